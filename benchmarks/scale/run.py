"""What 2D buys at 8 to 4096 GPUs (issue 33): DLRM-DCNv2 at MLPerf's sizes, predicted.

Workload: MLPerf DLRM-DCNv2's 26 tables (3 to 40M rows), D = 128, its multi-hot sizes
(bags of uniform [1, 2h - 1] ids, 214 ids per sample on average), ``--batch`` samples per
GPU, uniform ids; the dense arch, rowwise Adagrad and step of ``benchmarks/gpu_step.py``.
Plans per W = 8, 16, ..., 4096:

- ``1d_row_wise``, ``1d_table_row_wise``: TorchRec's row-wise and table-row-wise layouts
  over all W ranks (table-row-wise: table i on node i mod nodes), TorchRec's own plan read
  by ``dtrec.interop.plans`` (dtrec's specs for them when TorchRec is not installed);
- ``1d_planner``: dtrec's planner's specs over all W ranks (S = W);
- ``2d_S8``, ``2d_S16``, ``2d_S64``: dtrec 2D, a model replica sharded over S ranks with
  the planner's specs (``dtrec.planning.planner``), R = W / S replicas (TorchRec's
  DMPCollection "sharding group" of 8, 16, 64: its shard groups are strided, so they
  span nodes once R >= 8, and replicas sync over R contiguous ranks);
- ``2d_R8``, ``2d_R16``, ``2d_R64``: the other reading, replica groups of R = 8, 16, 64
  contiguous ranks (R = 8: one node, the replica sync on NVLink), S = W / R;
- ``2d_planner``: the one of those the model predicts fastest among those that fit a GPU's
  80 GB (the planner's memory model: rows, optimizer state, the step's buffers);
- ``2d_*_k100``, ``2d_sync_planner``: the same shapes with ``sync_every=k`` (``--sync-every``,
  default 100): replicas update their own rows and average weights and row-wise Adagrad
  state every k steps (TorchRec DMPCollection's periodic sync), 1/k of it per step;
- ``2d_*_fs``, ``2d_fs_planner``: the same shapes (R > 1) fully sharded 2D (issue 43): the
  planner's specs with ``fully_sharded=True`` on every sharded table, so each rank holds
  1/R of its shard and state at rest; touched rows fetched from their owner slices and
  their gradients sent back (``replica_slices``) instead of the replicas' gradient sum.

Per configuration: the bytes one rank sends in every collective, from dtrec's own input
dist, output dist, replica syncs and dense all-reduce run on a mirror world
(``benchmarks/scale/sim.py``); their times on DGX H100-like nodes (``Fabric``); the
lookups and dense math from this project's H200 step, scaled to H100 by copy bandwidth
(``Device``); overlap as ``dtrec.TrainPipeline`` does it (``dtrec.planning.step_model``).
The report checks the one-GPU calibration against every measured ``gpu_step`` config
(``one_gpu_check``, within 15%) and places W = 8 next to NVIDIA's MLPerf v4.0 result.

    python -m benchmarks.scale --json benchmarks/results/scale_2026-12-02.json \\
        --png benchmarks/results/scale_2026-12-02.png --generated-batches 4
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.common.dense_arch import DenseArch
from benchmarks.common.dlrm import MLPERF_HOTNESS, MLPERF_ROWS
from benchmarks.probes.machine import processor
from benchmarks.scale.mirror_world import mirror_world
from benchmarks.scale.sim import RankStep, Workload, simulate_rank
from dtrec.interop.plans import from_torchrec_plan
from dtrec.placements import RowWise, TableRowWise, TableSpec
from dtrec.placements.fully_sharded import slice_starts
from dtrec.placements.mesh import init_mesh, shard_axis
from dtrec.planning.cost_model import table_cost
from dtrec.planning.fully_sharded_plan import fully_sharded_candidates
from dtrec.planning.mesh_choice import rank_shard_group_sizes
from dtrec.planning.planner import plan_tables
from dtrec.planning.step_model import (
    Device,
    Fabric,
    calibrate,
    embedding_bytes,
    scaled,
    step_time,
)
from dtrec.planning.topology import Topology

RESULTS = Path(__file__).resolve().parents[1] / "results"
GPU_STEP = RESULTS / "gpu_step_h200_2026-11-27.json"
H100_COPY = 3.0e12
"""Device-to-device copy on the lent H100 (ANCHORS.md: ~3.0 TB/s of 3.35 peak)."""
MLPERF_H100 = 1.73e6
"""NVIDIA's MLPerf Training v4.0 DLRM-DCNv2, HugeCTR, 8 H100: samples/s per GPU
(derived from mlcommons/training_results_v4.0, ANCHORS.md)."""
WORLDS = tuple(2**k for k in range(3, 13))
GROUPS = (8, 16, 64)
TOLERANCE = 0.15
EXACT_WORLD = 16
GENERATED = [EXACT_WORLD]  # --generated-batches sets it
"""Worlds up to this size generate every rank's batch for the touched rows, larger ones the
simulated rank's shard group while S <= 16, beyond it the expected distinct rows of the ids
received (``sim.simulate_rank``): the time of the sweep, not its accuracy (uniform
ids), sets it."""
MAX_SEND_LENGTHS = 1 << 30
"""The input dist sends every bag's length to every block of its table (row-wise: S x
tables x B ints): past this many the rank's send buffer (GBs) does not fit this machine;
such points are reported as not simulated."""


def mlperf(batch: int) -> Workload:
    return Workload(MLPERF_ROWS, MLPERF_HOTNESS, 128, batch)


def one_gpu_check(gpu_step: dict, device: Device | None = None) -> list[dict]:
    """Predicted vs measured one-GPU step of every config of a ``gpu_step`` report, with the
    H200 constants (``calibrate``): which constant each config calibrates, and the error."""
    device = device or calibrate(gpu_step)
    multi = sorted(int(k.split("_")[0][1:]) for k in gpu_step["results"] if "multi" in k)
    rows = []
    for config, r in sorted(gpu_step["results"].items()):
        run = r["dtrec"]
        batch = int(config.split("_")[0][1:])
        seconds = step_time({}, 1, 1, batch, run["embedding"]["bytes"], device, Fabric()).step
        calibrates = []
        if "multi" in config and batch == multi[0]:
            calibrates.append("host_floor")
        if "multi" in config and batch == multi[-1]:
            calibrates += ["embedding_bandwidth", "dense_per_sample"]
        rows.append({
            "config": config,
            "measured_ms": 1e3 * run["step_s"],
            "predicted_ms": 1e3 * seconds,
            "error": seconds / run["step_s"] - 1,
            "calibrates": calibrates,
        })  # fmt: skip
    return rows


def _heaviest_rank(w: Workload, specs: dict[str, TableSpec], axis) -> int:
    """The rank (replica 0) at the shard position with the most expected lookup work: a
    synchronous step waits for the slowest rank."""
    load = [0.0] * axis.size
    for cfg in w.tables():
        t = int(cfg.name[1:])
        for b in specs[cfg.name].layout(cfg, axis).blocks:
            load[b.position] += w.hotness[t] * b.num_rows / cfg.num_embeddings * b.num_cols
    return max(range(axis.size), key=lambda p: load[p]) * axis.replicas


def _topology(w: Workload) -> Topology:
    """The planner's H100 topology for the workload (80 GB per GPU, its batch and hotness)."""
    return Topology.h100(
        node_size=8,
        batch_size_per_rank=w.batch,
        pooling_factors={f"f{i}": float(h) for i, h in enumerate(w.hotness)},
    )


def _planned(w: Workload, world: int, shards: int) -> tuple[dict[str, TableSpec], int]:
    """The planner's specs for an (S, R) mesh and the rank to simulate."""
    with mirror_world(0, world):
        axis = shard_axis(init_mesh("cpu", shards, 8))
    named = {cfg.name: cfg for cfg in w.tables()}
    choices, _ = plan_tables(named, axis, None, _topology(w))
    specs = {k: c.spec for k, c in choices.items()}
    return specs, _heaviest_rank(w, specs, axis)


def _one_d(w: Workload, world: int, kind: str) -> tuple[dict[str, TableSpec], int, str]:
    """TorchRec's 1D layout of every table (``kind``: "row_wise", or "table_row_wise" with
    table i on node i mod nodes) over all ``world`` ranks, the rank to simulate, and where
    the layout came from: TorchRec's own sharding plan (``construct_module_sharding_plan``)
    read by ``dtrec.interop.plans``, or, without TorchRec installed, dtrec's specs for it."""
    nodes = max(1, world // 8)
    with mirror_world(0, world):
        mesh = init_mesh("cpu", world, 8)
        axis = shard_axis(mesh)
        try:
            specs = _torchrec_layout(w, world, kind, mesh)
            source = "torchrec plan via dtrec.interop.plans"
        except ImportError:
            if kind == "row_wise":
                specs = {cfg.name: RowWise() for cfg in w.tables()}
            else:
                specs = {c.name: TableRowWise(node=i % nodes) for i, c in enumerate(w.tables())}
            source = "dtrec specs (torchrec not installed)"
    return specs, _heaviest_rank(w, specs, axis), source


def _torchrec_layout(w: Workload, world: int, kind: str, mesh) -> dict[str, TableSpec]:
    """TorchRec's plan for the workload's tables (meta, nothing allocated), as dtrec specs."""
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        row_wise,
        table_row_wise,
    )
    from torchrec.modules.embedding_configs import EmbeddingBagConfig as TorchRecConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchRecEBC

    configs = [TorchRecConfig(name=c.name, embedding_dim=c.embedding_dim,
                              num_embeddings=c.num_embeddings, feature_names=c.feature_names)
               for c in w.tables()]  # fmt: skip
    ebc = TorchRecEBC(configs, device=torch.device("meta"))
    nodes = max(1, world // 8)
    per_table = {c.name: row_wise() if kind == "row_wise" else table_row_wise(host_index=i % nodes)
                 for i, c in enumerate(configs)}  # fmt: skip
    plan = construct_module_sharding_plan(ebc, per_table, local_size=8, world_size=world,
                                          device_type="cuda")  # fmt: skip
    return from_torchrec_plan({"": plan}, {c.name: c for c in w.tables()}, mesh)


def _memory(w: Workload, specs: dict[str, TableSpec], world: int, shards: int, rank: int):
    """Bytes the simulated rank holds: its table rows + row-wise Adagrad state (its owner
    slice of a fully sharded block), and all the planner's cost model counts (with the
    step's buffers: ids received, partials pooled for the shard group's samples), against
    the budget it plans within."""
    with mirror_world(rank, world):
        axis = shard_axis(init_mesh("cpu", shards, 8))
    position, replica = divmod(rank, axis.replicas)
    rows, topology = 0, _topology(w)
    planned = 0.0
    for cfg in w.tables():
        layout = specs[cfg.name].layout(cfg, axis)
        for b in layout.blocks:
            if b.position == position:
                held = b.num_rows
                if layout.replica_sliced and not layout.batch_local:  # its owner slice
                    starts = slice_starts(b.num_rows, axis.replicas)
                    held = starts[replica + 1] - starts[replica]
                rows += held * (b.num_cols + 1) * 4
        planned += float(table_cost(cfg, specs[cfg.name], axis, topology, with_comm=False)
                         .memory[position])  # fmt: skip
    return rows, planned, topology.memory_budget


def configuration(
    w: Workload,
    name: str,
    world: int,
    shards: int,
    specs: dict,
    rank: int,
    device: Device,
    sync_every: int | None = None,
) -> dict:
    """Simulate one plan at one W and price its step (``sync_every``: replicas average
    weights every k steps instead of summing gradients every step)."""
    started = time.perf_counter()
    dense = DenseArch(len(w.rows) * w.dim, w.dim).to("meta")
    sim: RankStep = simulate_rank(
        w, specs, world, shards, rank, 8, dense, GENERATED[0], GENERATED[0], sync_every
    )
    table, held, budget = _memory(w, specs, world, shards, rank)
    row = {
        "plan": name,
        "W": world,
        "S": shards,
        "R": world // shards,
        "sync_every": sync_every,
        "fully_sharded": any(getattr(s, "fully_sharded", False) for s in specs.values()),
        "rank": rank,
        "types": _type_counts(specs),
        "table_gb_per_rank": table / 1e9,
        "memory_gb_per_rank": held / 1e9,
        "fits_memory": held <= budget,
        "comm": {k: {**v, "group": sim.groups[k]} for k, v in sim.comm.items()},
        "comm_bytes": sum(v["bytes"] for v in sim.comm.values()),
        "embedding_bytes": embedding_bytes(
            sim.looked_up, sim.ids, sim.bags, sim.pooled, sim.updated, sim.rows_touched
        ),
    }
    price(row, w.batch, device)
    row["simulate_s"] = time.perf_counter() - started
    return row


def price(row: dict, batch: int, device: Device, fabric: Fabric | None = None) -> dict:
    """Fill a configuration's times from its simulated bytes (in place; no simulation, so a
    report can be re-priced with other constants: ``--reprice``)."""
    t = step_time(row["comm"], row["S"], row["R"], batch, row["embedding_bytes"], device,
                  fabric or Fabric())  # fmt: skip
    for kind, v in row["comm"].items():
        v["ms"] = 1e3 * t.comm[kind]
    row.update(
        embedding_ms=1e3 * t.embedding,
        dense_ms=1e3 * t.dense,
        comm_ms=1e3 * t.comm_total,
        exposed_comm_ms=1e3 * t.exposed_comm,
        step_ms=1e3 * t.step,
        host_bound=t.host_bound,
        samples_per_s_per_gpu=batch / t.step,
        comm_share=t.comm_share,
    )
    return row


def dense_macs(layers: list[tuple[int, int]]) -> int:
    """Multiply-adds per sample of a stack of (in, out) matmuls."""
    return sum(i * o for i, o in layers)


def mlperf_dense_ratio(dim: int = 128, tables: int = 26) -> float:
    """MLPerf DCNv2's dense MACs per sample over ``gpu_step.DenseArch``'s: MLPerf's reference
    (bottom MLP 512-256-128, 3 low-rank-512 DCNv2 cross layers over 27 x 128, top MLP
    1024-1024-512-256-1) against one rank-64 cross layer and 256-wide MLPs."""
    width = dim * (tables + 1)
    bottom = [(13, 512), (512, 256), (256, dim)]
    cross = [(width, 512), (512, width)] * 3
    top = [(width, 1024), (1024, 1024), (1024, 512), (512, 256), (256, 1)]
    mlperf = dense_macs(bottom + cross + top)
    ours = sum(p.numel() for n, p in DenseArch(tables * dim, dim).named_parameters()
               if n.endswith("weight"))  # fmt: skip
    return mlperf / ours


def anchor(rows: list[dict], batch: int, device: Device) -> dict:
    """W = 8 against NVIDIA's MLPerf v4.0 result: the best plan as modelled, and the same
    with the dense time scaled to MLPerf's DCNv2 by multiply-adds (at this model's TF32
    rate: MLPerf runs its dense part in fp16/bf16)."""
    at8 = [r for r in rows if r["W"] == 8 and "skipped" not in r and r["fits_memory"]
           and not r["plan"].endswith("_planner")]  # fmt: skip
    if not at8:
        return {}
    best = max(at8, key=lambda r: r["samples_per_s_per_gpu"])
    ratio = mlperf_dense_ratio()
    heavy = replace(device, dense_per_sample=device.dense_per_sample * ratio)
    as_mlperf = price(json.loads(json.dumps(best)), batch, heavy)
    return {
        "published_samples_per_s_per_gpu": MLPERF_H100,
        "plan": best["plan"],
        "predicted": best["samples_per_s_per_gpu"],
        "ratio": best["samples_per_s_per_gpu"] / MLPERF_H100,
        "mlperf_dense_macs_ratio": ratio,
        "predicted_with_mlperf_dense": as_mlperf["samples_per_s_per_gpu"],
        "ratio_with_mlperf_dense": as_mlperf["samples_per_s_per_gpu"] / MLPERF_H100,
    }


def _family(rows: list[dict], world: int, synced: bool, sliced: bool = False) -> list[dict]:
    """The simulated 2D shapes of one W that fit 80 GB: the exact-sync ones, or (``synced``)
    the ``sync_every`` ones, or (``sliced``) the fully sharded ones; not the ``*_planner``
    picks."""
    return [r for r in rows if r["W"] == world and r["plan"].startswith("2d_")
            and not r["plan"].endswith("_planner") and "skipped" not in r
            and r.get("fits_memory", True)
            and (r.get("sync_every") is not None) == synced
            and bool(r.get("fully_sharded")) == sliced]  # fmt: skip


def mesh_choices(rows: list[dict], w: Workload) -> list[dict]:
    """Per W: the shard group size ``dtrec.planning.mesh_choice`` (what
    ``dtrec.choose_shard_group_size`` returns) picks among the sweep's exact-sync 2D shapes,
    against the one this model predicts fastest; ``loss``: the model's step at the
    planner's pick over its best (1.0: the same shape, or as fast)."""
    out = []
    named = {cfg.name: cfg for cfg in w.tables()}
    for world in sorted({r["W"] for r in rows}):
        twod = {r["S"]: r for r in _family(rows, world, synced=False)}
        if len(twod) < 2:
            continue
        started = time.perf_counter()
        choice = rank_shard_group_sizes(
            named, world, 8, _topology(w), shard_group_sizes=sorted(twod)
        )
        best = min(twod.values(), key=lambda r: r["step_ms"])
        picked = twod[choice.shard_group_size]
        out.append({
            "W": world,
            "planner_S": choice.shard_group_size,
            "model_S": best["S"],
            "planner_order": list(choice.per_size),
            "model_order": [r["S"] for r in sorted(twod.values(), key=lambda r: r["step_ms"])],
            "loss": picked["step_ms"] / best["step_ms"],
            "seconds": time.perf_counter() - started,
        })  # fmt: skip
        c = out[-1]
        print(f"W={world:5d} planner picks S={c['planner_S']}, the model S={c['model_S']}: "
              f"{c['loss']:.2f}x the model's best step", flush=True)  # fmt: skip
    return out


def _fully_sharded(specs: dict[str, TableSpec]) -> dict[str, TableSpec]:
    """The specs with every sharded table fully sharded 2D (the planner's own variant,
    ``fully_sharded_candidates``; data-parallel tables stay as they are)."""
    return {k: (fully_sharded_candidates([s]) or [s])[0] for k, s in specs.items()}


def _type_counts(specs: dict[str, TableSpec]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for spec in specs.values():
        counts[type(spec).__name__] = counts.get(type(spec).__name__, 0) + 1
    return counts


FAMILIES = ("1d_row_wise", "1d_table_row_wise", "1d_planner", "2d", "2d_sync", "2d_fs")
"""What ``--plans`` may name: the 1D plans, every 2D shape (with ``2d_planner``), every
2D shape whose replicas average weights every ``--sync-every`` steps (TorchRec
DMPCollection's way; with ``2d_sync_planner``), and every 2D shape with R > 1 fully
sharded (``fully_sharded=True`` on the planner's sharded specs; with ``2d_fs_planner``)."""
SYNC_EVERY = [100]  # --sync-every sets it


def _too_big(w: Workload, specs: dict[str, TableSpec], world: int, shards: int) -> str | None:
    """Why a plan cannot be simulated here: its input dist sends every bag's length to every
    block of its table (blocks x B ints); past ``MAX_SEND_LENGTHS`` that buffer alone is GBs."""
    with mirror_world(0, world):
        axis = shard_axis(init_mesh("cpu", shards, 8))
    lengths = sum(len(specs[c.name].layout(c, axis).blocks) for c in w.tables()) * w.batch
    if lengths <= MAX_SEND_LENGTHS:
        return None
    return (f"the rank's ids all-to-all would send {lengths / 1e6:.0f}M bag lengths (one per "
            "bag per block), more than this machine can hold")  # fmt: skip


def sweep(
    w: Workload, worlds: tuple[int, ...], device: Device, families: tuple[str, ...] = FAMILIES
) -> list[dict]:
    rows = []
    for world in worlds:
        here = []
        for name in [f for f in families if f.startswith("1d_")]:
            try:
                if name == "1d_planner":
                    specs, rank = _planned(w, world, world)
                    source = "dtrec planner"
                else:
                    specs, rank, source = _one_d(w, world, name.removeprefix("1d_"))
            except ValueError as exc:  # no plan fits a GPU's memory (the planner says why)
                here.append({"plan": name, "W": world, "S": world, "R": 1, "skipped": str(exc)})
                continue
            why = _too_big(w, specs, world, world)
            if why:
                here.append({"plan": name, "W": world, "S": world, "R": 1, "skipped": why})
                continue
            here.append({**configuration(w, name, world, world, specs, rank, device),
                         "layouts": source})  # fmt: skip
        shapes = [(f"2d_S{g}", g) for g in GROUPS if g <= world]
        shapes += [(f"2d_R{g}", world // g) for g in GROUPS if g < world]
        k = SYNC_EVERY[0]
        kinds = (("2d", None, "", False), ("2d_sync", k, f"_k{k}", False),
                 ("2d_fs", None, "_fs", True))  # fmt: skip
        for family, every, suffix, sliced in kinds:
            if family not in families:
                continue
            twod = []
            for name, s in shapes:
                if (every is not None or sliced) and s == world:
                    continue  # no replicas: the same step as 2d_S{W}
                try:
                    specs, rank = _planned(w, world, s)
                except ValueError as exc:
                    here.append({"plan": name + suffix, "W": world, "S": s,
                                 "R": world // s, "skipped": str(exc)})  # fmt: skip
                    continue
                if sliced:
                    specs = _fully_sharded(specs)
                twod.append(configuration(w, name + suffix, world, s, specs, rank, device, every))
            here += twod
            fit = _family(twod, world, every is not None, sliced)  # the fastest that fits
            if fit:
                best = min(fit, key=lambda r: r["step_ms"])
                here.append({**best, "plan": f"{family}_planner", "chosen": best["plan"]})
        for r in here:
            if "skipped" in r:
                print(f"W={world:5d} {r['plan']:20s} not simulated: {r['skipped']}", flush=True)
            else:
                fits = (
                    "" if r["fits_memory"] else f" DOES NOT FIT ({r['memory_gb_per_rank']:.0f} GB)"
                )
                print(f"W={world:5d} {r['plan']:20s} S={r['S']:5d} step {r['step_ms']:8.2f} ms "
                      f"{r['samples_per_s_per_gpu'] / 1e6:6.3f} M samples/s/GPU, comm share "
                      f"{r['comm_share']:.2f}, comm {r['comm_bytes'] / 2**20:10.1f} MiB "
                      f"({r['simulate_s']:.1f} s){fits}", flush=True)  # fmt: skip
        rows += here
    return rows


def plot(rows: list[dict], path: str) -> str:
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: no PNG"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 8), sharex=True)
    # the 1D plans and each 2D family's fastest shape (every shape is in the JSON)
    shown = [r["plan"] for r in rows if "skipped" not in r]
    plans = sorted({p for p in shown if p.startswith("1d") or p.endswith("_planner")})
    for plan in plans:
        pts = sorted(((r["W"], r) for r in rows if r["plan"] == plan and "skipped" not in r),
                     key=lambda p: p[0])  # fmt: skip
        xs = [p[0] for p in pts]
        style = "-o" if plan.startswith("1d") else "-s"
        line = top.plot(xs, [p[1]["samples_per_s_per_gpu"] / 1e6 for p in pts], style, label=plan)
        over = [p for p in pts if not p[1].get("fits_memory", True)]
        top.plot([p[0] for p in over], [p[1]["samples_per_s_per_gpu"] / 1e6 for p in over],
                 "x", color=line[0].get_color(), ms=12)  # fmt: skip
        bottom.plot(xs, [p[1]["comm_share"] for p in pts], style, label=plan)
    top.axhline(MLPERF_H100 / 1e6, color="gray", lw=0.8, ls=":")
    top.text(8, MLPERF_H100 / 1e6 * 1.1, "MLPerf v4.0 HugeCTR, 8 H100", fontsize=8, color="gray")
    top.set_xscale("log", base=2)
    top.set_yscale("log")
    top.set_ylabel("M samples/s per GPU (predicted; x: over 80 GB)")
    bottom.set_ylabel("share of the step waiting on comm")
    bottom.set_xlabel("GPUs (W), H100 nodes of 8, NVLink + 8x400 Gb/s IB")
    top.legend(fontsize=8)
    fig.suptitle("dtrec, DLRM-DCNv2 MLPerf tables: 1D vs 2D, predicted (benchmarks/scale/run.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"wrote {path}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16384, help="samples per GPU per step")
    parser.add_argument("--max-world", type=int, default=4096)
    parser.add_argument(
        "--generated-batches",
        type=int,
        default=EXACT_WORLD,
        help="generate every rank's batch up to this W, the shard group's up to this S, for "
        "the touched rows (beyond: their expected count, the same for uniform ids); smaller "
        "is faster",
    )
    parser.add_argument(
        "--plans",
        default=",".join(FAMILIES),
        help=f"comma-separated, of {FAMILIES} ('2d': every 2D shape and the fastest)",
    )
    parser.add_argument(
        "--sync-every",
        type=int,
        default=SYNC_EVERY[0],
        help="the 2d_sync plans' k: replicas average weights and optimizer state every k "
        "steps (dtrec's sync_every; TorchRec DMPCollection's periodic sync)",
    )
    parser.add_argument(
        "--reprice",
        nargs="+",
        help="reports of this script (same batch): keep their simulated bytes, merged, and "
        "recompute every time with the current constants (seconds instead of minutes)",
    )
    parser.add_argument(
        "--mesh-choice",
        action="store_true",
        help="also plan every W's 2D shapes with dtrec's mesh choice and compare its pick "
        "with this model's fastest (report: planner_mesh_choice; minutes at large W)",
    )
    parser.add_argument("--json")
    parser.add_argument("--png")
    args = parser.parse_args(argv)
    GENERATED[0] = args.generated_batches
    SYNC_EVERY[0] = args.sync_every
    gpu_step = json.loads(GPU_STEP.read_text())
    h200 = calibrate(gpu_step)
    h100 = scaled(h200, "H100", H100_COPY)
    check = one_gpu_check(gpu_step, h200)
    for row in check:
        note = f"  (calibrates {', '.join(row['calibrates'])})" if row["calibrates"] else ""
        print(
            f"1-GPU {row['config']:18s} measured {row['measured_ms']:6.2f} ms, predicted "
            f"{row['predicted_ms']:6.2f} ms, error {100 * row['error']:+5.1f}%{note}"
        )
    worst = max(abs(r["error"]) for r in check)
    command = " ".join(["python -m benchmarks.scale", *argv])
    if args.reprice:
        olds = [json.loads(Path(p).read_text()) for p in args.reprice]
        batch = olds[0]["workload"]["batch_per_gpu"]
        if any(o["workload"]["batch_per_gpu"] != batch for o in olds):
            parser.error("--reprice: the reports' batches per GPU differ")
        rows = [r if "skipped" in r else price(r, batch, h100)
                for o in olds for r in o["configs"]]  # fmt: skip
        rows.sort(key=lambda r: (r["W"], r["plan"]))
        _choose_2d(rows)
        w = mlperf(batch)
        command = "; ".join(o["meta"]["command"] for o in olds) + f"; repriced: {command}"
    else:
        w = mlperf(args.batch)
        families = tuple(args.plans.split(","))
        unknown = sorted(set(families) - set(FAMILIES))
        if unknown:
            parser.error(f"unknown --plans {unknown}; choose from {FAMILIES}")
        rows = sweep(w, tuple(x for x in WORLDS if x <= args.max_world), h100, families)
    report = {
        "meta": {
            "date": datetime.date.today().isoformat(),
            "command": command,
            "processor": processor(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "calibration": str(GPU_STEP.relative_to(RESULTS.parent.parent)),
        },
        "workload": {
            "rows": list(w.rows),
            "hotness": list(w.hotness),
            "dim": w.dim,
            "batch_per_gpu": w.batch,
        },
        "fabric": vars(Fabric()),
        "devices": {"H200": vars(h200), "H100": vars(h100)},
        "one_gpu_check": {
            "tolerance": TOLERANCE,
            "worst_error": worst,
            "rows": check,
            "ok": worst <= TOLERANCE,
        },
        "mlperf_anchor": anchor(rows, w.batch, h100),
        "planner_mesh_choice": mesh_choices(rows, w) if args.mesh_choice else None,
        "configs": rows,
    }
    a = report["mlperf_anchor"]
    if a:
        print(f"W=8 best ({a['plan']}): {a['predicted'] / 1e6:.2f}M samples/s/GPU vs MLPerf "
              f"v4.0 HugeCTR {MLPERF_H100 / 1e6:.2f}M ({a['ratio']:.2f}x); with MLPerf's "
              f"DCNv2 dense ({a['mlperf_dense_macs_ratio']:.1f}x the multiply-adds, TF32): "
              f"{a['predicted_with_mlperf_dense'] / 1e6:.2f}M "
              f"({a['ratio_with_mlperf_dense']:.2f}x)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {args.json}")
    if args.png:
        print(plot(rows, args.png))
    if worst > TOLERANCE:
        print(f"one-GPU check FAILED: worst error {100 * worst:.1f}% > {100 * TOLERANCE:.0f}%")
        return 1
    return 0


def _choose_2d(rows: list[dict]) -> None:
    """Re-pick each W's ``2d_planner``, ``2d_sync_planner`` and ``2d_fs_planner`` rows: the
    fastest 2D configuration of each family as now priced."""
    for world in sorted({r["W"] for r in rows}):
        for family, synced, sliced in (("2d", False, False), ("2d_sync", True, False),
                                       ("2d_fs", False, True)):  # fmt: skip
            pick = f"{family}_planner"
            twod = _family(rows, world, synced, sliced)
            if not twod:
                continue
            best = min(twod, key=lambda r: r["step_ms"])
            for i, r in enumerate(rows):
                if r["W"] == world and r["plan"] == pick:
                    rows[i] = {**best, "plan": pick, "chosen": best["plan"]}


if __name__ == "__main__":
    sys.exit(main())
