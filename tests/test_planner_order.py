"""The planner's model ranks plans as they measure (issue 33): on the 4-rank CPU benchmark
(``benchmarks/distributed.py``), the predicted step (``dtrec.planning.plan_step`` on the
cost model, with the constants that run measured: ``meta.cpu_calibration``) orders
table-wise, row-wise, column-wise, data-parallel and 2D row-wise as the same run measured
them, each within 30% of its measured step; a wrong topology does not order them; explain
states the plan's predicted step and communication share. Numbers only: no world, nothing
timed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.distributed import Workload
from benchmarks.distributed_predict import misordered, predict
from dtrec.modules.config import EmbeddingBagConfig
from dtrec.placements import RowWise
from dtrec.placements.mesh import ShardAxis
from dtrec.planning.cost_model import table_cost
from dtrec.planning.dry_run import dry_run
from dtrec.planning.plan_step import plan_step
from dtrec.planning.topology import Topology

MEASURED = (
    Path(__file__).resolve().parent.parent / "benchmarks/results/distributed_cpu_2026-11-29.json"
)
CONFIGS = ("table_wise", "row_wise", "column_wise", "data_parallel", "2d_row_wise")


@pytest.fixture(scope="module")
def committed() -> tuple[Workload, dict, dict[str, float]]:
    report = json.loads(MEASURED.read_text())
    meta = report["meta"]
    w = Workload(**{**meta["workload"], "rows": tuple(meta["workload"]["rows"]),
                    "bag_range": tuple(meta["workload"]["bag_range"])})  # fmt: skip
    measured = {c: report["results"][c]["dtrec"]["median"]["step_ms"] for c in CONFIGS}
    return w, meta["cpu_calibration"], measured


def _predicted(w: Workload, calibration: dict) -> dict[str, float]:
    return {c: 1e3 * predict(w, c, calibration).step for c in CONFIGS}


def test_the_calibrated_model_orders_the_cpu_benchmark_plans_as_measured(committed) -> None:
    w, calibration, measured = committed
    predicted = _predicted(w, calibration)
    wrong = misordered(measured, predicted)
    assert not wrong, f"measured {measured}, predicted {predicted}: misordered {wrong}"


def test_the_calibrated_model_predicts_each_measured_step_within_30_percent(committed) -> None:
    w, calibration, measured = committed
    predicted = _predicted(w, calibration)
    errors = {c: predicted[c] / measured[c] - 1 for c in CONFIGS}
    assert all(abs(e) <= 0.30 for e in errors.values()), errors


@pytest.mark.parametrize(
    "key, factor, flipped",
    [
        ("synced_s_64", 1 / 3, ("row_wise", "column_wise")),  # a synced update 3x faster
        ("latency_s", 10.0, ("2d_row_wise", "data_parallel")),  # calls 10x dearer
    ],
)
def test_a_wrong_topology_misorders_them(committed, key, factor, flipped) -> None:
    """The check can fail: one constant off flips a measured pair."""
    w, calibration, measured = committed
    wrong = {**calibration, key: calibration[key] * factor}
    assert flipped in misordered(measured, _predicted(w, wrong))


@pytest.mark.parametrize("world, shards", [(8, 8), (64, 8)])
def test_explain_states_the_predicted_step_and_comm_share(world: int, shards: int) -> None:
    tables = [EmbeddingBagConfig(f"t{i}", r, 64, [f"f{i}"]) for i, r in
              enumerate((10, 1000, 200_000, 3_000_000))]  # fmt: skip
    topology = Topology.h100(batch_size_per_rank=1024, default_pooling_factor=10.0)
    result = dry_run(tables, world, shards, 8, topology, with_explanation=True)
    lines = result["explanation"].splitlines()
    first = lines[0]
    assert first.startswith("plan: predicted step ")
    step = float(first.split("predicted step ")[1].split(" ms")[0])
    share = float(first.split(" = ")[1].split(" of it")[0])
    assert step == pytest.approx(1e3 * float(result["time"].max()), rel=1e-3)
    assert 0.0 <= share <= 1.0
    candidates = [line for line in lines if line.startswith("  other candidates")]
    assert candidates and all("% comm)" in line for line in candidates if "none" not in line)


def test_a_plan_step_pays_the_latency_once_per_collective_call() -> None:
    """dtrec sends each collective kind in one call for all tables: 2 row-wise tables issue
    as many calls as one (header, ids, output dist forward and backward)."""
    axis = ShardAxis(4, 1, None)
    slow = Topology.cpu(collective_latency=1e-3)
    fast = Topology.cpu()
    costs = [table_cost(EmbeddingBagConfig(f"t{i}", 1000, 16), RowWise(), axis, slow)
             for i in range(2)]  # fmt: skip
    with_latency, without = plan_step(costs, axis, slow), plan_step(costs, axis, fast)
    assert with_latency.calls == plan_step(costs[:1], axis, slow).calls == 4
    assert with_latency.step == pytest.approx(without.step + 4e-3)
    assert with_latency.comm_share > without.comm_share
