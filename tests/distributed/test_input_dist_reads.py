"""The input dist reads the device once per step, and a bad batch still fails everywhere.

On a (2 shard positions x 2 replicas) mesh with every kind of table (row-wise through
fbgemm's bucketize or the sort, table-wise, column-wise, data-parallel), the input dist of
a steady-state batch makes one host read (``StepCounter`` counts what would wait for a
GPU): the ids' range count, the layout of the ids, the replicas' verdict and the peers'
sizes all come with the header. Ids outside their table (negative, past the last row,
past int32) are found on the device: the rank that sent them raises its IndexError, its
sharding group peer names it, the other group's ranks name the lowest bad rank, and no
weight changes; the next batch trains.
"""

from __future__ import annotations

import pytest

from tests.multiprocess import run_world

PATHS = ("fbgemm", "sort")
BAD = {"negative": (3, -1), "past_the_table": (0, 50), "past_int32": (0, 2**31 + 3)}


def _run(rank: int, world: int) -> dict:
    import torch

    import dtrec
    import dtrec.sharded.dist.routing as routing_module
    from benchmarks.probes.step import StepCounter
    from dtrec.checkpoint.dcp import full_state_dict
    from tests.distributed.numerics import PLANS, TinyModel, make_batch, make_tables
    from tests.error_cases import outcome

    tables = make_tables(weighted=False)
    mesh = dtrec.init_mesh("cpu", 2)  # ranks {0, 2} and {1, 3} share a sharding group
    real = routing_module.fbgemm_ops
    out: dict = {}
    for path in PATHS:
        routing_module.fbgemm_ops = real if path == "fbgemm" else (lambda: None)
        try:
            torch.manual_seed(0)
            plan = {f"sparse.{k}": v for k, v in PLANS["mixed"].items()}
            model = dtrec.distribute_module(
                TinyModel(tables), mesh, plan, optimizer=dtrec.optim.RowWiseAdagrad(lr=0.1)
            )
            gen = torch.Generator().manual_seed(rank)

            def step(kjt, model=model) -> None:
                model(kjt).sum().backward()

            for _ in range(2):
                step(make_batch(tables, 4, False, gen)[0])
            kjt = make_batch(tables, 4, False, gen)[0]
            with StepCounter(torch.device("cpu")) as counts:
                model.sparse.prefetch(kjt)  # the input dist alone
            out[(path, "syncs")] = dict(counts.syncs)
            step(kjt)  # takes the prefetched batch
            for name, (bad_rank, bad_id) in BAD.items():
                before = {k: v.clone() for k, v in full_state_dict(model).items()}
                kjt = make_batch(tables, 4, False, gen)[0]
                if rank == bad_rank:  # f0: the row-wise table t0 (50 rows)
                    values = kjt.values().clone()
                    values[0] = bad_id
                    kjt = dtrec.KeyedJaggedTensor(kjt.keys(), values, kjt.lengths())
                got = outcome(lambda kjt=kjt: step(kjt))
                after = full_state_dict(model)
                unchanged = all(torch.equal(after[k], before[k]) for k in before)
                nxt = outcome(lambda gen=gen: step(make_batch(tables, 4, False, gen)[0]))
                out[(path, name)] = (got, unchanged, nxt)
        finally:
            routing_module.fbgemm_ops = real
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(4, _run, timeout=600)


@pytest.mark.parametrize("path", PATHS)
def test_input_dist_reads_the_device_once(results, path: str) -> None:
    for rank, r in enumerate(results):
        syncs = r[(path, "syncs")]
        assert sum(syncs.values()) == 1, (rank, syncs)
        assert "input_dist.py" in next(iter(syncs)), (rank, syncs)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", list(BAD))
def test_ids_outside_their_table_fail_every_rank_before_any_update(
    results, path: str, bad: str
) -> None:
    bad_rank, bad_id = BAD[bad]
    peer = {0: 2, 2: 0, 1: 3, 3: 1}[bad_rank]
    for rank, r in enumerate(results):
        (kind, message), unchanged, nxt = r[(path, bad)]
        assert unchanged and nxt is None, (rank, r[(path, bad)])
        if rank == bad_rank:
            assert kind == "IndexError", (rank, message)
            assert f"feature 'f0' (table 't0') on rank {rank}: id {bad_id} is outside [0, 50)" in (
                message
            )
        elif rank == peer:
            assert message.startswith(f"rank(s) [{bad_rank}] of this sharding group"), message
        else:
            assert message.startswith(f"rank {bad_rank} rejected its input batch"), message
