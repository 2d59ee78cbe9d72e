"""The side-by-side run loop: one (library, config) in a fresh world of gloo ranks.

Each rank builds its library's model, warms up, times ``steps`` steps (a barrier before
each, outside the timed region) with every collective's bytes counted, then runs census
steps; ``run_config`` spawns the world and reduces the ranks' results to medians.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import statistics
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dtrec
from benchmarks.common.cost_model import cost_model
from benchmarks.common.pipeline import pipeline_run
from benchmarks.common.workloads import (
    EPS,
    LR,
    Model,
    Workload,
    config_shards,
    dtrec_spec,
    make_batch,
    table_kinds,
)
from benchmarks.probes.comm import CollectiveCensus, CommCounter
from benchmarks.probes.stages import ExclusiveStageTimer, HostReads, dtrec_targets, torchrec_targets
from benchmarks.probes.stages import train_step as stage_train_step
from tests.multiprocess import WorldError, run_world

# glibc's malloc serves blocks above its mmap threshold (128 KiB until a larger block is
# freed, which raises it) with fresh pages, so a step's large temporaries page-fault anew
# every step; a process that built its tables on meta never freed a large block and pays
# that each step (dtrec's column-wise step: 158 vs 120 ms). A fixed 32 MiB threshold keeps
# them in the heap. Every rank of both libraries gets it; --malloc-default turns it off.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def quiet() -> None:
    """Workers print only errors: TorchRec and torch warn on every rank."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


def rss_mb() -> float:
    """This process's resident set now, MB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """This process's peak resident set, MB (a fresh world per run: that run's peak)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def dcp_bytes_written(directory: Path, rank: int) -> int:
    """Bytes ``rank`` wrote into a DCP checkpoint ``directory`` (its ``__<rank>_*.distcp``)."""
    return sum(p.stat().st_size for p in directory.glob(f"__{rank}_*.distcp"))


def first_step(model, optimizers, kjt_type, w: Workload, rank: int) -> None:
    """One training step on ``rank``'s batch of step 0 (so every optimizer state exists)."""
    keys, values, lengths, labels = make_batch(w, rank, 0)
    out = model(kjt_type(keys=keys, values=values, lengths=lengths))
    F.binary_cross_entropy_with_logits(out, labels).backward()
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)


def build_dtrec(w: Workload, kinds: list[str], shard_group_size: int, specs: dict | None = None):
    """(model, optimizers, per-step hook, DDP bytes estimate, KJT type) for dtrec;
    ``specs``: the plan itself (``{"ebc.t<i>": spec}``) instead of ``kinds``."""
    mesh = dtrec.init_mesh("cpu", shard_group_size=shard_group_size)
    ebc = dtrec.EmbeddingBagCollection(
        [
            dtrec.EmbeddingBagConfig(f"t{i}", r, w.dim, [f"f{i}"], "sum")
            for i, r in enumerate(w.rows)
        ],
        device="meta",  # like TorchRec's: each rank creates only its blocks
    )
    plan = specs or {f"ebc.t{i}": dtrec_spec(k) for i, k in enumerate(kinds)}
    model = dtrec.distribute_module(
        Model(ebc, w), mesh, plan, optimizer=dtrec.optim.RowWiseAdagrad(lr=LR, eps=EPS)
    )
    dense = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("ebc.")]
    # dtrec's dense gradient all-reduce is a plain c10d one (dtrec.sharded.dense): the
    # wrappers see it, so it needs no estimate (kind dense.grad_sync in comm_stats)
    return model, [torch.optim.Adagrad(dense, lr=LR)], None, 0, dtrec.KeyedJaggedTensor


def run_rank(rank: int, world: int, lib: str, config: str, w: Workload, opts: dict) -> dict:
    """One rank of one (library, config) run: build, warm up, time, census. Picklable result."""
    quiet()
    torch.manual_seed(0)
    warmup, steps, census_steps = opts["warmup"], opts["steps"], opts["census_steps"]
    if steps < 1 or census_steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1, census_steps >= 1, warmup >= 0; got {opts}")
    dtrec.ops.set_backend(opts.get("dtrec_backend", "auto"))
    shards = config_shards(config, world)
    kinds = opts.get("kinds") or table_kinds(config, shards, len(w.rows))
    rss_start = rss_mb()
    if lib == "dtrec":
        build = build_dtrec
    else:  # TorchRec is imported only where it runs
        from benchmarks.common.torchrec_side import build_torchrec as build
    model, optimizers, hook, ddp_estimate, kjt_type = build(w, kinds, shards)
    rss_built = rss_mb()
    batches = []
    for s in range(warmup + steps + census_steps):
        keys, values, lengths, labels = make_batch(w, rank, s)
        batches.append((kjt_type(keys=keys, values=values, lengths=lengths), labels))

    timer = ExclusiveStageTimer()

    def train_step(kjt, labels) -> float:
        return stage_train_step(model, optimizers, timer, kjt, labels, hook)

    def timed_step(s: int) -> float:
        dist.barrier()  # start together; the barrier is outside the timed region
        start = time.perf_counter()
        losses.append(train_step(*batches[s]))
        return 1e3 * (time.perf_counter() - start)

    losses: list[float] = []
    warmup_ms = [timed_step(s) for s in range(warmup)]
    counter = CommCounter()
    targets = (dtrec_targets if lib == "dtrec" else torchrec_targets)(model)
    with dtrec.comm_stats() as stats, counter.active():
        timer.clear()
        with timer.wrapping(targets) as not_timed:
            step_ms = [timed_step(s) for s in range(warmup, warmup + steps)]
    part_of = {"fused_update": "backward_update"}
    stage_ms = timer.per_step(steps, part_of)
    stage_cpu_ms = timer.per_step(steps, part_of, cpu=True)
    census, reads = CollectiveCensus(), HostReads(torch.device("cpu"))
    for s in range(warmup + steps, warmup + steps + census_steps):
        dist.barrier()
        with census, reads.counting():
            train_step(*batches[s])
    nbytes = counter.per_step(steps)
    profile = profile_steps(train_step, batches[warmup:], opts.get("profile", 0), rank)
    piped = None
    if opts.get("pipeline"):  # the library's own pipeline, same model and batches
        timed_batches = batches[: warmup + steps]
        piped = pipeline_run(lib, model, optimizers, timed_batches, warmup)
    from dtrec.kernels import cpu as cpu_kernels
    from dtrec.optim.cpu_choice import cpu_rowwise_adagrad

    return {
        "cpu_rowwise_adagrad": cpu_rowwise_adagrad() if lib == "dtrec" else None,
        "cpu_kernels": cpu_kernels.available() if lib == "dtrec" else None,
        "profile": profile,
        "pipeline": piped,
        "rank": rank,
        "kinds": kinds,
        "step_ms": step_ms,
        "median_ms": statistics.median(step_ms),
        "warmup_ms": warmup_ms,
        "loss_first_last": [losses[0], losses[-1]],
        "bytes_by_collective": nbytes,
        "bytes_per_step": sum(v["bytes"] for v in nbytes.values()),
        "dense_ddp_estimate": ddp_estimate,
        "census_per_step": {
            k: {"calls": census.calls[k] / census_steps, "bytes": census.bytes[k] / census_steps}
            for k in sorted(census.calls)
        },
        "dtrec_comm_stats": stats.per_step(steps) if lib == "dtrec" else None,
        "stage_ms": stage_ms,
        "stage_cpu_ms": stage_cpu_ms,
        "stages_not_timed": not_timed,
        "collectives_per_step": sum(census.calls.values()) / census_steps,
        "host_reads_per_step": sum(reads.sites.values()) / census_steps,
        "host_read_sites": {k: v / census_steps for k, v in reads.sites.most_common()},
        "rss_mb": {"start": rss_start, "after_setup": rss_built, "end": rss_mb()},
        "peak_rss_mb": peak_rss_mb(),
    }


def profile_steps(train_step, batches: list, steps: int, rank: int) -> str | None:
    """Rank 0's CPU profile of ``steps`` more steps (every rank runs them): the ops by self
    CPU time, then by total CPU time, as torch's profiler tables; None when ``steps`` is 0."""
    if steps <= 0:
        return None
    from torch.profiler import ProfilerActivity, profile

    profiler = profile(activities=[ProfilerActivity.CPU]) if rank == 0 else contextlib.nullcontext()
    with profiler as prof:
        for s in range(steps):
            dist.barrier()
            train_step(*batches[s % len(batches)])
    if rank != 0:
        return None
    averages = prof.key_averages()
    return "\n".join(
        [f"{steps} steps of rank 0", averages.table(sort_by="self_cpu_time_total", row_limit=45),
         averages.table(sort_by="cpu_time_total", row_limit=30)]
    )  # fmt: skip


def median(xs: Sequence[float]) -> float:
    """The median as a plain float (JSON-ready)."""
    return float(statistics.median(xs))


def run_config(lib: str, config: str, w: Workload, opts: dict, world: int = 4) -> dict:
    """Run one (library, config) in a fresh world; per-rank results and medians over ranks.

    Also records the machine's 1-minute load average before and after (other jobs on the
    machine skew step times).
    """
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    try:
        ranks = run_world(
            world,
            run_rank,
            lib,
            config,
            w,
            opts,
            timeout=opts.get("timeout", 1200.0),
            collective_timeout=opts.get("timeout", 1200.0),
            env=opts.get("env"),
        )
    except WorldError as exc:
        return {
            "status": "failed",
            "error": str(exc)[-6000:],
            "wall_s": time.perf_counter() - start,
            "load_avg": [load_before, os.getloadavg()[0]],
        }
    kinds = sorted({k for r in ranks for k in r["bytes_by_collective"]})
    census = sorted({k for r in ranks for k in r["census_per_step"]})
    summary = {
        "step_ms": median([r["median_ms"] for r in ranks]),
        "step_ms_slowest_rank": max(r["median_ms"] for r in ranks),
        "bytes_per_step": median([r["bytes_per_step"] for r in ranks]),
        "bytes_by_collective": {
            k: median([r["bytes_by_collective"].get(k, {}).get("bytes", 0) for r in ranks])
            for k in kinds
        },
        "dense_ddp_estimate": median([r["dense_ddp_estimate"] for r in ranks]),
        "census_bytes_per_step": {
            k: median([r["census_per_step"].get(k, {}).get("bytes", 0) for r in ranks])
            for k in census
        },
        **{
            key: {k: median([r[key].get(k, 0.0) for r in ranks]) for k in ranks[0][key]}
            for key in ("stage_ms", "stage_cpu_ms")
        },
        "collectives_per_step": median([r["collectives_per_step"] for r in ranks]),
        "host_reads_per_step": median([r["host_reads_per_step"] for r in ranks]),
        "peak_rss_mb": median([r["peak_rss_mb"] for r in ranks]),
        "end_rss_mb": median([r["rss_mb"]["end"] for r in ranks]),
    }
    summary["total_bytes_per_step"] = summary["bytes_per_step"] + summary["dense_ddp_estimate"]
    if opts.get("pipeline"):
        errors = sorted({r["pipeline"]["error"] for r in ranks if "error" in r["pipeline"]})
        if errors:
            summary["pipeline_error"] = "; ".join(errors)
        else:
            summary["pipeline_step_ms"] = median([r["pipeline"]["median_ms"] for r in ranks])
    out = {
        "status": "ok",
        "wall_s": time.perf_counter() - start,
        "load_avg": [load_before, os.getloadavg()[0]],
        "median": summary,
    }
    if lib == "dtrec":
        measured = [r["dtrec_comm_stats"] for r in ranks]
        names = sorted({k for m in measured for k in m})
        summary["dtrec_comm_stats"] = {
            k: median([m.get(k, {}).get("bytes", 0) for m in measured]) for k in names
        }
        # Host ms inside dtrec's collectives per step (on gloo: the exchange plus any wait).
        summary["dtrec_comm_ms"] = {
            k: 1e3 * median([m.get(k, {}).get("seconds", 0) for m in measured]) for k in names
        }
        model = cost_model(w, ranks[0]["kinds"], world, config_shards(config, world))
        out["cost_model_check"] = {
            "model_mean_bytes": model["mean_total"],
            "measured_mean_bytes": statistics.fmean(  # the tables' (the model's scope)
                sum(v["bytes"] for k, v in m.items() if not k.startswith("dense."))
                for m in measured
            ),
            "model_by_kind": model["mean_by_kind"],
        }
    out["ranks"] = ranks
    return out
