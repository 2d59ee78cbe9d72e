"""Kernel-level profile of dtrec's 1-rank DLRM step: where the device and the host spend it.

The model and batches are ``benchmarks/gpu_step.py``'s (26 MLPerf-like tables capped at
``--max-rows``, dim ``--dim``, table-wise in a 1-rank world, fused row-wise Adagrad, the
dense arch on torch's Adagrad). For each case (the whole step and the embedding part
alone, fwd + bwd + fused update, at ``--batch`` multi-hot and one-hot):

* ``wall_ms``: mean wall time per step over ``--steps`` back-to-back steps after
  ``--warmup`` ones, one sync at the end; ``host_ms``: the same loop's time before that
  sync (what the host takes to issue a step; when it is close to ``wall_ms`` the step is
  host-bound);
* under ``torch.profiler`` over ``--profile-steps`` more steps: ``device_busy_ms`` (the sum
  of the device events' self time per step, as the profiler's own "Self CUDA time total"
  counts it: kernels, copies and memsets, not the CPU ops or annotations that launched
  them, which would count each kernel twice), ``wall_over_device``, ``profiled_cpu_ms``
  (the sum of self CPU time per step: inflated by the profiler, compare cases with it,
  not with ``wall_ms``), and the top ``--top`` events by self device time (kernels) and
  by self CPU time (ops), per step.

The JSON holds all of it; the text file holds the profiler's own tables, both sort orders.

    PYTHONPATH=. python benchmarks/gpu_profile.py \\
        --json benchmarks/results/gpu_profile_<card>_<date>.json \\
        --txt benchmarks/results/gpu_profile_<card>_<date>.txt
    PYTHONPATH=. python benchmarks/gpu_profile.py --smoke --json /tmp/p.json   # CPU, seconds
"""

from __future__ import annotations

import argparse
import datetime
import functools
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.common.device import bench_device, sync
from benchmarks.common.dlrm import (
    MLPERF_ROWS,
    Batch,
    Workload,
    build_dtrec,
    make_batch,
)
from benchmarks.probes.report import dtrec_source, write_report

_DEVICE_TYPES = {DeviceType.CUDA, DeviceType.PrivateUse1}


def _self_device_us(e) -> float:
    """An event's self device time (us), under either of torch's attribute names."""
    return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))


def is_device_event(e) -> bool:
    """A kernel, copy or memset: the events whose self time the device spent (the CPU op
    or annotation that launched one carries its time too, and is not counted)."""
    return e.device_type in _DEVICE_TYPES and not getattr(e, "is_user_annotation", False)


def top_events(averages, steps: int, top: int) -> dict[str, list[dict]]:
    """The top ``top`` device events by self device time and ops by self CPU time, in ms
    and calls per step."""
    device = sorted((e for e in averages if is_device_event(e)), key=_self_device_us,
                    reverse=True)  # fmt: skip
    busy = sum(_self_device_us(e) for e in device) or 1.0
    by_cpu = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)
    return {
        "by_self_device_time": [
            {"name": e.key, "self_device_ms": _self_device_us(e) / 1e3 / steps,
             "share": _self_device_us(e) / busy, "calls": e.count / steps}
            for e in device[:top]
        ],
        "by_self_cpu_time": [
            {"name": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3 / steps,
             "cpu_total_ms": e.cpu_time_total / 1e3 / steps, "calls": e.count / steps}
            for e in by_cpu[:top]
        ],
    }  # fmt: skip


def tables(averages, device: torch.device, top: int) -> str:
    """The profiler's own tables: by self device time (on a device), by self CPU time."""
    sorts = (["self_cuda_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]
    out = []
    for key in sorts:
        out.append(f"--- top {top} by {key}")
        out.append(averages.table(sort_by=key, row_limit=top, max_name_column_width=70))
    return "\n".join(out)


def profile_case(fn: Callable[[Batch], None], items: list[Batch], args,
                 device: torch.device) -> tuple[dict, str]:  # fmt: skip
    """Warm up, time back to back, then profile ``fn`` over ``items`` (in that order);
    returns the case's measures and the profiler's tables."""
    warm, timed = items[: args.warmup], items[args.warmup : args.warmup + args.steps]
    profiled = items[args.warmup + args.steps :]
    for b in warm:
        fn(b)
    sync(device)
    start = time.perf_counter()
    for b in timed:
        fn(b)
    issued = time.perf_counter()
    sync(device)
    wall = (time.perf_counter() - start) / len(timed)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for b in profiled:
            fn(b)
        sync(device)
    averages = prof.key_averages()
    n = len(profiled)
    busy = sum(_self_device_us(e) for e in averages if is_device_event(e)) / 1e3 / n
    out = {
        "wall_ms": wall * 1e3,
        "host_ms": (issued - start) / len(timed) * 1e3,
        "device_busy_ms": busy if device.type == "cuda" else None,
        "wall_over_device": wall * 1e3 / busy if device.type == "cuda" and busy else None,
        "profiled_cpu_ms": sum(e.self_cpu_time_total for e in averages) / 1e3 / n,
        "steps": {"warmup": len(warm), "timed": len(timed), "profiled": n},
        "top": top_events(averages, n, args.top),
    }
    return out, tables(averages, device, args.top)


def run(args, w: Workload, device: torch.device) -> tuple[dict, list[str]]:
    lib = build_dtrec(w, device, "table_wise", None)
    gen = torch.Generator(device=device).manual_seed(0)
    count = args.warmup + args.steps + args.profile_steps
    cases, text = {}, []
    for one_hot in (False, True):
        hot = "one_hot" if one_hot else "multi_hot"
        batches = [make_batch(w, args.batch, one_hot, "uniform", device, gen) for _ in range(2)]
        grad = torch.ones(args.batch, len(w.rows) * w.dim, device=device)
        embedding = functools.partial(lib.embedding_step, grad=grad)
        for part, fn in (("step", lib.step), ("embedding", embedding)):
            name = f"B{args.batch}_{hot}_{part}"
            items = [batches[i % 2].again() for i in range(count)]
            cases[name], table = profile_case(fn, items, args, device)
            print(summary(name, cases[name]), flush=True)
            text += [f"##### {summary(name, cases[name])}", table, ""]
        del batches, grad, embedding
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return cases, text


def summary(name: str, c: dict) -> str:
    line = f"{name:<32} wall {c['wall_ms']:8.2f} ms/step, host {c['host_ms']:8.2f} ms"
    if c["device_busy_ms"] is not None:
        line += f", device busy {c['device_busy_ms']:.2f} ms (wall {c['wall_over_device']:.2f}x)"
    top = c["top"]["by_self_device_time"] or c["top"]["by_self_cpu_time"]
    return line + (f"; top: {top[0]['name'][:50]}" if top else "")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=16384, help="samples per step")
    p.add_argument("--max-rows", type=float, default=2e6, help="cap on a table's rows")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--steps", type=int, default=5, help="timed steps (wall, host)")
    p.add_argument("--profile-steps", type=int, default=3, help="steps under the profiler")
    p.add_argument("--top", type=int, default=25, help="rows of each top list")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (code-path check)")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--txt", help="write the profiler's tables here")
    args = p.parse_args(argv)
    if args.smoke:
        args.device = "cpu" if "--device" not in argv else args.device
        args.batch, args.max_rows, args.dim = 32, 2e3, 8
        args.warmup, args.steps, args.profile_steps, args.top = 1, 1, 1, 10
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    device = bench_device(args.device)
    w = Workload(tuple(max(1, int(min(r, args.max_rows))) for r in MLPERF_ROWS), args.dim)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
    )
    try:
        cases, text = run(args, w, device)
    finally:
        dist.destroy_process_group()
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "dtrec": dtrec_source(),
        "command": " ".join(["python benchmarks/gpu_profile.py", *argv]),
        "args": vars(args),
    }
    if args.txt:
        Path(args.txt).parent.mkdir(parents=True, exist_ok=True)
        head = f"# {meta['command']}\n# {meta['device']}, torch {meta['torch']}, {meta['date']}\n"
        Path(args.txt).write_text(head + "\n".join(text))
        print(f"wrote {args.txt}")
    if args.json:
        write_report(args.json, {"meta": meta, "workload": asdict(w), "cases": cases})
    return 0


if __name__ == "__main__":
    sys.exit(main())
