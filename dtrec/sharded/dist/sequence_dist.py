"""The sequence (unpooled) path's stages around the shared input dist: rows, not sums.

A sequence lookup is the pooled lookup with bags of one id, so ids travel exactly as
for bags (``InputDist``, ``Routing.bucketize``: each id goes to every block holding its
row, in a stable segment order). What changes is what comes back:

* server (``SequenceLookup.served``): one call over every served table
  (``lookup.sequence.lookup_rows``) gathers the received ids' rows (``[ids, block
  cols]``), laid out in the order the ids arrived: per source, per segment, per id;
* output dist (``SequenceOutputDist``): one differentiable all-to-all
  (``sequence_output_dist`` in ``dtrec.comm_stats()``) returns the rows to the ranks
  whose batches sent the ids;
* requester: the rows land at (id position, column range) of the feature's output
  through one index (``ReturnPlan``): a permutation, so the backward is a gather and is
  deterministic. Row blocks: each id comes back once, from the block holding its row;
  column blocks: once per block, tiling its columns. Data-parallel tables are looked up
  on the own batch and placed alike. When every sharded feature comes back whole (one
  block of all rows and columns: table-wise), the received pieces are the outputs
  themselves: no index, no copy (``SequenceRouting.returns_whole_features``).

The requester knows where each returned row belongs because ``SequenceRouting`` records,
while laying out what it sends, each sent id's position in the batch (the same stable
order the ids were sent in).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from dtrec.comm.collectives import all_to_all_autograd
from dtrec.comm.qcomms import QCommsConfig
from dtrec.comm.quantized import quantized_all_to_all
from dtrec.ops.backends.device_lists import device_list
from dtrec.sharded.update.fused_update import FusedUpdater
from dtrec.sharded.dist.input_dist import RoutedBatch
from dtrec.sharded.dist.replica_slices import (
    FetchTouched,
    OwnerSlices,
    fetch_touched,
    run_value_tables,
)
from dtrec.sharded.dist.routing import Routing, SendLayout
from dtrec.sharded.dist.row_buckets import Runs
from dtrec.sharded.lookup.sequence import IdRuns, expand_runs, lookup_rows
from dtrec.sparse import KeyedJaggedTensor


class SequenceRouting(Routing):
    """``Routing`` that also records the batch position of each id it sends and each sent
    segment's id count (``take_sent``).

    The positions ride through ``Routing.bucketize`` as the ids' "weights": they are
    permuted exactly like the ids, and ``send_layout`` (run once the sizes are read, only
    for a batch every rank accepted) keeps them instead of sending them. The caller takes
    them with ``take_sent`` right after the input dist.
    """

    _sent: tuple[list[Tensor], list[int]] | None = None

    @functools.cached_property
    def returns_whole_features(self) -> bool:
        """Whether every sharded feature goes to one segment holding all its table's rows
        and columns (table-wise; data-parallel features are not sent). Its rows then come
        back contiguous and in batch order (the ids were sent in a stable order), so the
        requester needs no positions and no placement index."""
        segs = [s for segs in self.segments_to for s in segs]
        features = [s.feature for s in segs]
        return len(set(features)) == len(features) and all(
            s.block.num_cols == self.slots[s.feature].dim for s in segs
        )

    def bucketize(self, values: Tensor, lengths: Tensor, weights: Tensor | None) -> Runs:
        positions = None
        if not self.returns_whole_features:
            positions = torch.arange(values.numel(), device=values.device)
        return super().bucketize(values, lengths, positions)

    def send_layout(self, runs: Runs, run_sizes: Sequence[int]) -> SendLayout:
        layout = super().send_layout(runs, run_sizes)
        positions = [w for ws in layout.weights or [] for w in ws]
        self._sent = (positions, layout.segment_counts)
        layout.weights = None  # recorded, not sent
        return layout

    def take_sent(self) -> tuple[list[Tensor], list[int]] | None:
        """(the batch positions of the ids sent, in send order; per segment: its id count),
        from the last ``send_layout``; None when nothing was sent since the last take."""
        sent, self._sent = self._sent, None
        return sent


def column_unit(routing: Routing) -> int:
    """The widest column run every feature dim, block width and block start is a multiple
    of: outputs are placed in runs of it (a whole row when no table is column-split and all
    dims are equal), so the placement index has ids x D / unit entries, not ids x D."""
    unit = 0
    for slot in routing.slots:
        unit = math.gcd(unit, slot.dim)
    for segs in routing.segments_to:
        for s in segs:
            unit = math.gcd(math.gcd(unit, s.block.num_cols), s.block.cols[0])
    return max(unit, 1)


class ReturnPlan:
    """Where every element the requester receives goes in its flat output (features in
    order, each ``[ids, D]`` row-major), and how many elements each position returns.

    ``dest`` indexes runs of ``unit`` columns (``column_unit``): received run i goes to
    output run ``dest[i]``."""

    def __init__(
        self,
        routing: SequenceRouting,
        kjt: KeyedJaggedTensor,
        sent: tuple[list[Tensor], Tensor] | None,
        unit: int,
    ) -> None:
        device = kjt.values().device
        self.unit = unit
        lengths = kjt.length_per_key()  # host ints (the KJT caches them)
        self.feature_sizes = [n * slot.dim for n, slot in zip(lengths, routing.slots, strict=True)]
        self.out_start = list(itertools.accumulate(self.feature_sizes, initial=0))[:-1]
        """First element of each feature's rows in the flat output."""
        self.total = sum(self.feature_sizes)
        self.recv_splits = [0] * routing.shard_size
        self.dest = torch.zeros(0, dtype=torch.long, device=device)
        self.whole = routing.returns_whole_features
        """Received rows are whole features in batch order: ``segment_sizes`` elements of
        feature ``segment_features`` each, no ``dest`` (``returns_whole_features``)."""
        segs = [s for segs in routing.segments_to for s in segs]
        self.segment_features = [s.feature for s in segs]
        self.segment_sizes = [0] * len(segs)
        if sent is None:
            return
        positions, counts = sent
        seg_width = torch.tensor([s.block.num_cols for s in segs], dtype=torch.long, device=device)
        seg_counts = device_list(counts, torch.long, device, cached=False)
        self.segment_sizes = [c * s.block.num_cols for c, s in zip(counts, segs, strict=True)]
        first = 0
        for p, p_segs in enumerate(routing.segments_to):
            self.recv_splits[p] = sum(self.segment_sizes[first : first + len(p_segs)])
            first += len(p_segs)
        if self.whole:
            return
        position = torch.cat(positions) if positions else self.dest
        if all(slot.dim == unit for slot in routing.slots):
            # Every row is one run (one dim, no column split): the flat output is the
            # batch's ids in order, so each id's run is its batch position.
            self.dest = position
            return
        dims = torch.tensor([s.dim for s in routing.slots], dtype=torch.long, device=device)
        value_start = torch.tensor(
            list(itertools.accumulate(lengths, initial=0))[:-1], dtype=torch.long, device=device
        )
        out_start = torch.tensor(self.out_start, dtype=torch.long, device=device)
        seg_feature = torch.tensor(self.segment_features, dtype=torch.long, device=device)
        seg_col = torch.tensor([s.block.cols[0] for s in segs], dtype=torch.long, device=device)
        segment = torch.repeat_interleave(
            torch.arange(len(segs), device=device), seg_counts, output_size=position.numel()
        )
        feature = seg_feature.index_select(0, segment)
        row = position - value_start.index_select(0, feature)
        starts = out_start.index_select(0, feature)
        starts += row * dims.index_select(0, feature) + seg_col.index_select(0, segment)
        self.dest = expand_runs(
            starts // unit,
            seg_width.index_select(0, segment) // unit,
            sum(self.recv_splits) // unit,
        )


class SequenceLookup:
    """Row gathers on local shards: every table's ids in one call (``lookup_rows``)."""

    def __init__(
        self,
        routing: Routing,
        updater: FusedUpdater | None,
        offload: Any = None,
        owners: dict[int, OwnerSlices] | None = None,
    ) -> None:
        self._routing = routing
        self._updater = updater
        self._offload = offload  # offloaded tables' caches (``OffloadedTables``), or None
        self._owners = owners or {}  # fully sharded tables' owner slices, by table index
        self._tables = sorted({s.table for s in routing.served})
        self._table_of = {t: u for u, t in enumerate(self._tables)}

    def served(
        self, routed: RoutedBatch, local: dict[int, Tensor]
    ) -> tuple[Tensor | None, list[int]]:
        """The flat send buffer of rows for every source (source-major, then segment, then
        id, each id's block columns; None when this rank serves nothing) and its
        per-source split sizes (elements).

        The received ids come in runs, one per (source, segment), each of one table; the
        runs' counts came in the input dist's header, every index is built from them."""
        routing = self._routing
        served, batch, shards = routing.served, routed.served_batch, routing.shard_size
        lengths, ids, _ = routed.wait_served(len(served))
        if self._offload is not None:  # offloaded tables' ids -> their cache slots
            ids = self._offload.slot_ids(routed, ids, self._run_tables(), lengths, batch)
        if not served:
            return None, [0] * shards
        counts = [c for source in routed.peer_segment_counts for c in source]  # header's
        widths = [s.block.num_cols for s in served]
        send_splits = [
            sum(c * w for c, w in zip(counts[p * len(served) :], widths, strict=False))
            for p in range(shards)
        ]
        runs = IdRuns(
            ids, [self._table_of[s.table] for s in served] * shards, counts, len(self._tables)
        )
        weights = [local[t] for t in self._tables]
        owners = {u: self._owners[t] for u, t in enumerate(self._tables) if t in self._owners}
        if owners:  # fully sharded tables: compact tables of their touched rows
            value_table = run_value_tables(runs.run_table, runs.run_counts, ids.numel())
            if self._updater is None:  # their gradients reach the owners by autograd
                ids, *weights = FetchTouched.apply(owners, value_table, ids, *weights)
            else:  # the fused updater sends their row gradients to the owners
                weights, ids = fetch_touched(owners, weights, value_table, ids)
            runs = IdRuns(ids, runs.run_table, runs.counts, len(self._tables))
        return lookup_rows(self._updater, self._tables, weights, runs), send_splits

    def fill(self, routed: RoutedBatch) -> None:
        """Fill offloaded tables' caches for a prefetched batch (``OffloadedTables.fill``)."""
        if self._offload is not None and routed.error is None:
            lengths, ids, _ = routed.wait_served(len(self._routing.served))
            self._offload.fill(routed, ids, self._run_tables(), lengths, routed.served_batch)

    def _run_tables(self) -> list[int]:
        """The table of each run of received ids (source-major, then served segment)."""
        return [s.table for s in self._routing.served] * self._routing.shard_size

    def data_parallel(self, kjt: KeyedJaggedTensor, local: dict[int, Tensor]) -> list[Tensor]:
        """Rows of the data-parallel features of the own batch, one ``[ids, D]`` each, in
        one call (a table's features are adjacent in the batch: one run per table)."""
        routing = self._routing
        per_feature = kjt.length_per_key()
        starts = list(itertools.accumulate(per_feature, initial=0))
        by_table: dict[int, list[int]] = {}
        for k in routing.local_features:
            by_table.setdefault(routing.slots[k].table, []).append(k)
        spans = [(starts[fs[0]], starts[fs[-1] + 1]) for fs in by_table.values()]
        values = kjt.values()
        ids = values[spans[0][0] : spans[-1][1]]
        if any(hi != lo for (_, hi), (lo, _) in zip(spans, spans[1:], strict=False)):
            ids = torch.cat([values[lo:hi] for lo, hi in spans])
        tables = list(by_table)
        runs = IdRuns(ids, list(range(len(tables))), [hi - lo for lo, hi in spans], len(tables))
        rows = lookup_rows(self._updater, tables, [local[t] for t in tables], runs)
        features = [k for fs in by_table.values() for k in fs]
        sizes = [per_feature[k] * routing.slots[k].dim for k in features]
        by_feature = {
            k: piece.view(-1, routing.slots[k].dim)
            for k, piece in zip(features, rows.split(sizes), strict=True)
        }
        return [by_feature[k] for k in routing.local_features]


class SequenceOutputDist:
    """Returns served rows to their requesters and assembles per-feature outputs."""

    def __init__(
        self,
        routing: SequenceRouting,
        shard_group: ProcessGroup,
        dtype: torch.dtype,
        qcomms: QCommsConfig | None = None,
    ) -> None:
        self._routing = routing
        self._qcomms = qcomms  # None: rows and their gradients travel as they are
        self._group = shard_group
        self._dtype = dtype
        self.unit = column_unit(routing)
        """Columns per placed run (``column_unit``); ``ReturnPlan`` is built with it."""

    def __call__(
        self,
        send: Tensor | None,
        send_splits: list[int],
        plan: ReturnPlan,
        local_rows: list[Tensor],
        device: torch.device,
    ) -> list[Tensor]:
        """Per feature (output order), its ``[ids, D]`` rows."""
        routing = self._routing
        sources, dests = [], []
        if routing.has_sharded:
            if send is None:
                send = torch.zeros(0, dtype=self._dtype, device=device)
            if self._qcomms is None:
                received = all_to_all_autograd(
                    send, plan.recv_splits, send_splits, self._group, "sequence_output_dist"
                )
            else:  # rows in the forward precision, their gradients in the backward one
                received = quantized_all_to_all(
                    send, plan.recv_splits, send_splits, self._group, "sequence_output_dist",
                    self._qcomms.forward_codec, self._qcomms.backward_codec,
                )  # fmt: skip
            sources.append(received)
            dests.append(plan.dest)
        if plan.whole:  # no placement: the received pieces are the features' rows
            by_feature = dict(zip(routing.local_features, local_rows, strict=True))
            if sources:
                pieces = sources[0].to(self._dtype).split(plan.segment_sizes)
                by_feature.update(zip(plan.segment_features, pieces, strict=True))
            return [by_feature[k].view(-1, slot.dim) for k, slot in enumerate(routing.slots)]
        unit = plan.unit
        for k, rows in zip(routing.local_features, local_rows, strict=True):
            start = plan.out_start[k] // unit
            sources.append(rows.reshape(-1))
            dests.append(torch.arange(start, start + rows.numel() // unit, device=device))
        flat = torch.zeros(plan.total // unit, unit, dtype=self._dtype, device=device)
        if sources:  # (torch.cat of one tensor would copy it)
            runs = (sources[0] if len(sources) == 1 else torch.cat(sources)).view(-1, unit)
            index = dests[0] if len(dests) == 1 else torch.cat(dests)
            flat.index_copy_(0, index, runs.to(self._dtype))  # in place: no copy of the zeros
        pieces = flat.view(-1).split(plan.feature_sizes)
        return [p.view(-1, slot.dim) for p, slot in zip(pieces, routing.slots, strict=True)]
