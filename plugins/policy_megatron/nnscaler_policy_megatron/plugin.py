"""The nnscaler plugin: registers the ``megatron`` policy.

Found through the entry point ``megatron`` in the group ``nnscaler``, so that after
``pip install ./plugins/policy_megatron`` ``parallelize(..., "megatron", ...)`` finds it
with no other step.
"""

from __future__ import annotations

from typing import Any

from nnscaler.extend import hookimpl
from nnscaler_policy_megatron.policy import megatron


@hookimpl
def nnscaler_register_policies(registry: Any) -> None:
    registry.register("megatron", megatron)
