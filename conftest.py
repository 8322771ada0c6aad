"""Shared by ``tests/`` and ``plugins/*/tests``: what the parent pytest process imports
before the multi-process tests fork.

`nnscaler.testing.run_distributed` forks its ranks, so a module the parent has imported
costs nothing in them, while one it has not is imported again in every rank of every
launch. Two imports are paid that way unless the parent makes them first:

- ``torch._dynamo`` (with sympy and ``torch.fx``): ``torch.optim.Optimizer`` imports it when
  its first parameter group is added, so every rank that builds an optimizer pays it
  (about 1.5 s of CPU);
- ``transformers.modeling_utils`` and ``transformers.generation`` (with
  ``torch.distributed.tensor``): building any Hugging Face model imports them (about 2 s).

When the collected tests launch processes, or use ``transformers``, the parent imports
those once, after collection.
"""

from __future__ import annotations

import importlib
import sys

#: imported by ``torch.optim.Optimizer.add_param_group`` the first time it runs
_OPTIMIZER = ("torch._dynamo",)
#: imported by every Hugging Face model class, whatever its architecture
_HF_SHARED = ("transformers.modeling_utils", "transformers.generation")


def pytest_collection_finish(session) -> None:
    wanted = []
    if "nnscaler.testing" in sys.modules:  # a collected module launches processes
        wanted += _OPTIMIZER
    if "transformers" in sys.modules:  # a collected module uses Hugging Face models
        wanted += _HF_SHARED
    for name in wanted:
        importlib.import_module(name)
