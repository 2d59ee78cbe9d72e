"""The sharded sequence collection: ``EmbeddingCollection`` on the one engine.

Same tables, input dist (over a ``SequenceRouting``), replica-axis sync and fused
updates as ``ShardedEmbeddingBagCollection``: both are a ``ShardedCollection``
(``collection.py``). Only the lookup and output dist differ: rows travel back instead
of pooled sums (``dist/sequence_dist.py``).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from dtrec._torch_compat import check_split_sizes
from dtrec.comm.qcomms import QCommsConfig
from dtrec.modules.embedding import (
    EmbeddingConfig,
    check_fixed_batch,
    prepare_sequence_features,
    sequence_outputs,
)
from dtrec.modules.features import RefusedBatch
from dtrec.ops.op import EmbeddingBagFunction
from dtrec.optim import FusedOptimizer
from dtrec.placements import TableSpec
from dtrec.placements.mesh import SHARD, mesh_device
from dtrec.sharded.collection import OFFLOADED_STEP, ShardedCollection
from dtrec.sharded.dist.batch_split import SPLIT_STEP, BatchSplit, gather_sequence_rows
from dtrec.sharded.dist.input_dist import RoutedBatch
from dtrec.sharded.dist.sequence_dist import (
    ReturnPlan,
    SequenceLookup,
    SequenceOutputDist,
    SequenceRouting,
)
from dtrec.sharded.lookup.compiled import fused_embedding_rows_op
from dtrec.sharded.lookup.local_path import serves_locally
from dtrec.sparse import JaggedTensor, as_kjt
from dtrec.sparse.checks import sum_per_key

_Routed = tuple[RoutedBatch, "tuple[list[Tensor], Tensor] | None"]


SEQUENCE_STEP = (
    "dtrec: a sharded EmbeddingCollection whose step exchanges with other ranks runs its "
    "forward eagerly (its input dist reads sizes on the host and its collectives are c10d "
    "ones with async work handles; docs/compile.md)"
)
PREFETCHED_STEP = (
    "dtrec: a sharded EmbeddingCollection fed a prefetched batch runs its forward eagerly "
    "under torch.compile (the traced one-rank forward routes nothing, so only the eager one "
    "consumes the batch's prefetched input dist; docs/compile.md)"
)


class ShardedEmbeddingCollection(ShardedCollection):
    """``EmbeddingCollection`` with tables sharded per a spec each.

    Same forward contract on the local batch (``{feature: JaggedTensor}``, same keys,
    order and rows as the unsharded module), same ``state_dict`` keys
    (``embeddings.<table>.weight``) with DTensor values.
    """

    tables_attr = "embeddings"

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
        same_batch: DeviceMesh | None = None,
    ) -> None:
        dtypes = {cfg.name: weights[cfg.name].dtype for cfg in tables if cfg.name in weights}
        if len(set(dtypes.values())) > 1:
            raise ValueError(
                f"tables of one sharded EmbeddingCollection must share a dtype (their rows "
                f"travel in one buffer); got {dtypes}: put the tables of each dtype in their "
                "own collection"
            )
        super().__init__(
            tables, weights, mesh, specs, optimizer, bounds_check, sync_every, init_seed,
            qcomms, SequenceRouting,
        )  # fmt: skip
        self.need_indices = bool(need_indices)
        self._lookup = SequenceLookup(self._routing, self._updater, self._offload, self._owners)
        self._output_dist = SequenceOutputDist(
            self._routing, mesh.get_group(SHARD), self._dtype, self.qcomms
        )
        # A world of one rank, every table whole here: under ``torch.compile`` the forward
        # is traced whole (``_one_rank_forward``); offloaded tables and prefetched batches run
        # eagerly (``forward``).
        self._device = mesh_device(mesh)
        self._traced_locally = mesh.size() == 1 and serves_locally(self._routing, self._layouts)
        split = None if same_batch is None else BatchSplit(same_batch)
        self._batch_split = split if split is not None and split.size > 1 else None
        """How the ranks of this rank's ``same_batch`` group split the batch they share
        (``dist/batch_split.py``; None: each rank looks its whole batch up)."""

    def embedding_configs(self) -> list[EmbeddingConfig]:
        """The table configs, in output order."""
        return list(self._tables)

    def forward(self, features: object) -> dict[str, JaggedTensor]:
        self._refuse_fx_trace(features)
        if self._batch_split is not None:
            return self._split_forward(features)
        if torch.compiler.is_compiling():  # the wrappers cost eager ~1.5 us: only here
            if not self._traced_locally:
                return self._forward_eagerly(features)
            if self._offload is not None:
                return self._offloaded_forward_eagerly(features)
            if self._prefetched:
                return self._prefetched_forward_eagerly(features)
            return self._one_rank_forward(features)
        return self._forward(features)

    def _one_rank_forward(self, features: object) -> dict[str, JaggedTensor]:
        """The forward of a one-rank world under ``torch.compile``, traced whole: nothing is
        routed, every feature's ids read their whole table (``lookup/compiled.py``).

        The ids per feature are read on the host (``tolist``): an output's size depends on
        the batch's contents. ``fullgraph=True`` traces them as unbacked sizes; a default
        compile breaks there unless ``torch._dynamo.config.capture_scalar_outputs``."""
        self._begin_step()
        kjt = prepare_sequence_features(features, self._tables, "off", self._device)
        local = self._local_shards()
        slots = self._routing.slots
        counts = sum_per_key(kjt.lengths(), kjt.stride_per_key())
        sizes = counts.tolist()
        values = kjt.values()
        check_split_sizes(sizes, values.shape[0])
        check = self.bounds_check == "on"
        arange = functools.partial(torch.arange, device=values.device)
        if self._updater is not None:
            table_ids = sorted({slot.table for slot in slots})
            index = {t: u for u, t in enumerate(table_ids)}
            rows = fused_embedding_rows_op(
                self._updater.trigger, [local[t] for t in table_ids],
                [index[slot.table] for slot in slots], values, counts, check, table_ids,
                self._updater.key,
            ).split(sizes)  # fmt: skip
            rows = [
                r if r.shape[1] == s.dim else r[:, : s.dim]
                for r, s in zip(rows, slots, strict=True)
            ]
        else:  # bags of one id: the pooled op (and its id check) returns the rows
            rows = [
                EmbeddingBagFunction.apply([0], [False], check, ids, arange(n + 1), None, w)
                for ids, n, w in zip(
                    values.split(sizes), sizes, [local[s.table] for s in slots], strict=True
                )
            ]
        return sequence_outputs(kjt, self._with_absent_grads(rows), self.need_indices, sizes)

    def _forward(self, features: object) -> dict[str, JaggedTensor]:
        """The forward; under ``torch.compile`` with other ranks, eager (one graph break,
        ``SEQUENCE_STEP``)."""
        self._begin_step()
        routed, sent = self._routed(features)
        if routed.error is not None:
            raise routed.error
        kjt = routed.kjt
        assert kjt is not None
        device = kjt.values().device
        local = self._local_shards()
        plan = ReturnPlan(self._routing, kjt, sent, self._output_dist.unit)
        send, send_splits = None, [0] * self._routing.shard_size
        if self._routing.has_sharded:
            send, send_splits = self._lookup.served(routed, local)
        local_rows = self._lookup.data_parallel(kjt, local) if self._routing.local_features else []
        rows = self._with_absent_grads(
            self._output_dist(send, send_splits, plan, local_rows, device)
        )
        return sequence_outputs(kjt, rows, self.need_indices)

    def _split_forward_impl(self, features: object) -> dict[str, JaggedTensor]:
        """This rank's chunk of the batch ``features`` looked up (``_start`` sliced it), then
        every chunk's rows gathered over the ``same_batch`` group, feature by feature."""
        assert self._batch_split is not None
        chunk = self._forward(features)
        whole = as_kjt(features)  # the chunk was cut from it: a valid fixed-size batch
        names = list(chunk)
        lengths = [whole[f].lengths() for f in names]
        rows = gather_sequence_rows(self._batch_split, lengths, [chunk[f].values() for f in names])
        return {
            f: JaggedTensor._trusted(r, n, whole[f].values() if self.need_indices else None)
            for f, r, n in zip(names, rows, lengths, strict=True)
        }

    _split_forward = torch.compiler.disable(_split_forward_impl, reason=SPLIT_STEP)
    _forward_eagerly = torch.compiler.disable(_forward, reason=SEQUENCE_STEP)
    _offloaded_forward_eagerly = torch.compiler.disable(_forward, reason=OFFLOADED_STEP)
    _prefetched_forward_eagerly = torch.compiler.disable(_forward, reason=PREFETCHED_STEP)

    def _fill_routed(self, routed: _Routed) -> None:
        self._lookup.fill(routed[0])

    def _start(self, features: object) -> _Routed:
        """Input dist of one batch (``InputDist``), with the positions of the ids sent.

        A variable-batch KJT (``check_fixed_batch``), or anything that fails here, is fed
        to the input dist as a ``RefusedBatch``, so peers fail the same step."""
        if self._batch_split is not None:
            features = self._batch_split.local_part(features)
        if not isinstance(features, RefusedBatch):
            try:
                check_fixed_batch(as_kjt(features), self._tables, dist.get_rank())
            except Exception as exc:  # noqa: BLE001 - raised in forward, on every rank
                features = RefusedBatch(exc)
        self._routing.take_sent()
        routed = self._input_dist(features, self.bounds_check, weighted=False)
        return routed, self._routing.take_sent()
