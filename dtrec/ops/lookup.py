"""Batched multi-table pooled lookup: layout, argument checks and the torch backend.

Layout (shared by every backend):
  * ``weights``: the U distinct 2-D tables ``[rows_u, D_u]`` (row-major).
  * E *entries*: entry e reads table ``entry_table[e]`` (a table read by two
    features, or by several source ranks after input-dist, has several entries)
    and pools with mean (``mean[e]``) or sum.
  * ``values``: 1-D int32/int64 ids, entry-major then bag-major; ``offsets``
    has ``E * B + 1`` entries; bag ``e * B + b`` is
    ``values[offsets[e*B + b] : offsets[e*B + b + 1]]``.
  * output ``[B, sum_e D_{entry_table[e]}]``; entry e fills the next ``D`` columns:
    ``out[b, cols_e] = pool_e(weights[entry_table[e]][ids] * per_sample_weights)``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dtrec.modules.config import POOLING_MODES


@dataclass(frozen=True)
class Lookup:
    """One batched lookup's inputs, in the layout above; what every backend takes."""

    weights: Sequence[Tensor]
    entry_table: Sequence[int]
    values: Tensor
    offsets: Tensor
    mean: Sequence[bool]
    per_sample_weights: Tensor | None = None

    @property
    def batch(self) -> int:
        """B: bags per entry."""
        return (self.offsets.numel() - 1) // len(self.entry_table)

    def columns(self) -> list[int]:
        """First output column of each entry, and the total width last."""
        return entry_columns(self.weights, self.entry_table)


def shared_storage(tensors: Sequence[Tensor]) -> tuple[Tensor, list[int]] | None:
    """(a flat view of the storage all tensors share, their element offsets in it), or None.

    Packed tables and optimizer states are views of one buffer; kernels that
    take (flat buffer, per-table offsets) then read and update them in place.
    """
    first = tensors[0]
    ptr = first.untyped_storage().data_ptr()
    if not all(t.is_contiguous() and t.untyped_storage().data_ptr() == ptr for t in tensors):
        return None
    numel = first.untyped_storage().nbytes() // first.element_size()
    flat = first.new_empty(0).set_(first.untyped_storage(), 0, (numel,))
    return flat, [t.storage_offset() for t in tensors]


def packed_views(
    shapes: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device, zero: bool = False
) -> list[Tensor]:
    """Contiguous views of one new flat buffer, one per shape, in order (see
    ``shared_storage``: what packed tables and optimizer states are made of)."""
    sizes = [math.prod(shape) for shape in shapes]
    flat = (torch.zeros if zero else torch.empty)(sum(sizes), dtype=dtype, device=device)
    starts = [0, *itertools.accumulate(sizes)]
    # slices, not torch.split: split's views may not be written in place under autograd
    return [
        flat[start : start + size].view(tuple(shape))
        for start, size, shape in zip(starts, sizes, shapes, strict=False)
    ]


def pooling_flags(pooling: str | Sequence[str], num_entries: int) -> list[bool]:
    """One mean flag per entry from one mode or one mode per entry."""
    modes = [pooling] * num_entries if isinstance(pooling, str) else list(pooling)
    if len(modes) != num_entries:
        raise ValueError(f"pooling has {len(modes)} entries for {num_entries} tables")
    for mode in modes:
        if mode not in POOLING_MODES:
            raise ValueError(f"pooling must be one of {POOLING_MODES}, got {mode!r}")
    return [m == "mean" for m in modes]


def check_embedding_bag_args(
    weights: Sequence[Tensor],
    entry_table: Sequence[int],
    values: Tensor,
    offsets: Tensor,
    mean: Sequence[bool],
    per_sample_weights: Tensor | None,
) -> int:
    """Validate the op's inputs; returns the batch size B."""
    if values.dim() != 1 or values.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"values must be 1-D int32/int64, got {values.dtype} {tuple(values.shape)}")
    if offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"offsets must be 1-D int32/int64, got {offsets.dtype}")
    if offsets.device != values.device:
        raise ValueError(f"offsets on {offsets.device}, values on {values.device}")
    num_entries = len(entry_table)
    if len(mean) != num_entries:
        raise ValueError(f"{len(mean)} pooling flags for {num_entries} entries")
    if num_entries == 0:
        return 0
    if offsets.numel() < 1 or (offsets.numel() - 1) % num_entries != 0:
        raise ValueError(
            f"offsets has {offsets.numel()} entries; expected T * B + 1 with T={num_entries}"
        )
    dtypes = {w.dtype for w in weights}
    if len(dtypes) > 1:
        raise TypeError(
            f"all tables of one lookup must share a dtype, got {sorted(map(str, dtypes))}"
        )
    for t, w in enumerate(weights):
        if w.dim() != 2:
            raise ValueError(f"table {t}: weight must be 2-D, got shape {tuple(w.shape)}")
        if w.device != values.device:
            raise ValueError(f"table {t}: weight on {w.device}, values on {values.device}")
        if not w.is_floating_point():
            raise TypeError(f"table {t}: weight must be floating point, got {w.dtype}")
    if any(not 0 <= t < len(weights) for t in entry_table):
        raise ValueError(
            f"entry_table {list(entry_table)} names a table outside 0..{len(weights) - 1}"
        )
    if per_sample_weights is not None:
        if per_sample_weights.device != values.device:
            raise ValueError(
                f"per_sample_weights on {per_sample_weights.device}, values on {values.device}"
            )
        if per_sample_weights.shape != values.shape:
            raise ValueError(
                f"per_sample_weights has shape {tuple(per_sample_weights.shape)}, "
                f"values {tuple(values.shape)}"
            )
        if not per_sample_weights.is_floating_point():
            raise TypeError(
                f"per_sample_weights must be floating point, got {per_sample_weights.dtype}"
            )
        bad = [e for e, m in enumerate(mean) if m]
        if bad:
            raise ValueError(
                f"per_sample_weights need sum pooling; table entries {bad} use mean pooling"
            )
    return (offsets.numel() - 1) // num_entries


def check_offsets(offsets: Tensor, num_values: int) -> None:
    """``offsets`` run from 0 to ``num_values`` without decreasing (one host read)."""
    if offsets.numel() == 0:
        return
    steps = torch.diff(offsets)
    ends = torch.stack([offsets[0], offsets[-1] - num_values])
    if not bool((ends != 0).any() | (steps < 0).any()):
        return
    if int(offsets[0]) != 0 or int(offsets[-1]) != num_values:
        raise ValueError(
            f"offsets must start at 0 and end at values.numel()={num_values}, got first "
            f"{int(offsets[0])} and last {int(offsets[-1])}"
        )
    bag = int(torch.nonzero(steps < 0)[0])
    raise ValueError(
        f"offsets must be non-decreasing, got offsets[{bag}]={int(offsets[bag])} > "
        f"offsets[{bag + 1}]={int(offsets[bag + 1])}"
    )


def check_bounds(
    weights: Sequence[Tensor], entry_table: Sequence[int], values: Tensor, offsets: Tensor
) -> None:
    """Every id of entry e lies in ``[0, rows of its table)``; one vectorized pass."""
    if values.numel() == 0:
        return
    num_entries = len(entry_table)
    batch = (offsets.numel() - 1) // num_entries
    rows = torch.tensor([weights[t].shape[0] for t in entry_table], device=values.device)
    ends = offsets[batch::batch] if batch else offsets.new_zeros(num_entries)
    counts = torch.diff(torch.cat([offsets[:1], ends]))
    bound = torch.repeat_interleave(rows, counts.long(), output_size=values.numel())
    bad = (values < 0) | (values >= bound)
    if bool(bad.any()):
        first = int(torch.nonzero(bad)[0])
        entry = int(torch.searchsorted(ends.long(), first, right=True))
        table = entry_table[entry]
        raise IndexError(
            f"table {table} (entry {entry}): id {int(values[first])} is outside "
            f"[0, {weights[table].shape[0]}) ({int(bad.sum())} bad ids)"
        )


def entry_columns(weights: Sequence[Tensor], entry_table: Sequence[int]) -> list[int]:
    """First output column of each entry (and the total width last)."""
    cols = [0]
    for t in entry_table:
        cols.append(cols[-1] + weights[t].shape[1])
    return cols


def _entries_by_table(
    entry_table: Sequence[int], mean: Sequence[bool]
) -> dict[tuple[int, bool], list[int]]:
    groups: dict[tuple[int, bool], list[int]] = {}
    for e, t in enumerate(entry_table):
        groups.setdefault((t, bool(mean[e])), []).append(e)
    return groups


def _gather_entries(
    entries: list[int], values: Tensor, offsets: Tensor, batch: int, psw: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The ids, bag offsets and weights of some entries, concatenated in entry order."""
    if len(entries) == 1:
        e = entries[0]
        lo, hi = int(offsets[e * batch]), int(offsets[(e + 1) * batch])
        local_offsets = offsets[e * batch : (e + 1) * batch + 1] - lo
        return values[lo:hi], local_offsets, None if psw is None else psw[lo:hi]
    spans = [(int(offsets[e * batch]), int(offsets[(e + 1) * batch])) for e in entries]
    ids = torch.cat([values[s:e] for s, e in spans])
    weights = None if psw is None else torch.cat([psw[s:e] for s, e in spans])
    lengths = torch.cat([torch.diff(offsets[e * batch : (e + 1) * batch + 1]) for e in entries])
    local_offsets = torch.zeros(lengths.numel() + 1, dtype=offsets.dtype, device=offsets.device)
    torch.cumsum(lengths, 0, out=local_offsets[1:])
    return ids, local_offsets, weights


def forward_torch(lookup: Lookup) -> Tensor:
    """One ``F.embedding_bag`` call per (table, pooling); no autograd of its own."""
    weights, entry_table, values, mean = (
        lookup.weights,
        lookup.entry_table,
        lookup.values,
        lookup.mean,
    )
    per_sample_weights, batch = lookup.per_sample_weights, lookup.batch
    offsets = lookup.offsets.to(values.dtype)
    pooled: list[Tensor | None] = [None] * len(entry_table)
    for (t, is_mean), entries in _entries_by_table(entry_table, mean).items():
        w = weights[t]
        if w.shape[1] == 0:  # an empty column shard
            for e in entries:
                pooled[e] = w.new_zeros(batch, 0)
            continue
        ids, local_offsets, psw = _gather_entries(
            entries, values, offsets, batch, per_sample_weights
        )
        out = F.embedding_bag(
            ids,
            w,
            local_offsets,
            mode="mean" if is_mean else "sum",
            per_sample_weights=None if psw is None else psw.to(w.dtype),
            include_last_offset=True,
        )
        for k, e in enumerate(entries):
            pooled[e] = out[k * batch : (k + 1) * batch]
    return torch.cat(pooled, dim=1)  # type: ignore[arg-type]


def occurrence_scale(
    offsets: Tensor, mean: Sequence[bool], per_sample_weights: Tensor | None, num_values: int
) -> tuple[Tensor, Tensor]:
    """Per id: its bag index (global, e*B+b) and the factor its row is pooled with."""
    lengths = torch.diff(offsets.long())
    bag = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=num_values
    )
    num_entries = len(mean)
    batch = lengths.numel() // num_entries
    mean_t = torch.tensor(list(mean), device=offsets.device).repeat_interleave(batch)
    inv_len = torch.where(mean_t, 1.0 / lengths.clamp(min=1).float(), torch.ones(()))
    scale = inv_len[bag]
    if per_sample_weights is not None:
        scale = scale * per_sample_weights.float()
    return bag, scale


def sum_rows_by_key(
    keys: Tensor,
    rows: Tensor,
    index: Tensor | None = None,
    scale: Tensor | None = None,
    key_bound: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Sorted unique keys, and per key the sum of ``rows[index[i]] * scale[i]`` over its i.

    ``index`` defaults to ``arange`` (row i belongs to key i), ``scale`` to 1. One stable
    sort groups the occurrences by key; each key's rows are then one bag that
    ``F.embedding_bag`` sums in order: deterministic, no ``[N, dim]`` gathered copy.
    ``key_bound`` (keys lie in ``[0, key_bound)``) lets keys below 2**31 sort as int32,
    about 2.5x faster on CPU.
    """
    small = key_bound is not None and key_bound < 2**31
    sorted_keys, perm = torch.sort(keys.int() if small else keys, stable=True)
    unique, counts = torch.unique_consecutive(sorted_keys, return_counts=True)
    sums = F.embedding_bag(
        perm if index is None else index.index_select(0, perm),
        rows,
        torch.cumsum(counts, 0) - counts,
        mode="sum",
        per_sample_weights=None if scale is None else scale.index_select(0, perm).to(rows.dtype),
    )
    return unique.long(), sums


def backward_rows_torch(lookup: Lookup, grad_out: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Row-sparse gradients: per table, (sorted unique row ids, summed fp32 grad rows).

    Vectorized over all tables of one embedding dim at once: each id occurrence
    gets the key ``row_base[table] + id``, and ``sum_rows_by_key`` sums each
    key's ``grad_out`` rows (times the occurrence's scale) in a fixed order:
    deterministic (on CUDA prefer the Triton backend).
    """
    weights, entry_table, values, offsets = (
        lookup.weights,
        lookup.entry_table,
        lookup.values,
        lookup.offsets,
    )
    num_entries, batch, device = len(entry_table), lookup.batch, values.device
    bag, scale = occurrence_scale(offsets, lookup.mean, lookup.per_sample_weights, values.numel())
    entry = bag // batch
    rows = [w.shape[0] for w in weights]
    row_base = torch.tensor([0, *rows[:-1]], device=device).cumsum(0)
    table_of_entry = torch.tensor(list(entry_table), device=device)
    dims = torch.tensor([w.shape[1] for w in weights], device=device)
    occ_table = table_of_entry.index_select(0, entry)
    occ_dim = dims.index_select(0, occ_table)
    grad_out = grad_out.float()
    entry_cols = lookup.columns()
    result: list[tuple[Tensor, Tensor] | None] = [None] * len(weights)
    empty_ids = torch.zeros(0, dtype=torch.long, device=device)
    for t, w in enumerate(weights):
        if w.shape[1] == 0:  # an empty column shard has no gradient
            result[t] = (empty_ids, grad_out.new_zeros(0, 0))
    for dim in sorted({w.shape[1] for w in weights} - {0}):
        # grad_out's column blocks of this dim's entries as rows [B * E_dim, dim].
        dim_entries = [e for e, t in enumerate(entry_table) if weights[t].shape[1] == dim]
        slot = torch.full((num_entries,), -1, dtype=torch.long, device=device)
        slot[dim_entries] = torch.arange(len(dim_entries), device=device)
        blocks = torch.stack(
            [grad_out[:, entry_cols[e] : entry_cols[e] + dim] for e in dim_entries], 1
        )
        if len(dim_entries) == num_entries:  # one dim: every occurrence, no selection copy
            s_bag, s_entry, s_scale, s_table, s_values = bag, entry, scale, occ_table, values
        else:
            sel = torch.nonzero(occ_dim == dim).squeeze(1)
            s_bag, s_entry, s_scale, s_table, s_values = (
                x.index_select(0, sel) for x in (bag, entry, scale, occ_table, values)
            )
        src = (s_bag - s_entry * batch) * len(dim_entries) + slot.index_select(0, s_entry)
        keys = row_base.index_select(0, s_table) + s_values.long()
        unique, grad_rows = sum_rows_by_key(
            keys, blocks.reshape(-1, dim), src, s_scale, key_bound=sum(rows)
        )
        key_table = torch.searchsorted(row_base, unique, right=True) - 1
        counts = torch.bincount(key_table, minlength=len(weights)).tolist()
        start = 0
        for t, n in enumerate(counts):
            if weights[t].shape[1] == dim:
                result[t] = (unique[start : start + n] - row_base[t], grad_rows[start : start + n])
            start += n
    return result  # type: ignore[return-value]


def per_sample_weights_grad_torch(lookup: Lookup, grad_out: Tensor) -> Tensor:
    """d out / d psw: for each id, <grad_out[bag, cols_e], weight row>."""
    weights, values, offsets, batch = lookup.weights, lookup.values, lookup.offsets, lookup.batch
    entry_table = lookup.entry_table
    cols = lookup.columns()
    grads = []
    for e, t in enumerate(entry_table):
        lo, hi = int(offsets[e * batch]), int(offsets[(e + 1) * batch])
        lengths = torch.diff(offsets[e * batch : (e + 1) * batch + 1].long())
        bag = torch.repeat_interleave(torch.arange(batch, device=values.device), lengths)
        g = grad_out[bag, cols[e] : cols[e + 1]]
        grads.append((g * weights[t][values[lo:hi].long()]).sum(1))
    return torch.cat(grads) if grads else grad_out.new_zeros(0)
