"""``copy.deepcopy`` of a distributed model: the copy trains on its own and equals the
original trained the same way. On main at 57977ad it raised "DDP does not support
deepcopy" (and a sharded collection alone could not be copied: process groups)."""

from __future__ import annotations

import pytest

from tests.multiprocess import run_world

CASES = ("torch_sgd", "torch_adam_foreach", "fused_rowwise_adagrad", "collection_only")


def _run(rank: int, world: int) -> dict[str, dict]:
    import copy

    import torch

    import dtrec
    from dtrec.checkpoint import full_state_dict, full_tensor
    from tests.distributed.numerics import PLANS, TinyModel, make_batch, make_tables

    tables = make_tables(False)
    mesh = dtrec.init_mesh("cpu", 2)
    plan = {f"sparse.{k}": v for k, v in PLANS["mixed"].items()}
    out = {}
    for case in CASES:
        torch.manual_seed(0)
        fused = dtrec.optim.RowWiseAdagrad(lr=0.1) if case.startswith("fused") else None
        if case == "collection_only":
            model = dtrec.distribute_module(
                dtrec.EmbeddingBagCollection(tables), mesh,
                {k.removeprefix("sparse."): v for k, v in plan.items()},
            )  # fmt: skip
        else:
            model = dtrec.distribute_module(TinyModel(tables), mesh, plan, optimizer=fused)
        before = dtrec.checkpoint.full_state_dict(model)
        twin = copy.deepcopy(model)
        assert type(twin) is type(model)

        def make_opt(m, case=case):
            if case == "torch_adam_foreach":
                return torch.optim.Adam(m.parameters(), lr=0.01, foreach=True)
            return torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)

        def step(m, opt, batch, case=case):
            kjt, target = batch
            y = m(kjt)
            y = y.values().sum(1) if case == "collection_only" else y
            ((y - target) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()

        gen = torch.Generator().manual_seed(1 + rank)
        batches = [make_batch(tables, 3, False, gen) for _ in range(3)]
        opt_twin = make_opt(twin)
        for b in batches:  # only the copy trains: the original must not move
            step(twin, opt_twin, b)
        untouched = dtrec.checkpoint.full_state_dict(model)
        opt = make_opt(model)
        for b in batches:  # now the original, the same way
            step(model, opt, b)
        a, b = dtrec.checkpoint.full_state_dict(model), dtrec.checkpoint.full_state_dict(twin)
        out[case] = {
            "original_unchanged": max(
                (untouched[k] - v).abs().max().item() for k, v in before.items()
            ),
            "copy_moved": max((b[k] - v).abs().max().item() for k, v in before.items()),
            "same_training": max((a[k] - b[k]).abs().max().item() for k in a),
        }  # fmt: skip
        if fused is not None:  # the copy's fused optimizer: its own state and param groups
            mine, theirs = model.fused_optimizer, twin.fused_optimizer
            states = mine.state_dict()["state"], theirs.state_dict()["state"]
            out[case]["fused_state_same"] = max(
                (full_tensor(v) - full_tensor(states[1][t][k])).abs().max().item()
                for t, entries in states[0].items()
                for k, v in entries.items()
            )
            for group in theirs.param_groups:  # lr 0 on the copy only: its tables freeze
                group["lr"] = 0.0
            step(model, opt, batches[0])
            step(twin, opt_twin, batches[0])
            a2, b2 = full_state_dict(model), full_state_dict(twin)
            out[case]["copy_lr_frozen"] = max(
                (b2[k] - b[k]).abs().max().item() for k in b if "embedding_bags" in k
            )
            out[case]["original_lr_moved"] = max(
                (a2[k] - a[k]).abs().max().item() for k in a if "embedding_bags" in k
            )
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(4, _run, timeout=300)


@pytest.mark.parametrize("case", CASES)
def test_deepcopy_trains_independently_and_equally(results, case: str) -> None:
    for rank, r in enumerate(results):
        got = r[case]
        assert got["original_unchanged"] == 0.0, (rank, got)
        assert got["copy_moved"] > 1e-3, (rank, got)
        assert got["same_training"] == 0.0, (rank, got)
        if case.startswith("fused"):
            assert got["fused_state_same"] == 0.0, (rank, got)
            assert got["copy_lr_frozen"] == 0.0 and got["original_lr_moved"] > 0, (rank, got)
