"""Which policy the Trainer runs when ``pas_policy`` is left at its default: nnScaler's
``autodist`` when the plugin is installed, and the built-in ``dp`` when it is not and a plan
of one device leaves autodist a single choice (docs/trainer.md). `nnscaler.trainer.args`
re-exports these names.
"""

from __future__ import annotations

import logging
from typing import Any

from nnscaler.config import AUTO, ComputeConfig

_log = logging.getLogger("nnscaler.cli.trainer")

#: The Trainer's default policy, as in nnScaler: from the ``nnscaler-policy-autodist``
#: plugin.
DEFAULT_POLICY = "autodist"
#: What the default becomes when that plugin is not installed and a plan has one device.
ONE_DEVICE_POLICY = "dp"


def default_policy(compute_config: ComputeConfig, registered: Any = None) -> str:
    """The policy the Trainer runs when ``pas_policy`` is left at `DEFAULT_POLICY`.

    ``autodist`` when it is registered (``registered``: the policy names, default the
    plugin manager's). Without it (``pip install nnscaler`` alone), a plan of one device
    (``plan_ngpus == 1``) with no ``pas_config`` and a given ZeRO stage (not ``'auto'``)
    leaves autodist a single choice, every op
    whole on the unit's one device with the units running data parallel, which is what
    the built-in `ONE_DEVICE_POLICY` (``'dp'``) plans: the Trainer runs that, and
    says so. Any other config keeps ``autodist``, whose lookup then names the package to
    install.
    """
    if compute_config.plan_ngpus != 1 or compute_config.pas_config \
            or compute_config.zero_stage == AUTO:
        return DEFAULT_POLICY
    if registered is None:
        from nnscaler.plugins import get_plugin_manager

        registered = get_plugin_manager().policies
    if DEFAULT_POLICY in registered:
        return DEFAULT_POLICY
    _log.info("pas_policy: %r is not installed (pip install nnscaler-policy-autodist); with "
              "plan_ngpus=1 it has one choice, the one of the built-in policy %r: using %r",
              DEFAULT_POLICY, ONE_DEVICE_POLICY, ONE_DEVICE_POLICY)
    return ONE_DEVICE_POLICY
