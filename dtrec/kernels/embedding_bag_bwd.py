"""Triton kernels for the row-sparse backward of the pooled lookup (and its fused step).

The pipeline: key every id occurrence by (table, row), sort, find the runs of equal
keys (one per touched row: ``sorted_runs.py``), then sum each row's gradient in a fixed
order (short runs several to a program, long ones split into chunks whose partials are
summed) and either return the summed rows or apply the fused optimizer step to them in
place. Same packed layout as the forward
(``embedding_bag.py``, whose docstring describes it); plain tensors only, fp32
accumulation, no float atomics (deterministic).

Sizes known ahead: every buffer has a capacity the host knows (the number of ids), the
run and chunk counts stay on the device, and the summing kernels loop over them from a
fixed grid (persistent programs), so the fused backward + step never waits for the
device. Eight launches whatever the number of tables: keys, sort, run flags, their
cumsum, run tables, short runs, long-run chunks, chunk partials.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from dtrec.kernels.embedding_bag import _MAX_BLOCK_D, _max_dim, _nonempty
from dtrec.kernels.row_updates import ROWWISE_ADAGRAD, FusedRowUpdate, apply_row_update
from dtrec.kernels.sorted_runs import Runs, find_runs

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
# occurrences in the short-run kernel, vs 8.7 with [16, 128] tiles on 2 warps; L=80 Zipf 10.3
# vs 12.4; hot rows (L=80 Zipf) 8.0 vs 10.4 with chunks of 256 occurrences summed 4 at a time
# on one warp (vs 1024, 16 at a time, 4 warps). Small tiles and few warps win: the row gathers
# are latency-bound, so more resident programs beat wider ones.
_SEG_CHUNK = 256  # a hot row's occurrences are split into chunks of this many
_SHORT_SEG = 32  # rows with at most this many occurrences go to the short-run kernel
_BWD_TILE = 512  # elements of the short-run kernel's [rows, BLOCK_D] tile
_BWD_WARPS = 1
_BWD_BLOCK_L = 4  # occurrences per step of the long-run kernel
_BLOCK_C = 16  # partials per step of the partial-sum kernel
_PROGRAMS_PER_SM = 32  # persistent programs of the summing kernels per multiprocessor
MAX_FUSED_ROWWISE_DIM = 2 * _MAX_BLOCK_D  # widest row the fused row-wise Adagrad takes


@triton.jit
def _sum_occurrences(grad_out_ptr, src_ptr, scale_ptr, start, count, cols, tile_mask,
                     BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr,
                     BLOCK_D: tl.constexpr):  # fmt: skip
    """``[BLOCK_R, BLOCK_D]``: row r's ``sum_j scale[j] * grad_out_flat[src[j] + cols]`` over
    sorted occurrences ``j = start[r] .. start[r] + count[r] - 1``, in that order.

    BLOCK_L occurrences of every row per step as one ``[BLOCK_R, BLOCK_L, BLOCK_D]`` tile
    (reduced over L at the end), the next step's ``src``/``scale`` loaded meanwhile: the
    short-run kernel takes many rows and one occurrence per step, the long-run kernel one
    chunk and BLOCK_L. ``tile_mask`` ``[BLOCK_R, BLOCK_D]`` marks the columns to read.
    """
    step = tl.arange(0, BLOCK_L)
    pos = start[:, None] + step[None, :]
    live = step[None, :] < count[:, None]
    src = tl.load(src_ptr + pos, mask=live, other=0)
    scale = tl.load(scale_ptr + pos, mask=live, other=0.0)
    acc = tl.zeros([BLOCK_R, BLOCK_L, BLOCK_D], dtype=tl.float32)
    for l0 in range(0, tl.max(count, axis=0), BLOCK_L):
        g = tl.load(
            grad_out_ptr + src[:, :, None] + cols[None, None, :],
            mask=live[:, :, None] & tile_mask[:, None, :],
            other=0.0,
        )
        pos += BLOCK_L
        live_next = (l0 + BLOCK_L + step)[None, :] < count[:, None]
        src_next = tl.load(src_ptr + pos, mask=live_next, other=0)
        scale_next = tl.load(scale_ptr + pos, mask=live_next, other=0.0)
        acc += g.to(tl.float32) * scale[:, :, None]
        src, scale, live = src_next, scale_next, live_next
    return tl.sum(acc, axis=1)


@triton.jit
def _store_or_update(acc, mask, live, run, cols, dim, grad_offsets_ptr, grad_rows_ptr,
                     row_table_ptr, row_ids_ptr, weights_ptr, table_offsets_ptr, hyper_ptr,
                     state_ptr, state_offsets_ptr, state2_ptr, full_dims_ptr, error_ptr,
                     KIND: tl.constexpr):  # fmt: skip
    """Rows ``run`` (``[R]``) of summed gradient ``acc``: stored at ``grad_offsets`` (KIND 0)
    or, with KIND > 0, applied by ``apply_row_update`` to rows ``(row_table, row_ids)``."""
    if KIND == 0:
        goff = tl.load(grad_offsets_ptr + run, mask=live, other=0)
        tl.store(grad_rows_ptr + goff[:, None] + cols[None, :], acc, mask=mask)
    else:
        table = tl.load(row_table_ptr + run, mask=live, other=0)
        row = tl.load(row_ids_ptr + run, mask=live, other=0).to(tl.int64)
        apply_row_update(
            acc, mask, live, table, row, cols, dim, weights_ptr, table_offsets_ptr, hyper_ptr,
            state_ptr, state_offsets_ptr, state2_ptr, full_dims_ptr, error_ptr, KIND,
        )  # fmt: skip


@triton.jit
def _short_runs_kernel(
    grad_out_ptr, src_ptr, scale_ptr, starts_ptr, row_dim_ptr, counts_ptr, grad_offsets_ptr,
    grad_rows_ptr, row_table_ptr, row_ids_ptr, weights_ptr, table_offsets_ptr, hyper_ptr,
    state_ptr, state_offsets_ptr, state2_ptr, full_dims_ptr, error_ptr,
    KIND: tl.constexpr, SHORT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Runs of at most SHORT occurrences, BLOCK_R to a tile, one occurrence per step.

    Grid ``(P, cdiv(max_dim, BLOCK_D))``: program (p, c) takes run blocks ``p, p + P, ...``
    up to ``counts[0]`` runs and columns ``c * BLOCK_D ...`` below each run's dim; run r's
    sorted occurrences are ``starts[r] .. starts[r + 1]``. Longer runs are the long-run
    kernel's. One writer per element, no atomics.
    """
    d0 = tl.program_id(1) * BLOCK_D
    cols = d0 + tl.arange(0, BLOCK_D)
    num_runs = tl.load(counts_ptr).to(tl.int32)
    for first in range(tl.program_id(0) * BLOCK_R, num_runs, tl.num_programs(0) * BLOCK_R):
        runs = first + tl.arange(0, BLOCK_R)
        in_range = runs < num_runs
        start = tl.load(starts_ptr + runs, mask=in_range, other=0)
        count = tl.load(starts_ptr + runs + 1, mask=in_range, other=0) - start
        dim = tl.load(row_dim_ptr + runs, mask=in_range, other=0)
        mine = in_range & (count <= SHORT) & (d0 < dim)
        tile_mask = mine[:, None] & (cols[None, :] < dim[:, None])
        acc = _sum_occurrences(grad_out_ptr, src_ptr, scale_ptr, start, tl.where(mine, count, 0),
                               cols, tile_mask, BLOCK_R, 1, BLOCK_D)  # fmt: skip
        _store_or_update(
            acc, tile_mask, mine, runs, cols, dim, grad_offsets_ptr, grad_rows_ptr,
            row_table_ptr, row_ids_ptr, weights_ptr, table_offsets_ptr, hyper_ptr, state_ptr,
            state_offsets_ptr, state2_ptr, full_dims_ptr, error_ptr, KIND,
        )  # fmt: skip


@triton.jit
def _partial_slot(pos, chunk, CHUNK: tl.constexpr):
    """The partials row of the chunk starting at sorted position ``pos``: two per CHUNK
    window (a window holds at most two chunk starts of runs longer than CHUNK: a later
    chunk of one run and the first chunk of the next), so slots need 2 * cdiv(N, CHUNK)."""
    return 2 * (pos // CHUNK) + tl.where(chunk == 0, 1, 0)


@triton.jit
def _long_runs_kernel(
    grad_out_ptr, src_ptr, scale_ptr, starts_ptr, row_dim_ptr, counts_ptr, item_run_ptr,
    item_chunk_ptr, partials_ptr, part_stride, grad_offsets_ptr, grad_rows_ptr, row_table_ptr,
    row_ids_ptr, weights_ptr, table_offsets_ptr, hyper_ptr, state_ptr, state_offsets_ptr,
    state2_ptr, full_dims_ptr, error_ptr,
    KIND: tl.constexpr, CHUNK: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One chunk of a long run per step: the sum of up to CHUNK of its occurrences.

    Grid ``(P, cdiv(max_dim, BLOCK_D))``: program p takes items ``p, p + P, ...`` up to
    ``counts[1]``; item i is chunk ``c = item_chunk[i]`` of run ``r = item_run[i]``, sorted
    occurrences ``starts[r] + c * CHUNK ...`` (BLOCK_L per step). A run of one chunk is
    stored (or updated) here; a longer run's chunks store fp32 partials at their
    ``_partial_slot`` rows, which ``_sum_partials_kernel`` adds up. Masks come from
    integer limits (the interpreter mishandles tensor & scalar-bool masks).
    """
    d0 = tl.program_id(1) * BLOCK_D
    cols = d0 + tl.arange(0, BLOCK_D)
    one = tl.arange(0, 1)
    num_items = tl.load(counts_ptr + 1).to(tl.int32)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        run = tl.load(item_run_ptr + item + one).to(tl.int64)
        chunk = tl.load(item_chunk_ptr + item + one).to(tl.int64)
        run_start = tl.load(starts_ptr + run)
        run_end = tl.load(starts_ptr + run + 1)
        start = run_start + chunk * CHUNK
        count = tl.minimum(start + CHUNK, run_end) - start
        dim = tl.load(row_dim_ptr + run)
        count = tl.where(d0 < dim, count, 0)
        tile_mask = cols[None, :] < dim[:, None]
        acc = _sum_occurrences(grad_out_ptr, src_ptr, scale_ptr, start, count, cols, tile_mask,
                               1, BLOCK_L, BLOCK_D)  # fmt: skip
        whole = run_end - run_start <= CHUNK
        whole_dim = tl.where(whole, dim, 0)
        _store_or_update(
            acc, cols[None, :] < whole_dim[:, None], whole_dim > d0, run, cols, dim,
            grad_offsets_ptr, grad_rows_ptr, row_table_ptr, row_ids_ptr, weights_ptr,
            table_offsets_ptr, hyper_ptr, state_ptr, state_offsets_ptr, state2_ptr,
            full_dims_ptr, error_ptr, KIND,
        )  # fmt: skip
        slot = _partial_slot(start, chunk, CHUNK).to(tl.int64) * part_stride
        part_dim = dim - whole_dim
        tl.store(partials_ptr + slot[:, None] + cols[None, :], acc,
                 mask=cols[None, :] < part_dim[:, None])  # fmt: skip


@triton.jit
def _sum_partials_kernel(
    partials_ptr, part_stride, starts_ptr, row_dim_ptr, counts_ptr, item_run_ptr,
    item_chunk_ptr, grad_offsets_ptr, grad_rows_ptr, row_table_ptr, row_ids_ptr, weights_ptr,
    table_offsets_ptr, hyper_ptr, state_ptr, state_offsets_ptr, state2_ptr, full_dims_ptr,
    error_ptr,
    KIND: tl.constexpr, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The runs longer than CHUNK: the sum of their chunks' partials, in chunk order.

    Grid and items as ``_long_runs_kernel``'s; only a run's first item (chunk 0) works: its
    ``n = cdiv(len, CHUNK)`` partials are read BLOCK_C at a time into a ``[BLOCK_C,
    BLOCK_D]`` tile and reduced at the end: a fixed order, so two runs agree bit for bit.
    """
    d0 = tl.program_id(1) * BLOCK_D
    cols = d0 + tl.arange(0, BLOCK_D)
    one = tl.arange(0, 1)
    num_items = tl.load(counts_ptr + 1).to(tl.int32)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        run = tl.load(item_run_ptr + item + one).to(tl.int64)
        run_start = tl.load(starts_ptr + run)
        num_chunks = (tl.load(starts_ptr + run + 1) - run_start + CHUNK - 1) // CHUNK
        dim = tl.load(row_dim_ptr + run)
        lead = (tl.load(item_chunk_ptr + item + one) == 0) & (num_chunks > 1) & (d0 < dim)
        stop = tl.max(tl.where(lead, num_chunks, 0), axis=0)
        col_mask = cols < tl.max(dim, axis=0)
        acc = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
        for c0 in range(0, stop, BLOCK_C):
            chunk = c0 + tl.arange(0, BLOCK_C)
            pos = tl.max(run_start, axis=0) + chunk * CHUNK
            rows = _partial_slot(pos, chunk, CHUNK).to(tl.int64) * part_stride
            mask = (chunk < stop)[:, None] & col_mask[None, :]
            acc += tl.load(partials_ptr + rows[:, None] + cols[None, :], mask=mask, other=0.0)
        lead_dim = tl.where(lead, dim, 0)
        _store_or_update(
            tl.sum(acc, axis=0)[None, :], cols[None, :] < lead_dim[:, None], lead_dim > d0, run,
            cols, dim, grad_offsets_ptr, grad_rows_ptr, row_table_ptr, row_ids_ptr,
            weights_ptr, table_offsets_ptr, hyper_ptr, state_ptr, state_offsets_ptr,
            state2_ptr, full_dims_ptr, error_ptr, KIND,
        )  # fmt: skip


def _bwd_blocks(max_dim: int) -> tuple[int, int, int]:
    """(BLOCK_D, column blocks, rows per program of the short-run kernel)."""
    block_d = min(2 * _MAX_BLOCK_D, triton.next_power_of_2(max(int(max_dim), 1)))
    block_r = max(1, min(128, _BWD_TILE // block_d))
    return block_d, triton.cdiv(max(int(max_dim), 1), block_d), block_r


def _programs(device: torch.device, blocks: int) -> int:
    """Persistent programs for ``blocks`` blocks of work: enough to fill the GPU's
    multiprocessors (each loops over its share), fewer in Triton's CPU interpreter."""
    if device.type == "cuda":
        return max(1, min(blocks, _multiprocessors(device.index) * _PROGRAMS_PER_SM))
    return max(1, min(blocks, 4))


@functools.lru_cache(maxsize=16)
def _multiprocessors(index: int | None) -> int:
    return torch.cuda.get_device_properties(index or 0).multi_processor_count


@functools.lru_cache(maxsize=16)
def _no_error(device: torch.device) -> Tensor:
    """A zero error flag (read only) for updates given none."""
    return torch.zeros(2, dtype=torch.int32, device=device)


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
    row_base: Tensor | None = None,
    update: FusedRowUpdate | None = None,
) -> RowGrads | None:
    """Deterministic row-sparse gradient of :func:`embedding_bag_fwd` w.r.t. the tables.

    ``grad_out`` is ``[B, total_dim]``; the other arguments are the forward's (layout in the
    module docstring; ``num_rows`` int64 ``[U]`` is rows per table, ``row_base`` its
    exclusive cumsum when the caller has it, ``total_rows`` its sum). Ids outside their
    table are skipped (no row gets their gradient). Occurrences are stably sorted by row
    key; a row with at most ``chunk_size`` occurrences (default 256) is summed in that order
    by one program (many short rows share a program), a hotter row's occurrences are split
    into chunks of ``chunk_size`` summed in parallel into fp32 partials, then added up in a
    fixed order. No float atomics: two runs give bit-identical results.

    With ``update`` (an optimizer and its packed weights and state) nothing is stored and
    None comes back: each row is updated in place where its gradient would be stored (one
    pass, no gradient buffer), rows untouched while ``update.error`` is set; this never
    waits for the device when ``max_dim`` and ``total_rows`` are given. Row-wise Adagrad
    needs whole rows in one tile (``max_dim <= MAX_FUSED_ROWWISE_DIM``). Without ``update``
    the rows come back (one host read: their number and size).

    Example::

        g = embedding_bag_bwd_rows(grad_out, dims, num_rows, entry_table, out_cols,
                                   ids, offsets, B, total_dim, mean)
        sgd_update_rows(w, toff, dims, g.row_table, g.row_ids, g.grad_rows,
                        g.grad_offsets, lr=0.1)
    """
    device = grad_out.device
    dims = dims.to(torch.int32)
    max_d = _max_dim(dims, max_dim)
    block_d, col_blocks, block_r = _bwd_blocks(max_d)
    if update is not None and update.kind == ROWWISE_ADAGRAD and col_blocks > 1:
        raise ValueError(f"fused row-wise Adagrad needs dims <= {MAX_FUSED_ROWWISE_DIM}")
    num_occ = values.numel()
    if num_occ == 0:
        if update is not None:
            return None
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return RowGrads(empty, empty.int(), empty, empty, empty.float())
    chunk = int(chunk_size or _SEG_CHUNK)
    short = max(1, min(_SHORT_SEG, chunk // 2))
    num_rows = num_rows.to(torch.int64)
    if per_sample_weights is not None:
        per_sample_weights = per_sample_weights.float().contiguous()
    if row_base is None:
        row_base = torch.cumsum(num_rows, 0) - num_rows
    if total_rows is None:
        total_rows = int(num_rows.sum())  # a host read; callers that know it pass it
    runs = find_runs(
        values, offsets.to(torch.int64), entry_table, row_base.to(torch.int64), num_rows,
        total_rows, dims, batch_size, total_dim, out_cols, mean, per_sample_weights, short,
        chunk,
    )  # fmt: skip
    if update is None:
        grad_offsets, grad_rows, num_runs = _grad_buffers(runs)
        grad_arg = _nonempty(grad_rows)
        upd = (grad_offsets, grad_arg, runs.row_table, runs.row_ids) + (grad_arg,) * 8
        kind = 0
    else:
        kind = update.kind
        error = _no_error(device) if update.error is None else update.error
        dummy = runs.row_dim
        upd = (dummy, dummy, runs.row_table, runs.row_ids, *update[1:-1], error)
    grad_out = grad_out.contiguous()
    programs = _programs(device, triton.cdiv(num_occ, block_r))
    _short_runs_kernel[(programs, col_blocks)](
        grad_out, runs.src, runs.scale, runs.starts, runs.row_dim, runs.counts, *upd,
        KIND=kind, SHORT=short, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=_BWD_WARPS,
    )  # fmt: skip
    # Partials: two rows of max_d per chunk window (``_partial_slot``).
    partials = torch.empty(2 * triton.cdiv(num_occ, chunk) * max_d, dtype=torch.float32,
                           device=device)  # fmt: skip
    programs = _programs(device, runs.items)
    items = (runs.starts, runs.row_dim, runs.counts, runs.item_run, runs.item_chunk)
    _long_runs_kernel[(programs, col_blocks)](
        grad_out, runs.src, runs.scale, *items, partials, max_d, *upd, KIND=kind, CHUNK=chunk,
        BLOCK_L=_BWD_BLOCK_L, BLOCK_D=block_d, num_warps=_BWD_WARPS,
    )  # fmt: skip
    _sum_partials_kernel[(programs, col_blocks)](
        partials, max_d, *items, *upd, KIND=kind, CHUNK=chunk, BLOCK_C=_BLOCK_C,
        BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    if update is not None:
        return None
    k = num_runs
    return RowGrads(runs.unique_keys[:k], runs.row_table[:k], runs.row_ids[:k],
                    grad_offsets[:k], grad_rows)  # fmt: skip


def _grad_buffers(runs: Runs) -> tuple[Tensor, Tensor, int]:
    """Each run's offset in a packed gradient buffer, the buffer, and the number of runs:
    the one host read of the unfused backward (rows and their total size)."""
    ends = torch.cumsum(runs.row_dim, 0)
    last = (runs.counts[:1] - 1).clamp(min=0)
    size = torch.where(runs.counts[:1] > 0, ends.index_select(0, last), 0)
    num_runs, grad_size = torch.cat([runs.counts[:1], size]).tolist()
    grad_offsets = ends - runs.row_dim
    return grad_offsets, torch.empty(grad_size, dtype=torch.float32, device=ends.device), num_runs
