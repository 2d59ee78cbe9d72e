"""``make gpu-check`` without a GPU: on a machine without a CUDA device it says so in one
line, exits non-zero and writes nothing; with ``DTREC_CUDA_TIER_DEVICE=cpu`` and
``--smoke`` every part runs on CPU at tiny sizes and writes its report (the wiring check:
the GPU figures come from the GPU run).

CUDA is hidden (``CUDA_VISIBLE_DEVICES=``) so this holds on a GPU machine too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.gpu_check.parts import FULLY_SHARDED_MODULE, PARTS, TIMEOUT_S, Run, plan_parts
from benchmarks.gpu_check.run import (
    NO_CUDA,
    TIMED_OUT,
    Budget,
    parse,
    run,
    run_part,
    slug,
    tier_outcomes,
)
from benchmarks.soak.run import backend_for

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
NO_GPU_ENV = {k: v for k, v in os.environ.items() if k != "DTREC_CUDA_TIER_DEVICE"}
NO_GPU_ENV["CUDA_VISIBLE_DEVICES"] = ""
CPU_TIER_ENV = {**NO_GPU_ENV, "DTREC_CUDA_TIER_DEVICE": "cpu"}


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    before = sorted(RESULTS.iterdir())
    done = subprocess.run(cmd, cwd=REPO, env=NO_GPU_ENV, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert sorted(RESULTS.iterdir()) == before  # nothing written
    return done


def test_script_without_cuda_says_so_and_exits_nonzero() -> None:
    done = _run([sys.executable, "-m", "benchmarks.gpu_check"])
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


def test_cpu_tier_device_without_smoke_runs_nothing() -> None:
    before = sorted(RESULTS.iterdir())
    cmd = [sys.executable, "-m", "benchmarks.gpu_check"]
    done = subprocess.run(cmd, cwd=REPO, env=CPU_TIER_ENV, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == NO_CUDA, done.stdout + done.stderr
    assert "only with --smoke" in done.stdout
    assert sorted(RESULTS.iterdir()) == before


def test_halves_split_the_parts_and_fit_ten_minutes_each() -> None:
    assert parse([]).chosen == list(PARTS)
    tests, bench = parse(["--skip-step"]).chosen, parse(["--skip-tests"]).chosen
    assert tests == ["tier", "fully_sharded", "soak"]
    assert bench == ["step", "profile", "kernels", "offload"]
    assert parse(["--parts", "step,soak", "--skip", "soak"]).chosen == ["step"]
    with pytest.raises(SystemExit):
        parse(["--parts", "tier,nope"])
    plans = plan_parts(parse([]), "cuda", RESULTS, "card_date")
    seconds = {part: sum(r.timeout_s for r in runs) for part, runs in plans.items()}
    assert sum(seconds[p] for p in tests) < 600 and sum(seconds[p] for p in bench) < 600
    assert parse([]).budget < 600  # the whole: parts past the budget are skipped, not run
    assert seconds["soak"] == 2 * TIMEOUT_S["soak"]  # W=1 and W=4
    soak = [r.cmd for r in plans["soak"]]
    assert all("--device" in c and c[c.index("--device") + 1] == "cuda" for c in soak)
    assert [c[c.index("--world") + 1] for c in soak] == ["1", "4"]
    offload = plans["offload"][0].cmd
    assert offload[offload.index("--device") + 1] == "cuda"
    # fully sharded 2D on the device: its own part, left out of the tier (run once)
    [fully_sharded] = plans["fully_sharded"]
    assert FULLY_SHARDED_MODULE in fully_sharded.cmd and fully_sharded.junit is not None
    assert f"--ignore={FULLY_SHARDED_MODULE}" in plans["tier"][0].cmd
    assert all(str(p).startswith(str(RESULTS)) for runs in plans.values() for r in runs
               for p in r.reports)  # fmt: skip


def test_soak_backends_on_one_gpu_are_the_tiers() -> None:
    """W=1: NCCL (gloo beside it for the harness's CPU tensors); W=4: gloo ranks sharing it."""
    assert backend_for("cuda", 1, gpus=1) == "cpu:gloo,cuda:nccl"
    assert backend_for("cuda", 4, gpus=1) == "gloo"
    assert backend_for("cuda", 4, gpus=8) == "cpu:gloo,cuda:nccl"
    assert backend_for("cpu", 1) == backend_for("cpu", 4) == "gloo"


def test_a_command_past_its_timeout_is_killed(tmp_path) -> None:
    start = time.monotonic()
    rc = run([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
             tmp_path / "log", timeout=2)  # fmt: skip
    assert rc == TIMED_OUT and time.monotonic() - start < 30
    assert "up" in (tmp_path / "log").read_text()


def test_parts_past_the_budget_are_skipped_and_fail(tmp_path) -> None:
    runs = [Run("x", [sys.executable, "-c", "pass"], tmp_path / "x.log", 10)]
    entry = run_part("kernels", runs, Budget(0.0))
    assert not entry["ok"] and "budget" in entry["commands"][0]["skipped"]
    entry = run_part("kernels", runs, Budget(600.0))
    assert entry["ok"] and entry["commands"][0]["exit_code"] == 0


def _smoke(results: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """``python -m benchmarks.gpu_check --smoke`` on CPU into ``results``; its output and its
    merged report."""
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--smoke", "--results-dir", str(results),
           "--budget", "1500", *args]  # fmt: skip
    before = sorted(RESULTS.iterdir())
    done = subprocess.run(cmd, cwd=REPO, env=CPU_TIER_ENV, capture_output=True, text=True,
                          timeout=1500)  # fmt: skip
    assert sorted(RESULTS.iterdir()) == before  # nothing in benchmarks/results
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    [path] = results.glob("gpu_check_cpu_smoke_*.json")
    return done, json.loads(path.read_text())


def test_smoke_on_cpu_writes_every_part_report(tmp_path) -> None:
    """Every part but the tier (next test), tiny, on CPU: each report written, well-formed."""
    done, report = _smoke(tmp_path, "--skip", "tier")
    assert report["meta"]["device"] == "cpu" and report["meta"]["smoke"] is True
    assert set(report) == {"meta", "fully_sharded", "gpu_step", "gpu_profile", "soak", "kernels",
                           "offload"}  # fmt: skip
    [fully_sharded] = report["fully_sharded"]["commands"]  # pytest's outcomes, no report
    assert report["fully_sharded"]["ok"] and fully_sharded["counts"] == {"passed": 2}, fully_sharded
    assert fully_sharded["env"] == {"DTREC_FS_GPU_SMOKE": "1"}
    for key in ("gpu_step", "gpu_profile", "soak", "kernels", "offload"):
        part = report[key]
        assert part["ok"], (key, part)
        for command in part["commands"]:
            assert command["exit_code"] == 0 and not command["timed_out"], command
            assert Path(command["log"]).stat().st_size > 0
            assert command["reports"] and "missing_reports" not in command
            for path, summary in command["summary"].items():
                assert Path(path).parent == tmp_path
                assert "error" not in summary, (path, summary)
    names = sorted(p.name for p in tmp_path.iterdir())
    stem = names[0].split("gpu_check_")[1].removesuffix(".json")  # cpu_smoke_<date>
    assert {f"gpu_step_{stem}.json", f"gpu_profile_{stem}.json", f"gpu_profile_{stem}.txt",
            f"kernels_{stem}.json", f"offload_{stem}.json", f"soak_{stem}_w1.json",
            f"soak_{stem}_w4.json"} <= set(names)  # fmt: skip
    profile = json.loads((tmp_path / f"gpu_profile_{stem}.json").read_text())
    assert sorted(profile["cases"]) == sorted(
        f"B32_{hot}_{part}" for hot in ("multi_hot", "one_hot") for part in ("step", "embedding")
    )
    for case in profile["cases"].values():
        assert case["wall_ms"] > 0 and case["host_ms"] > 0 and case["profiled_cpu_ms"] > 0
        assert case["device_busy_ms"] is None  # CPU: no device activity
        assert case["top"]["by_self_cpu_time"] and case["top"]["by_self_device_time"] == []
    assert "--- top 10 by self_cpu_time_total" in (tmp_path / f"gpu_profile_{stem}.txt").read_text()
    soak = {c["label"]: next(iter(c["summary"].values())) for c in report["soak"]["commands"]}
    assert [s["world"] for s in soak.values()] == [1, 4]
    assert all(s["ok"] and s["lost"] == 0 and s["backend"] == "gloo" for s in soak.values())
    step = next(iter(report["gpu_step"]["commands"][0]["summary"].values()))
    assert step["full_table_violations"] == 0 and len(step["issue_table"]) == 2
    assert "gpu-check: passed" in done.stdout


def test_smoke_tier_part_folds_outcomes_into_the_days_report(tmp_path) -> None:
    """The tier on CPU gloo worlds, its smoke selection (the 1-rank checkpoint round trips);
    added to the report an earlier half wrote that day."""
    date = time.strftime("%Y-%m-%d", time.gmtime())
    earlier = {"meta": {"device": "cpu"}, "gpu_step": {"ok": True, "commands": []}}
    (tmp_path / f"gpu_check_cpu_smoke_{date}.json").write_text(json.dumps(earlier))
    _, report = _smoke(tmp_path, "--skip-step", "--skip", "soak,fully_sharded")
    assert report["gpu_step"] == earlier["gpu_step"]  # the earlier half's part kept
    [command] = report["cuda_tier"]["commands"]
    assert command["counts"] == {"passed": 4}, command
    assert all("round_trip" in test and "W1" in test for test in command["tests"])
    assert all(outcome == "passed" for outcome in command["tests"].values())
    assert not list(tmp_path.glob("*junit.xml"))  # folded into the report
