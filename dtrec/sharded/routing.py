"""Static routing of a collection's features over the "shard" axis.

Built once per sharded collection from the tables' layouts. A *segment* is one
(feature, block) pair: every rank sends the ids of that feature falling in the
block's rows to the block's position, which pools them and sends back a
``[B, block cols]`` partial; the requester adds the partials into its output
columns. Row-wise blocks add up (Partial sum), column blocks tile the row.
This one scheme covers every sharding type.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dtrec.modules.config import EmbeddingBagConfig
from dtrec.ops.backends.fbgemm_loader import fbgemm_ops
from dtrec.placements import Block, TableLayout
from dtrec.sharded.row_buckets import BucketMaps, fbgemm_bucketize, sort_by_segment


@dataclass(frozen=True)
class Segment:
    """One feature's ids routed to one block of its table."""

    table: int
    """Index of the table in the collection."""
    feature: int
    """Index of the feature in output order."""
    block: Block


@dataclass(frozen=True)
class FeatureSlot:
    """Where a feature's pooled values sit in the output."""

    table: int
    col: int
    dim: int


class Routing:
    """Who sends which ids where, and where returned partials land.

    ``segments_to[p]`` is the ordered list of segments served by shard position
    ``p``; every rank computes the same lists, so send and receive layouts agree
    without exchanging metadata.
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        layouts: list[TableLayout],
        shard_size: int,
        position: int,
    ) -> None:
        self.shard_size = shard_size
        self.position = position
        self.slots: list[FeatureSlot] = []
        col = 0
        for t, cfg in enumerate(tables):
            for _ in cfg.feature_names:
                self.slots.append(FeatureSlot(t, col, cfg.embedding_dim))
                col += cfg.embedding_dim
        self.total_dim = col

        # The one place the sharded engine reads ``TableLayout.batch_local``; every other
        # stage asks this set whether a table is data parallel.
        self.data_parallel_tables: frozenset[int] = frozenset(
            t for t, layout in enumerate(layouts) if layout.batch_local
        )
        """Tables every rank holds whole and looks up on its own batch: their ids are not
        routed, and their gradients are summed over the world, not the "replicate" axis."""
        self.local_features: list[int] = [
            k for k, slot in enumerate(self.slots) if slot.table in self.data_parallel_tables
        ]
        """Features of data-parallel tables (output order): looked up where they are."""
        self.segments_to: list[list[Segment]] = [[] for _ in range(shard_size)]
        for k, slot in enumerate(self.slots):
            if slot.table in self.data_parallel_tables:
                continue
            for block in layouts[slot.table].blocks:
                self.segments_to[block.position].append(Segment(slot.table, k, block))
        for segs in self.segments_to:
            segs.sort(key=lambda s: (s.feature, s.block.rows, s.block.cols))

        self.widths = [sum(s.block.num_cols for s in segs) for segs in self.segments_to]
        self.served = self.segments_to[position]
        self.served_width = self.widths[position]
        self.has_sharded = any(self.segments_to)
        # Segments are numbered in send order (position-major, then segments_to[p] order).
        numbered = [(p, seg) for p, segs in enumerate(self.segments_to) for seg in segs]
        self._segment_numbers: list[list[int]] = []
        for segs in self.segments_to:
            first = sum(len(x) for x in self._segment_numbers)
            self._segment_numbers.append(list(range(first, first + len(segs))))
        # Features whose table is split by rows: their ids need a search for their block.
        split = {
            seg.feature
            for _, seg in numbered
            if seg.block.rows != (0, tables[seg.table].num_embeddings)
        }
        self._split_features = sorted(split)
        split_numbered = [(g, seg) for g, (_, seg) in enumerate(numbered) if seg.feature in split]
        self._split_segment_numbers = [g for g, _ in split_numbered]
        feature_index = {k: i for i, k in enumerate(self._split_features)}
        self._bucket_maps = BucketMaps(
            [tables[self.slots[k].table].num_embeddings for k in self._split_features],
            [(feature_index[seg.feature], seg.block) for _, seg in split_numbered],
            shard_size,
        )
        self._device_maps: dict[torch.device, BucketMaps] = {}

    def bucketize(
        self, values: Tensor, lengths: Tensor, weights: Tensor | None
    ) -> tuple[list[Tensor], list[Tensor | None], list[int]]:
        """Split a batch (features in output order) into what each shard position receives.

        ``values`` int ids, ``lengths`` ``[F, B]``, ``weights`` per id or None. Returns, per
        position p: an int64 buffer ``[lengths of p's segments (B each, in
        segments_to[p] order) | their ids, local to the block's rows]``, the ids'
        weights, and the id count (each id crosses the wire once per block holding its row).

        A segment whose block holds all its table's rows (table-wise, column-wise) takes
        its feature's ids and lengths as they are: slices, no search. The ids of features
        split by rows (row-wise, table-row-wise, grid) are laid out by segment in one
        counting pass (fbgemm) or a stable sort of narrow keys (``_split_segments``).
        One host read of the per-feature id counts (two with row-split features).
        """
        num_features, batch = lengths.shape
        values, lengths = values.long(), lengths.long()
        per_feature = lengths.sum(1).tolist()
        starts = [0]
        for n in per_feature:
            starts.append(starts[-1] + n)
        split_parts: dict[int, tuple[Tensor, Tensor, Tensor | None]] = {}
        if self._split_features:
            split_parts = self._split_segments(values, lengths, weights, per_feature, starts)
        buffers, sent_weights, counts = [], [], []
        for p, segs in enumerate(self.segments_to):
            seg_lengths, seg_ids, seg_weights = [], [], []
            for g, seg in zip(self._segment_numbers[p], segs, strict=True):
                if g in split_parts:
                    part_lengths, part_ids, part_weights = split_parts[g]
                else:
                    k = seg.feature
                    part_lengths, part_ids = lengths[k], values[starts[k] : starts[k + 1]]
                    part_weights = None if weights is None else weights[starts[k] : starts[k + 1]]
                seg_lengths.append(part_lengths)
                seg_ids.append(part_ids)
                seg_weights.append(part_weights)
            buffers.append(torch.cat([*seg_lengths, *seg_ids]) if segs else values[:0])
            counts.append(sum(t.numel() for t in seg_ids))
            if weights is None:
                sent_weights.append(None)
            else:
                sent_weights.append(torch.cat(seg_weights) if segs else weights[:0])
        return buffers, sent_weights, counts

    def _split_segments(
        self,
        values: Tensor,
        lengths: Tensor,
        weights: Tensor | None,
        per_feature: list[int],
        starts: list[int],
    ) -> dict[int, tuple[Tensor, Tensor, Tensor | None]]:
        """Segment number -> (bag lengths, local ids, weights) of the row-split features.

        Every segment's ids keep their batch order (a stable counting sort by segment), as
        the receiving lookup and the fused backward expect. Row-wise chunks on CPU go
        through fbgemm's ``block_bucketize_sparse_features`` (TorchRec's row-wise input
        dist: one pass, no sort) when fbgemm is there; otherwise ``sort_by_segment``.
        """
        maps = self._maps(values.device)
        features = self._split_features
        if len(features) < len(per_feature):
            values = torch.cat([values[starts[k] : starts[k + 1]] for k in features])
            if weights is not None:
                weights = torch.cat([weights[starts[k] : starts[k + 1]] for k in features])
            lengths = lengths[features]
        counts = [per_feature[k] for k in features]
        fbgemm_fits = (  # fbgemm's op has no autograd: trained weights take the sort path
            maps.fbgemm_rows is not None
            and values.device.type == "cpu"
            and (weights is None or not weights.requires_grad)
        )
        ops = fbgemm_ops() if fbgemm_fits else None
        if ops is not None:
            seg_lengths, local_ids, weights = fbgemm_bucketize(ops, maps, values, lengths, weights)
        else:
            seg_lengths, local_ids, weights = sort_by_segment(
                maps, values, lengths, weights, counts
            )
        per_segment = seg_lengths.sum(1).tolist()
        parts, start = {}, 0
        for i, (g, count) in enumerate(zip(self._split_segment_numbers, per_segment, strict=True)):
            part_weights = None if weights is None else weights[start : start + count]
            parts[g] = (seg_lengths[i], local_ids[start : start + count], part_weights)
            start += count
        return parts

    def _maps(self, device: torch.device) -> BucketMaps:
        if device not in self._device_maps:
            self._device_maps[device] = self._bucket_maps.to(device)
        return self._device_maps[device]

    @property
    def local_tables(self) -> list[int]:
        """Tables this rank stores a block of (data-parallel ones included)."""
        served = {s.table for s in self.served}
        served.update(self.slots[k].table for k in self.local_features)
        return sorted(served)

    def local_columns(self, device: torch.device) -> Tensor:
        """Output columns of the data-parallel features, in order."""
        cols = [
            torch.arange(self.slots[k].col, self.slots[k].col + self.slots[k].dim)
            for k in self.local_features
        ]
        return (torch.cat(cols) if cols else torch.zeros(0, dtype=torch.long)).to(device)
