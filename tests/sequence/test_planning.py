"""The planner on sequence tables: output bytes grow with ids (not with the batch), and a
model mixing EmbeddingBagCollection and EmbeddingCollection gets one plan."""

from __future__ import annotations

import pytest
from torch import nn

import dtrec
from dtrec.placements import RowWise, TableWise
from dtrec.placements.mesh import ShardAxis
from dtrec.planning.cost_model import Topology, table_cost
from tests.fake_world import fake_world

AXIS = ShardAxis(size=4, replicas=1, per_node=None)


def _sent(cfg, ids_per_bag: float, kind: str) -> float:
    topology = Topology.cpu(batch_size_per_rank=64, default_pooling_factor=ids_per_bag)
    return float(table_cost(cfg, RowWise(), AXIS, topology).comm[kind].sum())


def test_sequence_output_bytes_grow_with_ids() -> None:
    seq = dtrec.EmbeddingConfig("s", 1000, 16, ["h"])
    bag = dtrec.EmbeddingBagConfig("b", 1000, 16, ["p"])
    assert _sent(seq, 20.0, "sequence_output_dist") == pytest.approx(
        2 * _sent(seq, 10.0, "sequence_output_dist")
    )
    assert _sent(bag, 20.0, "output_dist") == _sent(bag, 10.0, "output_dist")
    # one row per id: 10 ids per sample move 10 rows where a bag moves one partial, but
    # a row-wise block (of 4) returns only the quarter of the ids in its rows
    assert _sent(seq, 10.0, "sequence_output_dist") == pytest.approx(
        10 / 4 * _sent(bag, 10.0, "output_dist")
    )


def test_mixed_model_is_planned() -> None:
    model = nn.Module()
    model.bags = dtrec.EmbeddingBagCollection([dtrec.EmbeddingBagConfig("b", 100, 8, ["p"])])
    model.seq = dtrec.EmbeddingCollection(
        [dtrec.EmbeddingConfig("s0", 100, 8, ["h"]), dtrec.EmbeddingConfig("s1", 50, 4, ["g"])]
    )
    with fake_world(0, 4):
        mesh = dtrec.init_mesh("cpu", 4)
        plan = dtrec.plan(model, mesh, constraints={"seq.s1": TableWise(rank=None)})
    assert sorted(plan) == ["bags.b", "seq.s0", "seq.s1"]
    assert isinstance(plan["seq.s1"], TableWise) and plan["seq.s1"].rank is not None
    assert "seq.s0" in str(plan)  # the report explains sequence tables too
