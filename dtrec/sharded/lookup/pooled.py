"""Lookup: pool ids on this rank's own blocks, in one batched op per call.

Two kinds of bags meet here: the segments this rank serves for its sharding group
(every source's ids, received by input-dist) and the data-parallel features of its
own batch (never sent). Both are sum-pooled; mean pooling is applied once on the
assembled output (``OutputDist.keyed``), since a row block only sees part of a bag.
With a fused optimizer the backward hands row gradients to the ``FusedUpdater``
instead of producing weight gradients.

Served bags arrive source-major (for each source, for each served segment); the lookup
lays them out *table-major* (for each served table, for each source, that table's
segments), so each table's bags are one contiguous run: the forward pools a table from
one slice and the fused backward takes the layout as it is. Only whole bags move, never
the ids inside a bag, so no float sum changes order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dtrec.ops.op import EmbeddingBagFunction
from dtrec.sharded.dist.input_dist import RoutedBatch
from dtrec.sharded.dist.replica_slices import (
    FetchTouched,
    OwnerSlices,
    entry_value_tables,
    fetch_touched,
)
from dtrec.sharded.dist.routing import Routing
from dtrec.sharded.update.fused_update import FusedUpdater, fused_lookup
from dtrec.sparse import KeyedJaggedTensor


class LocalLookup:
    """Pooled lookups on local shards, plain (autograd grads) or fused (``updater``)."""

    def __init__(
        self,
        routing: Routing,
        updater: FusedUpdater | None,
        offload: Any = None,
        owners: dict[int, OwnerSlices] | None = None,
    ) -> None:
        self._routing = routing
        self._updater = updater
        self._owners = owners or {}  # fully sharded tables' owner slices, by table index
        self._offload = offload  # offloaded tables' caches (``OffloadedTables``), or None
        served, shards = routing.served, routing.shard_size
        # The received (source, segment) blocks in table-major order, as runs of
        # consecutive received blocks (one per table and source).
        self._block_runs = [
            (src * len(served) + a, src * len(served) + b)
            for a, b in table_runs(routing)
            for src in range(shards)
        ]
        self._entries = [served[i % len(served)].table for a, b in self._block_runs
                         for i in range(a, b)]  # fmt: skip
        self._reorders = len(self._block_runs) > 1 and self._block_runs != sorted(self._block_runs)

    def served(self, routed: RoutedBatch, local: dict[int, Tensor]) -> Tensor | None:
        """``[B, S * served width]``: the partials of every source's served segments
        (table-major columns: ``table_runs`` order, then source, then segment; B is
        ``routed.served_batch``, a source with a smaller batch fills only its first
        rows), or None when this rank serves no segment (``[B, 0]`` when per-sample
        weights are trained: their gradient exchange runs on every rank)."""
        routing = self._routing
        served = routing.served
        runs = self._block_runs if self._reorders else None
        lengths, ids, psw = routed.wait_served(len(served), runs)
        if self._offload is not None:  # offloaded tables' ids -> their cache slots
            ids = self._offload.slot_ids(routed, ids, self._entries, lengths, routed.served_batch)
        if not served:
            if psw is not None and psw.requires_grad:  # nothing received: an empty [B, 0]
                # view, so the output dist's backward also runs the weights' one
                return psw.view(routed.served_batch, 0)
            return None
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long, device=lengths.device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return self._pooled(self._entries, local, ids, offsets, psw)

    def fill(self, routed: RoutedBatch) -> None:
        """Fill offloaded tables' caches for a prefetched batch (``OffloadedTables.fill``)."""
        if self._offload is not None and routed.error is None:
            runs = self._block_runs if self._reorders else None
            lengths, ids, _ = routed.wait_served(len(self._routing.served), runs)
            self._offload.fill(routed, ids, self._entries, lengths, routed.served_batch)

    def data_parallel(self, kjt: KeyedJaggedTensor, local: dict[int, Tensor]) -> Tensor:
        """``[B, data-parallel dims]``: the data-parallel features of the own batch."""
        routing = self._routing
        sub = kjt.permute(routing.local_features)
        entries = [routing.slots[k].table for k in routing.local_features]
        return self._pooled(entries, local, sub.values(), sub.offsets(), sub.weights_or_none())

    def _pooled(
        self,
        entry_tables: list[int],
        local: dict[int, Tensor],
        values: Tensor,
        offsets: Tensor,
        psw: Tensor | None,
    ) -> Tensor:
        """Sum-pooled lookup of entries (by collection table index) on local shards.

        Ids were range-checked before routing; with a fused optimizer the
        backward updates the tables instead of returning their gradients.
        """
        table_ids = sorted(set(entry_tables))
        index = {t: i for i, t in enumerate(table_ids)}
        tables = [local[t] for t in table_ids]
        entry_table = [index[t] for t in entry_tables]
        mean = [False] * len(entry_tables)
        # fully sharded tables: read compact tables of their touched rows
        owners = {i: self._owners[t] for i, t in enumerate(table_ids) if t in self._owners}
        if owners:
            value_table = entry_value_tables(entry_table, offsets, values.numel())
        if owners and self._updater is None:  # their gradients reach the owners by autograd
            values, *tables = FetchTouched.apply(owners, value_table, values, *tables)
        elif owners:  # the fused updater sends their row gradients to the owners
            tables, values = fetch_touched(owners, tables, value_table, values)
        if self._updater is not None:
            return fused_lookup(
                self._updater, table_ids, tables, entry_table, mean, values, offsets, psw
            )
        return EmbeddingBagFunction.apply(entry_table, mean, False, values, offsets, psw, *tables)


def table_runs(routing: Routing) -> list[tuple[int, int]]:
    """The served segments as runs ``[a, b)`` of consecutive segments of one table.

    Segments are ordered by feature, and a table's features are consecutive, so each
    table is one run.
    """
    runs: list[tuple[int, int]] = []
    for i, seg in enumerate(routing.served):
        if runs and routing.served[runs[-1][0]].table == seg.table:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
