"""``benchmarks/dense_step.py`` runs end to end (2 ranks, tiny sizes) and checks its own
numerics: dtrec's averaged dense gradients equal DDP's at the first step."""

from __future__ import annotations

import json


def test_dense_step_smoke(tmp_path) -> None:
    from benchmarks import dense_step

    out = tmp_path / "dense_step.json"
    args = ["--worlds", "2", "--steps", "2", "--warmup", "0", "--batch", "16", "--json", str(out)]
    assert dense_step.main(args) == 0
    report = json.loads(out.read_text())
    run = report["results"]["W2"]
    assert 0.0 <= run["first_grad_rel_diff"] <= 1e-5, run["first_grad_rel_diff"]
    assert set(run["ms"]) == {"dtrec", "ddp"} and run["ratio"] > 0
    assert report["meta"]["processor"]["cores"] >= 1
