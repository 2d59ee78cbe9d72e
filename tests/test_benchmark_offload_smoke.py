"""Smoke test of benchmarks/offload.py (``--smoke``: tiny sizes on CPU).

The CPU numbers are committed under benchmarks/results/; the GPU run is the same script
with ``--device cuda``. Here every code path runs once, in a subprocess (it starts its
own 1-rank process group), and the report's measures are checked for what must hold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_smoke_run_reports_hit_rates_bytes_and_step_ratios(tmp_path) -> None:
    out = tmp_path / "offload.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "benchmarks/offload.py", "--smoke", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["meta"]["device"] == "cpu" and report["host_to_device_GBps"] is None
    assert sorted(report["results"]) == ["B64_one_hot_uniform", "B64_one_hot_zipf"]
    for name, config in report["results"].items():
        assert sorted(config) == [
            "all_on_device", "cache_100pct", "cache_10pct", "cache_25pct", "cache_5pct",
        ], name  # fmt: skip
        assert config["all_on_device"]["hit_rate"] is None  # nothing offloaded
        for share in ("cache_100pct", "cache_25pct", "cache_10pct", "cache_5pct"):
            r = config[share]
            assert r["offloaded_tables"], (name, share)
            assert 0 <= r["hit_rate"] <= 1 and 0 <= r["expected_hit_rate"] <= 1
            assert r["step_over_device"] > 0 and r["pipelined_over_device"] > 0
            assert len(r["step_s_rounds"]) == 2 and r["step_s"] == min(r["step_s_rounds"])
        small = config["cache_5pct"]
        assert small["h2d_bytes_per_step"] > 0 and small["d2h_bytes_per_step"] >= 0
        assert config["cache_100pct"]["expected_hit_rate"] == 1.0
    uniform = report["results"]["B64_one_hot_uniform"]["cache_5pct"]
    assert abs(uniform["expected_hit_rate"] - 0.05) < 0.01  # uniform: the cache's share
