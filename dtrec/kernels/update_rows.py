"""Triton kernels of the fused optimizers: update only the touched rows of packed tables.

Each kernel does its own loads and stores; the arithmetic of every rule is the
shared ``row_updates`` helpers (the same the fused backward applies).

One program per (row or block of rows); deterministic, in place; fp32 math,
results stored in the weights' dtype; states fp32. Layout as in
``embedding_bag.py`` (``row_table``, ``row_ids``, ``grad_rows``,
``grad_offsets`` come from ``embedding_bag_bwd_rows``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dtrec.kernels.embedding_bag import _dim_blocks, _max_dim
from dtrec.kernels.row_updates import adam_moments, adam_step, rowwise_adagrad_step, sgd_step

_ADAGRAD_MAX_BLOCK_D = 512  # wider rows: one program per row, column blocks in a loop


_ADAGRAD_TILE = 1024  # elements of the row-block kernel's [rows, BLOCK_D] tile


_ADAGRAD_WARPS = 2


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
    w = sgd_step(w, g, lr)
    tl.store(weights_ptr + w_off + cols, w.to(weights_ptr.dtype.element_ty), mask=mask)


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
    full = tl.load(full_dims_ptr + table).to(tl.float32)
    s, multiplier = rowwise_adagrad_step(tl.load(s_ptr), sq, full, lr, eps)
    tl.store(s_ptr, s)
    for d0 in range(0, dim, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = cols < dim
        g = tl.load(grad_rows_ptr + g_off + cols, mask=mask, other=0.0)
        w = tl.load(weights_ptr + w_off + cols, mask=mask, other=0.0).to(tl.float32)
        w = sgd_step(w, g, multiplier)
        tl.store(weights_ptr + w_off + cols, w.to(weights_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rowwise_adagrad_row_block_kernel(
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
    num_rows,
    lr,
    eps,
    HAS_ROW_SQ_SUM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``_rowwise_adagrad_update_rows_kernel``'s update, BLOCK_R whole rows per program.

    Grid ``(cdiv(K, BLOCK_R),)`` with ``BLOCK_D >= max_dim``: program p updates the touched
    rows ``k = p * BLOCK_R ...`` as one ``[BLOCK_R, BLOCK_D]`` tile (each row's gradient is
    read once, its sum of squares reduced along the tile's columns). Same math and layouts.
    """
    ks = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = ks < num_rows
    table = tl.load(row_table_ptr + ks, mask=live, other=0)
    row = tl.load(row_ids_ptr + ks, mask=live, other=0).to(tl.int64)
    dim = tl.load(dims_ptr + table, mask=live, other=0)
    w_off = tl.load(table_offsets_ptr + table, mask=live, other=0) + row * dim
    g_off = tl.load(grad_offsets_ptr + ks, mask=live, other=0)
    cols = tl.arange(0, BLOCK_D)
    mask = live[:, None] & (cols[None, :] < dim[:, None])
    g = tl.load(grad_rows_ptr + g_off[:, None] + cols[None, :], mask=mask, other=0.0)
    # Every load before the state store, which the compiler may not move loads across.
    w_ptrs = weights_ptr + w_off[:, None] + cols[None, :]
    w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    s_ptrs = state_ptr + tl.load(state_offsets_ptr + table, mask=live, other=0) + row
    s = tl.load(s_ptrs, mask=live, other=0.0)
    if HAS_ROW_SQ_SUM:
        sq = tl.load(row_sq_sum_ptr + ks, mask=live, other=0.0).to(tl.float32)
    else:
        sq = tl.sum(g * g, axis=1)
    full = tl.load(full_dims_ptr + table, mask=live, other=1).to(tl.float32)
    s, multiplier = rowwise_adagrad_step(s, sq, full, lr, eps)
    tl.store(s_ptrs, s, mask=live)
    w = sgd_step(w, g, multiplier[:, None])
    tl.store(w_ptrs, w.to(weights_ptr.dtype.element_ty), mask=mask)


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
    m, v = adam_moments(m, v, g, beta1, beta2)
    tl.store(exp_avg_ptr + w_off + cols, m, mask=mask)
    tl.store(exp_avg_sq_ptr + w_off + cols, v, mask=mask)
    w = tl.load(weights_ptr + w_off + cols, mask=mask, other=0.0).to(tl.float32)
    w = adam_step(w, m, v, lr_over_bc1, sqrt_bc2, eps)
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
    num_rows = row_table.numel()
    if num_rows == 0:
        return
    args = (
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
    )
    dim = _max_dim(dims, max_dim)
    if dim <= _ADAGRAD_MAX_BLOCK_D:  # whole rows in one tile, several rows per program
        block_d = triton.next_power_of_2(max(dim, 1))
        block_r = max(1, min(64, _ADAGRAD_TILE // block_d))
        _rowwise_adagrad_row_block_kernel[(triton.cdiv(num_rows, block_r),)](
            *args, num_rows, float(lr), float(eps), HAS_ROW_SQ_SUM=row_sq_sum is not None,
            BLOCK_R=block_r, BLOCK_D=block_d, num_warps=_ADAGRAD_WARPS,
        )  # fmt: skip
        return
    block_d, _, num_warps = _dim_blocks(dim)
    _rowwise_adagrad_update_rows_kernel[(num_rows,)](
        *args, float(lr), float(eps), HAS_ROW_SQ_SUM=row_sq_sum is not None, BLOCK_D=block_d,
        num_warps=num_warps,
    )  # fmt: skip


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
