"""Code generation: a planned graph to one readable torch program per runtime rank.

- `build_program`: the analysis shared by all ranks (tensor layouts, adapters in one
  global order, parameter holders, process groups); raises for plans it cannot emit;
- `generate_rank` / `generate`: the source of ``gencode{rank}.py``;
- `emit_files`: every rank's file and ``fullmodel.pt``, written atomically;
- `load_generated_class`: import a rank's ``GenModel``.

A graph cut into pipeline stages becomes one method per stage and the rank's schedule
(`nnscaler.codegen.pipeline` finds the stages, `nnscaler.codegen.stage_writer`
writes them; ``docs/pipeline.md``). `nnscaler.codegen.emit` writes a rank's file from
the parts of `nnscaler.codegen.file_parts`.

See ``docs/codegen.md`` for what the generated code looks like and
``docs/internals/parallel-runtime.md`` for the contract it implements.
"""

from nnscaler.codegen.emit import describe_plan, generate, generate_rank
from nnscaler.codegen.errors import CodegenError
from nnscaler.codegen.files import (
    FULLMODEL,
    emit_files,
    full_state,
    gencode_name,
    load_generated_class,
    load_generated_module,
)
from nnscaler.codegen.layouts import Placed, to_layout
from nnscaler.codegen.program import AdapterSpec, Program, build_program

__all__ = [
    "FULLMODEL",
    "AdapterSpec",
    "CodegenError",
    "Placed",
    "Program",
    "build_program",
    "describe_plan",
    "emit_files",
    "full_state",
    "gencode_name",
    "generate",
    "generate_rank",
    "load_generated_class",
    "load_generated_module",
    "to_layout",
]
