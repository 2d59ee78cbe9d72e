"""Triton kernels of the fused optimizers: update only the touched rows of packed tables.

One kernel for every rule (``_update_rows_kernel``, the rule a constexpr): it does its
own loads and stores; the arithmetic of every rule is the shared ``row_updates`` helpers
(the same the fused backward applies).

A block of rows per program; deterministic, in place; fp32 math,
results stored in the weights' dtype; states fp32. Layout as in
``embedding_bag.py`` (``row_table``, ``row_ids``, ``grad_rows``,
``grad_offsets`` come from ``embedding_bag_bwd_rows``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from dtrec.kernels.embedding_bag import _max_dim
from dtrec.kernels.row_updates import (
    ADAM,
    ROWWISE_ADAGRAD,
    SGD,
    adam_moments,
    adam_step,
    rowwise_adagrad_step,
    sgd_step,
)

_ADAGRAD_MAX_BLOCK_D = 512  # row-wise Adagrad: wider rows walk their column blocks
_ROWS_TILE = 1024  # elements of the [rows, BLOCK_D] tile
_WARPS = 2


@triton.jit
def _update_rows_kernel(
    weights_ptr,
    state_ptr,
    state_offsets_ptr,
    state2_ptr,
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
    beta1,
    beta2,
    sqrt_bc2,
    KIND: tl.constexpr,
    HAS_ROW_SQ_SUM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One optimizer step on touched rows ``k = (t, r) = (row_table[k], row_ids[k])``.

    Grid ``(cdiv(K, BLOCK_R), column blocks)``: program (p, c) updates rows ``p * BLOCK_R
    ...`` as one ``[BLOCK_R, BLOCK_D]`` tile. ``W_t[r, d] = weights[table_offsets[t] + r *
    dims[t] + d]``; ``g[k, d] = grad_rows[grad_offsets[k] + d]`` (fp32); d contiguous in
    both; rows are distinct, so each element has one writer. KIND (``row_updates``):

    * SGD: ``W -= lr g`` on columns ``c * BLOCK_D ...``;
    * Adam (torch's, weight_decay=0): ``m = lerp(m, g, 1 - beta1)``, ``v = beta2 v + (1 -
      beta2) g^2``, ``W -= lr m / (sqrt(v) / sqrt_bc2 + eps)`` (``lr`` already over bias
      correction 1); ``m`` = ``state``, ``v`` = ``state2``, packed like the weights;
    * exact row-wise Adagrad (FBGEMM EXACT_ROWWISE_ADAGRAD): one column block in the grid,
      the program walks the row's column blocks twice (sum of squares unless
      ``row_sq_sum[k]`` is given, already all-reduced over column shards; then the
      update): ``s = state[state_offsets[t] + r] += sq / full_dims[t]``, ``W -= lr g /
      (sqrt(s) + eps)``.

    Math in fp32, stored in the weights dtype; states fp32.
    """
    ks = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = ks < num_rows
    table = tl.load(row_table_ptr + ks, mask=live, other=0)
    row = tl.load(row_ids_ptr + ks, mask=live, other=0).to(tl.int64)
    dim = tl.load(dims_ptr + table, mask=live, other=0)
    w_off = tl.load(table_offsets_ptr + table, mask=live, other=0) + row * dim
    g_off = tl.load(grad_offsets_ptr + ks, mask=live, other=0)
    if KIND == 2:
        s_ptrs = state_ptr + tl.load(state_offsets_ptr + table, mask=live, other=0) + row
        if HAS_ROW_SQ_SUM:
            sq = tl.load(row_sq_sum_ptr + ks, mask=live, other=0.0).to(tl.float32)
        else:
            sq = tl.zeros([BLOCK_R], dtype=tl.float32)
            for d0 in range(0, tl.max(dim, axis=0), BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                mask = live[:, None] & (cols[None, :] < dim[:, None])
                g = tl.load(grad_rows_ptr + g_off[:, None] + cols[None, :], mask=mask, other=0.0)
                sq += tl.sum(g * g, axis=1)
        full = tl.load(full_dims_ptr + table, mask=live, other=1).to(tl.float32)
        s, factor = rowwise_adagrad_step(tl.load(s_ptrs, mask=live, other=0.0), sq, full, lr, eps)
        tl.store(s_ptrs, s, mask=live)
        for d0 in range(0, tl.max(dim, axis=0), BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            mask = live[:, None] & (cols[None, :] < dim[:, None])
            g = tl.load(grad_rows_ptr + g_off[:, None] + cols[None, :], mask=mask, other=0.0)
            w_ptrs = weights_ptr + w_off[:, None] + cols[None, :]
            w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
            w = sgd_step(w, g, factor[:, None])
            tl.store(w_ptrs, w.to(weights_ptr.dtype.element_ty), mask=mask)
    else:
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = live[:, None] & (cols[None, :] < dim[:, None])
        g = tl.load(grad_rows_ptr + g_off[:, None] + cols[None, :], mask=mask, other=0.0)
        w_ptrs = weights_ptr + w_off[:, None] + cols[None, :]
        w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
        if KIND == 1:
            w = sgd_step(w, g, lr)
        else:
            m_ptrs = state_ptr + w_off[:, None] + cols[None, :]
            v_ptrs = state2_ptr + w_off[:, None] + cols[None, :]
            m, v = adam_moments(tl.load(m_ptrs, mask=mask, other=0.0),
                                tl.load(v_ptrs, mask=mask, other=0.0), g, beta1, beta2)  # fmt: skip
            tl.store(m_ptrs, m, mask=mask)
            tl.store(v_ptrs, v, mask=mask)
            w = adam_step(w, m, v, lr, sqrt_bc2, eps)
        tl.store(w_ptrs, w.to(weights_ptr.dtype.element_ty), mask=mask)


def _launch(kind: int, weights: Tensor, state: Tensor, state_offsets: Tensor, state2: Tensor,
            table_offsets: Tensor, dims: Tensor, full_dims: Tensor, row_table: Tensor,
            row_ids: Tensor, grad_rows: Tensor, grad_offsets: Tensor,
            row_sq_sum: Tensor | None, max_dim: int, lr: float, eps: float = 0.0,
            beta1: float = 0.0, beta2: float = 0.0, sqrt_bc2: float = 1.0) -> None:  # fmt: skip
    """``_update_rows_kernel`` over the touched rows (none: nothing to launch)."""
    num_rows = row_table.numel()
    if num_rows == 0:
        return
    limit = _ADAGRAD_MAX_BLOCK_D if kind == ROWWISE_ADAGRAD else 128
    block_d = min(limit, triton.next_power_of_2(max(int(max_dim), 1)))
    col_blocks = 1 if kind == ROWWISE_ADAGRAD else triton.cdiv(max(int(max_dim), 1), block_d)
    block_r = max(1, min(64, _ROWS_TILE // block_d))
    grad_rows = grad_rows.float()
    _update_rows_kernel[(triton.cdiv(num_rows, block_r), col_blocks)](
        weights, state, state_offsets.to(torch.int64), state2, table_offsets.to(torch.int64),
        dims.to(torch.int32), full_dims.to(torch.int32), row_table.to(torch.int32),
        row_ids.to(torch.int64), grad_rows, grad_offsets.to(torch.int64),
        grad_rows if row_sq_sum is None else row_sq_sum.float(), num_rows, float(lr),
        float(eps), float(beta1), float(beta2), float(sqrt_bc2), KIND=kind,
        HAS_ROW_SQ_SUM=row_sq_sum is not None, BLOCK_R=block_r, BLOCK_D=block_d,
        num_warps=_WARPS,
    )  # fmt: skip


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
    _launch(SGD, weights, weights, table_offsets, weights, table_offsets, dims, dims, row_table,
            row_ids, grad_rows, grad_offsets, None, _max_dim(dims, max_dim), lr)  # fmt: skip


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
    _launch(ROWWISE_ADAGRAD, weights, state, state_offsets, weights, table_offsets, dims,
            dims if full_dims is None else full_dims, row_table, row_ids, grad_rows,
            grad_offsets, row_sq_sum, _max_dim(dims, max_dim), lr, eps)  # fmt: skip


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
    lr_over_bc1, sqrt_bc2 = float(lr) / (1.0 - beta1**step), (1.0 - beta2**step) ** 0.5
    _launch(ADAM, weights, exp_avg, table_offsets, exp_avg_sq, table_offsets, dims, dims,
            row_table, row_ids, grad_rows, grad_offsets, None, _max_dim(dims, max_dim),
            lr_over_bc1, eps, beta1, beta2, sqrt_bc2)  # fmt: skip
