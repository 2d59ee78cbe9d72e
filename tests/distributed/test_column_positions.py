"""``ColumnWise(positions=...)``: a table's columns over some shard positions, in a given
order (what TorchRec's planner makes of a wide column-wise table), trains like the
unsharded model (the numerics contract), fused and not, on a 1D and a 2D mesh: outputs,
gradient blocks and weights; exact row-wise Adagrad sums each row's squares over just
those positions. The state dict keeps the unsharded keys and full values.
"""

from __future__ import annotations

import pytest

from tests.multiprocess import run_world

TOL = 1e-5
# (shard group size, plan name); the world is 4 ranks
CASES = [(4, "positions"), (4, "mixed"), (2, "positions")]
FUSED = ("none", "sgd", "rowwise_adagrad", "adam")


def _plan(shards: int, name: str) -> dict:
    from dtrec.placements import ColumnWise, DataParallel, RowWise

    cw = ColumnWise
    if shards == 2:
        return {"t0": cw(positions=(1,)), "t1": cw(positions=(0,)), "t2": cw(positions=(0, 1)),
                "t3": RowWise()}  # fmt: skip
    if name == "positions":
        return {"t0": cw(positions=(0, 2)), "t1": cw(positions=(1, 3)),
                "t2": cw(positions=(1, 2, 3)), "t3": cw(positions=(0,))}  # fmt: skip
    return {"t0": cw(positions=(0, 1, 3)), "t1": RowWise(), "t2": cw(positions=(2, 3)),
            "t3": DataParallel()}  # fmt: skip


def _fused(name: str):
    import dtrec

    return {
        "none": None,
        "sgd": dtrec.optim.SGD(lr=0.5),
        "rowwise_adagrad": dtrec.optim.RowWiseAdagrad(lr=0.1),
        "adam": dtrec.optim.Adam(lr=0.05),
    }[name]


def _run_all(rank: int, world: int) -> dict:
    import dataclasses

    import dtrec
    from tests.distributed.numerics import check_numerics

    out = {}
    for shards, name in CASES:
        mesh = dtrec.init_mesh("cpu", shards)
        for fused in FUSED:
            result = check_numerics(mesh, _plan(shards, name), False, fused=_fused(fused))
            out[(shards, name, fused)] = dataclasses.asdict(result)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(4, _run_all, timeout=600)


@pytest.mark.parametrize("fused", FUSED)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_column_positions_train_like_unsharded(results, case, fused) -> None:
    for rank, per_rank in enumerate(results):
        got = per_rank[(*case, fused)]
        assert got["max_output_diff"] < TOL, (rank, got)
        assert got["max_grad_diff"] < TOL, (rank, got)
        assert got["max_weight_diff"] < TOL, (rank, got)
        assert got["grads_sharded_like_weights"], (rank, got["notes"])
