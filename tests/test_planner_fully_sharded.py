"""The planner prices fully sharded tables: an owner slice's memory, routed rows' bytes."""

from __future__ import annotations

import pytest
from torch import nn

import dtrec
from dtrec.placements import RowWise, TableWise
from dtrec.placements.mesh import ShardAxis
from dtrec.planning.cost_model import UniformIds, table_cost
from dtrec.planning.planner import TableConstraint
from dtrec.planning.step_model import collective_of
from tests.fake_world import fake_world

TOPOLOGY = dtrec.Topology.cpu(memory_per_rank=1e9, batch_size_per_rank=256)


@pytest.mark.parametrize("replicas", [2, 4])
def test_slice_memory_and_routed_bytes(replicas: int) -> None:
    cfg = dtrec.EmbeddingBagConfig("t", 1_000_000, 16, ["f"])
    axis = ShardAxis(2, replicas, None)
    exact = table_cost(cfg, RowWise(), axis, TOPOLOGY)
    sliced = table_cost(cfg, RowWise(fully_sharded=True), axis, TOPOLOGY)
    block = (16 * 4 + 4) * 500_000  # rows x (weight + row-wise Adagrad's sum) per position
    saved = exact.memory - sliced.memory
    touched = UniformIds(1_000_000).unique(2 * 256 * 1.0, 0, 500_000)
    # the block less its slice, less the compact table and its gradient rows
    assert saved == pytest.approx(block * (1 - 1 / replicas) - touched * 16 * 8, rel=1e-6)
    r = replicas
    routed = (r - 1) / r * touched * (16 * 4 + 8) * 2
    assert sliced.replica_bytes == pytest.approx([routed, routed], rel=1e-6)
    # 2/R of exact 2D's sparse sync: the same at R = 2, less beyond
    assert sliced.replica_bytes[0] == pytest.approx(exact.replica_bytes[0] * 2 / r, rel=1e-6)
    assert set(sliced.comm) >= {"replica_slices.fetch", "replica_slices.grads"}
    assert not any(k.startswith("grad_sync") for k in sliced.comm)
    assert collective_of("replica_slices.fetch") == ("replicate", "all_to_all")


def test_a_pinned_fully_sharded_table_fits_where_exact_does_not() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            tables = [dtrec.EmbeddingBagConfig("big", 2_000_000, 32, ["f"])]
            self.sparse = dtrec.EmbeddingBagCollection(tables, device="meta")

    topology = dtrec.Topology.cpu(memory_per_rank=100e6, batch_size_per_rank=64)
    with fake_world(0, 4):
        mesh = dtrec.init_mesh("cpu", 2)
        with pytest.raises(ValueError):
            dtrec.plan(Model(), mesh, {"sparse.big": TableConstraint(types=(RowWise,))},
                       topology=topology)  # fmt: skip
        plan = dtrec.plan(Model(), mesh, {"sparse.big": RowWise(fully_sharded=True)},
                          topology=topology)  # fmt: skip
        assert plan["sparse.big"] == RowWise(fully_sharded=True)
        assert str(plan["sparse.big"]) == "RW+FS"
    assert TableWise(rank=0, fully_sharded=True).fully_sharded
