"""TorchRec's daily recipe, unchanged: ``apply_optimizer_in_backward`` picks the embedding
optimizer, ``in_backward_optimizer_filter`` the dense optimizer's parameters.

The same TorchRec DLRM (same initial weights), the same recipe and the same per-rank
batches go to TorchRec's own ``DistributedModelParallel`` (FBGEMM's fused optimizer, gloo
on CPU) and to ``dtrec.distribute_module``; after 10 steps every weight (tables and dense)
must be TorchRec's, on 1 and on 4 ranks, for row-wise Adagrad (TorchRec's
``RowWiseAdagrad``), SGD and Adam (torch's classes). Tables are row-wise and table-wise:
TorchRec's column-wise row-wise Adagrad keeps one accumulator per column shard (not the
unsharded optimizer, ANCHORS.md), and its data-parallel tables ignore the in-backward
optimizer (dense kernel), so those are compared with the unsharded model elsewhere.
Skipped without torchrec (the ``bench`` extra).
"""

from __future__ import annotations

import pytest

from tests.interop.torchrec_or_skip import torchrec
from tests.multiprocess import run_world

pytestmark = pytest.mark.skipif(torchrec is None, reason="torchrec (bench extra) not installed")

ROWS = [40, 10, 23, 8]
STEPS = 10
DENSE_LR = 0.05
TOL = 1e-5

RECIPES = {
    "rowwise_adagrad": ("torchrec.optim.RowWiseAdagrad", {"lr": 0.1}),
    "sgd": ("torch.optim.SGD", {"lr": 0.5}),
    "adam": ("torch.optim.Adam", {"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-6}),
    "torchrec_adam": ("torchrec.optim.optimizers.Adam", {"lr": 0.02, "beta1": 0.8}),
}
"""Recipe -> (in-backward optimizer class, kwargs)."""
EXPLICIT = {"adam": ("Adam", dict(lr=0.02, betas=(0.8, 0.99), eps=1e-6)),
            "torchrec_adam": ("Adam", dict(lr=0.02, betas=(0.8, 0.999)))}  # fmt: skip
"""FBGEMM has no Adam on CPU, so TorchRec's DMP cannot train these here: they are compared
with dtrec given the same rule as ``optimizer=`` (the mapping: kwargs, defaults)."""


def _optimizer_class(path: str):
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _dlrm(recipe: str | None):
    """TorchRec's DLRM (seeded) with the recipe's in-backward optimizer on its tables."""
    import torch
    import torchrec
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec.models.dlrm import DLRM

    torch.manual_seed(0)
    configs = [
        torchrec.EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=rows, embedding_dim=8, feature_names=[f"f{i}"]
        )
        for i, rows in enumerate(ROWS)
    ]
    model = DLRM(
        embedding_bag_collection=torchrec.EmbeddingBagCollection(configs),
        dense_in_features=5,
        dense_arch_layer_sizes=[8, 8],
        over_arch_layer_sizes=[8, 1],
    )
    if recipe is None:
        return model
    cls, kwargs = RECIPES[recipe]
    _apply_optimizer_in_backward(
        _optimizer_class(cls), model.sparse_arch.parameters(), dict(kwargs)
    )
    return model


def _plan(model, world: int):
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.types import ShardingPlan

    ebc = model.sparse_arch.embedding_bag_collection
    module_plan = sp.construct_module_sharding_plan(
        ebc,
        {
            "t0": sp.row_wise(),
            "t1": sp.table_wise(rank=world - 1),
            "t2": sp.row_wise(),
            "t3": sp.table_wise(rank=0),
        },
        world_size=world,
        local_size=world,
        device_type="cpu",
    )
    return ShardingPlan({"sparse_arch.embedding_bag_collection": module_plan})


def _batch(rank: int, step: int):
    import torch
    import torchrec

    gen = torch.Generator().manual_seed(1000 * step + rank)
    batch = 4
    lengths = torch.randint(0, 4, (len(ROWS) * batch,), generator=gen)
    bounds = torch.tensor(ROWS).repeat_interleave(batch).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=gen) * bounds).long()
    kjt = torchrec.KeyedJaggedTensor(
        keys=[f"f{i}" for i in range(len(ROWS))], values=values, lengths=lengths
    )
    return torch.randn(batch, 5, generator=gen), kjt, torch.rand(batch, 1, generator=gen)


def _train(model, dense_opt, rank: int) -> None:
    import torch

    for step in range(STEPS):
        dense, kjt, target = _batch(rank, step)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, kjt), target)
        loss.backward()
        dense_opt.step()
        dense_opt.zero_grad()


def _dense_optimizer(model):
    """TorchRec's recipe: the dense optimizer over what in_backward_optimizer_filter leaves."""
    import torch
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    return KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=DENSE_LR),
    )


def _check(rank: int, world: int, recipe: str) -> dict:
    import torch
    from torchrec.distributed import DistributedModelParallel
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    import dtrec

    if recipe in EXPLICIT:
        name, kwargs = EXPLICIT[recipe]
        rule = getattr(dtrec.optim, name)(**kwargs)
        theirs = _dlrm(None)
        mesh = dtrec.init_mesh("cpu", shard_group_size=world)
        theirs = dtrec.distribute_module(theirs, mesh, _plan(theirs, world), optimizer=rule)
    else:
        theirs = _dlrm(recipe)
        theirs = DistributedModelParallel(
            theirs, device=torch.device("cpu"), plan=_plan(theirs, world)
        )
    initial = theirs.state_dict()  # DMP made its own tables (TBE init): start from them
    mine = _dlrm(recipe)
    mesh = dtrec.init_mesh("cpu", shard_group_size=world)
    mine = dtrec.distribute_module(mine, mesh, _plan(mine, world).plan)  # the plan dict
    mine.load_state_dict(initial)
    start = dtrec.checkpoint.to_full_state_dict(initial)
    _train(theirs, _dense_optimizer(theirs), rank)
    dense_names = sorted(dict(in_backward_optimizer_filter(mine.named_parameters())))
    _train(mine, _dense_optimizer(mine), rank)

    want = dtrec.checkpoint.to_full_state_dict(theirs.state_dict())
    got = dtrec.checkpoint.full_state_dict(mine)
    assert sorted(want) == sorted(got), (sorted(want), sorted(got))
    diffs = {k: (want[k] - got[k]).abs().max().item() for k in want}
    moved = {k: (want[k] - start[k]).abs().max().item() for k in want if "embedding_bags" in k}
    return {
        "diffs": diffs,
        "moved": moved,
        "rule": repr(mine.fused_optimizer.optimizer),
        "dense_names": dense_names,
    }


def _run_all(rank: int, world: int) -> dict:
    return {recipe: _check(rank, world, recipe) for recipe in RECIPES}


@pytest.fixture(scope="module", params=[1, 4])
def world(request) -> tuple[int, list[dict]]:
    return request.param, run_world(request.param, _run_all, timeout=600)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_trains_like_torchrec(world, recipe: str) -> None:
    size, results = world
    for rank, per_rank in enumerate(results):
        got = per_rank[recipe]
        worst = max(got["diffs"], key=got["diffs"].get)
        assert got["diffs"][worst] < TOL, (rank, size, worst, got["diffs"], got["rule"])
        assert min(got["moved"].values()) > 1e-4, got["moved"]  # the tables did train
        assert not any("embedding_bags" in n for n in got["dense_names"]), got["dense_names"]
