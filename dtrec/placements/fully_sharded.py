"""The fully-sharded-2D option of a table spec: each shard's rows split over its replicas.

Exact 2D keeps every shard whole on each of its R replicas (R copies of the table and
of its optimizer state). ``fully_sharded=True`` keeps only one *owner slice* of each
shard per replica at rest: the shard's rows split into R contiguous chunks (torch's
chunk semantics) along the "replicate" axis, so the table's DTensor is
``(Shard(0), Shard(0))`` for row-wise (rows over "shard", then each shard's rows over
"replicate"), ``(Replicate(), Shard(0))`` on a table-wise table's one-position sub-mesh,
``(Shard(1), Shard(0))`` for column-wise (each column block's rows split). A step
fetches the rows its lookups touch from their owners and sends their gradients back
(``dtrec.sharded.dist.replica_slices``); only an owner updates a row and its optimizer
state, so training stays exact. Every spec but ``DataParallel`` takes the option, also
with the offload option (``cache_rows`` / ``cache_fraction``: the owner slice is then the
host block, its cache counts slice rows); docs/fully_sharded_2d.md has the design and
its bytes::

    RowWise(fully_sharded=True)
    TableWise(rank=1, fully_sharded=True)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from torch.distributed.tensor import Shard

from dtrec.placements.layout import Block, chunk_bounds

if TYPE_CHECKING:
    from dtrec.modules.config import EmbeddingBagConfig
    from dtrec.placements.layout import TableLayout


@dataclass(frozen=True, repr=False)
class ReplicaSliceable:
    """The keyword field of specs that may split their shards over the replicas."""

    fully_sharded: bool = field(default=False, kw_only=True)
    """True: each replica holds 1/R of its shard's rows and their optimizer state at rest
    (fully sharded 2D, exact); False: every replica holds the whole shard (exact 2D)."""

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]  # the cache fields' checks
        if not isinstance(self.fully_sharded, bool):
            raise TypeError(
                f"{type(self).__name__}: fully_sharded must be a bool, got {self.fully_sharded!r}"
            )

    def _with_layout_options(self, table: EmbeddingBagConfig, layout: TableLayout) -> TableLayout:
        """``layout`` with the spec's keyword options: its offload cache, then its slices."""
        return self._with_slices(self._with_cache(layout), table)  # type: ignore[attr-defined]

    def _with_slices(self, layout: TableLayout, table: EmbeddingBagConfig) -> TableLayout:
        """``layout`` split over the replicas when ``fully_sharded`` (a row split only)."""
        if not self.fully_sharded:
            return layout
        # offloaded too: the owner slice is the host block, its cache holds slice rows
        # (``cache_capacity`` of the slice's rows, ``sharded.tables.storage``)
        *shard, _replicate = layout.placements
        return replace(layout, placements=(*shard, Shard(0)), replica_sliced=True)

    def __str__(self) -> str:
        return super().__str__() + ("+FS" if self.fully_sharded else "")  # type: ignore[misc]


def replica_slice(block: Block, replica: int, replicas: int) -> Block:
    """The owner slice of ``block`` held by ``replica`` (0..R-1): rows chunked like torch's
    ``Shard(0)`` on the "replicate" axis (uneven allowed, trailing slices may be empty).

    Example: ``replica_slice(Block(0, (10, 15), (0, 4)), 1, 2).rows == (13, 15)``.
    """
    lo, hi = chunk_bounds(block.num_rows, replicas)[replica]
    start = block.rows[0]
    return Block(block.position, (start + lo, start + hi), block.cols)


def slice_starts(num_rows: int, replicas: int) -> list[int]:
    """Block-local first row of each replica's slice, and ``num_rows`` last."""
    return [lo for lo, _ in chunk_bounds(num_rows, replicas)] + [num_rows]
