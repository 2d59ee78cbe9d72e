"""dtrec.TrainPipeline prefetches sequence collections too: a model with an
EmbeddingBagCollection and an EmbeddingCollection trains through the pipeline exactly
like the plain loop (losses and every weight bit for bit), on a 1D and a 2D mesh, with
each collection on a mesh of its own (``distribute_module(..., meshes=)``), and with
``sync_every`` replica averages overlapped with the next step; each collection runs each
batch's input-dist once, ahead of its forward.
"""

from __future__ import annotations

import pytest

from tests.multiprocess import run_world

WORLD = 4
# (shards, fused optimizer, sync_every): S=4 is the 1D mesh, S=2 the 2x2 one; a pair is
# (the bag collection's S, the sequence collection's S), each on its own mesh
CASES = [
    (4, None, None), (4, "rowwise_adagrad", None), (2, None, None), (2, "adam", None),
    ((2, 4), "rowwise_adagrad", None), ((4, 1), None, None), ((2, 1), "rowwise_adagrad", 2),
]  # fmt: skip


def _model(bag_tables, seq_tables):
    import torch
    from torch import nn

    import dtrec

    class BagsAndSequences(nn.Module):
        """Pooled features -> a linear head; sequence rows -> a squared loss term."""

        def __init__(self) -> None:
            super().__init__()
            self.bags = dtrec.EmbeddingBagCollection(bag_tables)
            self.seq = dtrec.EmbeddingCollection(seq_tables)
            width = sum(t.embedding_dim * len(t.feature_names) for t in bag_tables)
            self.dense = nn.Linear(width, 1)

        def forward(self, bags, seq) -> torch.Tensor:
            from tests.sequence.numerics import loss_of

            return self.dense(self.bags(bags).values()).squeeze(1), loss_of(self.seq(seq))

    return BagsAndSequences()


def _train(
    rank: int, shards: int | tuple[int, int], fused_name: str | None, sync_every: int | None
) -> dict:
    import copy

    import torch

    import dtrec
    from dtrec.sharded.module import ShardedEmbeddingBagCollection
    from dtrec.sharded.sequence import ShardedEmbeddingCollection
    from tests.distributed import numerics as bag_numerics
    from tests.sequence import numerics as seq_numerics

    bag_shards, seq_shards = shards if isinstance(shards, tuple) else (shards, shards)
    mesh = dtrec.init_mesh("cpu", bag_shards)
    seq_mesh = mesh if seq_shards == bag_shards else dtrec.init_mesh("cpu", seq_shards)
    meshes = {"seq": seq_mesh} if seq_mesh is not mesh else None
    bag_tables = bag_numerics.make_tables(False)
    seq_tables = seq_numerics.make_tables()
    torch.manual_seed(0)
    model = _model(bag_tables, seq_tables)
    plan = {f"bags.{k}": v for k, v in bag_numerics.PLANS["mixed"].items()}
    plan.update({f"seq.{k}": v for k, v in seq_numerics.plans(seq_mesh)["mixed"].items()})
    fused = {
        None: None,
        "rowwise_adagrad": dtrec.optim.RowWiseAdagrad(lr=0.1),
        "adam": dtrec.optim.Adam(lr=0.05),
    }[fused_name]
    plain, piped = (
        dtrec.distribute_module(copy.deepcopy(model), mesh, plan, optimizer=fused,
                                sync_every=sync_every, meshes=meshes)
        for _ in range(2)
    )  # fmt: skip
    gen = torch.Generator().manual_seed(10 + rank)
    batches = []
    for _ in range(5):
        bags, target = bag_numerics.make_batch(bag_tables, 3, False, gen)
        batches.append((bags, seq_numerics.make_batch(3, gen), target))

    def loss_fn(m, batch):
        bags, seq, target = batch
        pooled, seq_loss = m(bags, seq)
        return ((pooled - target) ** 2).mean() + 0.01 * seq_loss

    def features(batch):
        return {"bags": batch[0], "seq": batch[1]}

    plain_opt = torch.optim.SGD([p for p in plain.parameters() if p.requires_grad], lr=0.5)
    plain_losses = []
    for batch in batches:
        loss = loss_fn(plain, batch)
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        plain_losses.append(loss.item())

    calls: dict[str, list[int]] = {"bags": [], "seq": []}
    bag_dist, seq_start = (
        ShardedEmbeddingBagCollection.input_dist,
        ShardedEmbeddingCollection._start,
    )

    def counted_bags(self, features):
        calls["bags"].append(id(features))
        return bag_dist(self, features)

    def counted_seq(self, features):
        calls["seq"].append(id(features))
        return seq_start(self, features)

    ShardedEmbeddingBagCollection.input_dist = counted_bags
    ShardedEmbeddingCollection._start = counted_seq
    try:
        opt = torch.optim.SGD([p for p in piped.parameters() if p.requires_grad], lr=0.5)
        pipeline = dtrec.TrainPipeline(piped, opt, loss_fn, sparse_features=features)
        piped_losses = [loss.item() for loss in pipeline.run(batches)]
    finally:
        ShardedEmbeddingBagCollection.input_dist = bag_dist
        ShardedEmbeddingCollection._start = seq_start
    if sync_every is not None:  # the averages still in flight land
        for model in (plain, piped):
            model.bags.sync_replicas()
            model.seq.sync_replicas()
    local = [p.to_local() if hasattr(p, "to_local") else p for p in plain.parameters()]
    other = [p.to_local() if hasattr(p, "to_local") else p for p in piped.parameters()]
    diffs = [float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(local, other)]
    return {
        "losses": (plain_losses, piped_losses),
        "max_param_diff": max(diffs),
        "collections": sorted(pipeline.collections),
        "input_dists": calls
        == {"bags": [id(b[0]) for b in batches], "seq": [id(b[1]) for b in batches]},
    }


def _wrong_object(rank: int) -> str:
    """A loss_fn that copies the sequence KJT bypasses its prefetch: a RuntimeError."""
    import torch

    import dtrec
    from tests.multiprocess import error_of
    from tests.sequence import numerics as seq_numerics

    mesh = dtrec.init_mesh("cpu", 2)
    model = torch.nn.Module()
    model.seq = dtrec.EmbeddingCollection(seq_numerics.make_tables())
    plan = {f"seq.{k}": v for k, v in seq_numerics.plans(mesh)["mixed"].items()}
    model = dtrec.distribute_module(model, mesh, plan)
    gen = torch.Generator().manual_seed(rank)
    batches = [seq_numerics.make_batch(3, gen) for _ in range(2)]

    def copying(m, kjt):
        again = dtrec.KeyedJaggedTensor(kjt.keys(), kjt.values(), kjt.lengths())
        return seq_numerics.loss_of(m.seq(again))

    pipeline = dtrec.TrainPipeline(model, None, copying, sparse_features=lambda kjt: kjt)
    return error_of(lambda: list(pipeline.run(batches)))


def _run(rank: int, world: int) -> dict:
    out = {case: _train(rank, *case) for case in CASES}
    out["wrong_object"] = _wrong_object(rank)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(WORLD, _run, timeout=300)


@pytest.mark.parametrize("case", CASES, ids=[f"S{s}-{f or 'torch_sgd'}-k{k}" for s, f, k in CASES])
def test_pipeline_with_a_sequence_collection_matches_plain_loop(results, case) -> None:
    for rank, r in enumerate(results):
        plain, piped = r[case]["losses"]
        assert r[case]["collections"] == ["bags", "seq"], rank  # both are prefetched
        assert plain == piped, (rank, plain, piped)
        assert r[case]["max_param_diff"] == 0.0, (rank, r[case]["max_param_diff"])
        assert r[case]["input_dists"], rank  # one input-dist per batch per collection, in order


def test_pipeline_rejects_a_loss_fn_that_bypasses_a_sequence_prefetch(results) -> None:
    for r in results:
        assert r["wrong_object"].startswith("RuntimeError") and "prefetched" in r["wrong_object"]
