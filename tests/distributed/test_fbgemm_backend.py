"""The sharded step with fbgemm's fused CPU backward + step.

Row- and table-wise tables with no replicas take ``FusedOptimizer.backward_update``; on
CPU it runs fbgemm's C++ backward + SGD / row-wise Adagrad when fbgemm loads: under the
``"fbgemm"`` backend for both rules, under ``"auto"`` for SGD and for row-wise Adagrad
where it is the faster one on this processor (``dtrec.optim.cpu_choice``; the tests pin
it, ``tests/conftest.py``). A
table-wise table read by both ranks arrives as two entries per table (segment-major),
which the fbgemm path regroups. Same numerics contract as the torch path.
"""

from __future__ import annotations

import pytest

from tests.multiprocess import run_world

CASES = [
    (backend, fused, plan, weighted)
    for backend in ("auto", "fbgemm")
    for fused in ("sgd", "rowwise_adagrad")
    for plan in ("row_wise", "table_wise")
    for weighted in (False, True)
]


def _run(rank: int, world: int) -> dict:
    import dtrec
    from dtrec.ops.backends.fbgemm import FbgemmBackend
    from dtrec.ops.backends.fbgemm_loader import fbgemm_available
    from tests.distributed.numerics import PLANS, check_numerics

    if not fbgemm_available():
        return {"fbgemm": False}
    optimizers = {"sgd": dtrec.optim.SGD(0.1), "rowwise_adagrad": dtrec.optim.RowWiseAdagrad(0.1)}
    real = FbgemmBackend.backward_update
    calls = []

    def counted(*args, **kwargs) -> bool:
        calls.append(real(*args, **kwargs))
        return calls[-1]

    FbgemmBackend.backward_update = counted
    out: dict = {"fbgemm": True}
    mesh = dtrec.init_mesh("cpu", 2)
    for backend, fused, plan, weighted in CASES:
        calls.clear()
        dtrec.ops.set_backend(backend)
        r = check_numerics(mesh, PLANS[plan], weighted=weighted, steps=3, fused=optimizers[fused])
        key = (backend, fused, plan, weighted)
        out[key] = (r.max_weight_diff, r.max_loss_diff, list(calls))
    from dtrec.optim.cpu_choice import cpu_rowwise_adagrad

    out["auto_rowwise"] = cpu_rowwise_adagrad()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    got = run_world(2, _run, timeout=600, env={"DTREC_BACKEND": "auto"})
    if not got[0]["fbgemm"]:
        pytest.skip("fbgemm_gpu does not load here")
    return got


@pytest.mark.parametrize(("backend", "fused", "plan", "weighted"), CASES)
def test_fbgemm_fused_step_matches_unsharded(
    results, backend: str, fused: str, plan: str, weighted: bool
):
    for rank, r in enumerate(results):
        weight_diff, loss_diff, calls = r[(backend, fused, plan, weighted)]
        assert weight_diff < 1e-5 and loss_diff < 1e-5, (rank, weight_diff, loss_diff)
        in_fbgemm = backend == "fbgemm" or fused == "sgd" or r["auto_rowwise"] == "fbgemm"
        assert calls == [in_fbgemm] * 3, (rank, calls)  # every step's update, or none


def test_auto_takes_the_pinned_row_wise_adagrad(results) -> None:
    import os

    assert {r["auto_rowwise"] for r in results} == {os.environ["DTREC_CPU_ROWWISE_ADAGRAD"]}
