"""The planner ranks plans as they measure (issue 33): on the 4-rank CPU benchmark's model
(``benchmarks/distributed.py``), the cost the planner minimises orders table-wise,
row-wise, column-wise, data-parallel and 2D row-wise as their measured steps in
``benchmarks/results/distributed_cpu_2026-11-27.json``; its explain states the plan's
predicted step and communication share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.distributed import _row_probs, config_shards, dtrec_spec, table_kinds, workload
from dtrec.modules.config import EmbeddingBagConfig
from dtrec.placements.mesh import ShardAxis
from dtrec.planning.cost_model import Topology, table_cost, totals
from dtrec.planning.dry_run import dry_run

MEASURED = (
    Path(__file__).resolve().parent.parent / "benchmarks/results/distributed_cpu_2026-11-27.json"
)
CONFIGS = ("table_wise", "row_wise", "column_wise", "data_parallel", "2d_row_wise")
NOISE = 0.10
"""Measured steps closer than this (relative) are a tie: either order is right."""


def _predicted_ms(config: str, world: int = 4) -> float:
    """The planner's cost (``totals(...).time``, its slowest position) of a benchmark plan."""
    w = workload()
    shards = config_shards(config, world)
    axis = ShardAxis(shards, world // shards, None)
    topology = Topology.cpu(batch_size_per_rank=w.batch, default_pooling_factor=w.mean_bag)
    costs = [
        table_cost(EmbeddingBagConfig(f"t{i}", w.rows[i], w.dim), dtrec_spec(kind), axis,
                   topology, _row_probs(w.rows[i], w.zipf))
        for i, kind in enumerate(table_kinds(config, shards))
    ]  # fmt: skip
    return 1e3 * float(totals(costs, shards).time(axis, topology).max())


def test_planner_orders_the_cpu_benchmark_plans_as_measured() -> None:
    results = json.loads(MEASURED.read_text())["results"]
    measured = {c: results[c]["dtrec"]["median"]["step_ms"] for c in CONFIGS}
    predicted = {c: _predicted_ms(c) for c in CONFIGS}
    wrong = []
    for a in CONFIGS:
        for b in CONFIGS:
            if measured[a] < measured[b] * (1 - NOISE) and not predicted[a] < predicted[b]:
                wrong.append((a, b))
    assert not wrong, f"measured {measured}, predicted {predicted}: misordered {wrong}"


@pytest.mark.parametrize("world, shards", [(8, 8), (64, 8)])
def test_explain_states_the_predicted_step_and_comm_share(world: int, shards: int) -> None:
    tables = [EmbeddingBagConfig(f"t{i}", r, 64, [f"f{i}"]) for i, r in
              enumerate((10, 1000, 200_000, 3_000_000))]  # fmt: skip
    topology = Topology.h100(batch_size_per_rank=1024, default_pooling_factor=10.0)
    result = dry_run(tables, world, shards, 8, topology, with_explanation=True)
    first = result["explanation"].splitlines()[0]
    assert first.startswith("plan: predicted step ")
    step = float(first.split("predicted step ")[1].split(" ms")[0])
    share = float(first.split(" = ")[1].split(" of it")[0])
    assert step == pytest.approx(1e3 * float(result["time"].max()), rel=1e-3)
    assert 0.0 <= share <= 1.0
