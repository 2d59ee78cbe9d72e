"""Shard metadata: where each block of a table lives on the "shard" axis.

A spec turns (table, mesh) into a ``TableLayout``: the shard positions that
hold the table, the torch placements on their sub-mesh, and the blocks. Every
later stage (input-dist, lookup, output-dist, checkpoints, planner) reads the
blocks instead of switching on the sharding type.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Placement


def chunk_bounds(size: int, parts: int) -> list[tuple[int, int]]:
    """``torch.chunk`` boundaries, padded with empty chunks (DTensor's Shard semantics).

    Example: ``chunk_bounds(5, 4) == [(0, 2), (2, 4), (4, 5), (5, 5)]``.
    """
    step = -(-size // parts) if parts else 0
    return [(min(i * step, size), min((i + 1) * step, size)) for i in range(parts)]


@dataclass(frozen=True)
class Block:
    """A rectangle of a table stored at one shard-axis position (on all its replicas)."""

    position: int
    """Coordinate on the "shard" mesh axis."""
    rows: tuple[int, int]
    """Row range [start, end) of the global table."""
    cols: tuple[int, int]
    """Column range [start, end)."""

    @property
    def num_rows(self) -> int:
        return self.rows[1] - self.rows[0]

    @property
    def num_cols(self) -> int:
        return self.cols[1] - self.cols[0]

    @property
    def numel(self) -> int:
        return self.num_rows * self.num_cols


@dataclass(frozen=True)
class TableLayout:
    """How one table sits on the mesh."""

    positions: tuple[int, ...]
    """Shard-axis positions of the table's sub-mesh, in sub-mesh order."""
    mesh_shape: tuple[int, ...]
    """How ``positions`` fold into sub-mesh dims (the replicate axis is appended)."""
    mesh_dim_names: tuple[str, ...]
    """Names of those dims (without "replicate")."""
    placements: tuple[Placement, ...]
    """torch placements, one per sub-mesh dim including "replicate"."""
    blocks: tuple[Block, ...]
    """Non-empty blocks; together they cover the table once (per batch-owner, see batch_local)."""
    batch_local: bool = False
    """Data parallel: every rank looks up its own batch in its own full copy, so ids are
    not routed and gradients are summed over the whole world instead of the "replicate"
    axis. Set by the spec; the sharded engine reads it once (``Routing.data_parallel_tables``)."""
    cache_rows: tuple[int, ...] = ()
    """Offloaded tables (``dtrec.placements.offload``): per block (``blocks`` order), the
    rows of its device cache; the blocks themselves live in host memory. Empty: every
    block lives on the device."""
    replica_sliced: bool = False
    """Fully sharded 2D (``dtrec.placements.fully_sharded``): each block's rows are split
    over the "replicate" axis, every replica holding one owner slice at rest (the last
    placement is ``Shard(0)``). ``blocks`` still name whole shards: what ids route to."""

    @property
    def offloaded(self) -> bool:
        """Whether the blocks live in host memory behind device caches."""
        return bool(self.cache_rows)

    def cache_rows_at(self, position: int) -> int | None:
        """Device cache rows of the block at ``position`` (None: on the device, or no block)."""
        for block, rows in zip(self.blocks, self.cache_rows, strict=False):
            if block.position == position:
                return rows
        return None

    def block_at(self, position: int) -> Block | None:
        """The block stored at ``position`` (specs put at most one per position)."""
        for block in self.blocks:
            if block.position == position:
                return block
        return None
