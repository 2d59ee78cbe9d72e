"""Smoke test of benchmarks/checkpoint.py: the dtrec side at tiny sizes on a 2D mesh.

On ``2d_mixed`` (S=2, R=2) every block has two replicas; the bytes written must still be
the state's unique bytes (plus DCP's per-item framing), not twice the replicated part.
"""

from __future__ import annotations

from benchmarks.checkpoint import run_config, unique_bytes
from benchmarks.common.workloads import workload


def test_2d_checkpoint_writes_each_block_once(tmp_path) -> None:
    w = workload(scale=0.01, batch=64)
    opts = {"repeats": 1, "timeout": 120.0, "root": str(tmp_path)}
    run = run_config("dtrec", "2d_mixed", w, opts, world=4)
    assert run["status"] == "ok", run.get("error")
    unique = sum(unique_bytes(w).values())
    assert unique <= run["bytes_written_total"] < 1.05 * unique, (run, unique)
    assert all(b > 0 for b in run["bytes_written_per_rank"])  # every rank wrote its part
    assert run["save_s"] > 0 and run["load_s"] > 0
