"""Smoke test of benchmarks/qcomms.py at tiny sizes: one world of 4 gloo ranks on a (2, 2)
mesh, fp32 / bf16 / fp16 round robin. The quantized collectives must send exactly half the
fp32 bytes, the others the same, and the summary must say so."""

from __future__ import annotations

import pytest

from benchmarks.common.workloads import workload
from benchmarks.qcomms import PRECISIONS, QUANTIZED_KINDS, run_rank, summarize
from tests.multiprocess import run_world


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_world(4, run_rank, "2d_row_wise", workload(scale=0.01, batch=32), 2, 1, timeout=240)


def test_quantized_collectives_halve(ranks) -> None:
    for r in ranks:
        fp32 = r["bytes_per_step"]["fp32"]
        assert {"output_dist", "output_dist.backward"} <= set(fp32)
        for name in ("bf16", "fp16"):
            sent = r["bytes_per_step"][name]
            assert set(sent) == set(fp32)
            for kind, nbytes in fp32.items():
                expected = nbytes / 2 if kind in QUANTIZED_KINDS else nbytes
                assert sent[kind] == expected, (name, kind)


def test_summary(ranks) -> None:
    summary = summarize(ranks)
    assert set(summary["step_ms"]) == set(PRECISIONS)
    for name in ("bf16", "fp16"):
        assert summary["quantized_bytes_ratio"][name]["quantized_collectives"] == 0.5
        assert 0.5 < summary["quantized_bytes_ratio"][name]["all_dtrec_collectives"] < 1.0
    assert summary["max_local_weight_diff_vs_fp32"]["fp32"] == 0.0
