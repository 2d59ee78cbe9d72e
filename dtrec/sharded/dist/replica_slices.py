"""Fully sharded 2D: touched rows fetched from their owner slices, gradients sent back.

A fully sharded table (``dtrec.placements.fully_sharded``) keeps, on each replica of a
shard, only its owner slice of the shard's rows (and of their optimizer state). After
the input dist a rank knows the rows its lookups touch, all in its own shard:

1. forward (``fetch_touched``): each table's unique touched rows are requested from
   their owners over the "replicate" axis (ids all-to-all), the owners answer with the
   rows (rows all-to-all), and the lookup reads a *compact* table of those rows, its
   ids remapped to compact positions. No rank ever holds its whole shard;
2. backward (``route_to_owners``): the compact rows' gradients go back to the owners
   (all-to-all), each owner sums the replicas' contributions per row (the same sum the
   exact replica sync computes) and alone updates the row and its optimizer state.
   When every table's gradient comes from one lookup's compact table, the gradients go
   back the way the rows came (``Fetch``: the owners kept which rows each replica asked
   for), one all-to-all; otherwise (several lookups merged before one update) the rows'
   ids travel with them after a counts exchange (three all-to-alls).

Bytes per step and rank: about 2 x touched rows x D (rows out, gradients back) plus
their ids, against exact 2D's sparse sync of about R x touched x D
(docs/fully_sharded_2d.md). All fully sharded tables of a lookup share one set of
exchanges (one replica group per collection).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from dtrec.comm.collectives import all_to_all
from dtrec.placements.fully_sharded import slice_starts
from dtrec.sharded.update.grad_sync import sum_by_row

_BLOCK_ROWS = "_dtrec_block_rows"
"""The attribute of a compact table naming, per compact row, its row in the shard."""
_FETCH = "_dtrec_fetch"
"""The attribute of a compact table holding its (``Fetch``, table index in it)."""


@dataclass(frozen=True)
class Fetch:
    """What one ``fetch_touched`` exchanged over its replica group, kept until the update
    so the gradients can go back the way the rows came, without their ids."""

    sent: Tensor
    """``[K tables, R owners]``: rows this rank asked each owner for, per table."""
    got: Tensor
    """``[R sources, K tables]``: rows each replica asked this rank for, per table."""
    asked: list[Tensor]
    """Per (source, table), source-major: the shard rows that source asked for."""
    rows: list[Tensor]
    """Per table: the sorted shard rows of its compact table (what this rank asked)."""
    sent_counts: list[list[int]]
    """``sent`` on the host (read once, with ``got``: sizes the way back needs no wait)."""
    got_counts: list[list[int]]
    """``got`` on the host."""


class OwnerSlices:
    """One fully sharded table's shard as owner slices over a replica group."""

    def __init__(self, block_rows: int, group: ProcessGroup, grad_scale: float = 1.0) -> None:
        self.grad_scale = grad_scale
        """1 / ranks whose batches the gradient sums (autograd's gradients are averaged with
        it before they reach the owners; the fused updater scales its own)."""
        self.block_rows = block_rows
        """Rows of the whole shard (block); ids after the input dist index them."""
        self.group = group
        self.replicas = dist.get_world_size(group)
        self.replica = dist.get_rank(group)
        starts = slice_starts(block_rows, self.replicas)
        self.start = starts[self.replica]
        """First shard row of this rank's own slice."""
        self.slice_rows = starts[self.replica + 1] - self.start
        self._ends = torch.tensor(starts[1 : self.replicas], dtype=torch.long)
        self.cache: Any = None
        """An offloaded table's ``dtrec.sharded.offload.RowCache`` of this slice (its host
        block), whose fills cache the rows of it this rank's own lookups read: the owner
        answers from a row's slot if cached, else from host memory, evicting nothing; the
        update steps cached rows in their slots and stages the others
        (``RowCache.row_updates``). None: the slice is on the device."""

    def read(self, local: Tensor, rows: Tensor) -> Tensor:
        """Rows ``rows`` of this slice (``local``: its device tensor, or an offloaded
        slice's cache) as they are now."""
        if self.cache is None:
            return local.index_select(0, rows)
        return self.cache.read_rows(rows)

    def owner_counts(self, rows: Tensor) -> Tensor:
        """How many of the sorted shard rows ``rows`` each replica (0..R-1) owns (on the
        rows' device: no wait for it)."""
        ends = torch.searchsorted(rows, self._ends.to(rows.device))
        total = torch.full((1,), rows.numel(), dtype=torch.long, device=rows.device)
        return torch.cat([ends, total]).diff(prepend=total.new_zeros(1))


def block_rows_of(compact: Tensor, rows: Tensor) -> Tensor:
    """Shard rows of the compact table ``compact``'s rows ``rows`` (sorted stays sorted)."""
    return getattr(compact, _BLOCK_ROWS)[rows]


def fetch_of(compact: Tensor) -> tuple[Fetch, int]:
    """The exchange that built the compact table ``compact``, and its table index there."""
    return getattr(compact, _FETCH)


def _exchange_counts(counts: Tensor, group: ProcessGroup, kind: str) -> Tensor:
    """``counts[k, d]`` (table k, to replica d) sent; returns ``[R sources, K]`` received."""
    tables, replicas = counts.shape
    sent = counts.t().contiguous().view(-1)
    got = all_to_all(sent, [tables] * replicas, [tables] * replicas, group, kind)
    return got.view(replicas, tables)


def _by_destination(parts: Sequence[Tensor], counts: list[list[int]]) -> tuple[Tensor, list[int]]:
    """Rows of each table (sorted by destination, ``counts[k][d]`` each: host ints) laid
    out destination-major, then table: one flat send buffer and its split per destination."""
    pieces = [p.split(c) for p, c in zip(parts, counts, strict=True)]
    replicas = len(counts[0]) if counts else 0
    send = [pieces[k][d].reshape(-1) for d in range(replicas) for k in range(len(parts))]
    widths = [p.shape[1] if p.dim() > 1 else 1 for p in parts]
    flat = torch.cat(send) if send else parts[0].new_empty(0)
    splits = [sum(c[d] * w for c, w in zip(counts, widths, strict=True)) for d in range(replicas)]
    return flat, splits


def entry_value_tables(
    entry_table: list[int], offsets: Tensor, num_values: int | None = None
) -> Tensor:
    """The table (index into the lookup's tables) of every id of a pooled lookup in
    ``dtrec.ops.lookup``'s layout (entry-major bags, ``E * B + 1`` offsets);
    ``num_values``: the ids' count, when known (no wait for the device on CUDA)."""
    entries = len(entry_table)
    batch = (offsets.numel() - 1) // entries
    per_entry = offsets[::batch].diff() if batch else offsets.new_zeros(entries)
    tables = torch.tensor(entry_table, dtype=torch.long, device=offsets.device)
    return tables.repeat_interleave(per_entry, output_size=num_values)


def run_value_tables(
    run_table: list[int], run_counts: Tensor, num_values: int | None = None
) -> Tensor:
    """The table of every id of a sequence lookup's runs (``lookup.sequence.IdRuns``);
    ``num_values``: the ids' count, when known (no wait for the device on CUDA)."""
    tables = torch.tensor(run_table, dtype=torch.long, device=run_counts.device)
    return tables.repeat_interleave(run_counts, output_size=num_values)


def fetch_touched(
    owners: dict[int, OwnerSlices], tables: list[Tensor], value_table: Tensor, values: Tensor
) -> tuple[list[Tensor], Tensor]:
    """(tables, values) of a lookup with each fully sharded table replaced by the compact
    table of its touched rows (fetched from their owners) and its ids remapped.

    ``owners``: position in ``tables`` -> that table's slices (``tables[i]`` is its own
    slice); ``value_table``: each id's position in ``tables`` (``entry_value_tables``,
    ``run_value_tables``). Collective over the replica group: every replica calls it with
    the same tables, in the same order.

    The host waits for the device twice, whatever the number of tables: for the number
    of distinct touched rows (one ``unique`` over every table's ids, keyed by table) and
    for the request counts (one read, after their exchange, which runs on the device).
    """
    keys = sorted(owners)
    group = owners[keys[0]].group
    replicas = owners[keys[0]].replicas
    device = values.device
    # every fully sharded table's shard rows end to end: table k's row r is key base[k] + r
    base = [0, *itertools.accumulate(owners[i].block_rows for i in keys)]
    slot = [-1] * len(tables)
    for k, i in enumerate(keys):
        slot[i] = k
    # (table, owner) buckets of the sorted keys: their edges (each table's slice starts)
    edges = [base[k] + lo for k, i in enumerate(keys)
             for lo in slice_starts(owners[i].block_rows, replicas)[:-1]] + [base[-1]]  # fmt: skip
    small = torch.tensor(slot + base + edges, dtype=torch.long)
    cuda = device.type == "cuda"  # one copy, from pinned memory: the host does not wait
    small = (small.pin_memory() if cuda else small).to(device, non_blocking=cuda)
    slot_t, base_t, edges_t = small.split([len(slot), len(base), len(edges)])
    k_of = slot_t[value_table.long()]
    sliced = k_of >= 0
    # the other tables' ids share one key past the end (the last unique key, if any)
    key = torch.where(sliced, base_t[k_of.clamp(min=0)] + values.long(), base[-1])
    unique, inverse = torch.unique(key, sorted=True, return_inverse=True)
    bounds = torch.searchsorted(unique, edges_t)  # each bucket's first key
    starts = bounds[::replicas]  # each table's first compact row among the keys
    values = torch.where(sliced, (inverse - starts[k_of.clamp(min=0)]).to(values.dtype), values)
    got = _exchange_counts(bounds.diff().view(len(keys), replicas), group,
                           "replica_slices.fetch.counts")  # fmt: skip
    host = torch.cat([bounds.diff(), got.view(-1)]).tolist()
    sent = [host[k * replicas : (k + 1) * replicas] for k in range(len(keys))]
    sent_n = len(keys) * replicas
    got_l = [host[sent_n + s * len(keys) : sent_n + (s + 1) * len(keys)]
             for s in range(replicas)]  # fmt: skip
    touched = [sum(c) for c in sent]
    rows = unique[: sum(touched)]  # the sliced tables' keys (the other tables' key after)
    owned = torch.searchsorted(base_t[1:], rows, right=True)
    rows = rows - base_t[owned]  # shard rows, table by table, each sorted
    uniques = list(rows.split(touched))
    ids, splits = _by_destination(uniques, sent)
    asked = all_to_all(ids, [sum(g) for g in got_l], splits, group, "replica_slices.fetch.ids")
    # answer every source, table by table, with the rows it asked for from our slices
    asked_parts = asked.split([c for g in got_l for c in g])
    answer = []
    for source in range(replicas):
        for k, i in enumerate(keys):
            local = asked_parts[source * len(keys) + k] - owners[i].start
            answer.append(owners[i].read(tables[i], local).reshape(-1))
    dims = [int(tables[i].shape[1]) for i in keys]
    flat = torch.cat(answer) if answer else tables[keys[0]].new_empty(0)
    received = all_to_all(
        flat,
        [sum(sent[k][d] * dims[k] for k in range(len(keys))) for d in range(replicas)],
        [sum(g[k] * dims[k] for k in range(len(keys))) for g in got_l],
        group,
        "replica_slices.fetch.rows",
    )
    # received: per owner, per table, the rows in ascending order; owners hold ascending
    # slices, so per table the owners' parts in order are the sorted unique rows
    pieces = received.split([sent[k][d] * dims[k] for d in range(replicas)
                             for k in range(len(keys))])  # fmt: skip
    out = list(tables)
    fetch = Fetch(
        torch.tensor(sent, dtype=torch.long), torch.tensor(got_l, dtype=torch.long),
        list(asked_parts), uniques, sent, got_l,
    )  # fmt: skip
    for k, i in enumerate(keys):
        parts = [pieces[d * len(keys) + k].view(-1, dims[k]) for d in range(replicas)]
        compact = torch.cat(parts) if parts else tables[i].new_empty(0, dims[k])
        setattr(compact, _BLOCK_ROWS, uniques[k])
        setattr(compact, _FETCH, (fetch, k))
        out[i] = compact
    return out, values


def route_to_owners(
    owners: dict[int, OwnerSlices],
    merged: dict[int, tuple[Tensor, Tensor]],
    fetched: dict[int, tuple[Fetch, int]] | None = None,
) -> dict[int, tuple[Tensor, Tensor]]:
    """Per fully sharded table: this rank's (shard rows, gradient rows) sent to the rows'
    owners, which return (rows of their own slice, gradients summed over the replicas),
    sorted by row. Collective over the replica group, tables in ascending order on every
    replica (every replica updates the same tables each step).

    ``fetched``: table -> ``fetch_of`` its one compact table, where its gradients come
    from one lookup. When every table has one and they are one fetch's tables (the same
    on every replica: it follows the program, not the data), the gradients go back the
    way the rows came (``_back_along``: one all-to-all, no ids)."""
    keys = sorted(owners)
    if not keys:
        return {}
    along = _one_fetch(keys, fetched or {})
    if along is not None:
        return _back_along(owners, merged, *along)
    group = owners[keys[0]].group
    rows = [merged[t][0].long() for t in keys]
    grads = [merged[t][1] for t in keys]
    replicas = owners[keys[0]].replicas
    counts = torch.stack([owners[t].owner_counts(r) for t, r in zip(keys, rows, strict=True)])
    got_t = _exchange_counts(counts, group, "replica_slices.grads.counts")
    host = torch.cat([counts.view(-1), got_t.view(-1)]).tolist()
    n = len(keys) * replicas
    sent = [host[k * replicas : (k + 1) * replicas] for k in range(len(keys))]
    got = [host[n + s * len(keys) : n + (s + 1) * len(keys)] for s in range(replicas)]
    flat_rows, row_splits = _by_destination(rows, sent)
    got_rows = all_to_all(
        flat_rows, [sum(g) for g in got], row_splits, group, "replica_slices.grads.rows"
    )
    dims = [int(g.shape[1]) for g in grads]
    flat_grads, grad_splits = _by_destination(grads, sent)
    got_grads = all_to_all(
        flat_grads,
        [sum(c * d for c, d in zip(g, dims, strict=True)) for g in got],
        grad_splits,
        group,
        "replica_slices.grads.values",
    )
    row_parts = got_rows.split([c for g in got for c in g])
    grad_parts = got_grads.split([c * d for g in got for c, d in zip(g, dims, strict=True)])
    out = {}
    for k, t in enumerate(keys):
        owner, dim = owners[t], dims[k]
        ids = torch.cat([row_parts[s * len(keys) + k] for s in range(replicas)])
        values = torch.cat([grad_parts[s * len(keys) + k].view(-1, dim) for s in range(replicas)])
        out[t] = sum_by_row(ids - owner.start, values, max(owner.slice_rows, 1))
    return out


def _one_fetch(
    keys: list[int], fetched: dict[int, tuple[Fetch, int]]
) -> tuple[Fetch, list[int]] | None:
    """(the fetch, the tables in its order) when ``keys`` are exactly one fetch's tables."""
    if sorted(fetched) != keys:
        return None
    fetch = fetched[keys[0]][0]
    order = {k: t for t, (f, k) in fetched.items() if f is fetch}
    if len(order) != len(keys) or sorted(order) != list(range(len(fetch.rows))):
        return None
    return fetch, [order[k] for k in range(len(order))]


def _back_along(
    owners: dict[int, OwnerSlices],
    merged: dict[int, tuple[Tensor, Tensor]],
    fetch: Fetch,
    order: list[int],
) -> dict[int, tuple[Tensor, Tensor]]:
    """``route_to_owners`` along ``fetch``: each compact row's gradient goes to the owner
    it came from, in the order it came; the owner knows the rows (``Fetch.asked``)."""
    group = owners[order[0]].group
    grads = []
    for k, t in enumerate(order):
        rows, grad = merged[t][0], merged[t][1]
        asked = fetch.rows[k]
        # both sorted and distinct, rows among the fetched ones: the same count is the
        # same rows (a host-side check: comparing values would wait for the device)
        if rows.numel() != asked.numel():  # every id of the lookup has a gradient row
            raise RuntimeError(
                f"dtrec internal error: table {t}'s gradient rows ({rows.numel()}) are not "
                f"the {asked.numel()} rows its lookup fetched"
            )
        grads.append(grad)
    dims = [int(g.shape[1]) for g in grads]
    flat, splits = _by_destination(grads, fetch.sent_counts)
    got = [[c * d for c, d in zip(g, dims, strict=True)] for g in fetch.got_counts]
    back = all_to_all(flat, [sum(g) for g in got], splits, group, "replica_slices.grads.values")
    parts = back.split([c for g in got for c in g])
    out = {}
    sources = len(fetch.got_counts)
    for k, t in enumerate(order):
        owner, dim = owners[t], dims[k]
        ids = torch.cat([fetch.asked[s * len(order) + k] for s in range(sources)])
        values = torch.cat([parts[s * len(order) + k].view(-1, dim) for s in range(sources)])
        out[t] = sum_by_row(ids - owner.start, values, max(owner.slice_rows, 1))
    return out


class FetchTouched(torch.autograd.Function):
    """``fetch_touched`` for tables trained by autograd (torch optimizers): forward builds
    the compact tables; backward sends their gradients (averaged by ``grad_scale``) to
    the owners, which sum the replicas' and return them as their slices' gradients (dense,
    like exact 2D's summed gradients: zero on rows no replica touched)."""

    @staticmethod
    def forward(ctx, owners, value_table, values, *tables):  # type: ignore[override]
        out, values = fetch_touched(owners, list(tables), value_table, values)
        ctx.owners = owners
        ctx.touched = {i: getattr(out[i], _BLOCK_ROWS) for i in owners}
        ctx.fetched = {i: fetch_of(out[i]) for i in owners}
        ctx.shapes = [t.shape for t in tables]
        ctx.mark_non_differentiable(values)
        return (values, *out)

    @staticmethod
    def backward(ctx, _values_grad, *grads):  # type: ignore[override]
        merged = {}
        for i, owner in ctx.owners.items():
            rows = ctx.touched[i]
            grad = grads[i]
            if grad is None:
                grad = torch.zeros(rows.numel(), ctx.shapes[i][1], device=rows.device)
            merged[i] = (rows, grad.float() * owner.grad_scale)
        summed = route_to_owners(ctx.owners, merged, ctx.fetched)
        out = list(grads)
        for i, (rows, grad) in summed.items():
            dense = torch.zeros(ctx.shapes[i], dtype=grads[i].dtype if grads[i] is not None
                                else grad.dtype, device=grad.device)  # fmt: skip
            out[i] = dense.index_add_(0, rows, grad.to(dense.dtype))
        return (None, None, None, *out)
