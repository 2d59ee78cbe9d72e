"""Static routing of a collection's features over the "shard" axis.

Built once per sharded collection from the tables' layouts. A *segment* is one
(feature, block) pair: every rank sends the ids of that feature falling in the
block's rows to the block's position, which pools them and sends back a
``[B, block cols]`` partial; the requester adds the partials into its output
columns. Row-wise blocks add up (Partial sum), column blocks tile the row.
This one scheme covers every sharding type.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dtrec.modules.config import EmbeddingBagConfig
from dtrec.ops.backends.fbgemm_loader import fbgemm_ops
from dtrec.placements import Block, TableLayout
from dtrec.sharded.dist.row_buckets import RunMaps, Runs, lay_out_runs


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


@dataclass
class SendLayout:
    """What this rank sends each shard position (``Routing.send_layout``): per position,
    the ``[B]`` bag lengths of its segments (in ``segments_to[p]`` order), their ids (local
    to the block's rows) and their weights (None when the batch has none)."""

    lengths: list[list[Tensor]]
    ids: list[list[Tensor]]
    weights: list[list[Tensor]] | None
    counts: list[int]
    """Ids sent to each position."""
    segment_counts: list[int]
    """Ids of each segment (send order)."""


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
        segments = [(seg.feature, seg.block) for _, seg in numbered]
        sizes = [tables[slot.table].num_embeddings for slot in self.slots]
        self._run_maps = RunMaps(sizes, segments, shard_size)

    def bucketize(self, values: Tensor, lengths: Tensor, weights: Tensor | None) -> Runs:
        """Lay a batch (features in output order) out in runs, on the device, no host read.

        ``values`` int ids, ``lengths`` ``[F, B]``, ``weights`` per id or None. Each segment
        sends one run whole (``row_buckets``): a feature whose blocks hold all its table's
        rows (table-wise, column-wise) is one run, the batch as it came; features split by
        rows (row-wise, table-row-wise, grid) are laid out in one counting pass (fbgemm,
        on CPU) or a stable sort of narrow keys. ``send_layout`` slices the runs once the
        host knows their sizes (the input dist reads them with its header).
        """
        maps = self._run_maps
        fbgemm_fits = (  # fbgemm's op has no autograd: trained weights take the sort path
            not maps.whole_features
            and maps.fbgemm_segment_run is not None
            and values.device.type == "cpu"
            and (weights is None or not weights.requires_grad)
        )
        ops = fbgemm_ops() if fbgemm_fits else None
        return lay_out_runs(maps, values, lengths, weights, ops)

    def send_layout(self, runs: Runs, run_sizes: Sequence[int]) -> SendLayout:
        """What each shard position gets: per position, its segments' ``[B]`` bag lengths
        and their ids (and weights), slices of ``runs`` (``run_sizes``: ids per run, read
        by the host); each id crosses the wire once per block holding its row."""
        starts = list(itertools.accumulate(run_sizes, initial=0))
        layout = SendLayout([], [], None if runs.weights is None else [], [], [])
        for numbers in self._segment_numbers:
            spans = [(r, starts[r], starts[r + 1]) for r in (runs.segment_run[g] for g in numbers)]
            layout.lengths.append([runs.lengths[r] for r, _, _ in spans])
            layout.ids.append([runs.ids[lo:hi] for _, lo, hi in spans])
            if runs.weights is not None:
                assert layout.weights is not None
                layout.weights.append([runs.weights[lo:hi] for _, lo, hi in spans])
            layout.segment_counts += [hi - lo for _, lo, hi in spans]
            layout.counts.append(sum(hi - lo for _, lo, hi in spans))
        return layout

    @property
    def num_runs(self) -> int:
        """Runs of the sort layout (``row_buckets``): one size each in a refused header."""
        return self._run_maps.num_runs

    @property
    def segment_run(self) -> tuple[int, ...]:
        """Per segment (send order), its run in the sort layout."""
        return self._run_maps.segment_run

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
