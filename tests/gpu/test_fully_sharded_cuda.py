"""Fully sharded 2D on CUDA (issue 43 item 9): exact, and no more host syncs than exact 2D.

One world of 4 ranks (S 2 x R 2; gloo ranks sharing one GPU, NCCL with 4 or more,
``tests/gpu/cuda_worlds.py``) runs

* the first ``NUMERICS_CASES`` cases of the CPU property test
  (``tests/distributed/test_fully_sharded_property.py``: random tables, every fully
  sharded type, fused SGD, row-wise Adagrad, Adam and torch's SGD and Adam, meshes
  2 x 2 and 1 x 4 with and without node splits, uneven and empty batches) with tables,
  batches and the owner-slice exchanges on the GPU, each within 1e-5 of the unsharded
  model on the global batch, each rank holding its owner slices at rest;
* the steady-state embedding step of ``tests/test_fully_sharded_step_budget.py``, exact
  2D and fully sharded, counted by ``benchmarks.probes.step.StepCounter`` on the GPU's
  tensors and by CUDA's own synchronizing-call count (``sync_debug_sites``): the fully
  sharded step waits for the device no more often than the exact 2D one, and its own
  waits (``replica_slices.py``) are the two the CPU budget states.

``make gpu-check`` runs this module as its ``fully_sharded`` part
(``benchmarks/gpu_check/parts.py``). ``DTREC_CUDA_TIER_DEVICE=cpu`` runs it on CPU gloo
worlds (the wiring check); ``DTREC_FS_GPU_SMOKE=1`` keeps one numerics case.
"""

from __future__ import annotations

import os

import pytest

from tests.gpu.cuda_worlds import CUDA_TIER, run_cuda_world

pytestmark = CUDA_TIER

TOLERANCE = 1e-5
NUMERICS_CASES = 1 if os.environ.get("DTREC_FS_GPU_SMOKE") else 10
COUNTED_TABLES = 4


def _numerics(rank: int, device: str) -> list[dict]:
    from tests.distributed.test_fully_sharded_property import CASES, _run_cases

    return _run_cases(rank, 4, CASES[4][:NUMERICS_CASES], device)


def _counts(rank: int, device: str) -> dict:
    import torch

    from benchmarks.probes.step import StepCounter, sync_debug_sites
    from tests.test_fully_sharded_step_budget import fully_sharded_step

    out = {}
    for mode in ("exact", "fs"):
        # CUDA: the Triton backend; CPU (the wiring check): the default one
        backend = "triton" if device == "cuda" else None
        step, batch = fully_sharded_step(rank, COUNTED_TABLES, mode, device, backend)
        for _ in range(2):
            step(batch())
        inputs = batch()
        if device == "cuda":
            torch.cuda.synchronize()
        with sync_debug_sites() as cuda_sites, StepCounter(torch.device(device)) as counts:
            step(inputs)
        out[mode] = {
            "launches": counts.total_launches(),
            "syncs": counts.total_syncs(),
            "sync_sites": dict(counts.syncs),
            "cuda_sync_sites": dict(cuda_sites),
        }
    return out


def _world(rank: int, world: int) -> dict:
    from tests.gpu import cuda_worlds

    cuda_worlds.use_rank_device(rank)
    device = cuda_worlds.DEVICE
    return {"numerics": _numerics(rank, device), "counts": _counts(rank, device)}


@pytest.fixture(scope="module")
def results() -> dict:
    return run_cuda_world(4, _world)


def test_fully_sharded_on_the_device_trains_like_unsharded(results) -> None:
    backend = results["backend"]
    assert len(results["results"][0]["numerics"]) == NUMERICS_CASES
    for rank, result in enumerate(results["results"]):
        for index, got in enumerate(result["numerics"]):
            assert not got["notes"] and not got["problems"], (rank, backend, index, got)
            assert got["worst"] < TOLERANCE, (rank, backend, index, got)


def test_fully_sharded_step_waits_no_more_than_exact_2d_on_the_device(results) -> None:
    from tests.test_fully_sharded_step_budget import FS_SYNC_SITES, fs_sync_sites

    for rank, result in enumerate(results["results"]):
        exact, fs = result["counts"]["exact"], result["counts"]["fs"]
        assert fs["syncs"] <= exact["syncs"], (rank, fs["sync_sites"], exact["sync_sites"])
        # (at most: on CUDA a host read may reach the counter as one op or none)
        assert 1 <= sum(fs_sync_sites(fs["sync_sites"]).values()) <= FS_SYNC_SITES, (rank, fs)
        # CUDA's own count of synchronizing calls (empty on CPU): no more than exact 2D's
        cuda_fs, cuda_exact = (sum(c["cuda_sync_sites"].values()) for c in (fs, exact))
        assert cuda_fs <= cuda_exact, (rank, fs["cuda_sync_sites"], exact["cuda_sync_sites"])
        assert sum(fs_sync_sites(fs["cuda_sync_sites"]).values()) <= FS_SYNC_SITES, rank
