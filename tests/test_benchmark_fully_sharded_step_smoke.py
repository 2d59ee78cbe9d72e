"""benchmarks/fully_sharded_step.py runs end to end on a tiny workload (4 gloo ranks): dtrec's
exact and fully sharded 2D, TorchRec's DMPCollection, and TorchRec's FULLY_SHARDED refusal."""

from __future__ import annotations

import pytest

from benchmarks.fully_sharded_step import main
from benchmarks.plots.fully_sharded import main as plot_main
from tests.interop.torchrec_or_skip import torchrec


def test_fully_sharded_step_smoke(tmp_path, capsys):
    out = main(["--world-size", "4", "--shards", "2", "--scale", "0.001", "--batch", "8",
                "--steps", "1", "--json", str(tmp_path / "fs.json")])  # fmt: skip
    capsys.readouterr()
    config = out["configs"]["4x2"]
    m = config["median"]
    # R = 2: each replica holds half of its shard and state (uneven slices: about half)
    assert config["ratio"]["at_rest"] == pytest.approx(0.5, rel=0.02)
    assert m["fully_sharded"]["bytes_per_axis"]["replicate"] > 0
    assert m["exact"]["bytes_per_axis"]["replicate"] > 0  # its replica sync
    # a step allocates (the compact tables, the pooled outputs, their gradients)
    assert all(m[name]["step_peak_bytes"] > 0 for name in m)
    assert (tmp_path / "fs.json").exists()
    plot_main([str(tmp_path / "fs.json"), "-o", str(tmp_path / "fs.png")])
    assert (tmp_path / "fs.png").stat().st_size > 0
    if torchrec is None:
        return
    # TorchRec's 2D ran beside them; its FULLY_SHARDED strategy refuses CPU (recorded)
    assert m["torchrec"]["at_rest_bytes"] > 0
    assert "cuda" in config["refused"]["torchrec_fully_sharded"].lower()
