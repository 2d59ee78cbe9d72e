"""Uneven and empty local batches against TorchRec's own DMP, on 2 gloo ranks.

TorchRec's ``DistributedModelParallel`` accepts local batches of different sizes (the
last batch of a ``drop_last=False`` loop), 0 included. Given the same weights and the
same per-rank batches (3 vs 5, 0 vs 3, 4 vs 0, 0 vs 0, 2 vs 1), dtrec must return the
same pooled rows on every rank (``(0, D)`` for an empty batch) and train its table-wise
and column-wise tables to the same weights with the same fused optimizer (exact SGD,
exact row-wise Adagrad; a fixed readout per rank as the loss, gradients divided by the
world size on both sides: TorchRec's ``GRADIENT_DIVISION``); row-wise tables are compared
in forward (see ``CASES``). Measured here: bit-identical outputs and weights (the test
asks for 1e-6).

Skipped without torchrec (the ``bench`` extra).
"""

from __future__ import annotations

import pytest

from tests.multiprocess import run_world

pytest.importorskip("torchrec", reason="torchrec (bench extra) not installed")

ROWS, DIM = (30, 40, 50), 8
SIZES = [(3, 5), (0, 3), (4, 0), (0, 0), (2, 1)]  # per step: (rank 0, rank 1)
TOLERANCE = 1e-6
OPTIMIZERS = {"sgd": 0.5, "rowwise_adagrad": 0.1}  # learning rates
# name: (fused optimizer, a spec per table, train). TorchRec's column-wise row-wise
# Adagrad keeps one accumulator per column shard (dtrec's is exact: ANCHORS.md), so
# Adagrad runs on table-wise tables only. TorchRec's row-wise backward fails on gloo with
# uneven batches (its reduce-scatter-v backward all-gathers [B_r, D] gradients, and gloo's
# allgather needs equal sizes), so row-wise compares the forward of every step.
CASES = {
    "tw_cw_sgd": ("sgd", ("tw1", "cw", "tw0"), True),
    "tw_rowwise_adagrad": ("rowwise_adagrad", ("tw1", "tw0", "tw1"), True),
    "rw_forward": ("sgd", ("rw", "rw", "rw"), False),
}


def _batch(step: int, rank: int, batch: int):
    import torch

    gen = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 4, (len(ROWS) * batch,), generator=gen)
    per_key = lengths.view(len(ROWS), batch).sum(1).tolist()
    values = torch.cat([torch.randint(0, r, (n,), generator=gen) for r, n in zip(ROWS, per_key)])
    return [f"f{i}" for i in range(len(ROWS))], values, lengths


def _train(rank: int, world: int, optimizer: str, kinds: tuple[str, ...], train: bool) -> dict:
    import copy

    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TorchrecKJT

    import dtrec
    from benchmarks.common.torchrec_side import UniformEBCModel
    from dtrec.placements import ColumnWise, RowWise, TableWise

    lr = OPTIMIZERS[optimizer]
    reference = UniformEBCModel(ROWS, DIM)
    rule = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": rule[optimizer], "learning_rate": lr, "eps": 1e-8}
    )
    helpers = {"tw0": table_wise(rank=0, compute_kernel="fused"),
               "tw1": table_wise(rank=1, compute_kernel="fused"),
               "rw": row_wise(compute_kernel="fused"),
               "cw": column_wise(ranks=[0, 1], compute_kernel="fused")}  # fmt: skip
    generators = {f"t{i}": helpers[kind] for i, kind in enumerate(kinds)}
    module_plan = construct_module_sharding_plan(
        reference.ebc, generators, sharder=sharder, local_size=world, world_size=world,
        device_type="cpu",
    )  # fmt: skip
    theirs = DistributedModelParallel(
        copy.deepcopy(reference),
        device=torch.device("cpu"),
        plan=ShardingPlan({"ebc": module_plan}),
        sharders=[sharder],
    )
    for key, value in theirs.state_dict().items():  # DMP's tables start from their own init
        full = reference.state_dict()[key.removeprefix("module.")]
        for shard in value.local_shards():
            rows, cols = shard.metadata.shard_offsets
            height, width = shard.metadata.shard_sizes
            shard.tensor.copy_(full[rows : rows + height, cols : cols + width])
    specs = {"tw0": TableWise(rank=0), "tw1": TableWise(rank=1), "rw": RowWise(),
             "cw": ColumnWise()}  # fmt: skip
    fused = {"sgd": dtrec.optim.SGD(lr=lr), "rowwise_adagrad": dtrec.optim.RowWiseAdagrad(
        lr=lr, eps=1e-8)}[optimizer]  # fmt: skip
    mine = dtrec.distribute_module(
        copy.deepcopy(reference),
        dtrec.init_mesh("cpu", world),
        {f"ebc.t{i}": specs[kind] for i, kind in enumerate(kinds)},
        optimizer=fused,
    )

    def rows(out) -> torch.Tensor:  # TorchRec's sharded output groups keys by sharding type
        return torch.cat([out.to_dict()[key] for key in keys], dim=1)

    out_diff, shapes = 0.0, []
    for step, sizes in enumerate(SIZES):
        keys, values, lengths = _batch(step, rank, sizes[rank])
        with torch.set_grad_enabled(train):
            out_theirs = rows(theirs(TorchrecKJT(keys=keys, values=values, lengths=lengths)))
            out_mine = rows(mine(dtrec.KeyedJaggedTensor(keys, values, lengths)))
        shapes.append((tuple(out_mine.shape), tuple(out_theirs.shape)))
        if out_mine.numel():
            out_diff = max(out_diff, (out_mine - out_theirs).abs().max().item())
        if train:
            gen = torch.Generator().manual_seed(rank)
            readout = 0.5 + torch.rand(out_mine.shape, generator=gen)
            (out_theirs * readout).sum().backward()
            (out_mine * readout).sum().backward()
    full_theirs = dtrec.checkpoint.to_full_state_dict(theirs.state_dict())
    full_mine = dtrec.checkpoint.full_state_dict(mine)
    weight_diff, moved = 0.0, 0.0
    for name in ("t0", "t1", "t2"):
        key = f"ebc.embedding_bags.{name}.weight"
        w_theirs = next(v for k, v in full_theirs.items() if k.endswith(key))
        weight_diff = max(weight_diff, (full_mine[key] - w_theirs).abs().max().item())
        moved = max(moved, (w_theirs - reference.state_dict()[key]).abs().max().item())
    dist.barrier()
    return {"out_diff": out_diff, "weight_diff": weight_diff, "moved": moved, "shapes": shapes}


def _run(rank: int, world: int) -> dict:
    return {name: _train(rank, world, *case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(2, _run, timeout=300)


@pytest.mark.parametrize("case", list(CASES))
def test_uneven_batches_match_torchrec_dmp(results, case: str) -> None:
    train = CASES[case][2]
    for rank, per_rank in enumerate(results):
        r = per_rank[case]
        want = [((sizes[rank], len(ROWS) * DIM),) * 2 for sizes in SIZES]
        assert r["shapes"] == want, (rank, r["shapes"])  # (0, D) rows for an empty batch
        assert r["out_diff"] <= TOLERANCE, (rank, r)
        if train:
            assert r["moved"] > 0.01, (rank, r)  # training did move the weights
            assert r["weight_diff"] <= TOLERANCE, (rank, r)
