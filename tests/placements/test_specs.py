"""Specs -> layouts: blocks tile each table once and agree with DTensor's own sharding."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import dtrec
from dtrec.placements import (
    ColumnWise,
    DataParallel,
    Grid,
    RowWise,
    TableRowWise,
    TableWise,
    chunk_bounds,
)
from dtrec.placements.mesh import ShardAxis
from dtrec.sharded.tables.tensor import table_mesh
from tests.fake_world import fake_world

ALL_SPECS = [
    DataParallel(),
    TableWise(rank=1),
    RowWise(),
    ColumnWise(),
    ColumnWise(positions=(1, 3)),
    TableRowWise(node=1),
    Grid(),
]


def test_chunk_bounds_follow_torch_chunk() -> None:
    assert chunk_bounds(5, 4) == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert chunk_bounds(3, 4) == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert chunk_bounds(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    for n in range(0, 20):
        for k in range(1, 6):
            sizes = [e - s for s, e in chunk_bounds(n, k)]
            torch_sizes = [c.shape[0] for c in torch.empty(n).chunk(k)]
            assert sizes[: len(torch_sizes)] == torch_sizes and sum(sizes) == n


def test_specs_are_small_values() -> None:
    assert repr(TableWise(rank=3)) == "TableWise(rank=3)" and str(TableWise(rank=3)) == "TW(3)"
    assert str(RowWise()) == "RW" and str(ColumnWise()) == "CW" and str(DataParallel()) == "DP"
    assert RowWise() == RowWise() and hash(TableWise(rank=1)) == hash(TableWise(rank=1))
    with pytest.raises(AttributeError):  # frozen
        TableWise(rank=1).rank = 2  # type: ignore[misc]


@pytest.mark.parametrize("spec", ALL_SPECS, ids=str)
@pytest.mark.parametrize(("rows", "dim"), [(10, 8), (3, 5), (97, 7), (1, 4)])
def test_blocks_tile_the_table_once(spec, rows: int, dim: int) -> None:
    axis = ShardAxis(size=4, replicas=2, per_node=2)
    layout = spec.layout(dtrec.EmbeddingBagConfig("t", rows, dim), axis)
    cover = torch.zeros(rows, dim, dtype=torch.int64)
    for block in layout.blocks:
        cover[block.rows[0] : block.rows[1], block.cols[0] : block.cols[1]] += 1
    copies = axis.size if layout.batch_local else 1
    assert torch.all(cover == copies)
    assert len({b.position for b in layout.blocks}) == len(layout.blocks)


@pytest.mark.parametrize(("world", "shards", "node"), [(8, 4, 4), (8, 2, 2), (4, 4, 2)])
def test_blocks_match_dtensor_local_shards(world: int, shards: int, node: int) -> None:
    """The metadata every stage uses is exactly what DTensor stores on each rank."""
    table = dtrec.EmbeddingBagConfig("t", 11, 6)
    specs = [
        DataParallel(),
        TableWise(rank=shards - 1),
        RowWise(),
        ColumnWise(),
        TableRowWise(node=0),
        Grid(),
    ]
    for rank in range(world):
        with fake_world(rank, world):
            mesh = dtrec.init_mesh("cpu", shards, node_size=node)
            axis = dtrec.placements.mesh.shard_axis(mesh)
            position = rank // (world // shards)
            for spec in specs:
                layout = spec.layout(table, axis)
                sub = table_mesh(mesh, layout)
                shape, offset = compute_local_shape_and_global_offset(
                    (11, 6), sub, list(layout.placements)
                )
                block = layout.block_at(position)
                if sub.get_coordinate() is None or 0 in shape:
                    assert block is None, (spec, rank)
                    continue
                assert block is not None, (spec, rank)
                assert (tuple(shape), tuple(offset)) == (
                    (block.num_rows, block.num_cols),
                    (block.rows[0], block.cols[0]),
                ), (spec, rank)


def test_unresolved_and_invalid_specs_name_the_table() -> None:
    axis = ShardAxis(size=4, replicas=1, per_node=None)
    narrow = dtrec.EmbeddingBagConfig("narrow", 100, 3)
    with pytest.raises(ValueError, match="'narrow'.*ColumnWise.*embedding_dim=3 < 4.*RowWise"):
        ColumnWise().layout(narrow, axis)
    with pytest.raises(ValueError, match="'narrow'.*TableWise\\(rank=None\\)"):
        TableWise().layout(narrow, axis)
    with pytest.raises(ValueError, match="'narrow'.*TableWise\\(rank=4\\).*0..3"):
        TableWise(rank=4).layout(narrow, axis)
    with pytest.raises(ValueError, match="'narrow'.*node-aware mesh"):
        Grid().layout(narrow, axis)
    with pytest.raises(ValueError, match="'narrow'.*TableRowWise\\(node=2\\)"):
        TableRowWise(node=2).layout(narrow, ShardAxis(4, 1, 2))
    with pytest.raises(ValueError, match="'narrow'.*Grid needs embedding_dim >= number of nodes"):
        Grid().layout(narrow, ShardAxis(8, 1, 2))


def test_degenerate_node_specs() -> None:
    """One shard position per node: TRW is table-wise on that node, Grid column-wise."""
    axis = ShardAxis(size=4, replicas=2, per_node=1)
    table = dtrec.EmbeddingBagConfig("t", 10, 8)
    assert (
        TableRowWise(node=2).layout(table, axis).blocks
        == TableWise(rank=2).layout(table, axis).blocks
    )
    assert Grid().layout(table, axis).blocks == ColumnWise().layout(table, axis).blocks


def test_candidates_enumerate_open_choices() -> None:
    axis = ShardAxis(size=3, replicas=1, per_node=1)
    assert TableWise().candidates(axis) == [TableWise(rank=i) for i in range(3)]
    assert TableRowWise().candidates(axis) == [TableRowWise(node=i) for i in range(3)]
    assert RowWise().candidates(axis) == [RowWise()]


def test_column_wise_over_some_positions() -> None:
    """``ColumnWise(positions=...)``: chunked columns on increasing positions (a sub-mesh);
    a JSON list reads back as the same (hashable) spec."""
    from torch.distributed.tensor import Replicate, Shard

    from dtrec.planning.plan import ShardingPlan

    table = dtrec.EmbeddingBagConfig("t", 10, 7, ["f"])
    layout = ColumnWise(positions=(1, 3)).layout(table, ShardAxis(4, 2, None))
    assert layout.positions == (1, 3) and layout.mesh_shape == (2,)
    assert [(b.position, b.cols) for b in layout.blocks] == [(1, (0, 4)), (3, (4, 7))]
    assert layout.placements == (Shard(1), Replicate())
    assert ColumnWise(positions=[1, 3]) == ColumnWise(positions=(1, 3))
    assert hash(ColumnWise(positions=[1, 3])) == hash(ColumnWise(positions=(1, 3)))
    plan = ShardingPlan({"s.t": ColumnWise(positions=(1, 3))})
    assert ShardingPlan.from_json(plan.to_json()) == plan
    for bad in ((3, 1), (1, 1), (), (0, 4)):
        with pytest.raises(ValueError, match="must name increasing shard positions in 0..3"):
            ColumnWise(positions=bad).layout(table, ShardAxis(4, 2, None))
