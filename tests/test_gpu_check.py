"""``make gpu-check`` on a machine without a CUDA device: one line, non-zero exit, no files.

CUDA is hidden (``CUDA_VISIBLE_DEVICES=``) so this holds on a GPU machine too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_check import NO_CUDA, slug, tier_outcomes

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
NO_GPU_ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    before = sorted(RESULTS.iterdir())
    done = subprocess.run(cmd, cwd=REPO, env=NO_GPU_ENV, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert sorted(RESULTS.iterdir()) == before  # nothing written
    return done


def test_script_without_cuda_says_so_and_exits_nonzero() -> None:
    done = _run([sys.executable, "benchmarks/gpu_check.py"])
    assert done.returncode == NO_CUDA, done.stdout + done.stderr
    assert done.stdout.strip().splitlines() == [
        "gpu-check: no CUDA device (torch sees none, or no NVIDIA driver); nothing run"
    ]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_target_without_cuda_fails_with_the_same_line() -> None:
    done = _run(["make", "-s", "gpu-check", f"PYTHON={sys.executable}"])
    assert done.returncode != 0
    assert "gpu-check: no CUDA device" in done.stdout


def test_card_names_become_file_names() -> None:
    assert slug("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"
    assert slug("NVIDIA H200") == "h200"


def test_junit_outcomes_are_counted(tmp_path) -> None:
    junit = tmp_path / "j.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="m" name="a"/>'
        '<testcase classname="m" name="b"><failure message="x"/></testcase>'
        '<testcase classname="m" name="c"><skipped message="no CUDA"/></testcase>'
        "</testsuite></testsuites>"
    )
    out = tier_outcomes(junit)
    assert out["counts"] == {"passed": 1, "failure": 1, "skipped": 1}
    assert out["tests"]["m::b"] == "failure"
