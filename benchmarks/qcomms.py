"""Quantized communication on W gloo CPU ranks: bytes and step time, fp32 vs bf16 vs fp16.

The model, batches and optimizers of ``benchmarks/distributed.py`` (imported from it: 8
tables of 1e5..1e6 rows times ``--scale``, D=64, bags of 10..30 Zipf ids, ``--batch``
samples per rank, fused row-wise Adagrad, an MLP on top). Per config (``table_wise``,
``row_wise``, ``column_wise``, ``2d_row_wise``: S = W / 2, R = 2) one world builds three
copies of the model from the same seed: ``qcomms=None`` (fp32), all-bf16
(``QCommsConfig("bf16", "bf16", "bf16")``) and all-fp16 with a backward loss scale of
1024, and runs their steps round robin, each after a barrier, so the machine's load hits
all three alike. Reported per precision: median step ms, bytes per step by collective kind
(``dtrec.comm_stats``, what this rank sends, median over ranks), and how far training
drifts from fp32 (losses, largest local weight difference after the last step).

    .venv/bin/python -m benchmarks.qcomms --steps 20 --warmup 3 \\
        --json benchmarks/results/qcomms_cpu_<date>.json
    .venv/bin/python -m benchmarks.qcomms --scale 0.01 --batch 32 --steps 2 --warmup 1
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
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dtrec
from benchmarks.common.run_loop import MALLOC_ENV
from benchmarks.common.workloads import (
    EPS,
    LR,
    Model,
    Workload,
    config_shards,
    dtrec_spec,
    make_batch,
    table_kinds,
    workload,
)
from tests.multiprocess import run_world

CONFIGS = ("table_wise", "row_wise", "column_wise", "2d_row_wise")
PRECISIONS = {
    "fp32": None,
    "bf16": dtrec.QCommsConfig("bf16", "bf16", "bf16"),
    "fp16": dtrec.QCommsConfig("fp16", "fp16", "fp16", backward_loss_scale=1024.0),
}
QUANTIZED_KINDS = (
    "output_dist",
    "output_dist.backward",
    "grad_sync.replicate.sparse",
    "grad_sync.replicate.dense",
)
"""The collectives a ``QCommsConfig`` sends in fp16 / bf16 (the others carry ids and counts)."""


def _build(w: Workload, kinds: list[str], shards: int, qcomms: object):
    torch.manual_seed(0)  # same tables (each rank inits its blocks from it) and MLP
    ebc = dtrec.EmbeddingBagCollection(
        [dtrec.EmbeddingBagConfig(f"t{i}", r, w.dim, [f"f{i}"]) for i, r in enumerate(w.rows)],
        device="meta",
    )
    plan = {f"ebc.t{i}": dtrec_spec(k) for i, k in enumerate(kinds)}
    model = dtrec.distribute_module(
        Model(ebc, w),
        dtrec.init_mesh("cpu", shard_group_size=shards),
        plan,
        optimizer=dtrec.optim.RowWiseAdagrad(lr=LR, eps=EPS),
        qcomms=qcomms,
    )
    dense = [p for n, p in model.named_parameters() if n.startswith("dense.")]
    return model, torch.optim.Adagrad(dense, lr=LR)


def run_rank(rank: int, world: int, config: str, w: Workload, steps: int, warmup: int) -> dict:
    """One rank: the three models' steps round robin; per precision ms, bytes, losses."""
    shards = config_shards(config, world)
    kinds = table_kinds(config, shards, len(w.rows))
    models = {name: _build(w, kinds, shards, q) for name, q in PRECISIONS.items()}
    step_ms: dict[str, list[float]] = defaultdict(list)
    losses: dict[str, list[float]] = defaultdict(list)
    sent: dict[str, dict[str, int]] = {name: defaultdict(int) for name in PRECISIONS}
    for s in range(warmup + steps):
        keys, values, lengths, labels = make_batch(w, rank, s)
        kjt = dtrec.KeyedJaggedTensor(keys, values, lengths)
        for name, (model, opt) in models.items():
            dist.barrier()
            start = time.perf_counter()
            with dtrec.comm_stats() as stats:
                loss = F.binary_cross_entropy_with_logits(model(kjt), labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            elapsed = 1e3 * (time.perf_counter() - start)
            losses[name].append(loss.item())
            if s >= warmup:
                step_ms[name].append(elapsed)
                for kind, nbytes in stats.bytes_sent.items():
                    sent[name][kind] += nbytes
    fp32_tables = models["fp32"][0].ebc.embedding_bags
    drift = {}
    for name, (model, _) in models.items():
        diffs = [
            (model.ebc.embedding_bags[t].weight.to_local() - table.weight.to_local()).abs()
            for t, table in fp32_tables.items()
        ]
        drift[name] = max((d.max().item() for d in diffs if d.numel()), default=0.0)
    return {
        "median_ms": {name: statistics.median(ms) for name, ms in step_ms.items()},
        "bytes_per_step": {
            name: {kind: n / steps for kind, n in sorted(by_kind.items())}
            for name, by_kind in sent.items()
        },
        "loss_first_last": {name: [ls[0], ls[-1]] for name, ls in losses.items()},
        "max_local_weight_diff_vs_fp32": drift,
    }


def summarize(ranks: list[dict]) -> dict:
    """Medians over ranks, and each precision's bytes relative to fp32."""
    out: dict = {"step_ms": {}, "bytes_per_step": {}, "quantized_bytes_ratio": {}}
    for name in PRECISIONS:
        out["step_ms"][name] = statistics.median(r["median_ms"][name] for r in ranks)
        kinds = sorted({k for r in ranks for k in r["bytes_per_step"][name]})
        out["bytes_per_step"][name] = {
            k: statistics.median(r["bytes_per_step"][name].get(k, 0) for r in ranks) for k in kinds
        }
    fp32 = out["bytes_per_step"]["fp32"]
    for name, by_kind in out["bytes_per_step"].items():
        quantized = sum(by_kind.get(k, 0) for k in QUANTIZED_KINDS)
        base = sum(fp32.get(k, 0) for k in QUANTIZED_KINDS)
        out["quantized_bytes_ratio"][name] = {
            "quantized_collectives": quantized / base if base else None,
            "all_dtrec_collectives": sum(by_kind.values()) / sum(fp32.values()),
        }
    out["max_local_weight_diff_vs_fp32"] = {
        name: max(r["max_local_weight_diff_vs_fp32"][name] for r in ranks) for name in PRECISIONS
    }
    out["loss_first_last_rank0"] = ranks[0]["loss_first_last"]
    return out


def print_table(results: dict[str, dict]) -> None:
    print(f"{'config':14s} {'prec':5s} {'ms/step':>8s} {'bytes/step':>12s} {'q-bytes':>8s}"
          f" {'all-bytes':>9s} {'max |dw|':>9s}")  # fmt: skip
    for config, r in results.items():
        if "error" in r:
            print(f"{config:14s} failed")
            continue
        for name in PRECISIONS:
            ratio = r["quantized_bytes_ratio"][name]
            total = sum(r["bytes_per_step"][name].values())
            print(
                f"{config:14s} {name:5s} {r['step_ms'][name]:8.1f} {total:12,.0f} "
                f"{ratio['quantized_collectives']:8.3f} {ratio['all_dtrec_collectives']:9.3f} "
                f"{r['max_local_weight_diff_vs_fp32'][name]:9.2e}"
            )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies table rows")
    parser.add_argument("--batch", type=int, default=512, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per precision")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"of {CONFIGS}")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per world, seconds")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args(argv)
    w = workload(args.scale, args.batch)
    configs = [c for c in args.configs.split(",") if c]
    if sorted(set(configs) - set(CONFIGS)):
        parser.error(f"unknown configs {sorted(set(configs) - set(CONFIGS))}; of {CONFIGS}")
    results: dict[str, dict] = {}
    for config in configs:
        start, load = time.perf_counter(), os.getloadavg()[0]
        ranks = run_world(
            args.world_size,
            run_rank,
            config,
            w,
            args.steps,
            args.warmup,
            timeout=args.timeout,
            env=MALLOC_ENV,
        )
        results[config] = {
            **summarize(ranks),
            "wall_s": time.perf_counter() - start,
            "load_avg": [load, os.getloadavg()[0]],
        }
        print(f"[{config}] done in {results[config]['wall_s']:.0f} s", flush=True)
    print_table(results)
    if args.json:
        report = {
            "meta": {
                "argv": argv,
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "workload": {"rows": w.rows, "dim": w.dim, "batch": w.batch},
                "world_size": args.world_size,
                "precisions": {k: repr(v) for k, v in PRECISIONS.items()},
            },
            "results": results,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
