"""Offloaded tables: the DLRM step with tables in host memory behind device caches.

The DLRM-shaped model of ``benchmarks/gpu_step.py`` (26 tables, MLPerf's rows capped at
``--max-rows``, dim ``--dim``, fused row-wise Adagrad, a 1-rank world, tables built on
the meta device), trained all on the device (the baseline) and with every table whose
cache can hold ``BATCHES_IN_FLIGHT`` batches' distinct rows offloaded behind a cache of
100%, 25%, 10% and 5% of its rows (``TableWise(rank=0, cache_rows=...)``); smaller tables
stay on the device, and the report lists them. Ids uniform or Zipf(1.1) (hot ranks
scattered over the rows, as ``benchmarks/distributed.py`` draws them). Per (batch, ids,
cache):

* ``hit_rate``: of the distinct rows a step reads from offloaded tables, the share already
  cached (``cache_stats`` over the timed steps, after warm-up forwards that fill the caches
  of up to 25% of the rows; a 100% cache keeps first-touch misses for longer), and
  ``expected_hit_rate``, the planner's steady-state estimate for the same caches (LRU by
  Che's approximation, ``dtrec.planning.offload``);
* ``h2d_bytes_per_step`` / ``d2h_bytes_per_step``: rows (and their optimizer state) copied
  in for misses, and written back on eviction;
* ``step_s`` and ``pipelined_step_s`` (``dtrec.TrainPipeline``: batch i + 1's fill runs
  during batch i's backward): medians of steps timed one by one, the best of
  ``--repeats`` rounds that run every variant in turn (a shared machine's load only slows
  steps down), and both over the all-on-device step of the same mode;
* ``copy_s_per_step``: the misses' bytes over the measured host-to-device bandwidth (what
  pipelining must hide; the GPU target is a pipelined step within 10% of the longer of
  the device step and this, and within 1.3x the device step at Zipf ids and a 10% cache).

    MALLOC_MMAP_THRESHOLD_=33554432 PYTHONPATH=. python benchmarks/offload.py \
        --json benchmarks/results/offload_cpu_<date>.json
    PYTHONPATH=. python benchmarks/offload.py --device cuda \
        --json benchmarks/results/offload_<card>_<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

import dtrec
from benchmarks.common.dense_arch import NUM_DENSE
from benchmarks.common.device import bench_device, sync
from benchmarks.common.dlrm import (
    LR,
    MLPERF_ROWS,
    Batch,
    Library,
    Workload,
    dtrec_dlrm,
)
from benchmarks.common.workloads import zipf_ids
from benchmarks.probes.machine import processor
from benchmarks.probes.report import dtrec_source, write_report
from dtrec.planning.cost_model import UniformIds
from dtrec.planning.offload import BATCHES_IN_FLIGHT, ZipfIds, expected_misses, row_buckets

CACHE_SHARES = (1.0, 0.25, 0.10, 0.05)
ZIPF = 1.1


def make_batch(w: Workload, size: int, one_hot: bool, ids: str, device, gen) -> Batch:
    """``gpu_step.make_batch``'s batch, Zipf ids drawn as ``benchmarks/distributed.py`` does
    (exact truncated power law, ranks scattered), so hit rates match the planner's model."""
    lengths, values = [], []
    for rows, hot in zip(w.rows, w.hotness, strict=True):
        if one_hot:
            ls = torch.ones(size, dtype=torch.long)
        else:
            ls = torch.randint(1, 2 * hot, (size,), generator=gen)
        n = int(ls.sum())
        v = torch.randint(0, rows, (n,), generator=gen) if ids == "uniform" else None
        values.append(v if v is not None else zipf_ids(rows, n, ZIPF, gen))
        lengths.append(ls)
    keys = [f"f{i}" for i in range(len(w.rows))]
    kjt = dtrec.KeyedJaggedTensor(keys, torch.cat(values), torch.cat(lengths)).to(device)
    dense = torch.randn(size, NUM_DENSE, generator=gen).to(device)
    labels = torch.randint(0, 2, (size,), generator=gen).float().to(device)
    unique = sum(int(torch.unique(v).numel()) for v in values)
    return Batch(dense, kjt, labels, [], unique)


def distinct_rows(batches: list[Batch], tables: int) -> list[int]:
    """Per table, the most distinct rows one batch reads."""
    most = [0] * tables
    for b in batches:
        for t, key in enumerate(b.sparse_features.keys()):
            most[t] = max(most[t], int(torch.unique(b.sparse_features[key].values()).numel()))
    return most


def cache_plan(w: Workload, share: float | None, most: list[int]) -> dict[str, object]:
    """Per table its spec: offloaded behind ``share`` of its rows when that holds
    BATCHES_IN_FLIGHT batches' distinct rows, else on the device (None: all on the device)."""
    specs = {}
    for t, rows in enumerate(w.rows):
        cache = None if share is None else math.ceil(share * rows)
        if cache is not None and cache < min(rows, BATCHES_IN_FLIGHT * most[t]):
            cache = None
        specs[f"sparse.t{t}"] = dtrec.placements.TableWise(rank=0, cache_rows=cache)
    return specs


def build(w: Workload, device: torch.device, specs: dict) -> Library:
    _, model = dtrec_dlrm(w, device)
    mesh = dtrec.init_mesh(device.type, 1)
    fused = dtrec.optim.RowWiseAdagrad(lr=LR)
    model = dtrec.distribute_module(model, mesh, specs, optimizer=fused)
    dense = [p for p in model.parameters() if p.requires_grad]
    return Library("dtrec", model, [torch.optim.Adagrad(dense, lr=LR)], "sparse_features", 0, 0)


def totals(lib: Library) -> dict[str, int]:
    stats = lib.model.sparse.cache_stats().values()
    return {k: sum(s[k] for s in stats) for k in ("rows", "misses", "h2d_bytes", "d2h_bytes")}


def measure(lib: Library, batches: list[Batch], args, device) -> dict:
    """Warm-up steps, then ``args.steps`` plain steps and as many pipelined ones, each on a
    batch of its own (fresh ids every step, as in training: a cache sees new rows)."""
    fresh = [b.again() for b in batches]
    warm, plain, piped = (
        fresh[: args.warmup],
        fresh[args.warmup : args.warmup + args.steps],
        fresh[args.warmup + args.steps :],
    )
    with torch.no_grad():  # forwards fill the caches (nothing to write back: no update)
        for b in warm[:-1]:
            lib.model(b.dense, b.sparse_features)
    lib.step(warm[-1])
    before = totals(lib)
    step_s = statistics.median(one_by_one(lib.step, plain, device))
    pipeline = dtrec.TrainPipeline(lib.model, lib.optimizers[0], lib.loss)
    pipelined_s = statistics.median(one_by_one(None, pipeline.run(piped), device))
    after = totals(lib)
    moved = {k: after[k] - before[k] for k in after}
    timed = 2 * args.steps  # plain and pipelined steps
    return {
        "step_s": step_s,
        "pipelined_step_s": pipelined_s,
        "hit_rate": 1.0 - moved["misses"] / moved["rows"] if moved["rows"] else None,
        "h2d_bytes_per_step": moved["h2d_bytes"] / timed,
        "d2h_bytes_per_step": moved["d2h_bytes"] / timed,
        "distinct_rows_per_step": moved["rows"] / timed,
    }


def one_by_one(fn, items, device: torch.device) -> list[float]:
    """Seconds of each ``fn(item)`` (``fn`` None: of producing each item, a pipeline's
    steps), synced after each."""
    times, it = [], iter(items)
    while True:
        sync(device)
        start = time.perf_counter()
        item = next(it, None)
        if item is None:
            return times
        if fn is not None:
            fn(item)
        sync(device)
        times.append(time.perf_counter() - start)


def expected_hit_rate(w: Workload, specs: dict, size: int, one_hot: bool, ids: str) -> float:
    """The planner's steady-state hit rate of these caches (distinct rows, all tables)."""
    read = missed = 0.0
    for t, rows in enumerate(w.rows):
        cache = specs[f"sparse.t{t}"].cache_rows
        if cache is None:
            continue
        dist_ = UniformIds(rows) if ids == "uniform" else ZipfIds(rows, ZIPF)
        per_step = size * (1 if one_hot else w.hotness[t])
        r, m = expected_misses(*row_buckets(dist_, 0, rows), per_step, cache)
        read, missed = read + r, missed + m
    return 1.0 - missed / read if read else 1.0


def host_to_device_gbps(device: torch.device, nbytes: int = 1 << 26) -> float | None:
    """Pinned host -> device copy GB/s (None on the CPU: the tiers are one memory)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes // 4, pin_memory=True)
    dst = torch.empty(nbytes // 4, device=device)
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 10 * nbytes / (time.perf_counter() - start) / 1e9


def run(args, w: Workload, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(0)
    h2d = host_to_device_gbps(device)
    results: dict[str, dict] = {}
    for size in [int(s) for s in args.batches.split(",")]:
        for one_hot in args.hot:
            for ids in args.ids:
                name = f"B{size}_{'one_hot' if one_hot else 'multi_hot'}_{ids}"
                count = args.warmup + 2 * args.steps
                batches = [make_batch(w, size, one_hot, ids, device, gen) for _ in range(count)]
                results[name] = run_config(args, w, device, batches, one_hot, ids, h2d)
                for share in CACHE_SHARES:
                    print(summary(name, share, results[name][key(share)]), flush=True)
    return {"results": results, "host_to_device_GBps": h2d}


def key(share: float) -> str:
    return f"cache_{round(100 * share)}pct"


def run_config(
    args,
    w: Workload,
    device: torch.device,
    batches: list[Batch],
    one_hot: bool,
    ids: str,
    h2d: float | None,
) -> dict:
    """All on the device and each cache share, ``args.repeats`` rounds in turn (a fresh
    model each time); a variant's times are its best round's (load on a shared machine
    only slows a step down), the rest its first round's; ratios to the device."""
    size = batches[0].dense.shape[0]
    most = distinct_rows(batches, len(w.rows))
    variants = {"all_on_device": cache_plan(w, None, most)}
    variants.update({key(share): cache_plan(w, share, most) for share in CACHE_SHARES})
    config: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, specs in variants.items():
            r = measure(build(w, device, specs), batches, args, device)
            if name not in config:
                config[name] = {**r, "step_s_rounds": [], "pipelined_step_s_rounds": []}
            for k in ("step_s", "pipelined_step_s"):
                config[name][f"{k}_rounds"].append(r[k])
                config[name][k] = min(config[name][f"{k}_rounds"])
    device_s = config["all_on_device"]
    for share in CACHE_SHARES:
        r, specs = config[key(share)], variants[key(share)]
        r["expected_hit_rate"] = expected_hit_rate(w, specs, size, one_hot, ids)
        r["offloaded_tables"] = sorted(k for k, v in specs.items() if v.cache_rows is not None)
        r["step_over_device"] = r["step_s"] / device_s["step_s"]
        r["pipelined_over_device"] = r["pipelined_step_s"] / device_s["pipelined_step_s"]
        if h2d:
            r["copy_s_per_step"] = r["h2d_bytes_per_step"] / (h2d * 1e9)
            bound = max(device_s["pipelined_step_s"], r["copy_s_per_step"])
            r["pipelined_over_bound"] = r["pipelined_step_s"] / bound
    return config


def summary(config: str, share: float, r: dict) -> str:
    hit = "  n/a" if r["hit_rate"] is None else f"{r['hit_rate']:5.1%}"
    hit += f" (expected {r['expected_hit_rate']:5.1%})"
    return (
        f"{config:<26} cache {share:4.0%}: hit {hit}, h2d {r['h2d_bytes_per_step'] / 2**20:8.2f} "
        f"MiB/step, step {r['step_over_device']:.2f}x device, pipelined "
        f"{r['pipelined_over_device']:.2f}x ({len(r['offloaded_tables'])} tables offloaded)"
    )


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu (CI-sized defaults) or cuda (full)")
    p.add_argument("--batches", help="batch sizes, comma-separated")
    p.add_argument("--max-rows", type=float, help="cap on a table's rows")
    p.add_argument("--dim", type=int)
    p.add_argument("--ids", default="uniform,zipf", help="uniform and/or zipf")
    p.add_argument("--hot", default="one", help="one and/or multi (hot batches)")
    p.add_argument("--steps", type=int, help="timed steps per mode")
    p.add_argument("--warmup", type=int, help="untimed forwards first (the caches fill)")
    p.add_argument("--repeats", type=int, help="rounds over the variants (best one kept)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (code-path check)")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    defaults = {  # CPU: CI-sized; CUDA: gpu_step's full size
        "batches": "16384" if cuda else "512",
        "max_rows": 2e6 if cuda else 2e5,
        "dim": 128 if cuda else 32,
        "steps": 20 if cuda else 10,
        "repeats": 1 if cuda else 3,
    }
    if args.smoke:
        defaults.update(batches="64", max_rows=2e4, dim=8, steps=2, warmup=3, repeats=2)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.warmup is None:  # enough batches to fill a 25% cache of the largest table
        smallest = min(int(b) for b in args.batches.split(","))
        args.warmup = math.ceil(0.25 * args.max_rows / smallest) + 5
    args.ids = args.ids.split(",")
    args.hot = [h == "one" for h in args.hot.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    device = bench_device(args.device)
    rows = tuple(max(1, int(min(r, args.max_rows))) for r in MLPERF_ROWS)
    w = Workload(rows, args.dim)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
    )
    load_before = os.getloadavg()
    try:
        report = run(args, w, device)
    finally:
        dist.destroy_process_group()
    meta = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "processor": processor(),
        "dtrec": dtrec_source(),
        "command": " ".join(["python benchmarks/offload.py", *argv]),
        "args": {k: v for k, v in vars(args).items()},
        "batches_in_flight": BATCHES_IN_FLIGHT,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "load_avg_before_after": [list(load_before), list(os.getloadavg())],
        "zipf": ZIPF,
    }
    report = {"meta": meta, "workload": asdict(w), **report}
    if args.json:
        write_report(args.json, report)
    sync(device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
