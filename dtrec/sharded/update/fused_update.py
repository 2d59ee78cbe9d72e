"""Fused-optimizer backward: row-sparse grads -> replica sync -> update, at the end of backward.

Lookups only *stash* their backward input during backward; one callback
queued on the autograd engine then updates the tables. A table read by one
lookup and owned by this rank alone (no replicas, no column shards) gets the
optimizer's fused backward + step: one pass, no gradient buffer. For the
others, in table order:

1. merges the stashed parts and averages over the ranks whose batches they
   sum (1 / W; 1 / S when replicas sync weights instead, ``sync_every``);
2. sums them over the table's replicas (``dtrec.sharded.update.grad_sync``: a sparse
   all-gather whose bytes grow with rows touched, or a dense all-reduce when
   that is cheaper; all tables of a group share the collectives), so every
   replica sees the union of touched rows and the same sums;
3. for optimizers that need a row's full sum of squares (row-wise Adagrad),
   all-reduces the partial sums over the column shards of that row (one
   all-reduce per group of column peers);
4. applies the update to the touched rows only.

The rule's hyperparameters are read from the collection's param group
(``model.fused_optimizer.param_groups``) when the update runs, so an LR scheduler
or a hand-set ``group["lr"]`` changes the very next update; a bad group raises
before any collective or weight change.

Doing every collective in one place, in a fixed order of groups, keeps ranks
that share a group (replicas, column shards, the data-parallel world) in step.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from dtrec._torch_compat import current_backward_id, queue_backward_callback
from dtrec.comm.collectives import PendingTensors, all_reduce_coalesced_start
from dtrec.comm.quantized import Codec
from dtrec.kernels.update_math import row_sq_sums
from dtrec.ops.lookup import Lookup
from dtrec.ops.op import embedding_bag_psw_backward_op, lookup_backward_rows, lookup_forward
from dtrec.optim import FusedOptimizer, RowUpdate
from dtrec.optim.param_groups import rule_for_group
from dtrec.sharded.dist.replica_slices import (
    OwnerSlices,
    block_rows_of,
    fetch_of,
    route_to_owners,
)
from dtrec.sharded.lookup.compiled import fused_embedding_bag_op, register_updater
from dtrec.sharded.update.grad_sync import TableRows, sum_by_row, sync_rows


def merge_rows(
    parts: Sequence[tuple[Tensor, Tensor]], num_rows: int | None = None
) -> tuple[Tensor, Tensor]:
    """Merge several (sorted unique rows, grads) results of one table (of ``num_rows``)."""
    if len(parts) == 1:
        return parts[0]
    ids, grads = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return sum_by_row(ids, grads, num_rows)


class TableUpdate:
    """What the updater needs to know about one local table (shard)."""

    def __init__(
        self,
        weight: Tensor,
        replica_group: ProcessGroup | None,
        column_group: ProcessGroup | None,
        full_dim: int,
        grad_scale: float,
        sync_kind: str,
        sync_codec: Codec | None = None,
    ) -> None:
        self.weight = weight
        self.sync_codec = sync_codec  # how its replica sync sends rows (None: fp32)
        self.sync_kind = sync_kind  # names its replica sync in dtrec.comm_stats
        self.replica_group = replica_group
        self.column_group = column_group
        self.full_dim = full_dim
        self.grad_scale = grad_scale  # 1 / number of ranks whose batches the gradient sums
        self.cache: Any = None
        """An offloaded table's ``dtrec.sharded.offload.RowCache`` (``weight`` is then its
        device cache, lookups read slots): row grads go to block rows before any sync,
        and the update goes to the rows' slots (or to host memory for rows not cached)."""
        self.owner: OwnerSlices | None = None
        """A fully sharded table's owner slices (``weight`` is then this rank's slice,
        lookups read compact tables of fetched rows): row grads go to shard rows, then to
        their owners instead of a replica sync (``dtrec.sharded.dist.replica_slices``)."""

    @property
    def num_rows(self) -> int:
        """Rows of the shard (of the block in host memory, for an offloaded table)."""
        if self.owner is not None:
            return self.owner.block_rows
        return self.weight.shape[0] if self.cache is None else self.cache.num_rows


class FusedUpdater:
    """Owns a collection's fused optimizer state and applies its updates."""

    def __init__(
        self,
        optimizer: FusedOptimizer,
        tables: dict[int, TableUpdate],
        state: dict[int, dict[str, Tensor]],
    ) -> None:
        self.optimizer = optimizer
        """The rule as configured; its hyperparameters are overridden by ``param_group``."""
        self.tables = tables
        self.state = state
        self.param_group: dict[str, Any] | None = None
        """The live torch param group (``FusedOptimizerView`` sets it) read at every update."""
        self._pending: list[tuple[list[int], Lookup, Tensor]] = []
        self.offload: Any = None
        """The collection's ``dtrec.sharded.offload.OffloadedTables`` (None without one):
        its copies in flight land before an update, its training batches' rows are
        released after it."""
        self.accumulating = False
        """True inside ``dtrec.accumulate_gradients``: backwards only stash; the block's end
        applies them all as one update (``dtrec.sharded.update.accumulate``)."""
        self.after_update: Callable[[], None] | None = None
        """Called once this updater's tables are updated (the collection starts a due
        ``sync_every`` replica average there)."""
        device = next((u.weight.device for u in tables.values()), torch.device("cpu"))
        self.trigger = torch.empty(0, device=device, requires_grad=True)
        """The compiled lookup's grad-requiring input (``lookup/compiled.py``): one leaf,
        so the traced forward creates none."""
        self.key = register_updater(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (``deepcopy``, unpickling) gets its own key for the compiled backward."""
        self.__dict__.update(state)
        self.key = register_updater(self)

    #: How replicas sum their row grads (set from the collection's ``replica_sync``).
    replica_sync: str = "auto"

    def stash(self, table_ids: list[int], lookup: Lookup, grad_out: Tensor) -> None:
        """Record a lookup's backward input; the sync and update run when backward ends.

        Stashes left by a backward that raised before its end (its callback never ran) are
        dropped here, with a warning: that step updates no table (all or nothing), and
        this backward gets its own end-of-backward update.
        """
        if self.accumulating:
            self._pending.append((table_ids, lookup, grad_out))
            return
        backward = current_backward_id()
        if _WAITING.updaters and _WAITING.backward != backward:
            _drop_unfinished_backward()
        if not self._pending:
            if not _WAITING.updaters:
                queue_backward_callback(update_waiting)
                _WAITING.backward = backward
            _WAITING.updaters.append(self)
        self._pending.append((table_ids, lookup, grad_out))

    def current_rule(self) -> FusedOptimizer:
        """The rule with this step's hyperparameters (ValueError for a bad param group)."""
        if self.param_group is None:
            return self.optimizer
        return rule_for_group(self.optimizer, self.param_group)

    def _syncs(self, t: int) -> bool:
        """Whether table ``t``'s gradient is summed over other ranks before its update."""
        update = self.tables[t]
        group = update.replica_group
        return update.column_group is not None or (
            group is not None and dist.get_world_size(group) > 1
        )

    def apply_pending(self, rule: FusedOptimizer, scale: float = 1.0) -> None:
        """Update every table touched by this backward, with ``rule`` (``current_rule()``),
        its gradients multiplied by ``scale`` (``accumulate_gradients``' ``1 / divide_by``).

        A lookup whose tables need no sync and appear in no other lookup gets the fused
        backward + step (one pass on the Triton backend). The other tables' row grads are
        synced in table order, then updated all at once.
        """
        pending, self._pending = self._pending, []
        if self.offload is not None:
            self.offload.join()
        uses = Counter(t for table_ids, _, _ in pending for t in table_ids)
        parts: dict[int, list[tuple[Tensor, Tensor]]] = {}
        fetched: dict[int, list] = {}  # fully sharded: the fetch of each compact table
        for table_ids, lookup, grad_out in pending:
            scales = {self.tables[t].grad_scale * scale for t in table_ids}
            if len(scales) == 1 and not any(uses[t] > 1 or self._syncs(t) for t in table_ids):
                with torch.no_grad():
                    rule.backward_update(
                        lookup, grad_out, [self.state[t] for t in table_ids], scales.pop()
                    )
                continue
            rows = lookup_backward_rows(lookup, grad_out)
            for t, part, compact in zip(table_ids, rows, lookup.weights, strict=True):
                cache = self.tables[t].cache
                if self.tables[t].owner is not None:  # compact rows -> shard rows (an
                    part = (block_rows_of(compact, part[0]), part[1])  # offloaded one's
                    fetched.setdefault(t, []).append(fetch_of(compact))  # too: no slots)
                    cache = None
                parts.setdefault(t, []).append(part if cache is None else cache.to_rows(*part))
        one = {t: f[0] for t, f in fetched.items() if len(f) == 1}
        self._sync_and_update(rule, parts, scale, one)
        if self.offload is not None:
            self.offload.after_update()
        if self.after_update is not None:
            self.after_update()

    def _sync_and_update(
        self,
        rule: FusedOptimizer,
        parts: dict[int, list[tuple[Tensor, Tensor]]],
        scale: float,
        fetched: dict | None = None,
    ) -> None:
        """Average, sum over replicas (coalesced per group), reduce row norms, update.

        Row norms of tables with column peers but no replicas are started first, so their
        all-reduce runs while the replica syncs and the other tables' updates do; tables
        with both wait for their replica sums. Groups are visited in the order of their
        first table, the same on every member (a group's tables are the same on all its
        members), so no two ranks wait on each other's groups in opposite orders.
        """
        merged = {}
        for t in sorted(parts):
            rows, grads = merge_rows(parts[t], self.tables[t].num_rows)
            merged[t] = (rows, grads * (self.tables[t].grad_scale * scale))
        by_column = [] if not rule.needs_row_sq_sum else [t for t in merged if self._columns(t)]
        unsynced = [t for t in by_column if not self._replicated(t)]
        row_sq_sums = self._start_row_sq_sums(merged, unsynced)
        owners = {t: o for t in merged if (o := self.tables[t].owner) is not None}
        # fully sharded: to owner slices (along the rows' fetch where one lookup read them)
        merged.update(route_to_owners(owners, merged, fetched))
        for tables, group in _by_group(
            merged, lambda t: None if t in owners else self.tables[t].replica_group
        ):
            synced = sync_rows(
                [
                    TableRows(*merged[t], self.tables[t].num_rows, self.tables[t].cache is None)
                    for t in tables
                ],
                group,
                self.tables[tables[0]].sync_kind,
                self.replica_sync,
                self.tables[tables[0]].sync_codec,
            )
            merged.update(zip(tables, synced, strict=True))
        row_sq_sums += self._start_row_sq_sums(merged, [t for t in by_column if t not in unsynced])
        self._update(rule, merged, [t for t in merged if t not in by_column], {})
        sums = {t: s for tables, pending in row_sq_sums for t, s in zip(tables, pending.wait())}
        self._update(rule, merged, by_column, sums)

    def _columns(self, t: int) -> bool:
        group = self.tables[t].column_group
        return group is not None and dist.get_world_size(group) > 1

    def _replicated(self, t: int) -> bool:
        group = self.tables[t].replica_group
        return group is not None and dist.get_world_size(group) > 1

    def _start_row_sq_sums(
        self, merged: dict[int, tuple[Tensor, Tensor]], tables: list[int]
    ) -> list[tuple[list[int], PendingTensors]]:
        """Start, per column group, one all-reduce of the tables' per-row squared-gradient
        sums (every column peer holds the same touched rows, in the same order)."""
        started = []
        chosen = {t: merged[t] for t in tables}
        for group_tables, group in _by_group(chosen, lambda t: self.tables[t].column_group):
            sums = [row_sq_sums(merged[t][1]) for t in group_tables]
            started.append(
                (group_tables, all_reduce_coalesced_start(sums, group, "optim.row_sq_sum"))
            )
        return started

    def _update(
        self,
        rule: FusedOptimizer,
        merged: dict[int, tuple[Tensor, Tensor]],
        tables: list[int],
        row_sq_sums: dict[int, Tensor],
    ) -> None:
        """Apply ``rule`` to the touched rows of ``tables`` (one batched call)."""
        if not tables:
            return
        updates, far = [], []
        # the call's widest table with rows, which the rows staged in a call of their own
        # are tiled by as well (``RowUpdate.tile_dim``): bitwise the uncached step
        widest = max((self.tables[t].weight.shape[1] for t in tables if merged[t][0].numel()),
                     default=None)  # fmt: skip
        for t in tables:
            table = self.tables[t]
            if table.cache is None:
                updates.append(RowUpdate(
                    table.weight, self.state[t], *merged[t], row_sq_sums.get(t), table.full_dim
                ))  # fmt: skip
                continue
            cached, rest = table.cache.row_updates(
                *merged[t], row_sq_sums.get(t), table.full_dim, widest
            )
            updates.append(cached)
            if rest is not None:  # rows not cached here: staged, packed, a call of their own
                far.append(rest)
        # staged before the first call steps the per-table scalars (Adam's step) they copy
        staged = self.offload.staged_updates(far) if far else []
        with torch.no_grad():
            rule.update_tables(updates)
            if staged:
                rule.update_tables(staged)
        for t in tables:
            if self.tables[t].cache is not None:
                self.tables[t].cache.write_back_staged()


@dataclass
class _Waiting:
    """The updaters with stashed backward input, in stash order, and the autograd graph
    task (``backward()`` call) whose end ``update_waiting`` is queued for."""

    updaters: list[FusedUpdater] = field(default_factory=list)
    backward: int = -1


_WAITING = _Waiting()


def _drop_unfinished_backward() -> None:
    """Forget the stashes of a backward that raised before its end-of-backward update."""
    warnings.warn(
        "a previous backward() stopped before its fused embedding update ran (an exception "
        "during backward?): its embedding gradients are dropped and no table was updated for "
        "that step",
        RuntimeWarning,
        stacklevel=3,
    )
    for updater in _WAITING.updaters:
        updater._pending = []
    _WAITING.updaters.clear()


def update_waiting() -> None:
    """The end-of-backward callback of every fused collection: all or nothing.

    Every waiting updater's param group is checked before any of them syncs or updates,
    so a bad group (ValueError) changes no table, and every updater's stash is dropped
    whatever fails, so no half-finished backward leaks into the next one.
    """
    updaters = list(_WAITING.updaters)
    _WAITING.updaters.clear()
    try:
        rules = [u.current_rule() for u in updaters]  # no collective yet: ranks raise alike
        for updater, rule in zip(updaters, rules, strict=True):
            updater.apply_pending(rule)
    finally:
        for updater in updaters:
            updater._pending = []


def _by_group(
    tables: dict[int, object], group_of: Callable[[int], ProcessGroup | None]
) -> list[tuple[list[int], ProcessGroup]]:
    """Tables with a group of more than one rank, by group, ordered by each group's first table."""
    by_group: dict[int, tuple[list[int], ProcessGroup]] = {}
    for t in sorted(tables):
        group = group_of(t)
        if group is not None and dist.get_world_size(group) > 1:
            by_group.setdefault(id(group), ([], group))[0].append(t)
    return list(by_group.values())


class FusedLookup(torch.autograd.Function):
    """Forward: the pooled lookup. Backward: stash row grads with the updater, no weight grads
    (per-sample weights that require grad get theirs).

    ``trigger`` is a throwaway leaf that requires grad, so backward reaches this
    node even though the tables themselves do not require grad.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, trigger, updater, table_ids, tables, entry_table, mean, values, offsets, psw, error
    ):
        ctx.updater, ctx.table_ids = updater, table_ids
        ctx.tables, ctx.entry_table, ctx.mean, ctx.error = tables, entry_table, mean, error
        ctx.save_for_backward(values, offsets, psw)
        return lookup_forward(Lookup(tables, entry_table, values, offsets, mean, psw, error))

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        values, offsets, psw = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        lookup = Lookup(ctx.tables, ctx.entry_table, values, offsets, ctx.mean, psw, ctx.error)
        ctx.updater.stash(ctx.table_ids, lookup, grad_out)
        grad_psw = None
        if ctx.needs_input_grad[8]:  # trained per-sample weights: w.r.t. the rows read now,
            # before the end-of-backward update changes them
            grad_psw = embedding_bag_psw_backward_op(
                ctx.tables, ctx.entry_table, values, offsets, grad_out
            ).to(psw.dtype)
        return (None,) * 8 + (grad_psw, None)


def fused_lookup(
    updater: FusedUpdater,
    table_ids: list[int],
    tables: list[Tensor],
    entry_table: list[int],
    mean: list[bool],
    values: Tensor,
    offsets: Tensor,
    psw: Tensor | None,
    error: Tensor | None = None,
    check_ids: bool = False,
) -> Tensor:
    """Pooled lookup whose backward feeds ``updater`` instead of producing weight grads.

    A bad param group is reported here, in forward, where failing leaves no half-stashed
    backward behind (the update reads the group again when it runs). ``error``: the
    ``Lookup.error`` flag its ids are checked into (backends that skip bad ids), which
    also stops its update. ``check_ids`` (compiled only): IndexError for an id outside
    its table, raised inside the op (``lookup/compiled.py``).
    """
    if torch.compiler.is_compiling():  # one traceable op (``lookup/compiled.py``)
        assert error is None, "the compiled lookup checks ids in the op"
        return fused_embedding_bag_op(
            updater.trigger, tables, entry_table, values, offsets, mean, psw, check_ids,
            table_ids, updater.key,
        )  # fmt: skip
    if torch.is_grad_enabled():
        updater.current_rule()
    trigger = torch.empty(0, requires_grad=torch.is_grad_enabled())
    return FusedLookup.apply(
        trigger, updater, table_ids, tables, entry_table, mean, values, offsets, psw, error
    )
