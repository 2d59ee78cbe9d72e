"""The CUDA tier's harness: which worlds run on this machine, and each rank's device.

Every module of ``tests/gpu`` sets ``pytestmark = CUDA_TIER``: the tests are marked
``gpu`` (``pytest -m gpu`` selects them) and skipped, with the reason, when torch sees no
CUDA device, before any fixture spawns a world (CPU CI runs none of it).

Worlds are ``tests.multiprocess.run_world`` worlds with a backend chosen from the number
of GPUs (:func:`backend_for`): a world of W ranks runs NCCL when every rank gets a GPU of
its own (always at W = 1), else gloo with ranks sharing devices round-robin (gloo moves
CUDA tensors through host memory for all-to-all, all-gather and all-reduce). On one GPU
that is gloo at W = 2 and 4 plus NCCL at W = 1; on four or more, NCCL everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.multiprocess import run_world

HAS_CUDA = torch.cuda.is_available()
DEVICE = os.environ.get("DTREC_CUDA_TIER_DEVICE", "cuda")
"""The tier's device type (meshes, models, batches). ``DTREC_CUDA_TIER_DEVICE=cpu`` runs
the tier on CPU gloo worlds instead: a check of its wiring on a machine without a GPU,
never a substitute for the CUDA run."""
CUDA_TIER = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cuda" and not HAS_CUDA,
        reason="CUDA tier: torch.cuda.is_available() is False (no CUDA device)",
    ),
]


def backend_for(world: int, devices: int | None = None) -> str:
    """NCCL when each of ``world`` ranks has its own GPU, else gloo on shared GPUs."""
    devices = torch.cuda.device_count() if devices is None else devices
    return "nccl" if 1 <= world <= devices else "gloo"


def use_rank_device(rank: int) -> torch.device:
    """Pin this rank to GPU ``rank % device_count`` with exact fp32 matmuls (no TF32, so
    sharded and unsharded models agree to fp32 reassociation, as on CPU)."""
    if DEVICE != "cuda":
        return torch.device(DEVICE)
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return device


def run_cuda_world(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 900.0) -> dict:
    """``run_world`` with :func:`backend_for`'s backend; ``{"backend", "results"}``.

    ``fn`` must call :func:`use_rank_device` before it builds a mesh.
    """
    backend = backend_for(world) if DEVICE == "cuda" else "gloo"
    results = run_world(world, fn, *args, timeout=timeout, backend=backend)
    return {"backend": backend, "results": results}
