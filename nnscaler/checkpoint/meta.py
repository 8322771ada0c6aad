"""The metadata a ``ParallelModule``'s state dict carries: moved to
`nnscaler.runtime.state`, since the module's own ``state_dict`` hooks use it and the
runtime sits below the checkpoint package. Names read here are looked up there, so code
that imports them from this module keeps working.
"""

from __future__ import annotations

from typing import Any

from nnscaler.runtime import state


def __getattr__(name: str) -> Any:
    return getattr(state, name)
