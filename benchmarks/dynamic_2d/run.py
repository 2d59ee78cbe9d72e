"""dtrec with a mesh per collection vs TorchRec's Dynamic 2D, side by side on W gloo CPU ranks.

TorchRec's ``DMPCollection(..., submodule_configs=[DMPCollectionConfig(...)])`` gives each
module type its own sharding group size ("Dynamic 2D", TorchRec #3177); dtrec takes the same
``DMPCollectionConfig`` list through ``dtrec.interop.dmp_collection.dmp_collection_meshes``
and shards each collection on a mesh of its own. This benchmark trains one model both ways
and checks that they end with the same weights.

Model (``MixedModel``, in benchmarks/dynamic_2d/model.py): a pooled collection
(``torchrec.EmbeddingBagCollection`` ``pooled``: tables ``p<i>``, feature ``pf<i>``, sum
pooling) and a sequence collection (``torchrec.EmbeddingCollection`` ``seq``: tables
``s<i>``, feature ``sf<i>``); the pooled
rows and each sequence feature's per-sample sum of rows -> Linear(., 64) -> ReLU ->
Linear(64, 1), BCE-with-logits vs random labels. Bags of 10..30 ids (sequences 5..15), ids
Zipf(1.1) scattered over the rows (``benchmarks.common.workloads.zipf_ids``). Rank r's batch of
step s comes from the seed (r, s) for every library. Both libraries start from one
reference model's weights (uniform in +-0.1 from seed 0: TorchRec's sharded tables are
overwritten with it).

Configs: ``DMPCollectionConfig(EmbeddingBagCollection, plan, S_pooled)`` and
``DMPCollectionConfig(EmbeddingCollection, plan, S_seq)``, plans by TorchRec's own helpers
(``construct_module_sharding_plan``, per table "tw:<r>", "rw" or "cw"), built afresh for
each library (``DMPCollection`` remaps a plan in place). Default: W=8, pooled 4 x 2 (S=4,
R=2), sequence 8 x 1.

Optimizers: the tables' SGD fused into backward (TorchRec: FBGEMM ``EXACT_SGD`` via the
sharders' ``fused_params``, its recipe; dtrec: ``dtrec.optim.SGD``), the dense part's
``torch.optim.SGD``, data parallel over all W ranks (TorchRec DDP; dtrec's replicated
DTensor parameters). Replicas are synchronised every step (k=1), in three runs:

* ``torchrec``: ``DMPCollection.sync()`` after every step (each replica group steps on its
  own, then weights are averaged over the replica groups: the CPU patches in
  ``benchmarks/common/torchrec_side.py``);
* ``dtrec``: dtrec's exact per-step sync (the default, ``sync_every=None``: replica
  gradients summed in backward, one update);
* ``dtrec_k1``: ``sync_every=1``, TorchRec's scheme (weights averaged after every step,
  the average overlapped with the next step).

For SGD all three are the same step; the weights after the last step must agree within
the numerics contract (``--tolerance``, relative to the largest weight of a tensor).

One world of W processes runs all three, each model trained in blocks of ``--steps``
steps, ``--rounds`` times, the libraries taking turns (machine load drifts; turns spread
it). Timing and bytes as in ``benchmarks/distributed.py``: a ``dist.barrier()`` before every
step outside the timed region, ``CommCounter`` (wrapped ``torch.distributed`` collectives)
during one library's steps only, DDP's C++ all-reduce as ``dense_ddp_estimate``, one
untimed census step per library, ``dtrec.comm_stats()`` for dtrec's own kinds.

    .venv/bin/python -m benchmarks.dynamic_2d --steps 5 --rounds 3 \\
        --json benchmarks/results/dynamic_2d_cpu_2026-11-27.json      # W=8, about 4 min here
    .venv/bin/python -m benchmarks.dynamic_2d --world-size 4 --pooled-shards 2 \\
        --seq-shards 4 --scale 0.001 --batch 8 --steps 2 --rounds 1    # smoke, about 40 s

2026-11-27, 2 cores (AMD EPYC, AVX512), load average 15-30 from other jobs: weights equal
(max relative difference 7.5e-7 exact sync, 1.5e-7 ``sync_every=1``); step time 0.61x
TorchRec's (exact sync: sparse gradient all-gather, 1.3 MB, instead of the whole replicated
shards' 12.2 MB weight all-reduce) and 0.93x (``sync_every=1``, the same all-reduce);
bytes 0.24x and 0.99x.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import Tensor, nn

import dtrec
from benchmarks.common.report import run_meta
from benchmarks.common.run_loop import MALLOC_ENV, quiet
from benchmarks.dynamic_2d.model import (
    LR,
    MixedModel,
    MixedWorkload,
    compare_weights,
    dmp_collection_configs,
    make_batch,
    reference_model,
    torchrec_sharders,
)
from benchmarks.probes.comm import CollectiveCensus, CommCounter
from benchmarks.probes.machine import processor_line
from benchmarks.probes.report import write_report
from benchmarks.probes.stages import ExclusiveStageTimer
from benchmarks.probes.stages import train_step as stage_train_step
from dtrec.comm.collectives import CommStats
from tests.multiprocess import WorldError, run_world

LIBS = ("torchrec", "dtrec", "dtrec_k1")
# --------------------------------------------------------------------------- one rank


@dataclass
class Side:
    """One library's sharded model, its dense optimizer, per-step hook and counters."""

    name: str
    model: nn.Module
    optimizers: list[torch.optim.Optimizer]
    hook: Callable[[], None] | None
    kjt_type: type
    ddp_estimate: int = 0
    """Bytes of DDP's gradient all-reduces (C++, unseen by ``CommCounter``) per step."""
    step_ms: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    counter: CommCounter = field(default_factory=CommCounter)
    stats: CommStats = field(default_factory=CommStats)


def _build_torchrec(reference: MixedModel, w: MixedWorkload) -> Side:
    from benchmarks.common import torchrec_side as trb

    model = copy.deepcopy(reference)
    sharders = torchrec_sharders()
    sharded = trb.cpu_dmp_collection(
        module=model,
        device=torch.device("cpu"),
        plan=trb.ShardingPlan({}),
        world_size=dist.get_world_size(),
        sharding_group_size=dist.get_world_size(),  # the default context: nothing left
        global_pg=dist.group.WORLD,
        sharders=list(sharders.values()),
        submodule_configs=dmp_collection_configs(model, w),
    )
    trb.load_full_weights(sharded, reference.state_dict())  # DMP made its own tables
    dense = [p for n, p in sharded.named_parameters() if n.startswith("dense.")]
    ddp = trb.ddp_estimate(
        [(m.process_group, m._module_parameters) for m in trb.ddp_modules(sharded)]
    )
    return Side("torchrec", sharded, [torch.optim.SGD(dense, lr=LR)], sharded.sync,
                trb.KeyedJaggedTensor, ddp)  # fmt: skip


def _build_dtrec(reference: MixedModel, w: MixedWorkload, sync_every: int | None) -> Side:
    from dtrec.interop.dmp_collection import dmp_collection_meshes

    model = copy.deepcopy(reference)
    meshes, plan = dmp_collection_meshes(model, dmp_collection_configs(model, w), "cpu")
    mesh = dtrec.init_mesh("cpu", dist.get_world_size())  # the dense part's (and no table's)
    sharded = dtrec.distribute_module(
        model, mesh, plan, optimizer=dtrec.optim.SGD(lr=LR), sync_every=sync_every,
        meshes=meshes,
    )  # fmt: skip
    dense = [p for n, p in sharded.named_parameters() if n.startswith("dense.")]
    name = "dtrec" if sync_every is None else f"dtrec_k{sync_every}"
    return Side(name, sharded, [torch.optim.SGD(dense, lr=LR)], None, dtrec.KeyedJaggedTensor)


def _full_weights(side: Side) -> dict[str, Tensor]:
    """Every parameter of ``side``'s model as a full tensor, by the unsharded model's key."""
    from dtrec.checkpoint import full_state_dict

    if side.name == "torchrec":
        from benchmarks.common.torchrec_side import full_weights

        return full_weights(side.model)
    return full_state_dict(side.model)


def run_rank(rank: int, world: int, w: MixedWorkload, opts: dict) -> dict:
    """Build every library's model from one reference, train them in turns, compare."""
    quiet()
    libs = opts.get("libs", LIBS)
    reference = reference_model(w)
    initial = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    builders = {
        "torchrec": lambda: _build_torchrec(reference, w),
        "dtrec": lambda: _build_dtrec(reference, w, None),
        "dtrec_k1": lambda: _build_dtrec(reference, w, 1),
    }
    sides = {lib: builders[lib]() for lib in libs}
    warmup, steps, rounds = opts["warmup"], opts["steps"], opts["rounds"]
    total = warmup + steps * rounds + 1  # + the census step
    raw = [make_batch(w, rank, s) for s in range(total)]
    timer = ExclusiveStageTimer()  # no stage targets: the step as a whole

    def step(side: Side, s: int) -> float:
        keys, values, lengths, labels = raw[s]
        kjt = side.kjt_type(keys=keys, values=values, lengths=lengths)
        dist.barrier()  # start together, outside the timed region
        start = time.perf_counter()
        loss = stage_train_step(side.model, side.optimizers, timer, kjt, labels, side.hook)
        side.losses.append(loss)
        return 1e3 * (time.perf_counter() - start)

    done = dict.fromkeys(libs, 0)
    for lib, side in sides.items():
        for _ in range(warmup):
            step(side, done[lib])
            done[lib] += 1
    for _ in range(rounds):
        for lib, side in sides.items():
            with dtrec.comm_stats() as stats, side.counter.active():
                for _ in range(steps):
                    side.step_ms.append(step(side, done[lib]))
                    done[lib] += 1
            for kind, n in stats.calls.items():
                side.stats.record(kind, stats.bytes_sent[kind], stats.seconds[kind], n)
    census = {}
    for lib, side in sides.items():
        with CollectiveCensus() as c:
            step(side, done[lib])
        census[lib] = {k: c.bytes[k] for k in sorted(c.calls)}
    weights = {lib: _full_weights(side) for lib, side in sides.items()}
    timed = steps * rounds
    out: dict = {"rank": rank, "libs": {}, "weights": {}}
    for lib, side in sides.items():
        nbytes = side.counter.per_step(timed)
        out["libs"][lib] = {
            "step_ms": side.step_ms,
            "median_ms": statistics.median(side.step_ms),
            "losses": side.losses,
            "bytes_by_collective": nbytes,
            "bytes_per_step": sum(v["bytes"] for v in nbytes.values()),
            "dense_ddp_estimate": side.ddp_estimate,
            "census_bytes": census[lib],
            "dtrec_comm_stats": side.stats.per_step(timed) if lib != "torchrec" else None,
        }
    base = "torchrec" if "torchrec" in weights else libs[0]
    for lib in weights:
        if lib != base:
            key = f"{lib}_vs_{base}"
            out["weights"][key] = compare_weights(weights[lib], weights[base], initial)
            pairs = zip(sides[lib].losses, sides[base].losses, strict=True)
            out["weights"][key]["loss_diff"] = max(abs(a - b) for a, b in pairs)
    dist.barrier()
    return out


# --------------------------------------------------------------------------- driver


def run(w: MixedWorkload, opts: dict, world: int) -> dict:
    """One world running every library; medians over ranks, the weights check."""
    start = time.perf_counter()
    try:
        ranks = run_world(
            world, run_rank, w, opts, timeout=opts.get("timeout", 1800.0),
            collective_timeout=opts.get("timeout", 1800.0), env=opts.get("env"),
        )  # fmt: skip
    except WorldError as exc:
        wall = time.perf_counter() - start
        return {"status": "failed", "error": str(exc)[-8000:], "wall_s": wall}
    med = statistics.median
    summary = {}
    for lib in ranks[0]["libs"]:
        per = [r["libs"][lib] for r in ranks]
        kinds = sorted({k for p in per for k in p["bytes_by_collective"]})
        entry = {
            "step_ms": med(p["median_ms"] for p in per),
            "step_ms_slowest_rank": max(p["median_ms"] for p in per),
            "bytes_by_collective": {
                k: med(p["bytes_by_collective"].get(k, {}).get("bytes", 0) for p in per)
                for k in kinds
            },
            "calls_by_collective": {
                k: med(p["bytes_by_collective"].get(k, {}).get("calls", 0) for p in per)
                for k in kinds
            },
            "bytes_per_step": med(p["bytes_per_step"] for p in per),
            "dense_ddp_estimate": med(p["dense_ddp_estimate"] for p in per),
        }
        entry["total_bytes_per_step"] = entry["bytes_per_step"] + entry["dense_ddp_estimate"]
        census = sorted({k for p in per for k in p["census_bytes"]})
        entry["census_bytes"] = {k: med(p["census_bytes"].get(k, 0) for p in per) for k in census}
        if per[0]["dtrec_comm_stats"] is not None:
            names = sorted({k for p in per for k in p["dtrec_comm_stats"]})
            entry["dtrec_comm_stats"] = {
                k: med(p["dtrec_comm_stats"].get(k, {}).get("bytes", 0) for p in per) for k in names
            }
        summary[lib] = entry
    checks = {}
    for key in ranks[0]["weights"]:
        per = [r["weights"][key] for r in ranks]
        worst = max(per, key=lambda d: d["max_rel"])
        checks[key] = worst
    return {
        "status": "ok",
        "wall_s": time.perf_counter() - start,
        "median": summary,
        "weights": checks,
        "ranks": ranks,
    }


def verdict(result: dict, tolerance: float, update_tolerance: float = 1e-2) -> dict:
    """Did every library end with TorchRec's weights: within ``tolerance`` of the weights'
    size (the numerics contract) and ``update_tolerance`` of what training changed, every
    tensor having changed? Step-time and bytes ratios to TorchRec."""
    checks = result["weights"]
    equal = {
        k: v["max_rel"] <= tolerance and v["of_update"] <= update_tolerance and v["least_moved"] > 0
        for k, v in checks.items()
    }
    out = {
        "tolerance": tolerance,
        "update_tolerance": update_tolerance,
        "weights_equal": equal,
        "passed": bool(equal) and all(equal.values()),
    }
    med = result["median"]
    if "torchrec" in med:
        for lib in med:
            if lib != "torchrec":
                out[f"{lib}_step_ratio"] = med[lib]["step_ms"] / med["torchrec"]["step_ms"]
                out[f"{lib}_bytes_ratio"] = med[lib]["total_bytes_per_step"] / max(
                    med["torchrec"]["total_bytes_per_step"], 1
                )
    return out


def print_report(result: dict, check: dict) -> None:
    """Step times, bytes per collective and the weights check, one library a line."""
    for lib, m in result["median"].items():
        parts = ", ".join(f"{k} {v:,.0f} B" for k, v in m["bytes_by_collective"].items())
        print(f"{lib:>9}: {m['step_ms']:8.1f} ms/step  {m['total_bytes_per_step']:12,.0f} B/step "
              f"({parts}; DDP est. {m['dense_ddp_estimate']:,.0f} B)")  # fmt: skip
        if "dtrec_comm_stats" in m:
            print("           comm_stats: " + ", ".join(
                f"{k} {v:,.0f} B" for k, v in m["dtrec_comm_stats"].items()))  # fmt: skip
    for key, v in result["weights"].items():
        print(f"  weights {key}: max abs {v['max_abs']:.3g}, max rel {v['max_rel']:.3g} "
              f"({v['worst_key']}), {v['of_update']:.3g} of the update (least moved "
              f"{v['least_moved']:.3g}); losses differ by {v['loss_diff']:.3g}")  # fmt: skip
    ratios = {k: v for k, v in check.items() if k.endswith("_ratio")}
    print("  " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    print(f"  weights equal within {check['tolerance']:g}: {check['passed']}")


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--pooled-shards", type=int, default=4, help="S of the pooled collection")
    parser.add_argument("--seq-shards", type=int, default=8, help="S of the sequence collection")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies table rows")
    parser.add_argument("--batch", type=int, default=256, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=2, help="turns per library")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--tolerance", type=float, default=1e-5,
                        help="weights diff over the largest weight, per tensor")  # fmt: skip
    parser.add_argument("--update-tolerance", type=float, default=1e-2,
                        help="weights diff over the largest change in training")  # fmt: skip
    parser.add_argument("--libs", default=",".join(LIBS), help=f"of {LIBS}")
    parser.add_argument("--timeout", type=float, default=1800.0, help="the world's, seconds")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    w = replace(
        MixedWorkload(pooled_shards=args.pooled_shards, seq_shards=args.seq_shards),
        batch=args.batch,
    ).scaled(args.scale)
    libs = tuple(x for x in args.libs.split(",") if x)
    if set(libs) - set(LIBS):
        parser.error(f"unknown libs {sorted(set(libs) - set(LIBS))}; choose from {LIBS}")
    opts = {"warmup": args.warmup, "steps": args.steps, "rounds": args.rounds, "libs": libs,
            "timeout": args.timeout, "env": MALLOC_ENV}  # fmt: skip
    meta = run_meta("benchmarks.dynamic_2d", argv, w)
    meta["command"] = " ".join(["python -m benchmarks.dynamic_2d", *argv])
    meta["world_size"] = args.world_size
    meta["sync"] = (
        "k=1: torchrec DMPCollection.sync() after every step; dtrec exact per-step "
        "gradient sync (sync_every=None); dtrec_k1 sync_every=1 (weights averaged, overlapped)"
    )
    result = run(w, opts, args.world_size)
    report = {"meta": meta, "result": result}
    if result["status"] == "ok":
        report["verdict"] = verdict(result, args.tolerance, args.update_tolerance)
        print_report(result, report["verdict"])
    else:
        print(result["error"])
    print(f"processor: {processor_line(meta['processor'])}")
    if args.json:
        write_report(args.json, report)
    return report


if __name__ == "__main__":
    main()
