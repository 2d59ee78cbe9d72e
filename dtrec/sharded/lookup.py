"""Lookup: pool ids on this rank's own blocks, in one batched op per call.

Two kinds of bags meet here: the segments this rank serves for its sharding group
(every source's ids, received by input-dist) and the data-parallel features of its
own batch (never sent). Both are sum-pooled; mean pooling is applied once on the
assembled output (``OutputDist.keyed``), since a row block only sees part of a bag.
With a fused optimizer the backward hands row gradients to the ``FusedUpdater``
instead of producing weight gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dtrec.ops.op import EmbeddingBagFunction
from dtrec.sharded.fused_update import FusedUpdater, fused_lookup
from dtrec.sharded.input_dist import RoutedBatch
from dtrec.sharded.routing import Routing
from dtrec.sparse import KeyedJaggedTensor


class LocalLookup:
    """Pooled lookups on local shards, plain (autograd grads) or fused (``updater``)."""

    def __init__(self, routing: Routing, updater: FusedUpdater | None) -> None:
        self._routing = routing
        self._updater = updater

    def served(self, routed: RoutedBatch, local: dict[int, Tensor]) -> Tensor | None:
        """``[B, S * served width]``: the partials of every source's served segments
        (source-major columns), or None when this rank serves no segment (``[B, 0]`` when
        per-sample weights are trained: their gradient exchange runs on every rank)."""
        routing = self._routing
        served = routing.served
        lengths, ids, psw = routed.wait_served(len(served))
        if not served:
            if psw is not None and psw.requires_grad:  # nothing received: an empty [B, 0]
                # view, so the output dist's backward also runs the weights' one
                return psw.view(routed.batch, 0)
            return None
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long, device=lengths.device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        entries = [s.table for _ in range(routing.shard_size) for s in served]
        return self._pooled(entries, local, ids, offsets, psw)

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
        if self._updater is not None:
            return fused_lookup(
                self._updater, table_ids, tables, entry_table, mean, values, offsets, psw
            )
        return EmbeddingBagFunction.apply(entry_table, mean, False, values, offsets, psw, *tables)
