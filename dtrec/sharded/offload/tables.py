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

A batch whose rows (plus the rows pinned by other batches in flight) exceed a cache is
refused before anything changes. One rank's refusal must stop every rank at the same
step (its peers would otherwise wait in the output dist), so every fill ends with an
8-byte all-reduce over the mesh (``offload.verdict``), skipped when every cache of the
collection holds its whole block (nothing can overflow). The error is raised by the
batch's forward on every rank, before any weight changes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from dtrec.comm.collectives import all_reduce_min
from dtrec.ops.backends.base import RowUpdate
from dtrec.sharded.offload.host import CopyJobs
from dtrec.sharded.offload.row_cache import FarRows, RowCache
from dtrec.sharded.offload.staging import staged_updates

_FILLED, _READ, _TRAINED, _DROPPED = "filled", "read", "trained", "dropped"


@dataclass
class _Lease:
    """One batch's fill: its key (the batch's input dist), where each offloaded table's
    ids sit in the received ids, and the slots it pins."""

    key: object
    spans: dict[int, slice | Tensor] = field(default_factory=dict)
    slots: dict[int, Tensor] = field(default_factory=dict)
    error: Exception | None = None
    state: str = _FILLED


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
    ) -> None:
        self.caches = caches
        self._jobs = jobs
        self._group = group
        self._device = device
        self._fused = fused
        self._offloaded = list(offloaded)
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
        self, key: object, ids: Tensor, run_tables: Sequence[int], lengths: Tensor, batch: int
    ) -> None:
        """Fill the caches for a prefetched batch; its copies run in the background.

        ``ids``: the ids this rank serves, in runs of one table each (``run_tables``,
        collection table indices), each run ``batch`` bags long (``lengths``).
        Collective (the verdict): every rank fills the same batches in the same order.
        """
        if self._find(key) is None:
            self._leases.append(self._fill(key, ids, run_tables, lengths, batch, True, True))

    def slot_ids(
        self, key: object, ids: Tensor, run_tables: Sequence[int], lengths: Tensor, batch: int
    ) -> Tensor:
        """``ids`` with every offloaded table's ids replaced by their cache slots, the
        batch filled first unless ``fill`` did (arguments as ``fill``'s). Raises the
        batch's refusal (on every rank alike)."""
        lease = self._find(key)
        if lease is None or lease.state == _DROPPED:  # dropped by a flush: it fitted with
            verdict = lease is None  # its pins then, so it fits now; no verdict (a flush
            if lease is not None:  # may have run on this rank only)
                self._leases.remove(lease)
            lease = self._fill(key, ids, run_tables, lengths, batch, verdict, False)
            self._leases.append(lease)
        if lease.error is not None:
            self._leases.remove(lease)
            raise lease.error
        self._jobs.wait()
        lease.state = _TRAINED if self._training else _READ
        out = ids.clone() if lease.spans else ids
        for t, where in lease.spans.items():
            cache = self.caches[t]
            if lease.state == _TRAINED:
                cache.mark_written(lease.slots[t])
            if isinstance(where, slice):
                out[where] = cache.slots_of(ids[where])
            else:
                out.index_copy_(0, where, cache.slots_of(ids.index_select(0, where)))
        return out

    def drop(self, key: object) -> None:
        """Forget the fill of a batch that will not be looked up (refused at its forward
        after ``fill``): its rows are no longer pinned."""
        lease = self._find(key)
        if lease is not None:
            self._leases.remove(lease)
            for t, slots in lease.slots.items():
                self.caches[t].unpin(slots)

    def _find(self, key: object) -> _Lease | None:
        return next((lease for lease in self._leases if lease.key is key), None)

    def _fill(
        self,
        key: object,
        ids: Tensor,
        run_tables: Sequence[int],
        lengths: Tensor,
        batch: int,
        verdict: bool,
        background: bool,
    ) -> _Lease:
        self._jobs.wait()  # the previous fill's copies land before slots are planned again
        lease = _Lease(key, _spans(self.caches, ids, run_tables, lengths, batch))
        plans = {}
        for t, where in lease.spans.items():
            table_ids = ids[where] if isinstance(where, slice) else ids.index_select(0, where)
            plans[t] = self.caches[t].plan(table_ids)
        over = [t for t, p in plans.items() if p.needed > self.caches[t].capacity]
        error = None
        if over:
            error = self.caches[over[0]].overflow(plans[over[0]], f"rank {dist.get_rank()}")
        if verdict:
            error = self._verdict(error)
        elif error is not None:
            raise AssertionError(f"a refill after a flush overflowed: {error}")
        if error is not None:
            lease.error, lease.spans = error, {}
            return lease
        moves = []
        for t, plan in plans.items():
            lease.slots[t], move = self.caches[t].start(plan)
            if move is not None:
                moves.append((self.caches[t], move))
        if moves:
            self._jobs.copies.begin(
                *(x for _, m in moves for x in (m.victims, m.old_rows, m.written, m.new_rows))
            )
            self._jobs.start(lambda: [cache.move(m) for cache, m in moves], background)
        return lease

    def _verdict(self, error: Exception | None) -> Exception | None:
        """``error``, or the refusal of the lowest rank that refused this batch elsewhere."""
        if self._group is None:
            return error
        world = dist.get_world_size()
        failed = torch.tensor([dist.get_rank() if error else world], device=self._device)
        first = int(all_reduce_min(failed, self._group, "offload.verdict")[0])
        if error is not None or first >= world:
            return error
        return ValueError(
            f"rank {first}'s device cache of an offloaded table cannot hold this batch's rows "
            "(see the error on that rank): every rank stops this step in forward, before any "
            "weight changes"
        )

    def _release(self, state: str) -> None:
        for lease in [x for x in self._leases if x.state == state]:
            for t, slots in lease.slots.items():
                self.caches[t].unpin(slots)
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
                for t, slots in lease.slots.items():
                    self.caches[t].unpin(slots)
                if lease.state == _READ:
                    continue
                lease.slots, lease.state = {}, _DROPPED
            kept.append(lease)
        self._leases = kept
        for cache in self.caches.values():
            cache.flush()
        for lease in self._leases:  # their update is still to come: written back on eviction
            if lease.state == _TRAINED:
                for t, slots in lease.slots.items():
                    self.caches[t].mark_written(slots)

    def staged_updates(self, far: list[FarRows]) -> list[RowUpdate]:
        """The step of rows a synced update touches that the caches do not hold
        (``staging.staged_updates``)."""
        return staged_updates(far)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per local offloaded table: distinct rows looked up, misses, bytes each way."""
        return {cache.name: dict(cache.stats) for cache in self.caches.values()}


def _spans(
    caches: dict[int, RowCache],
    ids: Tensor,
    run_tables: Sequence[int],
    lengths: Tensor,
    batch: int,
) -> dict[int, slice | Tensor]:
    """Per offloaded table with ids here: where its ids are (a slice when one run of
    runs, else their positions). One host read of the run sizes."""
    if not caches or not run_tables or not batch:
        return {}
    counts = lengths.view(len(run_tables), batch).sum(1).tolist()
    starts = list(itertools.accumulate(counts, initial=0))
    out: dict[int, slice | Tensor] = {}
    for t in caches:
        runs = [(starts[i], starts[i + 1]) for i, u in enumerate(run_tables) if u == t]
        runs = [(a, b) for a, b in runs if b > a]
        if not runs:
            continue
        if all(b == c for (_, b), (c, _) in zip(runs, runs[1:], strict=False)):
            out[t] = slice(runs[0][0], runs[-1][1])
        else:
            out[t] = torch.cat([torch.arange(a, b, device=ids.device) for a, b in runs])
    return out
