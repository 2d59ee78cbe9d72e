"""One offloaded block: every row in host memory, ``capacity`` of them in a device cache.

The host tier holds the block's rows and their optimizer state (row-wise Adagrad's
sum, Adam's moments); the device tier holds ``capacity`` slots of both, packed with the
collection's other device tables so one kernel reads them all. ``slot_of[row]`` is the
slot holding a row (-1: host only), ``row_of[slot]`` its inverse. A cached row's slot
is its only current copy (the host copy is stale until written back), so lookups and
updates always read and write the slot: no lookup ever reads a stale row.

Fills run for every offloaded block of the collection at once (``group.CacheGroup``,
which owns the bookkeeping tensors; this block's are views of them): a batch's distinct
rows that miss get slots, taken first from empty slots, then from the least recently
used rows that no batch in flight holds (``pins``); evicted rows that changed since their
fill (``dirty``) are written back with their state, then the missing rows and their
state are copied in. LRU rather than LFU: it is FBGEMM's default for TorchRec's UVM
cache, it follows ids whose popularity drifts without an ageing rule (LFU's counts keep
yesterday's hot rows), and under skewed (Zipf) ids the hot rows are recent as well as
frequent, so it keeps them too.

The fused optimizer updates cached rows in their slots; a synced update can touch rows
this rank did not look up (rows another replica's batch touched): those are updated in
a staging copy of their host rows (``row_updates``, ``staging.py``, ``write_back_staged``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dtrec.ops.backends.base import RowUpdate
from dtrec.sharded.offload.host import CopyStream

if TYPE_CHECKING:
    from dtrec.sharded.offload.group import CacheGroup


@dataclass
class FarRows:
    """One table's rows of a step that are not cached here, with their step's inputs."""

    cache: RowCache
    rows: Tensor
    """Sorted rows of the block (host-tier indices, on the CPU)."""
    grads: Tensor
    row_sq_sum: Tensor | None
    full_dim: int
    tile_dim: int | None


class RowCache:
    """A block's host tier, its device cache and the map between them (module doc)."""

    def __init__(
        self,
        name: str,
        host: Tensor,
        host_state: dict[str, Tensor],
        weight: Tensor,
        state: dict[str, Tensor],
        copies: CopyStream,
    ) -> None:
        self.name = name
        self.host = host
        """The block ``[rows, cols]`` in host memory (its DTensor's local tensor)."""
        self.host_state = host_state
        """Its optimizer state with one entry per row (row- or weight-shaped), host tier."""
        self.weight = weight
        """The device cache ``[capacity, cols]`` (a view of the collection's packed buffer)."""
        self.state = state
        """The optimizer state the updater steps: cache-shaped, plus per-table scalars."""
        self.copies = copies
        self.group: CacheGroup | None = None
        """The ``group.CacheGroup`` that owns this block's bookkeeping (``bind``)."""
        self.slice_start: int | None = None
        """Fully sharded (``dtrec.sharded.dist.replica_slices``): the shard row of this
        rank's owner slice's first row, the host block; the lookup's ids index the shard,
        and a fill caches only the ids in this slice (``CacheGroup.plan``). None: the ids
        index the block."""
        self._k = -1
        self._staged: tuple[Tensor, Tensor, dict[str, Tensor]] | None = None
        self._other_bytes = {"h2d_bytes": 0, "d2h_bytes": 0}

    def bind(
        self,
        group: CacheGroup,
        k: int,
        slot_of: Tensor,
        row_of: Tensor,
        last_used: Tensor,
        dirty: Tensor,
        pins: Tensor,
    ) -> None:
        """Take this block's views of ``group``'s bookkeeping (it is the group's ``k``-th):
        ``slot_of`` has one entry per row and a scratch one, the others one per slot."""
        self.group, self._k = group, k
        self.slot_of, self.row_of, self.last_used = slot_of, row_of, last_used
        self.dirty, self.pins = dirty, pins

    @property
    def stats(self) -> dict[str, int]:
        """Distinct rows looked up, of which missed; bytes copied host -> device and back
        (a host read of the group's device counters: not for the step path)."""
        assert self.group is not None, "bound by its CacheGroup"
        rows, misses, written = self.group.table_counts()[self._k]
        row_bytes = self._row_bytes()
        return {
            "rows": rows,
            "misses": misses,
            "h2d_bytes": misses * row_bytes + self._other_bytes["h2d_bytes"],
            "d2h_bytes": written * row_bytes + self._other_bytes["d2h_bytes"],
        }

    @property
    def num_rows(self) -> int:
        """Rows of the block (the host tier's)."""
        return self.host.shape[0]

    @property
    def capacity(self) -> int:
        return self.weight.shape[0]

    def _tiers(self) -> list[tuple[Tensor, Tensor]]:
        """(device cache, host tier) of the weight and of each per-row state entry."""
        return [(self.weight, self.host)] + [(self.state[k], v) for k, v in self.host_state.items()]

    def _row_bytes(self, weight_only: bool = False) -> int:
        tiers = self._tiers()[:1] if weight_only else self._tiers()
        return sum(h[0].numel() * h.element_size() if h.numel() else 0 for _, h in tiers)

    def count_prefill(self) -> None:
        """Count a whole-table copy into the cache (``CacheGroup.prefill``) in ``stats``."""
        self._other_bytes["h2d_bytes"] += self.num_rows * self._row_bytes()

    def overflow(self, distinct: int, pinned: int, where: str) -> ValueError:
        """The error for a batch whose ``distinct`` rows (with ``pinned`` more slots held by
        other batches in flight) do not fit the cache."""
        return ValueError(
            f"table {self.name!r} ({where}): this batch needs {distinct} distinct rows "
            f"in its device cache, which holds {self.capacity} rows ({pinned} more are "
            "pinned by other batches in flight); give the table a larger cache (cache_rows / "
            "cache_fraction) or feed smaller batches"
        )

    def move(self, moves: tuple[Tensor, ...]) -> None:
        """The row copies of a fill of this block's whole group (``CacheGroup.move``): a
        collection issues each fill's copies through its first block, as one job."""
        assert self.group is not None, "bound by its CacheGroup"
        self.group.move(moves)

    def mark_written(self, slots: Tensor) -> None:
        """These slots' rows will change (a training batch's): write them back on eviction."""
        self.dirty.index_fill_(0, slots, True)

    # ------------------------------------------------------------------ updates

    def to_rows(self, slots: Tensor, grads: Tensor) -> tuple[Tensor, Tensor]:
        """A lookup's (sorted unique slots, gradient rows) as (sorted rows of the block, the
        same gradient rows reordered): how replicas and column peers exchange them."""
        rows, order = torch.sort(self.row_of.index_select(0, slots))
        return rows, grads.index_select(0, order)

    def row_updates(
        self,
        rows: Tensor,
        grads: Tensor,
        row_sq_sum: Tensor | None,
        full_dim: int,
        tile_dim: int | None = None,
    ) -> tuple[RowUpdate, FarRows | None]:
        """The fused step of ``rows`` (sorted rows of the block): the cached ones in their
        slots, and, when a synced update touches rows not cached here, those rows for a
        staging copy (``staging.staged_updates``; ``write_back_staged`` after the step).
        ``tile_dim``: the widest table of the step (``RowUpdate.tile_dim``)."""
        slots = self.slot_of.index_select(0, rows).long()
        cached = slots >= 0
        count = int(cached.sum())
        if count == rows.numel():
            return self._slot_update(slots, grads, row_sq_sum, full_dim, tile_dim), None
        order = torch.argsort(cached.logical_not().to(torch.int8), stable=True)
        here, far = order[:count], order[count:]
        sq = _pick(row_sq_sum, here)
        update = self._slot_update(slots[here], grads[here], sq, full_dim, tile_dim)
        far_rows = rows.index_select(0, far).cpu()
        staged = FarRows(
            self, far_rows, grads.index_select(0, far), _pick(row_sq_sum, far), full_dim, tile_dim
        )
        return update, staged

    def read_rows(self, rows: Tensor) -> Tensor:
        """The current values of the block's rows ``rows`` (any order, repeats allowed) on
        the device, without changing the cache: a cached row from its slot (its only
        current copy), the others from host memory (written back on eviction), one indexed
        host gather and one copy. What a fully sharded owner answers its replicas with
        (``replica_slices.fetch_touched``); the host reads which rows missed."""
        slots = self.slot_of.index_select(0, rows).long()
        cached = slots >= 0
        out = self.weight.index_select(0, slots.clamp(min=0))
        far = torch.nonzero(cached.logical_not()).squeeze(1)
        if far.numel():
            host_rows = rows.index_select(0, far).cpu()
            out.index_copy_(0, far, self.copies.to_device(self.host.index_select(0, host_rows)))
            self._other_bytes["h2d_bytes"] += far.numel() * self._row_bytes(weight_only=True)
        return out

    def stage(self, rows: Tensor, weight: Tensor, state: dict[str, Tensor]) -> None:
        """Copy host rows ``rows`` (and their state) into staging buffers ``weight`` and
        ``state`` (views of the step's packed staging buffers) for the step."""
        weight.copy_(self.copies.to_device(self.host.index_select(0, rows)))
        for k, v in state.items():
            v.copy_(self.copies.to_device(self.host_state[k].index_select(0, rows)))
        self._staged = (rows, weight, state)
        self._other_bytes["h2d_bytes"] += rows.numel() * self._row_bytes()

    def _slot_update(
        self,
        slots: Tensor,
        grads: Tensor,
        row_sq_sum: Tensor | None,
        full_dim: int,
        tile_dim: int | None,
    ) -> RowUpdate:
        slots, order = torch.sort(slots)
        self.mark_written(slots)
        sq = None if row_sq_sum is None else row_sq_sum.index_select(0, order)
        grads = grads.index_select(0, order)
        return RowUpdate(self.weight, self.state, slots, grads, sq, full_dim, tile_dim)

    def write_back_staged(self) -> None:
        """After the step: the staged rows back to host memory."""
        if self._staged is None:
            return
        rows, weight, state = self._staged
        self._staged = None
        self.host.index_copy_(0, rows, self.copies.to_host(weight))
        for k, v in state.items():
            self.host_state[k].index_copy_(0, rows, self.copies.to_host(v))
        self._other_bytes["d2h_bytes"] += rows.numel() * self._row_bytes()

    # ------------------------------------------------------------------ whole cache

    def flush(self) -> None:
        """Write every changed cached row back to host memory, then empty every slot no
        batch in flight pins (so the host tier is current, and a later write into it, e.g.
        a checkpoint load, is what the next fill reads)."""
        written = torch.nonzero(self.dirty & (self.row_of >= 0)).squeeze(1)
        if written.numel():
            rows = self.row_of.index_select(0, written).cpu()
            for device, host in self._tiers():
                host.index_copy_(0, rows, self.copies.to_host(device.index_select(0, written)))
            self._other_bytes["d2h_bytes"] += rows.numel() * self._row_bytes()
        self.dirty.zero_()
        drop = torch.nonzero((self.pins == 0) & (self.row_of >= 0)).squeeze(1)
        if drop.numel():
            self.slot_of.index_fill_(0, self.row_of.index_select(0, drop), -1)
            self.row_of.index_fill_(0, drop, -1)


def _pick(values: Tensor | None, index: Tensor) -> Tensor | None:
    return None if values is None else values.index_select(0, index)
