"""Timing on one device: syncs, medians of repeated calls, the copy bandwidth to compare with."""

from __future__ import annotations

import statistics
import time

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so host clocks time it."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, iters: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs after 2 warmups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int, iters: int) -> float:
    """Device-to-device copy GB/s (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), iters, device)
    return 2 * nbytes / t / 1e9


def bench_device(name: str) -> torch.device:
    """The benchmark's device; on CUDA made current (with an index) and TF32 matmuls on,
    as a training job would run its dense part."""
    device = torch.device(name)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    return device
