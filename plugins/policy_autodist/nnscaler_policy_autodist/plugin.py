"""The nnscaler plugin: registers the ``autodist`` policy.

Found through the entry point ``policy_autodist`` in the group ``nnscaler``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nnscaler.extend import hookimpl
from nnscaler_policy_autodist.policy import autodist

if TYPE_CHECKING:
    from nnscaler.extend import Registry


@hookimpl
def nnscaler_register_policies(registry: Registry) -> None:
    registry.register("autodist", autodist)
