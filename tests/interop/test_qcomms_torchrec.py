"""dtrec's qcomms against TorchRec's own, on 2 gloo ranks: same weights, batches, config.

TorchRec's ``DistributedModelParallel`` (fbgemm's fp16 codec on its pooled-embedding
all-to-all) and dtrec, given the very same TorchRec ``QCommsConfig(FP16, FP16)`` object
(mapped by ``dtrec.interop.qcomms``), train a table-wise and a column-wise table with
fused SGD and a fixed positive readout as the loss. Both round every value sent once to
fp16 (fbgemm clamps to +-65504 first; nothing here comes near), so their outputs differ
by at most one fp16 rounding of each side's fp32 values: <= 2 u A (u = 2^-11, A = the
output with |weights|), and weights after N steps by <= 2 u |w_N - w_0| (each side within
u |step| of the fp32 step, see tests/distributed/test_qcomms.py), plus 1e-6 for fp32
reassociation between the two libraries' kernels (measured here: bit-identical outputs
and weights; the test asks for >90% identical outputs). Row-wise is left out: TorchRec's
quantized reduce-scatter adds partials in fp16 (dtrec adds them in fp32).

Skipped without torchrec (the ``bench`` extra).
"""

from __future__ import annotations

import pytest

from tests.multiprocess import run_world

pytest.importorskip("torchrec", reason="torchrec (bench extra) not installed")

ROWS, DIM, BATCH, STEPS, LR = (30, 40), 8, 5, 3, 0.5
U = 2.0**-11


def _batch(step: int, rank: int):
    import torch

    gen = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 4, (len(ROWS) * BATCH,), generator=gen)
    per_key = lengths.view(len(ROWS), BATCH).sum(1).tolist()
    values = torch.cat([torch.randint(0, r, (n,), generator=gen) for r, n in zip(ROWS, per_key)])
    return [f"f{i}" for i in range(len(ROWS))], values, lengths


def _train(rank: int, world: int) -> dict:
    import copy

    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fbgemm_qcomm_codec import (
        CommType,
        QCommsConfig,
        get_qcomm_codecs_registry,
    )
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TorchrecKJT

    import dtrec
    from benchmarks.common.torchrec_side import UniformEBCModel

    config = QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.FP16)
    reference = UniformEBCModel(ROWS, DIM)
    initial = {n: t.weight.detach().clone() for n, t in reference.ebc.embedding_bags.items()}
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR},
        qcomm_codecs_registry=get_qcomm_codecs_registry(config, device=torch.device("cpu")),
    )
    generators = {"t0": table_wise(rank=1, compute_kernel="fused"),
                  "t1": column_wise(ranks=[0, 1], compute_kernel="fused")}  # fmt: skip
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
    mine = dtrec.distribute_module(
        copy.deepcopy(reference),
        dtrec.init_mesh("cpu", world),
        {"ebc.t0": dtrec.placements.TableWise(rank=1), "ebc.t1": dtrec.placements.ColumnWise()},
        optimizer=dtrec.optim.SGD(lr=LR),
        qcomms=config,
    )
    readout = 0.5 + torch.rand(
        BATCH, len(ROWS) * DIM, generator=torch.Generator().manual_seed(rank)
    )
    out_ratio = 0.0
    for step in range(STEPS):
        keys, values, lengths = _batch(step, rank)
        out_theirs = theirs(TorchrecKJT(keys=keys, values=values, lengths=lengths)).values()
        out_mine = mine(dtrec.KeyedJaggedTensor(keys, values, lengths)).values()
        if step == 0:
            absolute = copy.deepcopy(reference)
            with torch.no_grad():
                for table in absolute.ebc.embedding_bags.values():
                    table.weight.abs_()
            kjt = TorchrecKJT(keys=keys, values=values, lengths=lengths)
            bound = 2 * U * absolute(kjt).values() + 1e-6
            out_ratio = ((out_mine - out_theirs).abs() / bound).max().item()
            # one partial per column, no sum after the cast back: fp16 values on both sides
            on_fp16_grid = all(torch.equal(o, o.half().float()) for o in (out_mine, out_theirs))
            same = (out_mine == out_theirs).float().mean().item()
        (out_theirs * readout).sum().backward()
        (out_mine * readout).sum().backward()
    full_theirs = dtrec.checkpoint.to_full_state_dict(theirs.state_dict())
    full_mine = dtrec.checkpoint.full_state_dict(mine)
    w_ratio = 0.0
    for name, w0 in initial.items():
        key = f"ebc.embedding_bags.{name}.weight"
        w_theirs = next(v for k, v in full_theirs.items() if k.endswith(key))
        moved = (w_theirs - w0).abs()
        diff = (full_mine[key] - w_theirs).abs()
        w_ratio = max(w_ratio, (diff / (2 * U * moved + 1e-6)).max().item())
    dist.barrier()
    return {
        "out_ratio": out_ratio,
        "w_ratio": w_ratio,
        "moved": moved.max().item(),
        "on_fp16_grid": on_fp16_grid,
        "bitwise_same_outputs": same,
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(2, _train, timeout=300)


def test_outputs_and_weights_match_torchrec_qcomms(results) -> None:
    for rank, r in enumerate(results):
        assert r["moved"] > 0.01, (rank, r)  # training did move the weights
        assert r["on_fp16_grid"], (rank, r)
        assert r["bitwise_same_outputs"] > 0.9, (rank, r)
        assert r["out_ratio"] <= 1.0, (rank, r)
        assert r["w_ratio"] <= 1.0, (rank, r)
