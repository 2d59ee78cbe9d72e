"""Fused-optimizer backward: row-sparse grads -> replica sync -> update, at the end of backward.

Lookups only *stash* their backward input during backward; one callback
queued on the autograd engine then updates the tables. A table read by one
lookup and owned by this rank alone (no replicas, no column shards) gets the
optimizer's fused backward + step: one pass, no gradient buffer. For the
others, in table order:

1. merges the stashed parts and averages over the world (1 / W);
2. sums them over the table's replicas with a sparse all-gather (bytes grow
   with rows touched, not rows owned), so every replica sees the union of
   touched rows and the same sums;
3. for optimizers that need a row's full sum of squares (row-wise Adagrad),
   all-reduces the partial sums over the column shards of that row;
4. applies the update to the touched rows only.

Doing every collective in one place, in table order, keeps ranks that share a
group (replicas, column shards, the data-parallel world) in step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from dtrec.collectives import _record
from dtrec.ops.embedding_bag import Lookup
from dtrec.ops.op import lookup_backward_rows, lookup_forward
from dtrec.optim import FusedOptimizer, RowUpdate


def sum_by_row(ids: Tensor, grads: Tensor) -> tuple[Tensor, Tensor]:
    """Sum gradient rows with the same id; result sorted by id (deterministic on CPU)."""
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    return unique, grads.new_zeros(unique.numel(), grads.shape[1]).index_add_(0, inverse, grads)


def merge_rows(parts: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Merge several (sorted unique rows, grads) results of one table."""
    if len(parts) == 1:
        return parts[0]
    return sum_by_row(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))


def sparse_all_reduce_rows(
    rows: Tensor, grads: Tensor, group: ProcessGroup | None, kind: str
) -> tuple[Tensor, Tensor]:
    """Sum row-sparse gradients over ``group``; every member gets the same (rows, sums)."""
    size = 1 if group is None else dist.get_world_size(group)
    if size == 1:
        return rows, grads
    count = torch.tensor([rows.numel()], dtype=torch.long, device=rows.device)
    counts = torch.empty(size, dtype=torch.long, device=rows.device)
    dist.all_gather_into_tensor(counts, count, group=group)
    most = int(counts.max())
    dim = grads.shape[1]
    padded_rows = torch.full((most,), -1, dtype=torch.long, device=rows.device)
    padded_rows[: rows.numel()] = rows
    padded_grads = grads.new_zeros(most, dim)
    padded_grads[: rows.numel()] = grads
    all_rows = torch.empty(size * most, dtype=torch.long, device=rows.device)
    all_grads = grads.new_empty(size * most, dim)
    _record(kind, (size - 1) * most * (8 + dim * grads.element_size()))
    dist.all_gather_into_tensor(all_rows, padded_rows, group=group)
    dist.all_gather_into_tensor(all_grads, padded_grads, group=group)
    valid = all_rows >= 0
    return sum_by_row(all_rows[valid], all_grads[valid])


class TableUpdate:
    """What the updater needs to know about one local table (shard)."""

    def __init__(
        self,
        weight: Tensor,
        replica_group: ProcessGroup | None,
        column_group: ProcessGroup | None,
        full_dim: int,
    ) -> None:
        self.weight = weight
        self.replica_group = replica_group
        self.column_group = column_group
        self.full_dim = full_dim


class FusedUpdater:
    """Owns a collection's fused optimizer state and applies its updates."""

    def __init__(
        self,
        optimizer: FusedOptimizer,
        tables: dict[int, TableUpdate],
        state: dict[int, dict[str, Tensor]],
        world_size: int,
    ) -> None:
        self.optimizer = optimizer
        self.tables = tables
        self.state = state
        self.world_size = world_size
        self._pending: list[tuple[list[int], Lookup, Tensor]] = []

    def stash(self, table_ids: list[int], lookup: Lookup, grad_out: Tensor) -> None:
        """Record a lookup's backward input; the sync and update run when backward ends."""
        if not self._pending:
            torch.autograd.Variable._execution_engine.queue_callback(self.apply_pending)
        self._pending.append((table_ids, lookup, grad_out))

    def _syncs(self, t: int) -> bool:
        """Whether table ``t``'s gradient is summed over other ranks before its update."""
        update = self.tables[t]
        group = update.replica_group
        return update.column_group is not None or (
            group is not None and dist.get_world_size(group) > 1
        )

    def apply_pending(self) -> None:
        """Update every table touched by this backward.

        A lookup whose tables need no sync and appear in no other lookup gets the fused
        backward + step (one pass on the Triton backend). The other tables' row grads are
        synced in table order, then updated all at once.
        """
        pending, self._pending = self._pending, []
        uses = Counter(t for table_ids, _, _ in pending for t in table_ids)
        parts: dict[int, list[tuple[Tensor, Tensor]]] = {}
        for table_ids, lookup, grad_out in pending:
            if not any(uses[t] > 1 or self._syncs(t) for t in table_ids):
                with torch.no_grad():
                    self.optimizer.backward_update(
                        lookup, grad_out, [self.state[t] for t in table_ids], 1 / self.world_size
                    )
                continue
            rows = lookup_backward_rows(lookup, grad_out)
            for t, part in zip(table_ids, rows, strict=True):
                parts.setdefault(t, []).append(part)
        updates = []
        for t in sorted(parts):
            pending_t = parts[t]
            update = self.tables[t]
            rows, grads = merge_rows(pending_t)
            grads = grads / self.world_size
            rows, grads = sparse_all_reduce_rows(
                rows, grads, update.replica_group, "grad_sync.replicate.sparse"
            )
            row_sq_sum = None
            if self.optimizer.needs_row_sq_sum and update.column_group is not None:
                row_sq_sum = grads.square().sum(1)
                size = dist.get_world_size(update.column_group)
                _record("optim.row_sq_sum", 2 * (size - 1) * row_sq_sum.numel() * 4 // size)
                dist.all_reduce(row_sq_sum, group=update.column_group)
            updates.append(
                RowUpdate(update.weight, self.state[t], rows, grads, row_sq_sum, update.full_dim)
            )
        with torch.no_grad():
            self.optimizer.update_tables(updates)


class FusedLookup(torch.autograd.Function):
    """Forward: the pooled lookup. Backward: stash row grads with the updater, no weight grads.

    ``trigger`` is a throwaway leaf that requires grad, so backward reaches this
    node even though the tables themselves do not require grad.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, trigger, updater, table_ids, tables, entry_table, mean, values, offsets, psw
    ):
        ctx.updater, ctx.table_ids = updater, table_ids
        ctx.tables, ctx.entry_table, ctx.mean = tables, entry_table, mean
        ctx.save_for_backward(values, offsets, psw)
        return lookup_forward(Lookup(tables, entry_table, values, offsets, mean, psw))

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        values, offsets, psw = ctx.saved_tensors
        lookup = Lookup(ctx.tables, ctx.entry_table, values, offsets, ctx.mean, psw)
        ctx.updater.stash(ctx.table_ids, lookup, grad_out.contiguous())
        return (None,) * 9


def fused_lookup(
    updater: FusedUpdater,
    table_ids: list[int],
    tables: list[Tensor],
    entry_table: list[int],
    mean: list[bool],
    values: Tensor,
    offsets: Tensor,
    psw: Tensor | None,
) -> Tensor:
    """Pooled lookup whose backward feeds ``updater`` instead of producing weight grads."""
    trigger = torch.empty(0, requires_grad=torch.is_grad_enabled())
    return FusedLookup.apply(
        trigger, updater, table_ids, tables, entry_table, mean, values, offsets, psw
    )
