"""Triton kernels for the row-sparse backward of the pooled lookup (and its fused step).

One cohesive pipeline, kept in one file (over ~400 lines on purpose): key every id
occurrence by (table, row), sort, then sum each row's gradient in a fixed order
(short segments in one program, long ones split and their partials summed), and
either return the summed rows or apply the fused optimizer step to them in place.
Same packed layout as the forward (``embedding_bag.py``, whose docstring describes
it); plain tensors only, fp32 accumulation, no float atomics (deterministic).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from dtrec.kernels.embedding_bag import _MAX_BLOCK_D, _max_dim, _nonempty
from dtrec.kernels.row_updates import ROWWISE_ADAGRAD, FusedRowUpdate, apply_row_update

__all__ = ["MAX_FUSED_ROWWISE_DIM", "RowGrads", "embedding_bag_bwd_rows"]


class RowGrads(NamedTuple):
    """Row-sparse gradient of the packed tables: one entry per distinct (table, row) touched.

    Rows are sorted by ``unique_keys = row_base[table] + row`` (``row_base`` the exclusive
    cumsum of ``num_rows``), i.e. by table then row, so the rows of table u are contiguous
    in ``grad_rows``: row ``k`` is ``grad_rows[grad_offsets[k] : grad_offsets[k] +
    dims[row_table[k]]]`` (fp32).
    """

    unique_keys: Tensor  # int64 [K]
    row_table: Tensor  # int32 [K] table of each row
    row_ids: Tensor  # int64 [K] row index local to its table
    grad_offsets: Tensor  # int64 [K] element offset of each row in grad_rows
    grad_rows: Tensor  # fp32 [sum_k dims[row_table[k]]]


# Backward tuning, swept on an H100 (26 tables, D=128, B=16384, fused row-wise Adagrad, ms per
# backward + update): L=20 uniform 6.2 with [4, 128] tiles on one warp and rows of up to 32
# occurrences in the row-block kernel, vs 8.7 with [16, 128] tiles on 2 warps; L=80 Zipf 10.3
# vs 12.4; hot rows (L=80 Zipf) 8.0 vs 10.4 with chunks of 256 occurrences summed 4 at a time
# on one warp (vs 1024, 16 at a time, 4 warps). Small tiles and few warps win: the row gathers
# are latency-bound, so more resident programs beat wider ones.
_SEG_CHUNK = 256  # a hot row's occurrences are split into sub-segments of this many
_SHORT_SEG = 32  # rows with at most this many occurrences go to the row-block kernel
_BWD_TILE = 512  # elements of the row-block kernel's [rows, BLOCK_D] tile
_BWD_WARPS = 1
_BWD_BLOCK_L = 4  # occurrences per step of the long-segment kernel
_BWD_LONG_WARPS = 1
_BLOCK_C = 16  # partials per step of the partial-sum kernel
_INT32_KEYS = 2**31 - 1  # sort int32 keys when the tables hold at most this many rows
MAX_FUSED_ROWWISE_DIM = 2 * _MAX_BLOCK_D  # widest row the fused row-wise Adagrad takes


@triton.jit
def _occurrence_keys_kernel(
    values_ptr,
    offsets_ptr,
    entry_table_ptr,
    row_base_ptr,
    keys_ptr,
    bag_of_ptr,
    batch_size,
    num_bags,
    BLOCK_B: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    """keys[i] = row_base[entry_table[e]] + values[i] and bag_of[i] = bag, for each id i.

    Grid ``(cdiv(E * B, BLOCK_B),)``: program p walks bags ``bag = e * B + b = p * BLOCK_B
    ...`` (ids ``offsets[bag] .. offsets[bag + 1]``) as ``[BLOCK_B, BLOCK_L]`` tiles, BLOCK_L
    ids of each bag per step (the launcher sizes BLOCK_L to the mean bag length, so short bags
    do not idle a whole program). ``row_base`` int64 ``[U]`` is the exclusive cumsum of the
    tables' row counts, so a key orders occurrences by table then row; ``keys`` is int32 or
    int64 (the launcher picks int32 when every key fits), ``bag_of`` int32.
    """
    bag = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    live = bag < num_bags
    table = tl.load(entry_table_ptr + bag // batch_size, mask=live, other=0)
    base = tl.load(row_base_ptr + table, mask=live, other=0)
    start = tl.load(offsets_ptr + bag, mask=live, other=0)
    count = tl.load(offsets_ptr + bag + 1, mask=live, other=0) - start
    for l0 in range(0, tl.max(count, axis=0), BLOCK_L):
        step = l0 + tl.arange(0, BLOCK_L)
        mask = step[None, :] < count[:, None]
        pos = start[:, None] + step[None, :]
        ids = tl.load(values_ptr + pos, mask=mask, other=0).to(tl.int64)
        tl.store(keys_ptr + pos, (base[:, None] + ids).to(keys_ptr.dtype.element_ty), mask=mask)
        tl.store(bag_of_ptr + pos, tl.zeros([BLOCK_B, BLOCK_L], dtype=tl.int32) + bag[:, None],
                 mask=mask)  # fmt: skip


@triton.jit
def _sorted_occurrences_kernel(
    perm_ptr,
    bag_of_ptr,
    bag_scale_ptr,
    psw_ptr,
    out_cols_ptr,
    src_ptr,
    scale_ptr,
    num_occ,
    batch_size,
    total_dim,
    HAS_PSW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """src[j], scale[j] of sorted occurrence j: its grad_out row and its factor.

    Grid ``(cdiv(N, BLOCK),)``. Occurrence j is id ``i = perm[j]`` of bag ``bag_of[i] = e * B
    + b``: ``src[j] = b * total_dim + out_cols[e]`` (element offset of its row in the
    row-major ``[B, total_dim]`` grad_out; int32 or int64) and ``scale[j] = bag_scale[bag] *
    psw[i]`` (``bag_scale`` = 1/len for mean entries, else 1). Streaming these once keeps
    the summing kernels' dependent loads to two (src, then the row).
    """
    pos = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = pos < num_occ
    occ = tl.load(perm_ptr + pos, mask=mask, other=0)
    bag = tl.load(bag_of_ptr + occ, mask=mask, other=0)
    entry = bag // batch_size
    b = (bag - entry * batch_size).to(tl.int64)
    src = b * total_dim + tl.load(out_cols_ptr + entry, mask=mask, other=0).to(tl.int64)
    scale = tl.load(bag_scale_ptr + bag, mask=mask, other=0.0)
    if HAS_PSW:
        scale = scale * tl.load(psw_ptr + occ, mask=mask, other=0.0)
    tl.store(src_ptr + pos, src.to(src_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + pos, scale, mask=mask)


@triton.jit
def _short_segments_kernel(
    grad_out_ptr,
    src_ptr,
    scale_ptr,
    seg_bounds_ptr,
    row_dim_ptr,
    grad_offsets_ptr,
    grad_rows_ptr,
    row_table_ptr,
    row_ids_ptr,
    weights_ptr,
    table_offsets_ptr,
    hyper_ptr,
    state_ptr,
    state_offsets_ptr,
    state2_ptr,
    full_dims_ptr,
    num_segs,
    KIND: tl.constexpr,
    SHORT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """grad_rows[grad_offsets[k] + d] = sum_j scale[j] * grad_out_flat[src[j] + d], short k.

    Grid ``(cdiv(K, BLOCK_R), cdiv(max_dim, BLOCK_D))``: program (p, c) owns the unique rows
    ``k = p * BLOCK_R ...`` with at most SHORT occurrences (sorted occurrences
    ``seg_bounds[k] .. seg_bounds[k + 1]``) and columns ``c * BLOCK_D ...`` below
    ``row_dim[k]``. Step ``l`` adds every owned row's l-th occurrence as one ``[BLOCK_R,
    BLOCK_D]`` tile (BLOCK_R row gathers in flight; the next step's src/scale are loaded
    meanwhile), so each row sums its occurrences in sorted order. ``src``/``scale`` from
    ``_sorted_occurrences_kernel``; grad_out is row-major ``[B, total_dim]``. Longer rows
    are left to ``_long_segments_kernel``. One writer per element, no atomics. With KIND > 0
    the summed rows are not stored: ``apply_row_update`` applies that optimizer step to
    rows ``(row_table[k], row_ids[k])`` instead (the other ``*_ptr`` are its arguments).
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d0 = tl.program_id(1) * BLOCK_D
    in_range = rows < num_segs
    start = tl.load(seg_bounds_ptr + rows, mask=in_range, other=0)
    count = (tl.load(seg_bounds_ptr + rows + 1, mask=in_range, other=0) - start).to(tl.int32)
    dim = tl.load(row_dim_ptr + rows, mask=in_range, other=0)
    mine = in_range & (count <= SHORT) & (d0 < dim)
    count = tl.where(mine, count, 0)
    cols = d0 + tl.arange(0, BLOCK_D)
    tile_mask = mine[:, None] & (cols[None, :] < dim[:, None])

    live = count > 0
    src = tl.load(src_ptr + start, mask=live, other=0)
    scale = tl.load(scale_ptr + start, mask=live, other=0.0)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for step in range(0, tl.max(count, axis=0)):
        g = tl.load(
            grad_out_ptr + src[:, None] + cols[None, :], mask=live[:, None] & tile_mask, other=0.0
        )
        live_next = step + 1 < count
        src_next = tl.load(src_ptr + start + step + 1, mask=live_next, other=0)
        scale_next = tl.load(scale_ptr + start + step + 1, mask=live_next, other=0.0)
        acc += g.to(tl.float32) * scale[:, None]
        src, scale, live = src_next, scale_next, live_next

    if KIND == 0:
        goff = tl.load(grad_offsets_ptr + rows, mask=mine, other=0)
        tl.store(grad_rows_ptr + goff[:, None] + cols[None, :], acc, mask=tile_mask)
    else:
        table = tl.load(row_table_ptr + rows, mask=mine, other=0)
        row = tl.load(row_ids_ptr + rows, mask=mine, other=0).to(tl.int64)
        apply_row_update(
            acc, tile_mask, mine, table, row, cols, dim, weights_ptr, table_offsets_ptr,
            hyper_ptr, state_ptr, state_offsets_ptr, state2_ptr, full_dims_ptr, KIND,
        )  # fmt: skip


@triton.jit
def _update_one_row(
    g,
    cols_live,
    seg,
    cols,
    dim,
    row_table_ptr,
    row_ids_ptr,
    weights_ptr,
    table_offsets_ptr,
    hyper_ptr,
    state_ptr,
    state_offsets_ptr,
    state2_ptr,
    full_dims_ptr,
    KIND: tl.constexpr,
):
    """``apply_row_update`` on columns ``cols < cols_live`` of one row (a one-row tile).

    Masks come from integer limits: the interpreter mishandles tensor & scalar-bool masks.
    """
    one = tl.arange(0, 1)
    live = one < tl.where(cols_live > 0, 1, 0)
    table = tl.load(row_table_ptr + seg + one, mask=live, other=0)
    row = tl.load(row_ids_ptr + seg + one, mask=live, other=0).to(tl.int64)
    apply_row_update(
        g[None, :], cols[None, :] < cols_live + one[:, None] * 0, live, table, row, cols,
        dim + one * 0,
        weights_ptr, table_offsets_ptr, hyper_ptr, state_ptr, state_offsets_ptr, state2_ptr,
        full_dims_ptr, KIND,
    )  # fmt: skip


@triton.jit
def _long_segments_kernel(
    grad_out_ptr,
    src_ptr,
    scale_ptr,
    seg_bounds_ptr,
    row_dim_ptr,
    grad_offsets_ptr,
    grad_rows_ptr,
    item_seg_ptr,
    item_chunk_ptr,
    partials_ptr,
    part_stride,
    row_table_ptr,
    row_ids_ptr,
    weights_ptr,
    table_offsets_ptr,
    hyper_ptr,
    state_ptr,
    state_offsets_ptr,
    state2_ptr,
    full_dims_ptr,
    KIND: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One sub-segment of a long row: the sum of up to CHUNK of its occurrences.

    Grid ``(n_items, cdiv(max_dim, BLOCK_D))``: item i is chunk ``c = item_chunk[i]`` of
    unique row ``k = item_seg[i]``, the sorted occurrences ``seg_bounds[k] + c * CHUNK ...``
    (up to CHUNK, within the row's segment), summed as in ``_short_segments_kernel`` but
    BLOCK_L occurrences per step (a ``[BLOCK_L, BLOCK_D]`` tile reduced at the end). A row
    of at most CHUNK occurrences has one chunk, stored straight to
    ``grad_rows[grad_offsets[k] + d]``; a longer row's chunks (consecutive items, in chunk
    order) store fp32 partials to ``partials[i * part_stride + d]``, which
    ``_sum_partials_kernel`` adds up. KIND as in ``_short_segments_kernel``.
    """
    item = tl.program_id(0)
    d0 = tl.program_id(1) * BLOCK_D
    seg = tl.load(item_seg_ptr + item)
    seg_start = tl.load(seg_bounds_ptr + seg)
    seg_end = tl.load(seg_bounds_ptr + seg + 1)
    start = seg_start + tl.load(item_chunk_ptr + item).to(tl.int64) * CHUNK
    end = tl.minimum(start + CHUNK, seg_end)
    dim = tl.load(row_dim_ptr + seg)
    stop = tl.where(d0 < dim, end, start)
    cols = d0 + tl.arange(0, BLOCK_D)
    col_mask = cols < dim

    pos = start + tl.arange(0, BLOCK_L)
    live = pos < stop
    src = tl.load(src_ptr + pos, mask=live, other=0)
    scale = tl.load(scale_ptr + pos, mask=live, other=0.0)
    acc = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    for l0 in range(start, stop, BLOCK_L):
        g = tl.load(
            grad_out_ptr + src[:, None] + cols[None, :],
            mask=live[:, None] & col_mask[None, :],
            other=0.0,
        )
        pos = l0 + BLOCK_L + tl.arange(0, BLOCK_L)
        live_next = pos < stop
        src_next = tl.load(src_ptr + pos, mask=live_next, other=0)
        scale_next = tl.load(scale_ptr + pos, mask=live_next, other=0.0)
        acc += g.to(tl.float32) * scale[:, None]
        src, scale, live = src_next, scale_next, live_next

    total = tl.sum(acc, axis=0)
    # Masks from column limits (the interpreter mishandles tensor & scalar-bool masks).
    whole_dim = tl.where(seg_end - seg_start <= CHUNK, dim, 0)
    if KIND == 0:
        goff = tl.load(grad_offsets_ptr + seg)
        tl.store(grad_rows_ptr + goff + cols, total, mask=cols < whole_dim)
    else:
        _update_one_row(
            total, whole_dim, seg, cols, dim, row_table_ptr, row_ids_ptr,
            weights_ptr, table_offsets_ptr, hyper_ptr, state_ptr, state_offsets_ptr, state2_ptr,
            full_dims_ptr, KIND,
        )  # fmt: skip
    part = partials_ptr + item.to(tl.int64) * part_stride + cols
    tl.store(part, total, mask=cols < dim - whole_dim)


@triton.jit
def _sum_partials_kernel(
    partials_ptr,
    part_stride,
    item_seg_ptr,
    item_chunk_ptr,
    seg_bounds_ptr,
    row_dim_ptr,
    grad_offsets_ptr,
    grad_rows_ptr,
    row_table_ptr,
    row_ids_ptr,
    weights_ptr,
    table_offsets_ptr,
    hyper_ptr,
    state_ptr,
    state_offsets_ptr,
    state2_ptr,
    full_dims_ptr,
    KIND: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """grad_rows[grad_offsets[k] + d] = sum_c partials[(i + c) * part_stride + d], split k.

    Grid as ``_long_segments_kernel``'s: only the program of a split row's first chunk
    (item i, ``item_chunk[i] == 0``) works; its ``n = cdiv(count, CHUNK)`` partials are
    items ``i .. i + n - 1``, read BLOCK_C at a time into a ``[BLOCK_C, BLOCK_D]`` tile and
    reduced at the end: a fixed order, so two runs agree bit for bit. KIND as in
    ``_short_segments_kernel``.
    """
    item = tl.program_id(0)
    d0 = tl.program_id(1) * BLOCK_D
    seg = tl.load(item_seg_ptr + item)
    count = tl.load(seg_bounds_ptr + seg + 1) - tl.load(seg_bounds_ptr + seg)
    num_chunks = (count + CHUNK - 1) // CHUNK
    dim = tl.load(row_dim_ptr + seg)
    lead = (tl.load(item_chunk_ptr + item) == 0) & (num_chunks > 1) & (d0 < dim)
    stop = tl.where(lead, num_chunks, 0)
    cols = d0 + tl.arange(0, BLOCK_D)
    col_mask = cols < dim

    acc = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
    for c0 in range(0, stop, BLOCK_C):
        chunk = c0 + tl.arange(0, BLOCK_C)
        rows = (item + chunk).to(tl.int64) * part_stride
        mask = (chunk < stop)[:, None] & col_mask[None, :]
        acc += tl.load(partials_ptr + rows[:, None] + cols[None, :], mask=mask, other=0.0)
    lead_dim = tl.where(lead, dim, 0)
    if KIND == 0:
        goff = tl.load(grad_offsets_ptr + seg)
        tl.store(grad_rows_ptr + goff + cols, tl.sum(acc, axis=0), mask=cols < lead_dim)
    else:
        _update_one_row(
            tl.sum(acc, axis=0), lead_dim, seg, cols, dim, row_table_ptr,
            row_ids_ptr, weights_ptr, table_offsets_ptr, hyper_ptr, state_ptr,
            state_offsets_ptr, state2_ptr, full_dims_ptr, KIND,
        )  # fmt: skip


def _bwd_blocks(max_dim: int) -> tuple[int, int, int]:
    """(BLOCK_D, column blocks, rows per program of the row-block kernel)."""
    block_d = min(2 * _MAX_BLOCK_D, triton.next_power_of_2(max(int(max_dim), 1)))
    block_r = max(1, min(128, _BWD_TILE // block_d))
    return block_d, triton.cdiv(max(int(max_dim), 1), block_d), block_r


def embedding_bag_bwd_rows(
    grad_out: Tensor,
    dims: Tensor,
    num_rows: Tensor,
    entry_table: Tensor,
    out_cols: Tensor,
    values: Tensor,
    offsets: Tensor,
    batch_size: int,
    total_dim: int,
    mean: Tensor,
    per_sample_weights: Tensor | None = None,
    *,
    max_dim: int | None = None,
    chunk_size: int | None = None,
    total_rows: int | None = None,
    update: FusedRowUpdate | None = None,
) -> RowGrads:
    """Deterministic row-sparse gradient of :func:`embedding_bag_fwd` w.r.t. the tables.

    ``grad_out`` is ``[B, total_dim]``; the other arguments are the forward's (layout in the
    module docstring; ``num_rows`` int64 ``[U]`` is rows per table). Ids must be in range
    (check the forward's ``error``). Occurrences are stably sorted by row key; a row with
    at most ``chunk_size`` occurrences (default 256) is summed in that order by one
    program (many short rows share a program), a hotter row's occurrences are split into
    chunks of ``chunk_size`` summed in parallel into fp32 partials, then added up in a
    fixed order. No float atomics: two runs give bit-identical results. Syncs the device
    twice (unique rows, buffer sizes; once more each without ``max_dim`` or ``total_rows``,
    the sum of ``num_rows``).

    With ``update`` (an optimizer and its packed weights and state) nothing is stored:
    each row is updated in place where its gradient would be stored (one pass, no
    gradient buffer written and read back) and ``grad_rows`` comes back empty. Row-wise
    Adagrad needs whole rows in one tile (``max_dim <= MAX_FUSED_ROWWISE_DIM``).

    Example::

        g = embedding_bag_bwd_rows(grad_out, dims, num_rows, entry_table, out_cols,
                                   ids, offsets, B, total_dim, mean)
        sgd_update_rows(w, toff, dims, g.row_table, g.row_ids, g.grad_rows,
                        g.grad_offsets, lr=0.1)
    """
    device = grad_out.device
    dims = dims.to(torch.int32)
    if values.numel() == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return RowGrads(empty, empty.int(), empty, empty, empty.float())
    chunk = int(chunk_size or _SEG_CHUNK)
    short = max(1, min(_SHORT_SEG, chunk // 2))
    offsets = offsets.to(torch.int64)
    num_rows = num_rows.to(torch.int64)
    row_end = torch.cumsum(num_rows, 0)
    row_base = row_end - num_rows
    num_bags = offsets.numel() - 1

    # Sort key per occurrence (int32 halves the radix sort when every key fits).
    small = (int(row_end[-1]) if total_rows is None else total_rows) <= _INT32_KEYS
    keys = torch.empty(values.numel(), dtype=torch.int32 if small else torch.int64, device=device)
    bag_of = torch.empty(values.numel(), dtype=torch.int32, device=device)
    block_l = min(128, triton.next_power_of_2(max(1, values.numel() // max(num_bags, 1))))
    block_b = max(1, 256 // block_l)
    _occurrence_keys_kernel[(triton.cdiv(num_bags, block_b),)](
        values, offsets, entry_table.to(torch.int32), row_base, keys, bag_of, batch_size,
        num_bags, BLOCK_B=block_b, BLOCK_L=block_l,
    )  # fmt: skip
    lengths = (offsets[1:] - offsets[:-1]).view(-1, batch_size)
    inv_len = 1.0 / lengths.clamp(min=1).float()
    bag_scale = torch.where(mean.bool()[:, None], inv_len, 1.0).reshape(-1).contiguous()
    sorted_keys, perm = torch.sort(keys, stable=True)
    del keys
    unique_keys, counts = torch.unique_consecutive(sorted_keys, return_counts=True)
    del sorted_keys
    unique_keys = unique_keys.long()
    seg_bounds = torch.zeros(unique_keys.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts, 0, out=seg_bounds[1:])
    row_table = torch.searchsorted(row_end, unique_keys, right=True).to(torch.int32)
    row_ids = unique_keys - row_base[row_table.long()]
    row_dim = dims[row_table.long()]
    grad_offsets = torch.cumsum(row_dim.long(), 0) - row_dim.long()
    num_chunks = torch.where(counts > short, (counts + chunk - 1) // chunk, 0)
    stats = torch.stack([row_dim.long().sum(), num_chunks.sum(), num_chunks.max()])
    grad_size, num_items, max_chunks = stats.tolist()
    grad_rows = torch.empty(grad_size if update is None else 0, dtype=torch.float32,
                            device=device)  # fmt: skip
    num_segs = unique_keys.numel()
    if num_segs == 0 or grad_size == 0:
        return RowGrads(unique_keys, row_table, row_ids, grad_offsets, grad_rows)

    max_d = _max_dim(dims, max_dim)
    block_d, col_blocks, block_r = _bwd_blocks(max_d)
    if update is None:
        kind, upd = 0, (row_table,) * 2 + (grad_rows,) * 7
        grad_rows_arg = grad_rows
    else:
        if update.kind == ROWWISE_ADAGRAD and col_blocks > 1:
            raise ValueError(f"fused row-wise Adagrad needs dims <= {MAX_FUSED_ROWWISE_DIM}")
        kind, upd = update.kind, (row_table, row_ids, *update[1:])
        grad_rows_arg = _nonempty(grad_rows)
    num_occ = values.numel()
    src_dtype = torch.int32 if batch_size * total_dim < 2**31 else torch.int64
    src = torch.empty(num_occ, dtype=src_dtype, device=device)
    scale = torch.empty(num_occ, dtype=torch.float32, device=device)
    psw = bag_scale if per_sample_weights is None else per_sample_weights.float().contiguous()
    _sorted_occurrences_kernel[(triton.cdiv(num_occ, 1024),)](
        perm, bag_of, bag_scale, psw, out_cols.to(torch.int64), src, scale, num_occ, batch_size,
        total_dim, HAS_PSW=per_sample_weights is not None, BLOCK=1024,
    )  # fmt: skip
    del perm, bag_of
    grad_out = grad_out.contiguous()
    _short_segments_kernel[(triton.cdiv(num_segs, block_r), col_blocks)](
        grad_out, src, scale, seg_bounds, row_dim, grad_offsets, grad_rows_arg, *upd, num_segs,
        KIND=kind, SHORT=short, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=_BWD_WARPS,
    )  # fmt: skip
    if num_items > 0:
        item_seg = torch.repeat_interleave(
            torch.arange(num_segs, device=device), num_chunks, output_size=num_items
        )
        first = torch.cumsum(num_chunks, 0) - num_chunks
        item_chunk = (torch.arange(num_items, device=device) - first[item_seg]).to(torch.int32)
        # One max_d-wide partial per item (single-chunk items leave theirs unused).
        split = max_chunks > 1
        partials = torch.empty((num_items if split else 1) * max_d, dtype=torch.float32,
                               device=device)  # fmt: skip
        _long_segments_kernel[(num_items, col_blocks)](
            grad_out, src, scale, seg_bounds, row_dim, grad_offsets, grad_rows_arg, item_seg,
            item_chunk, partials, max_d, *upd, KIND=kind, CHUNK=chunk, BLOCK_L=_BWD_BLOCK_L,
            BLOCK_D=block_d, num_warps=_BWD_LONG_WARPS,
        )  # fmt: skip
        if split:
            _sum_partials_kernel[(num_items, col_blocks)](
                partials, max_d, item_seg, item_chunk, seg_bounds, row_dim, grad_offsets,
                grad_rows_arg, *upd, KIND=kind, CHUNK=chunk, BLOCK_C=_BLOCK_C, BLOCK_D=block_d,
                num_warps=4,
            )  # fmt: skip
    return RowGrads(unique_keys, row_table, row_ids, grad_offsets, grad_rows)


# --------------------------------------------------------------------------- optimizers

# Row-wise Adagrad on an H100 (15.8M rows of 128): 15 ms with [8, 128] tiles on 2 warps, 24-28
# ms with one 4-warp program per row.
