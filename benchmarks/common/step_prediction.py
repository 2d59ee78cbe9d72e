"""The step ``benchmarks.distributed`` predicts per config, against the step it measures.

Issue 33: the planner's cost model (``dtrec.planning.cost_model``: bytes per position,
memory-bound lookups and updates) plus a latency per collective call
(``dtrec.planning.plan_step``), on a ``Topology`` whose constants were measured in the same
run by ``benchmarks/probes/cpu_calibration.py`` (one world of W gloo ranks before the
configs; again after them, to flag a run during which the machine's speed changed).
Reported per config: predicted and measured ms, the error (target: within ``TOLERANCE``),
the predicted communication share; and whether the plans' order by predicted time is the
measured one (measured steps within ``NOISE`` of each other are a tie: either order is
right).
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.common.run_loop import MALLOC_ENV, build_dtrec
from benchmarks.common.workloads import (
    Model,
    Workload,
    config_shards,
    dtrec_spec,
    make_batch,
    row_probs,
    table_kinds,
    zipf_ids,
)
from benchmarks.probes import cpu_calibration
from dtrec import KeyedJaggedTensor
from dtrec.modules.config import EmbeddingBagConfig
from dtrec.placements.mesh import ShardAxis
from dtrec.planning.cost_model import table_cost
from dtrec.planning.plan_step import PlanStep, plan_step
from tests.multiprocess import run_world

TOLERANCE = 0.30
NOISE = 0.10
DRIFT = 0.15
"""Predictions from the calibration repeated after the configs further than this from the
first one's: the machine's speed changed during the run."""


def _dense(w: Workload) -> nn.Module:
    """The benchmark model's dense arch (same shapes, fresh weights)."""
    return Model(nn.Identity(), w).dense


def floor_workload(w: Workload) -> Workload:
    """The host floor's model: ``w``'s tables cut to 64 rows, bags of one id."""
    return replace(w, rows=(64,) * len(w.rows), bag_range=(1, 1))


def _floor_step_s(rank: int, world: int, w: Workload, steps: int = 8) -> tuple[float, float]:
    """Median wall seconds of a table-wise dtrec step of ``floor_workload(w)`` and the CPU
    seconds of its thread: what a step costs the host besides the bytes and calls the model
    prices (Python, autograd, the KJT's small ops). CPU, not wall less the priced calls:
    the tiny step's calls cost less than calls after real compute, and while its peers wait
    in them a rank runs alone on a core, faster than in a step where all ranks compute."""
    tiny = floor_workload(w)
    torch.manual_seed(0)  # every rank alike, as distribute_module checks
    model, optimizers, *_ = build_dtrec(tiny, table_kinds("table_wise", world), world)
    batches = []
    for s in range(steps + 2):
        keys, values, lengths, labels = make_batch(tiny, rank, s)
        batches.append((KeyedJaggedTensor(keys=keys, values=values, lengths=lengths), labels))
    times, cpu = [], []
    for kjt, labels in batches:
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.thread_time()
        loss = F.binary_cross_entropy_with_logits(model(kjt), labels)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        for opt in optimizers:
            opt.step()
        loss.item()
        times.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
    return statistics.median(times[2:]), statistics.median(cpu[2:])


def _calibrate_rank(rank: int, world: int, w: Workload) -> dict:
    sample = functools.partial(_zipf, s=w.zipf)
    width = len(w.rows) * w.dim
    out = cpu_calibration.measure_rank(rank, world, sample, _dense(w), w.batch, width)
    out["floor_step_s"], out["floor_cpu_s"] = _floor_step_s(rank, world, w)
    return out


def calibrate(w: Workload, world: int = 4) -> dict:
    """The constants (``cpu_calibration``), measured by ``world`` ranks at once, with the
    benchmark's id skew, dense arch and rank environment, and the host floor: a tiny step's
    CPU seconds at the share of a core a rank gets when all ranks compute (``ranks_per_core``:
    ranks over the cores they share, at least 1), less the compute the model predicts for
    it (``host_s``); ``wall_s`` what it took."""
    start = time.perf_counter()
    ranks = run_world(world, _calibrate_rank, w, env=MALLOC_ENV)
    out = cpu_calibration.combine(ranks)
    out["host_s"] = 0.0
    tiny = predict(floor_workload(w), "table_wise", out, world).compute
    out["ranks_per_core"] = max(1.0, world / len(os.sched_getaffinity(0)))
    out["host_s"] = max(0.0, out["floor_cpu_s"] * out["ranks_per_core"] - tiny)
    out["wall_s"] = time.perf_counter() - start
    return out


def _zipf(rows: int, n: int, gen: torch.Generator, s: float) -> torch.Tensor:
    """``zipf_ids`` in ``cpu_calibration.IdSampler``'s argument order."""
    return zipf_ids(rows, n, s, gen)


def predict(w: Workload, config: str, calibration: dict, world: int = 4) -> PlanStep:
    """The predicted step of ``config`` (its tables by the cost model, the dense part from
    the calibration: its forward + backward + step, one all-reduce of its gradients)."""
    shards = config_shards(config, world)
    axis = ShardAxis(shards, world // shards, None)
    topology = cpu_calibration.topology(
        calibration, batch_size_per_rank=w.batch, default_pooling_factor=w.mean_bag
    )
    costs = [
        table_cost(EmbeddingBagConfig(f"t{i}", w.rows[i], w.dim), dtrec_spec(kind), axis,
                   topology, row_probs(w.rows[i], w.zipf))
        for i, kind in enumerate(table_kinds(config, shards, len(w.rows)))
    ]  # fmt: skip
    dense_bytes = 4 * sum(p.numel() for p in _dense(w).parameters())
    sent = 2 * (world - 1) / world * dense_bytes
    return plan_step(
        costs,
        axis,
        topology,
        extra_calls=1,
        extra_comm=sent / (topology.replica_bandwidth or topology.intra_node_bandwidth),
        extra_compute=calibration["dense_s"] + calibration.get("host_s", 0.0),
    )


def misordered(measured: dict[str, float], predicted: dict[str, float]) -> list[tuple[str, str]]:
    """Pairs (a, b) measured faster by more than ``NOISE`` that the prediction does not
    rank faster."""
    return [
        (a, b)
        for a in measured
        for b in measured
        if measured[a] < measured[b] * (1 - NOISE) and not predicted[a] < predicted[b]
    ]


def check(
    w: Workload, results: dict, calibration: dict, world: int = 4, after: dict | None = None
) -> dict:
    """Predicted vs measured dtrec step per config of ``results`` (``benchmarks.distributed``
    runs), printed; returns the report's ``step_prediction`` section.

    ``after``: the same calibration repeated after the configs. Its predictions over the
    first one's (``drift``) say whether the machine kept its speed through the run: another
    job starting mid-run makes the errors meaningless, and the report says so."""
    rows, measured, predicted = {}, {}, {}
    for config, runs in results.items():
        run = runs.get("dtrec")
        if not run or run["status"] != "ok":
            continue
        step = predict(w, config, calibration, world)
        measured[config] = run["median"]["step_ms"]
        predicted[config] = 1e3 * step.step
        error = predicted[config] / measured[config] - 1
        rows[config] = {
            "predicted_ms": predicted[config],
            "measured_ms": measured[config],
            "error": error,
            "within": abs(error) <= TOLERANCE,
            "compute_ms": 1e3 * step.compute,
            "comm_ms": 1e3 * step.comm,
            "calls": step.calls,
            "comm_share": step.comm_share,
        }
        if after is not None:
            rows[config]["drift"] = predict(w, config, after, world).step / step.step - 1
    wrong = misordered(measured, predicted)
    c, k = calibration, cpu_calibration.compute_constants(calibration)
    print(
        f"\npredicted vs measured dtrec step (calibrated in this run, {c['wall_s']:.0f} s: "
        f"latency {1e3 * c['latency_s']:.2f} ms/call (all-reduce "
        f"{1e3 * c.get('reduce_latency_s', c['latency_s']):.2f}, all-gather "
        f"{1e3 * c.get('gather_latency_s', c['latency_s']):.2f}), all-to-all "
        f"{c['a2a_bandwidth'] / 1e9:.2f} GB/s, all-gather {c['gather_bandwidth'] / 1e9:.2f} "
        f"GB/s, lookup + update {k['bandwidth'] / 1e9:.2f} GB/s + {k['id_cost_bytes']:.0f} B "
        f"per id + {k['row_cost_bytes']:.0f} B per row, synced update x"
        f"{k['synced_factor']:.2f}, dense {1e3 * c['dense_s']:.2f} ms, host floor "
        f"{1e3 * c['host_s']:.2f} ms)"
    )
    head = f"{'config':<16}{'pred ms':>9}{'meas ms':>9}{'error':>8}{'comm ms':>9}{'calls':>6}"
    print(head + f"{'comm %':>8}  within {TOLERANCE:.0%}")
    print("-" * (len(head) + 18))
    for config, r in rows.items():
        print(
            f"{config:<16}{r['predicted_ms']:>9.1f}{r['measured_ms']:>9.1f}{r['error']:>+8.0%}"
            f"{r['comm_ms']:>9.1f}{r['calls']:>6}{r['comm_share']:>8.0%}  "
            + ("yes" if r["within"] else "NO")
        )
    by = lambda d: " < ".join(sorted(d, key=d.get))  # noqa: E731
    print(f"order measured:  {by(measured)}")
    print(f"order predicted: {by(predicted)}")
    print(
        "ordering: "
        + (f"right (ties within {NOISE:.0%} allowed)" if not wrong else f"WRONG for {wrong}")
    )
    drift = [r["drift"] for r in rows.values() if "drift" in r]
    if drift:
        worst = max(drift, key=abs)
        print(f"calibration repeated after the configs: predictions {worst:+.0%} at most"
              + (": WARNING, the machine's speed changed during the run (another job?); "
                 "errors and order are not meaningful" if abs(worst) > DRIFT else ""))  # fmt: skip
    return {"calibration": calibration, "calibration_after": after, "configs": rows,
            "misordered": wrong, "tolerance": TOLERANCE, "noise": NOISE}  # fmt: skip
