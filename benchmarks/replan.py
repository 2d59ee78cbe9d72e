"""Re-plan a running model from the ids it has seen, then ``dtrec.reshard`` it in place,
vs the same move as a DCP save + load round trip.

The distributed benchmark's 8 tables (rows geometric 1e5..1e6 times ``--scale``, D=64,
bags of 10..30 ids Zipf(1.1), fused exact row-wise Adagrad) start on a poor plan, every
table on shard position 0 (``tw:0``). Per rank, in one world:

1. ``--steps`` timed steps on the poor plan, with ``dtrec.IdCounters`` on the model and
   switched on and off every other step (the counters' cost on the step: the medians
   of the steps with and without them);
2. ``dtrec.plan(model, mesh, id_counters=counters)``: the plan from what was counted
   (timed);
3. the round trip a user would do without ``reshard`` (``dtrec.checkpoint.save``,
   distribute a fresh model to the new plan, ``dtrec.checkpoint.load``), timed, with the
   bytes it wrote;
4. ``dtrec.reshard`` of the trained model to the same plan, timed, with the bytes it sent
   (``comm_stats``' ``reshard.rows``), and a check that both ways hold bit-identical
   blocks and fused state;
5. ``--steps`` timed steps of the round trip's model, then of the resharded one (the
   same plan: their step times should match).

``--to-shard-group-size S``: the re-plan targets a new mesh of the same world
(``dtrec.init_mesh("cpu", S)``, e.g. 4 x 1 -> 2 x 2), which the round trip distributes to
and ``reshard(..., mesh=)`` moves the model to (the dense part and its Adagrad state
follow).

    .venv/bin/python -m benchmarks.replan --json benchmarks/results/replan_cpu_<date>.json
    .venv/bin/python -m benchmarks.replan --scale 0.01 --steps 2  # smoke
    .venv/bin/python -m benchmarks.replan --to-shard-group-size 2  # 4 x 1 -> 2 x 2
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common.run_loop import (
    build_dtrec,
    dcp_bytes_written,
    first_step,
    peak_rss_mb,
    quiet,
)
from benchmarks.common.workloads import Workload, workload
from benchmarks.probes.report import dtrec_source, write_report
from tests.multiprocess import WorldError, run_world

START = "tw:0"
"""Every table's spec on the poor plan: all on shard position 0."""


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _step_times(model, optimizers, w: Workload, rank: int, steps: int) -> list[float]:
    import dtrec

    return [
        _timed(lambda: first_step(model, optimizers, dtrec.KeyedJaggedTensor, w, rank))
        for _ in range(steps)
    ]


def _same_blocks(a, b) -> bool:
    """Whether two models on the same plan hold bit-identical local blocks and fused state."""
    ta, tb = a.ebc, b.ebc
    for name, table in ta.embedding_bags.items():
        if not torch.equal(table.weight.to_local(), tb.embedding_bags[name].weight.to_local()):
            return False
    sa, sb = ta.fused_optimizer_state(), tb.fused_optimizer_state()
    return all(torch.equal(sa[t][k], sb[t][k]) for t in sa for k in sa[t])


def _counted_step_times(model, optimizers, w: Workload, rank: int, steps: int, counters):
    """Step times with the counters on and off, alternating (so drift hits both alike)."""
    on, off = [], []
    for i in range(2 * steps):
        counters.enabled = i % 2 == 0
        (on if counters.enabled else off).extend(_step_times(model, optimizers, w, rank, 1))
    counters.enabled = True
    return on, off


def run_rank(rank: int, world: int, w: Workload, opts: dict) -> dict:
    import dtrec
    from dtrec.checkpoint import dcp as checkpoint

    quiet()
    torch.manual_seed(0)
    n = len(w.rows)
    model, optimizers, _, _, _ = build_dtrec(w, [START] * n, world)
    counters = dtrec.IdCounters(model)
    counted, before = _counted_step_times(model, optimizers, w, rank, opts["steps"], counters)
    found: list = []
    shards = opts.get("to_shard_group_size") or world
    mesh = model.ebc.mesh if shards == world else dtrec.init_mesh("cpu", shards)
    plan_s = _timed(lambda: found.append(dtrec.plan(model, mesh, id_counters=counters)))
    counters.remove()
    target = dict(found[0])

    root = Path(opts["root"])
    published: list[Path] = []
    fresh: list = []

    def round_trip() -> None:
        published.append(checkpoint.save(root, model))
        torch.manual_seed(0)
        other, other_optimizers, _, _, _ = build_dtrec(w, [], shards, specs=target)
        checkpoint.load(published[0], other)
        fresh.extend([other, other_optimizers])

    round_trip_s = _timed(round_trip)
    written = dcp_bytes_written(published[0], rank)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(published[0])
    with dtrec.comm_stats() as stats:
        moves = {} if mesh is model.ebc.mesh else {"mesh": mesh, "optimizers": optimizers}
        reshard_s = _timed(lambda: dtrec.reshard(model, target, **moves))
    same = _same_blocks(model, fresh[0])
    direct = _step_times(fresh[0], fresh[1], w, rank, opts["steps"])
    del fresh[:]
    after = _step_times(model, optimizers, w, rank, opts["steps"])
    return {
        "rank": rank,
        "mesh_after": list(mesh.mesh.shape),
        "plan": {key: str(spec) for key, spec in target.items()},
        "step_before_s": statistics.median(before),
        "step_counted_s": statistics.median(counted),
        "step_after_s": statistics.median(after),
        "step_direct_s": statistics.median(direct),
        "plan_s": plan_s,
        "reshard_s": reshard_s,
        "reshard_bytes_sent": stats.bytes_sent.get("reshard.rows", 0),
        "round_trip_s": round_trip_s,
        "round_trip_bytes_written": written,
        "same_as_round_trip": same,
        "peak_rss_mb": peak_rss_mb(),
    }


def run(w: Workload, opts: dict, world: int) -> dict:
    start = time.perf_counter()
    try:
        ranks = run_world(world, run_rank, w, opts, timeout=opts["timeout"], collective_timeout=600)
    except WorldError as exc:
        return {
            "status": "failed",
            "error": str(exc)[-4000:],
            "wall_s": time.perf_counter() - start,
        }

    def med(key: str) -> float:
        return statistics.median(r[key] for r in ranks)

    return {
        "status": "ok",
        "wall_s": time.perf_counter() - start,
        "plan": ranks[0]["plan"],
        "mesh_after": ranks[0]["mesh_after"],
        "same_plan_on_every_rank": all(r["plan"] == ranks[0]["plan"] for r in ranks),
        "step_before_s": med("step_before_s"),
        "step_counted_s": med("step_counted_s"),
        "counter_overhead": med("step_counted_s") / med("step_before_s") - 1.0,
        "plan_s": max(r["plan_s"] for r in ranks),
        "step_after_s": med("step_after_s"),
        "step_direct_s": med("step_direct_s"),
        "reshard_s": max(r["reshard_s"] for r in ranks),
        "reshard_bytes_sent": sum(r["reshard_bytes_sent"] for r in ranks),
        "round_trip_s": max(r["round_trip_s"] for r in ranks),
        "round_trip_bytes_written": sum(r["round_trip_bytes_written"] for r in ranks),
        "same_as_round_trip": all(r["same_as_round_trip"] for r in ranks),
        "ranks": ranks,
    }


def print_result(result: dict) -> None:
    if result["status"] != "ok":
        print(f"failed: {result['error'].splitlines()[-1][:200]}")
        return
    r = result
    shape = " x ".join(str(n) for n in r["mesh_after"])
    print(f"re-planned from the counted ids in {r['plan_s']:.2f} s, on {shape}: {r['plan']}")
    print(
        f"id counters: step {r['step_counted_s'] * 1e3:.1f} ms with, "
        f"{r['step_before_s'] * 1e3:.1f} ms without ({100 * r['counter_overhead']:+.1f}%)"
    )
    print(
        f"step before {r['step_before_s'] * 1e3:.1f} ms, after {r['step_after_s'] * 1e3:.1f} ms "
        f"(distributed to the new plan directly: {r['step_direct_s'] * 1e3:.1f} ms)"
    )
    print(
        f"reshard    {r['reshard_s']:.3f} s, {r['reshard_bytes_sent'] / 1e6:.2f} MB sent\n"
        f"round trip {r['round_trip_s']:.3f} s, {r['round_trip_bytes_written'] / 1e6:.2f} MB "
        f"written (and read back)\n"
        f"same blocks and state both ways: {r['same_as_round_trip']}"
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.3, help="multiplies table rows")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps before and after")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument(
        "--to-shard-group-size",
        type=int,
        help="re-plan onto a new mesh with this shard group size (default: the same mesh)",
    )
    parser.add_argument("--dir", help="where the checkpoint goes (default: a temporary one)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args(argv)
    w = workload(args.scale, batch=args.batch)
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="dtrec_replan_bench_"))
    opts = {
        "steps": args.steps,
        "timeout": args.timeout,
        "root": str(workdir),
        "to_shard_group_size": args.to_shard_group_size,
    }
    try:
        result = run(w, opts, args.world_size)
    finally:
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    print_result(result)
    if args.json:
        import datetime

        write_report(
            args.json,
            {
                "meta": {
                    "date": datetime.date.today().isoformat(),
                    "command": " ".join(["python -m benchmarks.replan", *argv]),
                    "torch": torch.__version__,
                    "python": platform.python_version(),
                    "cpu_cores": os.cpu_count(),
                    "dtrec": dtrec_source(),
                    "rows": list(w.rows),
                    "dim": w.dim,
                    "start": START,
                    "target": "dtrec.plan(model, mesh, id_counters=counters) after the "
                    "steps before",
                    "timing": "step: median over steps, then over ranks (before and with "
                    "counters: alternating steps); plan, reshard and round trip: the slowest "
                    "rank (barriers before and after)",
                },
                "result": result,
            },
        )


if __name__ == "__main__":
    main()
