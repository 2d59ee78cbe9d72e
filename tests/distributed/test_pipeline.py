"""dtrec.TrainPipeline: the pipelined loop trains exactly like the plain loop.

Two copies of one model train on the same batches, one with a plain loop, one through
the pipeline (input-dist of batch i + 1 in flight during batch i): losses and every
weight must be equal bit for bit, and each batch's input-dist runs once, ahead of its
forward.
"""

from __future__ import annotations

import pytest

from tests.multiprocess import run_world

WORLD = 4
# (shards, fused optimizer, per-sample weights)
CASES = [(2, "rowwise_adagrad", False), (2, None, True), (4, "adam", False)]


def _train(rank: int, shards: int, fused_name: str | None, weighted: bool) -> dict:
    import copy

    import torch

    import dtrec
    from dtrec.sharded.module import ShardedEmbeddingBagCollection
    from tests.distributed.numerics import PLANS, TinyModel, make_batch, make_tables

    mesh = dtrec.init_mesh("cpu", shards)
    tables = make_tables(weighted)
    torch.manual_seed(0)
    model = TinyModel(tables)
    plan = {f"sparse.{k}": v for k, v in PLANS["mixed"].items()}
    fused = {
        None: None,
        "rowwise_adagrad": dtrec.optim.RowWiseAdagrad(lr=0.1),
        "adam": dtrec.optim.Adam(lr=0.05),
    }[fused_name]
    plain = dtrec.distribute_module(copy.deepcopy(model), mesh, plan, optimizer=fused)
    piped = dtrec.distribute_module(copy.deepcopy(model), mesh, plan, optimizer=fused)
    gen = torch.Generator().manual_seed(10 + rank)
    batches = [make_batch(tables, 3, weighted, gen) for _ in range(5)]

    def loss_fn(m, batch):
        kjt, target = batch
        return ((m(kjt) - target) ** 2).mean()

    plain_opt = torch.optim.SGD([p for p in plain.parameters() if p.requires_grad], lr=0.5)
    plain_losses = []
    for batch in batches:
        loss = loss_fn(plain, batch)
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        plain_losses.append(loss.item())

    calls = []
    original = ShardedEmbeddingBagCollection.input_dist

    def counted(self, features):
        calls.append(id(features))
        return original(self, features)

    ShardedEmbeddingBagCollection.input_dist = counted
    try:
        opt = torch.optim.SGD([p for p in piped.parameters() if p.requires_grad], lr=0.5)
        pipeline = dtrec.TrainPipeline(piped, opt, loss_fn)
        piped_losses = [loss.item() for loss in pipeline.run(batches)]
    finally:
        ShardedEmbeddingBagCollection.input_dist = original
    local = [p.to_local() if hasattr(p, "to_local") else p for p in plain.parameters()]
    other = [p.to_local() if hasattr(p, "to_local") else p for p in piped.parameters()]
    diffs = [float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(local, other)]
    return {
        "losses": (plain_losses, piped_losses),
        "max_param_diff": max(diffs),
        "input_dists": calls == [id(kjt) for kjt, _ in batches],
    }


def _wrong_object(rank: int) -> dict:
    import torch

    import dtrec
    from tests.distributed.numerics import PLANS, TinyModel, make_batch, make_tables
    from tests.multiprocess import error_of

    tables = make_tables(False)
    model = dtrec.distribute_module(
        TinyModel(tables), dtrec.init_mesh("cpu", 2),
        {f"sparse.{k}": v for k, v in PLANS["mixed"].items()},
    )  # fmt: skip
    batches = [make_batch(tables, 3, False, torch.Generator().manual_seed(rank)) for _ in range(2)]

    def copying(m, b):
        return m(dtrec.KeyedJaggedTensor(b[0].keys(), b[0].values(), b[0].lengths())).sum()

    named = dtrec.TrainPipeline(model, None, copying, sparse_features=lambda b: b[0])
    found = dtrec.TrainPipeline(model, None, copying)  # by forward inputs: not in the batch
    return {
        "named": error_of(lambda: list(named.run(batches))),
        "found": error_of(lambda: list(found.run(batches))),
    }


def _two_collections(rank: int) -> dict:
    """TorchRec's progress() on a dict batch feeding two collections, found by their
    forward inputs (no sparse_features): bit-identical to the plain loop; batches 2.. are
    prefetched (batch 1 is where the places are found), each from its own key."""
    import copy

    import torch

    import dtrec
    from dtrec.placements import ColumnWise, RowWise
    from dtrec.sharded.collection import ShardedCollection

    class TwoTowers(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            cfg = dtrec.EmbeddingBagConfig
            self.user = dtrec.EmbeddingBagCollection([cfg("u", 30, 4, ["fu"])])
            self.item = dtrec.EmbeddingBagCollection([cfg("i", 20, 6, ["fi"])])
            self.head = torch.nn.Linear(10, 1)

        def forward(self, batch):
            pooled = torch.cat([self.user(batch["user"]).values(),
                                self.item(batch["item"]).values()], 1)  # fmt: skip
            out = self.head(pooled).squeeze(1)
            return ((out - batch["y"]) ** 2).mean(), out.detach()

    mesh = dtrec.init_mesh("cpu", 2)
    plan = {"user.u": RowWise(), "item.i": ColumnWise()}
    torch.manual_seed(0)
    model = TwoTowers()
    plain = dtrec.distribute_module(copy.deepcopy(model), mesh, plan,
                                    optimizer=dtrec.optim.RowWiseAdagrad(lr=0.1))  # fmt: skip
    piped = dtrec.distribute_module(copy.deepcopy(model), mesh, plan,
                                    optimizer=dtrec.optim.RowWiseAdagrad(lr=0.1))  # fmt: skip
    gen = torch.Generator().manual_seed(rank)
    batches = []
    for _ in range(4):
        lu, li = torch.randint(0, 3, (3,), generator=gen), torch.randint(0, 3, (3,), generator=gen)
        user = dtrec.KeyedJaggedTensor(
            ["fu"], torch.randint(0, 30, (int(lu.sum()),), generator=gen), lu
        )
        item = dtrec.KeyedJaggedTensor(
            ["fi"], torch.randint(0, 20, (int(li.sum()),), generator=gen), li
        )
        batches.append({"user": user, "item": item, "y": torch.randn(3, generator=gen)})
    opt = torch.optim.SGD(plain.head.parameters(), lr=0.1)
    plain_out = []
    for batch in batches:
        loss, out = plain(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        plain_out.append(out)

    prefetched = []
    original = ShardedCollection.prefetch

    def counted(self, features):
        prefetched.append(id(features))
        return original(self, features)

    ShardedCollection.prefetch = counted
    try:
        pipeline = dtrec.TrainPipeline(piped, torch.optim.SGD(piped.head.parameters(), lr=0.1))
        it = iter(batches)
        piped_out = [pipeline.progress(it) for _ in batches]
        try:
            pipeline.progress(it)
            stopped = False
        except StopIteration:
            stopped = True
    finally:
        ShardedCollection.prefetch = original
    want = [id(b[k]) for b in batches[1:] for k in ("user", "item")]
    params = zip(plain.parameters(), piped.parameters(), strict=True)
    return {
        "outputs_equal": all(torch.equal(a, b) for a, b in zip(plain_out, piped_out)),
        "params_equal": all(
            torch.equal(*(t.to_local() if hasattr(t, "to_local") else t for t in pair))
            for pair in params
        ),
        "prefetched": prefetched == want,
        "found": pipeline.describe(),
        "stopped": stopped,
    }


def _run(rank: int, world: int) -> dict:
    out = {case: _train(rank, *case) for case in CASES}
    out["wrong_object"] = _wrong_object(rank)
    out["two_collections"] = _two_collections(rank)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(WORLD, _run, timeout=300)


@pytest.mark.parametrize(
    "case", CASES, ids=[f"S{s}-{f}-{'psw' if w else 'plain'}" for s, f, w in CASES]
)
def test_pipeline_matches_plain_loop(results, case) -> None:
    for rank, r in enumerate(results):
        plain, piped = r[case]["losses"]
        assert plain == piped, (rank, plain, piped)
        assert r[case]["max_param_diff"] == 0.0, (rank, r[case]["max_param_diff"])
        assert r[case]["input_dists"], rank  # one input-dist per batch, in batch order


def test_pipeline_rejects_a_loss_fn_that_bypasses_the_prefetch(results) -> None:
    for r in results:
        named, found = r["wrong_object"]["named"], r["wrong_object"]["found"]
        assert named.startswith("RuntimeError") and "prefetched" in named, named
        assert found.startswith("TypeError: TrainPipeline cannot find the features"), found


def test_progress_finds_each_collections_features_by_its_forward_input(results) -> None:
    for rank, r in enumerate(results):
        got = r["two_collections"]
        assert got["found"] == {"user": "batch['user']", "item": "batch['item']"}, got
        assert got["outputs_equal"] and got["params_equal"], (rank, got)
        assert got["prefetched"], (rank, got)  # batches 2.., both collections, in order
        assert got["stopped"], got  # StopIteration once the batches ran out
