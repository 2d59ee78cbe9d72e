"""The parts of ``make gpu-check`` (``benchmarks/gpu_check/run.py``): each part's commands, their
timeouts and reports, at the GPU sizes or (``--smoke``) tiny ones, and a summary of each
report for the check's own JSON. Imports no torch (``gpu_check`` may have to install it).
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

PARTS = ("tier", "fully_sharded", "step", "profile", "soak", "kernels", "offload")
"""In the order they run: the tier and the step first, the longest benchmark last."""
TEST_PARTS = ("tier", "fully_sharded", "soak")
"""The tests half (``--skip-step`` keeps these, ``--skip-tests`` leaves them out)."""
REPORT_KEYS = {"tier": "cuda_tier", "fully_sharded": "fully_sharded", "step": "gpu_step",
               "profile": "gpu_profile", "soak": "soak", "kernels": "kernels",
               "offload": "offload"}  # fmt: skip
"""Each part's key in ``gpu_check_<card>_<date>.json`` (the tier's and the step's as the
first H200 report has them)."""

TIMEOUT_S = {"tier": 270, "fully_sharded": 120, "step": 200, "profile": 90, "soak": 90,
             "kernels": 90, "offload": 150}  # fmt: skip
"""Seconds per command on an H100/H200 (the soak has two commands, W=1 and W=4). Halves:
tests (tier + fully_sharded + soak) 570 s, bench (step, profile, kernels, offload) 530 s."""
SMOKE_TIMEOUT_S = {"tier": 300, "fully_sharded": 300, "step": 300, "profile": 180, "soak": 180,
                   "kernels": 180, "offload": 300}  # fmt: skip
"""The same at ``--smoke`` sizes, generous for a loaded 2-core CPU machine."""

FULLY_SHARDED_MODULE = "tests/gpu/test_fully_sharded_cuda.py"
"""Fully sharded 2D on the device (issue 43): numerics and host syncs against exact 2D. Its
own part (the tier leaves it out), so its outcome is one line of the report."""

SMOKE_TIER_K = "W1 and round_trip"
"""The tier's cases at ``--smoke``: the 1-rank checkpoint round trips. A ``-k`` selection
saves less than it seems: each tier module trains every world of its cases in one
module-scoped fixture, so this one still runs the checkpoint module's W=4 and W=1 worlds
(about 35 s of CPU), and a numerics case would run that module's (about 3 minutes)."""


@dataclass
class Run:
    """One command of a part."""

    label: str
    cmd: list[str]
    log: Path
    timeout_s: float
    reports: list[Path] = field(default_factory=list)
    """Files the command must write (a part whose report is missing failed)."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables set for this command only."""
    junit: Path | None = None
    """pytest's JUnit XML, folded into the check's report, then removed."""


def plan_parts(args, kind: str, results: Path, stem: str) -> dict[str, list[Run]]:
    """Every part's commands for a ``kind`` ("cuda" or "cpu") device; ``args`` is
    ``gpu_check.parse``'s (``smoke``, ``timeout_scale``, ``<part>_args``)."""
    py, dev, smoke = sys.executable, kind, args.smoke
    limits = SMOKE_TIMEOUT_S if smoke else TIMEOUT_S
    timeout = {k: v * args.timeout_scale for k, v in limits.items()}

    def log(part: str) -> Path:
        return results / f"gpu_check_{stem}_{part}.log"

    def extra(part: str) -> list[str]:
        return shlex.split(getattr(args, f"{part}_args"))

    junit = results / f"gpu_check_{stem}_junit.xml"
    tier = [py, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rs", "-p", "no:cacheprovider",
            f"--junitxml={junit}", f"--ignore={FULLY_SHARDED_MODULE}"]  # fmt: skip
    fs_junit = results / f"gpu_check_{stem}_fully_sharded_junit.xml"
    fully_sharded = [py, "-m", "pytest", "-m", "gpu", FULLY_SHARDED_MODULE, "-q", "-rs", "-p",
                     "no:cacheprovider", f"--junitxml={fs_junit}"]  # fmt: skip
    if smoke:
        tier += ["-k", SMOKE_TIER_K]
    step = results / f"gpu_step_{stem}.json"
    step_args = ["--smoke", "--no-pytorch"] if smoke else ["--steps", "10", "--profile-steps", "2"]
    profile_json = results / f"gpu_profile_{stem}.json"
    profile_txt = profile_json.with_suffix(".txt")
    kernels = results / f"kernels_{stem}.json"
    kernels_args = (
        ["--scale", "0.0002", "--max-rows", "200", "--batch", "8", "--poolings", "1",
         "--dists", "uniform", "--iters", "1", "--no-baseline"]
        if smoke else ["--iters", "10", "--poolings", "1,20,80", "--dists", "uniform,zipf"]
    )  # fmt: skip
    offload = results / f"offload_{stem}.json"
    offload_args = ["--smoke", "--repeats", "1"] if smoke else ["--steps", "10"]
    soak_args = ["--steps", "16", "--faults", "0"] if smoke else ["--steps", "60", "--faults", "1"]
    plans = {
        "tier": [Run("pytest", tier + extra("tier"), results / f"gpu_check_{stem}_pytest.log",
                     timeout["tier"], junit=junit)],
        "fully_sharded": [Run("pytest", fully_sharded + extra("fully_sharded"),
                              log("fully_sharded"), timeout["fully_sharded"], junit=fs_junit,
                              env={"DTREC_FS_GPU_SMOKE": "1"} if smoke else {})],
        "step": [Run("gpu_step", [py, "benchmarks/gpu_step.py", "--device", dev, *step_args,
                                  "--json", str(step), *extra("step")],
                     log("step"), timeout["step"], [step])],
        "profile": [Run("gpu_profile", [py, "benchmarks/gpu_profile.py", "--device", dev,
                                        *(["--smoke"] if smoke else []), "--json",
                                        str(profile_json), "--txt", str(profile_txt),
                                        *extra("profile")],
                        log("profile"), timeout["profile"], [profile_json, profile_txt])],
        "soak": [
            Run(f"W{world}", [py, "-m", "benchmarks.soak", "--device", dev, "--world",
                              str(world), *soak_args, "--json", str(path), *extra("soak")],
                log(f"soak_w{world}"), timeout["soak"], [path])
            for world in (1, 4)
            for path in [results / f"soak_{stem}_w{world}.json"]
        ],
        "kernels": [Run("kernels", [py, "benchmarks/kernels.py", "--device", dev,
                                    *kernels_args, "--many-small", "0", "--json", str(kernels),
                                    *extra("kernels")],
                        log("kernels"), timeout["kernels"], [kernels])],
        "offload": [Run("offload", [py, "benchmarks/offload.py", "--device", dev, "--ids",
                                    "zipf", *offload_args, "--json", str(offload),
                                    *extra("offload")],
                        log("offload"), timeout["offload"], [offload])],
    }  # fmt: skip
    return plans


def summarize(path: Path) -> dict | str:
    """The headline figures of a part's report (what the check's JSON keeps of it)."""
    if path.suffix != ".json":
        return f"{path.stat().st_size} bytes"
    try:
        report = json.loads(path.read_text())
        name = path.name
        for prefix, fn in _SUMMARIES.items():
            if name.startswith(prefix):
                return fn(report)
        return {"keys": sorted(report)}
    except Exception as exc:  # noqa: BLE001 - a malformed report is itself the finding
        return {"error": f"{type(exc).__name__}: {exc}"}


def _step(report: dict) -> dict:
    return {"issue_table": report["issue_table"],
            "full_table_violations": len(report["full_table_check"]["violations"])}  # fmt: skip


def _profile(report: dict) -> dict:
    return {
        name: {"wall_ms": c["wall_ms"], "host_ms": c["host_ms"],
               "device_busy_ms": c["device_busy_ms"], "wall_over_device": c["wall_over_device"],
               "top_device": [(t["name"], t["self_device_ms"])
                              for t in c["top"]["by_self_device_time"][:5]],
               "top_cpu": [(t["name"], t["self_cpu_ms"]) for t in c["top"]["by_self_cpu_time"][:5]]}
        for name, c in report["cases"].items()
    }  # fmt: skip


def _kernels(report: dict) -> dict:
    fbo = "forward_backward_optimizer"
    return {r["config"]["name"]: {"forward_of_copy": r["dtrec"]["forward_of_copy"],
                                  f"{fbo}_of_copy": r["dtrec"][f"{fbo}_of_copy"]}
            for r in report["results"]}  # fmt: skip


def _offload(report: dict) -> dict:
    keep = ("hit_rate", "expected_hit_rate", "h2d_bytes_per_step", "step_over_device",
            "pipelined_over_device")  # fmt: skip
    return {
        config: {cache: {k: r.get(k) for k in keep} for cache, r in caches.items()
                 if cache != "all_on_device"}
        for config, caches in report["results"].items()
    }  # fmt: skip


def _soak(report: dict) -> dict:
    return {"ok": report["ok"], "world": report["meta"]["world"],
            "backend": report["meta"].get("backend"),
            "lost": sum(v["lost"] for v in report["faults"].values()),
            "injected": sum(v["injected"] for v in report["faults"].values()),
            "max_abs_diff": report.get("reference", {}).get("max_abs_diff"),
            "throughput": report["throughput"]}  # fmt: skip


_SUMMARIES = {"gpu_step_": _step, "gpu_profile_": _profile, "kernels_": _kernels,
              "offload_": _offload, "soak_": _soak}  # fmt: skip
