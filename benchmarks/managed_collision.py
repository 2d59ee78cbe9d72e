"""What managed collision costs a training step: dtrec's MC model vs ``id % rows``.

Workload (``benchmarks.distributed``'s shapes): 8 tables (rows geometric 1e5..1e6 times
``--scale``, D=64, one feature each, sum pooling), bags of 10..30 ids, ``--batch`` samples
per rank. Raw ids span the full int64 range: Zipf(1.1) ranks over a vocabulary of
``--vocab`` times each table's rows, each rank mapped to a 63-bit id by a fixed odd
multiplier (a bijection mod 2^64, top bit cleared). Two models on the same 4 gloo
ranks, batches and optimizers (fused row-wise Adagrad on the tables, torch Adagrad on
the MLP), tables row-wise over S = W (what managed collision shards):

- ``mc``: ``dtrec.ManagedCollisionEmbeddingBagCollection``, one
  ``MCHManagedCollisionModule`` per table (``zch_size`` = rows, DistanceLFU(0.5),
  eviction every ``--interval`` steps, default bounds check);
- ``modulo``: the same ``EmbeddingBagCollection`` fed ``id % rows`` (computed inside the
  step, one fused op).

A step is forward + backward + optimizer steps, timed per rank after a
``dist.barrier()`` (outside the timed region); the two models alternate step by step (both
see the same load of a shared machine); warm-up covers the first eviction. For the MC
model, host time is also taken around the remap (the ``ManagedCollisionCollection``
forward: feature permute, bounds check, recording the window, the lookup in the hash
index; an eviction inside it is counted apart), each remapper's eviction (window
coalesce, all-gather, scoring, re-sort, index build) and the reset of evicted rows.
Reported (median over a rank's steps, then median over ranks): the step of each model;
for MC non-eviction steps the remap's share of the step (issue 45's goal: at most 15%)
and the step's excess over ``modulo``; the eviction step apart (step, eviction, reset);
``dtrec.comm_stats`` bytes and calls per step by collective kind for each model.

    python -m benchmarks.managed_collision \
        --json benchmarks/results/managed_collision_cpu_<date>.json
    python -m benchmarks.managed_collision --scale 0.01 --batch 32 --steps 4 --interval 2   # smoke
    python -m benchmarks.managed_collision --eviction-cost 3   # an eviction's CPU, one process
    python -m benchmarks.managed_collision --split-cost 3      # per rank, split vs not, 4 ranks
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

import dtrec
from benchmarks.probes.machine import processor, processor_line
from benchmarks.probes.report import dtrec_source, write_report
from dtrec.placements import RowWise
from tests.multiprocess import run_world

GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: rank -> 63-bit id
LR, EPS = 0.01, 1e-8
TARGET_SHARE = 0.15


@dataclass(frozen=True)
class Workload:
    """The models and batch shape both runs train."""

    rows: tuple[int, ...]
    """Rows of each table ``t<i>`` (read by feature ``f<i>``), = its ``zch_size``."""
    dim: int = 64
    """Embedding dim of every table."""
    batch: int = 512
    """Samples per rank per step."""
    bag_range: tuple[int, int] = (10, 30)
    """Ids per bag, uniform over this inclusive range."""
    zipf: float = 1.1
    """Zipf exponent of the raw ids' ranks."""
    vocab: float = 4.0
    """Distinct raw ids per table, as a multiple of its rows."""
    interval: int = 10
    """Steps per eviction of every remapper."""


def workload(
    scale: float = 1.0, batch: int = 512, vocab: float = 4.0, interval: int = 10
) -> Workload:
    """8 tables of 1e5..1e6 rows (geometric) times ``scale``."""
    rows = tuple(max(2, int(scale * 1e5 * 10 ** (i / 7))) for i in range(8))
    return Workload(rows=rows, batch=batch, vocab=vocab, interval=interval)


def raw_ids(vocab: int, n: int, s: float, gen: torch.Generator) -> Tensor:
    """``n`` raw ids over the full int63 range: Zipf rank k < ``vocab`` (P ~ (k+1)^-s), then
    ``k * GOLDEN`` mod 2^64 with the top bit cleared."""
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    x = (1 - u * (1 - (vocab + 1) ** (1 - s))) ** (-1 / (s - 1))
    rank = (x.floor().long() - 1).clamp(0, vocab - 1)
    return (rank * GOLDEN) & ((1 << 63) - 1)


def make_batch(w: Workload, rank: int, step: int) -> tuple[list[str], Tensor, Tensor, Tensor]:
    """Rank ``rank``'s batch of step ``step``: (keys, raw values, key-major lengths, labels)."""
    gen = torch.Generator().manual_seed(1_000_003 * rank + step)
    lo, hi = w.bag_range
    lengths = torch.randint(lo, hi + 1, (len(w.rows) * w.batch,), generator=gen)
    per_key = lengths.view(len(w.rows), w.batch).sum(1).tolist()
    values = torch.cat(
        [raw_ids(int(w.vocab * r), n, w.zipf, gen) for r, n in zip(w.rows, per_key, strict=True)]
    )
    labels = torch.randint(0, 2, (w.batch,), generator=gen).float()
    return [f"f{i}" for i in range(len(w.rows))], values, lengths, labels


def _dense(w: Workload) -> nn.Module:
    return nn.Sequential(nn.Linear(len(w.rows) * w.dim, 64), nn.ReLU(), nn.Linear(64, 1))


def _configs(w: Workload) -> list[dtrec.EmbeddingBagConfig]:
    return [
        dtrec.EmbeddingBagConfig(f"t{i}", r, w.dim, [f"f{i}"], "sum") for i, r in enumerate(w.rows)
    ]


class ManagedCollisionModel(nn.Module):
    """Raw ids -> managed collision -> pooled -> MLP."""

    def __init__(self, w: Workload) -> None:
        super().__init__()
        from dtrec.modules.eviction import DistanceLFU

        cfgs = _configs(w)
        mcs = {
            c.name: dtrec.MCHManagedCollisionModule(
                c.num_embeddings,
                eviction_policy=DistanceLFU(0.5),
                eviction_interval=w.interval,
                name=c.name,
            )
            for c in cfgs
        }
        self.sparse = dtrec.ManagedCollisionEmbeddingBagCollection(
            dtrec.EmbeddingBagCollection(cfgs, device="meta"),
            dtrec.ManagedCollisionCollection(mcs, cfgs),
        )
        self.dense = _dense(w)

    def forward(self, kjt: dtrec.KeyedJaggedTensor) -> Tensor:
        pooled, _ = self.sparse(kjt)
        return self.dense(pooled.values()).squeeze(1)


class ModuloModel(nn.Module):
    """Raw ids -> ``id % rows`` -> pooled -> MLP (the same tables, no managed collision)."""

    def __init__(self, w: Workload) -> None:
        super().__init__()
        self.ebc = dtrec.EmbeddingBagCollection(_configs(w), device="meta")
        self.dense = _dense(w)
        self.register_buffer("rows", torch.tensor(w.rows), persistent=False)
        self._batch = w.batch

    def forward(self, kjt: dtrec.KeyedJaggedTensor) -> Tensor:
        per_key = kjt.lengths().view(len(self.rows), -1).sum(1)
        rows = self.rows.repeat_interleave(per_key, output_size=kjt.values().numel())
        return self.dense(self.ebc(kjt.with_values(kjt.values() % rows)).values()).squeeze(1)


class HostTimer:
    """Host seconds inside wrapped callables, by name, for the current step: wall time as
    ``name`` and this thread's CPU time as ``name_cpu`` (on a shared machine the wall time
    counts other processes' turns; the CPU time is the work)."""

    def __init__(self) -> None:
        self.step: dict[str, float] = {}

    def wrap(self, owner: object, attr: str, name: str) -> None:
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.step[name] = self.step.get(name, 0.0) + time.perf_counter() - start
                cpu_name = f"{name}_cpu"
                self.step[cpu_name] = self.step.get(cpu_name, 0.0) + time.thread_time() - cpu

        setattr(owner, attr, timed)


def _build(kind: str, w: Workload, world: int) -> tuple[nn.Module, HostTimer]:
    mesh = dtrec.init_mesh("cpu", shard_group_size=world)
    fused = dtrec.optim.RowWiseAdagrad(lr=LR, eps=EPS)
    model = ManagedCollisionModel(w) if kind == "mc" else ModuloModel(w)
    plan = {f"ebc.t{i}": RowWise() for i in range(len(w.rows))} if kind == "modulo" else None
    model = dtrec.distribute_module(model, mesh, plan, optimizer=fused)
    timer = HostTimer()
    if kind == "mc":
        timer.wrap(model.sparse._managed_collision_collection, "forward", "remap")
        timer.wrap(model.sparse, "_reset_evicted", "reset")
        remappers = model.sparse._managed_collision_collection._managed_collision_modules
        for mc in remappers.values():
            timer.wrap(mc, "_evict_window", "evict")
            # the part of evict after the window gather (split over the ranks or not)
            timer.wrap(mc, "_admit", "admit")
            timer.wrap(mc, "_admit_split", "admit")
    return model, timer


def run_rank(rank: int, world: int, w: Workload, opts: dict) -> dict:
    """One rank: each model warmed up and timed on the same batches. Picklable result."""
    torch.manual_seed(0)
    warmup, steps = opts["warmup"], opts["steps"]
    batches = []
    for s in range(warmup + steps):
        keys, values, lengths, labels = make_batch(w, rank, s)
        batches.append((dtrec.KeyedJaggedTensor(keys, values, lengths), labels))
    out: dict = {"rank": rank}
    built = {kind: _build(kind, w, world) for kind in ("modulo", "mc")}
    opts_of = {
        kind: torch.optim.Adagrad([p for p in model.parameters() if p.requires_grad], lr=LR)
        for kind, (model, _) in built.items()
    }
    records: dict[str, list[dict]] = {kind: [] for kind in built}
    comm: dict[str, dict[str, dict[str, float]]] = {kind: {} for kind in built}
    for s in range(warmup + steps):  # the models alternate: both see the machine's load
        for kind, (model, timer) in built.items():
            with dtrec.comm_stats() as stats:
                _step(model, opts_of[kind], timer, batches[s], records[kind])
            if s < warmup:
                records[kind].clear()
                continue
            for name, v in stats.per_step(steps).items():
                into = comm[kind].setdefault(name, {"calls": 0.0, "bytes": 0.0})
                into["calls"] += v["calls"]
                into["bytes"] += v["bytes"]
    for kind in built:
        out[kind] = {"records": records[kind], "comm": comm[kind]}
    return out


def _step(model: nn.Module, opt, timer: HostTimer, batch: tuple, records: list[dict]) -> None:
    """One timed training step (the barrier before it is not timed)."""
    dist.barrier()
    timer.step = {}
    start = time.perf_counter()
    kjt, labels = batch
    nn.functional.binary_cross_entropy_with_logits(model(kjt), labels).backward()
    opt.step()
    opt.zero_grad()
    record = {"step_ms": 1e3 * (time.perf_counter() - start)}
    record.update({k: 1e3 * v for k, v in timer.step.items()})
    records.append(record)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(ranks: list[dict]) -> dict:
    """Per rank medians, then the median over ranks; bytes per kind are rank means."""

    def over_ranks(fn) -> float | None:
        values = [v for v in (fn(r) for r in ranks) if v is not None]
        return _median(values)

    def mc_records(r: dict, evicting: bool) -> list[dict]:
        return [x for x in r["mc"]["records"] if (x.get("evict", 0.0) > 0) == evicting]

    base = over_ranks(lambda r: _median([x["step_ms"] for x in r["modulo"]["records"]]))
    mc_step = over_ranks(lambda r: _median([x["step_ms"] for x in mc_records(r, False)]))
    remap = over_ranks(lambda r: _median([x.get("remap", 0.0) for x in mc_records(r, False)]))
    share = over_ranks(
        lambda r: _median([x.get("remap", 0.0) / x["step_ms"] for x in mc_records(r, False)])
    )
    ev_step = over_ranks(lambda r: _median([x["step_ms"] for x in mc_records(r, True)]))
    ev_evict = over_ranks(lambda r: _median([x["evict"] for x in mc_records(r, True)]))
    ev_reset = over_ranks(lambda r: _median([x.get("reset", 0.0) for x in mc_records(r, True)]))
    ev_evict_cpu = over_ranks(lambda r: _median([x["evict_cpu"] for x in mc_records(r, True)]))
    ev_admit_cpu = over_ranks(lambda r: _median([x["admit_cpu"] for x in mc_records(r, True)]))
    ev_reset_cpu = over_ranks(
        lambda r: _median([x.get("reset_cpu", 0.0) for x in mc_records(r, True)])
    )
    eviction_steps = len(mc_records(ranks[0], True))

    def comm(kind: str) -> dict:
        kinds = sorted({k for r in ranks for k in r[kind]["comm"]})
        return {
            k: {
                field: statistics.mean(r[kind]["comm"].get(k, {}).get(field, 0.0) for r in ranks)
                for field in ("calls", "bytes")
            }
            for k in kinds
        }

    mc_comm = comm("mc")
    window = {k: v for k, v in mc_comm.items() if k.startswith("managed_collision.")}
    steps = len(ranks[0]["mc"]["records"])
    return {
        "modulo_step_ms": base,
        "mc_step_ms": mc_step,
        "mc_remap_ms": remap,
        "remap_share_of_step": share,
        "mc_excess_over_modulo_share": None if not mc_step or base is None
        else (mc_step - base) / mc_step,
        "meets_target": share is not None and share <= TARGET_SHARE,
        "target_share": TARGET_SHARE,
        "eviction": {
            "steps_timed": eviction_steps,
            "step_ms": ev_step,
            "evict_ms": ev_evict,
            "reset_ms": ev_reset,
            "evict_cpu_ms": ev_evict_cpu,
            "admit_cpu_ms": ev_admit_cpu,
            "reset_cpu_ms": ev_reset_cpu,
            "window_bytes_per_eviction_step": None if not eviction_steps
            else sum(v["bytes"] for v in window.values()) * steps / eviction_steps,
        },
        "comm_per_step": {"modulo": comm("modulo"), "mc": mc_comm},
    }  # fmt: skip


def run(w: Workload, opts: dict, world: int = 4) -> dict:
    ranks = run_world(world, run_rank, w, opts, timeout=opts.get("timeout", 1800.0))
    return {"summary": summarize(ranks), "ranks": ranks}


def _meta(argv: list[str], w: Workload, world: int) -> dict:
    try:
        import torchrec

        torchrec_version = torchrec.__version__
    except ImportError:
        torchrec_version = None
    return {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python -m benchmarks.managed_collision", *argv]),
        "device": "cpu",
        "torch": torch.__version__,
        "torchrec": torchrec_version,
        "python": platform.python_version(),
        "cpu_cores": os.cpu_count(),
        "processor": processor(),
        "platform": platform.platform(),
        "dtrec": dtrec_source(),
        "world": world,
        "workload": asdict(w),
        "timing": "host time per step per rank (dist.barrier() before each, outside); "
        "median over a rank's steps, then over ranks; OMP_NUM_THREADS=1 per rank",
    }


def _fmt(x: float | None, unit: str = "ms") -> str:
    return "n/a" if x is None else f"{x:.2f} {unit}"


def print_summary(s: dict) -> None:
    ev = s["eviction"]
    print(f"modulo step        {_fmt(s['modulo_step_ms'])}")
    print(f"mc step            {_fmt(s['mc_step_ms'])} (non-eviction steps)")
    share = 100 * (s["remap_share_of_step"] or 0)
    print(
        f"mc remap           {_fmt(s['mc_remap_ms'])} = {share:.1f}% of the step (target <= "
        f"{100 * s['target_share']:.0f}%: {'met' if s['meets_target'] else 'NOT met'})"
    )
    excess = s["mc_excess_over_modulo_share"]
    print(
        f"mc step over modulo: {'n/a' if excess is None else f'{100 * excess:.1f}%'} of the mc step"
    )
    print(f"eviction step      {_fmt(ev['step_ms'])} ({ev['steps_timed']} timed): evict "
          f"{_fmt(ev['evict_ms'])} ({_fmt(ev.get('evict_cpu_ms'))} CPU, of which scoring, "
          f"re-sort, index {_fmt(ev.get('admit_cpu_ms'))}), reset "
          f"{_fmt(ev['reset_ms'])} ({_fmt(ev.get('reset_cpu_ms'))} CPU), window gather "
          f"{ev['window_bytes_per_eviction_step'] or 0:,.0f} B")  # fmt: skip
    for model, kinds in s["comm_per_step"].items():
        for kind, v in kinds.items():
            print(f"  {model:6s} {kind:40s} {v['calls']:6.2f} calls {v['bytes']:14,.0f} B/step")


def eviction_cost(w: Workload, world: int = 4, evictions: int = 3) -> dict:
    """CPU seconds of one eviction of each table's remapper, in one process (no world).

    Each remapper sees the global batch of every step (all ``world`` ranks' ids of its
    table), so it makes the decisions every rank of the distributed run makes, and does
    the work each of them does at an eviction step but the window gather: coalesce, score,
    select, re-sort, index. Timed with this thread's CPU clock (a shared machine's load
    does not count); the first eviction (which fills the empty map) is not timed, then the
    median over ``evictions`` evictions per table."""
    from dtrec.modules.eviction import DistanceLFU

    torch.set_num_threads(1)
    mcs = [
        dtrec.MCHManagedCollisionModule(
            r, eviction_policy=DistanceLFU(0.5), eviction_interval=w.interval, name=f"t{i}"
        )
        for i, r in enumerate(w.rows)
    ]
    cpu: list[list[float]] = [[] for _ in mcs]
    for step in range((evictions + 1) * w.interval):
        parts = []
        for rank in range(world):
            _, values, lengths, _ = make_batch(w, rank, step)
            per_key = lengths.view(len(w.rows), w.batch).sum(1).tolist()
            parts.append(values.split(per_key))
        for t, mc in enumerate(mcs):
            ids = torch.cat([p[t] for p in parts])
            start = time.thread_time()
            mc.profile(ids)
            if (step + 1) % w.interval == 0 and step + 1 > w.interval:
                cpu[t].append(time.thread_time() - start)
    per_table = [statistics.median(c) for c in cpu]
    return {"evict_cpu_s_per_table": per_table, "evict_cpu_s": sum(per_table)}


def _split_cost_rank(rank: int, world: int, w: Workload, evictions: int) -> dict:
    """One rank of ``split_eviction_cost``: CPU s of each table's eviction, split and not."""
    from dtrec.modules.eviction import DistanceLFU

    torch.set_num_threads(1)

    def remappers(split: bool) -> list[dtrec.MCHManagedCollisionModule]:
        mcs = [
            dtrec.MCHManagedCollisionModule(
                r, eviction_policy=DistanceLFU(0.5), eviction_interval=w.interval, name=f"t{i}"
            )
            for i, r in enumerate(w.rows)
        ]
        for mc in mcs:
            mc.share_window(None)
            mc.split_eviction = split
        return mcs

    runs = {"split": remappers(True), "unsplit": remappers(False)}
    cpu: dict[str, list[list[float]]] = {k: [[] for _ in w.rows] for k in runs}
    for step in range((evictions + 1) * w.interval):
        _, values, lengths, _ = make_batch(w, rank, step)
        parts = values.split(lengths.view(len(w.rows), w.batch).sum(1).tolist())
        timed = (step + 1) % w.interval == 0 and step + 1 > w.interval
        order = ["split", "unsplit"] if step % 2 else ["unsplit", "split"]  # alternate
        for t in range(len(w.rows)):
            for kind in order:
                dist.barrier()  # every rank starts the eviction together: CPU, not waiting
                start = time.thread_time()
                runs[kind][t].profile(parts[t])
                if timed:
                    cpu[kind][t].append(time.thread_time() - start)
    same = all(
        torch.equal(a._mch_sorted_raw_ids, b._mch_sorted_raw_ids)
        and torch.equal(a._mch_remapped_ids_mapping, b._mch_remapped_ids_mapping)
        for a, b in zip(runs["split"], runs["unsplit"], strict=True)
    )
    return {
        kind: sum(statistics.median(c) for c in per_table) for kind, per_table in cpu.items()
    } | {"same_map": same}


def split_eviction_cost(w: Workload, world: int = 4, evictions: int = 3) -> dict:
    """CPU s per rank of one eviction of every table in a ``world``-rank gloo world (each
    rank its own batch, windows shared), decided by raw-id range over the ranks
    (``split_eviction``) and by every rank alone, the two alternating on the same
    batches; median over ``evictions`` evictions (the first, which fills the map, not
    timed) per table, summed. The thread CPU clock: a shared machine's load and the
    collectives' waiting do not count."""
    ranks = run_world(world, _split_cost_rank, w, evictions, timeout=1800.0)
    return {
        "split_cpu_s": [r["split"] for r in ranks],
        "unsplit_cpu_s": [r["unsplit"] for r in ranks],
        "same_map": all(r["same_map"] for r in ranks),
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=float, default=1.0, help="table rows x this")
    p.add_argument("--batch", type=int, default=512, help="samples per rank")
    p.add_argument("--vocab", type=float, default=4.0, help="distinct raw ids / rows")
    p.add_argument("--interval", type=int, default=10, help="steps per eviction")
    p.add_argument("--steps", type=int, default=30, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=None, help="default: interval + 2")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument(
        "--eviction-cost", type=int, default=0, metavar="N",
        help="instead: CPU s of an eviction (median of N), one process",
    )  # fmt: skip
    p.add_argument(
        "--split-cost", type=int, default=0, metavar="N",
        help="instead: CPU s per rank of an eviction split by raw-id range vs not "
        "(median of N), in a --world gloo world",
    )  # fmt: skip
    args = p.parse_args(argv)
    w = workload(args.scale, args.batch, args.vocab, args.interval)
    if args.split_cost:
        cost = split_eviction_cost(w, args.world, args.split_cost)
        print(f"processor: {processor_line()}")
        for kind in ("unsplit", "split"):
            per_rank = cost[f"{kind}_cpu_s"]
            print(f"{kind:8s} eviction CPU s per rank, all {len(w.rows)} tables: "
                  + ", ".join(f"{c:.3f}" for c in per_rank)
                  + f" (median {statistics.median(per_rank):.3f})")  # fmt: skip
        print(f"same map on every rank, split or not: {cost['same_map']}")
        return
    if args.eviction_cost:
        cost = eviction_cost(w, args.world, args.eviction_cost)
        print(f"processor: {processor_line()}")
        print(f"eviction CPU s, all {len(w.rows)} tables: {cost['evict_cpu_s']:.3f} (per table: "
              + ", ".join(f"{c:.3f}" for c in cost["evict_cpu_s_per_table"]) + ")")  # fmt: skip
        return
    warmup = args.interval + 2 if args.warmup is None else args.warmup
    report = run(w, {"warmup": warmup, "steps": args.steps}, world=args.world)
    report["meta"] = _meta(argv, w, args.world)
    print(f"processor: {processor_line(report['meta']['processor'])}")
    print_summary(report["summary"])
    if args.json:
        write_report(args.json, report)


if __name__ == "__main__":
    main()
