"""Triton kernels for the multi-table pooled embedding lookup, its backward and fused optimizers.

Plain tensors only: nothing here knows of DTensor, meshes or process groups, and
there is no autograd. Each kernel sits beside its launcher and its pure-torch
reference (``*_reference``); ``tests/ops/test_triton_kernels.py`` compares them.

Packed layout shared by every kernel here:

* ``weights``: one flat 1-D buffer (fp32, bf16 or fp16) holding all U local tables.
  Table ``u`` is ``weights[table_offsets[u] : table_offsets[u] + rows_u * dims[u]]``,
  row-major: row ``r`` starts at ``table_offsets[u] + r * dims[u]`` (a row is contiguous).
* ``table_offsets`` int64 ``[U]``; ``dims`` int32 ``[U]``; ``num_rows`` int64 ``[U]``.
* E entries (one feature reading one table; several may share a table):
  ``entry_table`` int32 ``[E]``, ``out_cols`` int32 ``[E]`` (first output column of the
  entry), ``mean`` int8/bool ``[E]`` (mean instead of sum pooling).
* ``values`` int32/int64 ids local to their table, entry-major then bag-major;
  ``offsets`` int64 ``[E * B + 1]``, bag ``(e, b)`` is
  ``values[offsets[e * B + b] : offsets[e * B + b + 1]]``; ``offsets[0] == 0`` and
  ``offsets[-1] == len(values)``. Optional ``per_sample_weights`` fp32 ``[N]``.
* pooled output ``[B, total_dim]`` row-major; entry e fills columns
  ``out_cols[e] : out_cols[e] + dims[entry_table[e]]``.

Everything accumulates in fp32. Run on CPU tensors with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = [
    "RowGrads",
    "adam_update_rows",
    "adam_update_rows_reference",
    "embedding_bag_bwd_rows",
    "embedding_bag_bwd_rows_reference",
    "embedding_bag_fwd",
    "embedding_bag_fwd_reference",
    "rowwise_adagrad_update_rows",
    "rowwise_adagrad_update_rows_reference",
    "sgd_update_rows",
    "sgd_update_rows_reference",
]

_MAX_BLOCK_D = 128
_BLOCK_L = 16


def _dim_blocks(max_dim: int) -> tuple[int, int, int]:
    """(BLOCK_D, number of column blocks, num_warps) for rows of up to ``max_dim`` columns."""
    block_d = min(_MAX_BLOCK_D, triton.next_power_of_2(max(int(max_dim), 1)))
    return block_d, triton.cdiv(max(int(max_dim), 1), block_d), max(1, min(4, block_d // 32))


def _max_dim(dims: Tensor, max_dim: int | None) -> int:
    # .item() syncs on GPU; callers that know their dims pass max_dim.
    return int(dims.max().item()) if max_dim is None else int(max_dim)


def _nonempty(t: Tensor) -> Tensor:
    # An empty tensor may have a null data pointer, which a launch may reject; the kernels
    # never read it then, so any one-element tensor of the same dtype will do.
    return t if t.numel() > 0 else t.new_zeros(1)


# --------------------------------------------------------------------------- forward


@triton.jit
def _embedding_bag_fwd_kernel(
    weights_ptr,
    table_offsets_ptr,
    dims_ptr,
    entry_table_ptr,
    out_cols_ptr,
    values_ptr,
    offsets_ptr,
    mean_ptr,
    psw_ptr,
    bounds_ptr,
    error_ptr,
    out_ptr,
    batch_size,
    total_dim,
    HAS_PSW: tl.constexpr,
    HAS_BOUNDS: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[b, out_cols[e] + d] = scale_e(b) * sum_i psw[i] * W_t[values[i], d], t = entry_table[e].

    Grid ``(E * B, cdiv(max_dim, BLOCK_D))``: program (bag, k) pools columns
    ``k * BLOCK_D ...`` of bag ``bag = e * B + b``, over ``i`` in
    ``offsets[bag] .. offsets[bag + 1]``. ``W_t[r, d] = weights[table_offsets[t] + r * dims[t]
    + d]`` (d contiguous). ``scale = 1 / len`` for mean entries (0 for an empty bag, whose sum
    is 0), else 1; ``psw = 1`` without per-sample weights. The bag is read BLOCK_L ids at a
    time as one ``[BLOCK_L, BLOCK_D]`` tile. With HAS_BOUNDS an id outside
    ``[0, bounds[t])`` adds nothing (it is never dereferenced) and sets ``error[0] = 1``,
    ``error[1] = max`` bad entry index.
    """
    bag = tl.program_id(0)
    d0 = tl.program_id(1) * BLOCK_D
    entry = bag // batch_size
    b = bag - entry * batch_size
    table = tl.load(entry_table_ptr + entry)
    dim = tl.load(dims_ptr + table)
    base = tl.load(table_offsets_ptr + table).to(tl.int64)
    start = tl.load(offsets_ptr + bag).to(tl.int64)
    end = tl.load(offsets_ptr + bag + 1).to(tl.int64)
    # Column blocks past this table's dim do no work (an empty loop, not an early return).
    stop = tl.where(d0 < dim, end, start)
    cols = d0 + tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    if HAS_BOUNDS:
        num_rows = tl.load(bounds_ptr + table)
    num_bad = tl.zeros([BLOCK_L], dtype=tl.int32)

    acc = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    for l0 in range(start, stop, BLOCK_L):
        pos = l0 + tl.arange(0, BLOCK_L)
        l_mask = pos < stop
        ids = tl.load(values_ptr + pos, mask=l_mask, other=0).to(tl.int64)
        if HAS_BOUNDS:
            bad = l_mask & ((ids < 0) | (ids >= num_rows))
            num_bad += bad.to(tl.int32)
            l_mask = l_mask & (~bad)
        row_ptrs = weights_ptr + base + ids[:, None] * dim + cols[None, :]
        rows = tl.load(row_ptrs, mask=l_mask[:, None] & col_mask[None, :], other=0.0)
        rows = rows.to(tl.float32)
        if HAS_PSW:
            psw = tl.load(psw_ptr + pos, mask=l_mask, other=0.0)
            rows = rows * psw[:, None]
        acc += rows

    if HAS_BOUNDS:  # noqa: SIM102 (a constexpr branch: compiled out without bounds)
        # One reduction and (rarely) two atomics per program, outside the hot loop.
        if tl.sum(num_bad, axis=0) > 0:
            tl.atomic_max(error_ptr, 1)
            tl.atomic_max(error_ptr + 1, entry)

    pooled = tl.sum(acc, axis=0)
    count = tl.maximum(end - start, 1).to(tl.float32)
    is_mean = tl.load(mean_ptr + entry) != 0
    pooled = pooled * tl.where(is_mean, 1.0 / count, 1.0)
    out_col = tl.load(out_cols_ptr + entry).to(tl.int64)
    out_ptrs = out_ptr + b.to(tl.int64) * total_dim + out_col + cols
    tl.store(out_ptrs, pooled.to(out_ptr.dtype.element_ty), mask=col_mask)


def embedding_bag_fwd(
    weights: Tensor,
    table_offsets: Tensor,
    dims: Tensor,
    entry_table: Tensor,
    out_cols: Tensor,
    values: Tensor,
    offsets: Tensor,
    batch_size: int,
    total_dim: int,
    mean: Tensor,
    per_sample_weights: Tensor | None = None,
    bounds: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    max_dim: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Pooled lookup of E entries over packed tables in one launch; ``[B, total_dim]``.

    Layout: see the module docstring. ``out_dtype`` defaults to the weights dtype;
    ``max_dim`` (largest ``dims[u]``) avoids a device sync when given. Mean pooling with
    per-sample weights divides the weighted sum by the bag length.

    Bounds check: with ``bounds`` (int64 ``[U]``, rows per table) every id is checked
    against ``[0, bounds[t])`` inside the kernel, bad ids contribute zero (and are never
    read), and the result is ``(out, error)``: ``error`` int32 ``[2]`` with ``error[0] == 1``
    if any id was bad and ``error[1]`` the largest entry index holding one. The caller
    checks ``error`` later (one small read, no extra pass over the ids).

    Example::

        out = embedding_bag_fwd(w, toff, dims, entry_table, out_cols, ids, offsets,
                                batch_size=B, total_dim=sum_d, mean=mean)
    """
    num_bags = offsets.numel() - 1
    out = torch.zeros(
        (batch_size, total_dim), dtype=out_dtype or weights.dtype, device=weights.device
    )
    error = torch.zeros(2, dtype=torch.int32, device=weights.device)
    if num_bags > 0 and total_dim > 0 and weights.numel() > 0:
        block_d, col_blocks, num_warps = _dim_blocks(_max_dim(dims, max_dim))
        values = _nonempty(values)
        psw = values if per_sample_weights is None else per_sample_weights.float()
        _embedding_bag_fwd_kernel[(num_bags, col_blocks)](
            weights,
            table_offsets.to(torch.int64),
            dims.to(torch.int32),
            entry_table.to(torch.int32),
            out_cols.to(torch.int32),
            values,
            offsets.to(torch.int64),
            mean.to(torch.int8),
            _nonempty(psw),
            error if bounds is None else bounds.to(torch.int64),
            error,
            out,
            batch_size,
            total_dim,
            HAS_PSW=per_sample_weights is not None,
            HAS_BOUNDS=bounds is not None,
            BLOCK_L=_BLOCK_L,
            BLOCK_D=block_d,
            num_warps=num_warps,
        )
    return out if bounds is None else (out, error)


def embedding_bag_fwd_reference(
    weights: Tensor,
    table_offsets: Tensor,
    dims: Tensor,
    entry_table: Tensor,
    out_cols: Tensor,
    values: Tensor,
    offsets: Tensor,
    batch_size: int,
    total_dim: int,
    mean: Tensor,
    per_sample_weights: Tensor | None = None,
    bounds: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Bag-by-bag torch version of :func:`embedding_bag_fwd` (``error`` is a bool here)."""
    out = torch.zeros((batch_size, total_dim), dtype=torch.float32, device=weights.device)
    any_bad = torch.zeros((), dtype=torch.bool, device=weights.device)
    for e in range(entry_table.numel()):
        t = int(entry_table[e])
        dim, base, col = int(dims[t]), int(table_offsets[t]), int(out_cols[e])
        for b in range(batch_size):
            lo, hi = int(offsets[e * batch_size + b]), int(offsets[e * batch_size + b + 1])
            ids = values[lo:hi].long()
            scale = torch.ones(hi - lo, dtype=torch.float32, device=weights.device)
            if per_sample_weights is not None:
                scale = per_sample_weights[lo:hi].float()
            if bounds is not None:
                ok = (ids >= 0) & (ids < int(bounds[t]))
                any_bad |= ~ok.all()
                ids, scale = torch.where(ok, ids, 0), torch.where(ok, scale, 0.0)
            rows = weights[base + ids[:, None] * dim + torch.arange(dim, device=ids.device)].float()
            pooled = (rows * scale[:, None]).sum(0)
            if bool(mean[e]) and hi > lo:
                pooled = pooled / (hi - lo)
            out[b, col : col + dim] = pooled
    out = out.to(out_dtype or weights.dtype)
    return out if bounds is None else (out, any_bad)


# --------------------------------------------------------------------------- backward


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


@triton.jit
def _segment_grad_kernel(
    grad_out_ptr,
    occ_src_ptr,
    occ_scale_ptr,
    seg_bounds_ptr,
    row_dim_ptr,
    grad_offsets_ptr,
    grad_rows_ptr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """grad_rows[grad_offsets[k] + d] = sum_j occ_scale[j] * grad_out_flat[occ_src[j] + d].

    Grid ``(K, cdiv(max_dim, BLOCK_D))``: program (k, c) sums the occurrences ``j`` in
    ``seg_bounds[k] .. seg_bounds[k + 1]`` of unique row k, in their (stable) sorted order,
    for columns ``c * BLOCK_D ...`` below ``row_dim[k]``. ``grad_out_flat`` is the row-major
    ``[B, total_dim]`` output gradient (d contiguous); ``occ_src[j] = b * total_dim +
    out_cols[e]`` for the bag (e, b) of occurrence j; ``occ_scale[j] = psw * (1/len if mean)``.
    Each output element is written by exactly one program in a fixed order: deterministic,
    no atomics.
    """
    seg = tl.program_id(0)
    d0 = tl.program_id(1) * BLOCK_D
    dim = tl.load(row_dim_ptr + seg)
    start = tl.load(seg_bounds_ptr + seg)
    end = tl.load(seg_bounds_ptr + seg + 1)
    stop = tl.where(d0 < dim, end, start)
    cols = d0 + tl.arange(0, BLOCK_D)
    col_mask = cols < dim

    acc = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    for l0 in range(start, stop, BLOCK_L):
        pos = l0 + tl.arange(0, BLOCK_L)
        l_mask = pos < stop
        src = tl.load(occ_src_ptr + pos, mask=l_mask, other=0)
        scale = tl.load(occ_scale_ptr + pos, mask=l_mask, other=0.0)
        g_ptrs = grad_out_ptr + src[:, None] + cols[None, :]
        g = tl.load(g_ptrs, mask=l_mask[:, None] & col_mask[None, :], other=0.0)
        acc += g.to(tl.float32) * scale[:, None]

    goff = tl.load(grad_offsets_ptr + seg)
    tl.store(grad_rows_ptr + goff + cols, tl.sum(acc, axis=0), mask=col_mask)


def _occurrences(
    dims: Tensor,
    num_rows: Tensor,
    entry_table: Tensor,
    out_cols: Tensor,
    values: Tensor,
    offsets: Tensor,
    batch_size: int,
    total_dim: int,
    mean: Tensor,
    per_sample_weights: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per id occurrence: (row key, table, grad_out source offset, scale)."""
    device = values.device
    lengths = offsets[1:] - offsets[:-1]
    bag = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=device), lengths, output_size=values.numel()
    )
    entry = bag // batch_size
    table = entry_table.long()[entry]
    row_base = torch.cumsum(num_rows.long(), 0) - num_rows.long()
    keys = row_base[table] + values.long()
    src = (bag - entry * batch_size) * total_dim + out_cols.long()[entry]
    inv_len = 1.0 / lengths.view(-1, batch_size).clamp(min=1).float()
    scale = torch.where(mean.bool()[:, None], inv_len, 1.0).reshape(-1)[bag]
    if per_sample_weights is not None:
        scale = scale * per_sample_weights.float()
    return keys, table, src, scale


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
) -> RowGrads:
    """Deterministic row-sparse gradient of :func:`embedding_bag_fwd` w.r.t. the tables.

    ``grad_out`` is ``[B, total_dim]``; the other arguments are the forward's (layout in the
    module docstring; ``num_rows`` int64 ``[U]`` is rows per table). Ids must be in range
    (check the forward's ``error``). Occurrences are stably sorted by row key and each
    unique row's segment is summed in that order by one program: no float atomics, and two
    runs give bit-identical results. Syncs the device (unique rows, grad buffer size).

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
    keys, table, src, scale = _occurrences(
        dims,
        num_rows,
        entry_table,
        out_cols,
        values,
        offsets,
        batch_size,
        total_dim,
        mean,
        per_sample_weights,
    )
    sorted_keys, perm = torch.sort(keys, stable=True)
    unique_keys, counts = torch.unique_consecutive(sorted_keys, return_counts=True)
    seg_bounds = torch.zeros(unique_keys.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts, 0, out=seg_bounds[1:])
    row_table = table[perm[seg_bounds[:-1]]].to(torch.int32)
    row_base = torch.cumsum(num_rows.long(), 0) - num_rows.long()
    row_ids = unique_keys - row_base[row_table.long()]
    row_dim = dims[row_table.long()]
    grad_offsets = torch.cumsum(row_dim.long(), 0) - row_dim.long()
    grad_rows = torch.empty(int(row_dim.sum().item()), dtype=torch.float32, device=device)
    if unique_keys.numel() > 0 and grad_rows.numel() > 0:
        block_d, col_blocks, num_warps = _dim_blocks(_max_dim(dims, max_dim))
        _segment_grad_kernel[(unique_keys.numel(), col_blocks)](
            grad_out.contiguous(),
            src[perm].contiguous(),
            scale[perm].contiguous(),
            seg_bounds,
            row_dim,
            grad_offsets,
            grad_rows,
            BLOCK_L=_BLOCK_L,
            BLOCK_D=block_d,
            num_warps=num_warps,
        )
    return RowGrads(unique_keys, row_table, row_ids, grad_offsets, grad_rows)


def embedding_bag_bwd_rows_reference(
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
) -> RowGrads:
    """Dense per-table torch version of :func:`embedding_bag_bwd_rows`."""
    grads = [torch.zeros(int(r), int(d)) for r, d in zip(num_rows, dims)]
    touched = [torch.zeros(int(r), dtype=torch.bool) for r in num_rows]
    for e in range(entry_table.numel()):
        t, col = int(entry_table[e]), int(out_cols[e])
        for b in range(batch_size):
            lo, hi = int(offsets[e * batch_size + b]), int(offsets[e * batch_size + b + 1])
            ids = values[lo:hi].long()
            scale = torch.ones(hi - lo)
            if per_sample_weights is not None:
                scale = per_sample_weights[lo:hi].float()
            if bool(mean[e]):
                scale = scale / max(hi - lo, 1)
            g = grad_out[b, col : col + int(dims[t])].float()
            grads[t].index_add_(0, ids, scale[:, None] * g[None, :])
            touched[t][ids] = True
    keys, tables, rows, flat = [], [], [], []
    base = 0
    for t, (g, hit) in enumerate(zip(grads, touched)):
        idx = hit.nonzero().flatten()
        keys.append(base + idx)
        tables.append(torch.full_like(idx, t))
        rows.append(idx)
        flat.append(g[idx].flatten())
        base += g.shape[0]
    row_table = torch.cat(tables).to(torch.int32)
    row_dim = dims.long()[row_table.long()]
    return RowGrads(
        torch.cat(keys),
        row_table,
        torch.cat(rows),
        torch.cumsum(row_dim, 0) - row_dim,
        torch.cat(flat),
    )


# --------------------------------------------------------------------------- optimizers


@triton.jit
def _sgd_update_rows_kernel(
    weights_ptr,
    table_offsets_ptr,
    dims_ptr,
    row_table_ptr,
    row_ids_ptr,
    grad_rows_ptr,
    grad_offsets_ptr,
    lr,
    BLOCK_D: tl.constexpr,
):
    """W_t[r, d] -= lr * g[k, d] for touched row k = (t, r) = (row_table[k], row_ids[k]).

    Grid ``(K, cdiv(max_dim, BLOCK_D))``. ``W_t[r, d] = weights[table_offsets[t] + r * dims[t]
    + d]``; ``g[k, d] = grad_rows[grad_offsets[k] + d]`` (fp32); d contiguous in both. Rows
    are distinct, so each element has one writer. Math in fp32, stored in the weights dtype.
    """
    k = tl.program_id(0)
    d0 = tl.program_id(1) * BLOCK_D
    table = tl.load(row_table_ptr + k)
    dim = tl.load(dims_ptr + table)
    w_off = tl.load(table_offsets_ptr + table) + tl.load(row_ids_ptr + k).to(tl.int64) * dim
    g_off = tl.load(grad_offsets_ptr + k)
    cols = d0 + tl.arange(0, BLOCK_D)
    mask = cols < dim
    g = tl.load(grad_rows_ptr + g_off + cols, mask=mask, other=0.0)
    w = tl.load(weights_ptr + w_off + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(weights_ptr + w_off + cols, (w - lr * g).to(weights_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rowwise_adagrad_update_rows_kernel(
    weights_ptr,
    state_ptr,
    state_offsets_ptr,
    table_offsets_ptr,
    dims_ptr,
    full_dims_ptr,
    row_table_ptr,
    row_ids_ptr,
    grad_rows_ptr,
    grad_offsets_ptr,
    row_sq_sum_ptr,
    lr,
    eps,
    HAS_ROW_SQ_SUM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Exact row-wise Adagrad (FBGEMM EXACT_ROWWISE_ADAGRAD) on touched row k = (t, r).

    ``s = state[state_offsets[t] + r] += sq_k / full_dims[t]`` with ``sq_k = row_sq_sum[k]``
    if given, else ``sum_d g[k, d]^2``; then ``W_t[r, :] -= lr * g[k, :] / (sqrt(s) + eps)``.
    Grid ``(K,)``: the whole row needs the new ``s``, so one program walks the row's column
    blocks twice (sum of squares, then update). Layouts as in ``_sgd_update_rows_kernel``;
    ``state`` fp32, one value per row, table t's rows contiguous from ``state_offsets[t]``.
    """
    k = tl.program_id(0)
    table = tl.load(row_table_ptr + k)
    row = tl.load(row_ids_ptr + k).to(tl.int64)
    dim = tl.load(dims_ptr + table)
    w_off = tl.load(table_offsets_ptr + table) + row * dim
    g_off = tl.load(grad_offsets_ptr + k)
    if HAS_ROW_SQ_SUM:
        sq = tl.load(row_sq_sum_ptr + k).to(tl.float32)
    else:
        sq_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, dim, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            g = tl.load(grad_rows_ptr + g_off + cols, mask=cols < dim, other=0.0)
            sq_acc += g * g
        sq = tl.sum(sq_acc, axis=0)
    s_ptr = state_ptr + tl.load(state_offsets_ptr + table) + row
    s = tl.load(s_ptr) + sq / tl.load(full_dims_ptr + table).to(tl.float32)
    tl.store(s_ptr, s)
    multiplier = lr / (tl.sqrt_rn(s) + eps)
    for d0 in range(0, dim, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = cols < dim
        g = tl.load(grad_rows_ptr + g_off + cols, mask=mask, other=0.0)
        w = tl.load(weights_ptr + w_off + cols, mask=mask, other=0.0).to(tl.float32)
        w = w - multiplier * g
        tl.store(weights_ptr + w_off + cols, w.to(weights_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adam_update_rows_kernel(
    weights_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    table_offsets_ptr,
    dims_ptr,
    row_table_ptr,
    row_ids_ptr,
    grad_rows_ptr,
    grad_offsets_ptr,
    lr_over_bc1,
    beta1,
    beta2,
    sqrt_bc2,
    eps,
    BLOCK_D: tl.constexpr,
):
    """torch.optim.Adam step (weight_decay=0) on the elements of touched row k = (t, r).

    ``m = beta1 m + (1 - beta1) g``, ``v = beta2 v + (1 - beta2) g^2``,
    ``W -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)`` with ``bc_i = 1 - beta_i^step``
    folded into ``lr_over_bc1`` and ``sqrt_bc2`` by the launcher. ``exp_avg``/``exp_avg_sq``
    are fp32 with the weights' packing (same ``table_offsets``). Grid
    ``(K, cdiv(max_dim, BLOCK_D))``; layouts as in ``_sgd_update_rows_kernel``.
    """
    k = tl.program_id(0)
    d0 = tl.program_id(1) * BLOCK_D
    table = tl.load(row_table_ptr + k)
    dim = tl.load(dims_ptr + table)
    w_off = tl.load(table_offsets_ptr + table) + tl.load(row_ids_ptr + k).to(tl.int64) * dim
    g_off = tl.load(grad_offsets_ptr + k)
    cols = d0 + tl.arange(0, BLOCK_D)
    mask = cols < dim
    g = tl.load(grad_rows_ptr + g_off + cols, mask=mask, other=0.0)
    m = tl.load(exp_avg_ptr + w_off + cols, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + w_off + cols, mask=mask, other=0.0)
    m = m + (1.0 - beta1) * (g - m)  # torch's lerp form
    v = beta2 * v + (1.0 - beta2) * g * g
    tl.store(exp_avg_ptr + w_off + cols, m, mask=mask)
    tl.store(exp_avg_sq_ptr + w_off + cols, v, mask=mask)
    w = tl.load(weights_ptr + w_off + cols, mask=mask, other=0.0).to(tl.float32)
    w = w - lr_over_bc1 * m / (tl.sqrt_rn(v) / sqrt_bc2 + eps)
    tl.store(weights_ptr + w_off + cols, w.to(weights_ptr.dtype.element_ty), mask=mask)


def _check_packed(**buffers: Tensor) -> None:
    for name, t in buffers.items():
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D packed buffer, got {tuple(t.shape)}")


def sgd_update_rows(
    weights: Tensor,
    table_offsets: Tensor,
    dims: Tensor,
    row_table: Tensor,
    row_ids: Tensor,
    grad_rows: Tensor,
    grad_offsets: Tensor,
    lr: float,
    *,
    max_dim: int | None = None,
) -> None:
    """In place ``W_t[r] -= lr * g`` on the touched rows of the packed ``weights`` only.

    ``row_table``, ``row_ids``, ``grad_rows``, ``grad_offsets`` as in :class:`RowGrads`
    (rows must be distinct).

    Example::

        sgd_update_rows(w, toff, dims, g.row_table, g.row_ids, g.grad_rows, g.grad_offsets, 0.1)
    """
    _check_packed(weights=weights)
    if row_table.numel() == 0:
        return
    block_d, col_blocks, num_warps = _dim_blocks(_max_dim(dims, max_dim))
    _sgd_update_rows_kernel[(row_table.numel(), col_blocks)](
        weights,
        table_offsets.to(torch.int64),
        dims.to(torch.int32),
        row_table.to(torch.int32),
        row_ids.to(torch.int64),
        grad_rows.float(),
        grad_offsets.to(torch.int64),
        float(lr),
        BLOCK_D=block_d,
        num_warps=num_warps,
    )


def rowwise_adagrad_update_rows(
    weights: Tensor,
    state: Tensor,
    state_offsets: Tensor,
    table_offsets: Tensor,
    dims: Tensor,
    row_table: Tensor,
    row_ids: Tensor,
    grad_rows: Tensor,
    grad_offsets: Tensor,
    lr: float,
    eps: float,
    row_sq_sum: Tensor | None = None,
    full_dims: Tensor | None = None,
    *,
    max_dim: int | None = None,
) -> None:
    """In place exact row-wise Adagrad on the touched rows (FBGEMM EXACT_ROWWISE_ADAGRAD).

    ``state`` fp32 holds one value per row, table t's at ``state_offsets[t] + r``. Per row:
    ``state += sum_d g^2 / full_dim; W -= lr * g / (sqrt(state) + eps)``. For a column
    shard, pass ``row_sq_sum`` fp32 ``[K]`` (each row's sum of squares, already all-reduced
    over the column shards) and ``full_dims`` ``[U]`` (each table's full embedding dim);
    ``full_dims`` defaults to ``dims``.

    Example::

        rowwise_adagrad_update_rows(w, state, soff, toff, dims, g.row_table, g.row_ids,
                                    g.grad_rows, g.grad_offsets, lr=0.1, eps=1e-8)
    """
    _check_packed(weights=weights, state=state)
    if row_table.numel() == 0:
        return
    block_d, _, num_warps = _dim_blocks(_max_dim(dims, max_dim))
    _rowwise_adagrad_update_rows_kernel[(row_table.numel(),)](
        weights,
        state,
        state_offsets.to(torch.int64),
        table_offsets.to(torch.int64),
        dims.to(torch.int32),
        (dims if full_dims is None else full_dims).to(torch.int32),
        row_table.to(torch.int32),
        row_ids.to(torch.int64),
        grad_rows.float(),
        grad_offsets.to(torch.int64),
        grad_rows if row_sq_sum is None else row_sq_sum.float(),
        float(lr),
        float(eps),
        HAS_ROW_SQ_SUM=row_sq_sum is not None,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )


def adam_update_rows(
    weights: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    table_offsets: Tensor,
    dims: Tensor,
    row_table: Tensor,
    row_ids: Tensor,
    grad_rows: Tensor,
    grad_offsets: Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    *,
    max_dim: int | None = None,
) -> None:
    """In place torch.optim.Adam step (weight_decay=0) on the touched rows only.

    ``exp_avg``/``exp_avg_sq`` are fp32 packed like ``weights``. ``step`` is one global
    step count (1 on the first update) used for the bias correction of every row; there is
    no per-row step counter, so rows skipped by earlier steps are corrected as if they had
    been updated (the same choice as FBGEMM's TBE Adam).

    Example::

        adam_update_rows(w, m, v, toff, dims, g.row_table, g.row_ids, g.grad_rows,
                         g.grad_offsets, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, step=1)
    """
    _check_packed(weights=weights, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    if row_table.numel() == 0:
        return
    block_d, col_blocks, num_warps = _dim_blocks(_max_dim(dims, max_dim))
    _adam_update_rows_kernel[(row_table.numel(), col_blocks)](
        weights,
        exp_avg,
        exp_avg_sq,
        table_offsets.to(torch.int64),
        dims.to(torch.int32),
        row_table.to(torch.int32),
        row_ids.to(torch.int64),
        grad_rows.float(),
        grad_offsets.to(torch.int64),
        float(lr) / (1.0 - beta1**step),
        float(beta1),
        float(beta2),
        (1.0 - beta2**step) ** 0.5,
        float(eps),
        BLOCK_D=block_d,
        num_warps=num_warps,
    )


def _touched_rows(table_offsets, dims, row_table, row_ids, grad_rows, grad_offsets):
    """Yield (k, table, row, weight slice, fp32 grad row) for each touched row k."""
    for k in range(row_table.numel()):
        t, r = int(row_table[k]), int(row_ids[k])
        dim, g_off = int(dims[t]), int(grad_offsets[k])
        w_off = int(table_offsets[t]) + r * dim
        yield k, t, r, slice(w_off, w_off + dim), grad_rows[g_off : g_off + dim].float()


def sgd_update_rows_reference(
    weights, table_offsets, dims, row_table, row_ids, grad_rows, grad_offsets, lr
) -> None:
    """Row-by-row torch version of :func:`sgd_update_rows` (in place)."""
    for _, _, _, ws, g in _touched_rows(
        table_offsets, dims, row_table, row_ids, grad_rows, grad_offsets
    ):
        weights[ws] = (weights[ws].float() - lr * g).to(weights.dtype)


def rowwise_adagrad_update_rows_reference(
    weights,
    state,
    state_offsets,
    table_offsets,
    dims,
    row_table,
    row_ids,
    grad_rows,
    grad_offsets,
    lr,
    eps,
    row_sq_sum=None,
    full_dims=None,
) -> None:
    """Row-by-row torch version of :func:`rowwise_adagrad_update_rows` (in place)."""
    full_dims = dims if full_dims is None else full_dims
    for k, t, r, ws, g in _touched_rows(
        table_offsets, dims, row_table, row_ids, grad_rows, grad_offsets
    ):
        sq = (g * g).sum() if row_sq_sum is None else row_sq_sum[k].float()
        s = int(state_offsets[t]) + r
        state[s] += sq / int(full_dims[t])
        weights[ws] = (weights[ws].float() - lr * g / (state[s].sqrt() + eps)).to(weights.dtype)


def adam_update_rows_reference(
    weights,
    exp_avg,
    exp_avg_sq,
    table_offsets,
    dims,
    row_table,
    row_ids,
    grad_rows,
    grad_offsets,
    lr,
    beta1,
    beta2,
    eps,
    step,
) -> None:
    """Row-by-row torch version of :func:`adam_update_rows` (in place)."""
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    for _, _, _, ws, g in _touched_rows(
        table_offsets, dims, row_table, row_ids, grad_rows, grad_offsets
    ):
        exp_avg[ws] = beta1 * exp_avg[ws] + (1 - beta1) * g
        exp_avg_sq[ws] = beta2 * exp_avg_sq[ws] + (1 - beta2) * g * g
        denom = exp_avg_sq[ws].sqrt() / bc2**0.5 + eps
        weights[ws] = (weights[ws].float() - lr / bc1 * exp_avg[ws] / denom).to(weights.dtype)
