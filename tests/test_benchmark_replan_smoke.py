"""Smoke test of benchmarks/replan.py: the poor plan re-planned from the ids counted on it,
moved there in place and by a checkpoint round trip, at tiny sizes on 2 gloo ranks."""

from __future__ import annotations

from benchmarks.common.workloads import workload
from benchmarks.replan import run


def test_reshard_and_round_trip_agree(tmp_path) -> None:
    w = workload(scale=0.002, batch=8)
    result = run(w, {"steps": 1, "timeout": 180.0, "root": str(tmp_path)}, world=2)
    assert result["status"] == "ok", result.get("error")
    assert result["same_as_round_trip"] and result["same_plan_on_every_rank"]
    assert set(result["plan"].values()) != {"TW(0)"}, result["plan"]  # off the poor plan
    assert result["step_counted_s"] > 0 and result["plan_s"] > 0
    # every table starts on position 0: position 1 receives what the new plan puts there
    assert 0 < result["reshard_bytes_sent"] < result["round_trip_bytes_written"]
    assert result["reshard_s"] > 0 and result["round_trip_s"] > 0
