"""Sequence embeddings, dtrec vs TorchRec: a sharded ``EmbeddingCollection`` on W gloo ranks.

Model: 4 tables (rows geometric 1e5..1e6 times ``--scale``, D=64, one feature each), each
sample's sequence 10..30 ids (uniform), ids Zipf(1.1) over the table's rows (as
``benchmarks/distributed.py``), ``--batch`` samples per rank; the looked-up rows of each
feature -> ``Linear(64, 64)`` -> ReLU -> mean over the sequence -> concatenated ->
``Linear(256, 1)``, BCE-with-logits vs random labels (every row's gradient is distinct).
Tables: fused exact row-wise Adagrad (lr 0.01, eps 1e-8); dense: ``torch.optim.Adagrad``,
data parallel (dtrec's replicated DTensor parameters, TorchRec DDP). Rank r's batch of
step s is drawn from the seed (r, s) alike for both libraries, and both start from the same
table weights.

Configs (``--configs``): ``table_wise`` (table i on rank i % W), ``row_wise``,
``column_wise`` (each table's 64 columns split over the W ranks), on one shard group of
W ranks (dtrec mesh (W, 1); TorchRec ``DistributedModelParallel`` with its
``EmbeddingCollectionSharder``). Every (library, config) runs in a fresh world;
``--warmup`` steps, then ``--steps`` timed steps, each after a barrier outside the
timed region. Bytes: every ``torch.distributed`` collective is wrapped during the timed
steps and charged what this rank sends (see ``benchmarks.probes.comm.CommCounter``);
DDP's dense all-reduce (the same for both) is not included.

    .venv/bin/python -m benchmarks.sequence --steps 10 --warmup 3 \\
        --json benchmarks/results/sequence_cpu_<date>.json
    .venv/bin/python -m benchmarks.sequence --scale 0.01 --steps 2 --warmup 1 --batch 16  # smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import dtrec
from benchmarks.common.run_loop import MALLOC_ENV
from benchmarks.common.workloads import per_feature_batch
from benchmarks.probes.comm import CollectiveCensus, CommCounter
from benchmarks.probes.report import dtrec_source
from benchmarks.probes.sequence_stages import (
    PART_OF,
    dtrec_sequence_targets,
    torchrec_sequence_targets,
)
from benchmarks.probes.stages import ExclusiveStageTimer, HostReads, print_stage_table
from benchmarks.probes.stages import train_step as stage_train_step
from tests.multiprocess import WorldError, run_world

CONFIGS = ("table_wise", "row_wise", "column_wise")
LIBS = ("dtrec", "torchrec")


@dataclass(frozen=True)
class Workload:
    rows: tuple[int, ...]
    dim: int = 64
    batch: int = 256
    min_len: int = 10
    max_len: int = 30
    zipf: float = 1.1
    lr: float = 0.01
    eps: float = 1e-8


def workload(scale: float = 1.0, batch: int = 256) -> Workload:
    rows = tuple(max(8, int(scale * 1e5 * 10 ** (i / 3))) for i in range(4))
    return Workload(rows=rows, batch=batch)


def make_batch(w: Workload, rank: int, step: int) -> tuple[list[str], Tensor, Tensor, Tensor]:
    """Rank ``rank``'s batch of step ``step``: keys, ids, lengths, labels."""
    features = [(f"f{i}", rows, (w.min_len, w.max_len)) for i, rows in enumerate(w.rows)]
    return per_feature_batch(features, w.batch, w.zipf, rank, step)


class SequenceHead(nn.Module):
    """Per-feature rows -> Linear -> ReLU -> mean over each sequence -> one logit."""

    def __init__(self, features: int, dim: int) -> None:
        super().__init__()
        self.item = nn.Linear(dim, dim)
        self.out = nn.Linear(features * dim, 1)

    def forward(self, per_feature: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
        pooled = []
        for rows, lengths in per_feature:
            hidden = F.relu(self.item(rows))
            sample = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
            summed = torch.zeros(lengths.numel(), hidden.shape[1]).index_add(0, sample, hidden)
            pooled.append(summed / lengths.clamp_min(1).unsqueeze(1))
        return self.out(torch.cat(pooled, dim=1)).squeeze(1)


class Model(nn.Module):
    def __init__(self, ec: nn.Module, features: int, dim: int) -> None:
        super().__init__()
        self.ec = ec
        self.dense = SequenceHead(features, dim)
        self.features = [f"f{i}" for i in range(features)]

    def forward(self, kjt: object) -> Tensor:
        out = self.ec(kjt)  # TorchRec's sharded EC: a lazy dict, indexed by key only
        return self.dense([(out[k].values(), out[k].lengths()) for k in self.features])


def initial_weights(w: Workload) -> dict[str, Tensor]:
    """The tables' starting weights (same for both libraries)."""
    gen = torch.Generator().manual_seed(0)
    return {
        f"t{i}": (torch.rand(rows, w.dim, generator=gen) - 0.5) * 2 / rows**0.5
        for i, rows in enumerate(w.rows)
    }


def _dtrec_plan(config: str, tables: int, world: int) -> dict:
    from dtrec.placements import ColumnWise, RowWise, TableWise

    if config == "table_wise":
        return {f"ec.t{i}": TableWise(rank=i % world) for i in range(tables)}
    if config == "row_wise":
        return {f"ec.t{i}": RowWise() for i in range(tables)}
    return {f"ec.t{i}": ColumnWise() for i in range(tables)}


def build_dtrec(w: Workload, config: str) -> tuple[nn.Module, list, type]:
    world = dist.get_world_size()
    tables = [
        dtrec.EmbeddingConfig(f"t{i}", rows, w.dim, [f"f{i}"]) for i, rows in enumerate(w.rows)
    ]
    ec = dtrec.EmbeddingCollection(tables)
    with torch.no_grad():
        for name, weight in initial_weights(w).items():
            ec.embeddings[name].weight.copy_(weight)
    model = Model(ec, len(tables), w.dim)
    fused = dtrec.optim.RowWiseAdagrad(lr=w.lr, eps=w.eps)
    model = dtrec.distribute_module(
        model,
        dtrec.init_mesh("cpu", world),
        _dtrec_plan(config, len(tables), world),
        optimizer=fused,
    )
    return model, [torch.optim.Adagrad(model.dense.parameters(), lr=w.lr)], dtrec.KeyedJaggedTensor


def build_torchrec(w: Workload, config: str) -> tuple[nn.Module, list, type]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    world = dist.get_world_size()
    tables = [
        EmbeddingConfig(
            name=f"t{i}", num_embeddings=rows, embedding_dim=w.dim, feature_names=[f"f{i}"]
        )
        for i, rows in enumerate(w.rows)
    ]
    ec = EmbeddingCollection(tables, device=torch.device("cpu"))
    with torch.no_grad():
        for name, weight in initial_weights(w).items():
            ec.embeddings[name].weight.copy_(weight)
    model = Model(ec, len(tables), w.dim)
    sharder = EmbeddingCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": w.lr,
            "eps": w.eps,
        }
    )
    if config == "table_wise":
        per_table = {
            f"t{i}": table_wise(rank=i % world, compute_kernel="fused") for i in range(len(tables))
        }
    elif config == "row_wise":
        per_table = {f"t{i}": row_wise(compute_kernel="fused") for i in range(len(tables))}
    else:
        per_table = {
            f"t{i}": column_wise(ranks=list(range(world)), compute_kernel="fused")
            for i in range(len(tables))
        }
    module_plan = construct_module_sharding_plan(
        model.ec, per_table, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
    )
    sharded = DistributedModelParallel(
        model,
        device=torch.device("cpu"),
        plan=ShardingPlan({"ec": module_plan}),
        sharders=[sharder],
    )
    dense = [p for n, p in sharded.named_parameters() if ".dense." in f".{n}"]
    return sharded, [torch.optim.Adagrad(dense, lr=w.lr)], KeyedJaggedTensor


def run_rank(rank: int, world: int, lib: str, config: str, w: Workload, opts: dict) -> dict:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.manual_seed(0)
    build = build_dtrec if lib == "dtrec" else build_torchrec
    model, optimizers, kjt_type = build(w, config)
    warmup, steps = opts["warmup"], opts["steps"]
    batches = []
    for s in range(warmup + steps + 1):  # the last: the untimed census step
        keys, values, lengths, labels = make_batch(w, rank, s)
        batches.append(
            (kjt_type.from_lengths_sync(keys=keys, values=values, lengths=lengths), labels)
        )

    losses: list[float] = []
    timer = ExclusiveStageTimer()

    def train_step(kjt: object, labels: Tensor) -> float:
        return stage_train_step(model, optimizers, timer, kjt, labels)

    def step(s: int) -> float:
        dist.barrier()  # start together; the barrier is outside the timed region
        start = time.perf_counter()
        losses.append(train_step(*batches[s]))
        return 1e3 * (time.perf_counter() - start)

    for s in range(warmup):
        step(s)
    counter = CommCounter()
    targets = (dtrec_sequence_targets if lib == "dtrec" else torchrec_sequence_targets)(model)
    timer.clear()
    with counter.active(), timer.wrapping(targets) as not_timed, dtrec.comm_stats() as ours:
        step_ms = [step(s) for s in range(warmup, warmup + steps)]
    per_step = counter.per_step(steps)
    # the dense all-reduce is left out for both: TorchRec's DDP runs it in C++, unseen by the
    # wrappers; dtrec's (dense.grad_sync) is a Python c10d call they see
    dense = sum(v for k, v in ours.bytes_sent.items() if k.startswith("dense.")) / steps
    if dense and "all_reduce" in per_step:
        per_step["all_reduce"]["bytes"] -= dense
    stage_ms = timer.per_step(steps, PART_OF)
    stage_cpu_ms = timer.per_step(steps, PART_OF, cpu=True)
    # one more, untimed step: collectives (DDP's included) and host reads of tensor data
    census, reads = CollectiveCensus(), HostReads(torch.device("cpu"))
    dist.barrier()
    with census, reads.counting():
        train_step(*batches[-1])
    return {
        "median_ms": statistics.median(step_ms),
        "step_ms": step_ms,
        "losses": losses,
        "bytes_by_collective": per_step,
        "bytes_per_step": sum(v["bytes"] for v in per_step.values()),
        "calls_per_step": sum(v["calls"] for v in per_step.values()),
        "stage_ms": stage_ms,
        "stage_cpu_ms": stage_cpu_ms,
        "stages_not_timed": not_timed,
        "collectives_per_step": sum(census.calls.values()),
        "host_reads_per_step": sum(reads.sites.values()),
        "host_read_sites": dict(reads.sites.most_common()),
    }


def run_config(lib: str, config: str, w: Workload, opts: dict, world: int) -> dict:
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    try:
        ranks = run_world(world, run_rank, lib, config, w, opts, timeout=1200.0, env=opts["env"])
    except WorldError as exc:
        return {"status": "failed", "error": str(exc)[-4000:]}
    med = statistics.median
    return {
        "status": "ok",
        "wall_s": time.perf_counter() - start,
        "load_avg": [load_before, os.getloadavg()[0]],
        "step_ms": med(r["median_ms"] for r in ranks),
        "bytes_per_step": med(r["bytes_per_step"] for r in ranks),
        "collectives_per_step": med(r["calls_per_step"] for r in ranks),
        "bytes_by_collective": {
            k: med(r["bytes_by_collective"].get(k, {}).get("bytes", 0) for r in ranks)
            for k in sorted({k for r in ranks for k in r["bytes_by_collective"]})
        },
        "losses_rank0": ranks[0]["losses"],
        # medians over ranks in ``benchmarks/probes/stages.py``'s shape (``print_stage_table``)
        "median": {
            "step_ms": med(r["median_ms"] for r in ranks),
            **{
                key: {k: med(r[key][k] for r in ranks) for k in ranks[0][key]}
                for key in ("stage_ms", "stage_cpu_ms")
            },
            "collectives_per_step": med(r["collectives_per_step"] for r in ranks),
            "host_reads_per_step": med(r["host_reads_per_step"] for r in ranks),
        },
        "stages_not_timed": ranks[0]["stages_not_timed"],
        "host_read_sites_rank0": ranks[0]["host_read_sites"],
        "ranks": ranks,
    }


def print_table(results: dict[str, dict[str, dict]]) -> None:
    print(
        f"{'config':<12} {'lib':<9} {'step ms':>9} {'bytes/step':>12} {'colls':>6}  by collective"
    )
    for config, by_lib in results.items():
        for lib, r in by_lib.items():
            if r["status"] != "ok":
                print(f"{config:<12} {lib:<9} FAILED: {r['error'][-200:]}")
                continue
            kinds = ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in r["bytes_by_collective"].items())
            print(
                f"{config:<12} {lib:<9} {r['step_ms']:9.1f} {r['bytes_per_step'] / 1e6:10.2f}MB "
                f"{r['collectives_per_step']:6.1f}  {kinds}"
            )
        ok = [by_lib.get(lib, {}) for lib in LIBS]
        if all(r.get("status") == "ok" for r in ok):
            ours, theirs = ok
            print(
                f"{'':<12} {'ratio':<9} {ours['step_ms'] / theirs['step_ms']:9.2f} "
                f"{ours['bytes_per_step'] / max(theirs['bytes_per_step'], 1):12.2f}"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--libs", default=",".join(LIBS))
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    w = workload(args.scale, args.batch)
    opts = {"steps": args.steps, "warmup": args.warmup, "env": MALLOC_ENV}
    results: dict[str, dict[str, dict]] = {}
    for config in args.configs.split(","):
        if config not in CONFIGS:
            raise SystemExit(f"unknown config {config!r}; choose from {CONFIGS}")
        results[config] = {
            lib: run_config(lib, config, w, opts, args.world) for lib in args.libs.split(",")
        }
    print_table(results)
    print_stage_table(results)
    print_stage_table(results, "stage_cpu_ms")
    if args.json:
        report = {
            "meta": {
                "argv": sys.argv,
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "dtrec": dtrec_source(),
                "workload": asdict(w),
                "uptime_load_avg": os.getloadavg(),
            },
            "results": {
                c: {lib: {k: v for k, v in r.items() if k != "ranks"} for lib, r in by.items()}
                for c, by in results.items()
            },
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
