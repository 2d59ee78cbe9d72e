"""Fully sharded 2D against exact 2D and TorchRec's 2D in one sitting: memory, bytes, time.

Per (W, S) world, every table row-wise, fused exact row-wise Adagrad, benchmarks/
distributed.py's workload (8 tables of 1e5..1e6 rows x ``--scale``, D = 64, bags of
~20 Zipf(1.1) ids, ``--batch`` samples per rank), built in one gloo world and stepped
alternately on the same batches, so machine load hits them alike:

- ``exact``: dtrec ``RowWise()`` (exact 2D: whole shard + state on each replica);
- ``fully_sharded``: dtrec ``RowWise(fully_sharded=True)`` (owner slices, rows routed);
- ``torchrec``: TorchRec 1.8.0 ``DMPCollection`` default strategy (``sync()`` every
  step: replicas' weights and state averaged), patched to run on CPU
  (``benchmarks/common/torchrec_side.cpu_dmp_collection``);
- ``torchrec_fully_sharded``: ``DMPCollection(sharding_strategy=FULLY_SHARDED)`` is
  tried; on CPU it refuses (its error is recorded) and its memory is computed from its
  code instead (``torchrec_fully_sharded_computed``): weights reduce-scattered to 1/R
  after the forward, all-gathered back in a backward pre-hook, optimizer state whole.

Per rank and model:

- ``at_rest_bytes``: tables + optimizer state between steps: dtrec's table DTensors' local
  blocks (owner slices) + its fused state; TorchRec's: every tensor storage its sharded
  embedding modules and their lookups (FBGEMM TBEs: weights, momentum, aux) hold;
- ``step_peak_bytes``: the most bytes allocated above the start of a step at any point of
  it (forward, backward, fused update, optimizer step, ``sync()``), from torch's profiler
  memory events (``profile_memory=True``: every allocation and free through torch's CPU
  allocator, summed in time order), in one extra, untimed step; gloo's own transport
  buffers are not torch allocations and are not counted. ``peak_bytes`` = at rest +
  step peak (other tensors alive at rest, the dense part and the batch, are the same for
  every model and left out);
- ``step_ms`` / ``step_cpu_ms``: median over timed steps of wall and process CPU time
  (``dist.barrier()`` before each, outside the timed region);
- ``bytes_per_axis`` / ``calls_per_axis``: what the rank sends per step over "shard",
  "replicate" and the whole world, from every c10d op dispatched in one untimed step
  (a ``TorchDispatchMode``; the op's process group's ranks name its axis; the same
  counting for both libraries).

Run (the issue's 8 ranks at S 2 x R 4 and S 4 x R 2, and 4 ranks at 2 x 2)::

    PYTHONPATH=. python benchmarks/fully_sharded_step.py --configs 8x2,8x4,4x2 \\
        --json benchmarks/results/fully_sharded_cpu_<date>.json

``--world-size W --shards S`` runs one world; ``--no-torchrec`` leaves TorchRec out.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
import warnings
from collections import defaultdict
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import dtrec
from benchmarks.common.workloads import EPS, LR, Model, make_batch, workload
from benchmarks.probes.comm import _C10D_OPS, _FUNCTIONAL_OPS, sent_bytes
from benchmarks.probes.machine import processor
from benchmarks.probes.report import dtrec_source, write_report
from dtrec.placements import RowWise
from tests.multiprocess import run_world

DTREC_MODES = ("exact", "fully_sharded")
TORCHREC_MODES = ("torchrec",)
WARMUP = 2


def _at_rest_bytes(model: nn.Module) -> int:
    """This rank's table blocks (or owner slices) and fused optimizer state, in bytes."""
    ebc = model.ebc
    weights = sum(t.weight.to_local().nbytes for t in ebc.embedding_bags.values())
    states = sum(v.nbytes for s in ebc.fused_optimizer_state().values() for v in s.values())
    return weights + states


def _torchrec_at_rest_bytes(model: nn.Module) -> int:
    """Bytes of every tensor storage TorchRec's sharded embedding modules hold (weights,
    optimizer state, kernel buffers), each storage once. Its lookups sit in plain lists
    (``_lookups``), not as submodules: walked too."""
    seen: dict[int, int] = {}
    todo = [m for n, m in model.named_modules() if type(m).__name__.startswith("Sharded")]
    done: set[int] = set()
    while todo:
        module = todo.pop()
        if id(module) in done:
            continue
        done.add(id(module))
        todo += list(module.children()) + list(getattr(module, "_lookups", []) or [])
        values = [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]
        for value in values:
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                storage = value.untyped_storage()
                seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def step_peak_bytes(step) -> int:
    """Most bytes allocated above the start of ``step()`` at any time during it (torch's
    profiler memory events: allocations and frees through torch's CPU allocator)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    ]
    live = peak = 0
    for _, nbytes in sorted(events):
        live += nbytes
        peak = max(peak, live)
    return peak


class AxisCensus(TorchDispatchMode):
    """Bytes sent and calls per mesh axis of every c10d / functional collective dispatched
    (the op's process group's ranks name the axis: ``groups`` maps rank tuples to names)."""

    def __init__(self, groups: dict[tuple[int, ...], str]) -> None:
        super().__init__()
        self.groups = groups
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        table = {"c10d": _C10D_OPS, "_c10d_functional": _FUNCTIONAL_OPS}.get(ns, {})
        if name in table:
            named = dict(zip([a.name for a in func._schema.arguments], args))
            named.update(kwargs)
            if "process_group" in named:
                pg = dist.ProcessGroup.unbox(named["process_group"])
            else:
                pg = dist.distributed_c10d._resolve_process_group(named["group_name"])
            ranks = tuple(dist.get_process_group_ranks(pg))
            axis = self.groups.get(ranks, f"ranks {list(ranks)}")
            kind, extract = table[name]
            inputs, splits = extract(named)
            self.calls[axis] += 1
            self.bytes[axis] += sent_bytes(
                kind, pg.size(), pg.rank(), inputs, splits=splits, root=named.get("root_rank")
            )
        return func(*args, **kwargs)


def _build_dtrec(w, mesh, fully_sharded: bool):
    tables = [dtrec.EmbeddingBagConfig(f"t{i}", r, w.dim, [f"f{i}"]) for i, r in enumerate(w.rows)]
    ebc = dtrec.EmbeddingBagCollection(tables, device="meta")
    plan = {f"ebc.t{i}": RowWise(fully_sharded=fully_sharded) for i in range(len(w.rows))}
    model = dtrec.distribute_module(
        Model(ebc, w), mesh, plan, optimizer=dtrec.optim.RowWiseAdagrad(lr=LR, eps=EPS)
    )
    dense = [p for n, p in model.named_parameters() if not n.startswith("ebc.")]
    return model, [torch.optim.Adagrad(dense, lr=LR)], None, dtrec.KeyedJaggedTensor


def _build_torchrec(w, shards: int, fully_sharded: bool):
    """TorchRec's DMPCollection (default, or FULLY_SHARDED: raises on CPU)."""
    from benchmarks.common import torchrec_side as trb

    model = Model(trb.torchrec_ebc(w.rows, w.dim), w)
    if not fully_sharded:
        sharded, optimizers, hook = trb.shard_torchrec(model, ["rw"] * len(w.rows), shards, LR, EPS)
        return sharded, optimizers, hook, trb.KeyedJaggedTensor
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingStrategy

    sharder = EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": LR,
            "eps": EPS,
        }
    )
    plan = trb._plan(model, ["rw"] * len(w.rows), shards, sharder)
    trb.cpu_dmp_collection(
        module=model,
        device=torch.device("cpu"),
        plan=plan,
        world_size=dist.get_world_size(),
        sharding_group_size=shards,
        global_pg=dist.group.WORLD,
        sharders=[sharder],
        sharding_strategy=ShardingStrategy.FULLY_SHARDED,
    )
    raise AssertionError("DMPCollection FULLY_SHARDED built on CPU: measure it here")


def _rank(rank: int, world: int, shards: int, scale: float, batch: int, steps: int,
          with_torchrec: bool) -> dict:  # fmt: skip
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    w = workload(scale, batch)
    mesh = dtrec.init_mesh("cpu", shards)
    groups = {
        tuple(dist.get_process_group_ranks(mesh.get_group("shard"))): "shard",
        tuple(dist.get_process_group_ranks(mesh.get_group("replicate"))): "replicate",
        tuple(range(world)): "world",
    }
    models = {mode: _build_dtrec(w, mesh, mode == "fully_sharded") for mode in DTREC_MODES}
    refused = {}
    if with_torchrec:
        models["torchrec"] = _build_torchrec(w, shards, False)
        try:
            _build_torchrec(w, shards, True)
        except Exception as exc:  # noqa: BLE001 - recorded: TorchRec's own refusal
            refused["torchrec_fully_sharded"] = f"{type(exc).__name__}: {exc}"

    def train_step(name: str, step: int, sync: bool = True) -> None:
        model, optimizers, hook, kjt_type = models[name]
        keys, values, lengths, labels = make_batch(w, rank, step)
        kjt = kjt_type(keys=keys, values=values, lengths=lengths)
        out = model(kjt)
        loss = nn.functional.binary_cross_entropy_with_logits(out, labels)
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        if hook is not None and sync:
            hook()

    wall: dict[str, list[float]] = defaultdict(list)
    cpu: dict[str, list[float]] = defaultdict(list)
    for step in range(WARMUP + steps):
        for name in models:
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            train_step(name, step)
            if step >= WARMUP:
                wall[name].append(1e3 * (time.perf_counter() - start))
                cpu[name].append(1e3 * (time.process_time() - start_cpu))
    out: dict = {"refused": refused}
    step = WARMUP + steps
    for name, (model, *_) in models.items():
        dist.barrier()
        census = AxisCensus(groups)
        with census:
            train_step(name, step)
        dist.barrier()
        peak = step_peak_bytes(lambda n=name: train_step(n, step + 1))
        rest = _at_rest_bytes(model) if name in DTREC_MODES else _torchrec_at_rest_bytes(model)
        if name == "torchrec":  # its step without sync(), for FULLY_SHARDED's (no sync)
            dist.barrier()
            no_sync = step_peak_bytes(lambda n=name: train_step(n, step + 2, sync=False))
        out[name] = {
            "at_rest_bytes": rest,
            "step_peak_bytes": peak,
            "peak_bytes": rest + peak,
            "step_ms": statistics.median(wall[name]),
            "step_cpu_ms": statistics.median(cpu[name]),
            "bytes_per_axis": dict(census.bytes),
            "calls_per_axis": dict(census.calls),
        }
        if name == "torchrec":
            out[name]["step_peak_without_sync_bytes"] = no_sync
    return out


def torchrec_fully_sharded_computed(default: dict, shards: int, replicas: int, w) -> dict:
    """TorchRec FULLY_SHARDED's memory on this rank, from its code (it does not run on CPU)
    and its default strategy's measurements (``default``: rank medians). TorchRec 1.8.0's
    ``ShardedBatchedFusedEmbeddingBag`` reduce-scatters the weights to 1/R after the
    forward (the async output into a 1/R buffer while the whole shard is alive), frees
    the whole shard, and all-gathers it back in a backward pre-hook (again whole + 1/R
    buffer), where the fused update runs on the whole shard: so between steps it holds
    the whole shard as the default does, 1/R only from the end of the forward to the
    backward (the dense part: what it saves), and its peak is shard + shard/R (TorchRec
    #3558, issue 43) + the step's other buffers: the default's step without ``sync()``
    (FULLY_SHARDED does not call it). Optimizer state is never split."""
    weights = 4 * w.dim * sum(w.rows) / shards  # a rank's row-wise shard of the weights
    step_peak = weights / replicas + default["step_peak_without_sync_bytes"]
    return {
        "at_rest_bytes": default["at_rest_bytes"],
        "during_dense_bytes": default["at_rest_bytes"] - weights + weights / replicas,
        "step_peak_bytes": step_peak,
        "peak_bytes": default["at_rest_bytes"] + step_peak,
        "how": "computed from TorchRec 1.8.0's ShardedBatchedFusedEmbeddingBag and the "
        "default strategy's measured rest and step peak; not run (it refuses CPU)",
    }


def _medians(ranks: list[dict], name: str) -> dict:
    runs = [r[name] for r in ranks]
    out = {
        k: statistics.median(r[k] for r in runs)
        for k in (
            "at_rest_bytes",
            "step_peak_bytes",
            "peak_bytes",
            "step_ms",
            "step_cpu_ms",
            "step_peak_without_sync_bytes",
        )
        if k in runs[0]
    }
    for key in ("bytes_per_axis", "calls_per_axis"):
        axes = sorted({a for r in runs for a in r[key]})
        out[key] = {a: statistics.median(r[key].get(a, 0) for r in runs) for a in axes}
    return out


def run_config(world: int, shards: int, args: argparse.Namespace) -> dict:
    """One (W, S) world: per-rank results, medians over ranks and the ratios."""
    with_torchrec = not args.no_torchrec
    ranks = run_world(world, _rank, shards, args.scale, args.batch, args.steps, with_torchrec,
                      timeout=3600.0, collective_timeout=900.0)  # fmt: skip
    names = [n for n in ranks[0] if n != "refused"]
    median = {name: _medians(ranks, name) for name in names}
    out = {"world": world, "shards": shards, "replicas": world // shards, "ranks": ranks,
           "median": median, "refused": ranks[0]["refused"]}  # fmt: skip
    if "torchrec" in median:
        out["torchrec_fully_sharded_computed"] = torchrec_fully_sharded_computed(
            median["torchrec"], shards, world // shards, workload(args.scale, args.batch)
        )
    e, f = median["exact"], median["fully_sharded"]
    out["ratio"] = {
        "at_rest": f["at_rest_bytes"] / e["at_rest_bytes"],
        "peak": f["peak_bytes"] / e["peak_bytes"],
        "step_ms": f["step_ms"] / e["step_ms"],
        "step_cpu_ms": f["step_cpu_ms"] / e["step_cpu_ms"],
    }
    if "torchrec" in median:
        out["ratio"]["step_ms_vs_torchrec"] = f["step_ms"] / median["torchrec"]["step_ms"]
        out["ratio"]["exact_step_ms_vs_torchrec"] = e["step_ms"] / median["torchrec"]["step_ms"]
    return out


def _print(config: dict) -> None:
    print(f"W {config['world']}, S {config['shards']} x R {config['replicas']} (rank medians)")
    print(f"  {'model':<24}{'rest MB':>9}{'peak MB':>9}{'step ms':>9}{'cpu ms':>9}  bytes/axis MB")
    rows = dict(config["median"])
    if "torchrec_fully_sharded_computed" in config:
        rows["torchrec_fs (computed)"] = config["torchrec_fully_sharded_computed"]
    for name, m in rows.items():
        axes = ", ".join(f"{a} {b / 1e6:.2f}" for a, b in m.get("bytes_per_axis", {}).items())
        ms = f"{m['step_ms']:>9.1f}{m['step_cpu_ms']:>9.1f}" if "step_ms" in m else " " * 18
        print(f"  {name:<24}{m['at_rest_bytes'] / 1e6:>9.1f}{m['peak_bytes'] / 1e6:>9.1f}{ms}"
              f"  {axes}")  # fmt: skip
    for name, why in config["refused"].items():
        print(f"  {name}: refused: {why}")
    print(
        "  fully sharded / exact: " + ", ".join(f"{k} {v:.2f}" for k, v in config["ratio"].items())
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--shards", type=int, default=2, help="S; R = world / S")
    parser.add_argument("--configs", default=None,
                        help="W x S worlds run one after another, e.g. 8x2,8x4,4x2 "
                        "(instead of --world-size / --shards)")  # fmt: skip
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies table rows")
    parser.add_argument("--batch", type=int, default=512, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (each model)")
    parser.add_argument("--no-torchrec", action="store_true", help="dtrec's two models only")
    parser.add_argument("--json", default=None)
    given = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(given)
    pairs = (
        [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
        if args.configs
        else [(args.world_size, args.shards)]
    )
    try:
        import torchrec

        torchrec_version = torchrec.__version__
    except ImportError:  # the bench extra is not installed: dtrec's two models only
        torchrec_version, args.no_torchrec = None, True
    out = {
        "meta": {
            "date": datetime.date.today().isoformat(),
            "command": " ".join(["python benchmarks/fully_sharded_step.py", *given]),
            "device": "cpu",
            "torch": torch.__version__,
            "torchrec": torchrec_version,
            "python": platform.python_version(),
            "processor": processor(),
            "dtrec": dtrec_source(),
            "workload": asdict(workload(args.scale, args.batch)),
            "peak": "at rest + the most bytes allocated above a step's start during one "
            "untimed step (torch.profiler profile_memory events through torch's CPU "
            "allocator; gloo transport buffers not counted)",
            "bytes": "sent per rank per step, every c10d op dispatched in one untimed step, "
            "by the op's process group (shard / replicate / world)",
            "timing": "median over timed steps per rank of wall and process CPU ms, models "
            "interleaved step by step, dist.barrier() before each; medians over ranks",
        },
        "args": vars(args),
        "configs": {},
    }
    for world, shards in pairs:
        config = run_config(world, shards, args)
        out["configs"][f"{world}x{shards}"] = config
        _print(config)
    if args.json:
        write_report(args.json, out)
    return out


if __name__ == "__main__":
    main()
