"""One offloaded block: every row in host memory, ``capacity`` of them in a device cache.

The host tier holds the block's rows and their optimizer state (row-wise Adagrad's
sum, Adam's moments); the device tier holds ``capacity`` slots of both, packed with the
collection's other device tables so one kernel reads them all. ``slot_of[row]`` is the
slot holding a row (-1: host only), ``row_of[slot]`` its inverse. A cached row's slot
is its only current copy (the host copy is stale until written back), so lookups and
updates always read and write the slot: no lookup ever reads a stale row.

A batch's fill (``plan`` then ``start``, the row copies in ``move``): its distinct rows
that miss get slots, taken first from empty slots, then from the least recently used
rows that no batch in flight holds (``pins``); evicted rows that changed since their
fill (``dirty``) are written back with their state, then the missing rows and their
state are copied in. LRU rather than LFU: it is FBGEMM's default for TorchRec's UVM
cache, it follows ids whose popularity drifts without an ageing rule (LFU's counts keep
yesterday's hot rows), and under skewed (Zipf) ids the hot rows are recent as well as
frequent, so it keeps them too; one step count per slot, no hashing.

The fused optimizer updates cached rows in their slots; a synced update can touch rows
this rank did not look up (rows another replica's batch touched): those are updated in
a staging copy of their host rows (``row_updates``, ``staging.py``, ``write_back_staged``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dtrec.ops.backends.base import RowUpdate
from dtrec.sharded.offload.host import CopyStream, host_empty

_KEEP = torch.iinfo(torch.int64).max
"""Eviction key of a slot that must stay (its row is needed by a batch in flight)."""


@dataclass
class FillPlan:
    """What a batch needs of one cache, computed before anything changes."""

    rows: Tensor
    """The batch's distinct rows, sorted."""
    slots: Tensor
    """Their slots now (-1: not cached)."""
    misses: int
    """How many of them are not cached."""
    needed: int
    """Slots that must hold their rows through this fill: the batch's rows and those
    other batches in flight pin."""
    pinned: int
    """Of ``needed``, the ones only other batches in flight pin."""


@dataclass
class Moves:
    """The row copies of one fill, for the copy job."""

    victims: Tensor
    """Slots given to the missing rows (int64)."""
    old_rows: Tensor
    """Rows those slots held (-1: empty)."""
    written: Tensor
    """Per victim: its row changed since its fill (write it back)."""
    new_rows: Tensor
    """The missing rows, one per victim."""


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
        device = weight.device
        rows, capacity = host.shape[0], weight.shape[0]
        # one extra entry: the target of evicted empty slots' "rows" (-1 -> scratch)
        self.slot_of = torch.full((rows + 1,), -1, dtype=torch.int32, device=device)
        self.row_of = torch.full((capacity,), -1, dtype=torch.int64, device=device)
        self.last_used = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.dirty = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.pins = torch.zeros(capacity, dtype=torch.int32, device=device)
        self._tick = 0
        self._fresh = 0  # slots [fresh, capacity) were never used: a fill takes them in order
        self._staged: tuple[Tensor, Tensor, dict[str, Tensor]] | None = None
        self.stats = {"rows": 0, "misses": 0, "h2d_bytes": 0, "d2h_bytes": 0}
        """Distinct rows looked up, of which missed; bytes copied host -> device and back."""

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

    def _row_bytes(self) -> int:
        return sum(h[0].numel() * h.element_size() if h.numel() else 0 for _, h in self._tiers())

    # ------------------------------------------------------------------ fills

    def plan(self, ids: Tensor) -> FillPlan:
        """What caching ``ids`` (rows of the block) takes; changes nothing. One host read."""
        rows = torch.unique(ids)
        slots = self.slot_of.index_select(0, rows)
        hit = slots >= 0
        held = self.pins > 0
        held_hits = held.index_select(0, slots.clamp(min=0).long()) & hit
        counts = torch.stack([(~hit).sum(), held.sum() - held_hits.sum()]).tolist()
        misses, pinned = int(counts[0]), int(counts[1])
        return FillPlan(rows, slots, misses, rows.numel() + pinned, pinned)

    def overflow(self, plan: FillPlan, where: str) -> ValueError:
        """The error for a batch whose rows do not fit (``plan.needed > capacity``)."""
        return ValueError(
            f"table {self.name!r} ({where}): this batch needs {plan.rows.numel()} distinct rows "
            f"in its device cache, which holds {self.capacity} rows ({plan.pinned} more are "
            "pinned by other batches in flight); give the table a larger cache (cache_rows / "
            "cache_fraction) or feed smaller batches"
        )

    def start(self, plan: FillPlan) -> tuple[Tensor, Moves | None]:
        """Give the plan's missing rows slots and pin the batch's rows (device bookkeeping
        only, no host sync); returns the batch's slots (sorted like ``plan.rows``) and the
        row copies left for ``move``."""
        assert plan.needed <= self.capacity, "plan the fill first"
        self._tick += 1
        self.stats["rows"] += plan.rows.numel()
        self.stats["misses"] += plan.misses
        slots, moves = plan.slots.long(), None
        if plan.misses:
            missing = plan.slots < 0
            if self._fresh + plan.misses <= self.capacity:  # never-used slots: no search
                victims = torch.arange(
                    self._fresh, self._fresh + plan.misses, device=self.row_of.device
                )
                self._fresh += plan.misses
            else:
                victims = self._victims(slots, missing, plan.misses)
            # the missing rows first, in row order (a stable sort of the "hit" flags)
            order = torch.argsort(missing.logical_not().to(torch.int8), stable=True)
            new_rows = plan.rows.index_select(0, order[: plan.misses])
            old_rows = self.row_of.index_select(0, victims)
            written = self.dirty.index_select(0, victims) & (old_rows >= 0)
            scratch = torch.where(old_rows >= 0, old_rows, self.num_rows)
            self.slot_of.index_fill_(0, scratch, -1)  # evicted rows: host only again
            self.slot_of.index_copy_(0, new_rows, victims.to(torch.int32))
            self.row_of.index_copy_(0, victims, new_rows)
            self.dirty.index_fill_(0, victims, False)
            slots = slots.index_copy(0, order[: plan.misses], victims)
            moves = Moves(victims, old_rows, written, new_rows)
        self.last_used.index_fill_(0, slots, self._tick)
        self.pins.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))
        return slots, moves

    def _victims(self, slots: Tensor, missing: Tensor, count: int) -> Tensor:
        """``count`` slots to fill: empty ones first, then the least recently used rows no
        batch in flight pins (nor this batch: its hits)."""
        self._fresh = self.capacity
        key = torch.where(self.row_of < 0, -1, self.last_used)
        key.masked_fill_(self.pins > 0, _KEEP)
        key = torch.cat([key, key.new_zeros(1)])  # misses' "slot": the scratch entry
        key.index_fill_(0, torch.where(missing, self.capacity, slots), _KEEP)  # its hits
        return torch.topk(key[:-1], count, largest=False, sorted=True).indices

    def move(self, moves: Moves) -> None:
        """The fill's row copies (on the copy stream): write the changed evicted rows back
        to host memory, then copy the missing rows (and their state) into their slots."""
        copies = self.copies
        written = moves.victims[moves.written]
        if written.numel():
            rows = moves.old_rows[moves.written].cpu()
            for device, host in self._tiers():
                host.index_copy_(0, rows, copies.to_host(device.index_select(0, written)))
            self.stats["d2h_bytes"] += rows.numel() * self._row_bytes()
        rows = moves.new_rows.cpu()
        for device, host in self._tiers():
            staged = host_empty((rows.numel(), *host.shape[1:]), host.dtype, copies.device)
            torch.index_select(host, 0, rows, out=staged)
            device.index_copy_(0, moves.victims, copies.to_device(staged))
        self.stats["h2d_bytes"] += rows.numel() * self._row_bytes()

    def unpin(self, slots: Tensor) -> None:
        """A batch in flight no longer needs its rows kept."""
        self.pins.index_add_(0, slots, torch.full_like(slots, -1, dtype=torch.int32))

    def mark_written(self, slots: Tensor) -> None:
        """These slots' rows will change (a training batch's): write them back on eviction."""
        self.dirty.index_fill_(0, slots, True)

    def slots_of(self, ids: Tensor) -> Tensor:
        """The slots of cached rows ``ids`` (int64, as lookups take ids)."""
        return self.slot_of.index_select(0, ids).long()

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

    def stage(self, rows: Tensor, weight: Tensor, state: dict[str, Tensor]) -> None:
        """Copy host rows ``rows`` (and their state) into staging buffers ``weight`` and
        ``state`` (views of the step's packed staging buffers) for the step."""
        weight.copy_(self.copies.to_device(self.host.index_select(0, rows)))
        for k, v in state.items():
            v.copy_(self.copies.to_device(self.host_state[k].index_select(0, rows)))
        self._staged = (rows, weight, state)
        self.stats["h2d_bytes"] += rows.numel() * self._row_bytes()

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
        self.stats["d2h_bytes"] += rows.numel() * self._row_bytes()

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
            self.stats["d2h_bytes"] += rows.numel() * self._row_bytes()
        self.dirty.zero_()
        drop = torch.nonzero((self.pins == 0) & (self.row_of >= 0)).squeeze(1)
        self._fresh = self.capacity  # empty slots are anywhere now: fills search
        if drop.numel():
            self.slot_of.index_fill_(0, self.row_of.index_select(0, drop), -1)
            self.row_of.index_fill_(0, drop, -1)


def _pick(values: Tensor | None, index: Tensor) -> Tensor | None:
    return None if values is None else values.index_select(0, index)
