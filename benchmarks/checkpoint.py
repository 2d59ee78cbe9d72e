"""Checkpoint save/load: dtrec vs TorchRec's own DCP checkpoint of the equivalent model.

Model: the distributed benchmark's 8 tables (rows geometric 1e5..1e6 times ``--scale``,
D=64, fp32; ``--scale 1.3`` is ~1 GB of tables) with fused exact row-wise Adagrad, and
its MLP. Configs: ``mixed`` (t0-t1 DP, t2-t3 TW, t4-t5 CW, t6-t7 RW on S=W) and
``2d_mixed`` (the same on S=W/2, R=2: replicas hold the same blocks, which must be
written once). dtrec: ``dtrec.checkpoint.save`` / ``load`` (DCP + atomic publish +
staged, validated load). TorchRec: ``torch.distributed.checkpoint.save`` / ``load`` of
``{"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}`` (ShardedTensors,
loaded in place). Both take one training step first so every optimizer state exists.

Per rank: save and load seconds (median over ``--repeats``, a barrier before each,
outside the timing; dtrec's load also with ``staged=False``, in place like TorchRec's)
and bytes written (its ``__<rank>_*.distcp`` files). Reported with
the unique bytes of the state (every table, fused state and dense parameter once).

    .venv/bin/python -m benchmarks.checkpoint --json benchmarks/results/checkpoint_cpu_<date>.json
    .venv/bin/python -m benchmarks.checkpoint --scale 0.01 --repeats 1 --no-torchrec  # smoke
"""

from __future__ import annotations

import argparse
import functools
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

from benchmarks.common.report import ratio
from benchmarks.common.run_loop import (
    build_dtrec,
    dcp_bytes_written,
    first_step,
    peak_rss_mb,
    quiet,
)
from benchmarks.common.workloads import Workload, config_shards, table_kinds, workload
from benchmarks.probes.report import dtrec_source, write_report
from tests.multiprocess import WorldError, run_world

CONFIGS = ("mixed", "2d_mixed")


def unique_bytes(w: Workload) -> dict[str, int]:
    """Bytes of the state with nothing counted twice (fp32 tables, one Adagrad sum per row)."""
    rows = sum(w.rows)
    dense = (len(w.rows) * w.dim * 64 + 64) + (64 + 1)
    return {"tables": 4 * rows * w.dim, "fused_state": 4 * rows, "dense": 4 * dense}


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_rank(rank: int, world: int, lib: str, config: str, w: Workload, opts: dict) -> dict:
    """Build, one step, then ``repeats`` x (save, load); seconds and bytes of this rank."""
    quiet()
    torch.manual_seed(0)
    shards = config_shards(config, world)
    kinds = table_kinds(config, shards, len(w.rows))
    if lib == "dtrec":
        build = build_dtrec
    else:
        from benchmarks.common.torchrec_side import build_torchrec as build
    model, optimizers, _, _, kjt_type = build(w, kinds, shards)
    first_step(model, optimizers, kjt_type, w, rank)
    root = Path(opts["root"]) / f"{lib}_{config}"
    saves, loads, in_place, written = [], [], [], []
    for i in range(opts["repeats"]):
        if lib == "dtrec":
            from dtrec.checkpoint import dcp as checkpoint

            published: list[Path] = []
            save = functools.partial(checkpoint.save, root, model)
            saves.append(_timed(lambda out=published, save=save: out.append(save())))
            directory = published[0]
            loads.append(_timed(lambda d=directory: checkpoint.load(d, model)))
            in_place.append(_timed(lambda d=directory: checkpoint.load(d, model, staged=False)))
        else:
            import torch.distributed.checkpoint as dcp

            directory = root / f"ckpt-{i}"
            state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
            saves.append(_timed(lambda d=directory, s=state: dcp.save(s, checkpoint_id=d)))
            loads.append(_timed(lambda d=directory, s=state: dcp.load(s, checkpoint_id=d)))
        dist.barrier()
        written.append(dcp_bytes_written(directory, rank))
        metadata = (directory / ".metadata").stat().st_size if rank == 0 else 0
        dist.barrier()
        if rank == 0:
            shutil.rmtree(directory)  # outside the timing, for both libraries
    return {
        "rank": rank,
        "save_s": saves,
        "load_s": loads,
        "load_in_place_s": in_place,
        "bytes_written": written[-1],
        "metadata_bytes": metadata,
        "peak_rss_mb": peak_rss_mb(),
    }


def run_config(lib: str, config: str, w: Workload, opts: dict, world: int) -> dict:
    start = time.perf_counter()
    try:
        ranks = run_world(
            world, run_rank, lib, config, w, opts, timeout=opts["timeout"], collective_timeout=600
        )
    except WorldError as exc:
        return {
            "status": "failed",
            "error": str(exc)[-4000:],
            "wall_s": time.perf_counter() - start,
        }
    total = sum(r["bytes_written"] for r in ranks) + ranks[0]["metadata_bytes"]
    return {
        "status": "ok",
        "wall_s": time.perf_counter() - start,
        "save_s": statistics.median(statistics.median(r["save_s"]) for r in ranks),
        "load_s": statistics.median(statistics.median(r["load_s"]) for r in ranks),
        "load_in_place_s": statistics.median(
            statistics.median(r["load_in_place_s"] or [0.0]) for r in ranks
        ),
        "bytes_written_per_rank": [r["bytes_written"] for r in ranks],
        "bytes_written_total": total,
        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in ranks),
        "ranks": ranks,
    }


def print_table(results: dict, unique: int) -> None:
    print(f"\nunique state bytes: {unique / 1e6:.1f} MB")
    head = (
        f"{'config':<10} {'lib':<9} {'save s':>8} {'load s':>8} {'written MB':>11} {'/unique':>8}"
    )
    print(head + "  per rank MB")
    print("-" * (len(head) + 14))
    for config, libs in results.items():
        for lib, run in libs.items():
            if run["status"] != "ok":
                print(f"{config:<10} {lib:<9} failed: {run['error'].splitlines()[-1][:80]}")
                continue
            per = " ".join(f"{b / 1e6:.0f}" for b in run["bytes_written_per_rank"])
            print(
                f"{config:<10} {lib:<9} {run['save_s']:8.2f} {run['load_s']:8.2f} "
                f"{run['bytes_written_total'] / 1e6:11.1f} "
                f"{run['bytes_written_total'] / unique:8.3f}  {per}"
            )
        d, t = libs.get("dtrec", {}), libs.get("torchrec", {})
        if d.get("status") == "ok":
            print(f"{config:<10} dtrec load with staged=False: {d['load_in_place_s']:.2f} s")
        if d.get("status") == t.get("status") == "ok":
            print(
                f"{config:<10} dtrec/TorchRec: save {ratio(d['save_s'], t['save_s'])}, "
                f"load {ratio(d['load_s'], t['load_s'])} "
                f"(staged=False {ratio(d['load_in_place_s'], t['load_s'])}), "
                f"bytes {ratio(d['bytes_written_total'], t['bytes_written_total'])}"
            )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.3, help="multiplies table rows")
    parser.add_argument("--repeats", type=int, default=3, help="save + load rounds per run")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"of {CONFIGS}")
    parser.add_argument("--no-torchrec", action="store_true", help="run dtrec only")
    parser.add_argument("--dir", help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="per world, seconds")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args(argv)
    w = workload(args.scale, batch=64)
    unique = unique_bytes(w)
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="dtrec_ckpt_bench_"))
    opts = {"repeats": args.repeats, "timeout": args.timeout, "root": str(workdir)}
    libs = ["dtrec"] if args.no_torchrec else ["dtrec", "torchrec"]
    results: dict[str, dict] = {}
    try:
        for config in [c for c in args.configs.split(",") if c]:
            if config not in CONFIGS:
                parser.error(f"unknown config {config!r}; choose from {CONFIGS}")
            results[config] = {}
            for lib in libs:
                run = run_config(lib, config, w, opts, args.world_size)
                results[config][lib] = run
                print(f"[{config} {lib}] {run['status']} ({run['wall_s']:.0f} s)", flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    print_table(results, sum(unique.values()))
    if args.json:
        import datetime

        report = {
            "meta": {
                "date": datetime.date.today().isoformat(),
                "command": " ".join(["python -m benchmarks.checkpoint", *argv]),
                "torch": torch.__version__,
                "python": platform.python_version(),
                "cpu_cores": os.cpu_count(),
                "dtrec": dtrec_source(),
                "rows": list(w.rows),
                "dim": w.dim,
                "unique_bytes": unique,
                "timing": "seconds per save / load on each rank (barrier first, outside), "
                "median over repeats, then over ranks",
            },
            "results": results,
        }
        write_report(args.json, report)


if __name__ == "__main__":
    main()
