"""Bytes per step and memory per rank of the ways to run 2D exactly (issue 43's design choice).

For each workload and (S, R) mesh, every table row-wise over the S shard positions
(blocks of 1/S of the rows and of the ids), per rank:

- ``exact``: today's exact 2D, whole shard + state on every replica; the replica sync
  sends min(sparse all-gather (R-1) x U x (4D + 8), dense all-reduce 2 (R-1)/R x shard);
- ``gather``: fully sharded by gathering the shard per step (TorchRec's FULLY_SHARDED
  shape, made exact by reduce-scattering gradients): 2 (R-1)/R x shard; peak shard +
  shard/R + U x 4D (the gradient rows);
- ``routed``: fully sharded by routing the touched rows to and from their owner slices
  (what dtrec builds): ids out, rows back, gradients out along the same way (the owners
  kept the ids): (R-1)/R x U x (8D + 8); peak shard/R + 2 x U x 4D (compact table and
  its gradients).

U is a rank's distinct touched rows per step: its block receives the ids of its shard
group's S batches; expected distinct rows of n draws (uniform ids, as the scale sweep's,
or Zipf as the CPU benchmark's). fp32 weights; optimizer state is row-wise Adagrad's one
float per row (Adam's 2 x D per row scales "state" by 2D). Run::

    PYTHONPATH=. python benchmarks/fully_sharded_bytes.py   # docs/fully_sharded_2d.md's table
"""

from __future__ import annotations

import numpy as np

from benchmarks.common.dlrm import MLPERF_HOTNESS, MLPERF_ROWS
from benchmarks.common.workloads import workload, zipf_row_probs


def distinct_uniform(rows: int, n: float) -> float:
    """Expected distinct values among ``n`` uniform draws over ``rows``."""
    return rows * -np.expm1(n * np.log1p(-1.0 / rows)) if rows > 1 else min(1.0, n)


def distinct_probs(probs: np.ndarray, n: float) -> float:
    """Expected distinct rows among ``n`` draws with row probabilities ``probs``."""
    return float(np.sum(-np.expm1(n * np.log1p(-np.minimum(probs, 1 - 1e-16)))))


def per_rank(rows, hotness, dim, batch, shards, replicas, probs=None) -> dict[str, float]:
    """Bytes per rank (see the module doc) for tables ``rows`` read ``hotness`` ids a sample."""
    shard = touched = 0.0
    for t, (n_rows, h) in enumerate(zip(rows, hotness, strict=True)):
        ids = shards * batch * h  # the shard group's ids of this table per step
        u = distinct_uniform(n_rows, ids) if probs is None else distinct_probs(probs[t], ids)
        shard += n_rows / shards
        touched += u / shards
    r = replicas
    row_b, wire = 4 * dim, 4 * dim + 8
    shard_b = shard * row_b
    state_b = shard * 4
    return {
        "shard_gb": (shard_b + state_b) / 1e9,
        "slice_gb": (shard_b + state_b) / r / 1e9,
        "touched_rows": touched,
        "touched_share": touched / shard,
        "exact_sparse_gb": (r - 1) * touched * wire / 1e9,
        "exact_dense_gb": 2 * (r - 1) / r * shard_b / 1e9,
        "gather_gb": 2 * (r - 1) / r * shard_b / 1e9,
        "gather_peak_gb": (shard_b + (shard_b + state_b) / r + touched * row_b) / 1e9,
        "routed_gb": (r - 1) / r * touched * (wire + row_b) / 1e9,
        "routed_peak_gb": ((shard_b + state_b) / r + 2 * touched * row_b) / 1e9,
    }


def main() -> None:
    cases = []
    cpu = workload()
    probs = [zipf_row_probs(n, cpu.zipf) for n in cpu.rows]
    hot = [cpu.mean_bag] * len(cpu.rows)
    for s, r in ((2, 2), (2, 4), (4, 2)):
        cases.append(("CPU bench (8 x 1e5..1e6, D64, B512, Zipf 1.1)", s, r,
                      per_rank(cpu.rows, hot, cpu.dim, cpu.batch, s, r, probs)))  # fmt: skip
    for s, r in ((16, 2), (64, 8), (64, 64), (8, 512)):
        cases.append(("MLPerf DLRM (26 tables, D128, B16384, uniform)", s, r,
                      per_rank(MLPERF_ROWS, MLPERF_HOTNESS, 128, 16384, s, r)))  # fmt: skip
    print(
        "| workload | S x R | shard + state GB (exact) | slice GB (FS) | touched rows "
        "(share of shard) | exact sync GB/step (sparse / dense) | gather GB/step (peak GB) | "
        "routed GB/step (peak GB) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, s, r, x in cases:
        print(
            f"| {name} | {s} x {r} | {x['shard_gb']:.3g} | {x['slice_gb']:.3g} | "
            f"{x['touched_rows']:,.0f} ({100 * x['touched_share']:.2g}%) | "
            f"{x['exact_sparse_gb']:.3g} / {x['exact_dense_gb']:.3g} | "
            f"{x['gather_gb']:.3g} ({x['gather_peak_gb']:.3g}) | "
            f"{x['routed_gb']:.3g} ({x['routed_peak_gb']:.3g}) |"
        )


if __name__ == "__main__":
    main()
