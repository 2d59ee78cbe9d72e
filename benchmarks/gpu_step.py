"""The DLRM-shaped training step on one GPU: dtrec's sharded step vs plain PyTorch.

Workload (MLPerf DLRM-DCNv2-like): 26 tables, dim 128, MLPerf's row counts capped at
``--max-rows`` (x ``--row-scale``), one feature each, sum pooling. Two batches per
``--batches`` size: multi-hot (feature f's bags hold uniform [1, 2 h_f - 1] ids, h_f
MLPerf's multi-hot size, mean 214 / 26 = 8.2 per bag) and one-hot. Ids uniform (or
Zipf(1.1), ``--ids``) over each table's rows. Dense arch: 13 dense features -> MLP 256-D,
concatenated with the 26 pooled embeddings, one low-rank DCNv2 cross layer (rank 64), MLP
256-1, BCE with logits; TF32 matmuls. ``--dense mlperf``: MLPerf DLRM-DCNv2's dense arch
instead (bottom 512-256-128, 3 low-rank cross layers of rank 512, top 1024-1024-512-256-1;
``benchmarks/common/dense_arch.py``); ``--dense-dtype bf16`` runs the dense arch under
``torch.autocast`` to bfloat16 (tables and exchanges unchanged, fp32).
Tables: dtrec's fused row-wise Adagrad, or ``nn.EmbeddingBag(sparse=True)`` per table +
``torch.optim.Adagrad``; dense: torch Adagrad.

dtrec runs its sharded path (input dist -> lookup -> output dist -> backward + fused
update) in a 1-rank world (NCCL on CUDA, gloo on CPU), tables built on the meta device.
Per config and library the JSON holds: ``step_s`` (mean of back-to-back steps, one sync
at the end; dtrec also through ``dtrec.TrainPipeline``), ``stages`` (host and device
seconds per stage, see ``benchmarks.probes.step.StageTimer``), ``profile`` (kernels, copies and
host-sync API calls per step: whole step, embedding part alone, dense part alone),
``samples_per_s`` (batch / ``step_s``), ``dense`` (the arch, its dtype and the dtypes its
``nn.Linear`` layers output, i.e. what the matmuls computed in),
``host_syncs`` (synchronizing calls by source line), ``embedding`` (fwd + bwd + table
update alone: seconds, modelled bytes, GB/s, fraction of the copy bandwidth measured in
this run), ``memory`` (peak during a step vs weights + optimizer state + activations)
and ``full_table_check`` (the run fails if a tensor shaped like a whole watched table is
ever created: ``benchmarks.probes.step.FullTableWatch``).

    PYTHONPATH=. python benchmarks/gpu_step.py --json benchmarks/results/gpu_step_<card>_<date>.json
    PYTHONPATH=. python benchmarks/gpu_step.py --smoke --json /tmp/smoke.json   # CPU, seconds

``--compile`` adds, per config, dtrec's step under ``torch.compile`` (``--compile-mode``;
issue 32, docs/compile.md): ``compiled.step_s`` (after warm-up, compiles excluded),
``compiled.graph_breaks`` in one forward (``torch._dynamo.explain``), beside the eager
``step_s``; on CUDA with ``--compile-mode reduce-overhead`` the step runs as CUDA graphs.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from dataclasses import asdict, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

import dtrec
from benchmarks.common.dense_arch import ARCHS, DTYPES, linear_output_dtypes, make_dense_arch
from benchmarks.common.device import bench_device, copy_bandwidth, sync
from benchmarks.common.dlrm import (
    LR,
    MLPERF_ROWS,
    Batch,
    Library,
    Workload,
    arch_name,
    build_dtrec,
    build_pytorch,
    make_batch,
    nbytes,
    plain_state,
)
from benchmarks.probes.machine import processor
from benchmarks.probes.report import dtrec_source, write_report
from benchmarks.probes.step import (
    FullTableWatch,
    StageTimer,
    StepCounter,
    SyncSites,
    cuda_activity,
    sync_debug_sites,
)
from dtrec.sharded.dist.output_dist import OutputDist
from dtrec.sharded.lookup.local_path import LocalPath
from dtrec.sharded.lookup.pooled import LocalLookup


def embedding_bytes(w: Workload, b: Batch, elem: int = 4, idx: int = 8) -> int:
    """Bytes the embedding part must move at least: forward reads each id's row, its id and
    the offsets, writes the pooled rows; backward reads the pooled gradient and the ids
    again and reads + writes each touched row and its row-wise Adagrad state."""
    ids, size = b.sparse_features.values().numel(), b.dense.shape[0]
    out = size * len(w.rows) * w.dim * 4
    forward = ids * (w.dim * elem + idx) + len(w.rows) * size * 8 + out
    return forward + out + ids * idx + b.unique_rows * (2 * w.dim * elem + 8)


def back_to_back(fn, items, device: torch.device) -> float:
    """Mean seconds per item of ``fn`` over ``items`` with one sync at the end."""
    sync(device)
    start = time.perf_counter()
    for item in items:
        fn(item)
    sync(device)
    return (time.perf_counter() - start) / len(items)


def profiled(fn, items, device: torch.device) -> dict[str, float]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        for item in items:
            fn(item)
        sync(device)
    return cuda_activity(prof, len(items))


def stage_targets(lib: Library) -> list[tuple[str, type, str]]:
    """(stage, class, method) to time: dtrec's stages by the classes that run them."""
    sparse, arch = type(lib.model.sparse), type(lib.model.dense_arch)
    if lib.name == "pytorch":
        return [("sparse_fwd", sparse, "forward"), ("dense_fwd", arch, "_forward")]
    return [
        ("sparse_fwd", sparse, "forward"),
        ("input_dist", sparse, "input_dist"),
        ("lookup_fwd", LocalLookup, "served"),
        ("lookup_fwd", LocalLookup, "data_parallel"),
        ("lookup_fwd", LocalPath, "lookup"),
        ("output_dist", OutputDist, "__call__"),
        ("output_dist", OutputDist, "zeros"),
        ("output_dist", OutputDist, "add_data_parallel"),
        ("output_dist", OutputDist, "keyed"),
        ("dense_fwd", arch, "_forward"),
    ]


def stages(lib: Library, items: list[Batch], device: torch.device) -> dict:
    timer = StageTimer(device)
    with timer.wrapping(stage_targets(lib)) as missing:
        for b in items:
            with timer.stage("forward"):
                loss = lib.loss(lib.model, b)
            with timer.stage("bwd_and_fused_update" if lib.name == "dtrec" else "bwd"):
                loss.backward()
            with timer.stage("optimizers"):
                lib.opt_step()
    n = len(items)
    return {
        "host_s": {k: v / n for k, v in timer.host_s.items()},
        "device_s": {k: v / n for k, v in timer.device_s().items()},
        "not_found": missing,
    }


def memory(lib: Library, b: Batch, w: Workload, device: torch.device) -> dict | None:
    """Peak during one step vs what it must hold (CUDA only)."""
    if device.type != "cuda":
        return None
    dense_params = list(lib.model.dense_arch.parameters())
    model_bytes = lib.table_bytes + lib.table_state_bytes + 2 * nbytes(dense_params)
    dense = DenseOnly(lib, w, torch.zeros(b.dense.shape[0], len(w.rows) * w.dim, device=device))
    dense(b)  # its optimizer state exists before the measured pass
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    dense(b)
    dense_activations = torch.cuda.max_memory_allocated() - base + nbytes([dense.pooled])
    del dense
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    lib.step(b)
    torch.cuda.synchronize()
    transient = torch.cuda.max_memory_allocated() - resident
    return {
        "tables_bytes": lib.table_bytes,
        "table_optimizer_state_bytes": lib.table_state_bytes,
        "dense_params_and_state_bytes": 2 * nbytes(dense_params),
        "dense_activation_bytes": dense_activations,
        "step_transient_bytes": transient,
        "transient_over_activations": transient / dense_activations,
        "peak_for_this_model_bytes": model_bytes + transient,
        "peak_over_weights_state_activations": (model_bytes + transient)
        / (model_bytes + dense_activations),
    }


def measure(lib: Library, w: Workload, batches: list[Batch], args, device, copy_gbps) -> dict:
    def steps(n: int) -> list[Batch]:
        return [batches[i % len(batches)].again() for i in range(n)]

    for b in steps(args.warmup):
        lib.step(b)
    out: dict = {"step_s": back_to_back(lib.step, steps(args.steps), device)}
    out["samples_per_s"] = batches[0].dense.shape[0] / out["step_s"]
    one = steps(1)[0]
    pooled = torch.zeros(one.dense.shape[0], len(w.rows) * w.dim, device=device)
    out["dense"] = {
        "arch": arch_name(lib.model.dense_arch),
        "dtype": lib.model.dense_arch.dtype,
        "linear_output_dtypes": linear_output_dtypes(lib.model.dense_arch, one.dense, pooled),
    }
    with torch.no_grad():
        out["dense"]["loss"] = lib.loss(lib.model, one).item()  # after the timed steps
    if lib.name == "dtrec":
        pipeline = dtrec.TrainPipeline(lib.model, lib.optimizers[0], lib.loss)
        out["pipelined_step_s"] = (
            back_to_back(lambda run: sum(1 for _ in run), [pipeline.run(steps(args.steps))], device)
            / args.steps
        )
    out["stages"] = stages(lib, steps(args.profile_steps), device)
    grad = torch.randn(batches[0].dense.shape[0], len(w.rows) * w.dim, device=device)

    def embedding(b: Batch) -> None:
        lib.embedding_step(b, grad)

    out["profile"] = {
        "step": profiled(lib.step, steps(args.profile_steps), device),
        "embedding": profiled(embedding, steps(args.profile_steps), device),
        "dense": profiled(DenseOnly(lib, w, grad), steps(args.profile_steps), device),
    }
    one = steps(1)[0]
    with sync_debug_sites() as cuda_sites, SyncSites(device) as op_sites:
        lib.step(one)
    out["host_syncs"] = {"cuda_sync_debug": dict(cuda_sites), "sync_ops": dict(op_sites.sites)}
    # The CPU budget test's count (tests/test_step_budget.py), here on this device; the
    # batch is built first (a KJT checks its lengths when it is made, outside the step).
    counted = steps(1)[0]
    with StepCounter(device) as counts:
        embedding(counted)
    out["counts"] = {
        "embedding": {
            "launches": counts.total_launches(),
            "syncs": counts.total_syncs(),
            "launch_kinds": dict(counts.launches),
            "sync_sites": dict(counts.syncs),
        }
    }
    seconds = back_to_back(embedding, steps(args.steps), device)
    moved = embedding_bytes(w, batches[0])
    out["embedding"] = {
        "fwd_bwd_update_s": seconds,
        "bytes": moved,
        "GBps": moved / seconds / 1e9,
        "of_copy": moved / seconds / 1e9 / copy_gbps,
    }
    out["memory"] = memory(lib, steps(1)[0], w, device)
    if lib.name == "dtrec" and args.compile:
        out["compiled"] = compiled_step(lib, steps, args, device)
    return out


def compiled_step(lib: Library, steps, args, device: torch.device) -> dict:
    """dtrec's whole step (model under ``torch.compile``, the same optimizers): graph
    breaks in one forward, then mean seconds per step after ``args.warmup + 2`` steps
    (the first compile and the recompile that makes the batch's sizes dynamic)."""
    one = steps(1)[0]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda d, f: lib.model(d, f))(one.dense, one.sparse_features)
    torch._dynamo.reset()
    compiled = replace(lib, model=torch.compile(lib.model, mode=args.compile_mode))
    start = time.perf_counter()
    for b in steps(args.warmup + 2):
        compiled.step(b)
    sync(device)
    warm_s = time.perf_counter() - start
    return {
        "mode": args.compile_mode,
        "graphs": explained.graph_count,
        "graph_breaks": explained.graph_break_count,
        "break_reasons": [r.reason.splitlines()[0] for r in explained.break_reasons],
        "warmup_s": warm_s,
        "step_s": back_to_back(compiled.step, steps(args.steps), device),
    }


class DenseOnly:
    """The dense part's step alone, on a copy of the library's dense arch (the model's own
    is data parallel: its gradient hooks expect the root forward) and a fixed pooled input."""

    def __init__(self, lib: Library, w: Workload, like: Tensor) -> None:
        like_arch = lib.model.dense_arch
        self.arch = make_dense_arch(
            arch_name(like_arch), len(w.rows) * w.dim, w.dim, like_arch.dtype
        ).to(like.device)
        self.arch.load_state_dict(plain_state(lib.model.dense_arch))
        self.opt = torch.optim.Adagrad(self.arch.parameters(), lr=LR)
        self.pooled = like.detach().clone().requires_grad_()

    def __call__(self, b: Batch) -> None:
        F.binary_cross_entropy_with_logits(self.arch(b.dense, self.pooled), b.labels).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.pooled.grad = None


def watched_tables(w: Workload, max_batch: int) -> dict[str, tuple[int, int]]:
    """Tables larger than any per-step buffer of theirs (rows > ids per step)."""
    return {
        f"t{i}": (r, w.dim)
        for i, (r, h) in enumerate(zip(w.rows, w.hotness))
        if r > max_batch * (2 * h - 1)
    }


def meta(args, device: torch.device, copy_gbps: float, argv: list[str]) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "processor": processor(),
        "dtrec": dtrec_source(),
        "dtrec_backend": dtrec.ops.get_backend(),
        "copy_GBps": copy_gbps,
        "command": " ".join(["python benchmarks/gpu_step.py", *argv]),
        "args": vars(args),
    }


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", default="16384,65536", help="batch sizes, comma-separated")
    p.add_argument("--max-rows", type=float, default=2e6, help="cap on a table's rows")
    p.add_argument("--row-scale", type=float, default=1.0, help="multiplies (capped) rows")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--ids", default="uniform", choices=["uniform", "zipf"])
    p.add_argument("--plan", default="table_wise", choices=["table_wise", "row_wise",
                                                            "data_parallel"])  # fmt: skip
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--no-pytorch", action="store_true", help="skip the plain PyTorch baseline")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (code-path check)")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--compile", action="store_true", help="also time dtrec's compiled step")
    p.add_argument("--dense", default="small", choices=sorted(ARCHS),
                   help="dense arch (common/dense_arch.py): small or MLPerf's")  # fmt: skip
    p.add_argument("--dense-dtype", default="fp32", choices=sorted(DTYPES),
                   help="the dense arch's compute dtype (bf16: torch.autocast)")  # fmt: skip
    p.add_argument("--compile-mode", default="default",
                   choices=["default", "reduce-overhead", "max-autotune"])  # fmt: skip
    args = p.parse_args(argv)
    if args.smoke:
        args.device = "cpu" if "--device" not in argv else args.device
        args.batches, args.max_rows, args.dim = "64", 2e4, 16
        args.steps, args.warmup, args.profile_steps = 2, 1, 1
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    device = bench_device(args.device)
    w = Workload(tuple(max(1, int(min(r, args.max_rows) * args.row_scale)) for r in MLPERF_ROWS),
                 args.dim)  # fmt: skip
    sizes = [int(s) for s in args.batches.split(",")]
    copy_gbps = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 24, 10)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
    )
    try:
        report = run(args, w, sizes, device, copy_gbps)
    finally:
        dist.destroy_process_group()
    report = {"meta": meta(args, device, copy_gbps, argv), "workload": asdict(w), **report}
    if args.json:
        write_report(args.json, report)
    bad = report["full_table_check"]["violations"]
    if bad:
        print("FAIL: a whole table was materialised:\n  " + "\n  ".join(bad[:20]))
        return 1
    return 0


def run(args, w: Workload, sizes: list[int], device, copy_gbps: float) -> dict:
    watched = watched_tables(w, max(sizes))
    build_watch = FullTableWatch(watched, device) if device.type == "cuda" else None
    libs = [build_dtrec(w, device, args.plan, build_watch, args.dense, args.dense_dtype)]
    if not args.no_pytorch:
        libs.append(build_pytorch(w, device, libs[0].model))
    gen = torch.Generator(device=device).manual_seed(0)
    step_watch = FullTableWatch(watched)
    results: dict[str, dict] = {}
    print(f"{device} copy {copy_gbps:.0f} GB/s; rows {w.rows}")
    for size in sizes:
        for one_hot in (False, True):
            name = f"B{size}_{'one_hot' if one_hot else 'multi_hot'}"
            batches = [make_batch(w, size, one_hot, args.ids, device, gen) for _ in range(2)]
            if len(libs) > 1 and not results:  # before either trained: same weights
                check_same_pooled(libs, batches[0])
            results[name] = {}
            for lib in libs:
                if lib.name == "dtrec":
                    one = batches[0].again()
                    with step_watch:
                        lib.step(one)
                r = results[name][lib.name] = measure(lib, w, batches, args, device, copy_gbps)
                print(summary_line(name, lib.name, r), flush=True)
            del batches
            if device.type == "cuda":
                torch.cuda.empty_cache()
    violations = (build_watch.violations if build_watch else []) + step_watch.violations
    table = issue_table(results, copy_gbps)
    print("\n" + "\n".join(markdown_table(table)))
    return {
        "results": results,
        "issue_table": table,
        "torchrec_fbgemm": "not run: TorchRec + fbgemm-gpu are not installed on this machine",
        "full_table_check": {
            "watched_tables": sorted(watched),
            "build_watched": build_watch is not None,
            "violations": violations,
        },
    }


def summary_line(config: str, library: str, r: dict) -> str:
    emb, syncs = r["embedding"], r["host_syncs"]
    compiled = r.get("compiled")
    if compiled:
        config += (f" [compiled {compiled['step_s'] * 1e3:.2f} ms, "
                   f"{compiled['graph_breaks']} breaks]")  # fmt: skip
    return (
        f"{config:<22} {library:<8} step {r['step_s'] * 1e3:8.2f} ms | embedding "
        f"{emb['GBps']:7.1f} GB/s ({emb['of_copy']:.0%} of copy), "
        f"{r['profile']['embedding']['launches']:.0f} launches "
        f"({r['counts']['embedding']['launches']} dispatched) | step: "
        f"{sum(syncs['cuda_sync_debug'].values())} syncs (CUDA count), "
        f"{sum(syncs['sync_ops'].values())} sync-forcing ops"
    )


def issue_table(results: dict[str, dict], copy_gbps: float) -> list[dict]:
    """One row per config, the columns of issue 24's table: dtrec's and plain PyTorch's step,
    dtrec's embedding part (fwd + bwd + update), its share of this run's copy bandwidth and
    speedup over plain PyTorch's, its launches (CUDA profile; dispatch count as the CPU test
    counts them) and its host syncs (CUDA's own count over a whole step; dispatch count)."""
    rows = []
    for config, libs in results.items():
        d, p = libs["dtrec"], libs.get("pytorch")
        emb = d["embedding"]
        batch = int(config.split("_")[0][1:])
        rows.append({
            "config": config,
            "dtrec_step_ms": d["step_s"] * 1e3,
            "pytorch_step_ms": p["step_s"] * 1e3 if p else None,
            "embedding_ms": emb["fwd_bwd_update_s"] * 1e3,
            "of_copy": emb["of_copy"],
            "embedding_vs_pytorch": (
                p["embedding"]["fwd_bwd_update_s"] / emb["fwd_bwd_update_s"] if p else None
            ),
            "launches_profile": d["profile"]["embedding"]["launches"],
            "launches_dispatch": d["counts"]["embedding"]["launches"],
            "host_syncs_cuda": sum(d["host_syncs"]["cuda_sync_debug"].values()),
            "host_syncs_dispatch": d["counts"]["embedding"]["syncs"],
            "samples_per_s": batch / d["step_s"],
            "dense_arch": d["dense"]["arch"],
            "dense_dtype": d["dense"]["dtype"],
            "copy_GBps": copy_gbps,
        })  # fmt: skip
    return rows


def markdown_table(rows: list[dict]) -> list[str]:
    """Issue 24's table (``issue_table``) as markdown lines."""

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f} ms"

    lines = [
        "| config | dtrec step | plain PyTorch | embedding fwd+bwd+update | share of copy BW "
        "| vs plain PyTorch's | launches (embedding part) | host syncs per step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        speedup = "-" if r["embedding_vs_pytorch"] is None else f"{r['embedding_vs_pytorch']:.1f}x"
        lines.append(
            f"| {r['config']} | {ms(r['dtrec_step_ms'])} | {ms(r['pytorch_step_ms'])} | "
            f"{ms(r['embedding_ms'])} | {r['of_copy']:.0%} | {speedup} | "
            f"{r['launches_profile']:.0f} ({r['launches_dispatch']} dispatched) | "
            f"{r['host_syncs_cuda']} ({r['host_syncs_dispatch']} in the embedding part) |"
        )
    return lines


def check_same_pooled(libs: list[Library], b: Batch) -> None:
    """Both libraries pool the same rows (same weights) before any of them trains."""
    with torch.no_grad():
        got = [lib.model.sparse(getattr(b, lib.features)) for lib in libs]
        got = [g if isinstance(g, Tensor) else g.values() for g in got]
    torch.testing.assert_close(got[0], got[1], rtol=1e-4, atol=1e-5)


if __name__ == "__main__":
    sys.exit(main())
