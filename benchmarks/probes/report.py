"""What every benchmark report records about its run: which dtrec ran, and the JSON file."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import dtrec


def dtrec_source() -> dict:
    """Which dtrec runs: its path, git commit, uncommitted files and a hash of its sources."""
    root = Path(dtrec.__file__).parent

    def git(*args: str) -> str | None:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else None

    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return {
        "path": str(root),
        "git_commit": git("rev-parse", "HEAD"),
        "uncommitted": (git("status", "--porcelain", "--", ".") or "").splitlines(),
        "sources_sha256": digest.hexdigest(),
    }


def write_report(path: str, report: dict) -> None:
    """A benchmark's JSON report at ``path`` (its folder made if needed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {path}")
