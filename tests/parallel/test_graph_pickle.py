"""graph.pkl is read by a restricted unpickler: nnscaler's graphs (with tensors and
library output containers) round-trip, and a file that asks for anything else is refused
before any of it runs."""

from __future__ import annotations

import os
import pickle
import sys
import warnings

import pytest
import torch
from torch import nn

from nnscaler.parallel.graph_pickle import UnsafeGraphFileError, load_graph, save_graph
from nnscaler.trace import trace


def _traced(module: nn.Module, args: dict) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace(module, args)


class WithConstant(nn.Module):
    """Holds a tensor that is neither a parameter nor a buffer (captured as a constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.table = torch.arange(4.0)

    def forward(self, x):
        return (self.fc(x) + self.table)[..., 1:].sum(-1)


def test_graphs_round_trip(tmp_path):
    graph = _traced(WithConstant(), {"x": torch.randn(2, 4)})
    save_graph(graph, tmp_path / "graph.pkl")
    again = load_graph(tmp_path / "graph.pkl")
    assert str(again) == str(graph)


def test_a_library_output_container_round_trips(tmp_path):
    transformers = pytest.importorskip("transformers")

    class Bert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            config = transformers.BertConfig(hidden_size=16, intermediate_size=32,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             vocab_size=32, max_position_embeddings=16)
            self.bert = transformers.BertModel(config)

        def forward(self, input_ids):
            return self.bert(input_ids=input_ids)

    graph = _traced(Bert(), {"input_ids": torch.randint(0, 32, (2, 8))})
    save_graph(graph, tmp_path / "graph.pkl")
    assert str(load_graph(tmp_path / "graph.pkl")) == str(graph)


class Calls:
    """Unpickles as a call of ``func(*args)``."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _write(tmp_path, data: bytes):
    path = tmp_path / "graph.pkl"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("func,args", [
    (os.system, ("touch {marker}",)),
    (eval, ("open({marker!r}, 'w')",)),
    (torch.load, ("{marker}",)),            # a torch function: a value, never a call
    (torch.nn.Module, ()),                  # a torch class that is not graph data
])
def test_calls_the_file_chooses_are_refused(tmp_path, func, args):
    marker = str(tmp_path / "ran")
    payload = {"ops": [Calls(func, *[a.format(marker=marker) for a in args])]}
    path = _write(tmp_path, pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
    with pytest.raises(UnsafeGraphFileError, match="not loaded and nothing in it ran"):
        load_graph(path)
    assert not os.path.exists(marker)


def test_state_set_on_a_library_function_is_refused(tmp_path):
    """BUILD on a function found by name would rewrite torch's own functions."""
    body = pickle.dumps({"__defaults__": (1,)}, protocol=2)[2:-1]  # the dict, no PROTO/STOP
    data = b"\x80\x02ctorch.nn.functional\nrelu\n" + body + b"b."
    with pytest.raises(UnsafeGraphFileError, match="setting the state of"):
        load_graph(_write(tmp_path, data))
    assert "__defaults__" not in torch.nn.functional.relu.__dict__


def test_getattr_reaches_methods_only(tmp_path):
    fine = pickle.dumps(torch.Tensor.add, protocol=pickle.HIGHEST_PROTOCOL)
    assert load_graph(_write(tmp_path, fine)) is torch.Tensor.add
    data = (b"\x80\x02c__builtin__\ngetattr\nctorch\nfloat32\nX\x09\x00\x00\x00__class__"
            b"\x86R.")
    with pytest.raises(UnsafeGraphFileError, match="getattr"):
        load_graph(_write(tmp_path, data))


def test_modules_are_never_imported_by_the_reader(tmp_path):
    assert "this" not in sys.modules  # importing it prints the Zen of Python
    with pytest.raises(UnsafeGraphFileError, match="this.s .its module is not imported"):
        load_graph(_write(tmp_path, b"\x80\x02cthis\ns\n."))
    assert "this" not in sys.modules
