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


@pytest.mark.parametrize("rank", range(8))
def test_replicas_across_nodes_w8_s4(rank: int) -> None:
    """TorchRec's ``use_inter_host_allreduce``: sharding groups contiguous, replicas strided."""
    with fake_world(rank, 8):
        mesh = dtrec.init_mesh("cpu", shard_group_size=4, replicas_within_node=False)
        assert mesh.mesh.tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
        assert _groups(mesh, "shard") == [[0, 1, 2, 3], [4, 5, 6, 7]][rank // 4]
        assert _groups(mesh, "replicate") == [rank % 4, rank % 4 + 4]
        assert tuple(mesh.get_coordinate()) == (rank % 4, rank // 4)
        axis = shard_axis(mesh)
        assert (axis.replica_stride, axis.replica_span) == (4, 5)
        assert [axis.rank_of(p, r) for p in range(4) for r in range(2)] == mesh.mesh.flatten(
        ).tolist()  # fmt: skip
        within = shard_axis(dtrec.init_mesh("cpu", shard_group_size=4))
        assert (within.replica_stride, within.replica_span) == (1, 2)


@pytest.mark.parametrize(
    ("world", "shards", "node", "per_node"),
    [(8, 4, 4, 4), (16, 8, 4, 4), (16, 4, 8, 4), (8, 2, 4, 2)],
)
def test_node_split_with_replicas_across_nodes(
    world: int, shards: int, node: int, per_node: int
) -> None:
    with fake_world(world - 1, world):
        mesh = dtrec.init_mesh("cpu", shards, node_size=node, replicas_within_node=False)
        axis = shard_axis(mesh)
        assert (axis.size, axis.replicas, axis.per_node) == (shards, world // shards, per_node)
        assert axis.replica_stride == (shards if world > shards else 1)
        plain = dtrec.init_mesh("cpu", shards, replicas_within_node=False)
        assert mesh.mesh.tolist() == plain.mesh.tolist()
        assert _groups(mesh, "shard") == list(range(world - shards, world))


def test_replicas_across_nodes_bad_node_size() -> None:
    with pytest.raises(ValueError, match="a sharding group either fits in a node"):
        positions_per_node(24, 4, 6, replicas_within_node=False)
    with pytest.raises(TypeError, match="replicas_within_node must be a bool"), fake_world(0, 4):
        dtrec.init_mesh("cpu", 2, replicas_within_node="no")  # type: ignore[arg-type]


def test_cost_model_prices_replica_groups_by_their_links() -> None:
    """The same plan on W=8, S=4, nodes of 4: replicas within a node sync over the intra-node
    links and all-to-all across nodes; replicas across nodes the other way round."""
    import numpy as np

    from dtrec.placements import RowWise
    from dtrec.planning.cost_model import (
        RECEIVED_INTER,
        RECEIVED_INTRA,
        REPLICA,
        node_of_positions,
        step_time,
        table_cost,
    )
    from dtrec.planning.topology import Topology

    topo = Topology(node_size=4, intra_node_bandwidth=400e9, inter_node_bandwidth=50e9)
    cfg = dtrec.EmbeddingBagConfig("t", 1_000_000, 64, ["f"])
    with fake_world(0, 8):
        within = shard_axis(dtrec.init_mesh("cpu", 4))
        across = shard_axis(dtrec.init_mesh("cpu", 4, replicas_within_node=False))
    assert node_of_positions(within, topo).tolist() == [0, 0, 1, 1]
    assert node_of_positions(across, topo).tolist() == [0, 0, 0, 0]
    near, far = table_cost(cfg, RowWise(), within, topo), table_cost(cfg, RowWise(), across, topo)
    assert far.stack[RECEIVED_INTER].sum() == 0 < near.stack[RECEIVED_INTER].sum()
    assert far.stack[RECEIVED_INTRA].sum() > near.stack[RECEIVED_INTRA].sum()
    np.testing.assert_allclose(far.stack[REPLICA], near.stack[REPLICA])  # same bytes
    only_sync = np.zeros_like(near.stack)
    only_sync[REPLICA] = near.stack[REPLICA]
    slow, fast = step_time(only_sync, across, topo), step_time(only_sync, within, topo)
    np.testing.assert_allclose(slow, fast * 8)  # 400 / 50 GB/s


def test_a_hand_made_rank_layout_prices_replicas_as_spanning_the_world() -> None:
    from torch.distributed.device_mesh import DeviceMesh

    with fake_world(0, 8):
        odd = DeviceMesh(
            "cpu", [[0, 3], [1, 2], [4, 7], [5, 6]], mesh_dim_names=("shard", "replicate")
        )
        axis = shard_axis(odd)
    assert (axis.replica_stride, axis.replica_span) == (0, 8)
