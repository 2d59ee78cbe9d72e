"""Offloaded tables on CUDA: the CPU suite's checks (``tests/distributed/test_offload.py``)
with models, batches and device caches on the GPU, host tiers in pinned memory and the
row copies on a stream of their own.

One world of 4 ranks (NCCL on 4+ GPUs, else gloo sharing the GPUs, ``cuda_worlds``):
every fused optimizer x row-wise (1D and 2D) and table-wise, 30 steps behind 5% caches
against the device tables; the pipeline; the checkpoint round trip into another plan and
cache size. Bound: 1e-6 on every weight and state entry (on CPU they are bitwise equal;
on CUDA rows that a 2D update reaches outside a replica's cache are stepped by the torch
rule rather than the Triton kernel, which may differ in the last bit), and whether the
run was bitwise is reported. Also: every offloaded block is pinned host memory and the
caches copy on a CUDA stream that is not the compute stream.
"""

from __future__ import annotations

import pytest

from tests.gpu.cuda_worlds import CUDA_TIER, DEVICE, run_cuda_world, use_rank_device

pytestmark = CUDA_TIER

STEPS = 30
BOUND = 1e-6
CASES = [f"{o}/row_wise/{m}" for o in ("sgd", "adagrad", "adam") for m in ("1d", "2d")]
CASES += ["adagrad/table_wise/1d", "pipeline", "round_trip"]


def _facts(mesh) -> dict:
    """Where an offloaded model's tensors live."""
    import tests.distributed.test_offload as T

    model, _ = T._build(mesh, "row_wise", "adam", {"cache_fraction": 0.05})
    offload = model.sparse._offload
    hosts = [t.weight.to_local() for t in model.sparse.embedding_bags.values()]
    caches = list(offload.caches.values())
    return {
        "host_pinned": all(h.is_pinned() for h in hosts if h.numel()) if DEVICE == "cuda" else True,
        "host_on_cpu": all(h.device.type == "cpu" for h in hosts),
        "caches_on_device": all(c.weight.device.type == DEVICE for c in caches),
        "copy_stream": (offload._jobs.copies.stream is not None) == (DEVICE == "cuda"),
    }


def _run(rank: int, world: int, root: str) -> dict:
    from pathlib import Path

    import dtrec
    import tests.distributed.test_offload as T

    device = use_rank_device(rank)
    T.DEVICE = device.type
    meshes = {"1d": dtrec.init_mesh(device.type, 4), "2d": dtrec.init_mesh(device.type, 2)}
    out = {"facts": _facts(meshes["1d"])}
    for case in CASES[:-2]:
        optimizer, kind, mesh = case.split("/")
        out[case] = T._side_by_side(meshes[mesh], kind, optimizer, STEPS)
    out["pipeline"] = T._pipelined(meshes["2d"], "adam", STEPS)
    out["round_trip"] = T._round_trip(Path(root), "adagrad")
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    return run_cuda_world(4, _run, str(tmp_path_factory.mktemp("offload_cuda")), timeout=1500)


def test_offloaded_blocks_are_pinned_host_memory_and_copy_on_their_own_stream(world) -> None:
    for rank, r in enumerate(world["results"]):
        assert r["facts"] == {
            "host_pinned": True, "host_on_cpu": True, "caches_on_device": True,
            "copy_stream": True,
        }, (rank, world["backend"])  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_cached_training_equals_device_training_on_cuda(world, case) -> None:
    for rank, r in enumerate(world["results"]):
        got = r[case]
        assert got["largest"] <= BOUND, (rank, case, got["largest"], got["differ"][:4])
