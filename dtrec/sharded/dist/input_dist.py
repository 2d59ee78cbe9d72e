"""Input dist: validate a batch and send each id to the shard position(s) holding its row.

Per batch, inside one sharding group (the ranks sharing a "replicate" coordinate):

1. on the device, no host read: the ids outside their table are counted
   (``count_bad_ids``) and the ids are laid out in runs (``Routing.bucketize``); the
   verdict all-reduce (``input_dist.verdict``, one header slot) over the replicas takes
   the lowest rank that refused its batch (W: none);
2. header all-to-all (``input_dist.header``): to each peer, whether this rank refused its
   batch, the replicas' verdict, the batch size, the per-sample weights flag and the id
   count of each segment the peer serves. This rank then reads its run sizes and the
   headers it received in one host read, the step's only one: every rank learns whether
   anyone in the world refused (so a bad batch fails on every rank, before any collective
   carries it, instead of hanging a later one), its peers' batch sizes and every size the
   ids all-to-all and the lookup need. Local batch sizes may differ (the last batch of a
   ``drop_last=False`` loop), 0 included: a served segment pools each source's batch (its
   bags padded with empty ones to the largest), and the output dist returns each source
   its own rows;
3. ids all-to-all (``input_dist.ids``; per-sample weights ride in the same buffer,
   unless they are trained: then a differentiable ``input_dist.weights`` all-to-all
   carries them), left in flight: each id goes to the block(s) that hold its row
   (``Routing.send_layout`` slices the runs); the lookup waits on it. The buffer (and the
   header) is int32 when every table has fewer than 2**31 rows (``wire_dtype``).

Collections whose tables are all data parallel send no ids: only the verdict runs,
over the world, and its result is the step's one host read.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from dtrec.comm.collectives import (
    PendingTensor,
    all_reduce_min,
    all_to_all,
    all_to_all_autograd,
    all_to_all_start,
)
from dtrec.modules.config import EmbeddingBagConfig
from dtrec.modules.features import bag_lengths, count_bad_ids, id_range_error, prepare_features
from dtrec.ops.backends.device_lists import device_list
from dtrec.placements.mesh import REPLICATE, SHARD, mesh_device
from dtrec.sharded.dist.batch_split import different_sizes
from dtrec.sharded.dist.groups import world_group
from dtrec.sharded.dist.routed_batch import RoutedBatch, pack_weights, packed_size, wire_dtype
from dtrec.sharded.dist.routing import Routing
from dtrec.sharded.dist.row_buckets import Runs
from dtrec.sparse import KeyedJaggedTensor

# The header to each peer: the fixed fields, then one id count per segment the peer serves.
# bad: ids outside their table (1 for a batch refused on the host; 0: fine); verdict: the
# lowest rank over the replicas that refused its batch (W: none); weights: _weights_flag.
_BAD, _VERDICT, _BATCH, _WEIGHTS_FIELD = range(4)
_HEADER = 4
# With ``carry_full_batch`` (a same_batch group that splits the batch): two fields more,
# the whole batch's size before the split and the group's first rank.
_FULL_BATCH, _GROUP = 4, 5
_NO_WEIGHTS, _WEIGHTS, _WEIGHTS_TRAINED = 0, 1, 2


class InputDist:
    """Starts the input-dist of a collection's batches (see the module docstring)."""

    def __init__(self, tables: list[EmbeddingBagConfig], routing: Routing, mesh: DeviceMesh):
        self._tables = tables
        self._routing = routing
        self._mesh = mesh
        self._world_size = mesh.size()
        self._shard_group = mesh.get_group(SHARD)
        self._replicate_group = mesh.get_group(REPLICATE)
        self._replicas = dist.get_world_size(self._replicate_group)
        self._shard_ranks = dist.get_process_group_ranks(self._shard_group)
        self._device = mesh_device(mesh)  # batches and collective buffers (NCCL: cuda)
        self._wire = wire_dtype(tables)
        self._header_index: dict[tuple[int, ...], Tensor] = {}
        self._world_group: dist.ProcessGroup | None = None  # made at the first verdict
        self._fields = _HEADER  # fixed header fields (``carry_full_batch``: two more)
        self._group_rank: int | None = None  # this rank's same_batch group's first rank

    def can_carry_full_batch(self) -> bool:
        """Whether the header reaches every rank of the world (one sharding group, no
        replicas): then it can carry each same_batch group's batch sizes to every rank,
        which all refuse a group whose sizes differ in the same step, with no collective
        of its own (``carry_full_batch``)."""
        return self._routing.has_sharded and self._replicas == 1

    def carry_full_batch(self, group_rank: int) -> None:
        """Let the header carry each call's ``full_batch`` (the batch's size before a
        same_batch group split it) and ``group_rank`` (that group's first rank); a group
        whose ranks' sizes differ refuses the step on every rank
        (``batch_split.different_sizes``). Only where ``can_carry_full_batch``."""
        assert self.can_carry_full_batch()
        self._fields, self._group_rank = _GROUP + 1, group_rank
        self._header_index.clear()

    def __call__(
        self,
        features: object,
        bounds_check: str,
        weighted: bool | None = None,
        full_batch: int = 0,
    ) -> RoutedBatch:
        """Validate ``features`` (``prepare_features``: ids, per-sample weights per
        ``weighted``) and start sending its ids; a refusal is kept, not raised.
        ``full_batch``: the size of the batch ``features`` was split from
        (``carry_full_batch``).

        Everything this rank computes before the header exchange (validation, the ids'
        range count, bucketize) runs on the device under one ``except Exception``: whatever
        fails there, a bad batch or not, becomes this rank's refusal in the exchange, so
        every rank fails the step together and none is left waiting in a collective its
        peer never joins. Ids outside their table are counted on the device and read with
        the header (one host read per step).
        """
        kjt: KeyedJaggedTensor | None = None
        runs: Runs | None = None
        header: Tensor | None = None
        bad: Tensor | None = None
        error: Exception | None = None
        try:
            kjt = prepare_features(
                features, self._tables, dist.get_rank(), "off", self._device, weighted
            )
            if self._routing.has_sharded:
                runs = self._routing.bucketize(
                    kjt.values(), bag_lengths(kjt), kjt.weights_or_none()
                )
                header = self._header_buffer(runs.lengths.shape[0])
                bad = header[:1]  # counted straight into the header
            bad = count_bad_ids(kjt, self._tables, out=bad) if bounds_check == "on" else None
        except Exception as exc:  # noqa: BLE001 - refused in the exchange, raised in forward
            error, runs, header, bad = exc, None, None, None
        if self._routing.has_sharded:
            return self._exchange_ids(kjt, runs, header, bad, error, full_batch)
        return self._exchange_verdict(kjt, bad, error)

    def _failed(self, bad: Tensor | None, error: Exception | None, dtype: torch.dtype) -> Tensor:
        """``[1]`` on the device: this rank if it refuses its batch (``error``, or an id
        outside its table: ``bad`` > 0), else W. Read-only (cached when known on the host)."""
        rank, device = dist.get_rank(), self._device
        if error is not None or bad is None:
            return device_list([rank if error is not None else self._world_size], dtype, device)
        here, none = (
            device_list([rank], dtype, device),
            device_list([self._world_size], dtype, device),
        )
        return torch.where(bad > 0, here, none)

    def _exchange_verdict(
        self, kjt: KeyedJaggedTensor | None, bad: Tensor | None, error: Exception | None
    ) -> RoutedBatch:
        """No table is sharded, so no header: the verdict goes over the world (one read)."""
        if self._world_group is None:
            self._world_group = world_group(self._mesh)
        group = self._world_group
        failed = self._failed(bad, error, torch.long)
        lowest = failed
        if dist.get_world_size(group) > 1:  # every rank joins it
            lowest = all_reduce_min(failed.clone(), group, "input_dist.verdict")
        first, mine = torch.cat([lowest, failed]).tolist()  # the step's one host read
        if error is None:
            error = self._own_error(kjt, int(mine < self._world_size)) or self._elsewhere(first)
        batch = kjt.stride() if kjt is not None else 0
        return RoutedBatch(kjt, batch, [], None, None, error)

    def _own_error(self, kjt: KeyedJaggedTensor | None, bad: int) -> Exception | None:
        """The IndexError of this rank's ids outside their table (``bad``: their count, as
        read)."""
        if not bad or kjt is None:
            return None
        rank = dist.get_rank()
        return id_range_error(kjt, self._tables, rank) or IndexError(
            f"the ids of rank {rank} were counted outside their tables on the device, but "
            "not on the host"
        )

    def _elsewhere(self, failed: int) -> Exception | None:
        """The error for a batch refused on another rank (``failed``: the lowest such rank
        in the world, W for none)."""
        if failed >= self._world_size:
            return None
        return ValueError(
            f"rank {failed} rejected its input batch (see the error on that rank): every rank "
            "stops this step in forward, before any weight changes"
        )

    def _group_error(self, rows: list[list[int]]) -> Exception | None:
        """Why this sharding group refuses the batch (None: it does not); every rank of the
        group computes the same from the header rows."""
        bad = [self._shard_ranks[j] for j, row in enumerate(rows) if row[_BAD]]
        if not bad:
            return None
        return ValueError(
            f"rank(s) {bad} of this sharding group rejected their input batch "
            "(see the error on those ranks); no collective was run with it"
        )

    def _header_buffer(self, num_runs: int) -> Tensor:
        """One buffer for this rank's header fields and run sizes, then the headers it
        receives: the step's one host read reads it whole."""
        routing = self._routing
        received = routing.shard_size * (self._fields + len(routing.served))
        return torch.empty(
            self._fields + num_runs + received, dtype=self._wire, device=self._device
        )

    def _header(
        self,
        kjt: KeyedJaggedTensor | None,
        runs: Runs | None,
        header: Tensor,
        bad: Tensor | None,
        error: Exception | None,
        full_batch: int = 0,
    ) -> Tensor:
        """This rank's header fields then its run sizes, written into ``header`` on the
        device, no host read: ``[ids outside their table (1 for a batch refused on the
        host), the lowest rank over the replicas that refused (W: none), batch, weights
        flag, ids per run...]``. The verdict all-reduce over the replicas runs here, so
        the header carries it."""
        wire, device, world = self._wire, self._device, self._world_size
        fields = self._fields
        num_runs = self._routing.num_runs if runs is None else runs.lengths.shape[0]
        own = header[: fields + num_runs]
        batch = kjt.stride() if kjt is not None else 0
        flag = _weights_flag(kjt.weights_or_none()) if kjt is not None else _NO_WEIGHTS
        rank = dist.get_rank()
        refused = error is not None
        split = [] if self._group_rank is None else [full_batch, self._group_rank]
        if bad is None:  # known on the host
            values = [int(refused), rank if refused else world, batch, flag, *split]
            own[:fields].copy_(device_list(values, wire, device))
        else:  # own[0] holds the count of bad ids
            own[1:fields].copy_(device_list([world, batch, flag, *split], wire, device))
        if self._replicas > 1:  # every rank joins it
            verdict = own[_VERDICT : _VERDICT + 1]
            if bad is not None:
                here, none = device_list([rank], wire, device), device_list([world], wire, device)
                torch.where(own[:1] > 0, here, none, out=verdict)
            all_reduce_min(verdict, self._replicate_group, "input_dist.verdict")
        if runs is None:  # refused before its layout: no sizes
            own[fields:].zero_()
        else:
            torch.sum(runs.lengths, dim=1, dtype=wire, out=own[fields:])
        return own

    def _send_header_index(self, segment_run: tuple[int, ...]) -> Tensor:
        """Per destination: the fixed fields, then the size of the run of each segment
        it serves (entries of ``_header``'s output)."""
        if segment_run not in self._header_index:
            index, g, fields = [], 0, self._fields
            for segs in self._routing.segments_to:
                index += list(range(fields)) + [fields + segment_run[g + i] for i in range(len(segs))]
                g += len(segs)
            self._header_index[segment_run] = device_list(index, torch.long, self._device)
        return self._header_index[segment_run]

    def _exchange_ids(
        self,
        kjt: KeyedJaggedTensor | None,
        runs: Runs | None,
        header: Tensor | None,
        bad: Tensor | None,
        error: Exception | None,
        full_batch: int = 0,
    ) -> RoutedBatch:
        routing = self._routing
        group = self._shard_group
        shards, served, fields = routing.shard_size, len(routing.served), self._fields
        if header is None:  # refused before its layout
            header = self._header_buffer(routing.num_runs)
        own = self._header(kjt, runs, header, bad, error, full_batch)
        segment_run = runs.segment_run if runs is not None else routing.segment_run
        all_to_all(
            own.index_select(0, self._send_header_index(segment_run)),
            [fields + served] * shards,
            [fields + len(segs) for segs in routing.segments_to],
            group,
            "input_dist.header",
            output=header[own.numel() :],
        )
        read = header.tolist()  # the step's one host read
        own_read, peer_read = read[: own.numel()], read[own.numel() :]
        rows = [peer_read[j * (fields + served) : (j + 1) * (fields + served)]
                for j in range(shards)]  # fmt: skip
        error = (
            error
            or self._own_error(kjt, own_read[_BAD])
            or self._group_error(rows)
            or self._elsewhere(min(row[_VERDICT] for row in rows))
            or self._split_error(rows)
        )
        batch = kjt.stride() if kjt is not None else 0
        if error is not None:
            return RoutedBatch(kjt, batch, [], None, None, error)
        assert kjt is not None and runs is not None
        return self._send_ids(kjt, runs, own_read[fields:], rows)

    def _split_error(self, rows: list[list[int]]) -> Exception | None:
        """The ValueError for a same_batch group whose ranks split batches of different
        sizes (``carry_full_batch``; the rows reach every rank of the world, so every rank
        finds the same one)."""
        if self._group_rank is None:
            return None
        groups: dict[int, list[tuple[int, int]]] = {}
        for j, row in enumerate(rows):
            groups.setdefault(row[_GROUP], []).append((self._shard_ranks[j], row[_FULL_BATCH]))
        for members in groups.values():
            if len({size for _, size in members}) > 1:
                ranks, sizes = zip(*sorted(members), strict=True)
                return different_sizes(list(ranks), list(sizes))
        return None

    def _send_ids(
        self, kjt: KeyedJaggedTensor, runs: Runs, run_sizes: list[int], rows: list[list[int]]
    ) -> RoutedBatch:
        """Start the ids all-to-all, every size known on the host from the header's read."""
        routing, group, wire = self._routing, self._shard_group, self._wire
        served = len(routing.served)
        flags = {row[_WEIGHTS_FIELD] for row in rows}
        trained = _WEIGHTS_TRAINED in flags  # their gradients travel back: an exchange of
        packed = flags != {_NO_WEIGHTS} and not trained  # their own; else in the ids buffer
        weights = runs.weights
        if packed and weights is not None:
            weights = weights.float()
        # One dtype before the cat (a cat of mixed dtypes copies piece by piece on CUDA):
        # the ids' and lengths' own, cast after the cat, unless packed weights join them.
        lengths, ids = runs.lengths, runs.ids
        if packed or lengths.dtype != ids.dtype:
            lengths, ids = lengths.to(wire), ids.to(wire)
        layout = routing.send_layout(Runs(lengths, ids, weights, runs.segment_run), run_sizes)
        counts = layout.counts
        peer_batches = [row[_BATCH] for row in rows]
        peer_segment_counts = [row[self._fields :] for row in rows]
        peer_counts = [sum(c) for c in peer_segment_counts]
        send_w = None
        if flags != {_NO_WEIGHTS}:  # then every rank sends weights (ones where it has none)
            send_w = layout.weights
            if send_w is None:
                ones = torch.ones(sum(counts), device=self._device)
                firsts = list(itertools.accumulate(counts, initial=0))
                send_w = [[ones[a:b]] for a, b in itertools.pairwise(firsts)]
        pieces: list[Tensor] = []
        for p in range(routing.shard_size):
            pieces += layout.lengths[p] + layout.ids[p]
            if packed:
                assert send_w is not None
                pieces += _packed(send_w[p], wire)
        extra = (lambda count: packed_size(count, wire)) if packed else (lambda count: 0)
        ids = all_to_all_start(
            torch.cat(pieces).to(wire),
            [served * b + c + extra(c) for b, c in zip(peer_batches, peer_counts, strict=True)],
            [
                len(segs) * kjt.stride() + c + extra(c)
                for segs, c in zip(routing.segments_to, counts, strict=True)
            ],  # fmt: skip
            group,
            "input_dist.ids",
        )
        psw = None
        if trained:
            assert send_w is not None
            received = all_to_all_autograd(
                _cat_float([w for ws in send_w for w in ws]), peer_counts, counts, group,
                "input_dist.weights",
            )  # fmt: skip
            psw = PendingTensor(received, None, "input_dist.weights", group)
        return RoutedBatch(kjt, kjt.stride(), peer_counts, ids, psw, None, packed, peer_batches,
                           peer_segment_counts)  # fmt: skip


def _cat_float(weights: list[Tensor]) -> Tensor:
    """The trained weights sent, as one fp32 tensor (differentiable)."""
    return torch.cat(weights).float()


def _packed(weights: list[Tensor], wire: torch.dtype) -> list[Tensor]:
    """One position's fp32 weights as ``wire`` slots (``pack_weights``): views for int32
    slots, one padded copy for int64 ones."""
    if wire == torch.int32:
        return [w.view(wire) for w in weights]
    if not weights:
        return []
    return [pack_weights(torch.cat(weights), wire)]


def _weights_flag(weights: Tensor | None) -> int:
    """The header's per-sample-weights field: none, given, or given and trained (a feature
    processor computed them with grad: the served ranks send their gradients back)."""
    if weights is None:
        return _NO_WEIGHTS
    return _WEIGHTS_TRAINED if weights.requires_grad and torch.is_grad_enabled() else _WEIGHTS


__all__ = ["InputDist", "RoutedBatch", "pack_weights", "packed_size", "wire_dtype"]
