"""examples/sequence_transformer.py runs as a user runs it (torchrun, 4 gloo ranks, 2D
mesh) and learns: the averaged loss falls and held-out accuracy beats chance."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.multiprocess import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_sequence_transformer_example_learns() -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
        "--master-port", str(free_port()), "--rdzv-backend", "static",
        str(ROOT / "examples" / "sequence_transformer.py"), "--steps", "40",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's dtrec, whatever is installed
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    match = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+); held-out accuracy (\d+\.\d+)", done.stdout)
    assert match, done.stdout[-3000:]
    first, last, accuracy = (float(g) for g in match.groups())
    assert last < first - 0.05 and accuracy > 0.6, match.group(0)
