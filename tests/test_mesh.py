"""init_mesh: the rank layout DESIGN.md promises, node splits, and its errors."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import dtrec
from dtrec.placements.mesh import positions_per_node, shard_axis
from tests.fake_world import fake_world


def _groups(mesh, dim: str) -> list[int]:
    return dist.get_process_group_ranks(mesh.get_group(dim))


@pytest.mark.parametrize("rank", range(8))
def test_design_example_w8_s4(rank: int) -> None:
    with fake_world(rank, 8):
        mesh = dtrec.init_mesh("cpu", shard_group_size=4)
        assert mesh.mesh_dim_names == ("shard", "replicate")
        assert mesh.mesh.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert _groups(mesh, "shard") == [[0, 2, 4, 6], [1, 3, 5, 7]][rank % 2]
        assert _groups(mesh, "replicate") == [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert tuple(mesh.get_coordinate()) == (rank // 2, rank % 2)


def test_plain_model_parallel_and_data_parallel() -> None:
    with fake_world(3, 4):
        mp = dtrec.init_mesh("cpu", shard_group_size=4)
        assert _groups(mp, "shard") == [0, 1, 2, 3] and _groups(mp, "replicate") == [3]
        dp = dtrec.init_mesh("cpu", shard_group_size=1)
        assert _groups(dp, "shard") == [3] and _groups(dp, "replicate") == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("world", "shards", "node", "per_node"),
    [(8, 4, 4, 2), (8, 8, 4, 4), (8, 2, 2, 1), (16, 4, 8, 2), (8, 4, 8, 4)],
)
def test_node_split(world: int, shards: int, node: int, per_node: int) -> None:
    with fake_world(world - 1, world):
        mesh = dtrec.init_mesh("cpu", shards, node_size=node)
        axis = shard_axis(mesh)
        assert (axis.size, axis.replicas, axis.per_node) == (shards, world // shards, per_node)
        # Same groups as without the node split.
        assert _groups(mesh, "shard") == list(
            range(world - 1 - (shards - 1) * (world // shards), world, world // shards)
        )


def test_node_split_without_node_size_is_none() -> None:
    with fake_world(0, 4):
        assert shard_axis(dtrec.init_mesh("cpu", 2)).per_node is None


def test_world_not_divisible_by_shard_group_size() -> None:
    with (
        fake_world(0, 6),
        pytest.raises(ValueError, match="world size 6 is not divisible by shard_group_size 4"),
    ):
        dtrec.init_mesh("cpu", 4)


def test_bad_node_sizes() -> None:
    with pytest.raises(ValueError, match="not divisible by node_size 3"):
        positions_per_node(8, 4, 3)
    with pytest.raises(ValueError, match="must divide one another"):
        positions_per_node(24, 4, 4)  # R = 6, node 4
    with pytest.raises(TypeError, match="shard_group_size must be an int"), fake_world(0, 4):
        dtrec.init_mesh("cpu", 2.0)  # type: ignore[arg-type]


def test_needs_initialised_world() -> None:
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        dtrec.init_mesh("cpu", 1)
