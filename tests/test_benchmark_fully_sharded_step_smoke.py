"""benchmarks/fully_sharded_step.py runs end to end on a tiny workload (4 gloo ranks)."""

from __future__ import annotations

import pytest

from benchmarks.fully_sharded_step import main


def test_fully_sharded_step_smoke(tmp_path, capsys):
    out = main(["--world-size", "4", "--shards", "2", "--scale", "0.001", "--batch", "8",
                "--steps", "1", "--json", str(tmp_path / "fs.json")])  # fmt: skip
    capsys.readouterr()
    m = out["median"]
    # R = 2: each replica holds half of its shard and state (uneven slices: about half)
    assert out["ratio"]["at_rest"] == pytest.approx(0.5, rel=0.02)
    assert m["fully_sharded"]["bytes_per_axis"]["replicate"] > 0
    assert (tmp_path / "fs.json").exists()
