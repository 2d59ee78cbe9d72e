"""Tests for the multi-process harness itself (tests/multiprocess.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from tests.multiprocess import WorldError, free_port, run_world

# --- worker functions: module level so that "spawn" can pickle them by name -------------------


def _all_reduce_worker(rank: int, world_size: int, offset: float) -> dict:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world_size": world_size,
        "sum": t.item(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "extra": os.environ.get("DTREC_TEST_VAR"),
    }


def _raise_on_rank1_worker(rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.all_reduce(torch.ones(1))  # blocks: rank 1 never joins; the parent must kill us


def _exit_on_rank1_worker(rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def _sleep_on_rank1_worker(rank: int, world_size: int) -> int:
    if rank == 1:
        while True:
            time.sleep(1.0)
    return rank


def _birth_worker(rank: int, world_size: int) -> dict:
    """How this rank was born: forked from the fork server (dtrec already imported) or
    spawned fresh; and what dtrec reads of its environment."""
    import sys

    preloaded = "dtrec" in sys.modules
    from dtrec.ops import get_backend

    return {
        "preloaded": preloaded,
        "backend": get_backend(),
        "var": os.environ.get("DTREC_TEST_VAR"),
    }


def _unpicklable_result_worker(rank: int, world_size: int):
    return lambda: rank


# --- tests -------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_leaked_children():
    before = set(mp.active_children())
    yield
    leaked = [p for p in mp.active_children() if p not in before]
    assert leaked == [], f"run_world left child processes behind: {leaked}"


def test_free_port():
    port = free_port()
    assert 0 < port < 65536


def test_all_reduce_results_in_rank_order():
    results = run_world(2, _all_reduce_worker, 10.0, env={"DTREC_TEST_VAR": "hello"})
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 for r in results)
    assert all(r["sum"] == 21.0 for r in results)  # 10 + 11
    assert all(r["omp"] == "1" for r in results)
    assert all(r["extra"] == "hello" for r in results)
    assert "DTREC_TEST_VAR" not in os.environ  # parent environment restored


# The waits these tests guard against are the collective timeout and the world timeout,
# both set far above what spawning and importing torch take on a loaded machine (tens of
# seconds with every core busy), so the bounds below hold under load and still fail if
# the harness waited for either.
SLOW_S = 900.0


def test_forked_ranks_see_what_spawned_ranks_would():
    """A world is forked from the fork server when its environment is the server's or read
    at use (DTREC_BACKEND), and spawned when a variable read at import differs (fbgemm
    switched off): either way the rank sees the environment it was given."""
    forked = run_world(2, _birth_worker, env={"DTREC_BACKEND": "torch"})
    spawned = run_world(1, _birth_worker, env={"DTREC_DISABLE_FBGEMM": "1"})
    assert [r["preloaded"] for r in forked] == [True, True]
    assert [r["backend"] for r in forked] == ["torch", "torch"]
    assert [r["var"] for r in forked] == [None, None]  # an earlier world's is not kept
    assert spawned[0]["preloaded"] is False
    assert spawned[0]["backend"] == os.environ.get("DTREC_BACKEND", "auto")


def test_exception_reported_and_others_killed_quickly():
    t0 = time.monotonic()
    with pytest.raises(WorldError) as excinfo:
        run_world(2, _raise_on_rank1_worker, collective_timeout=SLOW_S, timeout=SLOW_S)
    elapsed = time.monotonic() - t0
    msg = str(excinfo.value)
    assert "rank 1" in msg
    assert "boom" in msg
    assert "ValueError" in msg
    assert elapsed < SLOW_S / 5, f"took {elapsed:.1f}s: blocked rank was not terminated promptly"


def test_abnormal_exit_reported_with_exit_code():
    t0 = time.monotonic()
    with pytest.raises(WorldError) as excinfo:
        run_world(2, _exit_on_rank1_worker, collective_timeout=SLOW_S, timeout=SLOW_S)
    msg = str(excinfo.value)
    assert "rank 1" in msg
    assert "exit code 3" in msg
    assert time.monotonic() - t0 < SLOW_S / 5


def test_timeout_kills_world():
    t0 = time.monotonic()
    with pytest.raises(WorldError) as excinfo:
        run_world(2, _sleep_on_rank1_worker, timeout=5.0)
    elapsed = time.monotonic() - t0
    msg = str(excinfo.value)
    assert "timed out" in msg
    assert "1]" in msg  # rank 1 is listed among the unfinished ranks
    # the failure mode is a hang (rank 1 sleeps forever); teardown under load takes seconds
    assert elapsed < 120.0, f"took {elapsed:.1f}s"


def test_unpicklable_result_is_an_error():
    with pytest.raises(WorldError) as excinfo:
        run_world(1, _unpicklable_result_worker)
    assert "rank 0" in str(excinfo.value)
