"""The planner: planning time at scale, predicted vs measured step time, vs TorchRec's planner.

1. Planning time of ``python -m dtrec.planner``'s dry run (mesh on the fake process group,
   cost model, greedy + local search) for 26, 100, 300 and 1000 random tables (rows
   log-uniform 1e3..5e6, D in {32, 64, 128}, pooling factors in {1, 5, 20, 80}) at W in
   {8, 64, 512, 4096}, S = min(W, 64), nodes of 8: wall and CPU seconds. Target (issue
   46): 4096 ranks x 1000 tables in at most 25 s on a quiet machine.
2. Predicted vs measured: the distributed benchmark's model (8 tables, Zipf ids) on 4 gloo
   ranks under all table-wise, all row-wise, all column-wise and dtrec's planner's plan
   for ``Topology.cpu()``. Every pair of plans the cost model tells apart (predictions
   more than 5% apart, with the benchmark's Zipf id distribution) should be ordered as
   the measured median step times are; the JSON lists the pairs that are not.
3. TorchRec's ``EmbeddingShardingPlanner`` (when installed) on the same 8 tables: planning
   time next to dtrec's, and its plan predicted and measured the same way.

    .venv/bin/python -m benchmarks.planner --json benchmarks/results/planner_cpu_<date>.json
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time

import torch

from benchmarks.common.run_loop import run_config
from benchmarks.common.workloads import (
    EPS,
    LR,
    dtrec_spec,
    row_probs,
    table_kinds,
    workload,
)
from benchmarks.probes.machine import processor
from benchmarks.probes.report import dtrec_source, write_report
from dtrec.modules.config import EmbeddingBagConfig
from dtrec.placements import ColumnWise, DataParallel, RowWise, TableSpec, TableWise
from dtrec.placements.mesh import ShardAxis
from dtrec.planning.cost_model import Topology, table_cost, totals
from dtrec.planning.dry_run import dry_run
from dtrec.planning.planner import plan_tables

WORLDS = (8, 64, 512, 4096)
TIE = 0.05  # predictions closer than this are a tie for the ordering check


def random_tables(count: int, seed: int = 0) -> tuple[list[EmbeddingBagConfig], dict[str, float]]:
    rng = random.Random(seed)
    tables = [
        EmbeddingBagConfig(f"t{i}", int(10 ** rng.uniform(3, 6.7)), rng.choice([32, 64, 128]))
        for i in range(count)
    ]
    return tables, {f"t{i}": float(rng.choice([1, 5, 20, 80])) for i in range(count)}


def planning_times(counts: list[int]) -> list[dict]:
    """Plan time per (tables, W): wall seconds and the process's CPU seconds (what a busy
    machine inflates least)."""
    out = []
    for count in counts:
        out += [_plan_time(count, world) for world in WORLDS]
    return out


def _plan_time(count: int, world: int) -> dict:
    tables, pooling = random_tables(count)
    shards = min(world, 64)
    topology = Topology.h100(node_size=8, pooling_factors=pooling)
    cpu = time.process_time()
    result = dry_run(tables, world, shards, 8, topology)
    row = {
        "W": world,
        "S": shards,
        "tables": count,
        "plan_seconds": result["plan_seconds"],
        "plan_cpu_seconds": time.process_time() - cpu,
        "mesh_seconds": result["mesh_seconds"],
        "predicted_ms": 1e3 * float(result["time"].max()),
        "types": _type_counts(result["plan"].values()),
    }
    print(f"W={world:5d} S={shards:3d}: planned {count:4d} tables in {row['plan_seconds']:.1f} s "
          f"({row['plan_cpu_seconds']:.1f} s CPU)", flush=True)  # fmt: skip
    return row


def _type_counts(specs) -> dict[str, int]:
    counts: dict[str, int] = {}
    for spec in specs:
        counts[type(spec).__name__] = counts.get(type(spec).__name__, 0) + 1
    return counts


def _kind(spec: TableSpec) -> str:
    if isinstance(spec, TableWise):
        return f"tw:{spec.rank}"
    names = {RowWise: "rw", ColumnWise: "cw", DataParallel: "dp"}
    if type(spec) not in names:
        raise ValueError(f"no benchmark kind for {spec}")
    return names[type(spec)]


def predicted_ms(kinds: list[str], world: int) -> float:
    w = workload()
    axis = ShardAxis(world, 1, None)
    topology = Topology.cpu(batch_size_per_rank=w.batch, default_pooling_factor=w.mean_bag)
    costs = [
        table_cost(
            EmbeddingBagConfig(f"t{i}", w.rows[i], w.dim), dtrec_spec(k), axis, topology,
            row_probs(w.rows[i], w.zipf),
        )
        for i, k in enumerate(kinds)
    ]  # fmt: skip
    return 1e3 * float(totals(costs, world).time(axis, topology).max())


def compare_plans(world: int, steps: int, with_torchrec: bool) -> dict:
    w = workload()
    axis = ShardAxis(world, 1, None)
    topology = Topology.cpu(batch_size_per_rank=w.batch, default_pooling_factor=w.mean_bag)
    cfgs = {f"t{i}": EmbeddingBagConfig(f"t{i}", r, w.dim) for i, r in enumerate(w.rows)}
    start = time.perf_counter()
    choices, _ = plan_tables(cfgs, axis, None, topology)
    dtrec_seconds = time.perf_counter() - start
    plans = {name: table_kinds(name, world) for name in ("table_wise", "row_wise", "column_wise")}
    plans["dtrec_planner"] = [_kind(choices[f"t{i}"].spec) for i in range(len(w.rows))]
    report: dict = {"dtrec_planning_seconds": dtrec_seconds}
    if with_torchrec:
        from benchmarks.common.torchrec_side import torchrec_planner_kinds

        kinds, seconds = torchrec_planner_kinds(w.rows, w.dim, world, w.batch, w.mean_bag, LR, EPS)
        plans["torchrec_planner"] = kinds
        report["torchrec_planning_seconds"] = seconds
    opts = {"steps": steps, "warmup": 2, "census_steps": 1, "timeout": 600.0}
    runs = {}
    for name, kinds in plans.items():
        run = run_config("dtrec", "table_wise", w, {**opts, "kinds": kinds}, world)
        runs[name] = {
            "kinds": kinds,
            "predicted_ms": predicted_ms(kinds, world),
            "measured_ms": run["median"]["step_ms"] if run["status"] == "ok" else None,
            "status": run["status"],
        }
        print(f"{name}: predicted {runs[name]['predicted_ms']:.2f} ms, measured "
              f"{runs[name]['measured_ms']} ms  {kinds}", flush=True)  # fmt: skip
    ok = {k: v for k, v in runs.items() if v["measured_ms"] is not None}
    # Pairs the model tells apart (predictions > TIE apart) must be ordered alike.
    pairs = [(a, b) for a in ok for b in ok if a < b]
    told = [
        (a, b) for a, b in pairs if abs(ok[a]["predicted_ms"] / ok[b]["predicted_ms"] - 1) > TIE
    ]
    agree = [
        (a, b)
        for a, b in told
        if (ok[a]["predicted_ms"] < ok[b]["predicted_ms"])
        == (ok[a]["measured_ms"] < ok[b]["measured_ms"])
    ]
    report.update(
        plans=runs,
        order_predicted=sorted(ok, key=lambda k: ok[k]["predicted_ms"]),
        order_measured=sorted(ok, key=lambda k: ok[k]["measured_ms"]),
        pairs_told_apart=len(told),
        pairs_ordered_alike=len(agree),
        pairs_disagreeing=[p for p in told if p not in agree],
    )
    return report


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tables", type=int, nargs="+", default=[26, 100, 300, 1000],
        help="table counts of the plan-time rows (each at W 8 .. 4096)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=10, help="timed steps per measured plan")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--no-torchrec", action="store_true")
    parser.add_argument("--skip-measured", action="store_true", help="planning times only")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    report: dict = {
        "meta": {
            "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(["python -m benchmarks.planner", *argv]),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu_cores": os.cpu_count(),
            "dtrec": dtrec_source(),
        },
        "processor": processor(),
        "planning": planning_times(args.tables),
    }
    if not args.skip_measured:
        report["plans"] = compare_plans(args.world_size, args.steps, not args.no_torchrec)
        r = report["plans"]
        print(f"order predicted {r['order_predicted']}\norder measured  {r['order_measured']}")
        print(f"pairs the model tells apart: {r['pairs_told_apart']}, ordered alike: "
              f"{r['pairs_ordered_alike']}, disagreeing: {r['pairs_disagreeing']}")  # fmt: skip
    if args.json:
        write_report(args.json, report)


if __name__ == "__main__":
    main()
