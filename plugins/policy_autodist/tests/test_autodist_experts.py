"""autodist's expert axis (`nnscaler_policy_autodist.experts`): the expert split of every
`moe_experts` op is costed (its token exchanges and work under ``expert_imbalance``, its
memory, experts / degree), the mesh search takes the expert degree as one more axis with
valid bounds, and the plan splits the experts when they dominate memory, not for a tiny
dense-ish model. Multi-process parity of a chosen expert-parallel plan is at the end."""

from __future__ import annotations

import copy
import json
import os
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from nnscaler_policy_autodist import AutoDistError, plan_graph
from nnscaler_policy_autodist.comm import DEVICE_SPECS, CommModel
from nnscaler_policy_autodist.config import parse_config
from nnscaler_policy_autodist.experts import (
    ExpertAxis,
    Point,
    best_point,
    chosen_degree,
    expert_degrees,
    expert_split,
    search_axis,
)
from nnscaler_policy_autodist.model import CostModel
from nnscaler_policy_autodist.profile import ComputeProfiler
from nnscaler_policy_autodist.spmd import NoPlanFits
from torch import nn

from nnscaler.extend import is_moe
from nnscaler.graph import IRGraph, run_plan
from nnscaler.ops.builtin.moe import moe_experts
from nnscaler.testing import run_distributed
from nnscaler.trace import trace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOCAB, SEQ = 64, 8


class MoELM(nn.Module):
    """Embedding, ``layers`` blocks of a routed-experts layer (top-2) and a shared
    linear, a head: the experts hold nearly all the weights when ``experts`` is large."""

    def __init__(self, experts: int = 8, hidden: int = 16, ffn: int = 32, layers: int = 2,
                 top_k: int = 2, dense: int = 0):
        super().__init__()
        torch.manual_seed(0)
        self.top_k = top_k
        # a dense MLP of ``dense`` units before each MoE layer (what attention would cost)
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(hidden, dense), nn.GELU(),
                                                nn.Linear(dense, hidden))
                                  for _ in range(layers if dense else 0))
        self.embed = nn.Embedding(VOCAB, hidden)
        self.routers = nn.ModuleList(nn.Linear(hidden, experts, bias=False)
                                     for _ in range(layers))
        self.gate_up = nn.ParameterList(
            nn.Parameter(torch.randn(experts, 2 * ffn, hidden) / hidden**0.5)
            for _ in range(layers))
        self.down = nn.ParameterList(nn.Parameter(torch.randn(experts, hidden, ffn) / ffn**0.5)
                                     for _ in range(layers))
        self.head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = self.embed(batch["input_ids"])
        b, s, h = x.shape
        for i, (router, gate_up, down) in enumerate(zip(self.routers, self.gate_up, self.down)):
            if self.mlps:
                x = x + self.mlps[i](x)
            flat = x.reshape(b * s, h)
            weights, index = router(flat).softmax(-1).topk(self.top_k, dim=-1)
            routed = moe_experts(flat, index, weights / weights.sum(-1, keepdim=True),
                                 gate_up, down)
            x = x + routed.reshape(b, s, h)
        return F.cross_entropy(self.head(x).flatten(0, 1), batch["labels"].flatten())


def lm_batch(samples: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (samples, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def hf_mixtral(experts: int = 8, ffn: int = 64) -> nn.Module:
    import transformers

    class WithLoss(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, batch):
            return self.model(**batch).loss

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        hidden_size=16, intermediate_size=ffn, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=32,
        num_local_experts=experts, num_experts_per_tok=2, attn_implementation="eager")
    return WithLoss(transformers.MixtralForCausalLM(cfg))


def config(plan_ngpus, runtime, profile_dir, **pas):
    return SimpleNamespace(plan_ngpus=plan_ngpus, runtime_ngpus=runtime, use_end2end=True,
                           use_zero=False, pas_config={"profile_dir": profile_dir, **pas})


def traced(model: nn.Module, batch=None, strategy: str = "real") -> IRGraph:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return IRGraph.from_graph(trace(model, {"batch": batch or lm_batch()},
                                        strategy=strategy))


#: experts that dominate the weights and enough tokens (32768 of them, traced on the meta
#: device) that exchanging them beats gathering every token on every device
EP_MODEL = {"experts": 16, "hidden": 512, "ffn": 512}


def ep_graph() -> IRGraph:
    return traced(MoELM(**EP_MODEL), lm_batch(4096), strategy="meta")


def moe_ops(graph: IRGraph) -> list:
    return [op for op in graph.nodes() if is_moe(op)]


# -- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0.5, "2", True, -1.0])
def test_expert_imbalance_is_a_factor_of_at_least_one(bad):
    assert parse_config({}).expert_imbalance == 1.0
    assert parse_config({"expert_imbalance": 1.5}).expert_imbalance == 1.5
    with pytest.raises(AutoDistError, match="expert_imbalance.*>= 1.0"):
        parse_config({"expert_imbalance": bad})


# -- the cost of the expert split -----------------------------------------------------------


def _options(tmp_path, imbalance=1.0, k=2):
    graph = traced(MoELM())
    op = moe_ops(graph)[0]
    spec = DEVICE_SPECS["H100"]
    model = CostModel(profiler=ComputeProfiler(spec, tmp_path, measure=False),
                      comm=CommModel(spec), units=1, zero=False, expert_imbalance=imbalance)
    problem = model.build(graph.nodes(), k, {t.full for t in graph.output_tensors()})
    i = problem.ops.index(op)
    return op, model, {("replicate" if o.transform is None else (o.transform.idx, o.transform.dim)): o
                       for o in problem.options[i]}


def test_the_expert_split_holds_experts_over_degree_and_pays_its_exchanges(tmp_path):
    op, model, opts = _options(tmp_path)
    # tokens (one option, whichever of the three token inputs names it), experts (by
    # either stack), ffn (by either: the tracer holds gate_up_proj as its [E, 2, F, H] view)
    assert set(opts) == {"replicate", (0, 0), (3, 0), (4, 0), (3, 2), (4, 2)}
    assert expert_split(opts[(4, 0)].transform)
    ep = opts[(3, 0)]
    assert expert_split(ep.transform) and not expert_split(opts[(0, 0)].transform)
    gate_up, down = (op.input_tensors()[i].full for i in (3, 4))
    whole = sum(t.numel * 4 for t in (gate_up, down))
    # the weights held: parameter, gradient and Adam's two states, per byte of piece
    per_byte = model._weight_bytes(1.0)[0]
    assert ep.mem - ep.act == pytest.approx(per_byte * whole / 2)  # 8 experts over 2
    assert opts[(0, 0)].mem - opts[(0, 0)].act == pytest.approx(per_byte * whole)
    calls = model.profiler.collectives(op, ep.transform, 2)
    assert [c.kind for c in calls] == ["all_gather", "all_to_all", "all_to_all"]
    assert ep.comm >= model.part_comm(op, ep.transform, 2, True) > 0.0


def test_imbalance_slows_only_the_expert_split(tmp_path):
    _, model, even = _options(tmp_path, 1.0)
    op, skewed_model, skewed = _options(tmp_path, 2.0)
    for key in ("replicate", (0, 0), (4, 2)):
        assert skewed[key].time == pytest.approx(even[key].time)
    ep, ep2 = even[(3, 0)], skewed[(3, 0)]
    fw, bw = model.profiler.time(op, ep.transform, 2)
    assert ep2.compute - ep.compute == pytest.approx(fw + bw)  # twice the expert work
    a2a = skewed_model.part_comm(op, ep.transform, 2, True) - model.part_comm(
        op, ep.transform, 2, True)
    assert a2a > 0.0 and ep2.comm - ep.comm == pytest.approx(a2a)


# -- the expert axis ------------------------------------------------------------------------


def test_the_expert_degrees_of_a_unit(tmp_path):
    graph = traced(MoELM(experts=8))
    ops = moe_ops(graph)
    assert expert_degrees(ops, 8, [1, 2, 4, 8]) == [1, 8, 4, 2]  # 8/s for s = 1, 2, 4
    assert expert_degrees(ops, 16, [1]) == [1]  # 16 does not divide 8 experts
    assert expert_degrees([], 8, [1, 2]) == [1]
    axis = ExpertAxis(graph.nodes())
    spec = DEVICE_SPECS["H100"]
    model = CostModel(profiler=ComputeProfiler(spec, tmp_path, measure=False),
                      comm=CommModel(spec), units=1, zero=False)
    none, only = axis.restrict(model, 1), axis.restrict(model, 2)
    for op in ops:
        assert not any(expert_split(t) for t in none.transforms(op, 2))
        assert [expert_split(t) for t in only.transforms(op, 2)] == [True, True]
        assert len(model.transforms(op, 2)) == 6  # the model itself is unchanged
    other = next(op for op in graph.nodes() if not is_moe(op) and op.anno is not None)
    def names(ts):
        return [None if t is None else (t.idx, t.dim) for t in ts]

    assert names(only.transforms(other, 2)) == names(model.transforms(other, 2))


@st.composite
def axes(draw):
    """Expert degrees of a unit, each with a true best step (None: no plan fits, with
    the memory it needs), a bound at most that step and a memory floor at most that need."""
    degrees = draw(st.lists(st.sampled_from([1, 2, 4, 8, 16]), min_size=1, max_size=5,
                            unique=True))
    truth = {}
    for e in degrees:
        step = draw(st.one_of(st.none(), st.floats(1e-3, 10.0)))
        need = draw(st.floats(1.0, 10.0))
        truth[e] = (step, (step or 10.0) * draw(st.floats(0.0, 1.0)),
                    need * draw(st.floats(0.0, 1.0)), need)
    limit = draw(st.one_of(st.none(), st.floats(0.5, 12.0)))
    cap = draw(st.one_of(st.none(), st.floats(1e-3, 12.0)))
    return truth, limit, cap


@given(axes())
@settings(max_examples=200, deadline=None)
def test_pruning_the_expert_axis_never_drops_the_best_plan(case):
    truth, limit, cap = case

    def search(e, above):
        step, _, _, need = truth[e]
        if step is None or (limit is not None and need > limit):
            raise NoPlanFits(need, limit or 0.0)
        if above is not None and step > above:  # a search may stop above its cap
            return None
        return (SimpleNamespace(step_time=step), None, None)

    points = search_axis(list(truth), lambda e: truth[e][1], lambda e: truth[e][2], limit,
                         cap, search)
    assert sorted(p.e for p in points) == sorted(truth)
    fits = {e: s for e, (s, _, _, need) in truth.items()
            if s is not None and (limit is None or need <= limit)}
    beats = {e: s for e, s in fits.items() if cap is None or s <= cap}
    best = best_point(points)
    if beats:
        want = min(beats, key=lambda e: (beats[e], e))
        assert best is not None and best.plan[0].step_time == beats[want]
    else:
        assert best is None
    for p in points:
        assert isinstance(p, Point)
        if p.floor:  # skipped by its memory floor: it could not have fitted
            assert limit is not None and truth[p.e][3] > limit


def tight_limit(model: nn.Module, profile_dir: str) -> float:
    """GB per device below what 2 H100s need to hold every expert in the fastest plan,
    above what they need with the experts split in two."""
    graph = traced(model)
    free = plan_graph(graph, config(2, 2, profile_dir, device_type="H100"))[1]
    experts = sum(op.input_tensors()[i].full.numel * 4 for op in moe_ops(graph) for i in (3, 4))
    return (free.solutions[0].mem - 0.3 * experts * 4) / 2**30  # 4 bytes of state a byte


def shards_experts(result) -> bool:
    """Whether every MoE op of the plan holds a part of its experts' weights per device
    (split by experts, or by their intermediate units)."""
    picked = [opts[c].transform for problem, sol in zip(result.problems, result.solutions)
              for op, opts, c in zip(problem.ops, problem.options, sol.choice) if is_moe(op)]
    return bool(picked) and all(t is not None and (expert_split(t) or t.dim == 2)
                                for t in picked)


def test_a_limit_the_replicated_experts_cannot_meet_shards_them(profile_dir):
    """Tiny Mixtral (8 experts), 2 devices: with a limit below what a device needs to
    hold every expert, the plan shards the experts (at this size by their intermediate
    units: 64 tokens are cheaper to gather than to exchange), within the limit."""
    model = hf_mixtral()
    limit = tight_limit(model, profile_dir)
    g, chosen = plan_graph(traced(model), config(2, 2, profile_dir, device_type="H100",
                                                 mem_constraint=limit))
    assert shards_experts(chosen) and chosen.solutions[0].mem <= limit * 2**30
    batch = lm_batch()
    torch.testing.assert_close(run_plan(g, model, {"batch": batch}), model(batch))


def test_many_tokens_and_experts_choose_expert_parallelism(profile_dir):
    """8 H100s, 32768 tokens, 16 experts holding nearly all the weights: on a unit of 8
    the experts are split by experts (exchanging a token's top-2 copies over 8 devices
    moves a quarter of what gathering every token does); given only runtime_ngpus and
    0.15 GB per device, the chosen mesh has expert degree 8."""
    fixed = plan_graph(ep_graph(), config(8, 8, profile_dir, device_type="H100"))[1]
    assert chosen_degree(fixed.problems, fixed.solutions) == 8
    auto = plan_graph(ep_graph(), config("auto", 8, profile_dir, device_type="H100",
                                         mem_constraint=0.15))[1]
    assert auto.meshes[0].experts == 8 and auto.meshes[0].memory <= 0.15 * 2**30
    assert chosen_degree(auto.problems, auto.solutions) == 8


def test_a_dense_ish_model_keeps_its_experts_whole(profile_dir):
    """Two small experts among dense weights: no expert split, whatever the mesh."""
    few = plan_graph(traced(MoELM(experts=2, hidden=16, ffn=4, dense=64)),
                     config("auto", 8, profile_dir, device_type="H100"))[1]
    assert few.meshes[0].experts == 1 and chosen_degree(few.problems, few.solutions) == 1


def test_the_plan_file_records_the_expert_degree_and_replays(profile_dir, tmp_path):
    path = tmp_path / "plan.json"
    pas = {"device_type": "H100", "mem_constraint": 0.15}
    _, first = plan_graph(ep_graph(), config("auto", 8, profile_dir, **pas,
                                             save_plan_path=str(path)))
    saved = json.loads(path.read_text())
    assert saved["mesh"]["experts"] == first.meshes[0].experts == 8
    _, again = plan_graph(ep_graph(), config("auto", 8, profile_dir, **pas,
                                             load_plan_path=str(path)))
    # the same splits (a replay indexes the op's every option, the search its degree's)
    assert splits(again) == splits(first)


class _Forgetful(dict):
    """A memo that never remembers: every lookup computes again."""

    def __contains__(self, key):
        return False

    def setdefault(self, key, default=None):
        return _Forgetful()


def _forget_shared_costs(monkeypatch):
    """Every cost model of the search computes everything itself (`model.SharedCosts`
    and the options kept per model and build)."""
    import nnscaler_policy_autodist.model as model

    init, model_init = model.SharedCosts.__init__, model.CostModel.__init__

    def forgetful(self):
        init(self)
        for name in list(vars(self)):
            setattr(self, name, _Forgetful())

    def own_options(self, **kwargs):
        model_init(self, **kwargs)
        self._options = _Forgetful()

    monkeypatch.setattr(model.SharedCosts, "__init__", forgetful)
    monkeypatch.setattr(model.CostModel, "__init__", own_options)


def _searched(result) -> tuple:
    return (result.plan_ngpus, result.pipeline, result.meshes, result.solutions,
            [[o.time for o in opts] for p in result.problems for opts in p.options])


def test_shared_costs_give_the_plan_and_estimate_each_model_computes_alone(profile_dir):
    """The search over unit sizes, stage counts and expert degrees with its costs shared
    (`model.SharedCosts`) chooses the plan, and estimates every mesh, exactly as when
    every model computes its costs itself (16 devices, 0.3 GB each: units of 4 and 8
    searched, stages of 2, 4 and 8 devices, expert degrees 1, 2, 4 and 8)."""
    pas = {"device_type": "H100", "pipeline_nstages": "auto", "pipeline_nmicros": 4,
           "mem_constraint": 0.3}
    graph = ep_graph()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's pytree specs warn when copied
        again = copy.deepcopy(graph)
    shared = plan_graph(graph, config("auto", 16, profile_dir, **pas))[1]
    with pytest.MonkeyPatch.context() as m:
        _forget_shared_costs(m)
        alone = plan_graph(again, config("auto", 16, profile_dir, **pas))[1]
    assert [m.unit for m in shared.meshes if m.searched] == [4, 8]
    assert _searched(shared) == _searched(alone)


def splits(result) -> list:
    return [None if (t := opts[c].transform) is None else (t.idx, t.dim)
            for problem, sol in zip(result.problems, result.solutions)
            for opts, c in zip(problem.options, sol.choice)]


# -- parity --------------------------------------------------------------------------------


def _train(rank, world, outdir, profile_dir, limit):
    from nnscaler import ComputeConfig, build_optimizer, parallelize

    cfg = ComputeConfig(2, world, use_end2end=True, pas_config={
        "profile_dir": profile_dir, "device_type": "H100", "mem_constraint": limit})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = parallelize(MoELM(), {"batch": lm_batch()}, "autodist", cfg, gen_savedir=outdir)
    ref = MoELM()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    popt = build_optimizer(pm, torch.optim.SGD, lr=0.1, momentum=0.9)
    for step in range(2):
        batch = lm_batch(seed=step + 1)
        want = ref(batch)
        want.backward()
        opt.step()
        opt.zero_grad()
        got = pm.train_step([batch])[0]
        popt.step()
        popt.zero_grad()
        torch.testing.assert_close(torch.as_tensor(got), want.detach(), rtol=1e-5, atol=1e-6)
    state = dict(ref.named_parameters())
    held = 0
    for attr, meta in pm.fullmap.items():
        if meta.kind != "parameter":
            continue
        torch.testing.assert_close(getattr(pm, attr).detach(),
                                   meta.take(state[meta.orig_name].detach()),
                                   rtol=1e-5, atol=1e-6)
        if meta.orig_name.startswith(("gate_up", "down")):
            held += getattr(pm, attr).numel()
    return {"expert_numel": held}


def test_the_chosen_plan_trains_as_one_process(tmp_path):
    """The plan autodist chooses under a limit the replicated experts cannot meet, run on
    2 processes, trains as one process: losses and weights after two steps; each rank
    holds half of the experts' weights."""
    profile = str(tmp_path / "profile")
    limit = tight_limit(MoELM(), profile)
    results = run_distributed(_train, 2, str(tmp_path / "gen"), profile, limit)
    whole = sum(p.numel() for n, p in MoELM().named_parameters() if p.dim() == 3)
    assert [r["expert_numel"] for r in results] == [whole // 2] * 2
