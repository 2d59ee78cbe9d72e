"""Adapter from the op's table list to the Triton kernels' packed-table layout.

Tables that already live in one storage (views of one flat buffer) are read in
place; otherwise they are packed with one copy per call (the unsharded
collection's separate parameters). Kernels live in ``triton_kernels.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dtrec.ops.backends.device_lists import device_list
from dtrec.ops.lookup import Lookup, shared_storage

if TYPE_CHECKING:
    from dtrec.kernels.row_updates import FusedRowUpdate


def pack_tables(weights: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """A flat buffer holding every table, and each table's element offset in it.

    Zero-copy when all tables are contiguous views of one storage.
    """
    shared = shared_storage(weights)
    if shared is not None:
        flat, offsets = shared
        return flat, device_list(offsets, torch.int64, flat.device)
    sizes = [w.numel() for w in weights]
    starts = device_list([0, *sizes[:-1]], torch.int64, weights[0].device).cumsum(0)
    return torch.cat([w.reshape(-1) for w in weights]), starts


def _layout(lookup: Lookup) -> dict:
    """The kernels' layout arguments shared by forward and backward."""
    weights, device = lookup.weights, lookup.values.device
    cols = lookup.columns()
    return {
        "dims": device_list([w.shape[1] for w in weights], torch.int32, device),
        "entry_table": device_list(lookup.entry_table, torch.int32, device),
        "out_cols": device_list(cols[:-1], torch.int64, device),
        "values": lookup.values,
        "offsets": lookup.offsets.long(),
        "batch_size": lookup.batch,
        "total_dim": cols[-1],
        "mean": device_list(lookup.mean, torch.bool, device),
        "per_sample_weights": None
        if lookup.per_sample_weights is None
        else lookup.per_sample_weights.float(),
        "max_dim": max(w.shape[1] for w in weights),
    }


def forward(lookup: Lookup, check_ids: bool = False) -> Tensor:
    """One kernel launch for every entry; with ``check_ids`` the kernel flags bad ids."""
    from dtrec.kernels import embedding_bag as k

    weights = lookup.weights
    flat, table_offsets = pack_tables(weights)
    bounds = None
    if check_ids:
        bounds = device_list([w.shape[0] for w in weights], torch.int64, flat.device)
    result = k.embedding_bag_fwd(flat, table_offsets, bounds=bounds, **_layout(lookup))
    if bounds is None:
        return result
    out, error = result
    if int(error[0]):  # one small device->host read, no extra pass over the ids
        entry = int(error[1])
        table = lookup.entry_table[entry]
        raise IndexError(
            f"table {table} (entry {entry}): an id is outside [0, {weights[table].shape[0]})"
        )
    return out


def _rows(lookup: Lookup) -> dict:
    """The backward's table sizes: rows per table (a device list) and their sum."""
    rows = [w.shape[0] for w in lookup.weights]
    return {"num_rows": device_list(rows, torch.int64, lookup.values.device),
            "total_rows": sum(rows)}  # fmt: skip


def backward_update(lookup: Lookup, grad_out: Tensor, update: FusedRowUpdate) -> None:
    """Backward fused with an optimizer step: touched rows are updated in place, no grads."""
    from dtrec.kernels import embedding_bag as k

    k.embedding_bag_bwd_rows(
        grad_out.contiguous(), update=update, **_rows(lookup), **_layout(lookup)
    )


def backward_rows(lookup: Lookup, grad_out: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Per table: (sorted unique rows, fp32 grad rows ``[U_t, D_t]``), deterministic."""
    from dtrec.kernels import embedding_bag as k

    weights = lookup.weights
    g = k.embedding_bag_bwd_rows(grad_out.contiguous(), **_rows(lookup), **_layout(lookup))
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
