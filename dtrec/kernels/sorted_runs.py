"""Sorted occurrences and their runs: the first half of the row-sparse backward.

Every id occurrence of a pooled lookup gets a key ``row_base[table] + row`` (an id outside
its table gets ``no_row``, which sorts last and makes no run); a stable sort groups the
occurrences of each touched row into one *run*, and ``find_runs`` describes the runs in
buffers whose capacity is the number of ids: where each starts, its table, row and dim,
and one *item* per chunk of each long run. The counts stay on the device (``counts``), so
the summing kernels of ``embedding_bag_bwd.py`` loop over them without the host reading
a size. Five launches: keys, sort, run flags, their cumsum, run tables.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from dtrec.kernels.embedding_bag import _nonempty

__all__ = ["Runs", "find_runs"]

_SCAN_BLOCK = 1024  # sorted positions per program of the run kernels
_INT32_KEYS = 2**31 - 1  # sort int32 keys when the tables hold fewer rows than this


@triton.jit
def _occurrence_keys_kernel(
    values_ptr,
    offsets_ptr,
    entry_table_ptr,
    row_base_ptr,
    num_rows_ptr,
    keys_ptr,
    bag_of_ptr,
    batch_size,
    num_bags,
    no_row,
    BLOCK_B: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """keys[i] = row_base[t] + values[i] (``no_row`` for an id outside ``[0, num_rows[t])``)
    and bag_of[i] = bag, for each id i of bag ``e * B + b``, t = entry_table[e].

    Grid ``(cdiv(E * B, BLOCK_B),)``: program p walks bags ``p * BLOCK_B ...`` as
    ``[BLOCK_B, BLOCK_L]`` tiles, BLOCK_L ids of each bag per step (the launcher sizes
    BLOCK_L to the mean bag length). ``row_base`` int64 ``[U]`` is the exclusive cumsum of
    the row counts, so keys order occurrences by table then row, and ``no_row`` (the total
    row count) sorts a bad id last, where no run is made of it. ``keys`` int32 or int64.
    """
    bag = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    live = bag < num_bags
    table = tl.load(entry_table_ptr + bag // batch_size, mask=live, other=0)
    base = tl.load(row_base_ptr + table, mask=live, other=0)
    rows = tl.load(num_rows_ptr + table, mask=live, other=0)
    start = tl.load(offsets_ptr + bag, mask=live, other=0)
    count = tl.load(offsets_ptr + bag + 1, mask=live, other=0) - start
    for l0 in range(0, tl.max(count, axis=0), BLOCK_L):
        step = l0 + tl.arange(0, BLOCK_L)
        mask = step[None, :] < count[:, None]
        pos = start[:, None] + step[None, :]
        ids = tl.load(values_ptr + pos, mask=mask, other=0).to(tl.int64)
        key = tl.where((ids >= 0) & (ids < rows[:, None]), base[:, None] + ids, no_row)
        tl.store(keys_ptr + pos, key.to(keys_ptr.dtype.element_ty), mask=mask)
        tl.store(bag_of_ptr + pos, tl.zeros([BLOCK_B, BLOCK_L], dtype=tl.int32) + bag[:, None],
                 mask=mask)  # fmt: skip


@triton.jit
def _run_flags_kernel(
    keys_ptr,
    perm_ptr,
    bag_of_ptr,
    offsets_ptr,
    mean_ptr,
    psw_ptr,
    out_cols_ptr,
    src_ptr,
    scale_ptr,
    flags_ptr,
    num_occ,
    batch_size,
    total_dim,
    no_row,
    search_steps,
    HAS_PSW: tl.constexpr,
    SHORT: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Per sorted occurrence j (``keys`` sorted, ``perm`` their order): its ``src``/``scale``
    and ``flags[j] = is_run_start + (chunks << 32)``.

    Grid ``(cdiv(N, BLOCK),)``. Occurrence j is id ``i = perm[j]`` of bag ``bag_of[i] = e * B
    + b``: ``src[j] = b * total_dim + out_cols[e]`` (its grad_out row's element offset) and
    ``scale[j] = psw[i] / len`` (mean) or ``psw[i]``. A run (one touched row) starts at j
    when its key differs from j - 1's; a run of more than SHORT ids (``keys[j + SHORT]`` is
    the same key) is *long*: its end is found by a binary search of ``search_steps``
    halvings and ``chunks = cdiv(len, CHUNK)`` (0 for short runs). Bad ids (``no_row``)
    make no run. The cumsum of ``flags`` numbers runs (low half) and chunks (high half).
    """
    pos = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = pos < num_occ
    key = tl.load(keys_ptr + pos, mask=in_range, other=0).to(tl.int64)
    valid = in_range & (key < no_row)
    prev = tl.load(keys_ptr + pos - 1, mask=valid & (pos > 0), other=-1).to(tl.int64)
    is_start = valid & ((pos == 0) | (prev != key))

    occ = tl.load(perm_ptr + pos, mask=valid, other=0)
    bag = tl.load(bag_of_ptr + occ, mask=valid, other=0).to(tl.int64)
    entry = bag // batch_size
    b = bag - entry * batch_size
    src = b * total_dim + tl.load(out_cols_ptr + entry, mask=valid, other=0).to(tl.int64)
    length = tl.load(offsets_ptr + bag + 1, mask=valid, other=1) - tl.load(
        offsets_ptr + bag, mask=valid, other=0
    )
    is_mean = tl.load(mean_ptr + entry, mask=valid, other=0) != 0
    scale = tl.where(is_mean, 1.0 / tl.maximum(length, 1).to(tl.float32), 1.0)
    if HAS_PSW:
        scale = scale * tl.load(psw_ptr + occ, mask=valid, other=0.0)
    tl.store(src_ptr + pos, src.to(src_ptr.dtype.element_ty), mask=valid)
    tl.store(scale_ptr + pos, scale, mask=valid)

    ahead = pos + SHORT
    long = is_start & (ahead < num_occ)
    long = long & (tl.load(keys_ptr + ahead, mask=long, other=-1).to(tl.int64) == key)
    lo = ahead + 1  # the run's end lies in [lo, hi]
    hi = tl.zeros_like(pos) + num_occ
    for _ in range(search_steps):
        active = long & (lo < hi)
        mid = (lo + hi) // 2
        same = tl.load(keys_ptr + mid, mask=active, other=-1).to(tl.int64) == key
        lo = tl.where(active & same, mid + 1, lo)
        hi = tl.where(active & (~same), mid, hi)
    chunks = tl.where(long, (lo - pos + CHUNK - 1) // CHUNK, 0)
    tl.store(flags_ptr + pos, is_start.to(tl.int64) + (chunks << 32), mask=in_range)


@triton.jit
def _run_tables_kernel(
    keys_ptr,
    perm_ptr,
    bag_of_ptr,
    entry_table_ptr,
    row_base_ptr,
    dims_ptr,
    flags_ptr,
    cum_ptr,
    starts_ptr,
    unique_keys_ptr,
    row_table_ptr,
    row_ids_ptr,
    row_dim_ptr,
    item_run_ptr,
    item_chunk_ptr,
    counts_ptr,
    num_occ,
    batch_size,
    no_row,
    BLOCK: tl.constexpr,
):
    """Run r (``cum`` = inclusive cumsum of ``_run_flags_kernel``'s flags): its first sorted
    occurrence ``starts[r]``, key, table, row and dim; one item ``(run, chunk)`` per chunk of
    every long run; ``starts[K]`` the end of the last run and ``counts = [K, items]``.

    Grid ``(cdiv(N, BLOCK),)``; every buffer has the capacity of N ids, only the first
    ``counts`` entries are written. No run at all (every id bad) writes zero counts.
    """
    pos = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = pos < num_occ
    flags = tl.load(flags_ptr + pos, mask=in_range, other=0)
    cum = tl.load(cum_ptr + pos, mask=in_range, other=0)
    chunks = flags >> 32
    is_start = (flags - (chunks << 32)) != 0
    items_end = cum >> 32
    run = cum - (items_end << 32) - 1
    key = tl.load(keys_ptr + pos, mask=in_range, other=no_row).to(tl.int64)

    occ = tl.load(perm_ptr + pos, mask=is_start, other=0)
    bag = tl.load(bag_of_ptr + occ, mask=is_start, other=0)
    table = tl.load(entry_table_ptr + bag // batch_size, mask=is_start, other=0)
    tl.store(starts_ptr + run, pos, mask=is_start)
    tl.store(unique_keys_ptr + run, key, mask=is_start)
    tl.store(row_table_ptr + run, table, mask=is_start)
    row_id = key - tl.load(row_base_ptr + table, mask=is_start, other=0)
    tl.store(row_ids_ptr + run, row_id, mask=is_start)
    tl.store(row_dim_ptr + run, tl.load(dims_ptr + table, mask=is_start, other=0), mask=is_start)
    for c in range(0, tl.max(chunks, axis=0)):
        mine = c < chunks
        item = items_end - chunks + c
        tl.store(item_run_ptr + item, run.to(tl.int32), mask=mine)
        tl.store(item_chunk_ptr + item, tl.zeros_like(item).to(tl.int32) + c, mask=mine)

    valid = in_range & (key < no_row)
    after = tl.load(keys_ptr + pos + 1, mask=valid & (pos + 1 < num_occ), other=no_row)
    last = valid & (after.to(tl.int64) >= no_row)
    none = in_range & (pos == 0) & (key >= no_row)
    tl.store(starts_ptr + run + 1, pos + 1, mask=last)
    tl.store(starts_ptr + pos, tl.zeros_like(pos), mask=none)
    tl.store(counts_ptr + pos * 0, tl.where(last, run + 1, 0), mask=last | none)
    tl.store(counts_ptr + 1 + pos * 0, tl.where(last, items_end, 0), mask=last | none)


class Runs(NamedTuple):
    """The sorted occurrences and their runs, in capacity-sized buffers (see the kernels)."""

    src: Tensor
    scale: Tensor
    starts: Tensor
    unique_keys: Tensor
    row_table: Tensor
    row_ids: Tensor
    row_dim: Tensor
    item_run: Tensor
    item_chunk: Tensor
    counts: Tensor  # int64 [2]: runs, long-run chunks (on the device)
    items: int  # capacity of item_run / item_chunk (a host number)


def find_runs(values, offsets, entry_table, row_base, num_rows, total_rows, dims, batch_size,
               total_dim, out_cols, mean, psw, short: int, chunk: int) -> Runs:  # fmt: skip
    """The runs of the lookup's occurrences (a run: the occurrences of one touched row, in
    sorted order; long: more than ``short`` of them, in chunks of ``chunk``), each
    occurrence's grad_out offset ``src`` and factor ``scale`` (per the lookup's layout,
    ``embedding_bag.py``). No host read."""
    device, num_occ, num_bags = values.device, values.numel(), offsets.numel() - 1
    key_dtype = torch.int32 if total_rows < _INT32_KEYS else torch.int64
    keys = torch.empty(num_occ, dtype=key_dtype, device=device)
    bag_of = torch.empty(num_occ, dtype=torch.int32, device=device)
    block_l = min(128, triton.next_power_of_2(max(1, num_occ // max(num_bags, 1))))
    block_b = max(1, 256 // block_l)
    entry_table = entry_table.to(torch.int32)
    _occurrence_keys_kernel[(triton.cdiv(num_bags, block_b),)](
        values, offsets, entry_table, row_base, num_rows, keys, bag_of, batch_size, num_bags,
        total_rows, BLOCK_B=block_b, BLOCK_L=block_l,
    )  # fmt: skip
    keys, perm = torch.sort(keys, stable=True)
    src_dtype = torch.int32 if batch_size * total_dim < 2**31 else torch.int64
    src = torch.empty(num_occ, dtype=src_dtype, device=device)
    scale = torch.empty(num_occ, dtype=torch.float32, device=device)
    flags = torch.empty(num_occ, dtype=torch.int64, device=device)
    grid = (triton.cdiv(num_occ, _SCAN_BLOCK),)
    _run_flags_kernel[grid](
        keys, perm, bag_of, offsets, mean.to(torch.int8), _nonempty(psw) if psw is not None
        else scale, out_cols, src, scale, flags, num_occ, batch_size, total_dim,
        total_rows, num_occ.bit_length(), HAS_PSW=psw is not None, SHORT=short, CHUNK=chunk,
        BLOCK=_SCAN_BLOCK,
    )  # fmt: skip
    cum = torch.cumsum(flags, 0)
    items = num_occ // (short + 1) + num_occ // chunk + 1
    run_buffers = [
        torch.empty(num_occ + 1, dtype=torch.int64, device=device),  # starts
        torch.empty(num_occ, dtype=torch.int64, device=device),  # unique keys
        torch.empty(num_occ, dtype=torch.int32, device=device),  # row table
        torch.empty(num_occ, dtype=torch.int64, device=device),  # row ids
        torch.empty(num_occ, dtype=torch.int32, device=device),  # row dim
        torch.empty(items, dtype=torch.int32, device=device),  # item run
        torch.empty(items, dtype=torch.int32, device=device),  # item chunk
        torch.empty(2, dtype=torch.int64, device=device),  # counts
    ]
    _run_tables_kernel[grid](
        keys, perm, bag_of, entry_table, row_base, dims, flags, cum, *run_buffers, num_occ,
        batch_size, total_rows, BLOCK=_SCAN_BLOCK,
    )  # fmt: skip
    return Runs(src, scale, *run_buffers, items)
