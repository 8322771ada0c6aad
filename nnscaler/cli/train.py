"""``nnscaler-train``: train (or compile) from a YAML configuration.

::

    nnscaler-train -f config.yaml                                   # run (under torchrun)
    nnscaler-train compile -f config.yaml                           # generate code only
    torchrun --nproc_per_node=2 -m nnscaler.cli.train -f config.yaml --optimizer.args.lr 1e-3

The YAML file holds the fields of `TrainerArgs`; it is
read with ``yaml.safe_load`` rules (no object is built from a tag; classes and functions
are named by import path). Each ``--dotted.key value`` after it overrides one entry
(``--compute_config.plan_ngpus 2``, ``--log.0.args.root_dir runs``); values are read as
YAML scalars (``1e-3`` is a number, ``true`` a bool, ``null`` None, ``[1, 2]`` a list).
An unknown key, a wrong type or a missing required field stops with an error that names
the dotted key, and the closest valid key for a typo. Import paths resolve from the
current directory too, as with ``python -m``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from nnscaler.trainer.cmdline import (
    ConfigLoader,
    apply_overrides,
    load_yaml,
    parse_args,
    parse_value,
)
from nnscaler.trainer.errors import ConfigError

__all__ = ["load_yaml", "main", "parse_args", "parse_value", "apply_overrides"]

# the reading of the configuration lives in nnscaler.trainer.cmdline; nnScaler's names
# stay importable from here
_Loader = ConfigLoader


def main(argv: Sequence[str] | None = None) -> int:
    """The ``nnscaler-train`` console script."""
    from nnscaler.trainer.trainer import Trainer
    from nnscaler.utils import set_default_logger_level

    args = list(sys.argv[1:] if argv is None else argv)
    set_default_logger_level("INFO")
    if "" not in sys.path and os.getcwd() not in sys.path:
        # as `python -m`: import paths in the config resolve from the current directory
        sys.path.insert(0, os.getcwd())
    try:
        train_args = parse_args(args)
    except ConfigError as e:
        print(f"nnscaler-train: configuration error: {e}", file=sys.stderr)
        return 2
    Trainer(train_args=train_args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
