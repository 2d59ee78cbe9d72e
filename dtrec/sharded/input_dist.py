"""Input dist: validate a batch and send each id to the shard position(s) holding its row.

Per batch, inside one sharding group (the ranks sharing a "replicate" coordinate):

1. header all-to-all (fixed size, ``input_dist.header``): every rank learns its
   peers' batch size, id counts and whether their input was valid. Local batch sizes
   may differ (the last batch of a ``drop_last=False`` loop), 0 included: a served
   segment pools each source's batch (its bags padded with empty ones to the largest),
   and the output dist returns each source its own rows;
2. verdict all-reduce (8 bytes, ``input_dist.verdict``) over the replicas: the
   lowest rank in the world that refused its batch, so a bad batch fails on every
   rank instead of hanging a later collective;
3. ids all-to-all (``input_dist.ids``; per-sample weights ride in the same buffer,
   unless they are trained: then a differentiable ``input_dist.weights`` all-to-all
   carries them), left in flight: each id goes to the block(s) that hold its row
   (``Routing.bucketize``); the lookup waits on it. The buffer is int32 when every
   table has fewer than 2**31 rows (``wire_dtype``): half the bytes of int64 ids.

Collections whose tables are all data parallel send no ids: only the verdict runs,
over the world.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

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
from dtrec.modules.features import bag_lengths, prepare_features
from dtrec.placements.mesh import REPLICATE, SHARD, mesh_device
from dtrec.sharded.groups import world_group
from dtrec.sharded.routing import Routing
from dtrec.sparse import KeyedJaggedTensor

_HEADER = 4  # status, batch size, ids sent to this peer, per-sample weights (_weights_flag)
_STATUS_OK, _STATUS_BAD_INPUT = 0, 1
_NO_WEIGHTS, _WEIGHTS, _WEIGHTS_TRAINED = 0, 1, 2


@dataclass
class RoutedBatch:
    """A batch after input-dist: its validated features and the ids this rank serves.

    ``ids`` holds, per source rank, ``[lengths of the served segments | ids]``, followed
    by the ids' per-sample weights (fp32 bit patterns, one per int32 slot or two per
    int64 one) when ``packed_weights``; it and
    ``psw`` (per-sample weights that are trained, so they travel in a differentiable
    exchange of their own) may still be in flight until waited on. ``error``: why the
    batch was refused, here or on another rank (``forward`` raises it; no ids sent).
    ``peer_batches``: each shard position's local batch size (they may differ).
    """

    kjt: KeyedJaggedTensor | None
    batch: int
    peer_counts: list[int]
    ids: PendingTensor | None
    psw: PendingTensor | None
    error: Exception | None = None
    packed_weights: bool = False
    peer_batches: list[int] = field(default_factory=list)

    @property
    def served_batch(self) -> int:
        """Bags per served block: the largest batch of the group (smaller ones padded)."""
        return max(self.peer_batches, default=0)

    def wait_served(
        self, num_segments: int, block_runs: list[tuple[int, int]] | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Wait for the ids; return (bag lengths, ids, per-sample weights or None).

        Bags come in blocks of ``served_batch``, one per (source, served segment),
        numbered source-major (``Routing.served`` order within a source); a source with a
        smaller batch has its blocks padded with empty bags. ``num_segments`` is the
        number of segments this rank serves. ``block_runs`` (runs ``[a, b)`` of block
        numbers, none across sources) returns the blocks in that order instead, sliced
        straight out of the received buffer: one copy of the ids, one host read of the
        block sizes.
        """
        assert self.ids is not None
        received = self.ids.wait()
        psw = None if self.psw is None else self.psw.wait()
        batch = self.served_batch
        heads, id_starts, weight_starts, start = [], [], [], 0
        for count, own_batch in zip(self.peer_counts, self.peer_batches, strict=True):
            bags = num_segments * own_batch
            head = received[start : start + bags]
            if own_batch < batch:  # pad every block of this source with empty bags
                head = torch.nn.functional.pad(
                    head.view(num_segments, own_batch), (0, batch - own_batch)
                ).view(-1)
            heads.append(head)
            id_starts.append(start + bags)
            start += bags + count
            if self.packed_weights:
                weight_starts.append(start)
                start += packed_size(count, received.dtype)
        lengths = torch.cat(heads).long()
        if block_runs is None:  # as received: each source's ids whole
            spans = [(p, 0, count) for p, count in enumerate(self.peer_counts)]
        else:
            blocks = lengths.view(len(self.peer_counts) * num_segments, batch)
            spans = _id_spans(block_runs, blocks.sum(1).tolist(), num_segments)
            lengths = torch.cat([blocks[a:b] for a, b in block_runs]).reshape(-1)
        ids = _cat_spans([received[id_starts[p] :] for p in range(len(id_starts))], spans).long()
        if self.packed_weights:
            packed = [
                received[at : at + packed_size(count, received.dtype)].view(torch.float32)
                for at, count in zip(weight_starts, self.peer_counts, strict=True)
            ]
            psw = _cat_spans(packed, spans)
        elif psw is not None and block_runs is not None:  # trained: a differentiable cat
            firsts = itertools.accumulate(self.peer_counts, initial=0)
            psw = _cat_spans([psw[first:] for first in firsts], spans)
        return lengths, ids, psw


def _id_spans(
    block_runs: list[tuple[int, int]], sizes: list[int], num_segments: int
) -> list[tuple[int, int, int]]:
    """(source, first id, end) of each run of blocks, ids counted within the source's."""
    first = []  # each block's first id within its source's ids
    for p in range(len(sizes) // num_segments if num_segments else 0):
        own = sizes[p * num_segments : (p + 1) * num_segments]
        first += itertools.accumulate(own[:-1], initial=0)
    return [
        (a // num_segments, first[a], first[b - 1] + sizes[b - 1]) for a, b in block_runs if b > a
    ]


def _cat_spans(per_source: list[Tensor], spans: list[tuple[int, int, int]]) -> Tensor:
    """``per_source[p][lo:hi]`` of every span, concatenated (empty when there is none)."""
    if not spans:
        return per_source[0][:0]
    return torch.cat([per_source[p][lo:hi] for p, lo, hi in spans])


def wire_dtype(tables: list[EmbeddingBagConfig]) -> torch.dtype:
    """The ids buffer's dtype: int32 when every id (and bag length) fits, else int64."""
    rows = max((t.num_embeddings for t in tables), default=0)
    return torch.int32 if rows < 2**31 else torch.int64


def packed_size(count: int, wire: torch.dtype) -> int:
    """Slots of a ``wire`` buffer that carry ``count`` fp32 weights (one per int32 slot,
    two per int64 one)."""
    return count if wire == torch.int32 else (count + 1) // 2


def pack_weights(weights: Tensor, wire: torch.dtype) -> Tensor:
    """fp32 weights as ``wire`` slots (bit patterns, zero-padded), so they travel in the
    ids buffer instead of a collective of their own."""
    weights = weights.float()
    if wire == torch.int64 and weights.numel() % 2:
        weights = torch.cat([weights, weights.new_zeros(1)])
    return weights.view(wire)


class InputDist:
    """Starts the input-dist of a collection's batches (see the module docstring)."""

    def __init__(self, tables: list[EmbeddingBagConfig], routing: Routing, mesh: DeviceMesh):
        self._tables = tables
        self._routing = routing
        self._mesh = mesh
        self._world_size = mesh.size()
        self._shard_group = mesh.get_group(SHARD)
        self._replicate_group = mesh.get_group(REPLICATE)
        self._shard_ranks = dist.get_process_group_ranks(self._shard_group)
        self._device = mesh_device(mesh)  # batches and collective buffers (NCCL: cuda)
        self._wire = wire_dtype(tables)

    def __call__(
        self, features: object, bounds_check: str, weighted: bool | None = None
    ) -> RoutedBatch:
        """Validate ``features`` (``prepare_features``: ids, per-sample weights per
        ``weighted``) and start sending its ids; a refusal is kept, not raised.

        Everything this rank computes before the header exchange (validation, bucketize)
        runs under one ``except Exception``: whatever fails there, a bad batch or not,
        becomes this rank's refusal in the exchange, so every rank fails the step
        together and none is left waiting in a collective its peer never joins.
        """
        kjt: KeyedJaggedTensor | None = None
        local: _Bucketized | None = None
        error: Exception | None = None
        try:
            kjt = prepare_features(
                features, self._tables, dist.get_rank(), bounds_check, self._device, weighted
            )
            if self._routing.has_sharded:
                local = _Bucketized.of(self._routing, kjt)
        except Exception as exc:  # noqa: BLE001 - refused in the exchange, raised in forward
            error, local = exc, None
        return self._exchange(kjt, local, error)

    def _exchange(
        self, kjt: KeyedJaggedTensor | None, local: _Bucketized | None, error: Exception | None
    ) -> RoutedBatch:
        """The status exchange (header or world verdict), then the ids' when all agree."""
        if self._routing.has_sharded:
            return self._exchange_ids(kjt, local, error)
        # no header: the verdict goes over the world
        failed = dist.get_rank() if error is not None else self._world_size
        elsewhere = self._verdict(failed, world_group(self._mesh))  # every rank joins it
        error = error or elsewhere
        batch = kjt.stride() if kjt is not None else 0
        return RoutedBatch(kjt, batch, [], None, None, error)

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

    def _check_peers(self, header: list[list[int]]) -> tuple[Exception | None, int]:
        """Why this sharding group refuses the batch (None: it does not) and the lowest
        rank at fault (W: none). Every rank of the group computes the same."""
        bad = [self._shard_ranks[j] for j, row in enumerate(header) if row[0] != _STATUS_OK]
        if bad:
            return ValueError(
                f"rank(s) {bad} of this sharding group rejected their input batch "
                "(see the error on those ranks); no collective was run with it"
            ), min(bad)
        return None, self._world_size

    def _exchange_ids(
        self, kjt: KeyedJaggedTensor | None, local: _Bucketized | None, error: Exception | None
    ) -> RoutedBatch:
        routing = self._routing
        group = self._shard_group
        shards = routing.shard_size
        batch = kjt.stride() if kjt is not None else 0
        header = torch.zeros(shards, _HEADER, dtype=torch.long)  # built on the host
        if error is None:
            assert kjt is not None and local is not None
            header[:, 0] = _STATUS_OK
            header[:, 1] = batch
            header[:, 2] = torch.tensor(local.counts, dtype=torch.long)
            header[:, 3] = local.weights_flag
        else:
            header[:, 0] = _STATUS_BAD_INPUT
        peer = all_to_all(
            header.flatten().to(self._device),
            [_HEADER] * shards,
            [_HEADER] * shards,
            group,
            "input_dist.header",
        )
        rows = peer.view(shards, _HEADER).tolist()  # one host read for every check below
        group_error, failed = self._check_peers(rows)
        elsewhere = self._verdict(failed, self._replicate_group)  # every rank joins it
        error = error or group_error or elsewhere
        if error is not None:
            return RoutedBatch(kjt, batch, [], None, None, error)
        assert kjt is not None and local is not None
        buffers, sent_weights, counts = local.buffers, local.weights, local.counts

        device = kjt.values().device
        peer_batches = [row[1] for row in rows]
        peer_counts = [row[2] for row in rows]
        flags = {row[3] for row in rows}
        send_w = None
        if flags != {_NO_WEIGHTS}:  # then every rank sends weights (ones where it has none)
            send_w = [
                torch.ones(count, device=device) if w is None else w.float()
                for w, count in zip(sent_weights, counts, strict=True)
            ]
        trained = _WEIGHTS_TRAINED in flags  # their gradients travel back: an exchange of
        packed = send_w is not None and not trained  # their own; otherwise in the ids buffer
        wire = self._wire
        if packed:
            assert send_w is not None
            buffers = [
                torch.cat([b.to(wire), pack_weights(w, wire)]) for b, w in zip(buffers, send_w)
            ]
        extra = (lambda count: packed_size(count, wire)) if packed else (lambda count: 0)
        ids = all_to_all_start(
            torch.cat(buffers).to(device=device, dtype=wire),
            [
                len(routing.served) * b + c + extra(c)
                for b, c in zip(peer_batches, peer_counts, strict=True)
            ],
            [b.numel() for b in buffers],
            group,
            "input_dist.ids",
        )
        psw = None
        if trained:
            assert send_w is not None
            received = all_to_all_autograd(
                torch.cat(send_w), peer_counts, counts, group, "input_dist.weights"
            )
            psw = PendingTensor(received, None, "input_dist.weights", group)
        return RoutedBatch(kjt, batch, peer_counts, ids, psw, None, packed, peer_batches)


@dataclass
class _Bucketized:
    """This rank's batch laid out per shard position (``Routing.bucketize``), before the
    header exchange."""

    buffers: list[Tensor]
    weights: list[Tensor | None]
    counts: list[int]
    weights_flag: int

    @staticmethod
    def of(routing: Routing, kjt: KeyedJaggedTensor) -> _Bucketized:
        weights = kjt.weights_or_none()
        buffers, sent, counts = routing.bucketize(kjt.values(), bag_lengths(kjt), weights)
        return _Bucketized(buffers, sent, counts, _weights_flag(weights))


def _weights_flag(weights: Tensor | None) -> int:
    """The header's per-sample-weights field: none, given, or given and trained (a feature
    processor computed them with grad: the served ranks send their gradients back)."""
    if weights is None:
        return _NO_WEIGHTS
    return _WEIGHTS_TRAINED if weights.requires_grad and torch.is_grad_enabled() else _WEIGHTS
