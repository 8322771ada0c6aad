"""What [`verify`][nnscaler.verify] returns: the first [`Difference`][nnscaler.Difference],
the [`VerifyReport`][nnscaler.VerifyReport], and the default tolerances. (What it raises,
`VerifyError`, lives in `nnscaler.errors` with every other error.)
"""

from __future__ import annotations

import attrs

#: Default tolerances: the project's parity standard for float32.
RTOL, ATOL = 1e-5, 1e-6


@attrs.frozen(kw_only=True)
class Difference:
    """The first place where the parallel program and the reference disagree."""

    #: ``"output"`` (forward value), ``"gradient"`` (the gradient reaching a tensor) or
    #: ``"parameter gradient"`` (after the reducers; ``tensor`` is the parameter's name)
    kind: str
    #: the op's name (``torch.nn.functional.linear``, ``mylib.row_norm``)
    op: str
    #: ``file:line`` of the model code that called the op
    source: str
    #: that line's code
    code: str
    #: the module path of the call (``gpt.blocks.0.attn``)
    module_path: str
    #: the full tensor (``t12``) and which output of the op it is
    tensor: str
    output_index: int
    #: the ops that read the tensor (for a gradient: their backward sent it)
    consumers: tuple[str, ...]
    #: the reference side: ``f32[4, 8] on one device``
    reference_layout: str
    #: every rank's piece of the tensor, e.g. ``rank 0: [0:2, 0:8]``
    parallel_layout: tuple[str, ...]
    #: where the difference was seen: rank, micro-batch, the piece's ranges
    rank: int
    micro_batch: int
    piece: str
    max_abs_diff: float
    max_rel_diff: float
    #: the index (in the full tensor) of the largest difference, and both values there
    at: tuple[int, ...]
    expected: float
    got: float

    def __str__(self) -> str:
        if self.kind == "parameter gradient":
            what = f"the gradient of parameter {self.tensor}, read by"
        else:
            what = ("the output" if self.kind == "output"
                    else "the gradient reaching output") + f" {self.output_index} ({self.tensor})"
            what += " of"
        lines = [
            f"first difference: {what} op {self.op}",
            f"  at {self.source}  {self.code}".rstrip(),
            f"  in module {self.module_path or '<root>'}",
        ]
        if self.kind == "gradient" and self.consumers:
            lines.append("  sent back by the backward of: " + "; ".join(self.consumers))
        lines += [
            f"  reference: {self.reference_layout}",
            "  parallel:  " + "; ".join(self.parallel_layout),
            f"  rank {self.rank}, micro-batch {self.micro_batch}, piece {self.piece}: max abs "
            f"difference {self.max_abs_diff:.3e} (relative {self.max_rel_diff:.3e}) at "
            f"{list(self.at)}: expected {self.expected:.6g}, got {self.got:.6g}",
        ]
        return "\n".join(lines)


@attrs.frozen(kw_only=True)
class VerifyReport:
    """What [`verify`][nnscaler.verify] found: ``equal`` or the `first` difference."""

    equal: bool
    first: Difference | None
    policy: str
    plan_ngpus: int
    runtime_ngpus: int
    #: op outputs and gradients compared (pieces, over every rank and micro-batch)
    compared_outputs: int
    compared_gradients: int
    #: parameter pieces whose gradients were compared after the reducers (none with ZeRO)
    compared_parameter_gradients: int
    #: op outputs with a reference value that no generated variable held (not compared)
    unrecorded: tuple[str, ...]
    rtol: float
    atol: float
    seconds: float

    def __str__(self) -> str:
        head = (f"nnscaler verify: policy {self.policy!r}, plan_ngpus={self.plan_ngpus}, "
                f"runtime_ngpus={self.runtime_ngpus}: ")
        counts = (f"{self.compared_outputs} op output pieces, {self.compared_gradients} "
                  f"gradient pieces and {self.compared_parameter_gradients} parameter "
                  f"gradients compared (rtol={self.rtol:g}, atol={self.atol:g}, "
                  f"{self.seconds:.1f} s)")
        if self.unrecorded:
            counts += (f"; {len(self.unrecorded)} op outputs not held in a variable of the "
                       f"generated code were not compared: {', '.join(self.unrecorded[:8])}")
        if self.equal:
            return head + "equal within tolerance; " + counts
        return head + "DIFFERENT; " + counts + "\n" + str(self.first)
