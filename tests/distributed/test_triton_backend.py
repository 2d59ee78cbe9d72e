"""The sharded step on the Triton backend (Triton's CPU interpreter here, CUDA kernels on GPU).

A small slice of the numerics contract with ``DTREC_BACKEND=triton``: lookups,
row-sparse backward and fused updates all go through the Triton kernels.
"""

from __future__ import annotations

import pytest

from tests.multiprocess import run_world

pytest.importorskip("triton")

CASES = [(shards, fused) for shards in (2, 1) for fused in ("none", "rowwise_adagrad", "adam")]


def _run(rank: int, world: int) -> dict:
    import dtrec
    from dtrec.ops.backend import resolve_backend
    from tests.distributed.numerics import PLANS, check_numerics

    optimizers = {
        "none": None,
        "rowwise_adagrad": dtrec.optim.RowWiseAdagrad(lr=0.1),
        "adam": dtrec.optim.Adam(lr=0.05),
    }
    out = {"backend": resolve_backend(__import__("torch").device("cpu"))}
    for shards, fused in CASES:
        mesh = dtrec.init_mesh("cpu", shards)
        r = check_numerics(mesh, PLANS["mixed"], weighted=False, steps=3, fused=optimizers[fused])
        out[(shards, fused)] = (r.max_weight_diff, r.max_loss_diff)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    env = {"DTREC_BACKEND": "triton", "TRITON_INTERPRET": "1"}
    return run_world(2, _run, timeout=600, env=env)


@pytest.mark.parametrize(("shards", "fused"), CASES)
def test_triton_backend_matches_unsharded(results, shards: int, fused: str) -> None:
    for rank, r in enumerate(results):
        assert r["backend"] == "triton"
        weight_diff, loss_diff = r[(shards, fused)]
        assert weight_diff < 1e-5 and loss_diff < 1e-5, (rank, weight_diff, loss_diff)
