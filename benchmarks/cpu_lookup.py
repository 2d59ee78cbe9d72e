#!/usr/bin/env python
"""CPU benchmark: batched multi-table pooled embedding lookup (forward, forward+backward).

Compares candidate CPU kernels for dtrec's table-batched pooled lookup:

  (a) ``a_loop``      Python loop, one ``F.embedding_bag(mode="sum")`` per table.
  (b) ``b_concat``    Tables of equal dim concatenated into one weight matrix, ids shifted
                      by per-table row offsets, ONE ``F.embedding_bag`` per dim group.
  (c) fbgemm_gpu CPU table-batched embedding (TBE):
      ``c_tbe_dense``  ``DenseTableBatchedEmbeddingBagsCodegen(use_cpu=True)``: plain
                       autograd, produces a dense grad for the flat weight (like nn.EmbeddingBag
                       with sparse=False).
      ``c_tbe_split``  ``SplitTableBatchedEmbeddingBagsCodegen`` with EmbeddingLocation.HOST /
                       ComputeDevice.CPU: backward is fused with the optimizer (EXACT_SGD or
                       EXACT_ROWWISE_ADAGRAD), i.e. it updates the weights in place and produces
                       no .grad.

Input layout (shared by all variants, the KeyedJaggedTensor / TBE layout): ``indices`` is the
1-D concatenation of all ids, table-major; ``offsets`` has T*B+1 entries, bag (t, b) is
``indices[offsets[t*B+b]:offsets[t*B+b+1]]``. Per-variant input preparation (splitting and
rebasing offsets for (a), shifting ids for (b)) is INSIDE the timed region. Every variant returns
a (B, sum(D_t)) tensor with tables in feature order.

Forward is timed under ``torch.no_grad()``. Forward+backward uses a fixed random grad_output;
``.grad`` is reset to None (untimed) before every iteration so grads are not accumulated.

Caveat: dense-grad variants allocate a fresh full-size grad every step; with glibc malloc an
allocation above the mmap threshold (max 32 MiB) is mmap'ed and page-faulted each time, which can
dominate their time (e.g. MALLOC_MMAP_THRESHOLD_=4000000000 roughly halves them). The split TBE
(fused optimizer) allocates no weight-sized buffers.

Example:
    python benchmarks/cpu_lookup.py --threads 1,2 --json benchmarks/results/cpu_lookup.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

try:
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm.*)
    from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        DenseTableBatchedEmbeddingBagsCodegen,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    HAVE_FBGEMM = True
    FBGEMM_VERSION = getattr(fbgemm_gpu, "__version__", "unknown")
except Exception as e:  # pragma: no cover - benchmark degrades gracefully
    HAVE_FBGEMM = False
    FBGEMM_VERSION = f"unavailable ({type(e).__name__}: {e})"

# fbgemm logs a lot at INFO on construction; the dense TBE backward triggers a (harmless,
# grads verified below) "autograd kernel was not registered" UserWarning.
logging.getLogger().setLevel(logging.WARNING)
warnings.filterwarnings("ignore", message=".*autograd kernel was not registered.*")

LR = 0.01
TOL = 1e-4
GRAD_RTOL = 1e-5


# ----------------------------------------------------------------------------- inputs


@dataclass
class Config:
    name: str
    dims: list  # per-table embedding dim
    rows: list  # per-table rows
    batch: int
    pooling_factor: float
    length_dist: str
    zipf_a: float
    seed: int

    @property
    def num_tables(self) -> int:
        return len(self.dims)

    def summary(self) -> dict:
        d = asdict(self)
        d["num_tables"] = self.num_tables
        d["total_D"] = int(sum(self.dims))
        d["total_rows"] = int(sum(self.rows))
        d["weights_MiB"] = round(sum(r * dd for r, dd in zip(self.rows, self.dims)) * 4 / 2**20, 1)
        if len(set(self.dims)) == 1:
            d["dims"] = f"{self.dims[0]} x {self.num_tables}"
        if len(set(self.rows)) == 1:
            d["rows"] = f"{self.rows[0]} x {self.num_tables}"
        return d


def make_inputs(cfg: Config):
    """KJT-style (indices, offsets) with table-major layout, int64."""
    rng = np.random.default_rng(cfg.seed)
    T, B = cfg.num_tables, cfg.batch
    if cfg.length_dist == "poisson":
        lengths = rng.poisson(cfg.pooling_factor, size=T * B)
    elif cfg.length_dist == "uniform":
        pf = int(round(cfg.pooling_factor))
        lengths = rng.integers(max(0, pf // 2), pf + pf // 2 + 1, size=T * B)
    else:  # fixed
        lengths = np.full(T * B, int(round(cfg.pooling_factor)))
    ids = []
    for t in range(T):
        n = int(lengths[t * B : (t + 1) * B].sum())
        rows = cfg.rows[t]
        # Zipf(a) ranks folded into [0, rows), then a random permutation so hot rows are not
        # all adjacent in memory.
        ranks = (rng.zipf(cfg.zipf_a, size=n) - 1) % rows
        perm = rng.permutation(rows)
        ids.append(perm[ranks])
    indices = torch.from_numpy(np.concatenate(ids).astype(np.int64))
    offsets = torch.zeros(T * B + 1, dtype=torch.int64)
    offsets[1:] = torch.from_numpy(np.cumsum(lengths).astype(np.int64))
    return indices, offsets, lengths


# ----------------------------------------------------------------------------- variants


class LoopEB:
    """(a) one F.embedding_bag per table."""

    def __init__(self, weights, B, sparse):
        self.w = [w.clone().requires_grad_(True) for w in weights]
        self.B = B
        self.sparse = sparse

    def params(self):
        return self.w

    def __call__(self, indices, offsets):
        B = self.B
        bounds = offsets[::B].tolist()  # T+1 table boundaries
        outs = []
        for t, w in enumerate(self.w):
            s, e = bounds[t], bounds[t + 1]
            o = offsets[t * B : (t + 1) * B + 1] - s
            outs.append(
                F.embedding_bag(
                    indices[s:e], w, o, mode="sum", sparse=self.sparse, include_last_offset=True
                )
            )
        return torch.cat(outs, dim=1)


class ConcatEB:
    """(b) tables grouped by dim; per group ONE concatenated weight and ONE F.embedding_bag."""

    def __init__(self, weights, B, sparse):
        self.B = B
        self.sparse = sparse
        self.T = len(weights)
        groups: dict = {}
        for t, w in enumerate(weights):
            groups.setdefault(w.shape[1], []).append(t)
        self.groups = []  # (tables, weight, row_base tensor, contiguous)
        self.slot = {}  # table -> (group idx, position in group)
        for gi, tables in enumerate(groups.values()):
            w = torch.cat([weights[t] for t in tables], 0).clone().requires_grad_(True)
            base = [0]
            for t in tables[:-1]:
                base.append(base[-1] + weights[t].shape[0])
            contiguous = tables == list(range(tables[0], tables[-1] + 1))
            self.groups.append((tables, w, torch.tensor(base, dtype=torch.int64), base, contiguous))
            for j, t in enumerate(tables):
                self.slot[t] = (gi, j)

    def params(self):
        return [g[1] for g in self.groups]

    def __call__(self, indices, offsets):
        B = self.B
        bounds = offsets[::B].tolist()
        gouts = []
        for tables, w, base_t, base, contiguous in self.groups:
            if contiguous:
                t0, t1 = tables[0], tables[-1]
                s, e = bounds[t0], bounds[t1 + 1]
                counts = torch.tensor(
                    [bounds[t + 1] - bounds[t] for t in tables], dtype=torch.int64
                )
                ids = indices[s:e] + torch.repeat_interleave(base_t, counts)
                offs = offsets[t0 * B : (t1 + 1) * B + 1] - s
            else:
                id_parts, off_parts, run = [], [], 0
                for j, t in enumerate(tables):
                    s, e = bounds[t], bounds[t + 1]
                    id_parts.append(indices[s:e] + base[j])
                    off_parts.append(offsets[t * B : (t + 1) * B] - (s - run))
                    run += e - s
                off_parts.append(torch.tensor([run], dtype=torch.int64))
                ids = torch.cat(id_parts)
                offs = torch.cat(off_parts)
            out = F.embedding_bag(
                ids, w, offs, mode="sum", sparse=self.sparse, include_last_offset=True
            )
            gouts.append(out.view(len(tables), B, -1))
        if len(self.groups) == 1:
            g = gouts[0]  # (T, B, D) -> (B, T*D)
            return g.transpose(0, 1).reshape(B, -1)
        return torch.cat([gouts[gi][j] for gi, j in (self.slot[t] for t in range(self.T))], dim=1)


class DenseTBE:
    """(c) fbgemm DenseTableBatchedEmbeddingBagsCodegen on CPU (dense grad of flat weight)."""

    def __init__(self, weights):
        self.m = DenseTableBatchedEmbeddingBagsCodegen(
            [(w.shape[0], w.shape[1]) for w in weights], use_cpu=True, pooling_mode=PoolingMode.SUM
        )
        with torch.no_grad():
            for dst, src in zip(self.m.split_embedding_weights(), weights):
                dst.copy_(src)

    def params(self):
        return [self.m.weights]

    def __call__(self, indices, offsets):
        return self.m(indices, offsets)


class SplitTBE:
    """(c) fbgemm SplitTableBatchedEmbeddingBagsCodegen, HOST/CPU, fused optimizer backward."""

    def __init__(self, weights, optimizer, bounds_check=False):
        self.m = SplitTableBatchedEmbeddingBagsCodegen(
            [(w.shape[0], w.shape[1], EmbeddingLocation.HOST, ComputeDevice.CPU) for w in weights],
            optimizer=optimizer,
            learning_rate=LR,
            pooling_mode=PoolingMode.SUM,
            bounds_check_mode=BoundsCheckMode.WARNING if bounds_check else BoundsCheckMode.NONE,
        )
        with torch.no_grad():
            for dst, src in zip(self.m.split_embedding_weights(), weights):
                dst.copy_(src)

    def params(self):
        return []  # optimizer is fused; no .grad

    def __call__(self, indices, offsets):
        return self.m(indices, offsets)

    def set_bounds_check(self, on: bool):
        self.m.bounds_check_mode_int = (
            BoundsCheckMode.WARNING if on else BoundsCheckMode.NONE
        ).value


def sparse_sgd_step(params):
    with torch.no_grad():
        for p in params:
            p.add_(p.grad, alpha=-LR)  # dense += sparse (handles uncoalesced duplicates)


# ----------------------------------------------------------------------------- timing


def time_interleaved(cases, iters, warmup, budget_s=None, min_iters=10):
    """cases: {label: (fn, before_or_None)}. Round-robin over variants every iteration so that
    background load / frequency drift hits all variants alike. If budget_s is given, the number
    of timed rounds is reduced (not below min_iters) so the block takes about budget_s.
    Returns ({label: (median, min)}, rounds)."""
    t_w = time.perf_counter()
    for _ in range(max(1, warmup)):
        for fn, before in cases.values():
            if before:
                before()
            fn()
    round_s = (time.perf_counter() - t_w) / max(1, warmup)
    if budget_s is not None and round_s > 0:
        iters = max(min(iters, min_iters), min(iters, int(budget_s / round_s)))
    ts = {k: [] for k in cases}
    for _ in range(iters):
        for k, (fn, before) in cases.items():
            if before:
                before()
            t0 = time.perf_counter()
            fn()
            ts[k].append((time.perf_counter() - t0) * 1e3)
    return {k: (statistics.median(v), min(v)) for k, v in ts.items()}, iters


def zero_grads(params):
    def f():
        for p in params:
            p.grad = None

    return f


def build_variants(weights, B):
    v = {
        "a_loop": LoopEB(weights, B, sparse=False),
        "a_loop_sparse": LoopEB(weights, B, sparse=True),
        "b_concat": ConcatEB(weights, B, sparse=False),
        "b_concat_sparse": ConcatEB(weights, B, sparse=True),
    }
    if HAVE_FBGEMM:
        v["c_tbe_dense"] = DenseTBE(weights)
        v["c_tbe_split_sgd"] = SplitTBE(weights, OptimType.EXACT_SGD)
        v["c_tbe_split_rowwise_adagrad"] = SplitTBE(weights, OptimType.EXACT_ROWWISE_ADAGRAD)
    return v


def verify(v, indices, offsets, grad_out):
    """All variants must produce the same pooled output, dense grads and SGD update."""
    checks = {}
    with torch.no_grad():
        ref = v["a_loop"](indices, offsets)
        for name, m in v.items():
            out = m(indices, offsets)
            assert out.shape == ref.shape, (name, out.shape, ref.shape)
            d = (out - ref).abs().max().item()
            checks[f"fwd_maxabs[{name}]"] = d
            assert d < TOL, f"forward mismatch {name}: {d}"

    # dense grads: compare per-table grad of a_loop vs b_concat vs c_tbe_dense
    def per_table_grads(name):
        m = v[name]
        for p in m.params():
            p.grad = None
        m(indices, offsets).backward(grad_out)
        if isinstance(m, LoopEB):
            return [p.grad.to_dense() for p in m.w]
        if isinstance(m, ConcatEB):
            res = [None] * m.T
            for tables, w, _, base, _ in m.groups:
                g = w.grad.to_dense()
                for j, t in enumerate(tables):
                    res[t] = g[base[j] : base[j] + m_rows[t]]
            return res
        if isinstance(m, DenseTBE):
            g = m.m.weights.grad
            po = m.m.weights_physical_offsets
            return [g[po[t] : po[t + 1]].view(m_rows[t], -1) for t in range(len(m_rows))]
        raise TypeError(name)

    m_rows = [w.shape[0] for w in v["a_loop"].w]
    gref = per_table_grads("a_loop")
    gmax = max(g.abs().max().item() for g in gref)
    checks["grad_absmax_ref"] = gmax
    for name in ["a_loop_sparse", "b_concat", "b_concat_sparse"] + (
        ["c_tbe_dense"] if HAVE_FBGEMM else []
    ):
        g = per_table_grads(name)
        d = max((x - y).abs().max().item() for x, y in zip(g, gref))
        # hot (Zipf head) rows accumulate thousands of contributions: compare relative to the
        # largest grad entry (fp32 summation-order noise), forward uses the absolute TOL.
        rel = d / max(1.0, gmax)
        checks[f"grad_maxabs[{name}]"] = d
        checks[f"grad_maxrel[{name}]"] = rel
        assert rel < GRAD_RTOL, f"grad mismatch {name}: abs {d}, rel {rel}"

    if HAVE_FBGEMM:
        # fused SGD in split TBE == w - lr * grad (check one step against a_loop_sparse + SGD)
        a = v["a_loop_sparse"]
        for p in a.params():
            p.grad = None
        a(indices, offsets).backward(grad_out)
        sparse_sgd_step(a.params())
        s = v["c_tbe_split_sgd"]
        s(indices, offsets).backward(grad_out)
        d = max(
            (x - y.detach()).abs().max().item()
            for x, y in zip(s.m.split_embedding_weights(), a.params())
        )
        checks["split_sgd_update_vs_sparse_sgd_maxabs"] = d
        assert d < TOL, f"split TBE SGD update mismatch: {d}"
    for p in sum((m.params() for m in v.values()), []):
        p.grad = None
    return checks


def run_config(cfg: Config, threads_list, iters, warmup, budget_s=None):
    torch.manual_seed(cfg.seed)
    weights = [torch.empty(r, d).uniform_(-0.5, 0.5) for r, d in zip(cfg.rows, cfg.dims)]
    indices, offsets, lengths = make_inputs(cfg)
    t0 = time.perf_counter()
    v = build_variants(weights, cfg.batch)
    del weights
    build_s = time.perf_counter() - t0
    grad_out = torch.randn(cfg.batch, sum(cfg.dims))
    checks = verify(v, indices, offsets, grad_out)

    fwd_variants = ["a_loop", "b_concat"] + (
        ["c_tbe_dense", "c_tbe_split_sgd"] if HAVE_FBGEMM else []
    )
    bwd_variants = [
        # name, variant, extra step
        ("a_loop[dense_grad]", "a_loop", None),
        ("a_loop[sparse_grad]", "a_loop_sparse", None),
        ("a_loop[sparse_grad+sgd]", "a_loop_sparse", sparse_sgd_step),
        ("b_concat[dense_grad]", "b_concat", None),
        ("b_concat[sparse_grad]", "b_concat_sparse", None),
        ("b_concat[sparse_grad+sgd]", "b_concat_sparse", sparse_sgd_step),
    ]
    if HAVE_FBGEMM:
        bwd_variants += [
            ("c_tbe_dense[dense_grad]", "c_tbe_dense", None),
            ("c_tbe_split[fused_exact_sgd]", "c_tbe_split_sgd", None),
            ("c_tbe_split[fused_exact_rowwise_adagrad]", "c_tbe_split_rowwise_adagrad", None),
        ]

    results = {}
    for nt in threads_list:
        torch.set_num_threads(nt)
        fwd_cases = {}
        for name in fwd_variants:
            label = "c_tbe_split" if name == "c_tbe_split_sgd" else name
            fwd_cases[label] = ((lambda m=v[name]: m(indices, offsets)), None)
        if HAVE_FBGEMM:  # cost of the default BoundsCheckMode.WARNING (toggled on the same module)
            s = v["c_tbe_split_sgd"]

            def fwd_bc(s=s):
                s.set_bounds_check(True)
                try:
                    s(indices, offsets)
                finally:
                    s.set_bounds_check(False)

            fwd_cases["c_tbe_split[bounds_check=WARNING]"] = (fwd_bc, None)
        with torch.no_grad():
            r, fwd_iters = time_interleaved(fwd_cases, iters, warmup, budget_s)
        fwd = {k: {"median_ms": a, "min_ms": b} for k, (a, b) in r.items()}

        bwd_cases = {}
        for label, name, step in bwd_variants:
            m = v[name]
            params = m.params()

            def fb(m=m, params=params, step=step):
                m(indices, offsets).backward(grad_out)
                if step is not None:
                    step(params)

            bwd_cases[label] = (fb, zero_grads(params))
        r, bwd_iters = time_interleaved(bwd_cases, iters, warmup, budget_s)
        bwd = {k: {"median_ms": a, "min_ms": b} for k, (a, b) in r.items()}
        for d, base in ((fwd, "a_loop"), (bwd, "a_loop[dense_grad]")):
            for k in d:
                d[k]["ratio_vs_a"] = d[k]["median_ms"] / d[base]["median_ms"]
            d["_baseline"] = base
        results[f"threads={nt}"] = {
            "forward": fwd,
            "forward_backward": bwd,
            "iters": {"forward": fwd_iters, "forward_backward": bwd_iters},
            "loadavg_after": os.getloadavg(),
        }
    return {
        "config": cfg.summary(),
        "num_indices": int(indices.numel()),
        "mean_bag_length": float(lengths.mean()),
        "build_s": build_s,
        "verification": checks,
        "results": results,
    }


def print_table(name, res):
    cfg = res["config"]
    print(
        f"\n=== {name}: T={cfg['num_tables']} dims={cfg['dims']} rows={cfg['rows']} "
        f"B={cfg['batch']} "
        f"L~{res['mean_bag_length']:.1f} ({cfg['length_dist']}) n_ids={res['num_indices']} "
        f"weights={cfg['weights_MiB']} MiB"
    )
    print(
        "    verification max|diff|: "
        + ", ".join(f"{k}={v:.1e}" for k, v in res["verification"].items())
    )
    thr = list(res["results"])
    for phase in ("forward", "forward_backward"):
        rows = [k for k in res["results"][thr[0]][phase] if not k.startswith("_")]
        w = max(len(r) for r in rows) + 2
        hdr = f"  {phase:<{w}}" + "".join(f"{t:>22}" for t in thr)
        print(hdr + "   rounds: " + ", ".join(str(res["results"][t]["iters"][phase]) for t in thr))
        for r in rows:
            cells = ""
            for t in thr:
                x = res["results"][t][phase][r]
                cells += f"{x['median_ms']:>10.3f} ms ({x['ratio_vs_a']:.2f}x)"
            print(f"  {r:<{w}}{cells}")
    print("  (ratio = median_ms / median_ms of a_loop baseline; < 1 is faster)")


def machine_info():
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "sched_affinity": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
        "torch_version": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "fbgemm_gpu_version": FBGEMM_VERSION,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "loadavg_at_start": os.getloadavg(),
    }


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--pooling-factor", type=float, default=20.0)
    p.add_argument("--length-dist", choices=["poisson", "uniform", "fixed"], default="poisson")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent for ids")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--budget",
        type=float,
        default=15.0,
        help="seconds per (config, threads, phase) block; rounds are cut (not below 10) to fit. "
        "<=0 disables (always --iters)",
    )
    p.add_argument("--threads", type=str, default="1,2", help="comma list, e.g. 1,2")
    p.add_argument(
        "--configs",
        type=str,
        default="default,small,mixed",
        help="comma list of: default (uses --tables/--rows/--dim), small (100 tables x 1000 rows, "
        "dim 32), mixed (--tables tables x --rows, dims cycling 16/32/64/128)",
    )
    p.add_argument("--small-tables", type=int, default=100)
    p.add_argument("--small-rows", type=int, default=1000)
    p.add_argument("--small-dim", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=str, default=None, help="write results JSON here")
    args = p.parse_args(argv)
    if args.budget is not None and args.budget <= 0:
        args.budget = None

    threads = [int(x) for x in args.threads.split(",") if x]
    common = dict(
        batch=args.batch,
        pooling_factor=args.pooling_factor,
        length_dist=args.length_dist,
        zipf_a=args.zipf,
        seed=args.seed,
    )
    cfgs = []
    for c in args.configs.split(","):
        if c == "default":
            cfgs.append(
                Config("default", [args.dim] * args.tables, [args.rows] * args.tables, **common)
            )
        elif c == "small":
            cfgs.append(
                Config(
                    "many_small_tables",
                    [args.small_dim] * args.small_tables,
                    [args.small_rows] * args.small_tables,
                    **common,
                )
            )
        elif c == "mixed":
            dims = [(16, 32, 64, 128)[t % 4] for t in range(args.tables)]
            cfgs.append(Config("mixed_dims", dims, [args.rows] * args.tables, **common))
        else:
            p.error(f"unknown config {c}")

    info = machine_info()
    print("machine:", json.dumps(info))
    t_start = time.perf_counter()
    out = {"machine": info, "args": vars(args), "configs": {}}
    for cfg in cfgs:
        res = run_config(cfg, threads, args.iters, args.warmup, args.budget)
        out["configs"][cfg.name] = res
        print_table(cfg.name, res)
    out["total_wall_s"] = time.perf_counter() - t_start
    print(f"\ntotal wall: {out['total_wall_s']:.1f} s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print("wrote", args.json)


if __name__ == "__main__":
    main()
