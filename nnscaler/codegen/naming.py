"""Readable, collision-free Python names for generated code."""

from __future__ import annotations

import keyword
import re
from collections.abc import Iterable

_NOT_IDENT = re.compile(r"[^0-9a-zA-Z_]+")


def identifier(text: str, *, fallback: str = "v") -> str:
    """``text`` as a Python identifier: ``gpt.blocks.0.attn`` -> ``gpt_blocks_0_attn``,
    ``batch['input_ids']`` -> ``batch_input_ids``."""
    name = _NOT_IDENT.sub("_", text).strip("_")
    name = re.sub("_+", "_", name)
    if not name:
        name = fallback
    if name[0].isdigit():
        name = f"{fallback}_{name}"
    if keyword.iskeyword(name) or keyword.issoftkeyword(name):
        name += "_"
    return name


class Namer:
    """Hands out unique names; ``reserved`` names are never given out."""

    def __init__(self, reserved: Iterable[str] = ()) -> None:
        self._used: set[str] = set(reserved)

    def reserve(self, name: str) -> None:
        self._used.add(name)

    def taken(self, name: str) -> bool:
        return name in self._used

    def new(self, stem: str) -> str:
        """``stem`` itself if free, else ``stem_2``, ``stem_3``, ..."""
        name = stem
        k = 2
        while name in self._used:
            name = f"{stem}_{k}"
            k += 1
        self._used.add(name)
        return name
