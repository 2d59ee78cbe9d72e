"""Smoke test of benchmarks/gpu_step.py (``--smoke``: tiny sizes on CPU) and its probes.

The GPU numbers come from the CUDA machine (``make gpu-check``); here every code path of
the benchmark runs once, in a subprocess (it starts its own 1-rank process group), and
the probes are checked on cases where the right answer is known.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.probes.step import FullTableWatch, StageTimer, StepCounter, SyncSites

REPO = Path(__file__).resolve().parents[1]


def test_smoke_run_reports_every_measure(tmp_path) -> None:
    out = tmp_path / "gpu_step.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_step.py", "--smoke", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["meta"]["device"] == "cpu" and report["meta"]["copy_GBps"] > 0
    assert len(report["workload"]["rows"]) == 26
    assert sorted(report["results"]) == ["B64_multi_hot", "B64_one_hot"]
    check = report["full_table_check"]
    assert check["watched_tables"] and check["violations"] == []
    for config in report["results"].values():
        assert sorted(config) == ["dtrec", "pytorch"]
        for library, r in config.items():
            assert r["step_s"] > 0 and r["embedding"]["GBps"] > 0, library
            assert r["stages"]["not_found"] == [], library  # every stage found its code
            assert {"forward", "sparse_fwd", "dense_fwd"} <= set(r["stages"]["host_s"])
            assert set(r["profile"]) == {"step", "embedding", "dense"}
        stages = config["dtrec"]["stages"]["host_s"]
        # a 1-rank world: nothing to move, so no output dist (dtrec/sharded/lookup/local_path.py)
        assert {"input_dist", "lookup_fwd", "bwd_and_fused_update"} <= set(stages)
        assert config["dtrec"]["pipelined_step_s"] > 0
        counts = config["dtrec"]["counts"]["embedding"]
        assert counts["launches"] > 0 and counts["syncs"] >= 0
    # issue 24's table: one row per config, every column filled
    table = report["issue_table"]
    assert [row["config"] for row in table] == sorted(report["results"])
    for row in table:
        assert all(value is not None for value in row.values()), row
        assert row["of_copy"] > 0 and row["embedding_vs_pytorch"] > 0
    assert "| B64_multi_hot |" in done.stdout  # printed as markdown too


def test_compile_smoke_traces_the_one_rank_step_whole(tmp_path) -> None:
    """``--compile`` (issue 32): the DLRM step under ``torch.compile`` on CPU, its forward
    one graph (the embedding part of a one-rank world has no graph break)."""
    out = tmp_path / "gpu_step_compiled.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_step.py", "--smoke", "--compile", "--no-pytorch",
         "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["meta"]["args"]["compile"] is True
    for name, config in report["results"].items():
        compiled = config["dtrec"]["compiled"]
        assert compiled["graph_breaks"] == 0, (name, compiled["break_reasons"])
        assert compiled["graphs"] == 1 and compiled["step_s"] > 0, name
    assert "breaks]" in done.stdout


def test_mlperf_dense_arch_in_bf16_smoke(tmp_path) -> None:
    """``--dense mlperf --dense-dtype bf16`` (issue 47): MLPerf DLRM-DCNv2's dense arch
    trains under bf16 autocast: its matmuls output bf16, the loss stays finite, and the
    report names the arch and dtype beside samples/s."""
    import math

    from benchmarks.common.dense_arch import MLPerfDenseArch

    out = tmp_path / "gpu_step_mlperf.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_step.py", "--smoke", "--no-pytorch", "--dense",
         "mlperf", "--dense-dtype", "bf16", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["meta"]["args"]["dense"] == "mlperf"
    for name, config in report["results"].items():
        r = config["dtrec"]
        assert r["dense"]["arch"] == "mlperf" and r["dense"]["dtype"] == "bf16", name
        assert r["dense"]["linear_output_dtypes"] == ["torch.bfloat16"], (name, r["dense"])
        assert math.isfinite(r["dense"]["loss"]) and r["samples_per_s"] > 0, (name, r)
    for row in report["issue_table"]:
        assert (row["dense_arch"], row["dense_dtype"]) == ("mlperf", "bf16"), row
    # the arch's shape: MLPerf's layers (bottom 512-256-D, 3 cross layers rank 512, top)
    arch = MLPerfDenseArch(26 * 16, 16)
    linears = [m for m in arch.modules() if isinstance(m, torch.nn.Linear)]
    assert [m.out_features for m in arch.bottom if isinstance(m, torch.nn.Linear)] == [512, 256, 16]
    assert [m.out_features for m in arch.cross.v] == [512] * 3
    assert [m.out_features for m in arch.top if isinstance(m, torch.nn.Linear)] == [
        1024, 1024, 512, 256, 1,
    ]  # fmt: skip
    assert len(linears) == 3 + 6 + 5
    dense, pooled = torch.randn(4, 13), torch.randn(4, 26 * 16)
    assert arch(dense, pooled).dtype == torch.float32  # fp32: no autocast
    assert {str(m.weight.dtype) for m in linears} == {"torch.float32"}


def test_full_table_watch_flags_new_table_sized_tensors_only() -> None:
    flat = torch.zeros(100 * 8 + 10)
    with FullTableWatch({"t": (100, 8)}) as watch:
        flat[:800].view(100, 8).add_(1)  # a view of existing memory, written in place
        torch.zeros(50, 8)  # touched rows, not the table
    assert watch.violations == []
    with FullTableWatch({"t": (100, 8)}) as watch:
        flat[:800].view(100, 8).clone()  # a copy of the whole table
    assert len(watch.violations) == 1 and "table 't'" in watch.violations[0]


def test_sync_sites_name_the_line_that_waits_for_the_device() -> None:
    ids = torch.tensor([3, 0, 5])
    with SyncSites(torch.device("cpu")) as sites:
        int(ids.max())
        ids.nonzero()
        torch.repeat_interleave(ids, ids, output_size=8)  # size given: no wait
        ids + 1
    assert sum(sites.sites.values()) == 2, sites.sites
    assert all("test_benchmark_gpu_step_smoke.py" in site for site in sites.sites)


def test_stage_timer_times_wrapped_methods_and_reports_missing_ones() -> None:
    class Work:
        def run(self) -> int:
            return 1

    timer = StageTimer(torch.device("cpu"))
    with timer.wrapping([("run", Work, "run"), ("gone", Work, "renamed")]) as missing:
        assert Work().run() == 1
    assert missing == ["test_stage_timer_times_wrapped_methods_and_reports_missing_ones."
                       "<locals>.Work.renamed"]  # fmt: skip
    assert timer.calls["run"] == 1 and "run" in timer.host_s
    assert Work.run.__name__ == "run"  # unwrapped again


def test_step_counter_counts_kernel_launches_and_host_reads() -> None:
    pytest.importorskip("triton")
    from dtrec.kernels.embedding_bag import embedding_bag_fwd

    w = torch.randn(10 * 4)
    ids, offsets = torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3])
    one = torch.ones(1, dtype=torch.int64)
    with StepCounter(torch.device("cpu")) as counts:
        out = embedding_bag_fwd(
            w,
            one * 0,
            one.int() * 4,
            one.int() * 0,
            one.int() * 0,
            ids,
            offsets,
            batch_size=2,
            total_dim=4,
            mean=one.bool() & False,
            max_dim=4,
        )
        out.view(-1)[:3].t()  # views: no launch
        out.sum(0).tolist()  # one launch, one host read
        torch.repeat_interleave(ids, ids, output_size=6)  # size given: no read
    triton = {k: n for k, n in counts.launches.items() if k.startswith("triton:")}
    assert sum(triton.values()) == 1, counts.launches  # the interpreter's own ops not counted
    assert counts.launches["aten.sum"] == 1 and "aten.view" not in counts.launches
    assert counts.total_syncs() == 1 and "Tensor.tolist" in next(iter(counts.syncs))
    assert torch.Tensor.tolist.__name__ == "tolist"  # unpatched again
