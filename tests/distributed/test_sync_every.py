"""``sync_every=k``: replicas average weights every k steps instead of summing gradients.

On a (S=2, R=2) mesh: with SGD and k=1 this is the same math as the per-step gradient
sync (averaging w - lr * g_r over replicas = w - lr * mean g), so it must match the
default model; with k=2 and row-wise Adagrad replicas drift apart between syncs and are
identical (weights and optimizer state) right after one. Collectives are checked too.
The average overlapped with the next step (``overlap_replica_sync``, the default) gives
bit for bit the blocking one's weights and state, and with a fused optimizer is in
flight at the end of each k-th backward.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiprocess import run_world

WORLD, SHARDS, STEPS = 4, 2, 4


def _train(rank: int, fused_name: str | None, sync_every: int | None, overlap: bool = True) -> dict:
    import copy

    import torch
    import torch.distributed as dist

    import dtrec
    from dtrec.placements.mesh import REPLICATE
    from tests.distributed.numerics import PLANS, TinyModel, make_batch, make_tables

    mesh = dtrec.init_mesh("cpu", SHARDS)
    tables = make_tables(False)
    torch.manual_seed(0)
    base = TinyModel(tables)
    plan = {f"sparse.{k}": v for k, v in PLANS["mixed"].items()}
    fused = {None: None, "sgd": dtrec.optim.SGD(lr=0.5),
             "rowwise_adagrad": dtrec.optim.RowWiseAdagrad(lr=0.1)}[fused_name]  # fmt: skip
    model = dtrec.distribute_module(
        copy.deepcopy(base), mesh, plan, optimizer=fused, sync_every=sync_every
    )
    model.sparse.overlap_replica_sync = overlap
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    gen = torch.Generator().manual_seed(20 + rank)
    in_flight = []  # per step: whether a replica average was in flight after its backward
    with dtrec.comm_stats() as stats:
        for _ in range(STEPS):
            kjt, target = make_batch(tables, 3, False, gen)
            ((model(kjt) - target) ** 2).mean().backward()
            in_flight.append(model.sparse._averaging is not None)
            opt.step()
            opt.zero_grad()
    before = [t.weight.to_local().clone() for t in model.sparse.embedding_bags.values()]
    model.sparse.sync_replicas()
    shards = [t.weight.to_local() for t in model.sparse.embedding_bags.values()]
    state = model.sparse.fused_optimizer_state() if fused is not None else {}
    states = [v for s in state.values() for v in s.values() if v.dim() > 0]
    # largest difference to the other replica of each shard, after the final sync
    group = mesh.get_group(REPLICATE)
    replica_diff = 0.0
    for x in shards + states:
        other = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(other, x.contiguous(), group=group)
        replica_diff = max(
            [replica_diff] + [float((o - x).abs().max()) for o in other if o.numel()]
        )
    return {
        "shards": [x.detach().clone() for x in shards],
        "drift": max(
            float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(before, shards)
        ),  # fmt: skip
        "replica_diff": replica_diff,
        "states": [x.detach().clone() for x in states],
        "calls": dict(stats.calls),
        "in_flight": in_flight,
    }


def _run(rank: int, world: int) -> dict:
    out = {}
    for fused in (None, "sgd"):
        out[fused, "grads"] = _train(rank, fused, None)
        out[fused, "k1"] = _train(rank, fused, 1)
    out["adagrad", "k2"] = _train(rank, "rowwise_adagrad", 2)
    out["adagrad", "k2", "blocking"] = _train(rank, "rowwise_adagrad", 2, overlap=False)
    out[None, "k2"] = _train(rank, None, 2)
    out[None, "k2", "blocking"] = _train(rank, None, 2, overlap=False)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(WORLD, _run, timeout=300)


@pytest.mark.parametrize("fused", [None, "sgd"], ids=["torch-sgd", "fused-sgd"])
def test_k1_with_sgd_equals_gradient_sync(results, fused) -> None:
    for rank, r in enumerate(results):
        for got, want in zip(r[fused, "k1"]["shards"], r[fused, "grads"]["shards"], strict=True):
            if got.numel():
                assert float((got - want).abs().max()) < 1e-6, rank
        calls = r[fused, "k1"]["calls"]
        # a fused update starts each step's average at the end of its backward (the last
        # one in flight when training stops); without one, each next forward starts it
        assert calls["replica_sync.weights"] == (STEPS if fused else STEPS - 1), calls
        assert "grad_sync.replicate" not in calls and "grad_sync.replicate.counts" not in calls
        assert r[fused, "k1"]["replica_diff"] == 0.0


def test_k2_rowwise_adagrad_replicas_agree_after_sync(results) -> None:
    for rank, r in enumerate(results):
        k2 = r["adagrad", "k2"]
        assert k2["calls"]["replica_sync.weights"] == STEPS // 2, k2["calls"]
        assert r["adagrad", "k2", "blocking"]["calls"]["replica_sync.weights"] == (STEPS - 1) // 2
        assert k2["replica_diff"] == 0.0, rank  # weights and row-wise Adagrad state
        assert k2["drift"] > 0.0, rank  # replicas had taken different steps since the last sync


@pytest.mark.parametrize("fused", ["adagrad", None], ids=["fused-adagrad", "torch-sgd"])
def test_overlapped_average_equals_blocking_bit_for_bit(results, fused) -> None:
    for rank, r in enumerate(results):
        overlapped, blocking = r[fused, "k2"], r[fused, "k2", "blocking"]
        for got, want in zip(
            overlapped["shards"] + overlapped["states"],
            blocking["shards"] + blocking["states"],
            strict=True,
        ):
            assert torch.equal(got, want), rank
        # in flight after every 2nd backward with a fused update; never when blocking
        want = [fused is not None and (s + 1) % 2 == 0 for s in range(STEPS)]
        assert overlapped["in_flight"] == want, (rank, overlapped["in_flight"])
        assert not any(blocking["in_flight"]), rank


def test_sync_every_rejects_bad_values() -> None:
    from dtrec.sharded.module import ShardedEmbeddingBagCollection

    with pytest.raises(ValueError, match="sync_every"):
        ShardedEmbeddingBagCollection.__init__(object.__new__(ShardedEmbeddingBagCollection),
                                               [], {}, None, {}, sync_every=0)  # fmt: skip
