"""Values and sizes read from tensor data: recorded by the tracer, refused by parallelize
(each model line named, with the fix) unless accepted with ``allow_data_dependent``."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

from nnscaler import ComputeConfig, parallelize, register_op
from nnscaler.trace import DataDependentError, MetaTraceError, trace

pytestmark = [
    pytest.mark.filterwarnings("ignore::nnscaler.trace.OpaqueOpWarning"),
    # graph.pkl cannot pickle a function whose module attribute is its register_op wrapper
    pytest.mark.filterwarnings("ignore:the traced graph could not be saved"),
]

TWO = ComputeConfig(plan_ngpus=2, runtime_ngpus=2)
HERE = os.path.basename(__file__)


class Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:  # BRANCH
            return (h * 2).sum()
        return h.sum()


class ItemToOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        scale = h.abs().max().item()  # ITEM
        return (h / scale).sum()


class NonZero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        idx = torch.nonzero(h > 0)  # NONZERO
        return h.sum() + idx.shape[0]


class MaskIndex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h[h > 0].sum()  # MASK


class WhereOneArg(nn.Module):
    """The shape of Hugging Face Mixtral's eager expert loop: tokens picked by torch.where."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        rows, _ = torch.where(h > 0)  # WHERE
        return h[rows].sum()


def line_of(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if f"# {marker}" in text)


CASES = [
    (Branch, "BRANCH", "torch.Tensor.__bool__ gave the value"),
    (ItemToOutput, "ITEM", "torch.Tensor.item gave the value"),
    (NonZero, "NONZERO", "torch.nonzero gave the size"),
    (MaskIndex, "MASK", "torch.Tensor.__getitem__ gave the size"),
    (WhereOneArg, "WHERE", "torch.where gave the size"),
]


@pytest.mark.parametrize(("cls", "marker", "what"), CASES, ids=[c[1] for c in CASES])
def test_parallelize_names_each_data_dependent_line(tmp_path, cls, marker, what):
    torch.manual_seed(0)
    x = torch.randn(4, 4)
    with pytest.raises(DataDependentError) as info:
        parallelize(cls(), {"x": x}, "tp", TWO, gen_savedir=tmp_path, load_module=False)
    message = str(info.value)
    assert f"{HERE}:{line_of(marker)}" in message, message
    assert what in message
    for fix in ("tensor ops", "nnscaler.register_op", "allow_data_dependent=True"):
        assert fix in message
    assert not any(tmp_path.rglob("gencode*.py"))  # refused before anything is written
    # accepted explicitly: the traced values are kept
    parallelize(cls(), {"x": x}, "tp", ComputeConfig(plan_ngpus=2, runtime_ngpus=2,
                allow_data_dependent=True), gen_savedir=tmp_path, load_module=False)
    assert any(tmp_path.rglob("gencode1.py"))


def test_the_tracer_records_sizes_that_depend_on_data():
    torch.manual_seed(0)
    for cls, marker, _ in CASES[2:]:
        graph = trace(cls(), {"x": torch.randn(4, 4)})
        assert len(graph.data_dependent) == 1, graph.data_dependent
        assert graph.data_dependent[0].endswith(f"{HERE}:{line_of(marker)}")
        assert " -> size [" in graph.data_dependent[0] or " -> size ([" in graph.data_dependent[0]


class NotDataDependent(nn.Module):
    """Sizes from shapes, masks used arithmetically, torch.where with three arguments,
    integer-tensor indexing and repeat_interleave by a number are all fine."""

    def forward(self, x):
        mask = (x > 0).to(x.dtype)
        idx = torch.arange(x.shape[0] - 1, -1, -1)
        y = torch.where(x > 0, x, -x) * mask
        return (y[idx].repeat_interleave(2, dim=0)).sum() + x.size(0)


def test_shape_and_mask_arithmetic_is_not_data_dependent():
    graph = trace(NotDataDependent(), {"x": torch.randn(3, 4)})
    assert graph.data_dependent == []


def test_loops_report_a_line_once_with_a_count(tmp_path):
    class Loop(nn.Module):
        def forward(self, x):
            total = x.sum()
            for row in x:
                if row.sum() > 100:  # LOOP
                    total = total + 1
            return total

    with pytest.raises(DataDependentError, match=rf"{HERE}:{line_of('LOOP')} 'if row.sum\(\) > "
                       r"100:  # LOOP': torch.Tensor.__bool__ gave the value False \(3 times\)"):
        parallelize(Loop(), {"x": torch.randn(3, 4)}, "dp", TWO, gen_savedir=tmp_path,
                    load_module=False)


@register_op("n^ d^ -> n^ d^", name="tests.clip_rows_if_large", code_impl_pattern="source")
def clip_rows_if_large(h: torch.Tensor) -> torch.Tensor:
    """The branch on data inside a registered op: it runs whole, on the real values (the
    maximum is over every row, so no dim may be split: the promise check catches 'n d^')."""
    if h.abs().max() > 1.0:
        return h / h.abs().max()
    return h


class BranchInsideOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return clip_rows_if_large(self.fc(x)).sum()


def test_a_registered_op_may_read_data(tmp_path):
    x = torch.randn(4, 4)
    graph = trace(BranchInsideOp(), {"x": x})
    assert graph.data_dependent == [] and len(graph.ops) == 3
    parallelize(BranchInsideOp(), {"x": x}, "data", TWO, gen_savedir=tmp_path,
                load_module=False)


def test_meta_data_reads_stay_meta_errors():
    with pytest.raises(MetaTraceError) as info:
        trace(Branch(), {"x": torch.randn(4, 4)}, strategy="meta")
    assert isinstance(info.value, DataDependentError)


transformers = pytest.importorskip("transformers")


def test_mixtral_eager_expert_loop_traces_as_one_moe_op():
    """Mixtral's eager experts pick tokens with torch.where and skip experts on a tensor
    comparison: traced as written, a batch routed differently would need another program.
    The tracer recognises the expert stack and records it as one moe_experts op instead,
    so nothing is read from data (before, this model was refused here)."""
    from nnscaler.ops.builtin.moe import MOE_EXPERTS
    from nnscaler.trace import trace

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config = transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, batch):
            return self.model(**batch).loss

    ids = torch.randint(0, 64, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(WithLoss(), {"batch": {"input_ids": ids, "labels": ids}})
    assert graph.data_dependent == []
    (op,) = [op for op in graph.ops if op.name == MOE_EXPERTS]
    assert op.module_path == "model.model.layers.0.mlp.experts"
    assert "self.experts(" in op.code
    # the module is itself again after tracing
    assert "forward" not in vars(model.model.layers[0].mlp.experts)
