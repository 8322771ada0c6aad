"""The intermediate representation: tensors, sub-tensors, ops and the graph.

- `FullTensor`: one logical tensor (shape, dtype, kind, qualified names, version);
- `SubTensor`: the piece of a full tensor one op instance holds (index ranges per
  dim and a value part), what the layout layer reasons about;
- `Op`: one recorded call, with its bound annotation, where it came from, and
  whether it ran in place or without gradients;
- `Graph`: ops in program order with producers and consumers, the forward's
  inputs and outputs (nesting kept); ``str(graph)`` prints one op a line;
- `OpPlan`: where a policy placed an op instance (device, stage, recompute group);
- `leaf_values`: the values of a graph's parameters, buffers, constants and inputs;
- `run_graph`: executes a graph on one device (the reference for tests), with
  `run_ops`: the ops of a list in order on given values (freeing each value after
  its last reader with `release_schedule`); and
  `verify_graph`: checks that a graph reproduces its module's outputs and gradients.
"""

from nnscaler.ir.graph import Graph, GraphError
from nnscaler.ir.interpreter import (
    GraphMismatchError,
    InterpreterError,
    default_device,
    leaf_values,
    release_schedule,
    run_graph,
    run_ops,
    verify_graph,
)
from nnscaler.ir.op import Op, OpPlan, tensors_in
from nnscaler.ir.tensor import CURRENT_DEVICE, FullTensor, SubTensor, TensorKind, dtype_str

__all__ = [
    "CURRENT_DEVICE",
    "FullTensor",
    "Graph",
    "GraphError",
    "GraphMismatchError",
    "InterpreterError",
    "Op",
    "OpPlan",
    "SubTensor",
    "TensorKind",
    "default_device",
    "dtype_str",
    "leaf_values",
    "release_schedule",
    "run_graph",
    "run_ops",
    "tensors_in",
    "verify_graph",
]
