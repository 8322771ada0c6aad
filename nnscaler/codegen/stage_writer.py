"""Write the pipeline's parts of a rank's file: one method ``_stage_{s}`` per stage the
rank runs (what it receives, its ops, what it sends on), ``_check_inputs``, the rank's
schedule as module-level ``SCHEDULE`` text and the ``pipeline`` class attribute
(`nnscaler.runtime.pipeline.Pipeline`) the executor reads. ``docs/pipeline.md``
shows such a file.

The ops of a stage are written by the rank's writer (`nnscaler.codegen.emit`), as
for an unpipelined forward; this module writes what is around them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nnscaler.codegen.errors import CodegenError
from nnscaler.codegen.literals import literal
from nnscaler.codegen.pipeline import PipelinePlan, StagePlan
from nnscaler.ir import FullTensor

if TYPE_CHECKING:
    from nnscaler.codegen.emit import _Rank

__all__ = ["StageWriter"]

_INDENT = "    "


class StageWriter:
    """The pipeline's parts of the file of ``rank`` (the writer of one rank's file)."""

    def __init__(self, rank: _Rank, pipe: PipelinePlan) -> None:
        self.rank = rank
        self.p = rank.p
        self.pipe = pipe
        self.device = rank.device
        self.group = rank.group  # the device set (of the scale unit) this rank is in

    def mine(self) -> list[StagePlan]:
        """The stages this rank runs."""
        return [st for st in self.pipe.stages if st.group == self.group]

    def where(self) -> str:
        """The rank's stages, for the file's header."""
        mine = [str(st.index) for st in self.mine()]
        return (f": pipeline stage{'s' if len(mine) > 1 else ''} {', '.join(mine)} of "
                f"{len(self.pipe.stages)}")

    def methods(self) -> list[str]:
        """``_stage_{s}`` of every stage the rank runs, then ``_check_inputs``."""
        methods: list[str] = []
        for stage in self.mine():
            methods += ["", *self.stage_method(stage)] if methods else \
                self.stage_method(stage)
        checks = self.rank.input_checks()
        if checks:
            methods += ["", f"def _check_inputs(self, {self.p.args[0][0]}):",
                        f'{_INDENT}"""A micro-batch against the traced sample (train_step and '
                        f'infer_step check each before the schedule runs)."""',
                        *(_INDENT + line for line in checks)]
        return methods

    @staticmethod
    def runtime_names(methods: list[str]) -> list[str]:
        """What the file imports from ``nnscaler.runtime`` for its pipeline."""
        names = ["Piece", "Pipeline", "parse_schedule"]
        if any("anchored(" in line for line in methods):
            names.append("anchored")
        return names

    # -- a stage ------------------------------------------------------------------------
    def held_pieces(self, fulls: list[FullTensor], stage: int) -> list[FullTensor]:
        """The boundary tensors of which this device holds a piece on ``stage``."""
        return [f for f in fulls if self.device in self.pipe.view(f, stage).devices]

    def piece(self, full: FullTensor, stage: int) -> str:
        box = self.pipe.view(full, stage).box(self.device)
        shape = tuple(b - a for a, b in box)
        grad = (full.requires_grad and not self.p.inference_only
                and (full.dtype.is_floating_point or full.dtype.is_complex))
        fields = [repr(self.p.variables[full]), repr(shape), literal(full.dtype)]
        if grad:
            fields.append("grad=True")
        return f"Piece({', '.join(fields)})"

    def stage_method(self, stage: StagePlan) -> list[str]:
        rank, pipe = self.rank, self.pipe
        rank.used = set()
        rank.anchors = []
        received = self.held_pieces(stage.inputs, stage.index)
        sent = self.held_pieces(stage.outputs, stage.index)
        ops = rank.steps_lines(stage.steps)
        tail: list[str] = []
        last = stage.index == pipe.last
        if last:
            for spec in self.p.output_adapters:
                tail += rank.adapter_lines(spec)
            tail.append(f"return {rank.returned()}")
        else:
            tail.append(f"return {self.stage_returned(stage, sent)}")
        body = rank.prologue() + self.clones(stage, received) + ops + tail
        args = [self.p.args[0][0], *(self.p.variables[f] for f in received)]
        body = rank.with_recompute(body, args)
        nstages = len(pipe.stages)
        what = []
        if received:
            what.append(f"receives {', '.join(self.p.variables[f] for f in received)} from "
                        f"stage {stage.index - 1}")
        if last:
            what.append("returns the module's outputs")
        else:
            shown = ", ".join(self.p.variables[f] for f in sent) or "nothing (on this device)"
            what.append(f"sends {shown} to stage {stage.index + 1}")
        doc = (f'"""Stage {stage.index} of {nstages}, on devices {list(stage.devices)} of the '
               f'scale unit: {"; ".join(what)}."""')
        return ([f"def _stage_{stage.index}(self, {', '.join(args)}):", _INDENT + doc]
                + [_INDENT + line for line in body])

    def clones(self, stage: StagePlan, received: list[FullTensor]) -> list[str]:
        """A received tensor that the stage changes in place is cloned first (it is a
        leaf of autograd on this rank)."""
        mine = set(received)
        written = []
        for step in stage.steps:
            op = step.instances.get(self.device)
            if op is None:
                continue
            for before, _ in op.mutations:
                if before.full in mine and before.full not in written:
                    written.append(before.full)
        return [f"{self.p.variables[f]} = {self.p.variables[f]}.clone()" for f in written]

    def stage_returned(self, stage: StagePlan, sent: list[FullTensor]) -> str:
        items = [self.p.variables[f] for f in sent]
        anchors = self.rank.anchors if not self.p.inference_only else []
        if anchors:
            k = next((i for i, f in enumerate(sent) if f.requires_grad), None)
            if k is None:
                raise CodegenError(
                    f"stage {stage.index} on device {self.device} only sends some tensors "
                    f"inside the stage ({', '.join(anchors)}) and sends no tensor that "
                    f"requires grad to the next stage, so the gradients of what it sent "
                    f"would never come back. Replicate the ops of the stage on all its "
                    f"devices, or let the stage end with a tensor that requires grad"
                )
            items[k] = f"anchored({items[k]}, anchors=({', '.join(anchors)},))"
        if len(items) == 1:
            return f"({items[0]},)"
        return f"({', '.join(items)})"

    # -- the class attribute and the schedule -------------------------------------------
    def pipeline_attr(self) -> list[str]:
        p, pipe, rank = self.p, self.pipe, self.rank
        if self.group is None:
            raise CodegenError("internal error: no pipeline")
        lane = pipe.lane_of(self.device)
        mine = self.mine()
        stage_ranks = tuple(rank.offset + pipe.groups[st.group][lane] for st in pipe.stages)
        last = pipe.stages[pipe.last]
        settings = pipe.settings

        def pieces(which: str) -> str:
            items = []
            for st in mine:
                fulls = self.held_pieces(getattr(st, which), st.index)
                if not fulls:
                    continue
                listed = ", ".join(self.piece(f, st.index) for f in fulls)
                items.append(f"{st.index}: ({listed},)")
            return "{" + ", ".join(items) + "}"

        fields = [
            f"scheduler={settings.scheduler!r}",
            f"nstages={pipe.nstages}",
            f"nvirtual={pipe.nvirtual}",
            f"nmicros={settings.nmicros}",
            f"stages={tuple(st.index for st in mine)!r}",
            f"stage_ranks={stage_ranks!r}",
            f"inputs={pieces('inputs')}",
            f"outputs={pieces('outputs')}",
            f"output_rank={rank.offset + last.devices[0]}",
            f"unit_ranks={p.unit_ranks(rank.unit)!r}",
            "schedule=SCHEDULE",
        ]
        lines = [f"{_INDENT}pipeline = Pipeline("]
        lines += [f"{_INDENT * 2}{f}," for f in fields]
        lines.append(f"{_INDENT})")
        return lines

    def schedule_lines(self) -> list[str]:
        from nnscaler.runtime.pipeline import schedule_lines

        pipe = self.pipe
        if self.group is None:
            raise CodegenError("internal error: no pipeline")
        settings = pipe.settings
        mine = [str(st.index) for st in self.mine()]
        each = "stage" if pipe.nvirtual == 1 else "stages"
        head = [
            f"# {settings.scheduler} schedule: {pipe.nstages} pipeline devices x "
            f"{pipe.nvirtual} {each} each, {settings.nmicros} micro-batches. This rank runs "
            f"stage{'s' if len(mine) > 1 else ''} {', '.join(mine)};",
            "# its actions in order (the messages of one line are posted together: one "
            "batch_isend_irecv)",
            'SCHEDULE = parse_schedule("""',
        ]
        body = [_INDENT + line for line in schedule_lines(pipe.schedule[self.group])]
        return [*head, *body, '""")']
