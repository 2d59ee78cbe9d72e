"""A rank dies mid-step: its peers stop with a clear error instead of hanging.

Rank 2 of 3 exits (``os._exit``) between its forward and its backward at step 2, while
its peers run the backward's collectives. They must raise ``dtrec.CollectiveError``
naming the collective and the group instead of hanging.

No wall-clock guesses (these tests ran on a loaded machine and failed there): the
process group's timeout (``PG_TIMEOUT_S``) is longer than the world's, so a peer
that waits for it instead of noticing the dead link never reports and the world
times out; where the timeout itself is the subject (a stalled rank), the short
timeout is set only once every rank is known to have reached the stalled step (a
barrier), so setup, imports and the forward under load cannot trip it, and the
only bound checked is the one load cannot break (the timeout does not fire early).
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests.multiprocess import run_world

WORLD = 3
PG_TIMEOUT_S = 900.0  # never reached: a wait on it fails as a timed-out world
WORLD_TIMEOUT_S = 400.0


def _set_timeout(seconds: float, *groups: object) -> None:
    """Shorten the timeout of ``groups`` (and the default group) from now on (torch's
    private ``_set_pg_timeout``: tests only)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    for group in (None, *groups):
        _set_pg_timeout(timedelta(seconds=seconds), group)


def _run(rank: int, world: int) -> dict:
    import os

    import torch

    import dtrec
    from dtrec.placements import RowWise, TableWise
    from tests.distributed.numerics import TinyModel, make_batch, make_tables

    tables = make_tables(weighted=False)
    mesh = dtrec.init_mesh("cpu", world)
    plan = {f"sparse.{cfg.name}": RowWise() if i % 2 else TableWise(rank=i % world)
            for i, cfg in enumerate(tables)}  # fmt: skip
    torch.manual_seed(0)
    model = dtrec.distribute_module(
        TinyModel(tables), mesh, plan, optimizer=dtrec.optim.RowWiseAdagrad(lr=0.1)
    )
    gen = torch.Generator().manual_seed(rank)
    try:
        for step in range(4):
            kjt, target = make_batch(tables, 4, False, gen)
            loss = (model(kjt) - target).pow(2).mean()
            if step == 2 and rank == 2:
                os._exit(3)  # dies mid-step: its peers are about to exchange gradients
            loss.backward()
    except dtrec.CollectiveError as exc:
        return {"error": str(exc), "step": step}
    return {"error": None, "step": step}


@pytest.fixture(scope="module")
def results() -> list[dict | None]:
    return run_world(
        WORLD, _run, timeout=WORLD_TIMEOUT_S, collective_timeout=PG_TIMEOUT_S, may_die={2}
    )


def test_dead_rank_raises_clear_error_on_peers(results) -> None:
    assert results[2] is None  # the killed rank reported nothing
    for rank in (0, 1):
        r = results[rank]
        assert r["error"] is not None, (rank, r)
        assert r["step"] == 2, (rank, r)
        assert f"rank {rank}: collective" in r["error"] and "over ranks [0, 1, 2]" in r["error"]
        # the dead link, not a timeout (the world would have timed out first anyway)
        assert "timed out" not in r["error"].lower(), (rank, r)


STALL_TIMEOUT_S = 3.0


def _run_stalled(rank: int, world: int, flag_dir: str) -> dict:
    """Rank 2 stops calling collectives (alive, stuck elsewhere) before its backward.

    It stays stuck until both peers have reported their error (files in ``flag_dir``),
    so only the collective timeout can have freed them. The short timeout is set after
    a barrier every rank passed after its forward: it covers the backward only.
    """
    import os
    import time
    from pathlib import Path

    import torch

    import dtrec
    from dtrec.placements import RowWise
    from tests.distributed.numerics import TinyModel, make_batch, make_tables

    tables = make_tables(weighted=False)
    mesh = dtrec.init_mesh("cpu", world)
    plan = {f"sparse.{cfg.name}": RowWise() for cfg in tables}
    torch.manual_seed(0)
    model = dtrec.distribute_module(TinyModel(tables), mesh, plan)
    kjt, target = make_batch(tables, 4, False, torch.Generator().manual_seed(rank))
    loss = (model(kjt) - target).pow(2).mean()
    torch.distributed.barrier()  # every rank is past its forward
    flags = [Path(flag_dir) / f"rank{r}" for r in (0, 1)]
    if rank == 2:
        while not all(f.exists() for f in flags):  # the world's timeout bounds this
            time.sleep(0.05)
        os._exit(0)
    _set_timeout(STALL_TIMEOUT_S, *{mesh.get_group(d) for d in mesh.mesh_dim_names})
    start = time.monotonic()
    try:
        loss.backward()
    except dtrec.CollectiveError as exc:
        result = {"error": str(exc), "seconds": time.monotonic() - start}
    else:
        result = {"error": None}
    flags[rank].touch()
    return result


def test_stalled_rank_times_out_on_peers(tmp_path) -> None:
    results = run_world(
        WORLD, _run_stalled, str(tmp_path), timeout=WORLD_TIMEOUT_S,
        collective_timeout=PG_TIMEOUT_S, may_die={2},
    )  # fmt: skip
    for rank in (0, 1):
        r = results[rank]
        assert r["error"] is not None and f"rank {rank}: collective" in r["error"], (rank, r)
        # gloo words it "Timed out waiting ..." or "Application timeout caused pair closure"
        assert "timed out" in r["error"].lower() or "timeout caused" in r["error"], (rank, r)
        assert r["seconds"] > STALL_TIMEOUT_S * 0.9, (rank, r)  # not before the timeout


def _run_raises_in_forward(rank: int, world: int, flag_dir: str) -> dict:
    """Rank 1 raises in its dense forward (after the sparse forward's collectives), inside
    ``dtrec.report_failures()``; its peers, waiting in the backward, must name it.

    The report lives in the process group's store, which rank 0 hosts: rank 0 stays
    until rank 2 has read it (a file in ``flag_dir``), else under load rank 0 could
    exit first and take the store, and the report, with it."""
    import time
    from pathlib import Path

    import torch

    import dtrec
    from dtrec.placements import RowWise
    from tests.distributed.numerics import TinyModel, make_batch, make_tables

    tables = make_tables(weighted=False)
    mesh = dtrec.init_mesh("cpu", world)
    torch.manual_seed(0)
    model = dtrec.distribute_module(
        TinyModel(tables), mesh, {f"sparse.{cfg.name}": RowWise() for cfg in tables}
    )
    kjt, target = make_batch(tables, 4, False, torch.Generator().manual_seed(rank))
    try:
        with dtrec.report_failures():
            pooled = model.sparse(kjt).values()
            if rank == 1:
                raise RuntimeError("bad feature transform on this rank")
            (model.dense(pooled).squeeze(1) - target).pow(2).mean().backward()
    except dtrec.CollectiveError as exc:
        result = {"error": str(exc)}
    except RuntimeError as exc:
        return {"raised": str(exc)}  # then this process exits: its peers see the link close
    else:
        result = {"error": None}
    (Path(flag_dir) / f"rank{rank}").touch()
    while rank == 0 and not (Path(flag_dir) / "rank2").exists():  # bounded by the world's timeout
        time.sleep(0.05)
    return result


def test_rank_raising_in_forward_is_named_by_its_peers(tmp_path) -> None:
    results = run_world(
        WORLD, _run_raises_in_forward, str(tmp_path), timeout=WORLD_TIMEOUT_S,
        collective_timeout=PG_TIMEOUT_S, may_die={1},
    )  # fmt: skip
    assert results[1] == {"raised": "bad feature transform on this rank"}
    for rank in (0, 2):
        r = results[rank]
        assert r["error"] is not None, (rank, r)
        assert "rank 1 failed first: RuntimeError: bad feature transform" in r["error"], r
        assert "timed out" not in r["error"].lower(), (rank, r)
