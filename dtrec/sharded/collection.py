"""What every sharded collection is, pooled or not: tables, routing, sync, fused updates.

``ShardedEmbeddingBagCollection`` (``module.py``) and ``ShardedEmbeddingCollection``
(``sequence.py``) differ only in what comes back from the ranks holding the rows
(pooled partials or rows) and how it is assembled. Everything else is built here once:
the table blocks (``tables/storage.py``), who sends which ids where (a ``Routing``), the
replica-axis gradient sync (``GradSyncPlan``), the fused optimizer (``FusedUpdater``,
column peers for exact row-wise Adagrad), the input dist, ``sync_every`` weight
averaging, prefetching, and the device caches of offloaded tables (``offload/``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from dtrec.comm.qcomms import QCommsConfig
from dtrec.interop.qcomms import as_qcomms_config
from dtrec.modules.features import check_bounds_mode
from dtrec.optim import FusedOptimizer
from dtrec.placements import TableSpec
from dtrec.placements.mesh import shard_axis, shard_position
from dtrec.sharded.copies import deepcopy_module
from dtrec.sharded.dist.groups import column_groups
from dtrec.sharded.dist.input_dist import InputDist
from dtrec.sharded.dist.replica_slices import OwnerSlices
from dtrec.sharded.dist.routing import Routing
from dtrec.sharded.offload import OffloadedTables, offload_tables
from dtrec.sharded.tables.reset import RowValues, reset_block_rows
from dtrec.sharded.tables.storage import pack_local_shards, shard_tables, state_dtensors
from dtrec.sharded.tables.tensor import like_dtensor
from dtrec.sharded.update.fused_update import FusedUpdater, TableUpdate
from dtrec.sharded.update.sync_plan import GradSyncPlan, PendingAverage

OFFLOADED_STEP = (
    "dtrec: a collection with offloaded tables runs its forward eagerly under torch.compile "
    "(each batch's cache fill keeps Python bookkeeping: slots, LRU order, pins, copies on a "
    "thread; docs/compile.md)"
)


def fully_sharded_sync_every_error(
    names: list[str], sync_every: int, planned: bool = False
) -> ValueError:
    """E349: fully sharded tables and ``sync_every=k``; ``planned``: the planner chose to
    fully shard them (``distribute_module(plan=None)``), so say how to keep them whole."""
    text = (
        f"table(s) {names}: fully sharded 2D (fully_sharded=True) keeps one owner per row, "
        f"so replicas have nothing to average: sync_every={sync_every} expects whole "
        "replicated shards; use sync_every=None"
    )
    if planned:
        text += (
            "; the planner (plan=None, or tables a plan leaves open) chose fully sharded 2D "
            "for them because their "
            "replicated shard and its optimizer state do not fit a rank's memory budget "
            "(print(dtrec.plan(model, mesh)) says why): to keep whole shards, pin their "
            f"specs (plan={{{names[0]!r}: RowWise()}}, on a mesh whose S makes a shard fit) "
            "or give each rank more memory (plan=dtrec.plan(model, mesh, "
            "topology=dtrec.Topology.cpu(memory_per_rank=...)))"
        )
    return ValueError(text)


def check_sync_every(sync_every: int | None) -> None:
    """``sync_every``: None (replicas sync gradients every step) or a positive int."""
    if sync_every is not None and (
        isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1
    ):
        raise ValueError(f"sync_every must be a positive int or None, got {sync_every!r}")


class ShardedCollection(nn.Module):
    """The shared state and steps of a sharded collection (see the module docstring).

    A subclass names the attribute holding its tables (``tables_attr``: TorchRec's
    ``embedding_bags`` or ``embeddings``, so state_dict keys match) and its routing
    type, builds its lookup and output dist, and defines ``_start`` (the input dist of
    one batch, what ``prefetch`` leaves in flight).
    """

    #: How replicas sum gradients (fused or not): "auto" (sparse or dense per table,
    #: whichever sends fewer bytes), "sparse" or "dense"; see ``dtrec.sharded.update.grad_sync``.
    replica_sync: str = "auto"
    #: With ``sync_every=k``: start the k-th step's replica average early and finish it
    #: right before the tables are read again (bit for bit the blocking average), so it
    #: overlaps what lies between: with a fused optimizer it starts at the end of the
    #: k-th backward (overlapping the dense optimizer step and the next input dist),
    #: without one at the next forward (overlapping its input dist). False: blocking,
    #: at the start of the next forward.
    overlap_replica_sync: bool = True
    tables_attr: str
    #: Its forward runs collectives on every rank, even for a batch refused before it
    #: (``dtrec.modules.features.RefusedBatch``): the refusal travels in the input dist.
    collective_forward: bool = True

    def __init__(
        self,
        tables: list[Any],
        weights: dict[str, Tensor],
        mesh: DeviceMesh,
        specs: dict[str, TableSpec],
        optimizer: FusedOptimizer | None,
        bounds_check: str,
        sync_every: int | None,
        init_seed: int | None,
        qcomms: QCommsConfig | None,
        routing_type: type[Routing] = Routing,
    ) -> None:
        super().__init__()
        self.bounds_check = check_bounds_mode(bounds_check)
        check_sync_every(sync_every)
        names = [cfg.name for cfg in tables]
        for what, given in (("weights", weights), ("specs", specs)):
            missing = [n for n in names if n not in given]
            if missing:
                raise KeyError(f"{what} has no entry for table(s) {missing}; tables: {names}")
        self.sync_every = sync_every
        self.mesh = mesh
        """The ("shard", "replicate") mesh its tables are sharded on (its own with
        ``distribute_module(..., meshes=)``)."""
        self._steps = 0
        self._averaged_at = 0  # the step count whose replica average last started
        self._averaging: PendingAverage | None = None  # a replica average in flight
        axis = shard_axis(mesh)
        position = shard_position(mesh)
        if position is None:
            raise ValueError(f"rank {dist.get_rank()} is not in the mesh {mesh}")
        self._tables = tables
        self._dtype = weights[tables[0].name].dtype if tables else torch.float32
        self._layouts = [specs[cfg.name].layout(cfg, axis) for cfg in tables]
        self._check_fully_sharded(sync_every)
        stored = shard_tables(
            tables, weights, mesh, specs, self._layouts, position, init_seed, optimizer is None
        )
        setattr(self, self.tables_attr, stored)
        self._routing = routing_type(tables, self._layouts, axis.size, position)
        pack_local_shards([stored[tables[t].name] for t in self._routing.local_tables])
        qcomms = as_qcomms_config(qcomms)
        self.qcomms = qcomms  # precisions of its exchanges (None: fp32), see dtrec.QCommsConfig
        replica_codec = None if qcomms is None else qcomms.replica_sync_codec
        self._sync_plan = GradSyncPlan(mesh, self._routing, replica_codec)
        self.optimizer = optimizer
        self._owners = self._owner_slices(position)
        """Fully sharded local tables' owner slices, by table index (``fully_sharded``)."""
        self._updater = (
            None if optimizer is None else self._fused_updater(optimizer, mesh, position)
        )
        self._input_dist = InputDist(tables, self._routing, mesh)
        self._prefetched: list[tuple[object, Any]] = []
        self._offload: OffloadedTables | None = offload_tables(
            names, self._layouts, stored, self._routing.local_tables, self._updater, mesh,
            sync_every, {t: owner.start for t, owner in self._owners.items()},
        )  # fmt: skip
        for t, owner in self._owners.items():  # fully sharded and offloaded: answers and
            if self._offload is not None and t in self._offload.caches:  # updates through
                owner.cache = self._offload.caches[t]  # the cache of its slice
        """Offloaded tables' caches (None: every table is on the device)."""
        if self._updater is not None:
            self._updater.after_update = self._after_fused_update
        # whenever state is read or written: a replica average in flight lands first, and
        # the host tier of offloaded tables is the table
        self.register_state_dict_pre_hook(lambda module, *_: module._settle())
        self.register_load_state_dict_pre_hook(lambda module, *_: module._settle())

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardedCollection:
        """A copy whose tables are views of the copy of this rank's packed buffer, the
        tensors the copied fused updater updates (a DTensor parameter's own deepcopy would
        clone its block apart from them); communication shared (``sharded/copies.py``).
        Offloaded tables' row copies in flight land first (a cache is copied whole)."""
        self._finish_replica_average()
        if self._offload is not None:
            self._offload.join()
        for table in self._stored().values():
            weight = table.weight
            with torch.no_grad():
                local = copy.deepcopy(weight.to_local(), memo)  # storage copied once
            memo[id(weight)] = nn.Parameter(
                like_dtensor(local, weight), requires_grad=weight.requires_grad
            )
        return deepcopy_module(self, memo)

    def reset_rows(self, table: str, rows: Tensor, values: RowValues) -> None:
        """Rows ``rows`` (global, the same list on every rank) of ``table`` to
        ``values(rows, cols)`` where this rank holds them, their fused optimizer state to
        its init (a managed-collision table's evicted rows). Offloaded tables: ValueError."""
        t = [cfg.name for cfg in self._tables].index(table)
        if self._offload is not None and t in self._offload.caches:
            raise ValueError(
                f"table {table!r}: resetting rows of an offloaded table is not supported"
            )
        self._settle()
        block = self._layouts[t].block_at(shard_position(self.mesh))  # type: ignore[arg-type]
        state = None if self._updater is None else self._updater.state[t]
        with torch.no_grad():
            local = self._stored()[table].device_rows()
        reset_block_rows(local, block, rows, values, self.optimizer, state)

    def _stored(self) -> nn.ModuleDict:
        return getattr(self, self.tables_attr)

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
        shards = [self._stored()[cfg.name].device_rows() for cfg in self._tables]
        local = self._routing.local_tables
        updates = {}
        for t in local:
            sync = self._sync_plan.table(t, self.sync_every)
            updates[t] = TableUpdate(
                shards[t], sync.group, columns.get(t), self._tables[t].embedding_dim,
                sync.scale, sync.kind, sync.codec,
            )  # fmt: skip
        for t, update in updates.items():
            update.owner = self._owners.get(t)
        state = dict(zip(local, optimizer.init_states([shards[t] for t in local]), strict=True))
        for t in range(len(self._tables)):
            if t not in updates:
                state[t] = optimizer.init_state(shards[t])
        return FusedUpdater(optimizer, updates, state)

    def _check_fully_sharded(self, sync_every: int | None) -> None:
        """ValueError naming the fully sharded tables this increment does not serve yet."""
        names = [
            cfg.name for cfg, layout in zip(self._tables, self._layouts) if layout.replica_sliced
        ]
        if not names:
            return
        if sync_every is not None:
            raise fully_sharded_sync_every_error(names, sync_every)

    def _owner_slices(self, position: int) -> dict[int, OwnerSlices]:
        """Fully sharded local tables' owner slices over the replica group (none with one
        replica, whose slice is the whole shard)."""
        owners = {}
        for t in self._routing.local_tables:
            layout, sync = self._layouts[t], self._sync_plan.table(t, self.sync_every)
            block = layout.block_at(position)
            if not layout.replica_sliced or block is None or sync.group is None:
                continue
            if dist.get_world_size(sync.group) > 1:
                owners[t] = OwnerSlices(block.num_rows, sync.group, sync.scale)
        return owners

    def fused_optimizer_state(self) -> dict[str, dict[str, Tensor]]:
        """Table name -> its fused optimizer state (local tensors, shaped like the shard)."""
        if self._updater is None:
            return {}
        self._settle()
        caches = {} if self._offload is None else self._offload.caches
        return {
            cfg.name: self._updater.state[t]
            if t not in caches
            else {k: caches[t].host_state.get(k, v) for k, v in self._updater.state[t].items()}
            for t, cfg in enumerate(self._tables)
        }

    def _settle(self) -> None:
        """Tables and state as they are between steps: a replica average in flight finished,
        offloaded tables' rows written back (``flush_offloaded``)."""
        self._finish_replica_average()
        self.flush_offloaded()

    def flush_offloaded(self) -> None:
        """Write offloaded tables' changed cached rows (and optimizer state) back to host
        memory, so their parameters (and ``fused_optimizer_state``) hold every row's current
        value, and empty their caches, so what is then written there (a checkpoint load) is
        what the next batch reads. ``state_dict`` and ``load_state_dict`` call it; call it
        before reading an offloaded table's ``weight`` directly."""
        if self._offload is not None:
            self._offload.flush()

    def cache_stats(self) -> dict[str, dict[str, int]]:
        """Per offloaded table with a block here: distinct rows looked up, cache misses,
        bytes copied host -> device and back, since construction."""
        return {} if self._offload is None else self._offload.stats()

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
        return state_dtensors(self.fused_optimizer_state(), self._stored(), kinds)

    def specs(self) -> dict[str, TableSpec]:
        """Table name -> spec."""
        return {name: table.spec for name, table in self._stored().items()}

    def sync_replicas(self) -> None:
        """Average sharded tables' weights and fused optimizer state over the replicas.

        What ``sync_every=k`` runs every k training steps (TorchRec's
        ``DMPCollection.sync()``); call it yourself before saving or evaluating. One
        all-reduce over the "replicate" dim for all local tables. State of a torch
        optimizer (non-fused training) is the caller's to average. Offloaded tables are
        skipped: they only train with the per-step sync, which keeps replicas equal.
        An average already in flight (``overlap_replica_sync``) is finished instead: no
        table changed since it started.
        """
        if self._averaging is not None:
            self._finish_replica_average()
            return
        self._sync_plan.average_replicas(self._replica_tensors)

    def _replica_tensors(self, t: int) -> list[Tensor]:
        """What replicas of local table t average: its block and non-scalar fused state."""
        if self._offload is not None and t in self._offload.caches:
            return []
        tensors = [self._stored()[self._tables[t].name].weight.to_local()]
        if self._updater is not None:
            tensors += [v for v in self._updater.state[t].values() if v.dim() > 0]
        return tensors

    def _averaging_due(self) -> bool:
        """Whether the step just counted is a k-th one whose replica average has not started."""
        return (
            self.sync_every is not None
            and self._steps > 0
            and self._steps % self.sync_every == 0
            and self._averaged_at != self._steps
        )

    def _start_replica_average(self) -> None:
        self._averaged_at = self._steps
        self._averaging = self._sync_plan.start_average(self._replica_tensors)

    def _finish_replica_average(self) -> None:
        """Land the replica average in flight (no-op without one)."""
        averaging, self._averaging = self._averaging, None
        if averaging is not None:
            averaging.finish()

    def _after_fused_update(self) -> None:
        """End of a backward's fused update: a k-th step starts its replica average now."""
        if self.overlap_replica_sync and self._averaging_due():
            self._start_replica_average()

    def _begin_step(self) -> None:
        """Before a forward: ``sync_every`` weight averaging after every k-th training
        step (started here unless its backward started it; finished before the tables
        are read, ``_local_shards``), and this step's replica-sync mode."""
        if self.sync_every is not None and self.training and torch.is_grad_enabled():
            if self._averaging_due():
                self._start_replica_average()
                if not self.overlap_replica_sync:
                    self._finish_replica_average()
            self._steps += 1
        if self._updater is not None:
            self._updater.replica_sync = self.replica_sync
        if self._offload is not None:
            self._offload.begin_forward(torch.is_grad_enabled(), self.training)

    def _local_shards(self) -> dict[int, Tensor]:
        """This rank's blocks as plain tensors; without a fused optimizer (which updates
        them in place), their backward sums gradients per ``GradSyncPlan``. A replica
        average in flight lands first: this is where a forward reads the tables."""
        self._finish_replica_average()
        local = {
            t: self._stored()[self._tables[t].name].device_rows()
            for t in self._routing.local_tables
        }
        if self._updater is not None:
            return local
        caches = {} if self._offload is None else self._offload.caches  # not trained here
        # fully sharded tables' gradients go to their owners in the lookup (FetchTouched)
        tracked = {t: x for t, x in local.items() if t not in caches and t not in self._owners}
        return {**local, **self._sync_plan.track(tracked, self.sync_every, self.replica_sync)}

    def _with_absent_grads(self, out: Any) -> Any:
        """``out`` itself (a tensor, or a list: its first tensor carries it); without a fused
        optimizer, its backward also gives each table this rank holds no block of (a
        table-wise table elsewhere, an empty row shard) an empty gradient, so every
        rank has the same parameters with a ``.grad``: what ``clip_grad_norm_`` needs to
        stack their norms in the same order on every rank (``sharded/dtensor_handlers.py``)."""
        if self._updater is not None or not torch.is_grad_enabled():
            return out
        local = set(self._routing.local_tables)
        absent = [
            weight
            for t, cfg in enumerate(self._tables)
            if t not in local and (weight := self._stored()[cfg.name].weight).requires_grad
        ]
        if not absent:
            return out
        if isinstance(out, list):  # the sequence path's rows per feature: anchor the first
            return [_AbsentTableGrads.apply(out[0], absent), *out[1:]] if out else out
        return _AbsentTableGrads.apply(out, absent)

    _start: Callable[[object], Any]
    """The input dist of one batch (what ``prefetch`` leaves in flight)."""

    def _refuse_fx_trace(self, features: object) -> None:
        """TypeError for a torch.fx Proxy: TorchRec's ``TrainPipelineSparseDist`` fx-traces
        the model at its first ``progress`` to find TorchRec's own sharded modules (it
        pipelines nothing else), and a traced dtrec input dist cannot branch on the batch."""
        if isinstance(features, torch.fx.Proxy):
            raise TypeError(
                f"dtrec's {type(self).__name__} got a torch.fx Proxy: the model is being "
                "fx-traced, as TorchRec's TrainPipelineSparseDist does to find TorchRec's own "
                "sharded modules (it cannot pipeline dtrec's); use dtrec.TrainPipeline(model, "
                "optimizer) and its progress(dataloader_iter) instead"
            )

    def prefetch(self, features: object) -> None:
        """Start input-dist of a batch now; ``forward`` of that same object consumes it.

        The ids exchange stays in flight while the caller computes (``dtrec.TrainPipeline``
        prefetches batch i + 1 before running batch i). Collective: all ranks of the
        sharding group prefetch in the same order.
        """
        self._refuse_fx_trace(features)
        self._prefetched.append((features, self._start(features)))

    def fill(self, features: object) -> None:
        """Start filling offloaded tables' caches for a prefetched batch (no-op without
        offloaded tables or when ``prefetch(features)`` did not run).

        Waits for the batch's ids, plans its fill (missing rows get slots, evictions
        chosen; every rank agrees the batch fits, one 8-byte all-reduce) and leaves the
        row copies running on a worker thread and their own stream; the batch's forward
        waits for them. ``dtrec.TrainPipeline`` calls it for batch i + 1 between batch i's
        forward and backward. Collective: every rank fills the same batches in order.
        """
        if self._offload is None:
            return
        for prefetched, routed in self._prefetched:
            if prefetched is features:
                self._fill_routed(routed)
                return

    _fill_routed: Callable[[Any], None]
    """Fill the caches for one prefetched input dist (what ``_start`` returned)."""

    def is_prefetched(self, features: object) -> bool:
        """Whether ``prefetch(features)`` ran and no forward has consumed it yet."""
        return any(prefetched is features for prefetched, _ in self._prefetched)

    def _routed(self, features: object) -> Any:
        """The input dist of ``features``: its prefetch, else started now."""
        for i, (prefetched, routed) in enumerate(self._prefetched):
            if prefetched is features:
                del self._prefetched[i]
                return routed
        return self._start(features)


class _AbsentTableGrads(torch.autograd.Function):
    """Identity on the output; its backward sets a zero (empty here) ``.grad`` on the given
    table parameters that have none (their local tensor is not in the graph: on ranks
    outside a sub-mesh it is 1-D, which ``to_local``'s backward cannot turn back)."""

    @staticmethod
    def forward(ctx, out, params):  # type: ignore[override]
        ctx.params = params
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        with torch.no_grad():
            for p in ctx.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        return grad, None
