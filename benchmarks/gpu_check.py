"""``make gpu-check``: the CUDA test tier and the GPU step benchmark, in one command.

On a machine with a CUDA device: installs torch + Triton only if they do not import
(``--install``, pip; a GPU image that has them needs no registry), runs
``pytest -m gpu tests/gpu`` and ``benchmarks/gpu_step.py`` with ``PYTHONPATH=.`` from the
repository root, and writes ``benchmarks/results/gpu_check_<card>_<date>.json`` (device,
torch / CUDA / Triton versions, UTC date, each test's outcome, the benchmark's exit code
and report path; the benchmark's own report is ``gpu_step_<card>_<date>.json``). Exit code:
0 when the tier passed and the benchmark succeeded, 1 otherwise, 2 (with one line saying
so) when there is no CUDA device.

    make gpu-check              # or: python benchmarks/gpu_check.py (from the repository root)
    python benchmarks/gpu_check.py --pytest-args="-x -k W1" --step-args="--batches 16384"
    make gpu-check GPU_CHECK_ARGS=--skip-step; make gpu-check GPU_CHECK_ARGS=--skip-tests
                                # in two parts (one report: the second adds to the first)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
NO_CUDA = 2


def cuda_device_name() -> str | None:
    """The first CUDA device's name, or None without one (torch's view if it imports, else
    whether the NVIDIA driver shows a device)."""
    if importlib.util.find_spec("torch") is not None:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    done = subprocess.run([smi, "-L"], capture_output=True, text=True)
    return done.stdout.splitlines()[0] if done.returncode == 0 and done.stdout else None


def ensure_torch_and_triton(spec: str) -> None:
    """pip-install ``spec`` (and Triton) only when torch or Triton does not import."""
    missing = [m for m in ("torch", "triton") if importlib.util.find_spec(m) is None]
    if not missing:
        return
    print(f"gpu-check: {missing} not importable; installing {spec!r} + triton with pip")
    cmd = [sys.executable, "-m", "pip", "install", *shlex.split(spec), "triton", "numpy"]
    if subprocess.run(cmd).returncode != 0:
        sys.exit(f"gpu-check: pip install failed ({' '.join(cmd)}); install torch + triton")


def versions() -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": None}
    if importlib.util.find_spec("triton") is not None:
        import triton

        out["triton"] = triton.__version__
    return out


def slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100_80gb_hbm3'."""
    words = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    return words.removeprefix("nvidia_") or "gpu"


def run(cmd: list[str], log: Path) -> int:
    """Run ``cmd`` from the repository root with ``PYTHONPATH=.``, output to the console
    and to ``log``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [".", os.environ.get(
        "PYTHONPATH")]))}  # fmt: skip
    print("gpu-check: $ PYTHONPATH=. " + " ".join(cmd), flush=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            out.write(line)
        return proc.wait()


def tier_outcomes(junit: Path) -> dict:
    """Per-test outcome from pytest's JUnit XML, and counts per outcome."""
    if not junit.exists():
        return {"counts": {}, "tests": {}}
    tests = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = [child.tag for child in case]
        tests[name] = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
    counts: dict[str, int] = {}
    for outcome in tests.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return {"counts": counts, "tests": tests}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--install", default="torch", help="pip spec used only if torch is missing")
    p.add_argument("--pytest-args", default="", help="extra pytest arguments")
    p.add_argument("--step-args", default="", help="extra benchmarks/gpu_step.py arguments")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-step", action="store_true")
    args = p.parse_args(argv)

    device = cuda_device_name()
    if device is None:
        print("gpu-check: no CUDA device (torch sees none, or no NVIDIA driver); nothing run")
        return NO_CUDA
    ensure_torch_and_triton(args.install)
    date = datetime.datetime.now(datetime.timezone.utc)
    stem = f"{slug(device)}_{date.date().isoformat()}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "meta": {"device": device, **versions(), "date": date.isoformat(timespec="seconds"),
                 "python": sys.version.split()[0]},
    }  # fmt: skip
    ok = True
    if not args.skip_tests:
        junit = RESULTS / f"gpu_check_{stem}_junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-rs"]
        cmd += ["-p", "no:cacheprovider", f"--junitxml={junit}", *shlex.split(args.pytest_args)]
        rc = run(cmd, RESULTS / f"gpu_check_{stem}_pytest.log")
        report["cuda_tier"] = {"command": " ".join(cmd), "exit_code": rc, **tier_outcomes(junit)}
        junit.unlink(missing_ok=True)  # its content is in the report
        ok &= rc == 0
    if not args.skip_step:
        step_json = RESULTS / f"gpu_step_{stem}.json"
        cmd = [sys.executable, "benchmarks/gpu_step.py", "--json", str(step_json.relative_to(REPO)),
               *shlex.split(args.step_args)]  # fmt: skip
        rc = run(cmd, RESULTS / f"gpu_check_{stem}_step.log")
        report["gpu_step"] = {"command": " ".join(cmd), "exit_code": rc,
                              "report": str(step_json.relative_to(REPO))}  # fmt: skip
        ok &= rc == 0
    path = RESULTS / f"gpu_check_{stem}.json"
    if path.exists():  # an earlier part of today's check (--skip-tests / --skip-step runs)
        report = {**json.loads(path.read_text()), **report}
    path.write_text(json.dumps(report, indent=1))
    print(f"gpu-check: {'passed' if ok else 'FAILED'}; wrote {path.relative_to(REPO)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
