"""The numerics contract: every sharding type and mesh shape trains exactly like one device.

One spawned world per world size runs every (mesh, plan, weighting) case; the
parametrized tests then assert on its results.
"""

from __future__ import annotations

import pytest

from tests.distributed.numerics import PLANS
from tests.multiprocess import run_world

# (world size, shard group size, node size)
MESHES = {4: [(4, 2), (2, 2), (2, 4), (1, 2)], 2: [(2, 2), (1, 2)]}
TOLERANCE = 1e-5
# torch optimizers other than SGD, run on DTensor table parameters (mixed plan only).
OPTIMIZERS = ("adagrad", "adam")
# CPU and CUDA differ in defaults that decide which code runs, so the CPU suite also runs
# CUDA's: torch optimizers default to foreach=False on CPU but foreach=True on CUDA (the
# kernels that refused a DTensor/plain-tensor mix and that DTensor ran on the first
# tensor's mesh only); each plan's SGD and every optimizer above run with foreach=True
# too. Other CPU/CUDA differences that matter here and how the suites pin them:
# TF32 matmuls / cuDNN (off by default for matmul, on for cuDNN convs; the CUDA tier sets
# both off, tests/gpu/cuda_worlds.py), index_add_/scatter-add are nondeterministic on CUDA
# (dtrec's backward sorts rows instead, so results are bit-stable run to run), and
# autograd runs backward on a device thread on CUDA (so AccumulateGrad copies gradients
# it cannot steal: new_empty_strided, see dtrec/sharded/tables/dtensor_handlers.py).
FOREACH = {"foreach": True}
# Fused optimizers, on plans that exercise replicas, column shards (exact row-wise
# Adagrad needs the row's full sum of squares) and grid (rows and columns split).
FUSED_PLANS = ("mixed", "column_wise", "grid")
SYNC_MODES = ("sparse", "dense")  # forced replica-sync paths (the default picks by bytes)
SYNC_FUSED = ("rowwise_adagrad", "adam", "none")  # "none": torch Adagrad on DTensor grads


def _fused() -> dict:
    import dtrec

    return {
        "sgd": dtrec.optim.SGD(lr=0.5),
        "rowwise_adagrad": dtrec.optim.RowWiseAdagrad(lr=0.1),
        "adam": dtrec.optim.Adam(lr=0.05),
    }


FUSED = _fused()


def _run_world_cases(rank: int, world: int) -> dict[str, tuple]:
    import dtrec
    from tests.distributed.numerics import check_numerics

    out = {}
    for shards, node in MESHES[world]:
        mesh = dtrec.init_mesh("cpu", shards, node_size=node)
        for plan_name, plan in PLANS.items():
            for weighted in (False, True):
                r = check_numerics(mesh, plan, weighted)
                out[_case(world, shards, node, plan_name, weighted)] = _summary(r)
            r = check_numerics(mesh, plan, False, opt_kwargs=FOREACH)
            out[_case(world, shards, node, f"{plan_name}_foreach", False)] = _summary(r)
        for optimizer in OPTIMIZERS:
            r = check_numerics(mesh, PLANS["mixed"], weighted=False, optimizer=optimizer)
            out[_case(world, shards, node, f"mixed_{optimizer}", False)] = _summary(r)
            r = check_numerics(mesh, PLANS["mixed"], False, optimizer=optimizer, opt_kwargs=FOREACH)
            out[_case(world, shards, node, f"mixed_{optimizer}_foreach", False)] = _summary(r)
        for fused_name, fused in FUSED.items():
            for plan_name in FUSED_PLANS:
                r = check_numerics(mesh, PLANS[plan_name], weighted=False, fused=fused)
                out[_case(world, shards, node, f"{plan_name}_fused_{fused_name}", False)] = (
                    _summary(r)
                )
        if world // shards > 1:  # replicas: both replica-sync paths, forced
            from dtrec.sharded.module import ShardedEmbeddingBagCollection as Sharded

            for mode in SYNC_MODES:
                Sharded.replica_sync = mode
                for fused_name in SYNC_FUSED:
                    fused = FUSED.get(fused_name)
                    optimizer = "adagrad" if fused is None else "sgd"
                    r = check_numerics(
                        mesh, PLANS["mixed"], False, optimizer=optimizer, fused=fused
                    )
                    name = f"mixed_fused_{fused_name}_sync_{mode}"
                    out[_case(world, shards, node, name, False)] = _summary(r)
            Sharded.replica_sync = "auto"
    return out


def _summary(r) -> tuple:
    return r.max_weight_diff, r.max_loss_diff, r.grads_sharded_like_weights, r.notes


def _case(world: int, shards: int, node: int, plan: str, weighted: bool) -> str:
    pooling = "weighted" if weighted else "sum_mean"
    return f"W{world}-S{shards}-R{world // shards}-node{node}-{plan}-{pooling}"


CASES = (
    [
        (world, _case(world, s, n, p, w))
        for world, meshes in MESHES.items()
        for s, n in meshes
        for p in PLANS
        for w in (False, True)
    ]
    + [
        (world, _case(world, s, n, f"{p}_foreach", False))
        for world, meshes in MESHES.items()
        for s, n in meshes
        for p in PLANS
    ]
    + [
        (world, _case(world, s, n, f"mixed_{o}{suffix}", False))
        for world, meshes in MESHES.items()
        for s, n in meshes
        for o in OPTIMIZERS
        for suffix in ("", "_foreach")
    ]
    + [
        (world, _case(world, s, n, f"{p}_fused_{f}", False))
        for world, meshes in MESHES.items()
        for s, n in meshes
        for f in FUSED
        for p in FUSED_PLANS
    ]
    + [
        (world, _case(world, s, n, f"mixed_fused_{f}_sync_{m}", False))
        for world, meshes in MESHES.items()
        for s, n in meshes
        if world // s > 1
        for f in SYNC_FUSED
        for m in SYNC_MODES
    ]
)


@pytest.fixture(scope="module")
def world_results() -> dict[int, list[dict]]:
    return {world: run_world(world, _run_world_cases, timeout=900) for world in MESHES}


@pytest.mark.parametrize(("world", "case"), CASES, ids=[c for _, c in CASES])
def test_sharded_training_matches_unsharded(world_results, world: int, case: str) -> None:
    for rank, results in enumerate(world_results[world]):
        weight_diff, loss_diff, grads_ok, notes = results[case]
        assert weight_diff < TOLERANCE, f"rank {rank}: weights differ by {weight_diff}"
        assert loss_diff < TOLERANCE, f"rank {rank}: losses differ by {loss_diff}"
        assert grads_ok, f"rank {rank}: gradients not sharded like weights: {notes}"
