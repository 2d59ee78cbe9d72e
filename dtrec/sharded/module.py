"""The sharded collection: tables sharded over the "shard" axis, one step in stages.

One training step of a ``ShardedEmbeddingBagCollection``, each stage in its file:

1. input dist (``dist/input_dist.py``): validate the batch, agree on it over the
   sharding group and the replicas (header all-to-all, verdict all-reduce), send
   each id to the block(s) holding its row (ids all-to-all, ``dist/routing.py``
   computes the send layout);
2. lookup (``lookup/pooled.py``): one batched, sum-pooled lookup over the segments this
   rank serves, one over its own batch's data-parallel features;
3. output dist (``dist/output_dist.py``): partials all-to-all back to the batch's rank,
   assembled into output columns (row blocks add up, column blocks tile), then
   the mean-pooling scale;
4. backward mirrors 3 -> 2 through autograd;
5. fused update (``update/fused_update.py``, with a fused optimizer): when backward
   ends, each table's row gradients are averaged, synced (6) and only the
   touched rows updated; without one, autograd's gradients are synced (6) and
   any torch optimizer steps the DTensor parameters;
6. replicate-axis sync: ``update/sync_plan.py`` decides per table the group and scale
   (the "replicate" axis for routed tables, the world for data-parallel ones,
   averaged over all W batches), ``update/grad_sync.py`` sums the row-sparse gradients;
   with ``sync_every=k`` replicas average their weights every k steps instead.

The tables themselves (DTensor parameters, packed local shards, optimizer state
views) are ``tables/storage.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from dtrec.comm.qcomms import QCommsConfig
from dtrec.modules.config import EmbeddingBagConfig
from dtrec.modules.features import check_weighted
from dtrec.optim import FusedOptimizer
from dtrec.placements import TableSpec
from dtrec.placements.mesh import SHARD
from dtrec.sharded.collection import OFFLOADED_STEP, ShardedCollection
from dtrec.sharded.dist.batch_split import SPLIT_STEP, BatchSplit, full_batch_size
from dtrec.sharded.dist.input_dist import RoutedBatch
from dtrec.sharded.dist.output_dist import OutputDist
from dtrec.sharded.lookup.local_path import LocalBatch, LocalPath, serves_locally
from dtrec.sharded.lookup.pooled import LocalLookup
from dtrec.sparse import KeyedTensor

EXCHANGED_STEP = (
    "dtrec: a collection whose step exchanges with other ranks runs eagerly (its input "
    "dist reads the batch sizes of its peers on the host; its collectives are c10d ones "
    "with async work handles; docs/compile.md)"
)


class ShardedEmbeddingBagCollection(ShardedCollection):
    """``EmbeddingBagCollection`` with tables sharded per a spec each.

    Same forward contract on the local batch (same keys, order and values as
    the unsharded module, per-sample weights used per its ``is_weighted``), same
    ``state_dict`` keys with DTensor values.
    """

    tables_attr = "embedding_bags"

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        weights: dict[str, Tensor],
        mesh: DeviceMesh,
        specs: dict[str, TableSpec],
        optimizer: FusedOptimizer | None = None,
        bounds_check: str = "on",
        sync_every: int | None = None,
        init_seed: int | None = 0,
        is_weighted: bool | None = None,
        qcomms: QCommsConfig | None = None,
        same_batch: DeviceMesh | None = None,
    ) -> None:
        check_weighted(is_weighted)
        super().__init__(
            tables, weights, mesh, specs, optimizer, bounds_check, sync_every, init_seed, qcomms
        )
        self.is_weighted = is_weighted
        self._lookup = LocalLookup(self._routing, self._updater, self._offload, self._owners)
        self._output_dist = OutputDist(
            tables, self._routing, mesh.get_group(SHARD), self._dtype, self.qcomms
        )
        # A shard axis of one position: no routing, no all-to-all (``lookup/local_path.py``);
        # offloaded tables take the routed path, whose lookup reads through their caches.
        self._local = (
            LocalPath(tables, self._routing, self._updater, mesh, self._offload)
            if serves_locally(self._routing, self._layouts)
            and not any(layout.replica_sliced for layout in self._layouts)  # fetched rows
            else None
        )
        split = None if same_batch is None else BatchSplit(same_batch)
        self._batch_split = split if split is not None and split.size > 1 else None
        split = self._batch_split
        if split is not None and self._local is None and self._input_dist.can_carry_full_batch():
            self._input_dist.carry_full_batch(split.ranks[0])  # sizes checked in the header
            split.sizes_in_header = True
        """How the ranks of this rank's ``same_batch`` group split the batch they share
        (``dist/batch_split.py``; None: each rank looks its whole batch up)."""

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The table configs, in output order."""
        return list(self._tables)

    def forward(self, features: object) -> KeyedTensor:
        self._refuse_fx_trace(features)
        if self._batch_split is not None:
            return self._split_forward(features)
        if torch.compiler.is_compiling():  # the wrappers cost eager ~1.5 us: only here
            return self._compiled_forward(features)
        if self._local is not None and self._local.world_size == 1:
            self._begin_step()
            return self._local.forward(self._routed(features), self._local_shards())
        return self._exchanged_forward(features)

    def _compiled_forward(self, features: object) -> KeyedTensor:
        """Under ``torch.compile``: traced whole in a one-rank world (a prefetched batch too:
        its validated pieces are graph inputs); else eager, one graph break whose reason
        says why (other ranks, offloaded tables)."""
        if self._local is None or self._local.world_size > 1:
            return self._exchanged_forward_eagerly(features)
        if self._offload is not None:
            return self._offloaded_forward_eagerly(features)
        self._begin_step()
        return self._local.forward(self._routed(features), self._local_shards())

    def _exchanged_forward(self, features: object) -> KeyedTensor:
        """The eager forward (a one-rank world's too); under ``torch.compile`` it is one graph
        break (``_compiled_forward``)."""
        self._begin_step()
        if self._local is not None:
            return self._local.forward(self._routed(features), self._local_shards())
        routed = self._routed(features)
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
            out = self._output_dist(served, routed.batch, routed.peer_batches, device)
        else:
            out = self._output_dist.zeros(routed.batch, device)
        if own is not None:
            out = self._output_dist.add_data_parallel(out, own)
        return self._output_dist.keyed(self._with_absent_grads(out), kjt)

    def _split_forward_impl(self, features: object) -> KeyedTensor:
        """This rank's chunk of the batch ``features`` looked up (its input dist sliced it,
        ``input_dist``), then every chunk's pooled rows gathered over the group."""
        assert self._batch_split is not None
        batch = full_batch_size(features)
        return self._batch_split.gather(self._exchanged_forward(features), batch)

    _split_forward = torch.compiler.disable(_split_forward_impl, reason=SPLIT_STEP)
    _exchanged_forward_eagerly = torch.compiler.disable(_exchanged_forward, reason=EXCHANGED_STEP)
    _offloaded_forward_eagerly = torch.compiler.disable(_exchanged_forward, reason=OFFLOADED_STEP)

    def input_dist(self, features: object) -> RoutedBatch | LocalBatch:
        """Validate the batch and send each id to the shard(s) holding its row.

        With one shard position (``lookup/local_path.py``) nothing is sent: the batch is only
        validated, and its verdict (with replicas) is all-reduced in forward.

        One blocking header all-to-all over the sharding group (batch sizes, id
        counts, input validity) and an 8-byte verdict all-reduce over the replicas
        (the first rank in the world that refused its batch), then the ids (+
        per-sample weights) all-to-all, left in flight. A batch refused anywhere
        sends no ids on any rank: the error is kept for ``forward``, so a prefetch
        does not raise before the step in progress ends, and every rank fails the
        same step before any weight changes.

        With ``same_batch`` (``distribute_module``) only this rank's chunk of the batch is
        validated and sent (``dist/batch_split.py``), prefetched or not.
        """
        full_batch = 0
        if self._batch_split is not None:
            full_batch = full_batch_size(features)
            features = self._batch_split.local_part(features)
        if self._local is not None:
            return self._local.start(features, self.bounds_check, self.is_weighted)
        return self._input_dist(features, self.bounds_check, self.is_weighted, full_batch)

    def _start(self, features: object) -> RoutedBatch | LocalBatch:
        return self.input_dist(features)

    def _fill_routed(self, routed: RoutedBatch | LocalBatch) -> None:
        if isinstance(routed, LocalBatch):
            assert self._local is not None
            self._local.fill(routed)
        else:
            self._lookup.fill(routed)

    def check_pending_batches(self) -> None:
        """Wait for the device and raise the IndexError of a batch whose ids were checked on
        the device and not reported yet (a one-rank world with a fused optimizer reports
        a bad batch at a later forward, see ``dtrec.sharded.lookup.local_path``; call this after
        the last step). Does nothing elsewhere.

        Example::

            for batch in batches:
                train_step(model, batch)
            model.sparse.check_pending_batches()
        """
        if self._local is not None:
            self._local.report_bad_batches(wait=True)
