"""Smoke test of benchmarks/kernels.py: tiny sizes on CPU, the Triton kernels in Triton's
interpreter (what the GPU runs), every measure of issue 24's kernel rows reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_smoke_run_reports_share_of_copy_per_phase(tmp_path) -> None:
    pytest.importorskip("triton")
    out = tmp_path / "kernels.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "",
           "TRITON_INTERPRET": "1", "DTREC_BACKEND": "triton"}  # fmt: skip
    args = ["--device", "cpu", "--scale", "0.0002", "--max-rows", "200", "--batch", "8",
            "--poolings", "1,4", "--dists", "uniform", "--many-small", "3", "--iters", "1",
            "--no-baseline", "--json", str(out)]  # fmt: skip
    done = subprocess.run([sys.executable, "benchmarks/kernels.py", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["meta"]["backend"] == "triton" and report["meta"]["copy_GBps"] > 0
    names = [r["config"]["name"] for r in report["results"]]
    assert names == ["dlrm_L1_uniform", "dlrm_L4_uniform", "many_small_D32_L20_T3"]
    for r in report["results"]:
        for phase in ("forward", "forward_backward_optimizer"):
            assert r["dtrec"][f"{phase}_s"] > 0 and r["dtrec"][f"{phase}_of_copy"] > 0
