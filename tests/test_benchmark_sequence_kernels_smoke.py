"""Smoke test of benchmarks/sequence_kernels.py on CPU at tiny shapes: the unpooled op
gathers exactly the rows (checked inside the script), every variant and phase is timed,
and its bandwidth is reported against a copy of the same bytes."""

from __future__ import annotations

import json

from benchmarks.sequence_kernels import PHASES, main, traffic


def test_sequence_kernels_runs_on_cpu(tmp_path) -> None:
    path = tmp_path / "seq_kernels.json"
    argv = ["--device", "cpu", "--scale", "0.0001", "--batch", "4", "--lengths", "1,3"]
    results = main([*argv, "--iters", "1", "--json", str(path)])
    assert [r["config"]["name"] for r in results] == [
        "dlrm_seq_L1_uniform", "dlrm_seq_L1_zipf", "dlrm_seq_L3_uniform", "dlrm_seq_L3_zipf",
    ]  # fmt: skip
    for r in results:
        assert r["num_ids"] == 26 * 4 * r["config"]["length"]
        for variant in ("per_table", "batched"):
            for phase in PHASES:
                assert r[variant][f"{phase}_s"] > 0 and r[variant][f"{phase}_of_copy"] > 0
    assert json.loads(path.read_text())["meta"]["device"] is not None


def test_traffic_counts_rows_ids_and_update() -> None:
    from benchmarks.sequence_kernels import SequenceConfig

    cfg = SequenceConfig("x", [10, 10], dim=4, batch=3, length=2, dist="uniform")
    moved = traffic(cfg, unique_rows=5, elem=4)
    n = 12  # 3 samples x 2 ids x 2 tables
    assert moved["forward"] == n * (16 + 8 + 8 + 16)
    assert moved["forward_backward_optimizer"] == moved["forward"] + n * (16 + 8) + 5 * (32 + 8)
