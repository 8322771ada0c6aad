"""Padded and packed batches as flash-attn's packed (varlen) layout, at run time.

``segment_ids (batch, seqlen)`` says which tokens attend to which: token ``i`` of a row
sees token ``j`` of the same row when both carry the same id and that id is not 0, under
the causal and window rules counted in positions of the row. 0 marks padding: it sees
nothing and nothing sees it. One id per row and no padding is a plain batch; ids that
change along a row are packed sequences; 0s are padding.

flash-attn's varlen kernel wants each sequence as one contiguous run of rows, so the
tokens that are not padding are gathered, row after row, and every change of id (or of
row) starts a sequence. That is exact when:

- each id of a row forms one run once the padding is removed (otherwise two runs of one
  sequence could not see each other), and
- with a window, each sequence has no padding inside it (flash-attn counts the window in
  gathered tokens; the rule counts positions of the row).

`plan` reads the ids (this runs inside the op, at run time, never in a trace) and
raises a ``ValueError`` naming the row and the token when a batch breaks a rule.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class Plan:
    """Where the kept tokens are and how they form sequences."""

    index: torch.Tensor  # (kept,) positions in the flattened (batch * seqlen) tokens
    cu_seqlens: torch.Tensor  # (nseqs + 1,) int32 offsets into the kept tokens
    max_seqlen: int
    dense: bool  # every row is one sequence with no padding: a plain batch


def _where(flat: int, seqlen: int) -> str:
    return f"row {flat // seqlen}, token {flat % seqlen}"


def plan(fn: str, segment_ids: torch.Tensor, windowed: bool) -> Plan:
    """Gather plan of ``segment_ids (batch, seqlen)``; see the module docstring."""
    batch, seqlen = segment_ids.shape
    ids = segment_ids.to(torch.int64)
    if not ids.numel():
        empty = ids.new_zeros(0)
        return Plan(index=empty, cu_seqlens=empty.int(), max_seqlen=0, dense=False)
    # one read from the device for both questions (this runs once per layer)
    negative, dense = torch.stack(
        [(ids < 0).any(), ((ids == ids[:, :1]) & (ids != 0)).all()]
    ).tolist()
    if negative:
        bad = int((ids.reshape(-1) < 0).nonzero()[0, 0])
        raise ValueError(
            f"{fn}: segment_ids must be >= 0 (0 marks padding), got "
            f"{int(ids.reshape(-1)[bad])} at {_where(bad, seqlen)}. The Hugging Face attention "
            f"'nnscaler_fa' marks with -1 a token whose mask flash attention cannot express: "
            f"one that sees a later token under a causal mask (bidirectional image or prefix "
            f"blocks), or one that cu_seq_lens_q and cu_seq_lens_k put in different "
            f"sequences; run such a model with attn_implementation='sdpa'"
        )
    if dense:
        empty = ids.new_zeros(0)
        return Plan(index=empty, cu_seqlens=empty.int(), max_seqlen=seqlen, dense=True)
    flat = ids.reshape(-1)
    index = (flat != 0).nonzero().reshape(-1)
    kept = flat[index]
    row = index // seqlen
    starts = torch.ones_like(kept, dtype=torch.bool)
    starts[1:] = (kept[1:] != kept[:-1]) | (row[1:] != row[:-1])
    first = starts.nonzero().reshape(-1)
    total = torch.tensor([kept.numel()], dtype=first.dtype, device=first.device)
    cu = torch.cat([first, total])
    lengths = cu[1:] - cu[:-1]
    _check_one_run(fn, kept, row, first, index, seqlen)
    if windowed and first.numel():
        last = cu[1:] - 1
        span = index[last] - index[first] + 1
        holes = (span != lengths).nonzero().reshape(-1)
        if holes.numel():
            s = int(holes[0])
            raise ValueError(
                f"{fn}: the sequence from {_where(int(index[first[s]]), seqlen)} to "
                f"{_where(int(index[last[s]]), seqlen)} has padding inside it; with a "
                f"window_size, flash-attn counts the window in tokens without the padding "
                f"and the rule counts positions, so they would differ. Put the padding at "
                f"the ends of each row (left or right padding), or run without a window"
            )
    max_seqlen = int(lengths.max()) if lengths.numel() else 0
    return Plan(index=index, cu_seqlens=cu.to(torch.int32), max_seqlen=max_seqlen, dense=False)


def _check_one_run(
    fn: str,
    kept: torch.Tensor,
    row: torch.Tensor,
    first: torch.Tensor,
    index: torch.Tensor,
    seqlen: int,
) -> None:
    """Each (row, id) forms one run: as many runs as distinct (row, id) pairs."""
    if not first.numel():
        return
    span = int(kept.max()) + 1
    keys = row[first] * span + kept[first]
    if torch.unique(keys).numel() == keys.numel():
        return
    order = torch.argsort(keys, stable=True)
    repeated = (keys[order][1:] == keys[order][:-1]).nonzero().reshape(-1)
    again = int(order[int(repeated[0]) + 1])
    where = int(index[first[again]])
    raise ValueError(
        f"{fn}: segment id {int(kept[first[again]])} starts again at {_where(where, seqlen)} "
        f"after another sequence; each sequence's tokens must be one run of the row "
        f"(padding between them is allowed), since flash-attn's packed layout keeps a "
        f"sequence contiguous. Give the two parts different ids if they are different "
        f"sequences, or reorder the tokens"
    )
