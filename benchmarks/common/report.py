"""What the side-by-side benchmarks print and record: number formats and the run's meta."""

from __future__ import annotations

import datetime
import os
import platform
from dataclasses import asdict

import torch

from benchmarks.common.workloads import Workload
from benchmarks.probes.machine import processor
from benchmarks.probes.report import dtrec_source


def fmt_bytes(n: float | None) -> str:
    """``n`` bytes in decimal units (``1.2MB``); ``-`` for no value."""
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f}{unit}" if unit != "B" else f"{n:.0f}B"
        n /= 1000
    raise AssertionError


def ratio(a: float | None, b: float | None) -> str:
    """``a / b`` to two places; ``-`` where either is missing."""
    return f"{a / b:.2f}" if a is not None and b else "-"


def num(x: float | None) -> str:
    """``x`` to one place; ``-`` for no value."""
    return "-" if x is None else f"{x:.1f}"


def run_meta(module: str, argv: list[str], w: Workload) -> dict:
    """Versions, machine, dtrec source, workload and how to read the numbers, for the JSON."""
    import fbgemm_gpu

    try:
        import torchrec

        torchrec_version = torchrec.__version__
    except ImportError:
        torchrec_version = None
    return {
        "date": datetime.date.today().isoformat(),
        "command": " ".join([f"python -m {module}", *argv]),
        "torch": torch.__version__,
        "torchrec": torchrec_version,
        "fbgemm_gpu": fbgemm_gpu.__version__,
        "python": platform.python_version(),
        "cpu_cores": os.cpu_count(),
        "processor": processor(),
        "platform": platform.platform(),
        "dtrec": dtrec_source(),
        "workload": asdict(w),
        "timing": "median over timed steps per rank (dist.barrier() before each step, outside "
        "the timed region), then median over ranks; OMP_NUM_THREADS=1 per rank",
        "bytes": "per rank per step: wrapped torch.distributed collectives during the timed "
        "steps + dense_ddp_estimate = 2 (W-1)/W x bytes of DDP-reduced params",
    }
