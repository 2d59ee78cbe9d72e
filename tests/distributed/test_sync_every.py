"""``sync_every=k``: replicas average weights every k steps instead of summing gradients.

On a (S=2, R=2) mesh: with SGD and k=1 this is the same math as the per-step gradient
sync (averaging w - lr * g_r over replicas = w - lr * mean g), so it must match the
default model; with k=2 and row-wise Adagrad replicas drift apart between syncs and are
identical (weights and optimizer state) right after one. Collectives are checked too.
"""

from __future__ import annotations

import pytest

from tests.multiprocess import run_world

WORLD, SHARDS, STEPS = 4, 2, 4


def _train(rank: int, fused_name: str | None, sync_every: int | None) -> dict:
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
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    gen = torch.Generator().manual_seed(20 + rank)
    with dtrec.comm_stats() as stats:
        for _ in range(STEPS):
            kjt, target = make_batch(tables, 3, False, gen)
            ((model(kjt) - target) ** 2).mean().backward()
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
        "calls": dict(stats.calls),
    }


def _run(rank: int, world: int) -> dict:
    out = {}
    for fused in (None, "sgd"):
        out[fused, "grads"] = _train(rank, fused, None)
        out[fused, "k1"] = _train(rank, fused, 1)
    out["adagrad", "k2"] = _train(rank, "rowwise_adagrad", 2)
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
        assert calls["replica_sync.weights"] == STEPS - 1, calls  # before steps 2..STEPS
        assert "grad_sync.replicate" not in calls and "grad_sync.replicate.counts" not in calls
        assert r[fused, "k1"]["replica_diff"] == 0.0


def test_k2_rowwise_adagrad_replicas_agree_after_sync(results) -> None:
    for rank, r in enumerate(results):
        k2 = r["adagrad", "k2"]
        assert k2["calls"]["replica_sync.weights"] == (STEPS - 1) // 2, k2["calls"]
        assert k2["replica_diff"] == 0.0, rank  # weights and row-wise Adagrad state
        assert k2["drift"] > 0.0, rank  # replicas had taken different steps since the last sync


def test_sync_every_rejects_bad_values() -> None:
    from dtrec.sharded.module import ShardedEmbeddingBagCollection

    with pytest.raises(ValueError, match="sync_every"):
        ShardedEmbeddingBagCollection.__init__(object.__new__(ShardedEmbeddingBagCollection),
                                               [], {}, None, {}, sync_every=0)  # fmt: skip
