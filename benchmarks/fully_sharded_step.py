"""Fully sharded 2D against exact 2D in one sitting: memory at rest, bytes per axis, step time.

Both models (every table ``RowWise()`` vs ``RowWise(fully_sharded=True)``, fused row-wise
Adagrad, benchmarks/distributed.py's workload: 8 tables of 1e5..1e6 rows x ``--scale``,
D = 64, bags of ~20 Zipf(1.1) ids, ``--batch`` samples per rank) are built in one gloo
world and stepped alternately on the same batches, so machine load hits both alike. Per
rank: table + fused state bytes at rest, bytes sent per mesh axis per step, and the
median step time; the ratio fully sharded / exact. Run::

    PYTHONPATH=. python benchmarks/fully_sharded_step.py --world-size 4 --shards 2 \\
        --json /tmp/fs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import dtrec
from benchmarks.distributed import LR, Model, make_batch, workload
from dtrec.placements import RowWise
from tests.multiprocess import run_world


def _at_rest_bytes(model: nn.Module) -> int:
    """This rank's table blocks (or owner slices) and fused optimizer state, in bytes."""
    ebc = model.ebc
    weights = sum(t.weight.to_local().nbytes for t in ebc.embedding_bags.values())
    states = sum(v.nbytes for s in ebc.fused_optimizer_state().values() for v in s.values())
    return weights + states


def _rank(rank: int, world: int, shards: int, scale: float, batch: int, steps: int) -> dict:
    torch.manual_seed(0)
    w = workload(scale, batch)
    mesh = dtrec.init_mesh("cpu", shards)
    models = {}
    for name, fully_sharded in (("exact", False), ("fully_sharded", True)):
        tables = [
            dtrec.EmbeddingBagConfig(f"t{i}", r, w.dim, [f"f{i}"]) for i, r in enumerate(w.rows)
        ]
        ebc = dtrec.EmbeddingBagCollection(tables, device="meta")
        plan = {f"ebc.t{i}": RowWise(fully_sharded=fully_sharded) for i in range(len(w.rows))}
        model = dtrec.distribute_module(
            Model(ebc, w), mesh, plan, optimizer=dtrec.optim.RowWiseAdagrad(lr=LR)
        )
        dense = [p for n, p in model.named_parameters() if not n.startswith("ebc.")]
        models[name] = (model, torch.optim.Adagrad(dense, lr=LR))
    times: dict[str, list[float]] = {name: [] for name in models}
    axes: dict[str, dict[str, float]] = {}
    comm_ms: dict[str, dict[str, float]] = {}  # host ms inside each collective kind
    for step in range(steps + 2):  # two warm-up steps
        keys, values, lengths, labels = make_batch(w, rank, step)
        kjt = dtrec.KeyedJaggedTensor(keys, values, lengths)
        for name, (model, opt) in models.items():
            dist.barrier()
            with dtrec.comm_stats() as stats:
                start = time.perf_counter()
                loss = nn.functional.binary_cross_entropy_with_logits(model(kjt), labels)
                loss.backward()
                opt.step()
                opt.zero_grad()
                elapsed = time.perf_counter() - start
            if step >= 2:
                times[name].append(1e3 * elapsed)
                for axis, nbytes in stats.bytes_per_axis.items():
                    per = axes.setdefault(name, {})
                    per[axis] = per.get(axis, 0.0) + nbytes / steps
                for kind, seconds in stats.seconds.items():
                    per = comm_ms.setdefault(name, {})
                    per[kind] = per.get(kind, 0.0) + 1e3 * seconds / steps
    return {
        name: {
            "at_rest_bytes": _at_rest_bytes(model),
            "step_ms": statistics.median(times[name]),
            "bytes_per_axis": axes.get(name, {}),
            "comm_ms": comm_ms.get(name, {}),
        }
        for name, (model, _) in models.items()
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--shards", type=int, default=2, help="S; R = world / S")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies table rows")
    parser.add_argument("--batch", type=int, default=512, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (each model)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    ranks = run_world(
        args.world_size, _rank, args.shards, args.scale, args.batch, args.steps, timeout=1800.0
    )
    out = {"args": vars(args), "ranks": ranks, "median": {}}
    for name in ("exact", "fully_sharded"):
        out["median"][name] = {
            key: statistics.median(r[name][key] for r in ranks)
            for key in ("at_rest_bytes", "step_ms")
        }
        out["median"][name]["bytes_per_axis"] = {
            axis: statistics.median(r[name]["bytes_per_axis"].get(axis, 0.0) for r in ranks)
            for axis in sorted({a for r in ranks for a in r[name]["bytes_per_axis"]})
        }
    m = out["median"]
    out["ratio"] = {
        "at_rest": m["fully_sharded"]["at_rest_bytes"] / m["exact"]["at_rest_bytes"],
        "step_ms": m["fully_sharded"]["step_ms"] / m["exact"]["step_ms"],
    }
    print(json.dumps({"median": m, "ratio": out["ratio"]}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
