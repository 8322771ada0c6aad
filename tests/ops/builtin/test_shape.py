"""Shape ops: how view/reshape relate dims, size arguments per part, lists of tensors."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from nnscaler.anno import Split
from nnscaler.ops.builtin import shape
from nnscaler.ops.registry import OpRegistry
from nnscaler.ops.verify import verify_op

T = torch.Tensor


@pytest.fixture(scope="module")
def registry() -> OpRegistry:
    r = OpRegistry()
    shape.register(r)
    return r


def anno(registry: OpRegistry, fn, *args, **kwargs) -> str:
    return str(registry.lookup(fn).annotation_for(args, kwargs))


def split_of(transforms, ident: str, num: int):
    return next(t for t in transforms if t.ident == ident and t.num == num)


def test_view_splitting_heads_rewrites_the_size_argument(registry):
    x = torch.randn(2, 4, 512)
    assert anno(registry, T.view, x, 2, 4, 8, 64) == "a b (c 64) -> a b c 64"
    op = registry.lookup(T.view)
    call = op.bind((x, 2, 4, 8, 64), {})
    transforms = verify_op(op, (x, 2, 4, 8, 64))
    heads = split_of(transforms, "c", 2)
    assert heads.outputs == (Split(2),)
    assert op.part_kwargs(heads, call.kwargs, 1) == {"size": (2, 4, 4, 64)}
    # -1 stays -1; a tuple stays a tuple
    call = op.bind((x, (2, -1, 8, 64)), {})
    batch = split_of(verify_op(op, (x, (2, -1, 8, 64))), "a", 2)
    assert op.part_kwargs(batch, call.kwargs, 0) == {"size": ((1, -1, 8, 64),)}


def test_view_merges_and_misaligned_views(registry):
    assert anno(registry, T.view, torch.randn(2, 4, 8, 64), 2, 4, -1) == "a b c d^ -> a b (c 64)"
    # (6, 4) -> (4, 6): only the common factor 2 of the leading dims lines up
    assert anno(registry, T.view, torch.randn(6, 4), 4, 6) == "(a 3) b^ -> (a 2) 6"
    # nothing lines up: all '^' and numbers
    assert anno(registry, T.view, torch.randn(3, 4), 2, 6) == "a^ b^ -> 2 6"
    # size-1 dims are the number 1 on either side
    assert anno(registry, T.reshape, torch.randn(2, 1, 6), 2, 6, 1) == "a 1 c -> a c 1"
    assert anno(registry, torch.reshape, torch.randn(4, 6), (-1,)) == "a b^ -> (a 6)"
    # GQA's repeat_kv: the kv heads stay splittable through the merge
    x = torch.randn(2, 2, 3, 4, 8)
    assert anno(registry, T.reshape, x, 2, 6, 4, 8) == "a b c^ d e -> a (b 3) d e"
    verify_op(registry.lookup(T.reshape), (x, 2, 6, 4, 8))


def test_view_dtype(registry):
    assert anno(registry, T.view, torch.randn(2, 4), torch.int32) == "a b -> a b"
    assert anno(registry, T.view, torch.randn(2, 4), torch.float16) == "a b^ -> a 8"
    verify_op(registry.lookup(T.view), (torch.randn(2, 4), torch.float16))


def test_torch_reshape_keeps_a_list_shape(registry):
    op = registry.lookup(torch.reshape)
    x = torch.randn(4, 6)
    call = op.bind((x, [2, 2, 6]), {})
    t = split_of(verify_op(op, (x, [2, 2, 6])), "a", 2)
    assert op.part_kwargs(t, call.kwargs, 0) == {"shape": [1, 2, 6]}


def test_flatten_unflatten(registry):
    x = torch.randn(2, 3, 4, 5)
    assert anno(registry, T.flatten, x, 2) == "a b c d^ -> a b (c 5)"
    assert anno(registry, torch.flatten, x, 1, -2) == "a b c^ d -> a (b 4) d"
    op = registry.lookup(T.unflatten)
    y = torch.randn(2, 12)
    assert anno(registry, T.unflatten, y, -1, (4, 3)) == "a (unflat 3) -> a unflat 3"
    call = op.bind((y, -1, (4, 3)), {})
    t = split_of(verify_op(op, (y, -1, (4, 3))), "unflat", 2)
    assert op.part_kwargs(t, call.kwargs, 1)["sizes"] == (2, 3)


def test_transposes_and_permutes(registry):
    x = torch.randn(2, 3, 4)
    assert anno(registry, T.transpose, x, 1, -1) == "a b c -> a c b"
    assert anno(registry, T.permute, x, 2, 0, 1) == "a b c -> c a b"
    assert anno(registry, torch.permute, x, (2, 0, 1)) == "a b c -> c a b"
    assert anno(registry, torch.movedim, x, 0, -1) == "a b c -> b c a"
    assert anno(registry, T.mT.__get__, x) == "a b c -> a c b"
    assert anno(registry, T.T.__get__, torch.randn(2, 3)) == "a b -> b a"


def test_split_chunk_unbind_outputs(registry):
    x = torch.randn(2, 3, 12)
    assert anno(registry, T.split, x, 4, dim=2) == "a b c^ -> a b 4, a b 4, a b 4"
    assert anno(registry, torch.split, x, [5, 7], -1) == "a b c^ -> a b 5, a b 7"
    assert anno(registry, T.chunk, x, 5, -1) == "a b c^ -> a b 3, a b 3, a b 3, a b 3"
    assert anno(registry, T.unbind, x, 1) == "a b^ c -> a c, a c, a c"
    transforms = verify_op(registry.lookup(T.split), (x, 4), {"dim": 2})
    assert {t.ident for t in transforms} == {"a", "b"}


def test_cat_binds_one_input_per_tensor(registry):
    x, y = torch.randn(2, 3), torch.randn(2, 5)
    op = registry.lookup(torch.cat)
    assert op is registry.lookup(torch.concat) is registry.lookup(torch.concatenate)
    call = op.bind(([x, y],), {"dim": -1})
    assert len(call.inputs) == 2 and call.inputs[0] is x and call.inputs[1] is y
    assert call.kwargs == {"dim": -1}
    assert str(call.anno) == "a c^, a d^ -> a 8"
    assert torch.equal(call.run(), torch.cat([x, y], -1))
    assert torch.equal(op.call((x, y), {"dim": 1}), torch.cat([x, y], 1))
    assert {t.ident for t in verify_op(op, ([x, y],), {"dim": 1})} == {"a"}
    # keyword and tuple spellings
    assert str(op.bind((), {"tensors": (x, y), "dim": 1}).anno) == "a c^, a d^ -> a 8"
    # the legacy empty tensor (a fresh KV cache) is taken whole
    assert anno(registry, torch.cat, [torch.tensor([]), x], dim=0) == "?, d^ b -> 2 b"


def test_stack_and_vstack(registry):
    x = torch.randn(2, 3)
    assert anno(registry, torch.stack, [x, x, x], dim=-1) == "a b, a b, a b -> a b 3"
    assert anno(registry, torch.vstack, [torch.randn(3), x]) == "b, d^ b -> 3 b"
    verify_op(registry.lookup(torch.stack), ([x, x],), {"dim": 1})


def test_expand_makes_expanded_dims_numbers(registry):
    op = registry.lookup(T.expand)
    x = torch.randn(1, 8, 1)
    assert anno(registry, T.expand, x, 2, -1, 5) == "1 b 1 -> 2 b 5"
    assert anno(registry, T.expand, x, 3, 1, 8, 1) == "a b c -> 3 a b c"  # nothing expanded
    call = op.bind((torch.randn(2, 1, 4), 2, 3, 4), {})
    t = split_of(verify_op(op, (torch.randn(2, 1, 4), 2, 3, 4)), "c", 2)
    assert op.part_kwargs(t, call.kwargs, 0) == {"sizes": (2, 3, 2)}
    # expand_as: the target tensor carries the expanded dim, so it may be split
    assert anno(registry, T.expand_as, torch.randn(1, 4), torch.randn(3, 4)) == "1 b, a b -> a b"


def test_repeat_and_repeat_interleave(registry):
    x = torch.randn(2, 4)
    assert anno(registry, T.repeat, x, 1, 3) == "a b^ -> a 12"
    assert anno(registry, T.repeat_interleave, x, 3, dim=1) == "a rep, ? -> a (rep 3)"
    assert anno(registry, T.repeat_interleave, x, 2) == "a b^, ? -> (a b^ 2)"
    op = registry.lookup(torch.repeat_interleave)
    kw = {"dim": -1, "output_size": 12}
    call = op.bind((x, 3), kw)
    t = split_of(verify_op(op, (x, 3), kw), "rep", 2)
    assert op.part_kwargs(t, call.kwargs, 0)["output_size"] == 6
    other = split_of(verify_op(op, (x, 3), kw), "a", 2)
    assert op.part_kwargs(other, call.kwargs, 0)["output_size"] == 12
    reps = torch.tensor([1, 0, 2, 1])
    assert anno(registry, T.repeat_interleave, x, reps, dim=1) == "a rep^, ? -> a 4"


def test_squeeze_freezes_the_dims_it_looks_at(registry):
    x = torch.randn(4, 1, 6)
    # a part of size 1 would be squeezed too: every dim squeeze looks at is '^'
    assert anno(registry, T.squeeze, x) == "a^ 1 c^ -> a^ c^"
    assert anno(registry, T.squeeze, x, -2) == "a 1 c -> a c"
    assert anno(registry, T.squeeze, x, 0) == "a^ b c -> a^ b c"
    assert anno(registry, torch.squeeze, x, (0, 1)) == "a^ 1 c -> a^ c"
    assert anno(registry, T.unsqueeze, x, -1) == "a b c -> a b c 1"
    verify_op(registry.lookup(T.squeeze), (torch.randn(2, 1, 4), 0))


def test_narrow_roll_flip(registry):
    x = torch.randn(4, 6)
    assert anno(registry, torch.narrow, x, -1, 1, 3) == "a b^ -> a 3"
    assert anno(registry, T.roll, x, 1, 0) == "a^ b -> a^ b"
    assert anno(registry, T.roll, x, 1) == "a^ b^ -> a^ b^"  # rolls the flattened tensor
    assert anno(registry, T.flip, x, -1) == "a b^ -> a b^"
    assert anno(registry, torch.flip, x, (0, 1)) == "a^ b^ -> a^ b^"


def test_aliases_are_what_the_tracer_sees(registry):
    seen = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, 3, 4)
    with Record():
        x.view(6, 4)
        x.reshape(-1)
        x.transpose(0, 1)
        x.swapaxes(0, 1)
        _ = x.mT
        _ = x[0].T
        x.split(1, dim=-1)
        torch.split(x, 1)
        x.chunk(2)
        x.flatten()
        x.expand(2, 2, 3, 4)
        x.unsqueeze(0)
        x.repeat_interleave(2, dim=0)
        torch.cat([x, x])
        torch.concat([x, x])
        torch.stack([x, x])
        x.permute(2, 0, 1)
        x.squeeze()
    seen = [f for f in seen if f is not T.__getitem__]
    missing = [f for f in seen if registry.lookup(f) is None]
    assert not missing
    assert registry.lookup(T.T.__get__).name == "torch.Tensor.T"
    assert registry.lookup(T.swapaxes) is registry.lookup(torch.swapaxes)
