"""``make gpu-check``: everything the project measures on a GPU, in one command.

On a machine with a CUDA device: installs torch + Triton only if they do not import
(``--install``, pip; a GPU image that has them needs no registry), then runs these parts
from the repository root with ``PYTHONPATH=.``, each command under its own timeout, the
whole under ``--budget`` seconds (a part that would start with under a minute left is
skipped and reported so):

======== ======= ============================================================ =========
part     half    command (full size)                                          timeout
======== ======= ============================================================ =========
tier     tests   ``pytest -m gpu tests/gpu`` (the CUDA tier, but the next)    270 s
fully_   tests   ``pytest -m gpu tests/gpu/test_fully_sharded_cuda.py``:      120 s
sharded          fully sharded 2D exact on the device, host syncs <= exact 2D
step     bench   ``benchmarks/gpu_step.py --steps 10 --profile-steps 2``      200 s
profile  bench   ``benchmarks/gpu_profile.py`` (B16384 multi-/one-hot)        90 s
soak     tests   ``benchmarks/soak/run.py --device cuda`` at W=1 (NCCL) and at    2 x 90 s
                 W=4 (gloo ranks sharing the GPU), ``--steps 60 --faults 1``
kernels  bench   ``benchmarks/kernels.py --iters 10 --many-small 0``          90 s
offload  bench   ``benchmarks/offload.py --device cuda --ids zipf --steps 10`` 150 s
======== ======= ============================================================ =========

Every file goes to ``--results-dir`` (default ``benchmarks/results/``), named by card and
UTC date (``<card>_<date>``, e.g. ``h200_2026-11-27``; ``<card>_smoke_<date>`` with
``--smoke``): each part's own report (``gpu_step_``, ``gpu_profile_`` .json + .txt,
``kernels_``, ``offload_``, ``soak_<stem>_w1`` / ``_w4``), its console output
(``gpu_check_<stem>_<part>.log``; the tier's is ``_pytest.log``) and
``gpu_check_<stem>.json``: device, versions, date, and per part its commands, exit codes,
times, report paths and a summary of its report (the tier: each test's outcome). A later
run on the same day adds its parts to that file (run the halves one after the other).

Exit code: 0 when every part ran and passed, 1 otherwise, 2 (one line saying so, nothing
written) when there is no CUDA device. ``DTREC_CUDA_TIER_DEVICE=cpu`` (the CUDA tier's
switch) with ``--smoke`` runs every part on CPU at tiny sizes instead: a check of the
wiring (``tests/test_gpu_check.py``), never a substitute for the GPU run.

    make gpu-check                                  # every part, about 9 minutes
    make gpu-check GPU_CHECK_ARGS=--skip-step       # the tests half: tier, fully_sharded,
                                                    # soak
    make gpu-check GPU_CHECK_ARGS=--skip-tests      # the bench half: step, profile, kernels,
                                                    # offload (each half well under 10 min)
    python -m benchmarks.gpu_check --parts step,profile --step-args="--batches 16384"
    DTREC_CUDA_TIER_DEVICE=cpu python -m benchmarks.gpu_check --smoke --results-dir /tmp/g
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
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a script (make gpu-check): the repository importable
    sys.path.insert(0, str(REPO))

from benchmarks.gpu_check.parts import (  # noqa: E402
    PARTS,
    REPORT_KEYS,
    TEST_PARTS,
    Run,
    plan_parts,
    summarize,
)

RESULTS = REPO / "benchmarks" / "results"
NO_CUDA = 2
TIMED_OUT = 124  # the exit code a timed-out command is recorded with (as timeout(1))
MIN_START_S = 60.0  # a command that would start with less of the budget left is skipped


def cpu_mode() -> bool:
    """``DTREC_CUDA_TIER_DEVICE=cpu``: the tier and every part on CPU (a wiring check)."""
    return os.environ.get("DTREC_CUDA_TIER_DEVICE", "cuda") == "cpu"


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


def shown(path: Path) -> str:
    """``path`` relative to the repository when inside it (reports name their files so)."""
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def run(cmd: list[str], log: Path, timeout: float | None = None,
        env_extra: dict[str, str] | None = None) -> int:  # fmt: skip
    """Run ``cmd`` from the repository root with ``PYTHONPATH=.``, output to the console
    and to ``log``; after ``timeout`` seconds its whole process group (ranks, workers) is
    killed and the exit code is ``TIMED_OUT``."""
    env = {**os.environ, **(env_extra or {}), "PYTHONPATH": os.pathsep.join(filter(None, [
        ".", os.environ.get("PYTHONPATH")]))}  # fmt: skip
    assigned = [f"{k}={v}" for k, v in (env_extra or {}).items()] + ["PYTHONPATH=."]
    print("gpu-check: $ " + " ".join(assigned + [shlex.quote(c) for c in cmd]), flush=True)
    expired = threading.Event()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip

        def kill() -> None:
            expired.set()
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    return
                time.sleep(5)

        timer = threading.Timer(timeout, kill) if timeout else None
        if timer:
            timer.daemon = True
            timer.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            out.write(line)
        rc = proc.wait()
        if timer:
            timer.cancel()
        if expired.is_set():
            out.write(f"\ngpu-check: timed out after {timeout:.0f} s; killed\n")
            print(f"gpu-check: timed out after {timeout:.0f} s; killed", flush=True)
            return TIMED_OUT
        return rc


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


@dataclass
class Budget:
    """The whole check's time budget: each command's timeout is its own, or what is left."""

    seconds: float
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)


def run_part(name: str, runs: list[Run], budget: Budget) -> dict:
    """Every command of one part under its timeout (cut to the budget left); the part's
    entry of the report."""
    entry: dict = {"commands": [], "ok": True}
    started = time.monotonic()
    for r in runs:
        left = budget.left()
        record = {"label": r.label, "command": shlex.join(r.cmd), "env": r.env,
                  "timeout_s": r.timeout_s, "log": shown(r.log)}  # fmt: skip
        if left < MIN_START_S:
            record.update(exit_code=None, skipped=f"out of the time budget ({left:.0f} s left)")
            print(f"gpu-check: {name} {r.label}: skipped, {left:.0f} s of the budget left")
            entry["commands"].append(record)
            entry["ok"] = False
            continue
        timeout = min(r.timeout_s, left)
        t0 = time.monotonic()
        rc = run(r.cmd, r.log, timeout, r.env)
        record.update(exit_code=rc, timed_out=rc == TIMED_OUT, timeout_s=round(timeout),
                      seconds=round(time.monotonic() - t0, 1))  # fmt: skip
        if r.junit is not None:
            record.update(tier_outcomes(r.junit))
            r.junit.unlink(missing_ok=True)  # its content is in the report
        missing = [shown(p) for p in r.reports if not p.exists()]
        record["reports"] = [shown(p) for p in r.reports]
        if missing:
            record["missing_reports"] = missing
        record["summary"] = {shown(p): summarize(p) for p in r.reports if p.exists()}
        entry["commands"].append(record)
        entry["ok"] &= rc == 0 and not missing
    entry["seconds"] = round(time.monotonic() - started, 1)
    return entry


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--install", default="torch", help="pip spec used only if torch is missing")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    p.add_argument("--skip", default="", help="parts to leave out, comma-separated")
    p.add_argument("--skip-tests", action="store_true",
                   help="leave out the tier, fully_sharded and the soak")  # fmt: skip
    p.add_argument("--skip-step", action="store_true",
                   help="leave out the benchmarks: step, profile, kernels, offload")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="tiny sizes (on CPU: the wiring check)")
    p.add_argument("--results-dir", default=str(RESULTS), help="where every file goes")
    p.add_argument("--budget", type=float, default=570.0, help="seconds for the whole check")
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiplies every timeout")
    for part in PARTS:
        p.add_argument(f"--{part}-args", default="", help=f"extra arguments of the {part} part")
    p.add_argument("--pytest-args", default="", help="extra pytest arguments (= --tier-args)")
    args = p.parse_args(argv)
    args.tier_args = " ".join(filter(None, [args.tier_args, args.pytest_args]))
    chosen = [x for x in args.parts.split(",") if x]
    skipped = {x for x in args.skip.split(",") if x}
    unknown = (set(chosen) | skipped) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    if args.skip_tests:
        skipped |= set(TEST_PARTS)
    if args.skip_step:
        skipped |= set(PARTS) - set(TEST_PARTS)
    args.chosen = [x for x in PARTS if x in chosen and x not in skipped]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if cpu_mode():
        if not args.smoke:
            print("gpu-check: DTREC_CUDA_TIER_DEVICE=cpu runs only with --smoke (tiny sizes)")
            return NO_CUDA
        device, kind = "cpu", "cpu"
    else:
        device = cuda_device_name()
        if device is None:
            print("gpu-check: no CUDA device (torch sees none, or no NVIDIA driver); nothing run")
            return NO_CUDA
        kind = "cuda"
        ensure_torch_and_triton(args.install)
    date = datetime.datetime.now(datetime.timezone.utc)
    stem = f"{slug(device)}{'_smoke' if args.smoke else ''}_{date.date().isoformat()}"
    results = Path(args.results_dir).resolve()
    results.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "meta": {"device": device, **versions(), "date": date.isoformat(timespec="seconds"),
                 "python": sys.version.split()[0], "smoke": args.smoke,
                 "command": " ".join(["python -m benchmarks.gpu_check", *(argv or sys.argv[1:])]),
                 "budget_s": args.budget},
    }  # fmt: skip
    budget = Budget(args.budget)
    plans = plan_parts(args, kind, results, stem)
    ok = True
    for name in args.chosen:
        part = report[REPORT_KEYS[name]] = run_part(name, plans[name], budget)
        ok &= part["ok"]
        print(f"gpu-check: {name}: {'ok' if part['ok'] else 'FAILED'} ({part['seconds']:.0f} s)",
              flush=True)  # fmt: skip
    path = results / f"gpu_check_{stem}.json"
    if path.exists():  # an earlier part of today's check (--skip-tests / --skip-step runs)
        report = {**json.loads(path.read_text()), **report}
    path.write_text(json.dumps(report, indent=1))
    print(f"gpu-check: {'passed' if ok else 'FAILED'}; wrote {shown(path)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
