"""A shard axis of one position (W=1, or replicas only): no routing, no all-to-all.

The sharded collection pools its batch with one op call (``dtrec/sharded/lookup/local_path.py``):
same numerics as the unsharded model on every plan and fused optimizer, on the torch and
the Triton backend (its kernels in Triton's interpreter), no collective at W=1 and only
the verdict all-reduce with replicas; and the bad-batch contract, checked on the device:
at W=1 with the Triton backend and a fused optimizer a bad batch changes no table and is
reported by the next forward (or ``check_pending_batches``); with replicas every rank
raises in forward before any weight changes.
"""

from __future__ import annotations

import re

import pytest

from tests.multiprocess import run_world

PLANS = ("table_wise", "row_wise", "mixed")
FUSED = ("none", "rowwise_adagrad", "adam")
BACKENDS = ("torch", "triton")


def _optimizers():
    import dtrec

    return {
        "none": None,
        "rowwise_adagrad": dtrec.optim.RowWiseAdagrad(lr=0.1),
        "adam": dtrec.optim.Adam(lr=0.05),
    }


def _bad_batch(backend: str, fused: str) -> dict:
    """Train one step, feed a batch with an id outside its table on rank 1 (the only rank at
    W=1), then good batches: where and what is raised, and whether anything changed."""
    import copy

    import torch
    import torch.distributed as dist

    import dtrec
    from tests.distributed.numerics import PLANS as NUMERIC_PLANS
    from tests.distributed.numerics import TinyModel, make_batch, make_tables

    rank, world = dist.get_rank(), dist.get_world_size()
    dtrec.ops.set_backend(backend)
    tables = make_tables(weighted=False)
    torch.manual_seed(0)
    model = dtrec.distribute_module(
        TinyModel(tables), dtrec.init_mesh("cpu", 1),
        {f"sparse.{k}": v for k, v in NUMERIC_PLANS["mixed"].items()},
        optimizer=_optimizers()[fused],
    )  # fmt: skip
    gen = torch.Generator().manual_seed(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # the dense part, and the tables unfused

    def step(kjt) -> None:
        model(kjt).sum().backward()
        opt.step()
        opt.zero_grad()

    def snapshot() -> list[torch.Tensor]:
        state = model.sparse.fused_optimizer_state()
        weights = [t.weight.to_local().clone() for t in model.sparse.embedding_bags.values()]
        return weights + [v.clone() for s in state.values() for k, v in s.items() if k != "step"]

    def same(a, b) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    def attempt(fn) -> str:
        try:
            fn()
        except (IndexError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ok"

    out = {"local": model.sparse._local is not None}
    step(make_batch(tables, 4, False, gen)[0])
    before = snapshot()
    bad = make_batch(tables, 4, False, gen)[0]
    if rank == world - 1:
        bad = copy.copy(bad)
        values = bad.values().clone()
        values[-1] = 1000  # past every table
        bad = dtrec.KeyedJaggedTensor(bad.keys(), values, bad.lengths())
    out["bad_step"] = attempt(lambda: step(bad))
    out["unchanged_after_bad"] = same(before, snapshot())
    out["next_step"] = attempt(lambda: step(make_batch(tables, 4, False, gen)[0]))
    out["unchanged_after_report"] = same(before, snapshot())
    out["recovers"] = attempt(lambda: step(make_batch(tables, 4, False, gen)[0]))
    out["changed_after_recovery"] = not same(before, snapshot())
    # A bad last batch: only check_pending_batches can report it.
    out["last_bad"] = attempt(lambda: step(bad))
    out["pending"] = attempt(model.sparse.check_pending_batches)
    dtrec.ops.set_backend("auto")
    return out


def _numerics(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import dtrec
    from tests.distributed.numerics import PLANS as NUMERIC_PLANS
    from tests.distributed.numerics import check_numerics

    out = {}
    mesh = dtrec.init_mesh("cpu", 1)
    for backend in BACKENDS:
        dtrec.ops.set_backend(backend)
        for plan in PLANS:
            for fused in FUSED:
                for weighted in (False, True):
                    with dtrec.comm_stats() as stats:
                        r = check_numerics(mesh, NUMERIC_PLANS[plan], weighted, steps=3,
                                           fused=_optimizers()[fused])  # fmt: skip
                    calls = {k: n for k, n in stats.calls.items() if not k.startswith("dense")}
                    out[(backend, plan, fused, weighted)] = (
                        r.max_weight_diff, r.max_loss_diff, r.max_output_diff, calls,
                    )  # fmt: skip
    dtrec.ops.set_backend("auto")
    for backend in BACKENDS:
        for fused in FUSED:
            out[("bad", backend, fused)] = _bad_batch(backend, fused)
    dist.barrier()
    return out


_ENV = {"TRITON_INTERPRET": "1"}


@pytest.fixture(scope="module")
def one_rank() -> dict:
    pytest.importorskip("triton")
    return run_world(1, _numerics, timeout=900, env=_ENV)[0]


@pytest.fixture(scope="module")
def replicas() -> list[dict]:
    pytest.importorskip("triton")
    return run_world(2, _numerics, timeout=900, env=_ENV)


BAD_ID = r"IndexError: feature 'f\d' \(table 't\d'\) on rank {rank}: id 1000 is outside"
CASES = [(b, p, f, w) for b in BACKENDS for p in PLANS for f in FUSED for w in (False, True)]


@pytest.mark.parametrize(("backend", "plan", "fused", "weighted"), CASES)
def test_one_rank_matches_unsharded_without_collectives(one_rank, backend, plan, fused,
                                                        weighted) -> None:  # fmt: skip
    weight_diff, loss_diff, out_diff, calls = one_rank[(backend, plan, fused, weighted)]
    assert max(weight_diff, loss_diff, out_diff) < 1e-5, (weight_diff, loss_diff, out_diff)
    assert calls == {}, calls  # no header, ids, output or replica collective


@pytest.mark.parametrize(("backend", "plan", "fused", "weighted"), CASES)
def test_replicas_match_unsharded_with_one_verdict(replicas, backend, plan, fused,
                                                   weighted) -> None:  # fmt: skip
    for rank, r in enumerate(replicas):
        weight_diff, loss_diff, out_diff, calls = r[(backend, plan, fused, weighted)]
        assert max(weight_diff, loss_diff, out_diff) < 1e-5, (rank, weight_diff, loss_diff)
        assert calls.get("input_dist.verdict") == 3, calls  # one per step
        assert not any(k.startswith(("input_dist.header", "input_dist.ids", "output_dist"))
                       for k in calls), calls  # fmt: skip


@pytest.mark.parametrize("fused", FUSED[1:])
def test_one_rank_triton_reports_a_bad_batch_at_the_next_forward(one_rank, fused) -> None:
    r = one_rank[("bad", "triton", fused)]
    assert r["local"]
    assert r["bad_step"] == "ok" and r["unchanged_after_bad"], r  # checked on the device
    assert re.match(BAD_ID.format(rank=0), r["next_step"]), r
    assert "in the batch of forward call 2 of this collection" in r["next_step"], r
    assert r["unchanged_after_report"], r
    assert r["recovers"] == "ok" and r["changed_after_recovery"], r
    assert r["last_bad"] == "ok" and re.match(BAD_ID.format(rank=0), r["pending"]), r


@pytest.mark.parametrize(("backend", "fused"), [("torch", f) for f in FUSED] + [("triton", "none")])
def test_one_rank_host_checked_bad_batch_fails_in_forward(one_rank, backend, fused) -> None:
    r = one_rank[("bad", backend, fused)]
    assert re.match(BAD_ID.format(rank=0), r["bad_step"]), r
    assert r["unchanged_after_bad"] and r["next_step"] == "ok" and r["pending"] == "ok", r


@pytest.mark.parametrize(("backend", "fused"), [(b, f) for b in BACKENDS for f in FUSED])
def test_replicas_fail_a_bad_batch_on_every_rank_in_forward(replicas, backend, fused) -> None:
    by_rank = [r[("bad", backend, fused)] for r in replicas]
    assert re.match(BAD_ID.format(rank=1), by_rank[1]["bad_step"]), by_rank[1]
    assert by_rank[0]["bad_step"].startswith("ValueError: rank 1 rejected its input batch")
    for r in by_rank:
        assert r["unchanged_after_bad"] and r["next_step"] == "ok", r
        assert r["changed_after_recovery"], r
