"""A backward that raises after a fused lookup stashed its gradient (before the end-of-
backward update) must not leave that stash behind: the failed step updates no table,
warns, and the next good step updates exactly as a fresh one would."""

from __future__ import annotations

from tests.multiprocess import run_world


def _run(rank: int, world: int) -> dict:
    import copy
    import warnings

    import torch

    import dtrec

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("boom in backward")

    torch.manual_seed(0)
    ebc = dtrec.EmbeddingBagCollection([dtrec.EmbeddingBagConfig("t", 10, 4, ["f"])])
    reference = copy.deepcopy(ebc)
    model = dtrec.distribute_module(
        ebc, dtrec.init_mesh("cpu", 1), {"t": dtrec.placements.RowWise()},
        optimizer=dtrec.optim.SGD(lr=0.5),
    )  # fmt: skip
    kjt = dtrec.KeyedJaggedTensor(["f"], torch.tensor([1, 3, 3]), torch.tensor([2, 1]))
    before = dtrec.checkpoint.full_state_dict(model)["embedding_bags.t.weight"]

    leaf = torch.ones(1, requires_grad=True)
    early = Boom.apply(leaf)  # created first: its backward runs after the lookup's stash
    loss = model(kjt).values().sum() + early.sum()
    failed = ""
    try:
        loss.backward()
    except RuntimeError as exc:
        failed = str(exc)
    after_failure = dtrec.checkpoint.full_state_dict(model)["embedding_bags.t.weight"]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(kjt).values().sum().backward()
    after_good = dtrec.checkpoint.full_state_dict(model)["embedding_bags.t.weight"]
    reference(kjt).values().sum().backward()
    with torch.no_grad():
        want = (
            reference.embedding_bags["t"].weight - 0.5 * reference.embedding_bags["t"].weight.grad
        )
    return {
        "failed": failed,
        "unchanged_by_failure": bool(torch.equal(after_failure, before)),
        "good_step_err": (after_good - want).abs().max().item(),
        "warned": any(
            "stopped before its fused embedding update" in str(w.message) for w in caught
        ),
    }


def test_failed_backward_updates_nothing_and_the_next_step_updates_normally() -> None:
    (r,) = run_world(1, _run, timeout=120)
    assert "boom in backward" in r["failed"]
    assert r["unchanged_by_failure"]
    assert r["warned"]
    assert r["good_step_err"] < 1e-6, r
