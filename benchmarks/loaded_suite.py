"""Run the test suite several times back to back while CPU burners take every core.

    python -m benchmarks.loaded_suite --json benchmarks/results/loaded_suite_cpu_DATE.json
    python -m benchmarks.loaded_suite --runs 1 -- tests/distributed/test_faults.py -x

Issue 25's bar: the whole suite, 3 times in a row under a burner on every core, 0
failures. Each burner is a process spinning in pure Python (nice 0, like the tests);
they start before the first run and are stopped (by their own pids) after the last.
Each run is ``python -m pytest -q`` plus the arguments after ``--``, with a JUnit XML
report, from which the JSON records every failed or errored test (id and the first
lines of its message), the counts, the wall time of the run, its slowest tests and the
1-minute load average before and after. Exit status 0 only if every run passed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

BURN = "import os\nwhile True:\n    pass\n"


def start_burners(count: int) -> list[subprocess.Popen]:
    """``count`` busy-looping processes."""
    return [
        subprocess.Popen([sys.executable, "-c", BURN], stdout=subprocess.DEVNULL)
        for _ in range(count)
    ]


def stop_burners(burners: list[subprocess.Popen]) -> None:
    for p in burners:
        p.kill()
    for p in burners:
        p.wait()


def parse_junit(path: Path) -> dict:
    """Counts, failed / errored test ids with the start of their message, slowest tests."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in
              ("tests", "failures", "errors", "skipped")}  # fmt: skip
    bad, times = [], []
    for case in root.iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        times.append((float(case.get("time", 0.0)), test_id))
        for kind in ("failure", "error"):
            node = case.find(kind)
            if node is not None:
                text = (node.get("message") or node.text or "").strip()
                bad.append({"test": test_id, "kind": kind, "message": text[:600]})
    slowest = [{"test": t, "seconds": round(s, 2)} for s, t in sorted(times, reverse=True)[:15]]
    return {"counts": counts, "failed": bad, "slowest": slowest}


def run_suite(pytest_args: list[str], timeout: float) -> dict:
    """One ``python -m pytest -q`` run; its outcome from the JUnit report."""
    with tempfile.TemporaryDirectory(prefix="dtrec-loaded-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--junitxml={xml}", *pytest_args]  # fmt: skip
        load_before, start = os.getloadavg()[0], time.monotonic()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            code, tail = done.returncode, (done.stdout + done.stderr)[-3000:]
        except subprocess.TimeoutExpired as exc:
            code, tail = "timeout", str(exc.stdout or "")[-3000:]
        result = {"cmd": cmd, "returncode": code, "seconds": round(time.monotonic() - start, 1),
                  "load_before": load_before, "load_after": os.getloadavg()[0]}  # fmt: skip
        if xml.is_file():
            result.update(parse_junit(xml))
        result["output_tail"] = tail
        result["passed"] = code == 0
        return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, pytest_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) \
        if "--" in argv else (argv, [])  # fmt: skip
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 1,
                        help="busy processes (default: one per core)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=4 * 3600, help="per run, seconds")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(ours)
    report = {
        "date": datetime.date.today().isoformat(), "host": platform.node(),
        "cpus": os.cpu_count(), "burners": args.burners, "pytest_args": pytest_args,
        "load_idle": os.getloadavg()[0], "runs": [],
    }  # fmt: skip
    burners = start_burners(args.burners)
    try:
        time.sleep(2.0)  # the burners are on the cores before the first test starts
        for i in range(args.runs):
            result = run_suite(pytest_args, args.timeout)
            report["runs"].append(result)
            counts = result.get("counts", {})
            print(f"run {i + 1}/{args.runs}: {'passed' if result['passed'] else 'FAILED'} in "
                  f"{result['seconds']:.0f} s (load {result['load_before']:.1f} -> "
                  f"{result['load_after']:.1f}); {counts}", flush=True)  # fmt: skip
            for bad in result.get("failed", []):
                print(f"  {bad['kind']}: {bad['test']}: {bad['message'][:200]}", flush=True)
    finally:
        stop_burners(burners)
    report["all_passed"] = all(r["passed"] for r in report["runs"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if report["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
