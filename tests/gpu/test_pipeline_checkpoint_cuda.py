"""Pipeline on/off and checkpoint round trips with tables, batches and collectives on CUDA.

Per world (W=4 on a 2D mesh S=2 R=2, W=1 on NCCL), one model config per fused optimizer:

* pipeline: the same model trained with a plain loop and through ``dtrec.TrainPipeline``
  (input-dist of batch i + 1 in flight during batch i) gives the same losses and weights,
  and each batch's input-dist runs once, in order;
* checkpoint: a model trained 2 steps is saved; the uninterrupted run continues 2 steps;
  fresh models (other init) load the checkpoint, into the same plan and into another plan
  (resharding), must hold the saved weights and continue exactly like the uninterrupted run.
"""

from __future__ import annotations

import pytest

from tests.distributed.test_numerics import TOLERANCE
from tests.gpu.cuda_worlds import CUDA_TIER, run_cuda_world

pytestmark = CUDA_TIER

WORLDS = {4: 2, 1: 1}  # world size -> shard group size
FUSED_NAMES = ("rowwise_adagrad", "adam", "sgd", None)  # None: torch SGD on DTensor tables
STEPS, SAVE_AFTER = 4, 2


def _fused(name: str | None):
    import dtrec

    return {
        None: None,
        "sgd": dtrec.optim.SGD(lr=0.5),
        "rowwise_adagrad": dtrec.optim.RowWiseAdagrad(lr=0.1),
        "adam": dtrec.optim.Adam(lr=0.05),
    }[name]


def _plans(shards: int) -> dict[str, dict]:
    from dtrec.placements import ColumnWise, DataParallel, RowWise, TableWise

    return {
        "mixed": {"t0": RowWise(), "t1": TableWise(rank=0), "t2": ColumnWise(),
                  "t3": DataParallel()},
        "other": {"t0": ColumnWise(), "t1": RowWise(), "t2": TableWise(rank=shards - 1),
                  "t3": RowWise()},
    }  # fmt: skip


def _model(mesh, plan: dict, fused_name: str | None, seed: int):
    """A distributed TinyModel on ``mesh`` and an SGD optimizer of its ``.grad`` params."""
    import torch

    import dtrec
    from tests.distributed.numerics import TinyModel, make_tables
    from tests.gpu import cuda_worlds

    torch.manual_seed(seed)
    model = TinyModel(make_tables(weighted=False)).to(cuda_worlds.DEVICE)
    model = dtrec.distribute_module(
        model, mesh, {f"sparse.{k}": v for k, v in plan.items()}, optimizer=_fused(fused_name)
    )
    return model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)


def _batches(rank: int, steps: int) -> list:
    import torch

    from tests.distributed.numerics import make_batch, make_tables
    from tests.gpu import cuda_worlds

    gen = torch.Generator().manual_seed(10 + rank)
    batches = [make_batch(make_tables(False), 3, False, gen) for _ in range(steps)]
    return [(kjt.to(cuda_worlds.DEVICE), y.to(cuda_worlds.DEVICE)) for kjt, y in batches]


def _loss(model, batch):
    kjt, target = batch
    return ((model(kjt) - target) ** 2).mean()


def _train(model, opt, batches) -> list[float]:
    losses = []
    for batch in batches:
        loss = _loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(((a[k].float() - b[k].float()).abs().max().item() for k in a if a[k].numel()),
               default=0.0)  # fmt: skip


def _pipeline(rank: int, mesh, shards: int, fused_name: str | None) -> dict:
    import dtrec
    from dtrec.sharded.module import ShardedEmbeddingBagCollection

    plan = _plans(shards)["mixed"]
    batches = _batches(rank, STEPS)
    plain, plain_opt = _model(mesh, plan, fused_name, seed=0)
    piped, piped_opt = _model(mesh, plan, fused_name, seed=0)
    plain_losses = _train(plain, plain_opt, batches)
    calls = []
    original = ShardedEmbeddingBagCollection.input_dist

    def counted(self, features):
        calls.append(id(features))
        return original(self, features)

    ShardedEmbeddingBagCollection.input_dist = counted
    try:
        pipeline = dtrec.TrainPipeline(piped, piped_opt, _loss)
        piped_losses = [loss.item() for loss in pipeline.run(batches)]
    finally:
        ShardedEmbeddingBagCollection.input_dist = original
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(plain_losses, piped_losses)),
        "weight_diff": _max_diff(_local_state(plain), _local_state(piped)),
        "input_dists_in_order": calls == [id(kjt) for kjt, _ in batches],
    }


def _local_state(model) -> dict:
    return {
        name: (p.to_local() if hasattr(p, "to_local") else p).detach().cpu()
        for name, p in model.named_parameters()
    }


def _checkpoint(rank: int, mesh, shards: int, fused_name: str | None, root: str) -> dict:
    from dtrec import checkpoint

    plans = _plans(shards)
    batches = _batches(rank, STEPS)
    model, opt = _model(mesh, plans["mixed"], fused_name, seed=0)
    _train(model, opt, batches[:SAVE_AFTER])
    checkpoint.save(root, model, opt)
    saved = checkpoint.full_state_dict(model)
    want = _train(model, opt, batches[SAVE_AFTER:])
    want_final = checkpoint.full_state_dict(model)
    out = {}
    for plan_name, plan in plans.items():
        fresh, fresh_opt = _model(mesh, plan, fused_name, seed=99)
        checkpoint.load(root, fresh, fresh_opt)
        loaded = checkpoint.full_state_dict(fresh)
        got = _train(fresh, fresh_opt, batches[SAVE_AFTER:])
        out[plan_name] = {
            "loaded_diff": _max_diff(saved, loaded),
            "loss_diff": max(abs(a - b) for a, b in zip(want, got)),
            "final_diff": _max_diff(want_final, checkpoint.full_state_dict(fresh)),
        }
    return out


def _run(rank: int, world: int, root: str) -> dict:
    import dtrec
    from tests.gpu import cuda_worlds

    cuda_worlds.use_rank_device(rank)
    shards = WORLDS[world]
    mesh = dtrec.init_mesh(cuda_worlds.DEVICE, shards)
    out = {}
    for fused_name in FUSED_NAMES:
        out["pipeline", fused_name] = _pipeline(rank, mesh, shards, fused_name)
        path = f"{root}/W{world}-{fused_name}"
        out["checkpoint", fused_name] = _checkpoint(rank, mesh, shards, fused_name, path)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, dict]:
    root = tmp_path_factory.mktemp("cuda_ckpt")
    return {world: run_cuda_world(world, _run, str(root)) for world in WORLDS}


CASES = [(w, f) for w in WORLDS for f in FUSED_NAMES]
IDS = [f"W{w}-S{s}-{f or 'torch_sgd'}" for w, s in WORLDS.items() for f in FUSED_NAMES]


@pytest.mark.parametrize(("world", "fused_name"), CASES, ids=IDS)
def test_pipeline_on_cuda_matches_plain_loop(results, world: int, fused_name) -> None:
    backend = results[world]["backend"]
    for rank, r in enumerate(results[world]["results"]):
        r = r["pipeline", fused_name]
        where = f"rank {rank} ({backend})"
        assert r["loss_diff"] < TOLERANCE, f"{where}: losses differ by {r['loss_diff']}"
        assert r["weight_diff"] < TOLERANCE, f"{where}: weights differ by {r['weight_diff']}"
        assert r["input_dists_in_order"], f"{where}: not one input-dist per batch, in order"


@pytest.mark.parametrize(("world", "fused_name"), CASES, ids=IDS)
def test_checkpoint_round_trip_on_cuda(results, world: int, fused_name) -> None:
    backend = results[world]["backend"]
    for rank, r in enumerate(results[world]["results"]):
        for plan, diffs in r["checkpoint", fused_name].items():
            for what, diff in diffs.items():
                assert diff < TOLERANCE, f"rank {rank} ({backend}), load into {plan}: {what} {diff}"
