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

from dtrec.config import EmbeddingBagConfig
from dtrec.placements import Block, TableLayout


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

        self.local_features: list[int] = []  # data-parallel: looked up on the own batch
        self.segments_to: list[list[Segment]] = [[] for _ in range(shard_size)]
        for k, slot in enumerate(self.slots):
            layout = layouts[slot.table]
            if layout.batch_local:
                self.local_features.append(k)
                continue
            for block in layout.blocks:
                self.segments_to[block.position].append(Segment(slot.table, k, block))
        for segs in self.segments_to:
            segs.sort(key=lambda s: (s.feature, s.block.rows, s.block.cols))

        self.widths = [sum(s.block.num_cols for s in segs) for segs in self.segments_to]
        self.served = self.segments_to[position]
        self.served_width = self.widths[position]
        self.has_sharded = any(self.segments_to)

    @property
    def local_tables(self) -> list[int]:
        """Tables this rank stores a block of (data-parallel ones included)."""
        served = {s.table for s in self.served}
        served.update(self.slots[k].table for k in self.local_features)
        return sorted(served)

    def received_columns(self, device: torch.device) -> Tensor:
        """Output column of every column of the concatenated partials (positions in order)."""
        cols = [
            torch.arange(
                self.slots[s.feature].col + s.block.cols[0],
                self.slots[s.feature].col + s.block.cols[1],
            )
            for segs in self.segments_to
            for s in segs
        ]
        return (torch.cat(cols) if cols else torch.zeros(0, dtype=torch.long)).to(device)

    def local_columns(self, device: torch.device) -> Tensor:
        """Output columns of the data-parallel features, in order."""
        cols = [
            torch.arange(self.slots[k].col, self.slots[k].col + self.slots[k].dim)
            for k in self.local_features
        ]
        return (torch.cat(cols) if cols else torch.zeros(0, dtype=torch.long)).to(device)
