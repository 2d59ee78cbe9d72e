"""Adapter from the op's table list to the Triton kernels' packed-table layout.

Tables that already live in one storage (views of one flat buffer) are read in
place; otherwise they are packed with one copy per call (the unsharded
collection's separate parameters). Kernels live in ``triton_kernels.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def pack_tables(weights: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """A flat buffer holding every table, and each table's element offset in it.

    Zero-copy when all tables are contiguous views of one storage.
    """
    first = weights[0]
    storage = first.untyped_storage()
    if all(
        w.is_contiguous() and w.untyped_storage().data_ptr() == storage.data_ptr() for w in weights
    ):
        flat = first.new_empty(0).set_(storage, 0, (storage.nbytes() // first.element_size(),))
        return flat, torch.tensor([w.storage_offset() for w in weights], device=first.device)
    sizes = [w.numel() for w in weights]
    starts = torch.tensor([0, *sizes[:-1]], device=first.device).cumsum(0)
    return torch.cat([w.reshape(-1) for w in weights]), starts


def _layout(weights: Sequence[Tensor], entry_table: Sequence[int], mean: Sequence[bool]):
    device = weights[0].device
    dims_list = [w.shape[1] for w in weights]
    cols = [0]
    for t in entry_table:
        cols.append(cols[-1] + dims_list[t])
    dims = torch.tensor(dims_list, dtype=torch.int32, device=device)
    entries = torch.tensor(list(entry_table), dtype=torch.int32, device=device)
    out_cols = torch.tensor(cols[:-1], dtype=torch.int64, device=device)
    mean_t = torch.tensor(list(mean), dtype=torch.bool, device=device)
    return dims, entries, out_cols, mean_t, cols[-1], max(dims_list)


def forward(
    weights: Sequence[Tensor],
    entry_table: Sequence[int],
    values: Tensor,
    offsets: Tensor,
    mean: Sequence[bool],
    per_sample_weights: Tensor | None,
    check_ids: bool = False,
) -> Tensor:
    """One kernel launch for every entry; with ``check_ids`` the kernel flags bad ids."""
    from dtrec.ops import triton_kernels as k

    flat, table_offsets = pack_tables(weights)
    dims, entries, out_cols, mean_t, total, max_dim = _layout(weights, entry_table, mean)
    batch = (offsets.numel() - 1) // len(entry_table)
    bounds = None
    if check_ids:
        bounds = torch.tensor([w.shape[0] for w in weights], dtype=torch.int64, device=flat.device)
    result = k.embedding_bag_fwd(
        flat,
        table_offsets,
        dims,
        entries,
        out_cols,
        values,
        offsets.long(),
        batch,
        total,
        mean_t,
        None if per_sample_weights is None else per_sample_weights.float(),
        bounds,
        max_dim=max_dim,
    )
    if bounds is None:
        return result
    out, error = result
    if int(error[0]):  # one small device->host read, no extra pass over the ids
        entry = int(error[1])
        table = entry_table[entry]
        raise IndexError(
            f"table {table} (entry {entry}): an id is outside [0, {weights[table].shape[0]})"
        )
    return out


def backward_rows(
    weights: Sequence[Tensor],
    entry_table: Sequence[int],
    values: Tensor,
    offsets: Tensor,
    mean: Sequence[bool],
    per_sample_weights: Tensor | None,
    grad_out: Tensor,
) -> list[tuple[Tensor, Tensor]]:
    """Per table: (sorted unique rows, fp32 grad rows ``[U_t, D_t]``), deterministic."""
    from dtrec.ops import triton_kernels as k

    dims, entries, out_cols, mean_t, total, max_dim = _layout(weights, entry_table, mean)
    num_rows = torch.tensor([w.shape[0] for w in weights], dtype=torch.int64, device=values.device)
    batch = (offsets.numel() - 1) // len(entry_table)
    g = k.embedding_bag_bwd_rows(
        grad_out.contiguous(),
        dims,
        num_rows,
        entries,
        out_cols,
        values,
        offsets.long(),
        batch,
        total,
        mean_t,
        None if per_sample_weights is None else per_sample_weights.float(),
        max_dim=max_dim,
    )
    # Rows come sorted by table, so each table's rows and grads are contiguous.
    counts = torch.bincount(g.row_table.long(), minlength=len(weights)).tolist()
    result, start, grad_start = [], 0, 0
    for w, n in zip(weights, counts, strict=True):
        dim = w.shape[1]
        result.append(
            (
                g.row_ids[start : start + n],
                g.grad_rows[grad_start : grad_start + n * dim].view(n, dim),
            )
        )
        start += n
        grad_start += n * dim
    return result
