"""Table sharding specs: tiny frozen values that know how to lay a table out.

Adding a sharding type means adding one class here with a ``layout`` method;
nothing else switches on the type.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

from torch.distributed.tensor import Placement, Replicate, Shard

from dtrec.modules.config import EmbeddingBagConfig
from dtrec.placements.fully_sharded import ReplicaSliceable
from dtrec.placements.layout import Block, TableLayout, chunk_bounds
from dtrec.placements.mesh import SHARD, SHARD_LOCAL, SHARD_NODE, ShardAxis
from dtrec.placements.offload import Offloadable


class TableSpec(ABC):
    """How one table is sharded over the ("shard", "replicate") mesh."""

    short: str = "?"

    @abstractmethod
    def layout(self, table: EmbeddingBagConfig, axis: ShardAxis) -> TableLayout:
        """Placements and blocks of ``table`` on a mesh with this shard axis."""

    def candidates(self, axis: ShardAxis) -> list[TableSpec]:
        """Fully-specified variants the planner may choose among (just self if resolved)."""
        return [self]

    @property
    def resolved(self) -> bool:
        """False while a choice (a rank, a node) is left to the planner."""
        return True

    def __str__(self) -> str:
        return self.short


def _blocks(
    positions: list[int], rows: list[tuple[int, int]], cols: list[tuple[int, int]]
) -> tuple[Block, ...]:
    blocks = (Block(p, r, c) for p, r, c in zip(positions, rows, cols, strict=True))
    return tuple(b for b in blocks if b.numel > 0)


def _need_nodes(spec: TableSpec, table: EmbeddingBagConfig, axis: ShardAxis) -> int:
    if axis.per_node is None:
        raise ValueError(
            f"table {table.name!r}: {spec!r} needs a node-aware mesh; "
            "build it with dtrec.init_mesh(..., node_size=N)"
        )
    return axis.size // axis.per_node


@dataclass(frozen=True)
class DataParallel(TableSpec):
    """Full copy on every rank; each rank looks up its own batch, no input/output comm."""

    short = "DP"

    def layout(self, table: EmbeddingBagConfig, axis: ShardAxis) -> TableLayout:
        full_rows, full_cols = (0, table.num_embeddings), (0, table.embedding_dim)
        return TableLayout(
            positions=tuple(range(axis.size)),
            mesh_shape=(axis.size,),
            mesh_dim_names=(SHARD,),
            placements=(Replicate(), Replicate()),
            blocks=_blocks(
                list(range(axis.size)), [full_rows] * axis.size, [full_cols] * axis.size
            ),
            batch_local=True,
        )


@dataclass(frozen=True, repr=False)
class TableWise(ReplicaSliceable, Offloadable, TableSpec):
    """Whole table on shard position ``rank`` (0..S-1, same in every replica group)."""

    rank: int | None = None

    @property
    def short(self) -> str:  # type: ignore[override]
        return f"TW({self.rank})" if self.rank is not None else "TW(?)"

    @property
    def resolved(self) -> bool:
        return self.rank is not None

    def candidates(self, axis: ShardAxis) -> list[TableSpec]:
        return [self] if self.resolved else [replace(self, rank=i) for i in range(axis.size)]

    def layout(self, table: EmbeddingBagConfig, axis: ShardAxis) -> TableLayout:
        if self.rank is None:
            raise ValueError(
                f"table {table.name!r}: TableWise(rank=None) must be resolved by dtrec.plan "
                "(distribute_module does this) or given a rank"
            )
        if (
            isinstance(self.rank, bool)
            or not isinstance(self.rank, int)
            or not 0 <= self.rank < axis.size
        ):
            raise ValueError(
                f"table {table.name!r}: TableWise(rank={self.rank!r}) is not a position on the "
                f"shard axis (expected 0..{axis.size - 1})"
            )
        return self._with_layout_options(
            table,
            TableLayout(
                positions=(self.rank,),
                mesh_shape=(1,),
                mesh_dim_names=(SHARD,),
                placements=(Replicate(), Replicate()),
                blocks=_blocks(
                    [self.rank], [(0, table.num_embeddings)], [(0, table.embedding_dim)]
                ),
            ),
        )


@dataclass(frozen=True, repr=False)
class RowWise(ReplicaSliceable, Offloadable, TableSpec):
    """Rows split over the whole shard axis (torch chunk semantics; empty shards allowed)."""

    short = "RW"

    def layout(self, table: EmbeddingBagConfig, axis: ShardAxis) -> TableLayout:
        positions = list(range(axis.size))
        return self._with_layout_options(
            table,
            TableLayout(
                positions=tuple(positions),
                mesh_shape=(axis.size,),
                mesh_dim_names=(SHARD,),
                placements=(Shard(0), Replicate()),
                blocks=_blocks(
                    positions,
                    chunk_bounds(table.num_embeddings, axis.size),
                    [(0, table.embedding_dim)] * axis.size,
                ),
            ),
        )


@dataclass(frozen=True, repr=False)
class ColumnWise(ReplicaSliceable, Offloadable, TableSpec):
    """Columns split over the whole shard axis (torch chunk semantics), or over the
    increasing shard positions ``positions`` (a TorchRec planner's column-wise table on
    some of the ranks; their sub-mesh is ``Shard(1)``). Increasing, because torch orders a
    sub-mesh's process group by rank: the first columns are on the lowest position."""

    positions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()  # the cache fields
        if self.positions is not None:  # hashable, and a JSON list reads back alike
            object.__setattr__(self, "positions", tuple(self.positions))

    @property
    def short(self) -> str:  # type: ignore[override]
        if self.positions is None:
            return "CW"
        return f"CW({','.join(str(p) for p in self.positions)})"

    def layout(self, table: EmbeddingBagConfig, axis: ShardAxis) -> TableLayout:
        if self.positions is None:
            if table.embedding_dim < axis.size:
                raise ValueError(
                    f"table {table.name!r}: ColumnWise needs embedding_dim >= shard axis size, "
                    f"got embedding_dim={table.embedding_dim} < {axis.size}; use RowWise() or "
                    "TableWise()"
                )
            positions = list(range(axis.size))
        else:
            positions = list(self.positions)
            valid = all(isinstance(p, int) and not isinstance(p, bool) for p in positions)
            if (
                not positions
                or not valid
                or positions != sorted(set(positions))
                or not 0 <= positions[0] <= positions[-1] < axis.size
            ):
                raise ValueError(
                    f"table {table.name!r}: ColumnWise(positions={self.positions!r}) must name "
                    f"increasing shard positions in 0..{axis.size - 1} (torch orders a "
                    "sub-mesh's process group by rank: the first columns sit on the lowest)"
                )
            if table.embedding_dim < len(positions):
                raise ValueError(
                    f"table {table.name!r}: ColumnWise(positions={self.positions!r}) needs "
                    f"embedding_dim >= {len(positions)} positions, got {table.embedding_dim}"
                )
        return self._with_layout_options(
            table,
            TableLayout(
                positions=tuple(positions),
                mesh_shape=(len(positions),),
                mesh_dim_names=(SHARD,),
                placements=(Shard(1), Replicate()),
                blocks=_blocks(
                    positions,
                    [(0, table.num_embeddings)] * len(positions),
                    chunk_bounds(table.embedding_dim, len(positions)),
                ),
            ),
        )


@dataclass(frozen=True, repr=False)
class TableRowWise(ReplicaSliceable, Offloadable, TableSpec):
    """Table on one node (``node``), rows split over that node's shard positions."""

    node: int | None = None

    @property
    def short(self) -> str:  # type: ignore[override]
        return f"TRW({self.node})" if self.node is not None else "TRW(?)"

    @property
    def resolved(self) -> bool:
        return self.node is not None

    def candidates(self, axis: ShardAxis) -> list[TableSpec]:
        if self.resolved or axis.nodes is None:
            return [self]
        return [replace(self, node=n) for n in range(axis.nodes)]

    def layout(self, table: EmbeddingBagConfig, axis: ShardAxis) -> TableLayout:
        nodes = _need_nodes(self, table, axis)
        if self.node is None:
            raise ValueError(
                f"table {table.name!r}: TableRowWise(node=None) must be resolved by dtrec.plan "
                "(distribute_module does this) or given a node"
            )
        if (
            isinstance(self.node, bool)
            or not isinstance(self.node, int)
            or not 0 <= self.node < nodes
        ):
            raise ValueError(
                f"table {table.name!r}: TableRowWise(node={self.node!r}) is not a node of the "
                f"mesh (expected 0..{nodes - 1})"
            )
        per_node = axis.per_node
        assert per_node is not None
        positions = [self.node * per_node + i for i in range(per_node)]
        return self._with_layout_options(
            table,
            TableLayout(
                positions=tuple(positions),
                mesh_shape=(per_node,),
                mesh_dim_names=(SHARD_LOCAL,),
                placements=(Shard(0), Replicate()),
                blocks=_blocks(
                    positions,
                    chunk_bounds(table.num_embeddings, per_node),
                    [(0, table.embedding_dim)] * per_node,
                ),
            ),
        )


@dataclass(frozen=True, repr=False)
class Grid(ReplicaSliceable, Offloadable, TableSpec):
    """Columns split across nodes, rows split across the shard positions inside a node."""

    short = "GRID"

    def layout(self, table: EmbeddingBagConfig, axis: ShardAxis) -> TableLayout:
        nodes = _need_nodes(self, table, axis)
        if table.embedding_dim < nodes:
            raise ValueError(
                f"table {table.name!r}: Grid needs embedding_dim >= number of nodes, got "
                f"embedding_dim={table.embedding_dim} < {nodes}; use TableRowWise() or RowWise()"
            )
        per_node = axis.per_node
        assert per_node is not None
        col_chunks = chunk_bounds(table.embedding_dim, nodes)
        row_chunks = chunk_bounds(table.num_embeddings, per_node)
        positions = list(range(axis.size))
        placements: tuple[Placement, ...] = (Shard(1), Shard(0), Replicate())
        return self._with_layout_options(
            table,
            TableLayout(
                positions=tuple(positions),
                mesh_shape=(nodes, per_node),
                mesh_dim_names=(SHARD_NODE, SHARD_LOCAL),
                placements=placements,
                blocks=_blocks(
                    positions,
                    [row_chunks[p % per_node] for p in positions],
                    [col_chunks[p // per_node] for p in positions],
                ),
            ),
        )
