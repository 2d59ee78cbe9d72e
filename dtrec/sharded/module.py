"""The sharded collection: input-dist -> local lookup -> output-dist on the shard axis.

Per forward, inside one sharding group (the ranks sharing a "replicate"
coordinate):

1. header all-to-all (fixed size): every rank learns its peers' batch size,
   id counts and whether their input was valid, so a bad batch fails on all
   ranks instead of hanging a collective;
2. ids all-to-all: each id goes to the block(s) that hold its row;
3. one batched lookup over all served segments and all sources;
4. output all-to-all of ``[B, block cols]`` partials; the requester adds them
   into its output columns (a sum over row blocks, a tiling of column blocks).

Backward mirrors 4 -> 3 through autograd; each table's local gradient is then
all-reduced over the "replicate" axis (over the whole world for data-parallel
tables) and scaled by 1 / world size, so all ranks' gradients are averaged.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from dtrec.comm.collectives import (
    PendingTensor,
    all_reduce_coalesced,
    all_reduce_min,
    all_to_all,
    all_to_all_autograd,
    all_to_all_start,
)
from dtrec.modules.config import EmbeddingBagConfig
from dtrec.modules.features import bag_lengths, check_bounds_mode, feature_order, prepare_features
from dtrec.ops.lookup import packed_views, shared_storage
from dtrec.ops.op import EmbeddingBagFunction
from dtrec.optim import FusedOptimizer
from dtrec.placements import TableLayout, TableSpec
from dtrec.placements.layout import Block
from dtrec.placements.mesh import REPLICATE, SHARD, mesh_device, shard_axis, shard_position
from dtrec.sharded.fused_update import FusedUpdater, TableUpdate, fused_lookup
from dtrec.sharded.grad_sync import sync_grads
from dtrec.sharded.groups import column_groups, world_group
from dtrec.sharded.routing import Routing
from dtrec.sharded.tensor import (
    distribute_tensor,
    like_dtensor,
    load_block,
    state_dtensor,
)
from dtrec.sparse import KeyedJaggedTensor, KeyedTensor

_HEADER = 4  # status, batch size, ids sent to this peer, has per-sample weights
_STATUS_OK, _STATUS_BAD_INPUT = 0, 1


@dataclass
class RoutedBatch:
    """A batch after input-dist: its validated features and the ids this rank serves.

    ``ids`` holds, per source rank, ``[lengths of the served segments | ids]``; it and
    ``psw`` (per-sample weights) may still be in flight until waited on. ``error``: why
    the batch was refused, here or on another rank (``forward`` raises it; no ids sent).
    """

    kjt: KeyedJaggedTensor | None
    batch: int
    peer_counts: list[int]
    ids: PendingTensor | None
    psw: PendingTensor | None
    error: Exception | None = None


class ShardedTable(nn.Module):
    """Holds one table's weight as a DTensor parameter (``embedding_bags.<t>.weight``).

    ``load_state_dict`` takes the weight as a full tensor (e.g. from the unsharded
    model) or as a DTensor of any placements, and copies this rank's block in place.
    """

    def __init__(
        self, weight: nn.Parameter, spec: TableSpec, layout: TableLayout, block: Block | None
    ) -> None:
        super().__init__()
        self.weight = weight
        self.spec = spec
        self.layout = layout
        self.block = block  # this rank's block (None: the table has none here)

    def extra_repr(self) -> str:
        return f"spec={self.spec!r}"

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
            return
        try:
            load_block(self.weight, state_dict[key], self.block, key)
        except ValueError as exc:
            errors.append(str(exc))


def check_sync_every(sync_every: int | None) -> None:
    """``sync_every``: None (replicas sync gradients every step) or a positive int."""
    if sync_every is not None and (
        isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1
    ):
        raise ValueError(f"sync_every must be a positive int or None, got {sync_every!r}")


class ShardedEmbeddingBagCollection(nn.Module):
    """``EmbeddingBagCollection`` with tables sharded per a spec each.

    Same forward contract on the local batch (same keys, order and values as
    the unsharded module), same ``state_dict`` keys with DTensor values.
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
        self._steps = 0
        axis = shard_axis(mesh)
        position = shard_position(mesh)
        if position is None:
            raise ValueError(f"rank {dist.get_rank()} is not in the mesh {mesh}")
        self._tables = tables
        self._dtype = weights[tables[0].name].dtype if tables else torch.float32
        self._mesh = mesh
        self._world_size = mesh.size()
        self._shard_group = mesh.get_group(SHARD)
        self._replicate_group = mesh.get_group(REPLICATE)
        self._shard_ranks = dist.get_process_group_ranks(self._shard_group)
        self._device = mesh_device(mesh)  # tables, batches and collective buffers (NCCL: cuda)
        layouts = [specs[cfg.name].layout(cfg, axis) for cfg in tables]
        self.embedding_bags = nn.ModuleDict()
        into = self._packed_meta_blocks(tables, weights, layouts, position, mesh)
        for cfg, layout in zip(tables, layouts, strict=True):
            dtensor = distribute_tensor(
                weights[cfg.name], mesh, specs[cfg.name], cfg.name, init_seed, into.get(cfg.name)
            )
            block = layout.block_at(position)
            if block is not None and tuple(dtensor.to_local().shape) != (
                block.num_rows,
                block.num_cols,
            ):
                raise AssertionError(
                    f"table {cfg.name!r}: local shard {tuple(dtensor.to_local().shape)} does not "
                    f"match its block {block}"
                )
            self.embedding_bags[cfg.name] = ShardedTable(
                nn.Parameter(dtensor, requires_grad=optimizer is None),
                specs[cfg.name],
                layout,
                block,
            )
        self._layouts = layouts
        self._routing = Routing(tables, layouts, axis.size, position)
        self._pack_local_shards()
        self._dp_group = world_group(mesh) if self._routing.local_features else None
        self.optimizer = optimizer
        self._updater = None if optimizer is None else self._make_updater(optimizer, position)
        self._prefetched: list[tuple[object, RoutedBatch]] = []
        self._received_cols = self._routing.received_columns(torch.device("cpu"))
        self._local_cols = self._routing.local_columns(torch.device("cpu"))

    @staticmethod
    def _packed_meta_blocks(
        tables: list[EmbeddingBagConfig],
        weights: dict[str, Tensor],
        layouts: list[TableLayout],
        position: int,
        mesh: DeviceMesh,
    ) -> dict[str, Tensor]:
        """For meta-device tables: this rank's blocks as views of one new flat buffer, to
        be initialised in place (already packed: no second copy of the shards)."""
        if not tables or not all(weights[cfg.name].is_meta for cfg in tables):
            return {}
        dtype = weights[tables[0].name].dtype
        shapes = {
            cfg.name: (block.num_rows, block.num_cols)
            for cfg, layout in zip(tables, layouts, strict=True)
            if (block := layout.block_at(position)) is not None
        }
        views = packed_views(list(shapes.values()), dtype, mesh_device(mesh))
        return dict(zip(shapes, views, strict=True))

    def _pack_local_shards(self) -> None:
        """Put this rank's shards in one flat buffer, each parameter a view of it.

        Lookup kernels then read every local table in place with one launch
        (no per-call packing copy); in-place optimizer updates and
        ``load_state_dict`` keep writing through the views.
        """
        tables = [self.embedding_bags[self._tables[t].name] for t in self._routing.local_tables]
        locals_ = [table.weight.to_local() for table in tables]
        if len(locals_) < 2:
            return
        shared = shared_storage(locals_)
        if shared is not None and shared[1] == list(
            itertools.accumulate(
                (w.numel() for w in locals_[:-1]), initial=locals_[0].storage_offset()
            )
        ):
            return  # already one buffer, in order (meta-device tables are made that way)
        views = packed_views([w.shape for w in locals_], locals_[0].dtype, locals_[0].device)
        for table, local, view in zip(tables, locals_, views, strict=True):
            with torch.no_grad():  # the views become new leaf parameters below
                view.copy_(local)
            old = table.weight
            table.weight = nn.Parameter(like_dtensor(view, old), requires_grad=old.requires_grad)

    def _make_updater(self, optimizer: FusedOptimizer, position: int) -> FusedUpdater:
        columns = (
            column_groups(self._mesh, self._layouts, position) if optimizer.needs_row_sq_sum else {}
        )
        updates = {}
        for t in self._routing.local_tables:
            cfg = self._tables[t]
            replicas, scale, kind = self._grad_sync(t)
            weight = self.embedding_bags[cfg.name].weight.to_local()
            updates[t] = TableUpdate(
                weight, replicas, columns.get(t), cfg.embedding_dim, scale, kind
            )
        # Local tables' states packed in the order their weights are packed.
        local = self._routing.local_tables
        others = [t for t in range(len(self._tables)) if t not in updates]
        weights = [self.embedding_bags[self._tables[t].name].weight.to_local() for t in local]
        state = dict(zip(local, optimizer.init_states(weights), strict=True))
        for t in others:  # ranks without a shard of the table keep empty state
            state[t] = optimizer.init_state(
                self.embedding_bags[self._tables[t].name].weight.to_local()
            )
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
        out: dict[str, dict[str, Tensor]] = {}
        for name, state in self.fused_optimizer_state().items():
            weight = self.embedding_bags[name].weight
            out[name] = {k: state_dtensor(v, weight, kinds[k]) for k, v in state.items()}
        return out

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The table configs, in output order."""
        return list(self._tables)

    def specs(self) -> dict[str, TableSpec]:
        """Table name -> spec."""
        return {name: table.spec for name, table in self.embedding_bags.items()}

    def _grad_sync(self, t: int) -> tuple[ProcessGroup | None, float, str]:
        """Table t's gradient: the group it is summed over, the factor that averages it,
        and the name its sync has in ``dtrec.comm_stats``.

        Data-parallel tables: the world. Sharded tables: their replicas, so the sum
        covers all W batches; with ``sync_every`` replicas do not sum gradients (each
        averages its own S batches) and average weights every k steps instead.
        """
        if self._layouts[t].batch_local:
            return self._dp_group, 1.0 / self._world_size, "grad_sync.data_parallel"
        if self.sync_every is None:
            return self._replicate_group, 1.0 / self._world_size, "grad_sync.replicate"
        return None, 1.0 / self._routing.shard_size, "grad_sync.replicate"

    def _local_weights(self) -> dict[int, Tensor]:
        """This rank's blocks as plain tensors whose grads are synced over replicas.

        One ``sync_grads`` per group (replicas of the sharded tables, the world for
        data-parallel ones): its backward sums the touched rows of all those tables in
        shared collectives.
        """
        local = {
            t: self.embedding_bags[self._tables[t].name].weight.to_local()
            for t in self._routing.local_tables
        }
        if self._updater is not None:
            return local  # updated in place by the fused optimizer
        groups: dict[tuple, list[int]] = {}
        for t in local:
            group, scale, kind = self._grad_sync(t)
            groups.setdefault((id(group), group, scale, kind), []).append(t)
        out: dict[int, Tensor] = {}
        for (_, group, scale, kind), tables in groups.items():
            synced = sync_grads([local[t] for t in tables], group, scale, kind, self.replica_sync)
            out.update(zip(tables, synced, strict=True))
        return out

    def sync_replicas(self) -> None:
        """Average sharded tables' weights and fused optimizer state over the replicas.

        What ``sync_every=k`` runs every k training steps (TorchRec's
        ``DMPCollection.sync()``); call it yourself before saving or evaluating. One
        all-reduce over the "replicate" dim for all local tables. State of a torch
        optimizer (non-fused training) is the caller's to average.
        """
        size = dist.get_world_size(self._replicate_group)
        if size == 1:
            return
        tensors = []
        for t in self._routing.local_tables:
            if self._layouts[t].batch_local:
                continue  # data-parallel tables sync their gradients every step
            tensors.append(self.embedding_bags[self._tables[t].name].weight.to_local())
            if self._updater is not None:
                tensors += [v for v in self._updater.state[t].values() if v.dim() > 0]
        if not tensors:
            return
        with torch.no_grad():
            sums = all_reduce_coalesced(tensors, self._replicate_group, "replica_sync.weights")
            for x, total in zip(tensors, sums, strict=True):
                x.copy_(total / size)

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
        assert routed.kjt is not None
        routing = self._routing
        local = self._local_weights()
        dtype = self._dtype
        kjt, batch = routed.kjt, routed.batch
        device = kjt.values().device
        if routing.has_sharded:
            out = self._lookup_and_output(routed, local, device, dtype)
        else:
            out = torch.zeros(batch, routing.total_dim, dtype=dtype, device=device)
        if routing.local_features:
            out = out.index_add(
                1, self._local_cols.to(device), self._data_parallel_lookup(kjt, local)
            )
        out = out * self._pooling_scale(kjt, dtype)
        dims = [routing.slots[k].dim for k in range(len(routing.slots))]
        return KeyedTensor(feature_order(self._tables), dims, out)

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
        rank = dist.get_rank()
        routing = self._routing
        error: Exception | None = None
        kjt: KeyedJaggedTensor | None = None
        try:
            kjt = prepare_features(features, self._tables, rank, self.bounds_check, self._device)
        except (KeyError, ValueError, IndexError, TypeError) as exc:
            error = exc
        if not routing.has_sharded:  # no header: the verdict goes over the world
            failed = rank if error is not None else self._world_size
            elsewhere = self._verdict(failed, world_group(self._mesh))  # every rank joins it
            error = error or elsewhere
            batch = kjt.stride() if kjt is not None else 0
            return RoutedBatch(kjt, batch, [], None, None, error)
        return self._exchange_ids(kjt, error)

    def _verdict(self, failed: int, group: dist.ProcessGroup) -> Exception | None:
        """The error for a batch refused elsewhere: MIN over ``group`` of the lowest rank
        that refused its batch (``failed``, W for none). Blocking: right after the header's
        host read, it adds one small latency and no device sync of its own."""
        if dist.get_world_size(group) > 1:
            verdict = torch.tensor([failed], dtype=torch.long, device=self._device)
            failed = int(all_reduce_min(verdict, group, "input_dist.verdict")[0])
        if failed >= self._world_size:
            return None
        return ValueError(
            f"rank {failed} rejected its input batch (see the error on that rank): every rank "
            "stops this step in forward, before any weight changes"
        )

    def _pooling_scale(self, kjt: KeyedJaggedTensor, dtype: torch.dtype) -> Tensor:
        """``[B, total_dim]`` factors: 1 / bag length on mean-pooled features, 1 elsewhere."""
        lengths = bag_lengths(kjt).to(dtype)
        is_mean = torch.tensor(
            [self._tables[s.table].pooling == "mean" for s in self._routing.slots],
            device=lengths.device,
        ).unsqueeze(1)
        factor = torch.where(is_mean, 1.0 / lengths.clamp(min=1), torch.ones_like(lengths))
        dims = torch.tensor([s.dim for s in self._routing.slots], device=lengths.device)
        return factor.t().repeat_interleave(dims, dim=1)

    def _lookup(
        self,
        entry_tables: list[int],
        local: dict[int, Tensor],
        values: Tensor,
        offsets: Tensor,
        psw: Tensor | None,
    ) -> Tensor:
        """Sum-pooled lookup of entries (by collection table index) on local shards.

        Ids were range-checked before routing; with a fused optimizer the
        backward updates the tables instead of returning their gradients.
        """
        table_ids = sorted(set(entry_tables))
        index = {t: i for i, t in enumerate(table_ids)}
        tables = [local[t] for t in table_ids]
        entry_table = [index[t] for t in entry_tables]
        mean = [False] * len(entry_tables)
        if self._updater is not None:
            return fused_lookup(
                self._updater, table_ids, tables, entry_table, mean, values, offsets, psw
            )
        return EmbeddingBagFunction.apply(entry_table, mean, False, values, offsets, psw, *tables)

    def _data_parallel_lookup(self, kjt: KeyedJaggedTensor, local: dict[int, Tensor]) -> Tensor:
        routing = self._routing
        sub = kjt.permute(routing.local_features)
        entries = [routing.slots[k].table for k in routing.local_features]
        return self._lookup(entries, local, sub.values(), sub.offsets(), sub.weights_or_none())

    def _bucketize(
        self, kjt: KeyedJaggedTensor
    ) -> tuple[list[Tensor], list[Tensor | None], list[int]]:
        """Per destination: int64 [lengths | ids] buffer, weights, and id count."""
        return self._routing.bucketize(kjt.values(), bag_lengths(kjt), kjt.weights_or_none())

    def _check_peers(self, header: Tensor) -> tuple[Exception | None, int]:
        """Why this sharding group refuses the batch (None: it does not) and the lowest
        rank at fault (W: none). Every rank of the group computes the same."""
        bad = [
            self._shard_ranks[j] for j in range(header.shape[0]) if int(header[j, 0]) != _STATUS_OK
        ]
        if bad:
            return ValueError(
                f"rank(s) {bad} of this sharding group rejected their input batch "
                "(see the error on those ranks); no collective was run with it"
            ), min(bad)
        sizes = header[:, 1].tolist()
        if any(b != sizes[0] for b in sizes):
            per_rank = {self._shard_ranks[j]: b for j, b in enumerate(sizes)}
            return ValueError(
                f"batch size differs across the sharding group (rank -> batch size: {per_rank}); "
                "every rank of a sharding group must feed the same local batch size"
            ), min(self._shard_ranks)
        return None, self._world_size

    def _exchange_ids(self, kjt: KeyedJaggedTensor | None, error: Exception | None) -> RoutedBatch:
        routing = self._routing
        group = self._shard_group
        shards = routing.shard_size
        batch = kjt.stride() if kjt is not None else 0
        header = torch.zeros(shards, _HEADER, dtype=torch.long)  # built on the host
        if error is None:
            assert kjt is not None
            buffers, sent_weights, counts = self._bucketize(kjt)
            header[:, 0] = _STATUS_OK
            header[:, 1] = batch
            header[:, 2] = torch.tensor(counts)
            header[:, 3] = int(kjt.weights_or_none() is not None)
        else:
            header[:, 0] = _STATUS_BAD_INPUT
        peer = all_to_all(
            header.flatten().to(self._device),
            [_HEADER] * shards,
            [_HEADER] * shards,
            group,
            "input_dist.header",
        )
        peer = peer.view(shards, _HEADER).cpu()  # one host read for every check below
        group_error, failed = self._check_peers(peer)
        elsewhere = self._verdict(failed, self._replicate_group)  # every rank joins it
        error = error or group_error or elsewhere
        if error is not None:
            return RoutedBatch(kjt, batch, [], None, None, error)
        assert kjt is not None

        device = kjt.values().device
        n_served = len(routing.served) * batch
        peer_counts = peer[:, 2].tolist()
        ids = all_to_all_start(
            torch.cat(buffers).to(device),
            [n_served + c for c in peer_counts],
            [b.numel() for b in buffers],
            group,
            "input_dist.ids",
        )
        psw = None
        if bool(peer[:, 3].any()):
            send_w = [
                w if w is not None else torch.ones(c, dtype=torch.float32, device=device)
                for w, c in zip(sent_weights, counts, strict=True)
            ]
            psw = all_to_all_start(
                torch.cat(send_w).float(), peer_counts, counts, group, "input_dist.weights"
            )
        return RoutedBatch(kjt, batch, peer_counts, ids, psw)

    def _lookup_and_output(
        self,
        routed: RoutedBatch,
        local: dict[int, Tensor],
        device: torch.device,
        dtype: torch.dtype,
    ) -> Tensor:
        """Look up the ids this rank serves, send the partials back, assemble the output."""
        routing = self._routing
        group = self._shard_group
        shards = routing.shard_size
        batch = routed.batch
        served = routing.served
        n_served = len(served) * batch
        assert routed.ids is not None
        recv = routed.ids.wait()
        psw = None if routed.psw is None else routed.psw.wait()

        # Received layout: per source j, [lengths of served segments | ids].
        lengths_parts, id_parts, start = [], [], 0
        for c in routed.peer_counts:
            lengths_parts.append(recv[start : start + n_served])
            id_parts.append(recv[start + n_served : start + n_served + c])
            start += n_served + c
        if served:
            lengths = torch.cat(lengths_parts)
            offsets = torch.zeros(lengths.numel() + 1, dtype=torch.long, device=device)
            torch.cumsum(lengths, 0, out=offsets[1:])
            entries = [s.table for _ in range(shards) for s in served]
            pooled = self._lookup(entries, local, torch.cat(id_parts), offsets, psw)
            send_back = pooled.view(batch, shards, routing.served_width).transpose(0, 1).reshape(-1)
        else:
            send_back = torch.zeros(0, dtype=dtype, device=device)
        partials = all_to_all_autograd(
            send_back,
            [batch * w for w in routing.widths],
            [batch * routing.served_width] * shards,
            group,
            "output_dist",
        )
        pieces = torch.split(partials, [batch * w for w in routing.widths])
        received = torch.cat(
            [p.view(batch, w) for p, w in zip(pieces, routing.widths, strict=True)], dim=1
        )
        out = torch.zeros(batch, routing.total_dim, dtype=received.dtype, device=device)
        return out.index_add(1, self._received_cols.to(device), received)
