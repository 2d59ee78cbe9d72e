"""The dense part as replicated DTensors (``dtrec/sharded/dense.py``) behaves as DDP did,
against the unsharded model on the global batch: a parameter only some ranks use gets
the average on every rank, one no rank uses keeps ``grad None``, two backwards accumulate,
activation checkpointing re-runs a submodule in backward, buffers come from rank 0, and
every parameter is a DTensor with the unsharded model's state-dict keys."""

from __future__ import annotations

import pytest
from torch import nn

from tests.multiprocess import run_world


class Net(nn.Module):
    def __init__(self) -> None:
        import dtrec

        super().__init__()
        self.sparse = dtrec.EmbeddingBagCollection([dtrec.EmbeddingBagConfig("t", 10, 4, ["f"])])
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.only_rank0 = nn.Linear(4, 1)
        self.unused = nn.Linear(4, 1)
        self.head = nn.Linear(4, 1)
        self.register_buffer("scale", None)

    def forward(self, kjt, rank: int, checkpointed: bool = False):
        import torch.utils.checkpoint

        x = self.sparse(kjt).values()
        h = (
            torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
            if (checkpointed)
            else self.block(x)
        )
        y = self.head(h).squeeze(1) * self.scale
        return y + (self.only_rank0(h).squeeze(1) if rank == 0 else 0)


def _run(rank: int, world: int) -> dict:
    import copy

    import torch
    from torch.distributed.tensor import DTensor

    import dtrec
    from dtrec.placements import RowWise

    torch.manual_seed(0)
    ref = Net()
    ref.scale = torch.tensor(2.0)
    local = copy.deepcopy(ref)
    local.scale = torch.tensor(2.0 + rank)  # rank 0's buffer must win
    model = dtrec.distribute_module(local, dtrec.init_mesh("cpu", world), {"sparse.t": RowWise()})

    def batch(r: int, s: int):
        gen = torch.Generator().manual_seed(10 * s + r)
        lengths = torch.randint(1, 3, (3,), generator=gen)
        kjt = dtrec.KeyedJaggedTensor(
            ["f"], torch.randint(0, 10, (int(lengths.sum()),), generator=gen), lengths
        )
        return kjt, torch.randn(3, generator=gen)

    for step in range(2):  # two backwards, no zero_grad: gradients accumulate
        kjt, y = batch(rank, step)
        ((model(kjt, rank, checkpointed=step == 1) - y) ** 2).mean().backward()
        losses = [((ref(*batch(r, step)[:1], r, step == 1) - batch(r, step)[1]) ** 2).mean()
                  for r in range(world)]  # fmt: skip
        torch.stack(losses).mean().backward()
    full = {n: p for n, p in model.named_parameters()}
    diffs = {}
    for name, p in ref.named_parameters():
        got = full[name].grad
        if p.grad is None or got is None:
            diffs[name] = (p.grad is None, got is None)
            continue
        got = dtrec.checkpoint.full_tensor(got)
        diffs[name] = (got - p.grad).abs().max().item()
    return {
        "diffs": diffs,
        "all_dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
        "keys": sorted(model.state_dict()) == sorted(ref.state_dict()),
        "scale": model.scale.item(),
    }


def _hooks_and_zeroing(rank: int, world: int) -> dict:
    """A user's hook on a dense parameter runs (its gradient then arrives through the
    parameter's own ``to_local``) with the same gradients; ``zero_grad(set_to_none=False)``
    zeroes in place and the next backward starts from zero; a gradient a user replaced
    is accumulated into."""
    import copy

    import torch

    import dtrec
    from dtrec.placements import RowWise

    torch.manual_seed(0)
    ref = Net()
    ref.scale = torch.tensor(2.0)
    model = dtrec.distribute_module(
        copy.deepcopy(ref), dtrec.init_mesh("cpu", world), {"sparse.t": RowWise()}
    )
    params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    seen: list[tuple[int, ...]] = []
    params["head.weight"].register_hook(lambda g: seen.append(tuple(g.shape)))
    dense = [n for n in ref_params if not n.startswith(("sparse.", "unused.", "only_rank0."))]

    def step(s: int) -> None:
        gen = torch.Generator().manual_seed(s)
        lengths = torch.randint(1, 3, (3 * world,), generator=gen)
        values = torch.randint(0, 10, (int(lengths.sum()),), generator=gen)
        y = torch.randn(3 * world, generator=gen)
        mine = slice(3 * rank, 3 * rank + 3)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        kjt = dtrec.KeyedJaggedTensor(["f"], values[starts[3 * rank] : starts[3 * rank + 3]],
                                      lengths[mine])  # fmt: skip
        ((model(kjt, 1) - y[mine]) ** 2).mean().backward()
        full = dtrec.KeyedJaggedTensor(["f"], values, lengths)
        ((ref(full, 1) - y) ** 2).mean().backward()

    def worst() -> float:
        return max(
            (dtrec.checkpoint.full_tensor(params[n].grad) - ref_params[n].grad).abs().max().item()
            for n in dense
        )

    out = {}
    step(0)
    out["hooked"] = (worst(), len(seen))
    for m in (model, ref):
        for p in m.parameters():
            if p.grad is not None:
                p.grad.zero_()  # zero_grad(set_to_none=False)
    step(1)
    out["zeroed in place"] = worst()
    for n in dense:  # a user-set gradient (same values, new tensors) is accumulated into
        params[n].grad = params[n].grad.clone()
    step(2)
    out["replaced then accumulated"] = worst()
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["W1", "W2"])
def results(request) -> list[dict]:
    return run_world(request.param, _run, timeout=300)


@pytest.mark.parametrize("world", [1, 2])
def test_hooks_zeroing_and_replaced_gradients(world: int) -> None:
    for rank, r in enumerate(run_world(world, _hooks_and_zeroing, timeout=300)):
        assert r["hooked"][0] < 1e-6 and r["hooked"][1] == 1, (rank, r)
        assert r["zeroed in place"] < 1e-6, (rank, r)
        assert r["replaced then accumulated"] < 1e-6, (rank, r)


def test_dense_gradients_like_the_unsharded_model(results) -> None:
    for rank, r in enumerate(results):
        assert r["all_dtensors"] and r["keys"], rank
        assert r["scale"] == 2.0, rank
        for name, diff in r["diffs"].items():
            if name.startswith("unused."):
                assert diff == (True, True), (rank, name, diff)  # None everywhere
            else:
                assert isinstance(diff, float) and diff < 1e-6, (rank, name, diff)
