"""Batched multi-table pooled lookup: the layout every backend takes, packing and argument checks.

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
from torch import Tensor

from dtrec.ops.backends.device_lists import device_list
from dtrec.ops.huge_pages import advise_huge_pages

POOLING_MODES = ("sum", "mean")
"""How a bag's rows combine; the op's own vocabulary (table configs use it too)."""


@dataclass(frozen=True)
class Lookup:
    """One batched lookup's inputs, in the layout above; what every backend takes."""

    weights: Sequence[Tensor]
    entry_table: Sequence[int]
    values: Tensor
    offsets: Tensor
    mean: Sequence[bool]
    per_sample_weights: Tensor | None = None
    error: Tensor | None = None
    """A device flag (int32 ``[2]``) to record ids outside their table in instead of
    raising, for backends whose ``Capabilities.skips_bad_ids`` is True: such an id pools
    as a zero row, gets no gradient, and while ``error[0]`` is set their fused steps write
    nothing (the flag stays set until its owner clears it)."""

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
    ``shared_storage``: what packed tables and optimizer states are made of). On CPU the
    buffer asks for huge pages before it is first written (``huge_pages``)."""
    sizes = [math.prod(shape) for shape in shapes]
    flat = torch.empty(sum(sizes), dtype=dtype, device=device)
    advise_huge_pages(flat)
    if zero:
        flat.zero_()
    starts = [0, *itertools.accumulate(sizes)]
    # slices, not torch.split: split's views may not be written in place under autograd
    return [
        flat[start : start + size].view(tuple(shape))
        for start, size, shape in zip(starts, sizes, shapes, strict=False)
    ]


def pack_tables(weights: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """A flat buffer holding every table, and each table's element offset in it (a device list).

    Zero-copy when all tables are contiguous views of one storage (``shared_storage``);
    otherwise one copy per call (the unsharded collection's separate parameters).
    """
    shared = shared_storage(weights)
    if shared is not None:
        flat, offsets = shared
        return flat, device_list(offsets, torch.int64, flat.device)
    sizes = [w.numel() for w in weights]
    starts = device_list([0, *sizes[:-1]], torch.int64, weights[0].device).cumsum(0)
    return torch.cat([w.reshape(-1) for w in weights]), starts


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
