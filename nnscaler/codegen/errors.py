"""The error code generation raises.

The classes live in `nnscaler.errors`, the one home of every error class; this module
keeps the import path ``nnscaler.codegen.errors`` that the room's modules and users take.
"""

from __future__ import annotations

from nnscaler.errors import CodegenError

__all__ = ["CodegenError"]
