"""Repeated blocks: the layers of a model that are the same computation on other weights.

A transformer of 24 layers calls the same ops 24 times, with the same shapes, the same
annotations, from the same module structure; only the weights differ. A policy that
plans one layer can reuse the plan for the others, so its time does not grow with the
number of layers. `repeated_blocks` finds them in program order.

A *block* is a run of consecutive ops that share a *layer path*: the module path up to
and including its first numeric part (``gpt.blocks.3.attn.q_proj`` -> ``gpt.blocks.3``;
an op of an enclosing module right after the layer, such as the activation a
``Sequential`` applies between layers, is not part of it). Two blocks are instances of
one `BlockKind` when they have the same *signature*: for each op in order, its
name, its annotation bound to its shapes, its keyword arguments, its module path below
the layer path and its module class, its no-grad flag, and how each of its inputs is
wired (the output of an op of the block, at a position; a parameter or buffer, with its
name below the layer path; or something from outside the block, with its shape and
dtype). Position ``p`` of one instance then corresponds to position ``p`` of every other.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from nnscaler.ir import FullTensor, Op, TensorKind, tensors_in

__all__ = ["Block", "BlockKind", "layer_path", "repeated_blocks"]


def layer_path(op: Op) -> str:
    """The module path up to its first numeric part (``''`` when it has none):
    ``gpt.blocks.3.attn.q_proj`` -> ``gpt.blocks.3``."""
    parts = op.module_path.split(".") if op.module_path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


@attrs.frozen(eq=False)
class Block:
    """One instance: ``ops`` (in program order) of the layer at ``path``."""

    path: str
    ops: tuple[Op, ...]
    kind: int  # index into the BlockKind list


@attrs.frozen(eq=False)
class BlockKind:
    """Blocks with one signature, in program order; ``instances[0]`` is the template."""

    signature: tuple
    instances: tuple[Block, ...]

    @property
    def template(self) -> Block:
        return self.instances[0]


def _below(name: str, path: str) -> str:
    if name == path:
        return ""
    return name[len(path) + 1:] if name.startswith(path + ".") else name


def _signature(path: str, ops: Sequence[Op]) -> tuple:
    produced: dict[int, tuple[int, int]] = {}  # id(full) -> (op position, output position)
    sig = []
    for pos, op in enumerate(ops):
        wiring = []
        for x in op.input_tensors():
            full: FullTensor = x.full
            if id(full) in produced:
                wiring.append(("op", *produced[id(full)], x.indmap, x.valmap))
            elif full.kind in (TensorKind.PARAMETER, TensorKind.BUFFER) and full.version == 0:
                names = tuple(_below(n, path) for n in full.names)
                if not any(n.startswith(path + ".") for n in full.names):
                    wiring.append(("shared", full.tid))  # a weight from outside: the same one
                else:
                    wiring.append(("weight", names, full.shape, str(full.dtype), x.indmap))
            else:
                wiring.append(("outside", full.shape, str(full.dtype), full.requires_grad,
                               x.indmap, x.valmap))
        for k, y in enumerate(op.output_tensors()):
            produced[id(y.full)] = (pos, k)
        consts = tuple(repr(v) for v in op.inputs if not list(tensors_in(v)))
        sig.append((op.name, str(op.anno), repr(sorted(op.kwargs.items(), key=lambda kv: kv[0])),
                    _below(op.module_path, path), op.module_class, op.no_grad,
                    consts, tuple(wiring)))
    return tuple(sig)


def repeated_blocks(ops: Sequence[Op], *, min_count: int = 2) -> list[BlockKind]:
    """The kinds of blocks of ``ops`` (program order) that occur at least ``min_count``
    times, each with its instances in program order. Ops outside any repeated block are
    in none. Linear in the number of ops."""
    runs: list[tuple[str, list[Op]]] = []
    for op in ops:
        path = layer_path(op)
        if path and runs and runs[-1][0] == path:
            runs[-1][1].append(op)
        elif path:
            runs.append((path, [op]))
        else:
            runs.append(("", [op]))
    by_sig: dict[tuple, list[tuple[str, list[Op]]]] = {}
    for path, run in runs:
        if path:
            by_sig.setdefault(_signature(path, run), []).append((path, run))
    kinds: list[BlockKind] = []
    for sig, found in by_sig.items():
        if len(found) < min_count:
            continue
        k = len(kinds)
        kinds.append(BlockKind(signature=sig, instances=tuple(
            Block(path=path, ops=tuple(run), kind=k) for path, run in found)))
    return kinds
