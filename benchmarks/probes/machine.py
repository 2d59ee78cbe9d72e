"""The processor a benchmark ran on, for every report's ``meta``.

The same dtrec commit measured 0.69x TorchRec on one machine and 1.41x on another (issue
30): a ratio means something only next to the processor that produced it, and on x86 the
vector extensions decide which kernels fbgemm and ATen run.
"""

from __future__ import annotations

import os
import platform

import torch

FLAGS_THAT_MATTER = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
                     "avx512_vnni", "amx_tile", "amx_bf16", "asimd", "sve")  # fmt: skip
"""CPU flags that change which CPU kernels torch and fbgemm pick."""


def processor() -> dict:
    """Model name, the flags of ``FLAGS_THAT_MATTER`` it has, ATen's chosen CPU capability
    (e.g. ``AVX2``, ``AVX512``), cores this process may use.

    Example::

        report["meta"]["processor"] = processor()
        # {"model": "AMD EPYC 9B14", "flags": ["avx2", "avx512f", ...], "aten": "AVX512", ...}
    """
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "model": model,
        "flags": [f for f in FLAGS_THAT_MATTER if f in flags],
        "aten": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
    }


def processor_line(info: dict | None = None) -> str:
    """One line for a report's header: ``AMD EPYC 9B14 (AVX512; avx2 avx512f ...), 2 cores``."""
    info = info or processor()
    flags = " ".join(info["flags"]) or "no listed flags"
    return f"{info['model']} ({info['aten']}; {flags}), {info['usable_cores']} cores"
