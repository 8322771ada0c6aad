"""The part ops of the built-in splits, run as parts against the whole op in float64:
``class_parallel_cross_entropy`` (the class dim of cross_entropy split; the parts talk
through a PartGroup and each returns the whole loss) and ``row_parallel_embedding`` (the
table split by rows; the parts' outputs sum to the lookup)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnscaler.ops.builtin import loss, nn
from nnscaler.ops.builtin.loss import class_parallel_cross_entropy, cross_entropy_rules
from nnscaler.ops.builtin.nn import embedding_rules, row_parallel_embedding
from nnscaler.ops.partgroup import PartGroup, run_parts
from nnscaler.ops.registry import OpRegistry

RTOL, ATOL = 1e-10, 1e-12
SETTINGS = settings(max_examples=25, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def registry() -> OpRegistry:
    r = OpRegistry()
    for family in (nn, loss):
        family.register(r)
    return r


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _shares(n: int) -> list[float]:
    """How the runtime seeds the backward of a loss every part returns whole: each part
    seeds its share of one (uneven shares, exact in binary)."""
    return {2: [0.25, 0.75], 3: [0.25, 0.25, 0.5], 4: [0.125, 0.375, 0.25, 0.25]}[n]


# -- class_parallel_cross_entropy ------------------------------------------------------------


@st.composite
def ce_cases(draw: st.DrawFn) -> dict[str, Any]:
    num = draw(st.sampled_from([2, 3, 4]))
    c = num * draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["1d", "2d", "3d"]))
    n, d = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    shape = {"1d": (c,), "2d": (n, c), "3d": (n, c, d)}[kind]
    cls = 0 if kind == "1d" else 1
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([1.0, 40.0]))  # large logits: the maximum must be global
    x = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    probabilities = draw(st.booleans())
    ignore_index = draw(st.sampled_from([-100, 1]))
    if probabilities:
        target = torch.randn(shape, generator=g, dtype=torch.float64).softmax(cls)
    else:
        target = torch.randint(0, c, [s for i, s in enumerate(shape) if i != cls], generator=g)
        if draw(st.booleans()):  # some ignored entries, but never all of them
            mask = torch.rand(target.shape, generator=g) < 0.4
            target = target.masked_fill(mask, ignore_index)
            if (target == ignore_index).all():
                target = target.clone()
                target.view(-1)[0] = (ignore_index + 1) % c if ignore_index >= 0 else 0
    kwargs: dict[str, Any] = {
        "reduction": draw(st.sampled_from(["none", "sum", "mean"])),
        "label_smoothing": draw(st.sampled_from([0.0, 0.1])),
    }
    if not probabilities and ignore_index != -100:
        kwargs["ignore_index"] = ignore_index
    return {"num": num, "x": x, "target": target, "cls": cls, "kwargs": kwargs,
            "probabilities": probabilities}


def _parallel_ce(case: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                 list[torch.Tensor]]:
    """The parts' losses and their logits' (and probability targets') leaves."""
    num, x, target, cls = case["num"], case["x"], case["target"], case["cls"]
    c = x.size(cls)
    xs = [piece.detach().clone().requires_grad_(True) for piece in x.chunk(num, cls)]
    if case["probabilities"]:
        ts = [piece.detach().clone().requires_grad_(True) for piece in target.chunk(num, cls)]
    else:
        ts = [target] * num

    def part(p: int):
        def call(group: PartGroup) -> torch.Tensor:
            return class_parallel_cross_entropy(
                xs[p], ts[p], **case["kwargs"], class_start=p * (c // num), num_classes=c,
                group=group)

        return call

    return run_parts([part(p) for p in range(num)]), xs, ts


@SETTINGS
@given(ce_cases())
def test_class_parallel_cross_entropy_matches_the_whole_loss(case):
    _check_ce(case)


def _matrix() -> list[Any]:
    cases = []
    for i, (kind, probabilities, reduction, eps) in enumerate(
            (k, pr, r, e) for k in ("1d", "2d", "3d") for pr in (False, True)
            for r in ("none", "sum", "mean") for e in (0.0, 0.1)):
        cases.append(pytest.param(kind, probabilities, reduction, eps, (2, 3, 4)[i % 3],
                                  id=f"{kind}-{'prob' if probabilities else 'index'}-"
                                     f"{reduction}-{eps}"))
    return cases


@pytest.mark.parametrize(("kind", "probabilities", "reduction", "eps", "num"), _matrix())
def test_class_parallel_cross_entropy_every_kind(kind, probabilities, reduction, eps, num):
    """Every input rank x target kind x reduction x label smoothing (index targets with
    ignored entries where there are several samples)."""
    g = torch.Generator().manual_seed(11)
    c = 2 * num
    shape = {"1d": (c,), "2d": (5, c), "3d": (3, c, 2)}[kind]
    cls = 0 if kind == "1d" else 1
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3
    if probabilities:
        target = torch.randn(shape, generator=g, dtype=torch.float64).softmax(cls)
    else:
        target = torch.randint(0, c, [s for i, s in enumerate(shape) if i != cls], generator=g)
        if target.numel() > 1:
            target.view(-1)[1] = -100
    _check_ce({"num": num, "x": x, "target": target, "cls": cls,
               "probabilities": probabilities,
               "kwargs": {"reduction": reduction, "label_smoothing": eps}})


def _check_ce(case: dict[str, Any]) -> None:
    num, x, target, cls = case["num"], case["x"], case["target"], case["cls"]
    probabilities = case["probabilities"]
    whole = x.detach().clone().requires_grad_(True)
    whole_t = target.detach().clone().requires_grad_(True) if probabilities else target
    want = F.cross_entropy(whole, whole_t, **case["kwargs"])
    up = torch.randn(want.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    (want * up).sum().backward()

    losses, xs, ts = _parallel_ce(case)
    for p, got in enumerate(losses):  # every part returns the whole loss
        assert got.shape == want.shape
        _close(got.detach(), want.detach(), f"loss of part {p}")
    sum(share * (got * up).sum() for share, got in zip(_shares(num), losses, strict=True)).backward()
    _close(torch.cat([t.grad for t in xs], cls), whole.grad, "input gradient")
    if probabilities:
        _close(torch.cat([t.grad for t in ts], cls), whole_t.grad, "target gradient")


@pytest.mark.parametrize("num", [2, 4])
def test_class_parallel_cross_entropy_seeded_by_one_part(num):
    """The gradient seeded by part 0 alone (the others' losses times zero) is the whole
    gradient too: the parts' backward all goes through the exchange."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 8, 2, generator=g, dtype=torch.float64)
    target = torch.randint(0, 8, (5, 2), generator=g)
    target[0, 0] = -100
    case = {"num": num, "x": x, "target": target, "cls": 1, "probabilities": False,
            "kwargs": {"label_smoothing": 0.1}}
    whole = x.clone().requires_grad_(True)
    want = F.cross_entropy(whole, target, label_smoothing=0.1)
    want.backward()
    losses, xs, _ = _parallel_ce(case)
    (losses[0] * 1 + sum(lo * 0 for lo in losses[1:])).backward()
    _close(losses[-1].detach(), want.detach(), "loss")
    _close(torch.cat([t.grad for t in xs], 1), whole.grad, "input gradient")


def test_class_parallel_cross_entropy_unsplit_and_legacy_reduction():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, generator=g, dtype=torch.float64)
    t = torch.randint(0, 5, (3,), generator=g)
    # one part (group SINGLE): the op itself
    _close(class_parallel_cross_entropy(x, t), F.cross_entropy(x, t), "single")
    # size_average/reduce are torch's legacy spelling of the reduction
    _close(class_parallel_cross_entropy(x, t, size_average=False),
           F.cross_entropy(x, t, reduction="sum"), "legacy sum")
    with pytest.raises(ValueError, match="class weights are not supported"):
        class_parallel_cross_entropy(x, t, torch.ones(5, dtype=torch.float64))


def _bound(registry: OpRegistry, fn, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    opdef = registry.lookup(fn)
    call = opdef.bind(args, kwargs)
    shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in call.inputs]
    return opdef, call.anno.bind(shapes, call.kwargs)


def test_cross_entropy_rules(registry):
    x, t = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 6, (4,))
    opdef, bound = _bound(registry, F.cross_entropy, x, t)
    (rule,) = cross_entropy_rules(bound)
    assert rule.part_op == loss.CLASS_PARALLEL_CE
    assert rule.modifier({"reduction": "sum"}, 0, 1, 3, 2) == {
        "reduction": "sum", "class_start": 4, "num_classes": 6}
    space = bound.transform_space(2, rules=opdef.rules_for(bound))
    by_class = [tr for tr in space if tr.idx == 0 and tr.dim == 1]
    assert [tr.part_op for tr in by_class] == [loss.CLASS_PARALLEL_CE]
    # the part op is registered collective: it takes the group of the parts
    assert registry.get(loss.CLASS_PARALLEL_CE).collective
    # class weights: no rule, and the class dim cannot be split at all
    opdef, bound = _bound(registry, F.cross_entropy, x, t, weight=torch.ones(6, dtype=torch.float64))
    assert cross_entropy_rules(bound) == []
    assert opdef.rules_for(bound) == ()
    space = bound.transform_space(2, rules=opdef.rules_for(bound))
    assert not [tr for tr in space if tr.idx == 0 and tr.dim == 1]


# -- row_parallel_embedding -------------------------------------------------------------------


@st.composite
def embedding_cases(draw: st.DrawFn) -> dict[str, Any]:
    num = draw(st.sampled_from([2, 3, 4]))
    v = num * draw(st.integers(1, 3))
    e = draw(st.integers(1, 4))
    shape = draw(st.sampled_from([(), (5,), (3, 4), (2, 2, 3)]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(v, e, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, v, shape, generator=g)
    padding_idx = draw(st.sampled_from([None, "first", "last", "negative", "mid"]))
    padding_idx = {None: None, "first": 0, "last": v - 1, "negative": -1,
                   "mid": v // 2, }[padding_idx]
    if padding_idx is not None and tokens.numel() and draw(st.booleans()):
        tokens = tokens.clone()
        tokens.view(-1)[0] = padding_idx % v  # the padding token occurs
    return {"num": num, "weight": weight, "tokens": tokens, "padding_idx": padding_idx,
            "scale_grad_by_freq": draw(st.booleans())}


@SETTINGS
@given(embedding_cases())
def test_row_parallel_embedding_parts_sum_to_the_lookup(case):
    num, weight, tokens = case["num"], case["weight"], case["tokens"]
    kw = {"padding_idx": case["padding_idx"], "scale_grad_by_freq": case["scale_grad_by_freq"]}
    whole = weight.clone().requires_grad_(True)
    want = F.embedding(tokens, whole, **kw)
    up = torch.randn(want.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (want * up).sum().backward()

    v = weight.size(0)
    ws = [piece.clone().requires_grad_(True) for piece in weight.chunk(num, 0)]
    outs = [row_parallel_embedding(tokens, w, **kw, row_start=p * (v // num), num_rows=v)
            for p, w in enumerate(ws)]
    for out in outs:
        assert out.shape == want.shape
    _close(sum(o.detach() for o in outs), want.detach(), "lookup")
    # every token is found by exactly one part: the others give zeros
    found = torch.stack([(o != 0).any(-1) for o in outs]) if want.numel() else None
    if found is not None and (weight != 0).all():
        assert (found.sum(0) == 1).all()
    sum((o * up).sum() for o in outs).backward()
    _close(torch.cat([w.grad for w in ws], 0), whole.grad, "weight gradient")


@pytest.mark.parametrize("scale_grad_by_freq", [False, True])
def test_row_parallel_embedding_scalar_token(scale_grad_by_freq):
    weight = torch.randn(4, 3, dtype=torch.float64)
    for token in (0, 3):
        want = F.embedding(torch.tensor(token), weight, scale_grad_by_freq=scale_grad_by_freq)
        outs = [row_parallel_embedding(torch.tensor(token), w, row_start=2 * p, num_rows=4,
                                       scale_grad_by_freq=scale_grad_by_freq)
                for p, w in enumerate(weight.chunk(2, 0))]
        _close(outs[0] + outs[1], want, f"token {token}")


def test_row_parallel_embedding_padding_row_gets_no_gradient():
    weight = torch.randn(6, 3, dtype=torch.float64)
    tokens = torch.tensor([[5, 1, 5], [4, 5, 0]])
    for padding_idx in (5, -1):
        ws = [piece.clone().requires_grad_(True) for piece in weight.chunk(2, 0)]
        outs = [row_parallel_embedding(tokens, w, padding_idx=padding_idx,
                                       scale_grad_by_freq=True, row_start=3 * p, num_rows=6)
                for p, w in enumerate(ws)]
        sum(o.sum() for o in outs).backward()
        assert torch.equal(ws[1].grad[2], torch.zeros(3, dtype=torch.float64))
        # token 4 appears once; token 1 and 0 once: scale 1; the padding rows none
        assert torch.equal(ws[1].grad[1], torch.ones(3, dtype=torch.float64))
        assert torch.equal(ws[0].grad[2], torch.zeros(3, dtype=torch.float64))


def test_embedding_rules(registry):
    tokens, w = torch.tensor([[0, 3], [2, 1]]), torch.randn(6, 4, dtype=torch.float64)
    _, bound = _bound(registry, F.embedding, tokens, w)
    (rule,) = embedding_rules(bound)
    assert rule.part_op == nn.ROW_PARALLEL_EMBEDDING
    assert rule.modifier({}, 1, 0, 2, 1) == {"row_start": 3, "num_rows": 6}
    assert not registry.get(nn.ROW_PARALLEL_EMBEDDING).collective
    _, bound = _bound(registry, F.embedding, tokens, w, max_norm=1.0)
    assert embedding_rules(bound) == []
