"""TorchRec's DLRM, unchanged, distributed with dtrec: forward, backward and one SGD step
equal the unsharded TorchRec DLRM's, on 1 and on 4 gloo ranks.

Each rank feeds its own batch (a TorchRec KJT); the reference runs every rank's batch
with loss = mean of the per-rank losses (DESIGN.md's numerics contract: gradients are
averaged over the W ranks). Plans: dtrec specs mixing every type, the same as a
TorchRec ShardingPlan, the planner's own, a 2D mesh with a DMPCollection-style plan, and
a weighted collection trained with dtrec's fused SGD.
"""

from __future__ import annotations

import pytest

from tests.interop.torchrec_or_skip import torchrec
from tests.multiprocess import run_world

pytestmark = pytest.mark.skipif(torchrec is None, reason="torchrec (bench extra) not installed")

LR = 0.5
ROWS = [40, 10, 23, 8]

CONFIGS = {
    4: {
        "mixed_specs": dict(shards=4, plan="specs"),
        "torchrec_plan": dict(shards=4, plan="torchrec"),
        "planner": dict(shards=4, plan=None),
        "2d_torchrec_plan": dict(shards=2, plan="torchrec"),
        "weighted_fused_sgd": dict(shards=4, plan="specs", weighted=True, fused=True),
    },
    1: {
        "mixed_specs": dict(shards=1, plan="specs"),
        "torchrec_plan": dict(shards=1, plan="torchrec"),
        "planner": dict(shards=1, plan=None),
    },
}


def _dlrm(weighted: bool):
    import torchrec
    from torchrec.models.dlrm import DLRM

    configs = [
        torchrec.EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=rows, embedding_dim=16, feature_names=[f"f{i}"]
        )
        for i, rows in enumerate(ROWS)
    ]
    ebc = torchrec.EmbeddingBagCollection(configs, is_weighted=weighted)
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=5,
        dense_arch_layer_sizes=[8, 16],
        over_arch_layer_sizes=[8, 1],
    )


def _batch(rank: int):
    """This rank's batch. Its KJT always carries per-sample weights: an unweighted
    collection must ignore them (TorchRec's does), a weighted one pool with them."""
    import torch
    import torchrec

    gen = torch.Generator().manual_seed(1000 + rank)
    batch = 3
    lengths = torch.randint(0, 4, (len(ROWS) * batch,), generator=gen)
    bounds = torch.tensor(ROWS).repeat_interleave(batch).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=gen) * bounds).long()
    weights = torch.rand(values.shape, generator=gen)
    kjt = torchrec.KeyedJaggedTensor(
        keys=[f"f{i}" for i in range(len(ROWS))], values=values, lengths=lengths, weights=weights
    )
    dense = torch.randn(batch, 5, generator=gen)
    up = torch.randn(batch, 1, generator=gen)
    return dense, kjt, up


def _plan(model, shards: int, kind: str | None):
    from dtrec.placements import ColumnWise, DataParallel, RowWise, TableWise

    if kind == "specs":
        return {
            "sparse_arch.embedding_bag_collection.t0": RowWise(),
            "sparse_arch.embedding_bag_collection.t1": ColumnWise(),
            "sparse_arch.embedding_bag_collection.t2": TableWise(rank=shards - 1),
            "sparse_arch.embedding_bag_collection.t3": DataParallel(),
        }
    if kind is None:
        return None
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.types import ShardingPlan

    ebc = model.sparse_arch.embedding_bag_collection
    module_plan = sp.construct_module_sharding_plan(
        ebc,
        {
            "t0": sp.row_wise(compute_kernel="dense"),
            "t1": sp.column_wise(ranks=list(range(shards)), compute_kernel="dense"),
            "t2": sp.table_wise(rank=shards - 1, compute_kernel="dense"),
            "t3": sp.data_parallel(),
        },
        world_size=shards,  # DMPCollection plans one sharding group
        local_size=shards,
        device_type="cpu",
    )
    return ShardingPlan({"sparse_arch.embedding_bag_collection": module_plan})


def _check(rank: int, world: int, shards: int, plan, weighted=False, fused=False) -> dict:
    import copy

    import torch
    from torch.distributed.tensor import DTensor

    import dtrec

    torch.manual_seed(0)
    reference = _dlrm(weighted)
    model = copy.deepcopy(reference)
    dense_arch = model.dense_arch
    mesh = dtrec.init_mesh("cpu", shards)
    optimizer = dtrec.optim.SGD(lr=LR) if fused else None
    model = dtrec.distribute_module(model, mesh, _plan(model, shards, plan), optimizer=optimizer)
    sharded = model.sparse_arch.embedding_bag_collection
    assert isinstance(sharded, dtrec.ShardedEmbeddingBagCollection), type(sharded)
    assert sharded.is_weighted is weighted
    assert model.dense_arch is dense_arch  # the dense part is left where it was

    dense, kjt, up = _batch(rank)
    out = model(dense, kjt)
    fwd = (out - reference(dense, kjt)).abs().max().item()
    (out * up).sum().backward()

    total = 0.0
    for r in range(world):
        d, k, u = _batch(r)
        total = total + (reference(d, k) * u).sum() / world
    total.backward()
    # Dense gradients directly; table gradients (DTensors, absent on ranks without a shard
    # of a table, or fused into the update) through the SGD step: w - LR * grad.
    grad = 0.0
    params = dict(model.named_parameters())
    for name, ref in reference.named_parameters():
        if "embedding_bags" in name:
            continue
        got = params[name].grad  # dense: replicated over the mesh, every rank's copy whole
        assert isinstance(got, DTensor) and all(p.is_replicate() for p in got.placements), name
        grad = max(grad, (got.to_local() - ref.grad).abs().max().item())

    torch.optim.SGD(model.parameters(), lr=LR, foreach=True).step()  # CUDA's default
    torch.optim.SGD(reference.parameters(), lr=LR).step()
    full = dtrec.checkpoint.full_state_dict(model)
    want = reference.state_dict()
    assert sorted(full) == sorted(want)
    weight = max((full[k] - want[k]).abs().max().item() for k in want)
    return {"forward": fwd, "grad": grad, "weight": weight, "plan": str(model.sharding_plan)}


def _run_all(rank: int, world: int, configs: dict) -> dict:
    return {name: _check(rank, world, **cfg) for name, cfg in configs.items()}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def world(request) -> tuple[int, list[dict]]:
    size = request.param
    return size, run_world(size, _run_all, CONFIGS[size], timeout=300)


def test_dlrm_round_trip(world) -> None:
    size, results = world
    for name in CONFIGS[size]:
        for rank, per_rank in enumerate(results):
            got = per_rank[name]
            where = f"{name} on rank {rank} of {size}:\n{got['plan']}"
            assert got["forward"] < 1e-5, where
            assert got["grad"] < 1e-5, where
            assert got["weight"] < 1e-5, where
