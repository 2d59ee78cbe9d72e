"""A rank dies inside ``dtrec.checkpoint.save``: its peers raise at once, none waits out
the process group's timeout, and the last complete checkpoint is untouched.

Rank ``victim`` of 4 SIGKILLs itself right after DCP wrote its data file (before the
save's gather to rank 0). Its peers are then in different collectives: those that
talked to it raise out of DCP, while another is still inside DCP's gather, waiting on
them. Before, the ones out of DCP went on to the save's agreement all-reduce, which
the one inside the gather never joins: all three waited for the full process-group
timeout (found by ``benchmarks/soak/run.py``). The process-group timeout here is longer
than the world's, so a wait on it fails the test as a timed-out world rather than by
a wall-clock threshold.
"""

from __future__ import annotations

import pytest

from tests.multiprocess import run_world

WORLD = 4
PG_TIMEOUT_S = 900.0  # a survivor that waits on it never reports: the world times out
WORLD_TIMEOUT_S = 400.0


def _run(rank: int, world: int, root: str, victim: int) -> dict:
    import os
    import signal
    from pathlib import Path

    import torch
    from torch.distributed.checkpoint import FileSystemWriter

    import dtrec
    from dtrec.placements import ColumnWise, RowWise, TableWise
    from tests.distributed.numerics import TinyModel, make_batch, make_tables

    tables = make_tables(weighted=False)
    mesh = dtrec.init_mesh("cpu", world)
    specs = (RowWise(), TableWise(rank=1), ColumnWise(), TableWise(rank=3))
    plan = {f"sparse.{cfg.name}": spec for cfg, spec in zip(tables, specs, strict=True)}
    torch.manual_seed(0)
    model = dtrec.distribute_module(
        TinyModel(tables), mesh, plan, optimizer=dtrec.optim.RowWiseAdagrad(lr=0.1)
    )
    kjt, target = make_batch(tables, 4, False, torch.Generator().manual_seed(rank))
    (model(kjt) - target).pow(2).mean().backward()
    first = dtrec.checkpoint.save(root, model)
    before = {k: v.clone() for k, v in dtrec.checkpoint.full_state_dict(model).items()}
    (model(kjt) - target).pow(2).mean().backward()  # the next save holds other weights

    if rank == victim:
        write = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):  # type: ignore[no-untyped-def]
            write(self, plan, planner).wait()
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = write_then_die
    try:
        dtrec.checkpoint.save(root, model)
    except dtrec.CollectiveError as exc:
        error = str(exc)
    else:
        error = None
    names = sorted(p.name for p in Path(root).iterdir())
    return {"error": error, "first": first.name, "names": names, "before": before}


@pytest.mark.parametrize("victim", [0, 2])  # the coordinator of DCP's gather, and not
def test_peers_of_a_rank_dying_in_save_raise_at_once(tmp_path, victim: int) -> None:
    results = run_world(
        WORLD, _run, str(tmp_path), victim, timeout=WORLD_TIMEOUT_S,
        collective_timeout=PG_TIMEOUT_S, may_die={victim},
    )  # fmt: skip
    assert results[victim] is None
    for rank, r in enumerate(results):
        if rank == victim:
            continue
        assert r["error"] is not None, (rank, r["error"])
        assert f"rank {rank}: checkpoint write of" in r["error"], r["error"]
        assert "failed in a collective" in r["error"], r["error"]
        assert ".partial" in r["error"], r["error"]
        # the published checkpoint is the first one; the dead save left only its .partial
        assert r["names"] == [".ckpt-000002.partial", "ckpt-000001"], r["names"]

    # the last complete checkpoint loads, and holds what was saved
    import dtrec
    from tests.distributed.numerics import TinyModel, make_tables

    model = TinyModel(make_tables(weighted=False))
    dtrec.checkpoint.load(tmp_path, model)
    survivor = results[(victim + 1) % WORLD]
    for key, value in model.state_dict().items():
        assert (value == survivor["before"][key]).all(), key
