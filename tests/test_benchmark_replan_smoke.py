"""Smoke test of benchmarks/replan.py: the poor plan moved to the mixed one at tiny sizes,
in place and by a checkpoint round trip, on 2 gloo ranks."""

from __future__ import annotations

from benchmarks.distributed import workload
from benchmarks.replan import run


def test_reshard_and_round_trip_agree(tmp_path) -> None:
    w = workload(scale=0.002, batch=8)
    result = run(w, {"steps": 1, "timeout": 180.0, "root": str(tmp_path)}, world=2)
    assert result["status"] == "ok", result.get("error")
    assert result["same_as_round_trip"]
    # every table starts on position 0: position 1 receives its half of the RW and CW
    # tables, the TW one placed there and a copy of the DP ones (weights + Adagrad sums)
    assert 0 < result["reshard_bytes_sent"] < result["round_trip_bytes_written"]
    assert result["reshard_s"] > 0 and result["round_trip_s"] > 0
