"""Summing row-sparse gradients over a group of replicas, coalesced across tables.

After a fused backward each rank holds, per table, the rows its batch touched
and their gradient rows. Replicas must all apply the same update: the sum over
the group of every touched row, on the union of touched rows. Two ways, chosen
per table from counts every member sees (so all members choose alike):

* sparse: all-gather every member's (row ids, gradient rows), padded to the
  largest count; bytes grow with rows touched, not rows owned;
* dense: all-reduce the shard-sized gradient with one extra column counting
  touches (the union must include touched rows whose sum is zero: Adam still
  moves them), cheaper once a large fraction of the rows is touched.

All tables of a step share the collectives: one all-gather of counts, one of
ids and one of gradient rows for the sparse tables, one all-reduce for the
dense ones. Every member ends with bit-identical rows and sums.

Quantized (a ``Codec``, from ``QCommsConfig.replica_sync_precision``): the sparse path
gathers gradient rows in fp16 / bf16 and row ids as int32, then sums in fp32 (one
rounding per member's row); the dense path sends fp16 / bf16 pieces to their chunk's
owner, which sums them in fp32 and shares the sum in fp16 / bf16
(``dtrec.comm.quantized.sum_quantized``: two roundings). Both send half the bytes of
their fp32 twins, and the sparse / dense choice is the fp32 one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from dtrec.comm.collectives import all_gather_flat, collective, sync_bytes
from dtrec.comm.quantized import Codec, sum_quantized
from dtrec.ops.backends.torch import sum_rows_by_key

MODES = ("auto", "sparse", "dense")


@dataclass
class TableRows:
    """One table's touched rows on this rank (sorted unique ids) and their fp32 gradients."""

    rows: Tensor
    grads: Tensor  # [len(rows), dim]
    num_rows: int  # rows of the local shard (size of the dense alternative)
    dense_ok: bool = True  # False: always sparse (an offloaded table: no shard-sized buffer)


def sum_by_row(ids: Tensor, grads: Tensor) -> tuple[Tensor, Tensor]:
    """Sum gradient rows with the same id; result sorted by id (deterministic)."""
    return sum_rows_by_key(ids, grads)


def sync_rows(
    tables: Sequence[TableRows],
    group: ProcessGroup | None,
    kind: str,
    mode: str = "auto",
    codec: Codec | None = None,
) -> list[tuple[Tensor, Tensor]]:
    """Per table: (union of touched rows over ``group``, summed gradient rows), sorted.

    ``mode``: "auto" picks, per table, whichever of the sparse all-gather and the dense
    all-reduce sends fewer bytes; "sparse" / "dense" force one. ``codec``: the gradient
    rows travel quantized (module doc), None: fp32. Collective: every member calls it
    with the same tables (same order, dims and ``num_rows``) and the same codec.
    """
    if mode not in MODES:
        raise ValueError(f"replica sync mode must be one of {MODES}, got {mode!r}")
    size = 1 if group is None else dist.get_world_size(group)
    if size == 1 or not tables:
        return [(t.rows, t.grads) for t in tables]
    device = tables[0].grads.device
    if device.type == "meta":  # sizes only (benchmarks/scale_sim.py): real counts, real rows
        device = tables[0].rows.device
    counts = torch.tensor([t.rows.numel() for t in tables], dtype=torch.long, device=device)
    gathered = torch.empty(size * len(tables), dtype=torch.long, device=device)
    with collective(kind + ".counts", (size - 1) * counts.numel() * 8, group):
        all_gather_flat(gathered, counts, group)
    most = gathered.view(size, len(tables)).max(0).values.tolist()

    dense = []
    for t, m in zip(tables, most, strict=True):
        sparse_bytes, dense_bytes = sync_bytes(size, m, t.grads.shape[1], t.num_rows)
        dense.append(
            t.dense_ok and (mode == "dense" or (mode == "auto" and dense_bytes < sparse_bytes))
        )
    result: dict[int, tuple[Tensor, Tensor]] = {}
    sparse_ids = [i for i, d in enumerate(dense) if not d]
    if sparse_ids:
        picked = [tables[i] for i in sparse_ids]
        synced = _all_gather_rows(picked, [most[i] for i in sparse_ids], group, size, kind, codec)
        result.update(zip(sparse_ids, synced, strict=True))
    dense_ids = [i for i, d in enumerate(dense) if d]
    if dense_ids:
        synced = _all_reduce_dense([tables[i] for i in dense_ids], group, size, kind, codec)
        result.update(zip(dense_ids, synced, strict=True))
    return [result[i] for i in range(len(tables))]


def _all_gather_rows(
    tables: list[TableRows],
    most: list[int],
    group: ProcessGroup,
    size: int,
    kind: str,
    codec: Codec | None,
) -> list[tuple[Tensor, Tensor]]:
    """Sparse path: two all-gathers (ids, grads) for all tables, then per-table sums.

    Quantized: ids as int32 when every shard's row count fits, grads in the codec's dtype.
    """
    device = tables[0].grads.device
    id_len = sum(most)
    grad_len = sum(m * t.grads.shape[1] for t, m in zip(tables, most, strict=True))
    narrow_ids = codec is not None and max(t.num_rows for t in tables) <= 2**31 - 1
    id_dtype = torch.int32 if narrow_ids else torch.long
    grad_dtype = torch.float32 if codec is None else codec.dtype
    ids = torch.full((id_len,), -1, dtype=id_dtype, device=device)
    grads = torch.zeros(grad_len, dtype=grad_dtype, device=device)
    id_at = grad_at = 0
    for t, m in zip(tables, most, strict=True):
        if device.type == "meta":  # sizes only (benchmarks/scale_sim.py): nothing to copy
            break
        n, dim = t.rows.numel(), t.grads.shape[1]
        ids[id_at : id_at + n] = t.rows
        sent = t.grads.reshape(-1) if codec is None else codec.encode(t.grads.reshape(-1))
        grads[grad_at : grad_at + n * dim] = sent
        id_at, grad_at = id_at + m, grad_at + m * dim
    all_ids = torch.empty(size * id_len, dtype=id_dtype, device=device)
    all_grads = torch.empty(size * grad_len, dtype=grad_dtype, device=device)
    nbytes = (size - 1) * (id_len * ids.element_size() + grad_len * grads.element_size())
    with collective(kind + ".sparse", nbytes, group):
        all_gather_flat(all_ids, ids, group)
        all_gather_flat(all_grads, grads, group)
    if device.type == "meta":  # sizes only: the exchange's bytes are all that is asked
        return [(t.rows, t.grads) for t in tables]
    if codec is not None:
        all_ids, all_grads = all_ids.long(), codec.decode(all_grads, torch.float32)
    all_ids, all_grads = all_ids.view(size, id_len), all_grads.view(size, grad_len)
    out, id_at, grad_at = [], 0, 0
    for t, m in zip(tables, most, strict=True):
        dim = t.grads.shape[1]
        member_ids = all_ids[:, id_at : id_at + m].reshape(-1)
        member_grads = all_grads[:, grad_at : grad_at + m * dim].reshape(-1, dim)
        valid = member_ids >= 0
        out.append(sum_by_row(member_ids[valid], member_grads[valid]))
        id_at, grad_at = id_at + m, grad_at + m * dim
    return out


def _all_reduce_dense(
    tables: list[TableRows], group: ProcessGroup, size: int, kind: str, codec: Codec | None
) -> list[tuple[Tensor, Tensor]]:
    """Dense path: one all-reduce of every table's ``[num_rows, dim + 1]`` (grads | touches).

    Quantized: ``sum_quantized`` in the codec's dtype, the loss scale on the grads only
    (touch counts up to the group size are exact in fp16 / bf16).
    """
    device = tables[0].grads.device
    scale = None if codec is None else codec.scale
    sizes = [t.num_rows * (t.grads.shape[1] + 1) for t in tables]
    flat = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
    meta = device.type == "meta"  # sizes only (benchmarks/scale_sim.py): nothing to fill
    for t, part in zip(tables, torch.split(flat, sizes), strict=True):
        if meta:
            break
        block = part.view(t.num_rows, t.grads.shape[1] + 1)
        block[t.rows, :-1] = t.grads if scale is None else t.grads * scale
        block[t.rows, -1] = 1.0
    if codec is None:
        with collective(kind + ".dense", 2 * (size - 1) * flat.numel() * 4 // size, group):
            dist.all_reduce(flat, group=group)
    else:
        flat = sum_quantized(flat, group, kind + ".dense", codec.dtype)
    if meta:
        return [(t.rows, t.grads) for t in tables]
    out = []
    for t, part in zip(tables, torch.split(flat, sizes), strict=True):
        block = part.view(t.num_rows, t.grads.shape[1] + 1)
        rows = torch.nonzero(block[:, -1] > 0).squeeze(1)
        sums = block[rows, :-1]
        out.append((rows, sums if scale is None else sums / scale))
    return out


class _SyncGrads(torch.autograd.Function):
    """Identity forward on several tables; backward syncs their dense grads as row-sparse."""

    @staticmethod
    def forward(ctx, group, scale, kind, mode, codec, *tables):  # type: ignore[override]
        ctx.group, ctx.scale, ctx.kind, ctx.mode, ctx.codec = group, scale, kind, mode, codec
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in tables]
        return tuple(t.view_as(t) for t in tables)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        grads = [
            torch.zeros(shape, dtype=dtype, device=device) if g is None else g * ctx.scale
            for g, (shape, dtype, device) in zip(grads, ctx.shapes, strict=True)
        ]
        size = 1 if ctx.group is None else dist.get_world_size(ctx.group)
        if size > 1:
            touched = [torch.nonzero((g != 0).any(1)).squeeze(1) for g in grads]
            synced = sync_rows(
                [TableRows(r, g[r].float(), g.shape[0]) for r, g in zip(touched, grads)],
                ctx.group,
                ctx.kind,
                ctx.mode,
                ctx.codec,
            )
            out = []
            for g, (rows, sums) in zip(grads, synced, strict=True):
                dense = torch.zeros_like(g)
                dense[rows] = sums.to(g.dtype)
                out.append(dense)
            grads = out
        return (None, None, None, None, None, *grads)


def sync_grads(
    tables: Sequence[Tensor],
    group: ProcessGroup | None,
    scale: float,
    kind: str,
    mode: str = "auto",
    codec: Codec | None = None,
) -> tuple[Tensor, ...]:
    """Identity forward; backward sums each table's gradient over ``group``, times ``scale``.

    The gradients are dense (autograd's), but only their nonzero rows travel: all tables
    share ``sync_rows``' collectives (sparse or dense per table, by bytes; quantized with
    ``codec``). A row whose sum is zero on every member stays zero, so the result equals
    a dense all-reduce. ``group`` None: only the scaling.
    """
    return _SyncGrads.apply(group, scale, kind, mode, codec, *tables)


__all__ = ["MODES", "TableRows", "sum_by_row", "sync_grads", "sync_rows"]
