"""Batched multi-table pooled lookup: the op every module calls.

Layout (shared by every backend):
  * ``weights``: list of T 2-D tables ``[rows_t, D_t]`` (row-major, rows contiguous).
    The same tensor may appear several times (one entry per feature or per
    source rank); each appearance is its own "table entry".
  * ``values``: 1-D int32/int64 ids, entry-major then bag-major.
  * ``offsets``: ``T * B + 1`` offsets into ``values``; bag ``t * B + b`` is
    ``values[offsets[t*B + b] : offsets[t*B + b + 1]]``.
  * output ``[B, sum_t D_t]``: entry t fills columns ``sum_{u<t} D_u .. + D_t``;
    ``out[b, cols_t] = pool_t(weights[t][ids of bag t*B+b] * per_sample_weights)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from dtrec.config import POOLING_MODES


def _pooling_per_table(pooling: str | Sequence[str], num_tables: int) -> list[str]:
    modes = [pooling] * num_tables if isinstance(pooling, str) else list(pooling)
    if len(modes) != num_tables:
        raise ValueError(f"pooling has {len(modes)} entries for {num_tables} tables")
    for mode in modes:
        if mode not in POOLING_MODES:
            raise ValueError(f"pooling must be one of {POOLING_MODES}, got {mode!r}")
    return modes


def check_embedding_bag_args(
    weights: Sequence[Tensor],
    values: Tensor,
    offsets: Tensor,
    modes: list[str],
    per_sample_weights: Tensor | None,
) -> int:
    """Validate the op's inputs; returns the batch size B."""
    if values.dim() != 1 or values.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"values must be 1-D int32/int64, got {values.dtype} {tuple(values.shape)}")
    if offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"offsets must be 1-D int32/int64, got {offsets.dtype}")
    num_tables = len(weights)
    if num_tables == 0:
        if offsets.numel() > 1:
            raise ValueError("offsets given for zero tables")
        return 0
    if (offsets.numel() - 1) % num_tables != 0:
        raise ValueError(
            f"offsets has {offsets.numel()} entries; expected T * B + 1 with T={num_tables}"
        )
    for t, w in enumerate(weights):
        if w.dim() != 2:
            raise ValueError(f"table entry {t}: weight must be 2-D, got shape {tuple(w.shape)}")
        if w.device != values.device:
            raise ValueError(f"table entry {t}: weight on {w.device}, values on {values.device}")
    if per_sample_weights is not None:
        if per_sample_weights.shape != values.shape:
            raise ValueError(
                f"per_sample_weights has shape {tuple(per_sample_weights.shape)}, "
                f"values {tuple(values.shape)}"
            )
        if not per_sample_weights.is_floating_point():
            raise TypeError(
                f"per_sample_weights must be floating point, got {per_sample_weights.dtype}"
            )
        bad = [t for t, m in enumerate(modes) if m != "sum"]
        if bad:
            raise ValueError(
                f"per_sample_weights need sum pooling; table entries {bad} use mean pooling"
            )
    return (offsets.numel() - 1) // num_tables


def embedding_bag_torch(
    weights: Sequence[Tensor],
    values: Tensor,
    offsets: Tensor,
    modes: list[str],
    per_sample_weights: Tensor | None,
) -> Tensor:
    """Pure-torch backend: one ``F.embedding_bag`` call per distinct (table, pooling).

    Entries that share a tensor (a table read by several features, or by
    several source ranks after input-dist) are gathered into one call, so the
    dense backward writes each table's gradient once.
    """
    num_tables = len(weights)
    batch = check_embedding_bag_args(weights, values, offsets, modes, per_sample_weights)
    if num_tables == 0 or batch == 0:
        width = sum(w.shape[1] for w in weights)
        dtype = weights[0].dtype if num_tables else torch.float32
        return values.new_zeros((batch, width), dtype=dtype)
    offsets = offsets.to(values.dtype)
    groups: dict[tuple[int, str], list[int]] = {}
    for t, w in enumerate(weights):
        groups.setdefault((id(w), modes[t]), []).append(t)

    pooled: list[Tensor | None] = [None] * num_tables
    bag_starts = offsets[:-1].view(num_tables, batch)
    bag_ends = offsets[1:].view(num_tables, batch)
    for (_, mode), entries in groups.items():
        w = weights[entries[0]]
        idx = torch.tensor(entries, device=values.device)
        # Values of the group's entries, concatenated in entry order.
        starts, ends = bag_starts[idx, 0], bag_ends[idx, -1]
        if len(entries) == 1:
            lo, hi = int(starts[0]), int(ends[0])
            ids = values[lo:hi]
            psw = per_sample_weights[lo:hi] if per_sample_weights is not None else None
            local_offsets = offsets[entries[0] * batch : (entries[0] + 1) * batch + 1] - lo
        else:
            spans = [(int(s), int(e)) for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]
            ids = torch.cat([values[s:e] for s, e in spans])
            psw = (
                torch.cat([per_sample_weights[s:e] for s, e in spans])
                if per_sample_weights is not None
                else None
            )
            lengths = (bag_ends[idx] - bag_starts[idx]).reshape(-1)
            local_offsets = torch.zeros(
                lengths.numel() + 1, dtype=values.dtype, device=values.device
            )
            torch.cumsum(lengths, 0, out=local_offsets[1:])
        out = F.embedding_bag(
            ids,
            w,
            local_offsets,
            mode=mode,
            per_sample_weights=None if psw is None else psw.to(w.dtype),
            include_last_offset=True,
        )
        for k, t in enumerate(entries):
            pooled[t] = out[k * batch : (k + 1) * batch]
    return torch.cat(pooled, dim=1)  # type: ignore[arg-type]
