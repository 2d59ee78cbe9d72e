"""Pure-torch references of the Triton kernels: simple, obviously right, used by the tests.

Same arguments and packed layout as the kernels in ``embedding_bag.py`` and
``update_rows.py`` (see their docstrings). The update references walk the packed
rows one by one and apply the optimizers' own math (``update_math.py``), so a
kernel is checked against the very formula the torch path runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dtrec.kernels.embedding_bag_bwd import RowGrads
from dtrec.kernels.update_math import adam_rows, rowwise_adagrad_rows, sgd_rows


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
        weights[ws] = sgd_rows(weights[ws][None], g[None], lr)[0].to(weights.dtype)


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
        s = slice(int(state_offsets[t]) + r, int(state_offsets[t]) + r + 1)
        new, acc = rowwise_adagrad_rows(
            weights[ws][None], state[s], g[None], sq[None], int(full_dims[t]), lr, eps
        )
        state[s] = acc
        weights[ws] = new[0].to(weights.dtype)


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
    for _, _, _, ws, g in _touched_rows(
        table_offsets, dims, row_table, row_ids, grad_rows, grad_offsets
    ):
        new, m, v = adam_rows(
            weights[ws][None], exp_avg[ws][None], exp_avg_sq[ws][None], g[None], lr,
            (beta1, beta2), eps, step,
        )  # fmt: skip
        exp_avg[ws], exp_avg_sq[ws] = m[0], v[0]
        weights[ws] = new[0].to(weights.dtype)
