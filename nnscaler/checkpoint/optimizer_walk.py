"""The two walks over optimizer state that merging and resharding share.

- `SavedRanks` reads the per-rank optimizer state dicts of one plan, rank by rank. Each
  tensor a rank's optimizer held is a parameter piece (handed to `SavedRanks.on_piece`)
  or a ZeRO shard (collected per reducer bucket; `SavedRanks.zero_buckets` then checks
  that every bucket is whole). Every original parameter must sit in the same parameter
  group on every rank. [`merge_state_dicts`][nnscaler.merge_state_dicts] takes the
  values (`nnscaler.checkpoint.merge`); [`load_resharded`][nnscaler.load_resharded]
  takes where they are, to read them later (`nnscaler.checkpoint.optimizer_reshard`).
- `local_groups` walks this rank's optimizer, parameter group by parameter group: the
  parallel module, the descriptor and the original parameters of each of its tensors,
  and the saved group its parameters come from (the saved groups one of its groups
  draws from must have the same hyperparameters).
  [`load_merged_state_dicts`][nnscaler.load_merged_state_dicts] (`nnscaler.checkpoint.reshard`)
  and `load_resharded` fill the optimizer with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from nnscaler.checkpoint.optimizer import OPTIMIZER_KEY, tensor_entries
from nnscaler.errors import CheckpointError
from nnscaler.runtime.state import describe_piece, descriptor_map, sub_shape

if TYPE_CHECKING:
    from nnscaler.checkpoint.merge import _ModuleView

#: a ZeRO reducer bucket: (module prefix, reducer ranks, bucket, number of shards)
BucketKey = tuple[Any, ...]
#: one saved shard of a bucket: (rank, optimizer state index, descriptor)
Shard = tuple[int, Any, Mapping[str, Any]]


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter group's hyperparameters: everything but its tensors and their names."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def guess_optimizer(state: Mapping[Any, Any]) -> str:
    keys: set[str] = set()
    for entry in state.values():
        if isinstance(entry, Mapping):
            keys.update(str(k) for k in entry)
    if {"exp_avg", "exp_avg_sq"} <= keys:
        return "the optimizer (Adam-like)"
    if "momentum_buffer" in keys:
        return "the optimizer (SGD-like)"
    return "the optimizer"


def rank_entries(views: list[_ModuleView], r: int, osd: Mapping[str, Any]
                  ) -> tuple[dict[Any, tuple[_ModuleView, Mapping[str, Any]]], str, bool]:
    """``optimizer index -> (module view, descriptor)`` for rank ``r``, the optimizer's
    name, and whether the state dict said which tensor is which (else: by order)."""
    if not isinstance(osd.get("param_groups"), list) or not isinstance(osd.get("state"), Mapping):
        raise CheckpointError(
            f"optimizer_state_dicts[{r}] is not an optimizer state dict (it needs 'state' and "
            f"'param_groups'); pass optimizer.state_dict() of every rank"
        )
    indices = [i for g in osd["param_groups"] for i in g["params"]]
    meta = osd.get(OPTIMIZER_KEY)
    opt = meta.get("optimizer") if isinstance(meta, Mapping) else None
    opt = opt or guess_optimizer(osd["state"])
    if isinstance(meta, Mapping) and "params" in meta:
        if len(meta["params"]) != len(indices):
            raise CheckpointError(
                f"optimizer_state_dicts[{r}]: its nnscaler metadata lists "
                f"{len(meta['params'])} tensors but its groups hold {len(indices)}; the state "
                f"dict was edited after it was saved"
            )
        out: dict[Any, tuple[_ModuleView, Mapping[str, Any]]] = {}
        for i, where in zip(indices, meta["params"]):
            if where is None:
                raise CheckpointError(
                    f"optimizer_state_dicts[{r}]: {opt} updates a tensor (entry {i}) that "
                    f"belongs to no parallel module; merging supports optimizers over "
                    f"parallel modules' parameters only (parallelize the whole model)"
                )
            view = views[where[0]]
            out[i] = (view, view.metas[r]["optimizer"][where[1]])
        return out, opt, True
    descs = [(view, d) for view in views for d in view.metas[r]["optimizer"]]
    if len(descs) != len(indices):
        raise CheckpointError(
            f"optimizer_state_dicts[{r}]: {opt} has {len(indices)} tensors but the parallel "
            f"modules of module_state_dicts[{r}] hand {len(descs)} to an optimizer. Merging "
            f"supports optimizers over the parallel modules' parameters_for_optimizer() only "
            f"(as nnscaler.build_optimizer makes them); pass each rank's module and optimizer "
            f"state dicts in the same order"
        )
    return dict(zip(indices, descs)), opt, False


def check_shapes(opt: str, r: int, i: Any, state: Mapping[Any, Any], expected: tuple[int, ...],
                  what: str) -> None:
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != expected:
            raise CheckpointError(
                f"optimizer_state_dicts[{r}] entry {i}: {opt}'s state {key!r} has shape "
                f"{tuple(value.shape)}, but the tensor it belongs to ({what}) has shape "
                f"{expected} in nnscaler.build_optimizer's order. Either the optimizer "
                f"orders its tensors differently (several parameter groups?): call "
                f"nnscaler.checkpoint.track_optimizer(optimizer) after building it so that "
                f"its state_dict() says which tensor is which, and pass each rank's module "
                f"and optimizer state dicts in the same order; or its state is not "
                f"elementwise, and cannot be merged"
            )


class SavedRanks:
    """The walk over every rank's saved optimizer state dict (see the module docstring).

    Subclasses say what a parameter piece's state becomes (`on_piece`), how errors name
    the call (``what``) and a rank's state dict (`rank_name`), and which words name what
    was given (``given``)."""

    what = "merge_state_dicts"
    given = "optimizer state dicts"
    #: put before the group error (the call's name, where the rank's name lacks it)
    lead = ""

    def __init__(self, views: list[_ModuleView]) -> None:
        self.views = views
        self.group_of: dict[str, int] = {}
        self.group_hyper: dict[int, dict[str, Any]] = {}
        #: bucket -> shard index -> the first saved copy of that shard
        self.zero: dict[BucketKey, dict[int, Shard]] = {}
        self.zero_view: dict[BucketKey, _ModuleView] = {}

    def rank_name(self, r: int) -> str:
        return f"optimizer_state_dicts[{r}]"

    def on_piece(self, view: _ModuleView, rec: Mapping[str, Any], r: int, i: Any,
                 state: Mapping[Any, Any], opt: str) -> None:
        """Take the state ``state`` (entry ``i`` of rank ``r``) of the parameter piece
        ``rec`` of ``view``."""
        raise NotImplementedError

    def assign_group(self, name: str, g: int, r: int) -> None:
        if self.group_of.setdefault(name, g) != g:
            raise CheckpointError(
                f"{self.lead}{self.rank_name(r)} puts {name} in parameter group {g}, another "
                f"rank in group {self.group_of[name]}: every rank must group the parameters "
                f"alike"
            )

    def add_rank(self, r: int, osd: Mapping[str, Any]) -> str:
        """Take rank ``r``'s entries: parameter pieces now (`on_piece`), ZeRO shards for
        `zero_buckets`; returns the optimizer's name as the state dict gives it."""
        entries, opt, exact = rank_entries(self.views, r, osd)
        for g, group in enumerate(osd["param_groups"]):
            self.group_hyper.setdefault(g, hyperparameters(group))
            for i in group["params"]:
                view, desc = entries[i]
                state = osd["state"].get(i)
                if desc["kind"] == "param":
                    rec = view.records[r][desc["attr"]]
                    self.assign_group(view.prefix + rec["name"], g, r)
                    if state:
                        if not exact:
                            check_shapes(opt, r, i, state, sub_shape(rec["index"]),
                                          describe_piece(rec["name"], rec["shape"],
                                                         rec["index"]))
                        self.on_piece(view, rec, r, i, state, opt)
                    continue
                for attr, _, _ in desc["members"]:
                    self.assign_group(view.prefix + view.records[r][attr]["name"], g, r)
                if not state:
                    continue
                if not exact:
                    check_shapes(opt, r, i, state, (int(desc["shard_numel"]),),
                                  f"a ZeRO shard of {len(desc['members'])} parameters")
                key = (view.prefix, tuple(desc["reducer"]), int(desc["bucket"]),
                       int(desc["nshards"]))
                self.zero.setdefault(key, {}).setdefault(int(desc["shard_index"]), (r, i, desc))
                self.zero_view[key] = view
        return opt

    def zero_buckets(self) -> Iterator[tuple[BucketKey, _ModuleView, dict[int, Shard]]]:
        """Every saved reducer bucket with its view and shards, checked whole."""
        for key, shards in self.zero.items():
            view, nshards = self.zero_view[key], key[3]
            missing = [s for s in range(nshards) if s not in shards]
            if missing:
                raise CheckpointError(
                    f"{self.what}: the ZeRO shards {missing} of {nshards} of a reducer bucket "
                    f"of ranks {list(key[1])} are in none of the {self.given} given; "
                    f"{view.hint}"
                )
            yield key, view, shards


#: one original parameter an optimizer tensor updates: (its name in the saved state, all
#: its names, its `AttrMeta` in the parallel module)
Member = tuple[str, list[str], Any]


def local_groups(
    optimizer: torch.optim.Optimizer,
    pms: list[tuple[str, Any]],
    *,
    what: str,
    opt: str,
    saved_group: Callable[[list[str]], tuple[str, int | None]],
    same_hyper: Callable[[int, int], bool],
) -> Iterator[tuple[dict[str, Any], list[tuple[Mapping[str, Any], list[Member]]], int | None]]:
    """For each parameter group of ``optimizer`` (over the parallel modules ``pms``,
    ``(prefix, module)``): the group, its tensors as ``(descriptor, members)``, and the
    saved group its parameters come from (None if none has saved state).

    ``saved_group(names)`` gives a parameter's name in the saved state and its saved group
    (or None); ``same_hyper(a, b)`` whether saved groups ``a`` and ``b`` have the same
    hyperparameters. ``what`` starts the errors, ``opt`` names the optimizer in them."""
    entries = tensor_entries([pm for _, pm in pms])
    descs = [descriptor_map(pm) for _, pm in pms]
    for g, group in enumerate(optimizer.param_groups):
        source: int | None = None
        tensors: list[tuple[Mapping[str, Any], list[Member]]] = []
        for p in group["params"]:
            entry = entries.get(id(p))
            if entry is None:
                raise CheckpointError(
                    f"{what}: {opt} (parameter group {g}) updates a tensor of shape "
                    f"{tuple(p.shape)} that belongs to no parallel module of the model; "
                    f"loading supports optimizers over the parallel modules' "
                    f"parameters_for_optimizer() (nnscaler.build_optimizer)"
                )
            prefix, pm = pms[entry[0]]
            desc = descs[entry[0]][id(p)]
            attrs_ = ([desc["attr"]] if desc["kind"] == "param"
                      else [m[0] for m in desc["members"]])
            members: list[Member] = []
            for attr in attrs_:
                meta = pm.fullmap[attr]
                names = [prefix + n for n in meta.names]
                name, saved = saved_group(names)
                if saved is not None:
                    if source is None:
                        source = saved
                    elif not same_hyper(source, saved):
                        raise CheckpointError(
                            f"{what}: {opt}'s parameter group {g} holds parameters of the "
                            f"saved groups {source} and {saved}, which have different "
                            f"hyperparameters; group the parameters as the checkpoint does"
                        )
                members.append((name, names, meta))
            tensors.append((desc, members))
        yield group, tensors, source
