"""The sharded step on the Triton backend (Triton's CPU interpreter here, CUDA kernels on GPU).

A small slice of the numerics contract with ``DTREC_BACKEND=triton``: lookups,
row-sparse backward and fused updates all go through the Triton kernels.
"""

from __future__ import annotations

import pytest

from tests.multiprocess import run_world

pytest.importorskip("triton")

# (shards, fused optimizer, plan). With 2 shards there are no replicas: row- and table-wise
# tables take the one-pass fused backward + step (the mixed plan's CW/DP tables sync first).
CASES = [
    (shards, fused, "mixed") for shards in (2, 1) for fused in ("none", "rowwise_adagrad", "adam")
] + [(2, "sgd", "row_wise"), (2, "rowwise_adagrad", "row_wise"), (2, "adam", "table_wise")]


def _run(rank: int, world: int) -> dict:
    import torch

    import dtrec
    from dtrec.ops.backends.registry import resolve_backend
    from dtrec.ops.backends.triton import TritonBackend
    from tests.distributed.numerics import PLANS, check_numerics

    optimizers = {
        "none": None,
        "sgd": dtrec.optim.SGD(lr=0.1),
        "rowwise_adagrad": dtrec.optim.RowWiseAdagrad(lr=0.1),
        "adam": dtrec.optim.Adam(lr=0.05),
    }
    one_pass = TritonBackend.backward_update
    calls = []

    def counted(*args) -> bool:  # counts the steps the one-pass kernel served
        served = one_pass(*args)
        calls.extend([1] if served else [])
        return served

    TritonBackend.backward_update = counted
    out = {"backend": resolve_backend(torch.device("cpu")).name}
    for shards, fused, plan in CASES:
        mesh = dtrec.init_mesh("cpu", shards)
        calls.clear()
        r = check_numerics(mesh, PLANS[plan], weighted=False, steps=3, fused=optimizers[fused])
        out[(shards, fused, plan)] = (r.max_weight_diff, r.max_loss_diff, len(calls))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    env = {"DTREC_BACKEND": "triton", "TRITON_INTERPRET": "1"}
    return run_world(2, _run, timeout=600, env=env)


@pytest.mark.parametrize(("shards", "fused", "plan"), CASES)
def test_triton_backend_matches_unsharded(results, shards: int, fused: str, plan: str) -> None:
    for rank, r in enumerate(results):
        assert r["backend"] == "triton"
        weight_diff, loss_diff, one_pass_steps = r[(shards, fused, plan)]
        assert weight_diff < 1e-5 and loss_diff < 1e-5, (rank, weight_diff, loss_diff)
        if plan != "mixed":  # every step's update took the one-pass path
            assert one_pass_steps == 3, (rank, one_pass_steps)
