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


@dataclass(frozen=True)
class RowsShape:
    """What the wire of one table's sync depends on: its gradient rows' width, the local
    shard's rows (the dense alternative's size) and whether the dense path is allowed."""

    dim: int
    num_rows: int
    dense_ok: bool = True


@dataclass
class TableRows:
    """One table's touched rows on this rank (sorted unique ids) and their fp32 gradients."""

    rows: Tensor
    grads: Tensor  # [len(rows), dim]
    num_rows: int  # rows of the local shard (size of the dense alternative)
    dense_ok: bool = True  # False: always sparse (an offloaded table: no shard-sized buffer)

    @property
    def shape(self) -> RowsShape:
        return RowsShape(self.grads.shape[1], self.num_rows, self.dense_ok)


@dataclass(frozen=True)
class SyncWire:
    """How one ``sync_rows`` call moves its tables once every member's counts are known:
    which tables go sparse or dense, and the sizes of the buffers each path exchanges.

    Sizes only, so the sizes-only simulation of a step (``record_sync_rows``, used by
    ``benchmarks/scale/sim.py``) and the real exchange count the same bytes.
    """

    size: int
    shapes: tuple[RowsShape, ...]
    most: tuple[int, ...]
    """Per table, the largest touched-row count over the group (what each member sends)."""
    dense: tuple[bool, ...]
    grad_dtype: torch.dtype
    """fp32, or the codec's dtype when quantized."""

    @property
    def id_dtype(self) -> torch.dtype:
        """Row ids travel as int32 when quantized and every sparse table's shard fits."""
        narrow = self.grad_dtype != torch.float32 and all(
            self.shapes[i].num_rows <= 2**31 - 1 for i in self.sparse_tables
        )
        return torch.int32 if narrow else torch.long

    @property
    def sparse_tables(self) -> list[int]:
        return [i for i, d in enumerate(self.dense) if not d]

    @property
    def dense_tables(self) -> list[int]:
        return [i for i, d in enumerate(self.dense) if d]

    @property
    def id_len(self) -> int:
        return sum(self.most[i] for i in self.sparse_tables)

    @property
    def grad_len(self) -> int:
        return sum(self.most[i] * self.shapes[i].dim for i in self.sparse_tables)

    @property
    def dense_sizes(self) -> list[int]:
        """fp32 elements of each dense table's ``[num_rows, dim + 1]`` (grads | touches)."""
        return [self.shapes[i].num_rows * (self.shapes[i].dim + 1) for i in self.dense_tables]

    def sparse_bytes(self) -> int:
        """What this member sends in the sparse path's two all-gathers (ids, grad rows)."""
        per_member = self.id_len * _itemsize(self.id_dtype)
        per_member += self.grad_len * _itemsize(self.grad_dtype)
        return (self.size - 1) * per_member

    def dense_bytes(self) -> int:
        """What this member sends in the dense path's fp32 ring all-reduce."""
        return 2 * (self.size - 1) * sum(self.dense_sizes) * 4 // self.size


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def sync_wire(
    shapes: Sequence[RowsShape],
    most: Sequence[int],
    size: int,
    mode: str = "auto",
    codec: Codec | None = None,
) -> SyncWire:
    """The wire of a ``sync_rows`` call from the tables' shapes and the group's largest
    counts: per table the path that sends fewer bytes ("auto"), or the forced one.
    Quantized (``codec``): ids as int32 when every shard's row count fits, gradient rows in
    the codec's dtype; the sparse / dense choice stays the fp32 one."""
    if mode not in MODES:
        raise ValueError(f"replica sync mode must be one of {MODES}, got {mode!r}")
    dense = []
    for shape, m in zip(shapes, most, strict=True):
        sparse_bytes, dense_bytes = sync_bytes(size, m, shape.dim, shape.num_rows)
        dense.append(
            shape.dense_ok and (mode == "dense" or (mode == "auto" and dense_bytes < sparse_bytes))
        )
    return SyncWire(
        size=size,
        shapes=tuple(shapes),
        most=tuple(most),
        dense=tuple(dense),
        grad_dtype=torch.float32 if codec is None else codec.dtype,
    )


def sum_by_row(ids: Tensor, grads: Tensor, num_rows: int | None = None) -> tuple[Tensor, Tensor]:
    """Sum gradient rows with the same id; result sorted by id (deterministic).
    ``num_rows`` (ids lie in ``[0, num_rows)``) lets the sort take its fast paths."""
    return sum_rows_by_key(ids, grads, key_bound=num_rows)


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
    counts = torch.tensor([t.rows.numel() for t in tables], dtype=torch.long, device=device)
    gathered = torch.empty(size * len(tables), dtype=torch.long, device=device)
    with collective(kind + ".counts", _counts_bytes(size, len(tables)), group):
        all_gather_flat(gathered, counts, group)
    most = gathered.view(size, len(tables)).max(0).values.tolist()
    wire = sync_wire([t.shape for t in tables], most, size, mode, codec)

    result: dict[int, tuple[Tensor, Tensor]] = {}
    if wire.sparse_tables:
        synced = _all_gather_rows(tables, wire, group, kind, codec)
        result.update(zip(wire.sparse_tables, synced, strict=True))
    if wire.dense_tables:
        synced = _all_reduce_dense(tables, wire, group, kind, codec)
        result.update(zip(wire.dense_tables, synced, strict=True))
    return [result[i] for i in range(len(tables))]


def record_sync_rows(
    shapes: Sequence[RowsShape], most: Sequence[int], group: ProcessGroup, kind: str
) -> None:
    """Record in ``comm_stats`` the exchanges ``sync_rows`` (fp32) runs over ``group`` for
    tables of these shapes whose largest touched-row counts are ``most``, moving no data:
    the sizes-only step of ``benchmarks/scale/sim.py``, whose bytes must equal a real run's."""
    size = dist.get_world_size(group)
    if size == 1 or not shapes:
        return
    with collective(kind + ".counts", _counts_bytes(size, len(shapes)), group):
        pass
    wire = sync_wire(shapes, most, size)
    if wire.sparse_tables:
        with collective(kind + ".sparse", wire.sparse_bytes(), group):
            pass
    if wire.dense_tables:
        with collective(kind + ".dense", wire.dense_bytes(), group):
            pass


def _counts_bytes(size: int, tables: int) -> int:
    return (size - 1) * tables * 8


def _all_gather_rows(
    tables: Sequence[TableRows],
    wire: SyncWire,
    group: ProcessGroup,
    kind: str,
    codec: Codec | None,
) -> list[tuple[Tensor, Tensor]]:
    """Sparse path: two all-gathers (ids, grads) for all its tables, then per-table sums.

    Each member's rows padded to the group's largest count (ids -1 past its own).
    """
    device = tables[0].grads.device
    picked = [(tables[i], wire.most[i]) for i in wire.sparse_tables]
    id_len, grad_len = wire.id_len, wire.grad_len
    ids = torch.full((id_len,), -1, dtype=wire.id_dtype, device=device)
    grads = torch.zeros(grad_len, dtype=wire.grad_dtype, device=device)
    id_at = grad_at = 0
    for t, m in picked:
        n, dim = t.rows.numel(), t.grads.shape[1]
        ids[id_at : id_at + n] = t.rows
        sent = t.grads.reshape(-1) if codec is None else codec.encode(t.grads.reshape(-1))
        grads[grad_at : grad_at + n * dim] = sent
        id_at, grad_at = id_at + m, grad_at + m * dim
    all_ids = torch.empty(wire.size * id_len, dtype=wire.id_dtype, device=device)
    all_grads = torch.empty(wire.size * grad_len, dtype=wire.grad_dtype, device=device)
    with collective(kind + ".sparse", wire.sparse_bytes(), group):
        all_gather_flat(all_ids, ids, group)
        all_gather_flat(all_grads, grads, group)
    if codec is not None:
        all_ids, all_grads = all_ids.long(), codec.decode(all_grads, torch.float32)
    all_ids, all_grads = all_ids.view(wire.size, id_len), all_grads.view(wire.size, grad_len)
    out, id_at, grad_at = [], 0, 0
    for t, m in picked:
        dim = t.grads.shape[1]
        member_ids = all_ids[:, id_at : id_at + m].reshape(-1)
        member_grads = all_grads[:, grad_at : grad_at + m * dim].reshape(-1, dim)
        valid = member_ids >= 0
        out.append(sum_by_row(member_ids[valid], member_grads[valid], t.num_rows))
        id_at, grad_at = id_at + m, grad_at + m * dim
    return out


def _all_reduce_dense(
    tables: Sequence[TableRows],
    wire: SyncWire,
    group: ProcessGroup,
    kind: str,
    codec: Codec | None,
) -> list[tuple[Tensor, Tensor]]:
    """Dense path: one all-reduce of every dense table's ``[num_rows, dim + 1]``
    (grads | touches).

    Quantized: ``sum_quantized`` in the codec's dtype, the loss scale on the grads only
    (touch counts up to the group size are exact in fp16 / bf16).
    """
    picked = [tables[i] for i in wire.dense_tables]
    scale = None if codec is None else codec.scale
    sizes = wire.dense_sizes
    flat = torch.zeros(sum(sizes), dtype=torch.float32, device=picked[0].grads.device)
    for t, part in zip(picked, torch.split(flat, sizes), strict=True):
        block = part.view(t.num_rows, t.grads.shape[1] + 1)
        block[t.rows, :-1] = t.grads if scale is None else t.grads * scale
        block[t.rows, -1] = 1.0
    if codec is None:
        with collective(kind + ".dense", wire.dense_bytes(), group):
            dist.all_reduce(flat, group=group)
    else:
        flat = sum_quantized(flat, group, kind + ".dense", codec.dtype)
    out = []
    for t, part in zip(picked, torch.split(flat, sizes), strict=True):
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


__all__ = [
    "MODES",
    "RowsShape",
    "SyncWire",
    "TableRows",
    "record_sync_rows",
    "sum_by_row",
    "sync_grads",
    "sync_rows",
    "sync_wire",
]
