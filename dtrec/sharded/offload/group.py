"""Every offloaded cache of a collection on one rank as one: fills in a fixed set of ops.

Why one group: a fill per table ran some 60 small ops per offloaded table and read sizes
on the host (``unique``, a ``topk`` per table, boolean masks), so a step's launches grew
with the tables and the host waited for the device every step (issue 31). Here a batch's
fill is one sequence of ops over all its ids, whatever the number of tables, and every
output has a size the host knows without reading the device (the batch's id count N,
the group's slot count C): no ``.item()``, ``nonzero`` or data-sized outputs.

Layout. Table k (offloaded tables in collection order) has ``rows[k]`` host rows and
``caps[k]`` cache slots. Its rows are the group's rows ``row_base[k] + row`` (plus one
scratch entry after them, ``RowCache``'s), its slots the group's slots ``slot_base[k] +
slot``: first those of the tables that evict (LRU tables), then those of the tables whose
cache holds every row (direct tables: row r lives in slot r, so they never evict).
``slot_of``/``row_of``/``last_used``/``dirty``/``pins`` are the group's; each ``RowCache``
holds views of its part, with the table's own (local) slot and row numbers, so per-table
code (flush, the synced update's row mapping) reads them as before. Each
bookkeeping tensor has one more entry at its end: the target of the padded writes of
positions that write nothing (``_DUMMY``), never read back.

A fill (``plan`` then ``apply``): per id, its table (from the runs' lengths, on the
device), its group row, its slot now. A stable sort of the ids' group rows finds the
distinct rows. The missing ones of an LRU table take, in order, its slots sorted by
(empty first, then least recently used; slots pinned by a batch in flight or hit by this
one last): one sort of the LRU tables' slots by (table, class, last use) serves them all.
A missing row of a direct table takes its own slot, which is empty: no sort and no pass
over a direct table's slots (a sort of every slot was 75 ms of a 145 ms CPU step with
every table cached whole, issue 31). An LRU table whose distinct missing rows outnumber
its free slots overflows (``Plan.over``).
Duplicated ids get the same rank, so the same slot, and write the same values.
A fully sharded table (``RowCache.slice_start``) caches only the ids in this rank's owner
slice (its host block) and keeps its ids: its lookup reads the rows its fetch gathers.

Copies (``move``): per tier (the weight, each per-row optimizer state entry), one gather
and one scatter over the flat host and device buffers, at element indices ``[N, widest
row]`` (a narrower table's extra columns repeat its last one), or, where every table of
the tier has rows of one width aligned in both buffers, of whole rows at ``[N]`` row
indices (a 32-wide tier: 32x fewer indices to build, contiguous row copies). Positions that copy
nothing repeat the first position that does (the same element gets the same value
twice), or, when none does, rewrite one element with its own value: fixed sizes, no
host sizing. Write-backs first (evicted changed rows to the host), then the fills.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dtrec.ops.lookup import shared_storage

_KEY_BITS = 31
"""A slot's sort key is a non-negative int32: (LRU table, class, recency) packed in 31 bits
(a 32-bit radix sort takes half the passes of a 64-bit one: 1.6 vs 3.4 ms for 200k slots
on a CPU core)."""


@dataclass
class Tier:
    """One per-row tensor of every table (the weight, or one optimizer state entry): the
    flat device and host buffers their views live in, each table's element offsets in
    them and its elements per row."""

    device: Tensor
    device_at: Tensor
    host: Tensor
    host_at: Tensor
    width: Tensor
    widest: int


@dataclass
class Plan:
    """What a batch needs of the caches, computed before anything changes."""

    ids: Tensor
    id_dtype: torch.dtype
    k: Tensor
    """Per id: its table's group index (clamped; ``offloaded`` says if it has one)."""
    offloaded: Tensor
    valid: Tensor
    """Per id: an offloaded table's id inside its table."""
    row: Tensor
    """Per id: its row of its table (0 where not valid)."""
    hit: Tensor
    hit_slot: Tensor
    """Per id: its group slot if cached."""
    order: Tensor
    first: Tensor
    """The ids' stable sort by group row, and per sorted id: the first of its row."""
    new: Tensor
    """Per sorted id: the first of a missing row."""
    need: Tensor
    avail: Tensor
    distinct: Tensor
    """Per table: distinct missing rows, free slots, distinct rows of the batch."""
    slots_by_age: Tensor | None
    """The LRU tables' slots sorted by (table, class, last use); None: no LRU table."""

    @property
    def over(self) -> Tensor:
        """Per table: the batch's missing rows do not fit its free slots."""
        return self.need > self.avail


@dataclass
class Fill:
    """A batch's fill: its ids as cache slots, the group slots it pins, its row copies."""

    slot_ids: Tensor
    touched: Tensor
    """Per id: the group slot it reads (the dummy where none): what the lease pins."""
    moves: tuple[Tensor, ...] | None


class CacheGroup:
    """The bookkeeping and row copies of every offloaded cache of a collection (module doc).

    ``caches``: collection table index -> ``RowCache`` (bound to this group's views here);
    ``num_tables``: the collection's table count.
    """

    def __init__(self, caches: dict, num_tables: int, device: torch.device) -> None:
        self.tables = sorted(caches)
        caches_k = [caches[t] for t in self.tables]
        rows = [c.num_rows for c in caches_k]
        caps = [c.capacity for c in caches_k]
        row_base = [0]
        for r in rows:
            row_base.append(row_base[-1] + r + 1)
        self.full = [k for k, c in enumerate(caches_k) if 0 < c.num_rows <= c.capacity]
        """Direct tables (their cache has a slot for every row): ``prefill`` caches them
        whole, row r in slot r, and they never evict."""
        lru = [k for k in range(len(caches_k)) if k not in self.full]
        slot_base = [0] * (len(caps) + 1)
        at = 0
        for k in lru + self.full:
            slot_base[k], at = at, at + caps[k]
        self.num_slots = slot_base[-1] = slots = at
        self.lru_slots = sum(caps[k] for k in lru)
        """The LRU tables' slots are the group's ``[0, lru_slots)``."""
        self.sentinel = row_base[-1]
        """The group row of ids that are not an offloaded table's row (slot_of: -1)."""
        self.slot_of = torch.full((self.sentinel + 1,), -1, dtype=torch.int32, device=device)
        self.row_of = torch.full((slots + 1,), -1, dtype=torch.int64, device=device)
        self.last_used = torch.zeros(slots + 1, dtype=torch.int64, device=device)
        self.dirty = torch.zeros(slots + 1, dtype=torch.bool, device=device)
        self.pins = torch.zeros(slots + 1, dtype=torch.int32, device=device)
        self.counts = torch.zeros(3, len(caches_k) + 1, dtype=torch.int64, device=device)
        """Per table: distinct rows looked up, misses, rows written back (last: dummy)."""
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        lru_caps = as_tensor([caps[k] for k in lru])
        self.lru_table = torch.repeat_interleave(as_tensor(lru), lru_caps)
        """Per LRU slot: its table."""
        table_bits = max(1, (len(lru) - 1).bit_length())
        self._age_bits = _KEY_BITS - table_bits - 2
        """Recency bits of the sort key: fills further back than 2**age_bits tie (slot order)."""
        rank = torch.repeat_interleave(torch.arange(len(lru), device=device), lru_caps)
        self._lru_key_base = (rank << (self._age_bits + 2)).int()
        """Per LRU slot: its table's rank among the LRU tables, in the key's top bits."""
        direct = [k in self.full for k in range(len(caps))]
        self.direct = torch.tensor(direct + [False], device=device)
        k_of = [-1] * num_tables
        for k, t in enumerate(self.tables):
            k_of[t] = k
        self._k_of_table = k_of
        self.rows, self.caps = as_tensor(rows + [0]), as_tensor(caps + [0])
        starts = [c.slice_start for c in caches_k]
        self.sliced = any(s is not None for s in starts)
        """Whether some table is fully sharded: only then does a fill shift ids by
        ``id_base`` and keep ``keeps_ids`` tables' ids (no ops on the others' hot path)."""
        self.id_base = as_tensor([s or 0 for s in starts] + [0])
        """Per table: what its ids have above its host rows (a fully sharded table's
        owner slice start; ``RowCache.slice_start``), 0 for the others."""
        self.keeps_ids = torch.tensor([s is not None for s in starts] + [False], device=device)
        """Per table: its lookup reads its ids, not cache slots (fully sharded: it reads the
        compact table its fetch builds, whose owners answer from the cache)."""
        self.row_base, self.slot_base = as_tensor(row_base), as_tensor(slot_base)
        self._runs: dict[tuple[int, ...], Tensor] = {}
        self._tick = 0
        for k, cache in enumerate(caches_k):
            r, s = slice(row_base[k], row_base[k + 1]), slice(slot_base[k], slot_base[k] + caps[k])
            cache.bind(self, k, self.slot_of[r], self.row_of[s], self.last_used[s],
                       self.dirty[s], self.pins[s])  # fmt: skip
        self._caches = caches_k
        self.prefill_due = bool(self.full)
        """Whether the full caches are empty (at first, after a flush that kept no pins)."""
        self.tiers = [_tier(caches_k, lambda c: (c.weight, c.host), device)]
        for key in caches_k[0].host_state if caches_k else ():
            self.tiers.append(
                _tier(caches_k, lambda c, k=key: (c.state[k], c.host_state[k]), device)
            )

    @property
    def dummy(self) -> int:
        return self.num_slots

    def _run_groups(self, run_tables: tuple[int, ...], device: torch.device) -> Tensor:
        """Per run (and one more for ids past the last run): its table's group index or -1."""
        if run_tables not in self._runs:
            ks = [self._k_of_table[t] for t in run_tables] + [-1]
            self._runs[run_tables] = torch.tensor(ks, dtype=torch.int64, device=device)
        return self._runs[run_tables]

    # ------------------------------------------------------------------ fills

    def prefill(self) -> None:
        """Cache every row of each table whose cache can hold them all (row r in slot r),
        one bulk copy per tier: such a table never misses, where filling on demand missed
        every row once, and again after every flush (a 100% cache hit 79% of a Zipf
        batch's rows on an H200, issue 31). Runs before a fill while ``prefill_due``
        (the full caches are empty); bookkeeping is set without reading the device."""
        self.prefill_due = False
        for k in self.full:
            cache = self._caches[k]
            n = cache.num_rows
            local = torch.arange(n, device=self.slot_of.device)
            cache.slot_of[:n].copy_(local.to(torch.int32))
            cache.row_of[:n].copy_(local)
            cache.dirty[:n].fill_(False)
            for device_view, host_view in cache._tiers():
                device_view[:n].copy_(cache.copies.to_device(host_view))
            cache.count_prefill()

    def plan(self, ids: Tensor, run_tables: tuple[int, ...], lengths: Tensor, batch: int) -> Plan:
        """What caching ``ids`` takes (module doc); changes nothing, reads nothing."""
        device, n = ids.device, ids.numel()
        ends = lengths.view(len(run_tables), batch).sum(1).cumsum(0)
        run = torch.searchsorted(ends, torch.arange(n, device=device), right=True)
        k = self._run_groups(run_tables, device).index_select(0, run)
        offloaded = k >= 0
        k = k.clamp(min=0)
        id_dtype, ids = ids.dtype, ids.long()
        # fully sharded: the rows of its own slice
        local = ids - self.id_base.index_select(0, k) if self.sliced else ids
        valid = offloaded & (local >= 0) & (local < self.rows.index_select(0, k))
        row = torch.where(valid, local, 0)
        group_row = torch.where(valid, self.row_base.index_select(0, k) + row, self.sentinel)
        slot = self.slot_of.index_select(0, group_row).long()
        hit = slot >= 0  # the sentinel is never cached
        hit_slot = torch.where(hit, self.slot_base.index_select(0, k) + slot, self.dummy)
        sorted_rows, order = torch.sort(group_row, stable=True)
        first = torch.cat([sorted_rows[:1] >= 0, sorted_rows[1:] != sorted_rows[:-1]])
        first &= sorted_rows != self.sentinel
        k_sorted = k.index_select(0, order)
        new = first & hit.logical_not().index_select(0, order)
        tables = self.counts.shape[1]
        need = torch.zeros(tables, dtype=torch.int64, device=device)
        need.index_add_(0, k_sorted, new.long())
        distinct = torch.zeros_like(need).index_add_(0, k_sorted, first.long())
        slots_by_age, avail = None, self.caps.clone()  # a direct table has a slot per row
        if self.lru_slots:
            lru = self.lru_slots
            busy = torch.zeros(lru + 1, dtype=torch.bool, device=device)
            torch.gt(self.pins[:lru], 0, out=busy[:lru])
            busy = busy.index_fill_(0, hit_slot.clamp(max=lru), True)[:lru]
            klass = torch.where(busy, 2, (self.row_of[:lru] >= 0).int())
            oldest = self._tick - (1 << self._age_bits) + 1  # last uses before it tie
            recency = (self.last_used[:lru] - oldest).clamp_(min=0).int()
            key = self._lru_key_base | (klass << self._age_bits) | recency
            slots_by_age = torch.sort(key, stable=True).indices
            free = torch.zeros_like(need).index_add_(0, self.lru_table, (klass < 2).long())
            avail = torch.where(self.direct, avail, free)
        return Plan(ids, id_dtype, k, offloaded, valid, row, hit, hit_slot, order, first, new, need,
                    avail, distinct, slots_by_age)  # fmt: skip

    def apply(self, plan: Plan, fits: Tensor | None) -> Fill:
        """Give the plan's missing rows slots, pin its rows (device bookkeeping only) and
        return the batch's slot ids and row copies. ``fits``: a device bool (False: the
        batch overflowed, change nothing and leave its missing ids out of range, where the
        lookup kernel flags them); None: the caller checked it fits."""
        self._tick += 1
        k, order = plan.k, plan.order
        k_sorted = k.index_select(0, order)
        base = self.slot_base.index_select(0, k)
        victim = base + plan.row  # a direct table's slot for the row
        if plan.slots_by_age is not None:
            need_before = plan.need.cumsum(0) - plan.need
            rank = plan.new.long().cumsum(0) - 1 - need_before.index_select(0, k_sorted)
            at = (self.slot_base.index_select(0, k_sorted) + rank).clamp(0, self.lru_slots - 1)
            lru_sorted = plan.slots_by_age.index_select(0, at)
            lru_victim = torch.empty_like(lru_sorted).index_copy_(0, order, lru_sorted)
            victim = torch.where(self.direct.index_select(0, k), victim, lru_victim)
        assign = plan.valid & plan.hit.logical_not()
        if fits is not None:
            assign &= fits
        target = torch.where(assign, victim, self.dummy)
        old = self.row_of.index_select(0, target)
        written = self.dirty.index_select(0, target) & (old >= 0)
        row_base = self.row_base.index_select(0, k)
        self.slot_of.index_fill_(0, torch.where(old >= 0, row_base + old, self.sentinel), -1)
        new_row = torch.where(assign, row_base + plan.row, self.sentinel)
        local_slot = target - base
        self.slot_of.index_copy_(0, new_row, torch.where(assign, local_slot, -1).int())
        self.row_of.index_copy_(0, target, torch.where(assign, plan.row, -1))
        self.dirty.index_fill_(0, target, False)
        touched = torch.where(plan.hit, plan.hit_slot, target)
        self.last_used.index_fill_(0, touched, self._tick)
        self.pins.index_add_(0, touched, torch.ones_like(touched, dtype=torch.int32))
        firsts = plan.first.long() if fits is None else plan.first.long() * fits
        evicted = (written.index_select(0, order) & plan.new).long()
        counted = torch.stack([firsts, plan.new.long() * firsts, evicted])
        self.counts.index_add_(1, k_sorted, counted)
        caps = self.caps.index_select(0, k)
        reads = torch.where(plan.hit | assign, touched - base, caps)
        reads_slots = plan.offloaded
        if self.sliced:
            reads_slots = reads_slots & self.keeps_ids.index_select(0, k).logical_not()
        slot_ids = torch.where(reads_slots, reads, plan.ids).to(plan.id_dtype)
        moves = (assign, written, k, local_slot, old, plan.row)
        return Fill(slot_ids, touched, moves)

    def move(self, moves: tuple[Tensor, ...]) -> None:
        """A fill's row copies (module doc): changed evicted rows back to the host, then
        the missing rows (and their state) into their slots."""
        assign, written, k, slot, old, row = moves
        slot = torch.where(assign, slot, 0)
        old = torch.where(written, old, 0)
        for tier in self.tiers:
            at_slot = _elements(tier.device_at, tier.width, tier.widest, k, slot, tier.device)
            at_old = _elements(tier.host_at, tier.width, tier.widest, k, old, tier.host)
            at_row = _elements(tier.host_at, tier.width, tier.widest, k, row, tier.host)
            _copy_rows(tier.host, at_old, tier.device, at_slot, assign & written)
            _copy_rows(tier.device, at_slot, tier.host, at_row, assign)

    def unpin(self, touched: Tensor) -> None:
        """A batch in flight no longer needs its rows kept."""
        self.pins.index_add_(0, touched, torch.full_like(touched, -1, dtype=torch.int32))

    def mark_written(self, touched: Tensor) -> None:
        """These slots' rows will change (a training batch's): write them back on eviction."""
        self.dirty.index_fill_(0, touched, True)

    def table_counts(self) -> list[list[int]]:
        """Per table: [distinct rows looked up, misses, rows written back] (a host read)."""
        return self.counts[:, :-1].t().tolist()


def _tier(caches: list, pick, device: torch.device) -> Tier:
    """The tier ``pick(cache) -> (device view, host view)`` of every cache."""
    pairs = [pick(c) for c in caches]
    devices, hosts = [p[0] for p in pairs], [p[1] for p in pairs]
    found = []
    for views in (devices, hosts):
        shared = shared_storage(views)
        if shared is None:
            raise AssertionError("offloaded tables' caches and host blocks must be packed")
        found.append(shared)
    widths = [max(1, math.prod(v.shape[1:])) for v in hosts]
    (dev_flat, dev_at), (host_flat, host_at) = found
    w = widths[0]
    if w > 1 and widths == [w] * len(widths) and all(a % w == 0 for a in dev_at + host_at):
        # one width, rows aligned in both buffers: copy whole rows of [rows, w] views
        dev_flat, host_flat = _as_rows(dev_flat, w), _as_rows(host_flat, w)
        dev_at, host_at, widths = (
            [a // w for a in dev_at],
            [a // w for a in host_at],
            [1] * len(widths),
        )
    as_tensor = lambda v: torch.tensor(v + [0], dtype=torch.int64, device=device)  # noqa: E731
    return Tier(dev_flat, as_tensor(dev_at), host_flat, as_tensor(host_at), as_tensor(widths),
                max(widths))  # fmt: skip


def _as_rows(flat: Tensor, width: int) -> Tensor:
    """The flat buffer as ``[rows, width]`` (a view; a tail shorter than a row left out)."""
    return flat[: flat.numel() // width * width].view(-1, width)


def _elements(at: Tensor, width: Tensor, widest: int, k: Tensor, row: Tensor, flat: Tensor):
    """``[N, widest]`` element indices of row ``row[i]`` of table ``k[i]`` in ``flat`` (a
    narrower row repeats its last element), clamped into it (on ``k``'s device). A tier
    of whole rows (``_as_rows``: ``flat`` is 2-D, every width 1) gets ``[N, 1]`` row
    indices."""
    if widest == 1:
        out = (at.index_select(0, k) + row).unsqueeze(1)
    else:
        w = width.index_select(0, k).unsqueeze(1)
        cols = torch.minimum(torch.arange(widest, device=k.device).unsqueeze(0), w - 1)
        out = at.index_select(0, k).unsqueeze(1) + row.unsqueeze(1) * w + cols
    return out.clamp_(0, max(flat.shape[0] - 1, 0))


def _copy_rows(dst: Tensor, dst_at: Tensor, src: Tensor, src_at: Tensor, valid: Tensor) -> None:
    """``dst[dst_at[i]] = src[src_at[i]]`` where ``valid[i]``, in one gather and one scatter
    of fixed size (module doc: padded rows repeat the first valid one, or rewrite an
    element of ``dst`` with its own value); elements of flat buffers, or rows of 2-D ones."""
    if not valid.numel() or not dst.numel():
        return
    first = torch.argmax(valid.to(torch.int8))
    any_valid = valid.index_select(0, first.view(1))
    keep = valid.unsqueeze(1)
    dst_at = torch.where(keep, dst_at, dst_at.index_select(0, first.view(1))).reshape(-1)
    src_at = torch.where(keep, src_at, src_at.index_select(0, first.view(1))).reshape(-1)
    dst_at, src_at = _on(dst_at, dst.device), _on(src_at, src.device)
    source = _on(src.index_select(0, src_at), dst.device)
    own = dst.index_select(0, dst_at)
    values = torch.where(_on(any_valid, dst.device), source, own)
    dst.index_copy_(0, dst_at, values)


def _on(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` on ``device``: to a CUDA device asynchronously; to the host (a CUDA host
    tier without device-mapped memory, ``host.py``) a blocking copy, so host gathers and
    scatters read finished values (a wait on the copy stream, not the compute stream)."""
    return tensor.to(device, non_blocking=device.type == "cuda")
