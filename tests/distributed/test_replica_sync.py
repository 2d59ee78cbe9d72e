"""dtrec.sharded.update.grad_sync on gloo: sparse, dense and auto give the dense all-reduce's sums.

Every rank builds all members' inputs from seeds, so each can check its result against
the dense sum over the group computed locally; the chosen path is read off the bytes
each collective recorded.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiprocess import run_world

WORLD = 3
# (num_rows, dim, rows touched per rank): sparse, nearly full, untouched, one rank only
TABLES = [(1000, 8, 5), (6, 3, 6), (50, 4, 0), (20, 2, None)]
MODES = ("sparse", "dense", "auto")


def _inputs(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s (sorted unique rows, grads) per table; row 0 is touched with 0 grad."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for num_rows, dim, touched in TABLES:
        n = (3 if rank == 1 else 0) if touched is None else touched
        rows = torch.randperm(num_rows, generator=g)[:n].sort().values
        grads = torch.randn(n, dim, generator=g)
        if n and num_rows == 1000:
            rows[0], grads[0] = 0, 0.0  # touched, zero gradient: still in the union
            rows = rows.sort().values
        out.append((rows, grads))
    return out


def _expected() -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for t, (num_rows, dim, _) in enumerate(TABLES):
        dense, hit = torch.zeros(num_rows, dim), torch.zeros(num_rows, dtype=torch.bool)
        for r in range(WORLD):
            rows, grads = _inputs(r)[t]
            dense[rows] += grads
            hit[rows] = True
        rows = torch.nonzero(hit).squeeze(1)
        out.append((rows, dense[rows]))
    return out


def _run(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import dtrec
    from dtrec.sharded.update.grad_sync import RowsShape, TableRows, record_sync_rows, sync_rows

    group = dist.new_group(list(range(world)))
    out = {}
    for mode in MODES:
        tables = [
            TableRows(rows, grads, cfg[0])
            for (rows, grads), cfg in zip(_inputs(rank), TABLES, strict=True)
        ]
        with dtrec.count_comm() as stats:
            got = sync_rows(tables, group, "sync", mode)
        errors = []
        for (rows, grads), (want_rows, want_grads) in zip(got, _expected(), strict=True):
            errors.append(
                (
                    torch.equal(rows, want_rows),
                    float((grads - want_grads).abs().max()) if grads.numel() else 0.0,
                )
            )
        out[mode] = (errors, dict(stats.calls), [g.tolist() for _, g in got], stats.per_step(2))
    # the sizes-only record (benchmarks/scale/sim.py) of the auto sync, no data moved
    with dtrec.count_comm() as real:
        sync_rows([TableRows(r, g, c[0]) for (r, g), c in zip(_inputs(rank), TABLES)], group, "s")
    most = [max(_inputs(r)[t][0].numel() for r in range(world)) for t in range(len(TABLES))]
    with dtrec.count_comm() as sizes_only:
        record_sync_rows([RowsShape(dim, rows) for rows, dim, _ in TABLES], most, group, "s")
    out["sizes_only"] = [(dict(s.calls), dict(s.bytes_sent)) for s in (real, sizes_only)]
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(WORLD, _run, timeout=120)


@pytest.mark.parametrize("mode", MODES)
def test_sync_rows_matches_dense_sum(results, mode: str) -> None:
    for rank, r in enumerate(results):
        errors, calls, _, per_step = r[mode]
        for t, (same_rows, err) in enumerate(errors):
            assert same_rows, (rank, mode, t)
            assert err < 1e-6, (rank, mode, t, err)
        # one all-gather of counts; the rest coalesced: one call per path taken
        paths = {"sparse": {"sparse"}, "dense": {"dense"}, "auto": {"sparse", "dense"}}[mode]
        assert set(calls) == {"sync.counts"} | {f"sync.{p}" for p in paths}, calls
        assert all(c == 1 for c in calls.values()), calls
        # comm_stats: per step (here: per 2 steps) calls, bytes and the time in the call
        for kind, v in per_step.items():
            assert v["calls"] == 0.5 and v["bytes"] > 0 and v["seconds"] > 0, (kind, v)
        # every member holds the same sums, bit for bit
        assert r[mode][2] == results[0][mode][2]


def test_auto_picks_by_bytes() -> None:
    from dtrec.comm.collectives import sync_bytes

    sparse, dense = sync_bytes(size=3, most=5, dim=8, num_rows=1000)
    assert sparse < dense  # 5 of 1000 rows: all-gather
    sparse, dense = sync_bytes(size=3, most=6, dim=3, num_rows=6)
    assert dense < sparse  # every row touched: all-reduce


def test_sizes_only_record_equals_the_real_sync(results) -> None:
    """``record_sync_rows`` (the scale model's replica sync) counts the calls and bytes the
    real ``sync_rows`` sends, on both paths (auto: a sparse and a dense table here)."""
    for rank, r in enumerate(results):
        real, sizes_only = r["sizes_only"]
        assert set(real[0]) == {"s.counts", "s.sparse", "s.dense"}, real
        assert sizes_only == real, rank
