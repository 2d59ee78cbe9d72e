"""dtrec vs TorchRec, side by side: the same model, batches and optimizers on W gloo CPU ranks.

Model: 8 tables (rows geometric 1e5..1e6 times ``--scale``, D=64, one feature each, sum
pooling), bags of 10..30 ids (uniform, mean 20), ids Zipf(1.1) over each table's rows (a
truncated inverse CDF, then a fixed multiplicative hash scatters hot ids over the rows),
``--batch`` samples per rank; pooled embeddings -> Linear(T x 64, 64) -> ReLU -> Linear(64, 1),
BCE-with-logits vs random labels. Tables: fused exact row-wise Adagrad (lr 0.01, eps 1e-8);
MLP: ``torch.optim.Adagrad(lr=0.01)``, data parallel (dtrec's replicated DTensor dense
parameters, ``dtrec.sharded.dense``; TorchRec DDP).
Rank r's batch of step s is generated from the seed (r, s) alike for both libraries.
``--workload mixed_sizes`` (issue 46's second workload): 16 tables of 100..1e6 rows
(geometric), Zipf(1.05), same bags: many small tables whose ids repeat heavily.

Configs (``--configs``): ``table_wise`` (table i on shard rank i % S), ``row_wise``,
``column_wise``, ``data_parallel``, ``mixed`` (quarters of the tables: DP, TW, CW, RW) on a
shard group of S = W ranks (dtrec mesh (W, 1), TorchRec ``DistributedModelParallel``), and
``2d_<type>`` on S = W / 2 (dtrec mesh (W/2, 2), TorchRec ``DMPCollection`` with ``sync()``
after every step, patched to run on CPU: see ``benchmarks/torchrec_baseline.py``).

Every (library, config) runs in a fresh world of W processes (so ``ru_maxrss`` is that run's
peak): ``--warmup`` steps, then ``--steps`` timed steps, each preceded by a ``dist.barrier()``
outside the timed region; a step is forward + backward + optimizer step(s) (+ ``sync()``).
Bytes: every ``torch.distributed`` collective (and ``ProcessGroup.allreduce_coalesced``) is
wrapped during the timed steps and charged what this rank sends (all-to-all: all but its own
split; all-reduce: 2 (n-1)/n of the tensor; reduce-scatter: (n-1)/n of the input; all-gather:
(n-1) inputs; broadcast: the tensor, on the source). TorchRec's DDP gradient all-reduce
runs in C++ and is not seen by the wrappers: ``dense_ddp_estimate`` = 2 (W-1)/W x bytes
of the parameters DDP reduces (TorchRec's data-parallel tables included); dtrec's dense
all-reduce is seen (its estimate is 0). One more untimed step runs under a
dispatch-mode census of every c10d op (DDP's included) to check the wrappers missed nothing.

Before the configs (and again after them, to tell whether the machine's speed held), one
world measures the machine (``benchmarks/probes/cpu_calibration.py``: collective latency
and bandwidths, lookup and update speed, the dense step, a host floor); the report then
predicts every config's dtrec step from the first measurement and the planner's cost model
and prints the error and the plans' order (``benchmarks/distributed_predict.py``, issue 33;
``--no-predict`` skips all of it).

``--cost-model`` prints dtrec's expected bytes per rank per step for large worlds (no processes),
computed from the tables' shard layouts (``cost_model``); the full run also checks it against the
bytes dtrec measured at W.

    .venv/bin/python -m benchmarks.distributed --steps 20 --warmup 3 \\
        --json benchmarks/results/distributed_cpu_<date>.json
    .venv/bin/python -m benchmarks.distributed --scale 0.01 --steps 2 --warmup 1 --batch 32 \\
        --configs table_wise,row_wise --no-torchrec          # smoke run, about 30 s
    .venv/bin/python -m benchmarks.distributed --cost-model

(from the repository root; ``dtrec`` is imported from the working directory first, so running
from a clone of a given commit measures that commit, see ``meta.dtrec`` in the JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import logging
import os
import platform
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

import dtrec
from benchmarks.distributed_pipeline import pipeline_run, print_pipeline_table
from benchmarks.probes.comm import CollectiveCensus, CommCounter
from benchmarks.probes.machine import processor, processor_line
from benchmarks.probes.report import dtrec_source, write_report
from benchmarks.probes.stages import (
    ExclusiveStageTimer,
    HostReads,
    dtrec_targets,
    print_stage_table,
    torchrec_targets,
)
from benchmarks.probes.stages import train_step as stage_train_step
from dtrec.modules.config import EmbeddingBagConfig
from dtrec.placements import (
    ColumnWise,
    DataParallel,
    Grid,
    RowWise,
    TableRowWise,
    TableSpec,
    TableWise,
)
from dtrec.placements.mesh import ShardAxis, positions_per_node
from dtrec.planning.cost_model import Topology, comm_by_kind, table_cost
from tests.multiprocess import WorldError, run_world

TYPES = ("table_wise", "row_wise", "column_wise", "data_parallel", "mixed")
CONFIGS = (*TYPES, *(f"2d_{t}" for t in TYPES))
DEFAULT_CONFIGS = (*TYPES, "2d_row_wise", "2d_mixed")
HASH = 2654435761  # Zipf rank -> row scatter (as in benchmarks/kernels.py)
LR, EPS = 0.01, 1e-8


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Workload:
    """The model and batch shape both libraries train."""

    rows: tuple[int, ...]
    """Rows of each table ``t<i>`` (read by feature ``f<i>``)."""
    dim: int = 64
    """Embedding dim of every table."""
    batch: int = 512
    """Samples per rank per step."""
    bag_range: tuple[int, int] = (10, 30)
    """Ids per bag, uniform over this inclusive range."""
    zipf: float = 1.1
    """Zipf exponent of the ids."""

    @property
    def mean_bag(self) -> float:
        return sum(self.bag_range) / 2


WORKLOADS = ("large_tables", "mixed_sizes")


def workload(scale: float = 1.0, batch: int = 512, kind: str = "large_tables") -> Workload:
    """``large_tables``: 8 tables of 1e5..1e6 rows (geometric) times ``scale`` (as
    benchmarks/kernels.py), Zipf 1.1. ``mixed_sizes`` (issue 46): 16 tables of 100..1e6
    rows (geometric) times ``scale``, Zipf 1.05: many small tables whose ids repeat
    heavily within a batch, a regime of their own. Both: bags of 10..30 ids (mean 20)."""
    if kind == "large_tables":
        rows = (max(1, int(scale * 1e5 * 10 ** (i / 7))) for i in range(8))
        return Workload(rows=tuple(rows), batch=batch)
    if kind == "mixed_sizes":
        rows = (max(1, int(scale * 100 * 10 ** (4 * i / 15))) for i in range(16))
        return Workload(rows=tuple(rows), batch=batch, zipf=1.05)
    raise ValueError(f"unknown workload {kind!r}; choose from {WORKLOADS}")


def zipf_ids(rows: int, n: int, s: float, gen: torch.Generator) -> Tensor:
    """``n`` ids: Zipf rank k (P ~ (k+1)^-s, truncated to ``rows``) scattered by ``HASH``.

    Inverse CDF of the continuous power law on [1, rows + 1), floored: rank k has probability
    ``zipf_row_probs`` exactly (unlike clamping, which piles the tail's mass on one row).
    """
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    x = (1 - u * (1 - (rows + 1) ** (1 - s))) ** (-1 / (s - 1))
    rank = (x.floor().long() - 1).clamp(0, rows - 1)
    return (rank * HASH) % rows


def zipf_row_probs(rows: int, s: float) -> np.ndarray:
    """Probability of each row (after the hash scatter) under ``zipf_ids``."""
    edge = np.arange(1, rows + 2, dtype=np.float64) ** (1 - s)
    p_rank = (edge[:-1] - edge[1:]) / (1 - (rows + 1) ** (1 - s))
    row = (np.arange(rows, dtype=np.int64) * HASH) % rows
    return np.bincount(row, weights=p_rank, minlength=rows)


def make_batch(w: Workload, rank: int, step: int) -> tuple[list[str], Tensor, Tensor, Tensor]:
    """Rank ``rank``'s batch of step ``step``: (keys, values, key-major lengths, labels)."""
    gen = torch.Generator().manual_seed(1_000_003 * rank + step)
    lo, hi = w.bag_range
    lengths = torch.randint(lo, hi + 1, (len(w.rows) * w.batch,), generator=gen)
    per_key = lengths.view(len(w.rows), w.batch).sum(1).tolist()
    values = torch.cat([zipf_ids(r, n, w.zipf, gen) for r, n in zip(w.rows, per_key)])
    labels = torch.randint(0, 2, (w.batch,), generator=gen).float()
    return [f"f{i}" for i in range(len(w.rows))], values, lengths, labels


def config_shards(config: str, world: int) -> int:
    """S of a config: the whole world, or half of it for the ``2d_`` configs (R = 2)."""
    return world // 2 if config.startswith("2d_") else world


def table_kinds(config: str, shard_group_size: int, num_tables: int = 8) -> list[str]:
    """Per table: "tw:<shard rank>", "rw", "cw" or "dp" (``config`` without its ``2d_``)."""
    kind = config.removeprefix("2d_")
    if kind == "mixed":  # quarters of the tables, in order: DP, TW, CW, RW
        if num_tables % 4:
            raise ValueError(f"the mixed plan splits tables in quarters, got {num_tables}")
        per = [("dp", "tw", "cw", "rw")[4 * i // num_tables] for i in range(num_tables)]
    else:
        short = {"table_wise": "tw", "row_wise": "rw", "column_wise": "cw", "data_parallel": "dp"}
        per = [short[kind]] * num_tables
    return [f"tw:{i % shard_group_size}" if k == "tw" else k for i, k in enumerate(per)]


def dtrec_spec(kind: str) -> TableSpec:
    """dtrec spec of a table kind ("tw:3", "rw", "cw", "dp", "trw:1", "grid")."""
    name, _, arg = kind.partition(":")
    specs = {
        "tw": lambda: TableWise(rank=int(arg)),
        "trw": lambda: TableRowWise(node=int(arg)),
        "rw": RowWise,
        "cw": ColumnWise,
        "dp": DataParallel,
        "grid": Grid,
    }
    return specs[name]()


class Model(nn.Module):
    """Embedding collection -> concat pooled -> Linear(T*D, 64) -> ReLU -> Linear(64, 1)."""

    def __init__(self, ebc: nn.Module, w: Workload) -> None:
        super().__init__()
        self.ebc = ebc
        self.dense = nn.Sequential(nn.Linear(len(w.rows) * w.dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, kjt: object) -> Tensor:
        return self.dense(self.ebc(kjt).values()).squeeze(1)


# --------------------------------------------------------------------------- one rank


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _ddp_estimate(ddps: Sequence[tuple[dist.ProcessGroup | None, list[nn.Parameter]]]) -> int:
    """Bytes a rank sends in DDP's gradient all-reduces: 2 (g-1)/g x reduced bytes, per DDP."""
    total = 0
    for group, params in ddps:
        size = (group or dist.group.WORLD).size()
        nbytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        total += 2 * (size - 1) * nbytes // size
    return total


def _build_dtrec(w: Workload, kinds: list[str], shard_group_size: int, specs: dict | None = None):
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


def _build_torchrec(w: Workload, kinds: list[str], shard_group_size: int):
    """Same as ``_build_dtrec``, with TorchRec (imported only here)."""
    from benchmarks import torchrec_baseline as trb

    model, optimizers, hook = trb.shard_torchrec(
        Model(trb.torchrec_ebc(w.rows, w.dim), w), kinds, shard_group_size, LR, EPS
    )
    ddp = _ddp_estimate([(m.process_group, m._module_parameters) for m in trb.ddp_modules(model)])
    return model, optimizers, hook, ddp, trb.KeyedJaggedTensor


def run_rank(rank: int, world: int, lib: str, config: str, w: Workload, opts: dict) -> dict:
    """One rank of one (library, config) run: build, warm up, time, census. Picklable result."""
    _quiet()
    torch.manual_seed(0)
    warmup, steps, census_steps = opts["warmup"], opts["steps"], opts["census_steps"]
    if steps < 1 or census_steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1, census_steps >= 1, warmup >= 0; got {opts}")
    dtrec.ops.set_backend(opts.get("dtrec_backend", "auto"))
    shards = config_shards(config, world)
    kinds = opts.get("kinds") or table_kinds(config, shards, len(w.rows))
    rss_start = _rss_mb()
    build = _build_dtrec if lib == "dtrec" else _build_torchrec
    model, optimizers, hook, ddp_estimate, kjt_type = build(w, kinds, shards)
    rss_built = _rss_mb()
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
    profile = _profile_steps(train_step, batches[warmup:], opts.get("profile", 0), rank)
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
        "rss_mb": {"start": rss_start, "after_setup": rss_built, "end": _rss_mb()},
        "peak_rss_mb": _peak_rss_mb(),
    }


def _profile_steps(train_step, batches: list, steps: int, rank: int) -> str | None:
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


# --------------------------------------------------------------------------- driver


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


# glibc's malloc serves blocks above its mmap threshold (128 KiB until a larger block is
# freed, which raises it) with fresh pages, so a step's large temporaries page-fault anew
# every step; a process that built its tables on meta never freed a large block and pays
# that each step (dtrec's column-wise step: 158 vs 120 ms). A fixed 32 MiB threshold keeps
# them in the heap. Every rank of both libraries gets it; --malloc-default turns it off.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


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
        "step_ms": _median([r["median_ms"] for r in ranks]),
        "step_ms_slowest_rank": max(r["median_ms"] for r in ranks),
        "bytes_per_step": _median([r["bytes_per_step"] for r in ranks]),
        "bytes_by_collective": {
            k: _median([r["bytes_by_collective"].get(k, {}).get("bytes", 0) for r in ranks])
            for k in kinds
        },
        "dense_ddp_estimate": _median([r["dense_ddp_estimate"] for r in ranks]),
        "census_bytes_per_step": {
            k: _median([r["census_per_step"].get(k, {}).get("bytes", 0) for r in ranks])
            for k in census
        },
        **{
            key: {k: _median([r[key].get(k, 0.0) for r in ranks]) for k in ranks[0][key]}
            for key in ("stage_ms", "stage_cpu_ms")
        },
        "collectives_per_step": _median([r["collectives_per_step"] for r in ranks]),
        "host_reads_per_step": _median([r["host_reads_per_step"] for r in ranks]),
        "peak_rss_mb": _median([r["peak_rss_mb"] for r in ranks]),
        "end_rss_mb": _median([r["rss_mb"]["end"] for r in ranks]),
    }
    summary["total_bytes_per_step"] = summary["bytes_per_step"] + summary["dense_ddp_estimate"]
    if opts.get("pipeline"):
        errors = sorted({r["pipeline"]["error"] for r in ranks if "error" in r["pipeline"]})
        if errors:
            summary["pipeline_error"] = "; ".join(errors)
        else:
            summary["pipeline_step_ms"] = _median([r["pipeline"]["median_ms"] for r in ranks])
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
            k: _median([m.get(k, {}).get("bytes", 0) for m in measured]) for k in names
        }
        # Host ms inside dtrec's collectives per step (on gloo: the exchange plus any wait).
        summary["dtrec_comm_ms"] = {
            k: 1e3 * _median([m.get(k, {}).get("seconds", 0) for m in measured]) for k in names
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


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f}{unit}" if unit != "B" else f"{n:.0f}B"
        n /= 1000
    raise AssertionError


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def print_table(results: dict[str, dict[str, dict]]) -> None:
    """The side-by-side table (medians over ranks), then bytes per collective."""

    def get(config: str, lib: str, key: str) -> float | None:
        run = results[config].get(lib)
        return run["median"][key] if run and run["status"] == "ok" else None

    head = (
        f"{'config':<16}{'dtrec ms':>9}{'TR ms':>9}{'ratio':>6}{'dtrec B/step':>13}"
        f"{'TR B/step':>11}{'ratio':>6}{'dtrec RSS MB':>14}{'TR RSS MB':>12}"
    )
    print(head)
    print("-" * len(head))
    for config in results:
        d_ms, t_ms = get(config, "dtrec", "step_ms"), get(config, "torchrec", "step_ms")
        d_b = get(config, "dtrec", "total_bytes_per_step")
        t_b = get(config, "torchrec", "total_bytes_per_step")
        rss = [_rss(results[config].get(lib)) for lib in ("dtrec", "torchrec")]
        print(
            f"{config:<16}{_num(d_ms):>9}{_num(t_ms):>9}{_ratio(d_ms, t_ms):>6}"
            f"{_fmt_bytes(d_b):>13}{_fmt_bytes(t_b):>11}{_ratio(d_b, t_b):>6}"
            f"{rss[0]:>14}{rss[1]:>12}"
        )
    print(
        "ms: median step; B/step: wrapped collectives + dense_ddp_estimate, per rank; "
        "RSS: peak/end per rank"
    )
    for config, runs in results.items():
        for lib, run in runs.items():
            if run["status"] != "ok":
                last = run["error"].strip().splitlines()[-1] if run["error"].strip() else "?"
                print(f"  {config} {lib}: FAILED: {last[:200]}")
                continue
            m = run["median"]
            parts = [f"{k} {_fmt_bytes(v)}" for k, v in m["bytes_by_collective"].items()]
            parts.append(f"DDP est. {_fmt_bytes(m['dense_ddp_estimate'])}")
            print(f"  {config} {lib}: " + ", ".join(parts))
            if lib == "dtrec":
                check = run["cost_model_check"]
                stats = m["dtrec_comm_stats"]
                print(
                    f"  {config} dtrec comm_stats: "
                    + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in stats.items())
                    + f" | cost model {_fmt_bytes(check['model_mean_bytes'])} vs measured "
                    + f"{_fmt_bytes(check['measured_mean_bytes'])}"
                )
                comm_ms = m["dtrec_comm_ms"]
                print(
                    f"  {config} dtrec ms in collectives: {sum(comm_ms.values()):.1f} of "
                    f"{m['step_ms']:.1f} ("
                    + ", ".join(f"{k} {v:.1f}" for k, v in comm_ms.items() if v >= 0.05)
                    + ")"
                )


def check_targets(results: dict[str, dict[str, dict]], target: float) -> dict[str, dict]:
    """Per config, dtrec's step time over TorchRec's against ``target`` (issue 30: <= 0.75
    for every type and for 2D vs DMPCollection), and its bytes over TorchRec's (must not
    exceed 1): a ratio measured side by side in this run, never an absolute time."""
    out = {}
    for config, runs in results.items():
        d, t = runs.get("dtrec"), runs.get("torchrec")
        if not (d and t and d["status"] == "ok" and t["status"] == "ok"):
            continue
        ratio = d["median"]["step_ms"] / t["median"]["step_ms"]
        nbytes = d["median"]["total_bytes_per_step"] / max(t["median"]["total_bytes_per_step"], 1)
        out[config] = {"step_ratio": ratio, "bytes_ratio": nbytes,
                       "meets": ratio <= target and nbytes <= 1.0}  # fmt: skip
        verdict = "meets" if out[config]["meets"] else "MISSES"
        print(f"  target {config}: step {ratio:.2f}x TorchRec, bytes {nbytes:.2f}x: {verdict} "
              f"(step <= {target}x, bytes <= 1x)")  # fmt: skip
    return out


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _rss(run: dict | None) -> str:
    """Peak/end RSS in MB (medians over ranks) of a run, or "-"."""
    if not run or run["status"] != "ok":
        return "-"
    return f"{run['median']['peak_rss_mb']:.0f}/{run['median']['end_rss_mb']:.0f}"


# --------------------------------------------------------------------------- cost model


def cost_model(
    w: Workload,
    kinds: Sequence[str],
    world: int,
    shard_group_size: int,
    node_size: int | None = None,
) -> dict:
    """Expected bytes one rank sends per training step in dtrec, per dtrec collective kind.

    Built from each table's ``TableLayout.blocks`` the way ``dtrec.sharded`` routes data
    (B = batch per rank, L = mean bag length, S shard group, R = W / S replicas,
    P(b) = probability mass of block b's rows,
    U(n, b) = expected distinct rows of block b among n ids = sum_r in b 1 - (1 - p_r)^n):

    * ``input_dist.header``: to each of the S - 1 peers 4 int32 when any table is not data
      parallel, and one int32 id count per segment that peer serves;
    * ``input_dist.ids``: to each block's position, from every other position, B int64
      lengths + B L P(b) int64 ids (column blocks get every id of their rows);
    * ``output_dist``: a block's position sends (S - 1) x [B, block cols] fp32 partials;
      ``output_dist.backward``: every other position sends [B, block cols] fp32 grads back;
    * ``grad_sync.replicate.*`` / ``grad_sync.data_parallel.*`` (fused optimizer, gradients
      synced every step): per group (the R replicas of sharded blocks; the W ranks for
      data-parallel tables) one all-gather of per-table counts, (g - 1) x 8 x tables; then
      per table the cheaper of a sparse all-gather, (g - 1) m (8 + 4 cols) with
      m = U(S B L, b) (U(B L, table) for data parallel), and a dense all-reduce,
      2 (g - 1) / g x rows (cols + 1) x 4 (``replica_sync.sync_bytes``, "auto" mode);
    * ``optim.row_sq_sum`` (row-wise Adagrad, blocks sharing rows with c > 1 column peers):
      all-reduce of U(W B L, b) fp32 row sums: 2 (c - 1) / c x 4 U.

    ``dense_ddp_estimate`` is separate (torch DDP, not dtrec). Returns the mean and max over
    ranks of the total, and the mean per kind (plus the id/length split of input_dist.ids).
    """
    s_size, replicas = shard_group_size, world // shard_group_size
    per_node = None if node_size is None else positions_per_node(world, s_size, node_size)
    axis = ShardAxis(s_size, replicas, per_node)
    topology = Topology(batch_size_per_rank=w.batch, default_pooling_factor=w.mean_bag)
    costs = [
        table_cost(
            EmbeddingBagConfig(f"t{t}", w.rows[t], w.dim),
            dtrec_spec(kind),
            axis,
            topology,
            _row_probs(w.rows[t], w.zipf),
        )
        for t, kind in enumerate(kinds)
    ]
    sent = comm_by_kind(costs, axis)
    kinds_out = [k for k in sent if k not in ("input_dist.lengths", "input_dist.id_values")]
    total = sum(sent[k] for k in kinds_out) if kinds_out else np.zeros(s_size)
    return {
        "mean_total": float(np.mean(total)),
        "max_total": float(np.max(total)),
        "mean_by_kind": {k: float(np.mean(v)) for k, v in sorted(sent.items()) if v.any()},
    }


class _RowProbs:
    """Row probabilities of one table, with prefix sums for block masses and distinct counts."""

    def __init__(self, rows: int, s: float) -> None:
        p = zipf_row_probs(rows, s)
        self._log1m = np.log1p(-p)
        self._mass = np.concatenate([[0.0], np.cumsum(p)])
        self._unique: dict[float, np.ndarray] = {}

    def mass(self, start: int, end: int) -> float:
        """Probability that an id falls in rows [start, end)."""
        return float(self._mass[end] - self._mass[start])

    def unique(self, n: float, start: int, end: int) -> float:
        """Expected distinct rows of [start, end) among ``n`` ids: sum 1 - (1 - p_r)^n."""
        if n not in self._unique:
            self._unique[n] = np.concatenate([[0.0], np.cumsum(-np.expm1(n * self._log1m))])
        return float(self._unique[n][end] - self._unique[n][start])


@functools.cache
def _row_probs(rows: int, s: float) -> _RowProbs:
    return _RowProbs(rows, s)


COST_WORLDS = (8, 64, 512, 4096)
COST_SHARDS = (8, 64, 512)
COST_TYPES = (*TYPES, "table_row_wise", "grid")


def cost_model_table(w: Workload, node_size: int = 8) -> list[dict]:
    """``cost_model`` for every type x S x W (S <= W); node-aware types use ``node_size``."""
    out = []
    for kind in COST_TYPES:
        for s_size in COST_SHARDS:
            for world in COST_WORLDS:
                if s_size > world:
                    continue
                row = {"type": kind, "S": s_size, "W": world, "R": world // s_size}
                try:
                    if kind in ("table_row_wise", "grid"):
                        nodes = s_size // positions_per_node(world, s_size, node_size)
                        trw = [f"trw:{i % nodes}" for i in range(len(w.rows))]
                        kinds = trw if kind == "table_row_wise" else ["grid"] * len(w.rows)
                        row.update(cost_model(w, kinds, world, s_size, node_size))
                    else:
                        row.update(cost_model(w, table_kinds(kind, s_size), world, s_size))
                except ValueError as exc:  # e.g. column-wise with D < S
                    row["error"] = str(exc)
                out.append(row)
    return out


def print_cost_model(rows: list[dict]) -> None:
    print("\ndtrec cost model: mean bytes per rank per step (max over ranks in parentheses)")
    print(f"{'type':<16}{'S':>5}" + "".join(f"{'W=' + str(x):>24}" for x in COST_WORLDS))
    keys = sorted({(r["type"], r["S"]) for r in rows}, key=lambda k: (COST_TYPES.index(k[0]), k[1]))
    for kind, s_size in keys:
        cells = []
        for world in COST_WORLDS:
            r = next(
                (r for r in rows if (r["type"], r["S"], r["W"]) == (kind, s_size, world)), None
            )
            if r is None:
                cells.append("")
            elif "error" in r:
                cells.append("n/a")
            else:
                cells.append(f"{_fmt_bytes(r['mean_total'])} ({_fmt_bytes(r['max_total'])})")
        print(f"{kind:<16}{s_size:>5}" + "".join(f"{c:>24}" for c in cells))


# --------------------------------------------------------------------------- main


def _meta(argv: list[str], w: Workload) -> dict:
    import fbgemm_gpu

    try:
        import torchrec

        torchrec_version = torchrec.__version__
    except ImportError:
        torchrec_version = None
    return {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python -m benchmarks.distributed", *argv]),
        "torch": torch.__version__,
        "torchrec": torchrec_version,
        "fbgemm_gpu": fbgemm_gpu.__version__,
        "python": platform.python_version(),
        "cpu_cores": os.cpu_count(),
        "processor": processor(),
        "platform": platform.platform(),
        "dtrec": dtrec_source(),
        "workload": asdict(w),
        "timing": "median over timed steps per rank (dist.barrier() before each step, outside "
        "the timed region), then median over ranks; OMP_NUM_THREADS=1 per rank",
        "bytes": "per rank per step: wrapped torch.distributed collectives during the timed "
        "steps + dense_ddp_estimate = 2 (W-1)/W x bytes of DDP-reduced params",
    }


def write_profiles(path: str, results: dict[str, dict[str, dict]]) -> None:
    """Every run's rank-0 profile (``--profile``) into one text file, run by run."""
    with open(path, "w") as f:
        f.write(f"processor: {processor_line()}\n")
        for config, libs in results.items():
            for lib, run in libs.items():
                table = run.get("ranks", [{}])[0].get("profile") if run["status"] == "ok" else None
                f.write(f"\n##### {config} {lib}\n{table or run.get('error', 'no profile')}\n")
    print(f"profiles in {path}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies table rows")
    parser.add_argument("--batch", type=int, default=512, help="samples per rank per step")
    parser.add_argument("--workload", default="large_tables", choices=WORKLOADS,
                        help="the tables and ids (see workload())")  # fmt: skip
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--census-steps", type=int, default=1, help="untimed census steps")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"of {CONFIGS}")
    parser.add_argument("--no-torchrec", action="store_true", help="run dtrec only")
    parser.add_argument("--dtrec-backend", default="auto", help="dtrec.ops.set_backend value")
    parser.add_argument("--cost-model", action="store_true", help="only the cost-model table")
    parser.add_argument("--timeout", type=float, default=1200.0, help="per world, seconds")
    parser.add_argument("--json", help="write results here")
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="also time dtrec.TrainPipeline / TorchRec's TrainPipelineSparseDist",
    )
    parser.add_argument("--no-predict", action="store_true",
                        help="skip the calibration world and the predicted steps")  # fmt: skip
    parser.add_argument("--target", type=float, default=0.75,
                        help="dtrec / TorchRec step time each config should meet")  # fmt: skip
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="profile STEPS more steps on rank 0 of each run; tables in --profile-out",
    )
    parser.add_argument("--profile-out", default="distributed_profile.txt",
                        help="where --profile writes its tables")  # fmt: skip
    parser.add_argument(
        "--malloc-default", action="store_true", help=f"leave glibc malloc as is (not {MALLOC_ENV})"
    )
    args = parser.parse_args(argv)
    w = workload(args.scale, args.batch, args.workload)
    env = {} if args.malloc_default else MALLOC_ENV
    report: dict = {"meta": {**_meta(argv, w), "workload_kind": args.workload, "rank_env": env}}
    report["cost_model"] = cost_table = cost_model_table(w)
    if not args.cost_model:
        configs = [c for c in args.configs.split(",") if c]
        unknown = sorted(set(configs) - set(CONFIGS))
        if unknown:
            parser.error(f"unknown configs {unknown}; choose from {CONFIGS}")
        names = ("steps", "warmup", "census_steps", "timeout", "dtrec_backend", "pipeline",
                 "profile")  # fmt: skip
        opts = {**{k: getattr(args, k) for k in names}, "env": env}
        libs = ["dtrec"] if args.no_torchrec else ["dtrec", "torchrec"]
        calibration = None
        if not args.no_predict:  # imported here: it imports this module
            from benchmarks.distributed_predict import calibrate

            calibration = report["meta"]["cpu_calibration"] = calibrate(w, args.world_size)
            print(f"[calibration] ok ({calibration['wall_s']:.0f} s)", flush=True)
        results: dict[str, dict[str, dict]] = {}
        for config in configs:
            results[config] = {}
            for lib in libs:
                run = run_config(lib, config, w, opts, args.world_size)
                results[config][lib] = run
                state = run["status"]
                ms = f"{run['median']['step_ms']:.1f} ms/step" if state == "ok" else ""
                load = "load {:.1f} -> {:.1f}".format(*run["load_avg"])
                first = run.get("ranks", [{}])[0]
                update = first.get("cpu_rowwise_adagrad")
                update = f", row-wise Adagrad on {update}" if update else ""
                if first.get("cpu_kernels") is not None:  # dtrec.kernels.cpu built or not
                    update += ", C kernels " + ("on" if first["cpu_kernels"] else "off")
                print(f"[{config} {lib}] {state} {ms} ({run['wall_s']:.0f} s, {load}{update})",
                      flush=True)  # fmt: skip
        report["results"] = results
        if args.profile:
            write_profiles(args.profile_out, results)
        print()
        print_table(results)
        report["targets"] = check_targets(results, args.target)
        print_stage_table(results)
        print_stage_table(results, "stage_cpu_ms")
        if args.pipeline:
            print_pipeline_table(results)
        if calibration is not None:
            from benchmarks.distributed_predict import calibrate, check

            after = report["meta"]["cpu_calibration_after"] = calibrate(w, args.world_size)
            report["step_prediction"] = check(w, results, calibration, args.world_size, after)
        after = dtrec_source()
        if after["sources_sha256"] != report["meta"]["dtrec"]["sources_sha256"]:
            report["meta"]["dtrec_at_end"] = after  # worlds started later ran the new code
            print("WARNING: dtrec's sources changed during the run (see meta.dtrec_at_end)")
    print_cost_model(cost_table)
    print(f"processor: {processor_line(report['meta']['processor'])}")
    if args.json:
        write_report(args.json, report)


if __name__ == "__main__":
    main()
