"""Which ranks sum each local table's gradient, and the replicas' weight averaging.

Every rank's embedding gradient must end averaged over all W batches, like the
dense part's. A table's gradient covers the batches of the ranks that looked
up in it, so the group it is summed over follows from how its ids travel:

* data-parallel tables (``Routing.data_parallel_tables``): each rank pooled only
  its own batch, so the gradient is summed over the world (``grad_sync.data_parallel``);
* routed tables: a block pooled its whole sharding group's batches, so the sum
  runs over the "replicate" axis (``grad_sync.replicate``); with ``sync_every``
  replicas do not sum gradients (each averages its own S batches) and average
  their weights every k steps instead (``replica_sync.weights``).

The sums themselves are ``dtrec.sharded.update.grad_sync`` (row-sparse, coalesced):
for plain training through ``sync_grads`` in autograd, for fused optimizers in
the ``FusedUpdater``, both with the group and scale decided here. A collection's
``QCommsConfig.replica_sync_precision`` quantizes the replicate-axis sum of routed
tables only: data-parallel tables' world sum and the weight averaging stay fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from dtrec.comm.collectives import PendingTensors, all_reduce_coalesced_start
from dtrec.comm.quantized import Codec
from dtrec.placements.mesh import REPLICATE
from dtrec.sharded.dist.groups import world_group
from dtrec.sharded.dist.routing import Routing
from dtrec.sharded.update.grad_sync import sync_grads


@dataclass(frozen=True)
class TableGradSync:
    """How one table's gradient is summed before its update."""

    group: ProcessGroup | None
    """Ranks it is summed over (None: not summed, only scaled)."""
    scale: float
    """1 / number of ranks whose batches the sum covers (averages it)."""
    kind: str
    """Name of its sync in ``dtrec.comm_stats``."""
    codec: Codec | None = None
    """How its gradient rows travel (None: fp32; see ``dtrec.comm.quantized``)."""


class GradSyncPlan:
    """Decides, per local table, how its gradient is summed; averages replicas' weights."""

    def __init__(
        self, mesh: DeviceMesh, routing: Routing, replica_codec: Codec | None = None
    ) -> None:
        self._routing = routing
        self._replica_codec = replica_codec  # the replicate-axis sum's, None: fp32
        self._world_size = mesh.size()
        self._replicate_group = mesh.get_group(REPLICATE)
        # A group of its own (collective to create): only collections that need it.
        self._world_group = world_group(mesh) if routing.local_features else None

    def table(self, t: int, sync_every: int | None) -> TableGradSync:
        """Table t's gradient: the group it is summed over, the factor that averages it,
        and the name its sync has in ``dtrec.comm_stats``."""
        if t in self._routing.data_parallel_tables:
            return TableGradSync(
                self._world_group, 1.0 / self._world_size, "grad_sync.data_parallel"
            )
        if sync_every is None:
            return TableGradSync(
                self._replicate_group,
                1.0 / self._world_size,
                "grad_sync.replicate",
                self._replica_codec,
            )
        return TableGradSync(None, 1.0 / self._routing.shard_size, "grad_sync.replicate")

    def track(
        self, local: dict[int, Tensor], sync_every: int | None, mode: str
    ) -> dict[int, Tensor]:
        """``local`` (table -> local shard) as tensors whose backward sums their grads.

        One ``sync_grads`` per group (replicas of the routed tables, the world for
        data-parallel ones): its backward sums the touched rows of all those tables in
        shared collectives. ``mode``: the collection's ``replica_sync``.
        """
        groups: dict[tuple, list[int]] = {}
        for t in local:
            sync = self.table(t, sync_every)
            key = (id(sync.group), sync.group, sync.scale, sync.kind, sync.codec)
            groups.setdefault(key, []).append(t)
        out: dict[int, Tensor] = {}
        for (_, group, scale, kind, codec), tables in groups.items():
            synced = sync_grads([local[t] for t in tables], group, scale, kind, mode, codec)
            out.update(zip(tables, synced, strict=True))
        return out

    def average_replicas(self, tensors_of: Callable[[int], list[Tensor]]) -> None:
        """Average, over the "replicate" axis, ``tensors_of(t)`` of every local routed table.

        One coalesced all-reduce (``replica_sync.weights``); data-parallel tables are
        skipped: their gradients are summed over the world every step.
        """
        pending = self.start_average(tensors_of)
        if pending is not None:
            pending.finish()

    def start_average(self, tensors_of: Callable[[int], list[Tensor]]) -> PendingAverage | None:
        """``average_replicas`` started, not finished: the sums travel in a buffer of their
        own, the tensors keep their values until ``finish()`` (None: nothing to average)."""
        size = dist.get_world_size(self._replicate_group)
        if size == 1:
            return None
        routing = self._routing
        tensors = [
            x
            for t in routing.local_tables
            if t not in routing.data_parallel_tables
            for x in tensors_of(t)
        ]
        if not tensors:
            return None
        with torch.no_grad():
            group = self._replicate_group
            sums = all_reduce_coalesced_start(tensors, group, "replica_sync.weights")
        return PendingAverage(tensors, sums, size)


class PendingAverage:
    """A replica average in flight; ``finish()`` writes the averages into the tensors
    (the same values, bit for bit, as averaging at once: the same sums, divided alike)."""

    def __init__(self, tensors: list[Tensor], sums: PendingTensors, size: int) -> None:
        self._tensors, self._sums, self._size = tensors, sums, size

    def finish(self) -> None:
        with torch.no_grad():
            for x, total in zip(self._tensors, self._sums.wait(), strict=True):
                x.copy_(total / self._size)
