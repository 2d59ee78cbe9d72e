"""Smoke test of ``benchmarks.distributed --pipeline``: each library's train pipeline runs
on the benchmark's model and batches (tiny sizes, 4 gloo ranks) and gets a step time."""

from __future__ import annotations

import importlib.util

import pytest

from benchmarks.common.run_loop import run_config
from benchmarks.common.workloads import workload

TINY = workload(scale=0.01, batch=32)
OPTS = {"steps": 2, "warmup": 1, "census_steps": 1, "timeout": 120.0, "pipeline": True}
LIBS = [
    "dtrec",
    pytest.param(
        "torchrec",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("torchrec") is None, reason="torchrec is not installed"
        ),
    ),
]


@pytest.mark.parametrize("lib", LIBS)
def test_pipeline_steps_are_timed(lib):
    run = run_config(lib, "table_wise", TINY, OPTS)
    assert run["status"] == "ok", run.get("error")
    m = run["median"]
    assert "pipeline_error" not in m, m.get("pipeline_error")
    assert m["pipeline_step_ms"] > 0
    for r in run["ranks"]:  # the untimed warm-up steps are left out
        assert len(r["pipeline"]["step_ms"]) == OPTS["steps"]
