"""The numerics contract on CUDA: sharded training == unsharded training on the global batch.

The CPU suite's cases (``tests/distributed/test_numerics.py``): every sharding type with
and without per-sample weights, torch optimizers on DTensor tables, every fused optimizer
on plans with replicas, column shards and grid, and both replica-sync paths; here with
tables, batches and collectives on CUDA (``check_numerics(device="cuda")``), on a 1D mesh
with two nodes (S=4), a 2D mesh (S=2, R=2), W=2 and W=1 (NCCL). Which backend each world
uses depends on the GPUs present (``tests/gpu/cuda_worlds.py``).
"""

from __future__ import annotations

import pytest

from tests.distributed.numerics import PLANS
from tests.distributed.test_numerics import (
    FUSED_PLANS,
    OPTIMIZERS,
    SYNC_FUSED,
    SYNC_MODES,
    TOLERANCE,
)
from tests.gpu.cuda_worlds import CUDA_TIER, run_cuda_world

pytestmark = CUDA_TIER

# world size -> [(shard group size, node size)]
MESHES = {4: [(4, 2), (2, 2)], 2: [(2, 2)], 1: [(1, 1)]}
FUSED_NAMES = ("sgd", "rowwise_adagrad", "adam")


def _fused(name: str | None):
    import dtrec

    return {
        None: None,
        "sgd": dtrec.optim.SGD(lr=0.5),
        "rowwise_adagrad": dtrec.optim.RowWiseAdagrad(lr=0.1),
        "adam": dtrec.optim.Adam(lr=0.05),
    }[name]


def _case(world: int, shards: int, node: int, plan: str, weighted: bool) -> str:
    pooling = "weighted" if weighted else "sum_mean"
    return f"cuda-W{world}-S{shards}-R{world // shards}-node{node}-{plan}-{pooling}"


def _jobs(world: int) -> list[tuple[str, int, int, str, dict]]:
    """(case, shards, node, plan name, check_numerics kwargs) of one world, in run order."""
    return [
        (_case(world, shards, node, name, kw.get("weighted", False)), shards, node, plan, kw)
        for shards, node in MESHES[world]
        for name, plan, kw in _mesh_jobs(world // shards)
    ]


def _mesh_jobs(replicas: int) -> list[tuple[str, str, dict]]:
    """(case name, plan name, kwargs) of one mesh."""
    jobs = [(p, p, {"weighted": w}) for p in PLANS for w in (False, True)]
    jobs += [(f"mixed_{o}", "mixed", {"optimizer": o}) for o in OPTIMIZERS]
    jobs += [(f"{p}_fused_{f}", p, {"fused": f}) for f in FUSED_NAMES for p in FUSED_PLANS]
    if replicas > 1:  # replicas: both replica-sync paths, forced
        jobs += [
            (
                f"mixed_fused_{f}_sync_{mode}",
                "mixed",
                {
                    "sync": mode,
                    "fused": None if f == "none" else f,
                    "optimizer": "adagrad" if f == "none" else "sgd",
                },
            )
            for mode in SYNC_MODES
            for f in SYNC_FUSED
        ]
    return jobs


def _run_cases(rank: int, world: int) -> dict[str, tuple]:
    import dtrec
    from dtrec.sharded.module import ShardedEmbeddingBagCollection as Sharded
    from tests.distributed.numerics import check_numerics
    from tests.gpu import cuda_worlds

    cuda_worlds.use_rank_device(rank)
    meshes = {}
    out = {}
    for case, shards, node, plan, kw in _jobs(world):
        if (shards, node) not in meshes:
            meshes[shards, node] = dtrec.init_mesh(cuda_worlds.DEVICE, shards, node_size=node)
        kw = dict(kw)
        Sharded.replica_sync = kw.pop("sync", "auto")
        fused = _fused(kw.pop("fused", None))
        weighted = kw.pop("weighted", False)
        try:
            r = check_numerics(
                meshes[shards, node],
                PLANS[plan],
                weighted,
                fused=fused,
                device=cuda_worlds.DEVICE,
                **kw,
            )
        finally:
            Sharded.replica_sync = "auto"
        out[case] = (r.max_weight_diff, r.max_loss_diff, r.grads_sharded_like_weights, r.notes)
    return out


CASES = [(world, job[0]) for world in MESHES for job in _jobs(world)]


@pytest.fixture(scope="module")
def world_results() -> dict[int, dict]:
    return {world: run_cuda_world(world, _run_cases) for world in MESHES}


@pytest.mark.parametrize(("world", "case"), CASES, ids=[c for _, c in CASES])
def test_sharded_training_on_cuda_matches_unsharded(world_results, world: int, case: str) -> None:
    backend = world_results[world]["backend"]
    for rank, results in enumerate(world_results[world]["results"]):
        weight_diff, loss_diff, grads_ok, notes = results[case]
        where = f"rank {rank} ({backend})"
        assert weight_diff < TOLERANCE, f"{where}: weights differ by {weight_diff}"
        assert loss_diff < TOLERANCE, f"{where}: losses differ by {loss_diff}"
        assert grads_ok, f"{where}: gradients not sharded like weights: {notes}"
