"""A collection's offloaded tables on one rank: their caches and the fills of its batches.

Each batch is *filled* before its lookup: per offloaded block, the distinct rows its ids
read get cache slots (``RowCache``), and the lookup then reads the slots (``slot_ids``
turns the block's ids into slots). The fill runs at the start of the lookup, or earlier
for a prefetched batch (``fill``, which ``TrainPipeline`` calls for batch i + 1 before
batch i's backward; its row copies then run on a worker thread and their own stream,
overlapping that backward).

A fill *leases* its rows: they are pinned (never evicted) while the batch is in flight.
A prefetched batch's lease lasts until its forward; then it is held as *read* (until
the next forward: nothing else needs those rows) or, for a forward autograd records with
a fused optimizer (train or eval mode), as *trained* (until the fused update of that
backward has run, which reads and writes the same slots; its rows are written back on
eviction). So the current batch's and the prefetched batch's rows are never evicted.

Every fill covers all offloaded tables at once (``group.CacheGroup``: a fixed set of
ops, no host read). A batch whose rows (plus the rows pinned by other batches in flight)
exceed a cache is refused before anything changes. One rank's refusal must stop every
rank at the same step (its peers would otherwise wait in the output dist), so with
several ranks every fill ends with a host read of its verdict and an 8-byte all-reduce
over the mesh (``offload.verdict``), skipped when every cache of the collection holds
its whole block (nothing can overflow). The error is raised by the batch's forward on
every rank, before any weight changes. A *deferred* fill (a world of one rank whose
lookup kernel checks ids on the device, ``LocalPath``) reads nothing: a batch that does
not fit changes nothing, its missing ids read out-of-range slots, so the lookup kernel
flags the batch like one with a bad id (no weight changes), and the local path reports
it at a later forward (``overflow_detail`` names the table).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from dtrec.comm.collectives import all_reduce_min
from dtrec.ops.backends.base import RowUpdate
from dtrec.sharded.offload.group import CacheGroup, Fill, Plan
from dtrec.sharded.offload.host import CopyJobs
from dtrec.sharded.offload.row_cache import FarRows, RowCache
from dtrec.sharded.offload.staging import staged_updates

_FILLED, _READ, _TRAINED, _DROPPED = "filled", "read", "trained", "dropped"


@dataclass
class _Lease:
    """One batch's fill: its key (the batch's input dist) and its fill (slot ids, the
    slots it pins), or its refusal."""

    key: object
    fill: Fill | None = None
    error: Exception | None = None
    state: str = _FILLED


def _sizes(plan: Plan) -> Tensor:
    """A plan's per-table [over, need, avail, distinct] (``[4, tables]``, on the device)."""
    return torch.stack([plan.over.long(), plan.need, plan.avail, plan.distinct])[:, :-1]


class OffloadedTables:
    """The offloaded blocks of one collection on this rank (module doc).

    ``caches``: collection table index -> its block's ``RowCache`` (empty on a rank that
    holds no offloaded block: it still joins every fill's verdict). ``group``: the mesh's
    ranks, or None when no fill can overflow. ``fused``: whether a fused optimizer trains
    the tables (without one only non-training forwards are allowed).
    """

    def __init__(
        self,
        caches: dict[int, RowCache],
        jobs: CopyJobs,
        group: dist.ProcessGroup | None,
        device: torch.device,
        fused: bool,
        offloaded: Sequence[str],
        num_tables: int,
    ) -> None:
        self.caches = caches
        self._jobs = jobs
        self._group = group
        self._device = device
        self._fused = fused
        self._offloaded = list(offloaded)
        self.cache_group = CacheGroup(caches, num_tables, device) if caches else None
        """Every local cache's bookkeeping and fills (None on a rank with no offloaded block)."""
        self._leases: list[_Lease] = []
        self._training = False

    # ------------------------------------------------------------------ batches

    def begin_forward(self, grad: bool, training: bool) -> None:
        """A forward starts: read leases end. ``grad``: autograd records it, so with a fused
        optimizer its backward updates the rows it reads (whatever the module's mode);
        ``training``: the module is in train mode (without a fused optimizer, an error)."""
        if grad and training and not self._fused:
            raise RuntimeError(
                f"tables {self._offloaded} are offloaded (host memory behind a device cache): "
                "they train only with a fused optimizer (distribute_module(..., "
                "optimizer=dtrec.optim.RowWiseAdagrad(...)), which updates the cached rows); "
                "without one, run them under torch.no_grad() or in eval mode"
            )
        self._training = grad and self._fused
        self._release(_READ)

    def fill(
        self,
        key: object,
        ids: Tensor,
        run_tables: Sequence[int],
        lengths: Tensor,
        batch: int,
        deferred: bool = False,
    ) -> None:
        """Fill the caches for a prefetched batch; its copies run in the background.

        ``ids``: the ids this rank serves, in runs of one table each (``run_tables``,
        collection table indices), each run ``batch`` bags long (``lengths``).
        Collective (the verdict): every rank fills the same batches in the same order.
        ``deferred``: a batch that does not fit is flagged by the lookup (module doc).
        """
        if self._find(key) is None:
            lease = self._fill(key, ids, run_tables, lengths, batch, True, True, deferred)
            self._leases.append(lease)

    def slot_ids(
        self,
        key: object,
        ids: Tensor,
        run_tables: Sequence[int],
        lengths: Tensor,
        batch: int,
        deferred: bool = False,
    ) -> Tensor:
        """``ids`` with every offloaded table's ids replaced by their cache slots, the
        batch filled first unless ``fill`` did (arguments as ``fill``'s). Raises the
        batch's refusal (on every rank alike)."""
        lease = self._find(key)
        if lease is None or lease.state == _DROPPED:  # dropped by a flush: it fitted with
            verdict = lease is None  # its pins then, so it fits now; no verdict (a flush
            if lease is not None:  # may have run on this rank only)
                self._leases.remove(lease)
            lease = self._fill(key, ids, run_tables, lengths, batch, verdict, False, deferred)
            self._leases.append(lease)
        if lease.error is not None:
            self._leases.remove(lease)
            raise lease.error
        self._jobs.wait()
        lease.state = _TRAINED if self._training else _READ
        if lease.fill is None:
            return ids
        if lease.state == _TRAINED:
            self._cache_group().mark_written(lease.fill.touched)
        return lease.fill.slot_ids

    def drop(self, key: object) -> None:
        """Forget the fill of a batch that will not be looked up (refused at its forward
        after ``fill``): its rows are no longer pinned."""
        lease = self._find(key)
        if lease is not None:
            self._leases.remove(lease)
            self._unpin(lease)

    def _find(self, key: object) -> _Lease | None:
        return next((lease for lease in self._leases if lease.key is key), None)

    def _cache_group(self) -> CacheGroup:
        assert self.cache_group is not None, "a rank without offloaded blocks fills nothing"
        return self.cache_group

    def _unpin(self, lease: _Lease) -> None:
        if lease.fill is not None:
            self._cache_group().unpin(lease.fill.touched)

    def _fill(
        self,
        key: object,
        ids: Tensor,
        run_tables: Sequence[int],
        lengths: Tensor,
        batch: int,
        verdict: bool,
        background: bool,
        deferred: bool,
    ) -> _Lease:
        self._jobs.wait()  # the previous fill's copies land before slots are planned again
        lease = _Lease(key)
        group = self.cache_group
        served = group is not None and bool(run_tables) and batch > 0 and ids.numel() > 0
        if served and group.prefill_due:  # full caches take their whole table first
            self._jobs.start(group.prefill, background=False)
        plan = group.plan(ids, tuple(run_tables), lengths, batch) if served else None
        fits = None
        alone = self._group is None or dist.get_world_size(self._group) == 1
        if self._group is not None and deferred and alone:
            if plan is not None:  # read by no one: the lookup kernel flags the batch
                fits = plan.over.any().logical_not()
        elif self._group is not None:
            if verdict:
                error = self._verdict(plan)
            elif plan is not None and (error := self._overflow(plan)) is not None:
                raise AssertionError(f"a refill after a flush overflowed: {error}")
            if error is not None:
                lease.error = error
                return lease
        if plan is None:
            return lease
        assert group is not None
        lease.fill = group.apply(plan, fits)
        moves = lease.fill.moves
        assert moves is not None
        self._jobs.copies.begin(*moves)
        first = self.caches[group.tables[0]]  # the group's copies, through one block's move
        self._jobs.start(lambda: first.move(moves), background)
        return lease

    def _overflow(self, plan: Plan, read: list[list[int]] | None = None) -> Exception | None:
        """This rank's refusal of ``plan``, or None; ``read``: the plan's per-table
        [over, need, avail, distinct] already read to the host (else one host read)."""
        group = self._cache_group()
        if read is None:
            read = _sizes(plan).tolist()
        over, need, avail, distinct = read
        if not any(over):
            return None
        k = over.index(1)
        cache = self.caches[group.tables[k]]
        pinned = cache.capacity - avail[k] - (distinct[k] - need[k])
        return cache.overflow(distinct[k], pinned, f"rank {dist.get_rank()}")

    def _verdict(self, plan: Plan | None) -> Exception | None:
        """This rank's refusal of ``plan``, else that of the lowest rank that refused this
        batch: one all-reduce of a device flag, then one host read of it and of this
        rank's sizes together (not a read for the sizes and another for the verdict)."""
        if self._group is None or dist.get_world_size(self._group) == 1:
            return None if plan is None else self._overflow(plan)
        rank, world = dist.get_rank(), dist.get_world_size()
        sizes = None if plan is None else _sizes(plan)
        if sizes is None:
            failed = torch.full((1,), world, dtype=torch.long, device=self._device)
        else:
            failed = torch.where(sizes[0].any(), rank, world).view(1)
        first = all_reduce_min(failed, self._group, "offload.verdict")
        if sizes is None:
            read, first_rank = None, int(first[0])
        else:
            both = torch.cat([first.to(sizes.device).view(1, 1).expand(1, sizes.shape[1]), sizes])
            values = both.tolist()
            read, first_rank = values[1:], values[0][0]
        error = None if read is None else self._overflow(plan, read)  # type: ignore[arg-type]
        if error is not None or first_rank >= world:
            return error
        return ValueError(
            f"rank {first_rank}'s device cache of an offloaded table cannot hold this batch's "
            "rows (see the error on that rank): every rank stops this step in forward, before "
            "any weight changes"
        )

    def _release(self, state: str) -> None:
        for lease in [x for x in self._leases if x.state == state]:
            self._unpin(lease)
            self._leases.remove(lease)

    # ------------------------------------------------------------------ updates, state

    def join(self) -> None:
        """Wait for the copies in flight (before the cache or host tier is read or written)."""
        self._jobs.wait()

    def after_update(self) -> None:
        """The fused update of the training forwards so far has run: their rows may go."""
        self._release(_TRAINED)

    def flush(self) -> None:
        """Write every changed cached row back to host memory and empty the caches but for
        the rows of training batches whose update has not run; a prefetched batch is
        filled again at its forward. After it, the host tier is the table (state_dict,
        checkpoints), and what is written into it is what the next fill reads."""
        self._jobs.wait()
        kept = []
        for lease in self._leases:
            if lease.state in (_FILLED, _READ) and lease.error is None:
                self._unpin(lease)
                if lease.state == _READ:
                    continue
                lease.fill, lease.state = None, _DROPPED
            kept.append(lease)
        self._leases = kept
        for cache in self.caches.values():
            cache.flush()
        if self.cache_group is not None and all(lease.fill is None for lease in self._leases):
            self.cache_group.prefill_due = bool(self.cache_group.full)  # emptied: refill whole
        for lease in self._leases:  # their update is still to come: written back on eviction
            if lease.state == _TRAINED and lease.fill is not None:
                self._cache_group().mark_written(lease.fill.touched)

    def staged_updates(self, far: list[FarRows]) -> list[RowUpdate]:
        """The step of rows a synced update touches that the caches do not hold
        (``staging.staged_updates``)."""
        return staged_updates(far)

    def overflow_detail(
        self, ids: Tensor, run_tables: Sequence[int], lengths: Tensor, batch: int
    ) -> str:
        """Why a deferred fill of a batch (``fill``'s arguments) did not fit, for its late
        report: the first table whose distinct rows alone exceed its cache, or the rows
        pinned by the batch in flight then. Host reads: not for the step."""
        counts = lengths.view(len(run_tables), batch).sum(1).tolist() if batch else []
        parts: dict[int, list[Tensor]] = {}
        start = 0
        for t, n in zip(run_tables, counts, strict=False):
            parts.setdefault(t, []).append(ids[start : start + n])
            start += n
        for t, chunks in parts.items():
            if t in self.caches:
                distinct = torch.unique(torch.cat(chunks)).numel()
                if distinct > self.caches[t].capacity:
                    return str(self.caches[t].overflow(distinct, 0, f"rank {dist.get_rank()}"))
        return (
            f"the rows of a batch of tables {self._offloaded} and those another batch in "
            "flight pinned did not fit an offloaded table's device cache; give the tables "
            "larger caches (cache_rows / cache_fraction) or feed smaller batches"
        )

    def stats(self) -> dict[str, dict[str, int]]:
        """Per local offloaded table: distinct rows looked up, misses, bytes each way."""
        return {cache.name: dict(cache.stats) for cache in self.caches.values()}
