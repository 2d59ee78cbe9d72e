"""The sharded collection: tables sharded over the "shard" axis, one step in stages.

One training step of a ``ShardedEmbeddingBagCollection``, each stage in its file:

1. input dist (``input_dist.py``): validate the batch, agree on it over the
   sharding group and the replicas (header all-to-all, verdict all-reduce), send
   each id to the block(s) holding its row (ids all-to-all, ``routing.py``
   computes the send layout);
2. lookup (``lookup.py``): one batched, sum-pooled lookup over the segments this
   rank serves, one over its own batch's data-parallel features;
3. output dist (``output_dist.py``): partials all-to-all back to the batch's rank,
   assembled into output columns (row blocks add up, column blocks tile), then
   the mean-pooling scale;
4. backward mirrors 3 -> 2 through autograd;
5. fused update (``fused_update.py``, with a fused optimizer): when backward
   ends, each table's row gradients are averaged, synced (6) and only the
   touched rows updated; without one, autograd's gradients are synced (6) and
   any torch optimizer steps the DTensor parameters;
6. replicate-axis sync: ``sync_plan.py`` decides per table the group and scale
   (the "replicate" axis for routed tables, the world for data-parallel ones,
   averaged over all W batches), ``grad_sync.py`` sums the row-sparse gradients;
   with ``sync_every=k`` replicas average their weights every k steps instead.

The tables themselves (DTensor parameters, packed local shards, optimizer state
views) are ``storage.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from dtrec.comm.qcomms import QCommsConfig
from dtrec.interop.qcomms import as_qcomms_config
from dtrec.modules.config import EmbeddingBagConfig
from dtrec.modules.features import check_bounds_mode, check_weighted
from dtrec.optim import FusedOptimizer
from dtrec.placements import TableSpec
from dtrec.placements.mesh import SHARD, shard_axis, shard_position
from dtrec.sharded.fused_update import FusedUpdater, TableUpdate
from dtrec.sharded.groups import column_groups
from dtrec.sharded.input_dist import InputDist, RoutedBatch
from dtrec.sharded.lookup import LocalLookup
from dtrec.sharded.output_dist import OutputDist
from dtrec.sharded.routing import Routing
from dtrec.sharded.storage import pack_local_shards, shard_tables, state_dtensors
from dtrec.sharded.sync_plan import GradSyncPlan
from dtrec.sparse import KeyedTensor


def check_sync_every(sync_every: int | None) -> None:
    """``sync_every``: None (replicas sync gradients every step) or a positive int."""
    if sync_every is not None and (
        isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1
    ):
        raise ValueError(f"sync_every must be a positive int or None, got {sync_every!r}")


class ShardedEmbeddingBagCollection(nn.Module):
    """``EmbeddingBagCollection`` with tables sharded per a spec each.

    Same forward contract on the local batch (same keys, order and values as
    the unsharded module, per-sample weights used per its ``is_weighted``), same
    ``state_dict`` keys with DTensor values.
    """

    #: How replicas sum gradients (fused or not): "auto" (sparse or dense per table,
    #: whichever sends fewer bytes), "sparse" or "dense"; see ``dtrec.sharded.grad_sync``.
    replica_sync: str = "auto"

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        weights: dict[str, Tensor],
        mesh: DeviceMesh,
        specs: dict[str, TableSpec],
        optimizer: FusedOptimizer | None = None,
        bounds_check: str = "on",
        sync_every: int | None = None,
        init_seed: int = 0,
        is_weighted: bool | None = None,
        qcomms: QCommsConfig | None = None,
    ) -> None:
        super().__init__()
        self.bounds_check = check_bounds_mode(bounds_check)
        self.is_weighted = check_weighted(is_weighted)
        check_sync_every(sync_every)
        names = [cfg.name for cfg in tables]
        for what, given in (("weights", weights), ("specs", specs)):
            missing = [n for n in names if n not in given]
            if missing:
                raise KeyError(f"{what} has no entry for table(s) {missing}; tables: {names}")
        self.sync_every = sync_every
        self._steps = 0
        axis = shard_axis(mesh)
        position = shard_position(mesh)
        if position is None:
            raise ValueError(f"rank {dist.get_rank()} is not in the mesh {mesh}")
        self._tables = tables
        dtype = weights[tables[0].name].dtype if tables else torch.float32
        self._layouts = [specs[cfg.name].layout(cfg, axis) for cfg in tables]
        self.embedding_bags = shard_tables(
            tables, weights, mesh, specs, self._layouts, position, init_seed, optimizer is None
        )
        self._routing = Routing(tables, self._layouts, axis.size, position)
        pack_local_shards([self.embedding_bags[tables[t].name] for t in self._routing.local_tables])
        qcomms = as_qcomms_config(qcomms)
        self.qcomms = qcomms  # precisions of its exchanges (None: fp32), see dtrec.QCommsConfig
        replica_codec = None if qcomms is None else qcomms.replica_sync_codec
        self._sync_plan = GradSyncPlan(mesh, self._routing, replica_codec)
        self.optimizer = optimizer
        self._updater = (
            None if optimizer is None else self._fused_updater(optimizer, mesh, position)
        )
        self._input_dist = InputDist(tables, self._routing, mesh)
        self._lookup = LocalLookup(self._routing, self._updater)
        self._output_dist = OutputDist(tables, self._routing, mesh.get_group(SHARD), dtype, qcomms)
        self._prefetched: list[tuple[object, RoutedBatch]] = []

    def _fused_updater(
        self, optimizer: FusedOptimizer, mesh: DeviceMesh, position: int
    ) -> FusedUpdater:
        """The updater of every local table, with its sync group, scale and column peers.

        Local tables' states are packed in the order their weights are packed; ranks
        without a shard of a table keep empty state for it.
        """
        routed = {
            t: layout
            for t, layout in enumerate(self._layouts)
            if t not in self._routing.data_parallel_tables
        }
        columns = column_groups(mesh, routed, position) if optimizer.needs_row_sq_sum else {}
        shards = [self.embedding_bags[cfg.name].weight.to_local() for cfg in self._tables]
        local = self._routing.local_tables
        updates = {}
        for t in local:
            sync = self._sync_plan.table(t, self.sync_every)
            updates[t] = TableUpdate(
                shards[t], sync.group, columns.get(t), self._tables[t].embedding_dim,
                sync.scale, sync.kind, sync.codec,
            )  # fmt: skip
        state = dict(zip(local, optimizer.init_states([shards[t] for t in local]), strict=True))
        for t in range(len(self._tables)):
            if t not in updates:
                state[t] = optimizer.init_state(shards[t])
        return FusedUpdater(optimizer, updates, state)

    def fused_optimizer_state(self) -> dict[str, dict[str, Tensor]]:
        """Table name -> its fused optimizer state (local tensors, shaped like the shard)."""
        if self._updater is None:
            return {}
        return {cfg.name: self._updater.state[t] for t, cfg in enumerate(self._tables)}

    def fused_optimizer_dtensors(self) -> dict[str, dict[str, Tensor]]:
        """Table name -> its fused optimizer state as DTensors placed like the table.

        Weight-shaped state (Adam's m, v) has the table's placements; per-row state
        (row-wise Adagrad's sum) is sharded like the table's rows and replicated over
        column shards; scalars (Adam's step) stay plain tensors (see ``state_dtensor``).
        The DTensors wrap the live state: loading into them writes the optimizer's own
        buffers.
        """
        if self.optimizer is None:
            return {}
        kinds = self.optimizer.state_layout()
        return state_dtensors(self.fused_optimizer_state(), self.embedding_bags, kinds)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The table configs, in output order."""
        return list(self._tables)

    def specs(self) -> dict[str, TableSpec]:
        """Table name -> spec."""
        return {name: table.spec for name, table in self.embedding_bags.items()}

    def sync_replicas(self) -> None:
        """Average sharded tables' weights and fused optimizer state over the replicas.

        What ``sync_every=k`` runs every k training steps (TorchRec's
        ``DMPCollection.sync()``); call it yourself before saving or evaluating. One
        all-reduce over the "replicate" dim for all local tables. State of a torch
        optimizer (non-fused training) is the caller's to average.
        """

        def weight_and_state(t: int) -> list[Tensor]:
            tensors = [self.embedding_bags[self._tables[t].name].weight.to_local()]
            if self._updater is not None:
                tensors += [v for v in self._updater.state[t].values() if v.dim() > 0]
            return tensors

        self._sync_plan.average_replicas(weight_and_state)

    def forward(self, features: object) -> KeyedTensor:
        if self.sync_every is not None and self.training and torch.is_grad_enabled():
            if self._steps and self._steps % self.sync_every == 0:
                self.sync_replicas()  # after every k-th step, before the next one reads
            self._steps += 1
        if self._updater is not None:
            self._updater.replica_sync = self.replica_sync
        routed = self._take_prefetched(features)
        if routed is None:
            routed = self.input_dist(features)
        if routed.error is not None:
            raise routed.error
        kjt = routed.kjt
        assert kjt is not None
        device = kjt.values().device
        local = self._local_shards()
        own = None  # data-parallel features first: looked up while the ids are in flight
        if self._routing.local_features:
            own = self._lookup.data_parallel(kjt, local)
        if self._routing.has_sharded:
            served = self._lookup.served(routed, local)
            out = self._output_dist(served, routed.batch, device)
        else:
            out = self._output_dist.zeros(routed.batch, device)
        if own is not None:
            out = self._output_dist.add_data_parallel(out, own)
        return self._output_dist.keyed(out, kjt)

    def _local_shards(self) -> dict[int, Tensor]:
        """This rank's blocks as plain tensors; without a fused optimizer (which updates
        them in place), their backward sums gradients per ``GradSyncPlan``."""
        local = {
            t: self.embedding_bags[self._tables[t].name].weight.to_local()
            for t in self._routing.local_tables
        }
        if self._updater is not None:
            return local
        return self._sync_plan.track(local, self.sync_every, self.replica_sync)

    def prefetch(self, features: object) -> None:
        """Start input-dist of a batch now; ``forward`` of that same object consumes it.

        The ids exchange stays in flight while the caller computes (``dtrec.TrainPipeline``
        prefetches batch i + 1 before running batch i). Collective: all ranks of the
        sharding group prefetch in the same order.
        """
        self._prefetched.append((features, self.input_dist(features)))

    def is_prefetched(self, features: object) -> bool:
        """Whether ``prefetch(features)`` ran and no forward has consumed it yet."""
        return any(prefetched is features for prefetched, _ in self._prefetched)

    def _take_prefetched(self, features: object) -> RoutedBatch | None:
        for i, (prefetched, routed) in enumerate(self._prefetched):
            if prefetched is features:
                del self._prefetched[i]
                return routed
        return None

    def input_dist(self, features: object) -> RoutedBatch:
        """Validate the batch and send each id to the shard(s) holding its row.

        One blocking header all-to-all over the sharding group (batch sizes, id
        counts, input validity) and an 8-byte verdict all-reduce over the replicas
        (the first rank in the world that refused its batch), then the ids (+
        per-sample weights) all-to-all, left in flight. A batch refused anywhere
        sends no ids on any rank: the error is kept for ``forward``, so a prefetch
        does not raise before the step in progress ends, and every rank fails the
        same step before any weight changes.
        """
        return self._input_dist(features, self.bounds_check, self.is_weighted)
