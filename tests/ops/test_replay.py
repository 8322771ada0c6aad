"""``OpDef.replay``: the arguments that call an op's function the way the traced call was
written, for every kind of parameter; its routes are computed once per argument names."""

from __future__ import annotations

import inspect

from hypothesis import given
from hypothesis import strategies as st

from nnscaler.ops.registry import OpDef


def plain(a, b, c=1, d=2):  # noqa: ANN001, ANN201
    return a, b, c, d


def with_star(a, *rest, scale=1.0, **extra):  # noqa: ANN001, ANN002, ANN003, ANN201
    return a, rest, scale, extra


def positional_only(a, b, /, c=3, *, flag=False):  # noqa: ANN001, ANN201
    return a, b, c, flag


FUNCTIONS = [plain, with_star, positional_only]


@st.composite
def calls(draw):  # noqa: ANN001, ANN201
    fn = draw(st.sampled_from(FUNCTIONS))
    params = list(inspect.signature(fn).parameters.values())
    P = inspect.Parameter
    named = [p for p in params if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)]
    required = [p for p in named if p.default is P.empty]
    n = draw(st.integers(len(required), len([p for p in named if p.kind is not P.KEYWORD_ONLY])))
    inputs = [f"in{i}" for i in range(n)]
    optional = [p.name for p in named[n:]]
    chosen = draw(st.lists(st.sampled_from(optional), unique=True)) if optional else []
    kwargs = {name: f"kw_{name}" for name in chosen}
    if any(p.kind is P.VAR_POSITIONAL for p in params) and draw(st.booleans()):
        kwargs["rest"] = ("r0", "r1")
    if any(p.kind is P.VAR_KEYWORD for p in params) and draw(st.booleans()):
        kwargs["extra"] = {"e": "e0"}
    keywords = frozenset(draw(st.lists(st.sampled_from(chosen), unique=True))) if chosen \
        else frozenset()
    return fn, inputs, kwargs, keywords


@given(calls())
def test_replay_calls_the_function_with_every_argument_where_it_belongs(call):
    fn, inputs, kwargs, keywords = call
    opdef = OpDef(name=fn.__name__, fn=fn, annotation="*", signature=inspect.signature(fn))
    args, kw = opdef.replay(inputs, kwargs, keywords=keywords)
    bound = inspect.signature(fn).bind(*args, **kw).arguments
    expected = dict(zip(inspect.signature(fn).parameters, inputs))
    expected.update(kwargs)
    assert bound == expected
    assert not keywords - set(kw)  # passed by keyword where the call did
    # the cached route gives the same split for other values of the same names
    again = opdef.replay([x + "'" for x in inputs], kwargs, keywords=keywords)
    assert [a + "'" if a in inputs else a for a in args] == again[0]
