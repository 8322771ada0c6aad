"""The intra-stage solvers: one option per op minimising time under the memory limit.

Both minimise ``sum(node time) + sum(edge cost)`` (see `model`) subject to
``sum(weights) + inflight * sum(activations) + max(transients) <= limit`` bytes per
device.

- `solve_ilp`: an integer program, solved exactly by CBC through pulp. One binary
  per option of each *representative* op (an op outside repeated blocks, or the template
  of one), so a model's depth adds nothing to it; an edge is linearised exactly with
  continuous pair variables whose rows and columns sum to the two ops' choices.
- `solve_dp`: a dynamic program in program order whose state is the choice of
  every op whose output is still to be read (the *frontier*): exact when the memory
  limit does not bind, in time linear in the number of ops for chain-like graphs
  (residual streams keep the frontier at two or three ops). A binding limit is priced
  in by a Lagrange multiplier (bisection), which finds a plan that fits but does not
  prove it the best; ``solver='auto'`` then uses the ILP.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs
import numpy as np

from nnscaler_policy_autodist.config import AutoDistError
from nnscaler_policy_autodist.model import Option, StageProblem

__all__ = ["NotChainLike", "Solution", "solve", "solve_dp", "solve_ilp"]

logger = logging.getLogger("nnscaler.autodist.spmd")  # under nnscaler's loggers

#: The most frontier states the DP keeps before it declares a graph not chain-like.
MAX_DP_STATES = 20000


class NotChainLike(Exception):
    """The DP's frontier grew beyond `MAX_DP_STATES`."""


@attrs.frozen
class Solution:
    """``choice[i]``: the option index of op ``i``; its time (seconds per micro-batch,
    per device), of which communication, and memory (bytes per device)."""

    choice: tuple[int, ...]
    time: float
    comm: float
    mem: float
    solver: str


def _mem(o: Option, inflight: int) -> float:
    return (o.mem - o.act) + o.act * inflight


def evaluate(problem: StageProblem, choice: Sequence[int], inflight: int = 1,
             solver: str = "") -> Solution:
    """The time, communication and memory of ``choice``."""
    time = comm = mem = peak = 0.0
    for i, opts in enumerate(problem.options):
        o = opts[choice[i]]
        time += o.time
        comm += o.comm
        mem += _mem(o, inflight)
        peak = max(peak, o.transient)
    mem += peak
    for e in problem.edges:
        c = e.cost[choice[e.src]][choice[e.dst]]
        time += c
        comm += c
    return Solution(tuple(choice), time, comm, mem, solver)


def min_memory(problem: StageProblem, inflight: int = 1) -> float:
    """The least memory per device any choice needs (each op at its leanest option)."""
    return sum(min(_mem(o, inflight) for o in opts) for opts in problem.options) + max(
        (min(o.transient for o in opts) for opts in problem.options), default=0.0)


def _tied(problem: StageProblem, choice_of_rep: dict[int, int]) -> tuple[int, ...]:
    return tuple(choice_of_rep[problem.rep[i]] for i in range(len(problem.ops)))


def solve_ilp(problem: StageProblem, limit: float | None, inflight: int = 1, *,
              verbose: bool = False, time_limit: float = 120.0) -> Solution:
    """The exact optimum over tied choices (see the module docstring)."""
    import warnings

    import pulp

    with warnings.catch_warnings():  # pulp 3.3 announces its 4.0 API; 2.x lacks it
        warnings.simplefilter("ignore", DeprecationWarning)
        return _solve_ilp(pulp, problem, limit, inflight, verbose, time_limit)


def _solve_ilp(pulp, problem: StageProblem, limit: float | None, inflight: int,  # noqa: ANN001
               verbose: bool, time_limit: float) -> Solution:
    reps = sorted(set(problem.rep))
    node = {r: [0.0] * len(problem.options[r]) for r in reps}
    memv = {r: [0.0] * len(problem.options[r]) for r in reps}
    for i, opts in enumerate(problem.options):
        r = problem.rep[i]
        for o_idx, o in enumerate(opts):
            node[r][o_idx] += o.time
            memv[r][o_idx] += _mem(o, inflight)
    pairs: dict[tuple[int, int], list[list[float]]] = {}
    for e in problem.edges:
        a, b = problem.rep[e.src], problem.rep[e.dst]
        if a == b:
            for o_idx in range(len(node[a])):
                node[a][o_idx] += e.cost[o_idx][o_idx]
            continue
        if (a, b) in pairs:
            acc = pairs[(a, b)]
            for x, row in enumerate(e.cost):
                for y, c in enumerate(row):
                    acc[x][y] += c
        else:
            pairs[(a, b)] = [list(row) for row in e.cost]
    prob = pulp.LpProblem("autodist_stage", pulp.LpMinimize)
    x = {r: [pulp.LpVariable(f"x_{r}_{o}", cat="Binary") for o in range(len(node[r]))]
         for r in reps}
    objective = []
    for r in reps:
        prob += pulp.lpSum(x[r]) == 1
        objective += [c * v for c, v in zip(node[r], x[r]) if c]
    for n, ((a, b), cost) in enumerate(pairs.items()):
        if not any(c for row in cost for c in row):
            continue
        if len(x[a]) == 1 or len(x[b]) == 1:  # one side fixed: the edge is a node cost
            if len(x[a]) == 1:
                objective += [cost[0][j] * x[b][j] for j in range(len(x[b])) if cost[0][j]]
            else:
                objective += [cost[i][0] * x[a][i] for i in range(len(x[a])) if cost[i][0]]
            continue
        y = [[pulp.LpVariable(f"y_{n}_{i}_{j}", lowBound=0) for j in range(len(x[b]))]
             for i in range(len(x[a]))]
        for i in range(len(x[a])):
            prob += pulp.lpSum(y[i]) == x[a][i]
        for j in range(len(x[b])):
            prob += pulp.lpSum(y[i][j] for i in range(len(x[a]))) == x[b][j]
        objective += [cost[i][j] * y[i][j] for i in range(len(x[a])) for j in range(len(x[b]))
                      if cost[i][j]]
    # in microseconds: CBC's tolerances are absolute (~1e-7), so costs in seconds (1e-6
    # for a small op) would tie options that differ by a microsecond
    prob += 1e6 * pulp.lpSum(objective)
    if limit is not None:
        # the largest transient of the chosen options: one variable above each op's
        peak = pulp.LpVariable("transient", lowBound=0)
        for r in reps:
            if any(o.transient for o in problem.options[r]):
                prob += peak >= pulp.lpSum(o.transient * v
                                           for o, v in zip(problem.options[r], x[r]))
        prob += pulp.lpSum(m * v for r in reps for m, v in zip(memv[r], x[r])) + peak <= limit
    status = prob.solve(pulp.PULP_CBC_CMD(msg=verbose, timeLimit=time_limit, gapRel=1e-9))
    if pulp.LpStatus[status] != "Optimal":
        raise AutoDistError(f"policy 'autodist': the integer program has no solution "
                            f"({pulp.LpStatus[status]})")
    chosen = {r: max(range(len(x[r])), key=lambda o, r=r: x[r][o].value() or 0.0) for r in reps}
    return evaluate(problem, _tied(problem, chosen), inflight, "ilp")


def solve_dp(problem: StageProblem, limit: float | None, inflight: int = 1, *,
             max_states: int = MAX_DP_STATES) -> Solution:
    """The DP over the frontier (see the module docstring); raises `NotChainLike`
    when the frontier outgrows ``max_states``."""
    best = _dp(problem, 0.0, inflight, max_states)
    if limit is None or best.mem <= limit:
        return attrs.evolve(best, solver="dp")
    lo, hi = 0.0, 1e-6
    fit = None
    for _ in range(40):  # find a multiplier that fits
        sol = _dp(problem, hi, inflight, max_states)
        if sol.mem <= limit:
            fit = sol
            break
        lo, hi = hi, hi * 4
    if fit is None:
        raise AutoDistError("policy 'autodist': no plan fits the memory limit")
    for _ in range(25):
        mid = (lo + hi) / 2
        sol = _dp(problem, mid, inflight, max_states)
        if sol.mem <= limit:
            fit, hi = sol, mid
        else:
            lo = mid
    return attrs.evolve(fit, solver="dp")


def _dp(problem: StageProblem, lam: float, inflight: int, max_states: int) -> Solution:
    n = len(problem.ops)
    into: list[list] = [[] for _ in range(n)]
    out_of: list[list] = [[] for _ in range(n)]
    last_use = list(range(n))
    for e in problem.edges:
        into[e.dst].append(e)
        out_of[e.src].append(e)
        last_use[e.src] = max(last_use[e.src], e.dst)
    # options of an op that cost every later reader the same are one state: the state
    # holds, per frontier op, the class of its option (the first option of the class)
    cls: list[list[int]] = []
    for i in range(n):
        first: dict[tuple, int] = {}
        cls.append([first.setdefault(tuple(tuple(e.cost[o]) for e in out_of[i]), o)
                    for o in range(len(problem.options[i]))])
    mats = {id(e): np.asarray(e.cost, dtype=float) for e in problem.edges}
    frontier: tuple[int, ...] = ()
    states: dict[tuple[int, ...], float] = {(): 0.0}
    back: list[dict[tuple[int, ...], tuple[tuple[int, ...], int]]] = []
    for j in range(n):
        opts = problem.options[j]
        where = {op: p for p, op in enumerate(frontier)}
        keep = [p for p, op in enumerate(frontier) if last_use[op] > j]
        live = last_use[j] > j
        new_front = tuple(frontier[p] for p in keep) + ((j,) if live else ())
        local = np.array([o.time + lam * _mem(o, inflight) for o in opts])
        ins = [(where[e.src], mats[id(e)]) for e in into[j]]
        classes: dict[int, list[int]] = {}
        for o in range(len(opts)):
            classes.setdefault(cls[j][o] if live else 0, []).append(o)
        groups: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for state in states:
            groups.setdefault(tuple(state[p] for p in keep), []).append(state)
        nxt: dict[tuple[int, ...], float] = {}
        ptr: dict[tuple[int, ...], tuple[tuple[int, ...], int]] = {}
        for base, members in groups.items():
            cost = np.array([states[m] for m in members])[:, None] + local[None, :]
            for p, mat in ins:
                cost += mat[[m[p] for m in members]]
            for c, cols in classes.items():
                sub = cost[:, cols]
                flat = int(np.argmin(sub))
                row, col = divmod(flat, len(cols))
                key = base + (c,) if live else base
                nxt[key] = float(sub[row, col])
                ptr[key] = (members[row], cols[col])
        if len(nxt) > max_states:
            raise NotChainLike(f"{len(nxt)} states at op {j}")
        back.append(ptr)
        states, frontier = nxt, new_front
    key = min(states, key=states.__getitem__)
    choice = [0] * n
    for j in range(n - 1, -1, -1):
        prev, o = back[j][key]
        choice[j] = o
        key = prev
    return evaluate(problem, choice, inflight, "dp")


def solve(problem: StageProblem, limit: float | None, solver: str, inflight: int = 1, *,
          verbose: bool = False) -> Solution:
    """Solve with ``solver`` ('auto', 'ilp', 'dp'); raise when nothing fits ``limit``."""
    need = min_memory(problem, inflight)
    if limit is not None and need > limit:
        raise NoPlanFits(need, limit)
    tied = len(set(problem.rep)) < len(problem.rep)
    if solver == "dp" or (solver == "auto" and not tied):
        try:
            sol = solve_dp(problem, limit if solver == "dp" else None, inflight)
            if solver == "dp" or limit is None or sol.mem <= limit:
                return sol
        except NotChainLike as e:
            if solver == "dp":
                raise AutoDistError(
                    f"policy 'autodist': solver='dp' needs a chain-like graph, but the "
                    f"frontier of live tensors grew too large ({e}). Use solver='ilp' or "
                    f"'auto'") from None
            logger.info("autodist: the graph is not chain-like (%s); using the ILP", e)
    return solve_ilp(problem, limit, inflight, verbose=verbose)


class NoPlanFits(AutoDistError):
    """No choice of options fits the memory limit."""

    def __init__(self, need: float, limit: float) -> None:
        self.need = need
        self.limit = limit
        super().__init__(
            f"policy 'autodist': no plan fits the memory limit of {limit / 1024**3:.3f} GB "
            f"per device: the smallest memory any plan of this stage needs is "
            f"{need / 1024**3:.3f} GB ({need:.0f} bytes). Raise pas_config['mem_constraint'] "
            f"to at least {need / 1024**3:.3f}, use more devices per scale unit (plan_ngpus), "
            f"ZeRO (use_zero=True), recompute_modules, or more pipeline stages")

    def __reduce__(self) -> tuple:  # rebuilt on the other ranks of parallelize
        return (type(self), (self.need, self.limit))
