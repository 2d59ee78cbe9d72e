"""The composed HSTU model (examples/hstu_composed.py) three ways on 8 gloo ranks: step time,
peak RSS and the dense part's memory per rank, dtrec vs TorchRec.

Modes, each in a fresh world of 8 ranks (one after the other, in one sitting):

- ``dtrec_tp_hsdp``: the example's composition: world mesh (dp_replicate 2, dp_shard 2,
  tp 2), the blocks TP over "tp" then HSDP, the tables on ``dtrec.table_mesh`` (4 shard
  ranks x 2 replicas) with ``same_batch=world["tp"]`` (``hstu_composed.parallelize``); the
  two tp ranks of a dp group share a batch, so a step sees 4 distinct batches;
- ``dtrec_fsdp``: FSDP2 only (``fully_shard`` per block, then the dense tower) over all 8
  ranks, the tables sharded over the 8 ranks (mesh (8, 1)); 8 distinct batches;
- ``torchrec_ddp``: the same tables in TorchRec's ``EmbeddingCollection`` /
  ``EmbeddingBagCollection`` under ``DistributedModelParallel`` with the example's plan
  written as TorchRec plan helpers over the 8 ranks (row-wise, table-wise, column-wise over
  4 ranks; built by hand, as ``benchmarks/common/torchrec_side.py``: the planner offers no
  row-wise on CPU), the dense tower under DDP (DMP's wrapper); rank r gets the same batch
  as in ``dtrec_fsdp`` and the same starting weights.

All three: tables updated in backward by fused exact row-wise Adagrad (fbgemm's CPU TBE has
no Adam), the dense tower by ``torch.optim.Adam``; ``--batch`` samples per dp group
(``hstu_composed.make_batch``). ``--warmup`` steps, then ``--repeats`` x ``--steps`` timed
steps, each after a barrier outside the timed region; a rank's step time is the best of its
repeats' medians, the report's the median over ranks. Memory per rank, after the last step:
the dense tower's parameters, gradients and Adam state (unique storages, so FSDP's padding
counts) next to the full dense model's (what DDP holds), the tables' weights and fused
optimizer state, and ``ru_maxrss``. Bytes: ``dtrec.comm_stats()`` over the timed steps, per
collective kind and per mesh dim (dtrec's own collectives: FSDP's, TP's and DDP's are not
in it).

    python -m benchmarks.composed --json benchmarks/results/composed_cpu_<date>.json
    python -m benchmarks.composed --steps 2 --warmup 1 --repeats 1 --batch 4  # smoke

8 ranks on a 2-core machine are oversubscribed: only the ratios measured side by side mean
anything.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import resource
import shlex
import statistics
import sys
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dtrec
from benchmarks.common.run_loop import MALLOC_ENV
from benchmarks.probes.machine import processor, processor_line
from benchmarks.probes.report import dtrec_source, write_report
from examples import hstu_composed as hstu
from tests.multiprocess import WorldError, run_world

MODES = ("dtrec_tp_hsdp", "dtrec_fsdp", "torchrec_ddp")
WORLD = 8
LR, EPS = 1e-2, 1e-8


# ---- building each mode ---------------------------------------------------------------


def _dtrec_tp_hsdp() -> tuple[nn.Module, int, int]:
    world = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    model = hstu.parallelize(hstu.HSTURecommender(), world, dtrec.optim.RowWiseAdagrad(LR, EPS))
    dp_group = world["dp_replicate"].get_local_rank() * 2 + world["dp_shard"].get_local_rank()
    return model, dp_group, 4


def _dtrec_fsdp() -> tuple[nn.Module, int, int]:
    world = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))
    model = hstu.HSTURecommender()
    for block in model.dense.blocks:
        fully_shard(block, mesh=world)
    fully_shard(model.dense, mesh=world)
    tables = dtrec.table_mesh(world, shard="dp_shard")
    fused = dtrec.optim.RowWiseAdagrad(LR, EPS)
    model = dtrec.distribute_module(model, tables, hstu.PLAN, optimizer=fused)
    return model, dist.get_rank(), WORLD


def _torchrec_plan(model: nn.Module, sharders: dict) -> object:
    """``hstu.PLAN`` as TorchRec plan helpers over the 8 ranks (column-wise: over 4 ranks,
    dtrec's shard axis size in the composed mode)."""
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan

    from dtrec.placements import ColumnWise, RowWise, TableWise

    def helper(spec: object):
        if isinstance(spec, RowWise):
            return row_wise(compute_kernel="fused")
        if isinstance(spec, TableWise):
            return table_wise(rank=spec.rank, compute_kernel="fused")
        if isinstance(spec, ColumnWise):
            return column_wise(ranks=[0, 1, 2, 3], compute_kernel="fused")
        raise ValueError(f"no TorchRec helper for {spec!r}")

    plan = {}
    for module in ("items", "users"):
        per_table = {
            key.split(".", 1)[1]: helper(spec)
            for key, spec in hstu.PLAN.items()
            if key.startswith(module + ".")
        }
        plan[module] = construct_module_sharding_plan(
            getattr(model, module),
            per_table,
            sharder=sharders[module],
            local_size=WORLD,
            world_size=WORLD,
            device_type="cpu",
        )
    return ShardingPlan(plan)


def _torchrec_ddp() -> tuple[nn.Module, int, int]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
        PoolingType,
    )
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from benchmarks.common.torchrec_side import load_full_weights

    model = hstu.HSTURecommender()  # dtrec's tables: their weights are the starting point
    full = {k: v.clone() for k, v in model.state_dict().items()}
    model.items = EmbeddingCollection(
        [
            EmbeddingConfig(
                name=c.name,
                num_embeddings=c.num_embeddings,
                embedding_dim=c.embedding_dim,
                feature_names=list(c.feature_names),
            )
            for c in model.items.embedding_configs()
        ],
        device=torch.device("meta"),
    )
    model.users = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                name=c.name,
                num_embeddings=c.num_embeddings,
                embedding_dim=c.embedding_dim,
                feature_names=list(c.feature_names),
                pooling=PoolingType.MEAN if c.pooling == "mean" else PoolingType.SUM,
            )
            for c in model.users.embedding_bag_configs()
        ],
        device=torch.device("meta"),
    )
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR, "eps": EPS}
    sharders = {
        "items": EmbeddingCollectionSharder(fused_params=fused),
        "users": EmbeddingBagCollectionSharder(fused_params=fused),
    }
    sharded = DistributedModelParallel(
        model,
        device=torch.device("cpu"),
        plan=_torchrec_plan(model, sharders),
        sharders=list(sharders.values()),
    )
    load_full_weights(sharded, full)
    return sharded, dist.get_rank(), WORLD


BUILD = {"dtrec_tp_hsdp": _dtrec_tp_hsdp, "dtrec_fsdp": _dtrec_fsdp, "torchrec_ddp": _torchrec_ddp}


def _to_torchrec(kjt: dtrec.KeyedJaggedTensor) -> object:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor.from_lengths_sync(
        keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths()
    )


# ---- memory ---------------------------------------------------------------------------


def _local_tensors(value: object) -> Iterable[Tensor]:
    """The tensors this rank holds for ``value`` (a tensor, DTensor, ShardedTensor or a
    nest of dicts/lists of them)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, DTensor):
        local = value.to_local()
        yield from (local.local_shards() if hasattr(local, "local_shards") else [local])
    elif isinstance(value, ShardedTensor):
        yield from (s.tensor for s in value.local_shards())
    elif isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _local_tensors(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _local_tensors(v)


def held_bytes(values: Iterable[object]) -> int:
    """Bytes of the unique storages under ``values``: a padded FSDP shard counts its
    padding, tensors viewing one buffer count it once."""
    storages = {}
    for t in _local_tensors(list(values)):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def memory(model: nn.Module, dense_opt: torch.optim.Optimizer, full_dense: int, n: int) -> dict:
    dense = [p for name, p in model.named_parameters() if ".dense." in f".{name}"]
    tables = {k: v for k, v in model.state_dict().items() if ".dense." not in f".{k}"}
    fused = getattr(model, "fused_optimizer", None)
    return {
        "dense_param_bytes": held_bytes(dense),
        "dense_grad_bytes": held_bytes(p.grad for p in dense if p.grad is not None),
        "dense_optimizer_bytes": held_bytes(dense_opt.state.values()),
        # the unsharded dense tower and what torch.optim.Adam keeps for it (exp_avg,
        # exp_avg_sq, a 4-byte step per parameter)
        "full_dense_param_bytes": full_dense,
        "full_dense_grad_bytes": full_dense,
        "full_dense_optimizer_bytes": 2 * full_dense + 4 * n,
        "table_weight_bytes": held_bytes(tables.values()),
        "table_optimizer_bytes": held_bytes([fused.state_dict()]) if fused is not None else 0,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB
    }


# ---- one rank -------------------------------------------------------------------------


def run_rank(rank: int, world: int, mode: str, opts: dict) -> dict:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.manual_seed(0)  # the same initial model on every rank and in every mode
    reference = hstu.HSTURecommender()
    full_dense = sum(p.numel() * p.element_size() for p in reference.dense.parameters())
    n_dense = len(list(reference.dense.parameters()))
    del reference
    torch.manual_seed(0)
    model, dp_group, dp_groups = BUILD[mode]()
    dense = [p for name, p in model.named_parameters() if ".dense." in f".{name}"]
    opt = torch.optim.Adam(dense, lr=LR)
    loss_fn = nn.BCEWithLogitsLoss()
    convert = _to_torchrec if mode.startswith("torchrec") else (lambda kjt: kjt)
    total = opts["warmup"] + opts["repeats"] * opts["steps"]
    batches = []
    for step in range(total):
        seq, user, labels = hstu.make_batch(step, dp_group, opts["batch"], torch.device("cpu"))
        batches.append((convert(seq), convert(user), labels))
    losses: list[float] = []

    def step(s: int) -> float:
        dist.barrier()  # start together; outside the timed region
        start = time.perf_counter()
        loss = loss_fn(model(batches[s][0], batches[s][1]), batches[s][2])
        opt.zero_grad()
        loss.backward()
        opt.step()
        elapsed = 1e3 * (time.perf_counter() - start)
        losses.append(loss.item())
        return elapsed

    for s in range(opts["warmup"]):
        step(s)
    medians = []
    with dtrec.comm_stats() as stats:
        for r in range(opts["repeats"]):
            first = opts["warmup"] + r * opts["steps"]
            medians.append(statistics.median(step(s) for s in range(first, first + opts["steps"])))
    timed = opts["repeats"] * opts["steps"]
    return {
        "step_ms": min(medians),
        "repeat_medians_ms": medians,
        "losses": losses,
        "dp_groups": dp_groups,
        "comm_per_step": stats.per_step(timed) if stats.calls else {},
        "bytes_per_axis_per_step": {k: v / timed for k, v in stats.bytes_per_axis.items()},
        **memory(model, opt, full_dense, n_dense),
    }


def run_mode(mode: str, opts: dict) -> dict:
    start = time.perf_counter()
    try:
        ranks = run_world(WORLD, run_rank, mode, opts, timeout=1800.0, env=opts["env"])
    except WorldError as exc:
        return {"status": "failed", "error": str(exc)[-4000:]}
    med = statistics.median
    step_ms = med(r["step_ms"] for r in ranks)
    summary = {
        "status": "ok",
        "wall_s": time.perf_counter() - start,
        "step_ms": step_ms,
        "step_ms_per_rank": [r["step_ms"] for r in ranks],
        # distinct samples per second over the world (a tp pair shares its batch)
        "samples_per_s": ranks[0]["dp_groups"] * opts["batch"] / (step_ms / 1e3),
        "peak_rss_mb": med(r["peak_rss_mb"] for r in ranks),
        "peak_rss_mb_max": max(r["peak_rss_mb"] for r in ranks),
        "losses_rank0": ranks[0]["losses"],
        "comm_per_step": {
            kind: {
                k: med(r["comm_per_step"].get(kind, {}).get(k, 0) for r in ranks)
                for k in ("calls", "bytes", "seconds")
            }
            for kind in sorted({k for r in ranks for k in r["comm_per_step"]})
        },
        "bytes_per_axis_per_step": {
            axis: med(r["bytes_per_axis_per_step"].get(axis, 0) for r in ranks)
            for axis in sorted({a for r in ranks for a in r["bytes_per_axis_per_step"]})
        },
        "memory_per_rank": {k: [r[k] for r in ranks] for k in MEMORY_KEYS},
    }
    summary["dense_bytes_max"] = max(
        sum(r[k] for k in ("dense_param_bytes", "dense_grad_bytes", "dense_optimizer_bytes"))
        for r in ranks
    )
    summary["full_dense_bytes"] = sum(
        ranks[0][k]
        for k in ("full_dense_param_bytes", "full_dense_grad_bytes", "full_dense_optimizer_bytes")
    )
    return summary


MEMORY_KEYS = (
    "dense_param_bytes",
    "dense_grad_bytes",
    "dense_optimizer_bytes",
    "full_dense_param_bytes",
    "table_weight_bytes",
    "table_optimizer_bytes",
    "peak_rss_mb",
)


# ---- report ---------------------------------------------------------------------------


def _kb(values: list[float]) -> str:
    return f"{max(values) / 1e3:.0f}"


def print_table(results: dict[str, dict]) -> None:
    print(
        f"\n{'mode':<14} {'step ms':>8} {'samples/s':>10} {'RSS MB':>7} "
        f"{'dense KB param/grad/opt (max rank)':>35} {'of full':>8} {'tables KB':>10}"
    )
    for mode, r in results.items():
        if r["status"] != "ok":
            print(f"{mode:<14} FAILED: {r['error'][-300:]}")
            continue
        m = r["memory_per_rank"]
        dense = "/".join(_kb(m[k]) for k in MEMORY_KEYS[:3])
        tables = [w + o for w, o in zip(m["table_weight_bytes"], m["table_optimizer_bytes"])]
        print(
            f"{mode:<14} {r['step_ms']:8.1f} {r['samples_per_s']:10.0f} {r['peak_rss_mb']:7.0f} "
            f"{dense:>35} {r['dense_bytes_max'] / r['full_dense_bytes']:8.2f} {_kb(tables):>10}"
        )
    full = next((r for r in results.values() if r["status"] == "ok"), None)
    if full:
        print(
            f"full dense model: {full['full_dense_bytes'] / 1e3:.0f} KB "
            "(params + grads + Adam state)"
        )
    theirs = results.get("torchrec_ddp", {})
    for mode in ("dtrec_tp_hsdp", "dtrec_fsdp"):
        ours = results.get(mode, {})
        if ours.get("status") == theirs.get("status") == "ok":
            print(
                f"{mode} / torchrec_ddp: step {ours['step_ms'] / theirs['step_ms']:.2f}x, "
                f"samples/s {ours['samples_per_s'] / theirs['samples_per_s']:.2f}x"
            )
    for mode, r in results.items():
        if r["status"] == "ok" and r["comm_per_step"]:
            kinds = ", ".join(
                f"{k} {v['bytes'] / 1e3:.1f} KB ({v['calls']:g} calls)"
                for k, v in r["comm_per_step"].items()
            )
            axes = ", ".join(
                f"{a} {b / 1e3:.1f} KB" for a, b in r["bytes_per_axis_per_step"].items()
            )
            print(f"{mode} dtrec comm_stats per step: {kinds}; by mesh dim: {axes}")


def meta(argv: list[str], opts: dict) -> dict:
    try:
        import torchrec

        torchrec_version = torchrec.__version__
    except ImportError:
        torchrec_version = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "benchmarks.composed", *argv]),
        "device": "cpu",
        "processor": processor(),
        "torch": torch.__version__,
        "torchrec": torchrec_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "world": WORLD,
        "dtrec": dtrec_source(),
        "settings": opts,
        "model": {
            "items": hstu.ITEMS,
            "users": hstu.USERS,
            "dim": hstu.DIM,
            "layers": hstu.LAYERS,
            "max_len": hstu.MAX_LEN,
        },
        "timing": "per rank: best of --repeats medians of --steps steps (barrier before each, "
        "outside the timed region), then median over ranks; OMP_NUM_THREADS=1 per rank; "
        "8 ranks on this machine's cores: oversubscribed, compare ratios only",
        "memory": "per rank after the last step: unique storages of the dense parameters, "
        "their .grad and Adam state (DDP's reducer buckets not included); tables: weights "
        "and fused optimizer state; peak_rss_mb: ru_maxrss",
    }


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--batch", type=int, default=64, help="samples per dp group")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--malloc-default",
        action="store_true",
        help=f"leave glibc malloc as is (not {MALLOC_ENV}): ranks fork from the test harness's "
        "server instead of starting fresh (the smoke test's choice)",
    )
    args = parser.parse_args(argv)
    opts = {
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "env": {} if args.malloc_default else MALLOC_ENV,
    }
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    print(f"processor: {processor_line()}; {WORLD} ranks")
    results = {mode: run_mode(mode, opts) for mode in modes}
    print_table(results)
    report = {"meta": meta(argv, opts), "results": results}
    if args.json:
        write_report(args.json, report)
    return report


if __name__ == "__main__":
    main()
