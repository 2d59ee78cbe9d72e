"""TorchRec's pipeline recipe against dtrec's, on the same model and batches.

TorchRec's ``TrainPipelineSparseDist(model, optimizer, device).progress(dataloader_iter)``
trains a ``DistributedModelParallel`` DLRM whose forward takes a TorchRec ``Batch`` and
returns ``(loss, logits)``; ``dtrec.TrainPipeline(model, optimizer).progress(...)`` trains
the same model distributed by dtrec (same initial weights, same in-backward recipe, the
same per-rank batches). Each step's output, the number of steps before ``StopIteration``
and the final weights must be TorchRec's. TorchRec's own pipeline given the dtrec model
is refused at its first ``progress`` (the earliest: its constructor does not touch the
model) with an error naming ``dtrec.TrainPipeline``. 4 gloo ranks.
"""

from __future__ import annotations

import pytest

from tests.interop.torchrec_or_skip import torchrec
from tests.multiprocess import run_world

pytestmark = pytest.mark.skipif(torchrec is None, reason="torchrec (bench extra) not installed")

WORLD = 4
STEPS = 5
ROWS = [40, 10, 23, 8]


def _model():
    import torch
    import torchrec
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec.models.dlrm import DLRM
    from torchrec.optim import RowWiseAdagrad

    class Train(torch.nn.Module):
        """TorchRec's pipeline convention: forward(batch) -> (loss, output)."""

        def __init__(self) -> None:
            super().__init__()
            configs = [
                torchrec.EmbeddingBagConfig(
                    name=f"t{i}", num_embeddings=rows, embedding_dim=8, feature_names=[f"f{i}"]
                )
                for i, rows in enumerate(ROWS)
            ]
            self.model = DLRM(
                embedding_bag_collection=torchrec.EmbeddingBagCollection(configs),
                dense_in_features=5,
                dense_arch_layer_sizes=[8, 8],
                over_arch_layer_sizes=[8, 1],
            )

        def forward(self, batch):
            logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
            return loss, logits.detach()

    torch.manual_seed(0)
    train = Train()
    _apply_optimizer_in_backward(RowWiseAdagrad, train.model.sparse_arch.parameters(), {"lr": 0.1})
    return train


def _plan(model):
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.types import ShardingPlan

    ebc = model.model.sparse_arch.embedding_bag_collection
    module_plan = sp.construct_module_sharding_plan(
        ebc,
        {
            "t0": sp.row_wise(),
            "t1": sp.table_wise(rank=3),
            "t2": sp.row_wise(),
            "t3": sp.table_wise(rank=0),
        },  # fmt: skip
        world_size=WORLD,
        local_size=WORLD,
        device_type="cpu",
    )
    return ShardingPlan({"model.sparse_arch.embedding_bag_collection": module_plan})


def _batches(rank: int) -> list:
    import torch
    import torchrec
    from torchrec.datasets.utils import Batch

    out = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        batch = 4
        lengths = torch.randint(0, 4, (len(ROWS) * batch,), generator=gen)
        bounds = torch.tensor(ROWS).repeat_interleave(batch).repeat_interleave(lengths)
        values = (torch.rand(int(lengths.sum()), generator=gen) * bounds).long()
        kjt = torchrec.KeyedJaggedTensor(
            keys=[f"f{i}" for i in range(len(ROWS))], values=values, lengths=lengths
        )
        dense = torch.randn(batch, 5, generator=gen)
        labels = torch.randint(0, 2, (batch,), generator=gen).float()
        out.append(Batch(dense_features=dense, sparse_features=kjt, labels=labels))
    return out


def _dense_optimizer(model):
    import torch
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    return KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=0.05),
    )


def _drain(pipeline, batches) -> list:
    """progress() until StopIteration, as TorchRec's training loops do."""
    it = iter(batches)
    outputs = []
    while True:
        try:
            outputs.append(pipeline.progress(it).clone())
        except StopIteration:
            return outputs


def _check(rank: int, world: int) -> dict:
    import torch
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    import dtrec
    from tests.multiprocess import error_of

    cpu = torch.device("cpu")
    theirs = _model()
    theirs = DistributedModelParallel(theirs, device=cpu, plan=_plan(theirs))
    initial = theirs.state_dict()
    mine = _model()
    mine = dtrec.distribute_module(mine, dtrec.init_mesh("cpu", WORLD), _plan(mine).plan)
    mine.load_state_dict(initial)  # DMP made its own tables

    refused = TrainPipelineSparseDist(mine, _dense_optimizer(mine), cpu)  # constructs
    refusal = error_of(lambda: refused.progress(iter(_batches(rank))))

    their_outputs = _drain(TrainPipelineSparseDist(theirs, _dense_optimizer(theirs), cpu),
                           _batches(rank))  # fmt: skip
    pipeline = dtrec.TrainPipeline(mine, _dense_optimizer(mine))
    my_outputs = _drain(pipeline, _batches(rank))
    want = dtrec.checkpoint.to_full_state_dict(theirs.state_dict())
    got = dtrec.checkpoint.full_state_dict(mine)
    return {
        "steps": (len(their_outputs), len(my_outputs)),
        "outputs": max((a - b).abs().max().item() for a, b in zip(their_outputs, my_outputs)),
        "weights": max((want[k] - got[k]).abs().max().item() for k in want),
        "keys": sorted(want) == sorted(got),
        "found": pipeline.describe(),
        "refusal": refusal,
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(WORLD, _check, timeout=600)


def test_progress_trains_like_torchrec_pipeline(results) -> None:
    for rank, got in enumerate(results):
        assert got["steps"] == (STEPS, STEPS), (rank, got)
        assert got["keys"], rank
        assert got["outputs"] < 1e-5 and got["weights"] < 1e-5, (rank, got)
        assert got["found"] == {
            "model.sparse_arch.embedding_bag_collection": "batch.sparse_features"
        }, got["found"]


def test_torchrec_pipeline_on_a_dtrec_model_is_refused(results) -> None:
    for got in results:
        assert got["refusal"].startswith("TypeError: dtrec's ShardedEmbeddingBagCollection got"), (
            got
        )
        assert "use dtrec.TrainPipeline(model, optimizer)" in got["refusal"], got
