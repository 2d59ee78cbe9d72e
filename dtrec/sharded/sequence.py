"""The sharded sequence collection: ``EmbeddingCollection`` on the one engine.

Same stages and helpers as ``ShardedEmbeddingBagCollection`` (``module.py``): input
dist (``InputDist`` over a ``SequenceRouting``), storage (``shard_tables``,
``pack_local_shards``), replica-axis sync (``GradSyncPlan``), fused updates
(``FusedUpdater``, exact row-wise Adagrad under column-wise via ``column_groups``).
Only the lookup and output dist differ: rows travel back instead of pooled sums
(``sequence_dist.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from dtrec.comm.qcomms import QCommsConfig
from dtrec.interop.qcomms import as_qcomms_config
from dtrec.modules.embedding import EmbeddingConfig, check_fixed_batch, sequence_outputs
from dtrec.modules.features import check_bounds_mode
from dtrec.optim import FusedOptimizer
from dtrec.placements import TableSpec
from dtrec.placements.mesh import SHARD, shard_axis, shard_position
from dtrec.sharded.fused_update import FusedUpdater, TableUpdate
from dtrec.sharded.groups import column_groups
from dtrec.sharded.input_dist import InputDist, RoutedBatch
from dtrec.sharded.module import check_sync_every
from dtrec.sharded.sequence_dist import (
    ReturnPlan,
    SequenceLookup,
    SequenceOutputDist,
    SequenceRouting,
)
from dtrec.sharded.storage import pack_local_shards, shard_tables, state_dtensors
from dtrec.sharded.sync_plan import GradSyncPlan
from dtrec.sparse import JaggedTensor, as_kjt

_REFUSED = object()
"""Fed to the input dist in place of a batch refused here: it fails validation there, so
every rank of the step learns of the refusal through the input dist's own verdict."""

_Routed = tuple[RoutedBatch, "tuple[list[Tensor], Tensor] | None", "Exception | None"]


class ShardedEmbeddingCollection(nn.Module):
    """``EmbeddingCollection`` with tables sharded per a spec each.

    Same forward contract on the local batch (``{feature: JaggedTensor}``, same keys,
    order and rows as the unsharded module), same ``state_dict`` keys
    (``embeddings.<table>.weight``) with DTensor values.
    """

    #: How replicas sum gradients: see ``ShardedEmbeddingBagCollection.replica_sync``.
    replica_sync: str = "auto"

    def __init__(
        self,
        tables: list[EmbeddingConfig],
        weights: dict[str, Tensor],
        mesh: DeviceMesh,
        specs: dict[str, TableSpec],
        optimizer: FusedOptimizer | None = None,
        bounds_check: str = "on",
        sync_every: int | None = None,
        init_seed: int = 0,
        need_indices: bool = False,
        qcomms: QCommsConfig | None = None,
    ) -> None:
        super().__init__()
        self.bounds_check = check_bounds_mode(bounds_check)
        self.need_indices = bool(need_indices)
        check_sync_every(sync_every)
        names = [cfg.name for cfg in tables]
        for what, given in (("weights", weights), ("specs", specs)):
            missing = [n for n in names if n not in given]
            if missing:
                raise KeyError(f"{what} has no entry for table(s) {missing}; tables: {names}")
        dtypes = {cfg.name: weights[cfg.name].dtype for cfg in tables}
        if len(set(dtypes.values())) > 1:
            raise ValueError(
                f"tables of one sharded EmbeddingCollection must share a dtype (their rows "
                f"travel in one buffer); got {dtypes}: put the tables of each dtype in their "
                "own collection"
            )
        self.sync_every = sync_every
        self._steps = 0
        axis = shard_axis(mesh)
        position = shard_position(mesh)
        if position is None:
            raise ValueError(f"rank {dist.get_rank()} is not in the mesh {mesh}")
        self._tables = tables
        dtype = weights[tables[0].name].dtype if tables else torch.float32
        self._layouts = [specs[cfg.name].layout(cfg, axis) for cfg in tables]
        self.embeddings = shard_tables(
            tables, weights, mesh, specs, self._layouts, position, init_seed, optimizer is None
        )
        self._routing = SequenceRouting(tables, self._layouts, axis.size, position)
        pack_local_shards([self.embeddings[tables[t].name] for t in self._routing.local_tables])
        qcomms = as_qcomms_config(qcomms)
        self.qcomms = qcomms  # precisions of its exchanges (None: fp32), see dtrec.QCommsConfig
        replica_codec = None if qcomms is None else qcomms.replica_sync_codec
        self._sync_plan = GradSyncPlan(mesh, self._routing, replica_codec)
        self.optimizer = optimizer
        self._updater = None if optimizer is None else self._fused_updater(optimizer, mesh)
        self._input_dist = InputDist(tables, self._routing, mesh)
        self._lookup = SequenceLookup(self._routing, self._updater)
        self._output_dist = SequenceOutputDist(self._routing, mesh.get_group(SHARD), dtype, qcomms)
        self._prefetched: list[tuple[object, _Routed]] = []

    def _fused_updater(self, optimizer: FusedOptimizer, mesh: DeviceMesh) -> FusedUpdater:
        """The updater of every local table (as ``ShardedEmbeddingBagCollection``'s)."""
        routing = self._routing
        routed = {
            t: layout
            for t, layout in enumerate(self._layouts)
            if t not in routing.data_parallel_tables
        }
        columns = (
            column_groups(mesh, routed, routing.position) if optimizer.needs_row_sq_sum else {}
        )
        shards = [self.embeddings[cfg.name].weight.to_local() for cfg in self._tables]
        updates = {}
        for t in routing.local_tables:
            sync = self._sync_plan.table(t, self.sync_every)
            updates[t] = TableUpdate(
                shards[t], sync.group, columns.get(t), self._tables[t].embedding_dim,
                sync.scale, sync.kind, sync.codec,
            )  # fmt: skip
        local = routing.local_tables
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
        """Table name -> its fused optimizer state as DTensors placed like the table."""
        if self.optimizer is None:
            return {}
        kinds = self.optimizer.state_layout()
        return state_dtensors(self.fused_optimizer_state(), self.embeddings, kinds)

    def embedding_configs(self) -> list[EmbeddingConfig]:
        """The table configs, in output order."""
        return list(self._tables)

    def specs(self) -> dict[str, TableSpec]:
        """Table name -> spec."""
        return {name: table.spec for name, table in self.embeddings.items()}

    def sync_replicas(self) -> None:
        """Average sharded tables' weights and fused optimizer state over the replicas
        (see ``ShardedEmbeddingBagCollection.sync_replicas``)."""

        def weight_and_state(t: int) -> list[Tensor]:
            tensors = [self.embeddings[self._tables[t].name].weight.to_local()]
            if self._updater is not None:
                tensors += [v for v in self._updater.state[t].values() if v.dim() > 0]
            return tensors

        self._sync_plan.average_replicas(weight_and_state)

    def forward(self, features: object) -> dict[str, JaggedTensor]:
        if self.sync_every is not None and self.training and torch.is_grad_enabled():
            if self._steps and self._steps % self.sync_every == 0:
                self.sync_replicas()
            self._steps += 1
        if self._updater is not None:
            self._updater.replica_sync = self.replica_sync
        taken = self._take_prefetched(features)
        routed, sent, refusal = taken if taken is not None else self._start(features)
        if refusal is not None or routed.error is not None:
            raise refusal or routed.error  # type: ignore[misc]
        kjt = routed.kjt
        assert kjt is not None
        device = kjt.values().device
        local = self._local_shards()
        plan = ReturnPlan(self._routing, kjt, sent, self._output_dist.unit)
        send, send_splits = None, [0] * self._routing.shard_size
        if self._routing.has_sharded:
            send, send_splits = self._lookup.served(routed, local)
        local_rows = self._lookup.data_parallel(kjt, local) if self._routing.local_features else []
        rows = self._output_dist(send, send_splits, plan, local_rows, device)
        return sequence_outputs(kjt, rows, self.need_indices)

    def _local_shards(self) -> dict[int, Tensor]:
        local = {
            t: self.embeddings[self._tables[t].name].weight.to_local()
            for t in self._routing.local_tables
        }
        if self._updater is not None:
            return local
        return self._sync_plan.track(local, self.sync_every, self.replica_sync)

    def _start(self, features: object) -> _Routed:
        """Input dist of one batch (``InputDist``), with the positions of the ids sent.

        A variable-batch KJT is refused here (``check_fixed_batch``) and fed to the input
        dist as a batch that fails validation, so peers fail the same step."""
        refusal = None
        try:
            check_fixed_batch(as_kjt(features), self._tables, dist.get_rank())
        except ValueError as exc:
            refusal, features = exc, _REFUSED
        except TypeError:
            pass  # the input dist reports it
        self._routing.take_sent()
        routed = self._input_dist(features, self.bounds_check, weighted=False)
        return routed, self._routing.take_sent(), refusal

    def prefetch(self, features: object) -> None:
        """Start input-dist of a batch now; ``forward`` of that same object consumes it
        (see ``ShardedEmbeddingBagCollection.prefetch``)."""
        self._prefetched.append((features, self._start(features)))

    def is_prefetched(self, features: object) -> bool:
        """Whether ``prefetch(features)`` ran and no forward has consumed it yet."""
        return any(prefetched is features for prefetched, _ in self._prefetched)

    def _take_prefetched(self, features: object) -> _Routed | None:
        for i, (prefetched, routed) in enumerate(self._prefetched):
            if prefetched is features:
                del self._prefetched[i]
                return routed
        return None
