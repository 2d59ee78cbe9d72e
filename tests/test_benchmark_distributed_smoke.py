"""Smoke test of benchmarks/distributed.py: the dtrec side at tiny sizes, and its cost model.

TorchRec is not needed (nor imported): only dtrec runs, in two fresh worlds of 4 gloo ranks
(``mixed``: every 1D sharding type; ``2d_row_wise``: a (2, 2) mesh with replica sync). The
byte counter must agree with dtrec's own ``comm_stats``, the dispatch census must see DDP's
all-reduce, and the cost model must predict the measured bytes. The cost model is also
checked against closed forms (row-wise input/output dist) at the benchmark's real sizes.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from benchmarks.common.cost_model import cost_model
from benchmarks.common.run_loop import run_config
from benchmarks.common.step_prediction import _dense, _zipf, check
from benchmarks.common.workloads import (
    config_shards,
    table_kinds,
    workload,
    zipf_ids,
    zipf_row_probs,
)
from benchmarks.distributed import check_targets, cost_model_table
from benchmarks.probes import cpu_calibration
from benchmarks.probes.stages import STAGES

CONFIGS = ("mixed", "2d_row_wise")
TINY = workload(scale=0.01, batch=32)
# ``mixed`` runs the second workload (16 tables of 5..50k rows here, some smaller than S)
SMALL_TABLES = workload(scale=0.05, batch=32, kind="mixed_sizes")
WORKLOADS = {"mixed": SMALL_TABLES, "2d_row_wise": TINY}
OPTS = {"steps": 2, "warmup": 1, "census_steps": 1, "timeout": 120.0, "profile": 1}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    return {config: run_config("dtrec", config, WORKLOADS[config], OPTS) for config in CONFIGS}


def test_workloads():
    big, small = workload(), workload(kind="mixed_sizes")
    assert len(big.rows) == 8 and (big.rows[0], big.rows[-1], big.zipf) == (100_000, 1_000_000, 1.1)
    assert len(small.rows) == 16 and (small.rows[0], small.rows[-1]) == (100, 1_000_000)
    assert small.zipf == 1.05 and small.mean_bag == 20
    assert table_kinds("mixed", 4, 8) == ["dp", "dp", "tw:2", "tw:3", "cw", "cw", "rw", "rw"]
    assert table_kinds("mixed", 4, 16)[3:5] == ["dp", "tw:0"]
    with pytest.raises(ValueError, match="unknown workload"):
        workload(kind="tiny")


@pytest.mark.parametrize("config", CONFIGS)
def test_runs_and_counts(runs, config):
    run = runs[config]
    assert run["status"] == "ok", run.get("error")
    assert len(run["ranks"]) == 4
    for r in run["ranks"]:
        assert len(r["step_ms"]) == OPTS["steps"] and min(r["step_ms"]) > 0
        assert r["bytes_by_collective"]["all_to_all_single"]["bytes"] > 0
        # dtrec's dense gradient all-reduce is its own c10d call: seen, no estimate needed.
        assert r["dense_ddp_estimate"] == 0
        assert r["dtrec_comm_stats"]["dense.grad_sync"]["bytes"] > 0
        # The torch.distributed wrappers see exactly what dtrec says it sent.
        stats = sum(v["bytes"] for v in r["dtrec_comm_stats"].values())
        assert r["bytes_per_step"] == pytest.approx(stats, rel=1e-9)
        assert r["peak_rss_mb"] > 0
        assert r["stages_not_timed"] == []  # every stage's method exists in dtrec
    assert "1 steps of rank 0" in run["ranks"][0]["profile"]  # --profile: rank 0's tables
    assert all(r["profile"] is None for r in run["ranks"][1:])
    assert {r["cpu_rowwise_adagrad"] for r in run["ranks"]} in ({"fbgemm"}, {"torch"})
    m = run["median"]
    assert m["step_ms"] > 0
    # The exclusive stages add up to (almost) the step; data-parallel lookups, the fused
    # update and the pooled exchange each took time.
    assert sum(m["stage_ms"][s] for s in STAGES) == pytest.approx(m["step_ms"], rel=0.2)
    assert min(m["stage_cpu_ms"][s] for s in ("lookup_fwd", "output_dist", "fused_update")) > 0
    assert m["collectives_per_step"] >= 4 and m["host_reads_per_step"] > 0


def test_header_bytes_are_the_closed_form(runs):
    # 2 shard positions serving every table's one row-wise segment: to the one peer, 4 int32
    # fields and an int32 id count per segment; the verdict (an int32 header slot) is
    # all-reduced over the 2 replicas.
    tables = len(TINY.rows)
    for r in runs["2d_row_wise"]["ranks"]:
        stats = r["dtrec_comm_stats"]
        assert stats["input_dist.header"]["bytes"] == 4 * (4 + tables)
        assert stats["input_dist.verdict"]["bytes"] == 4


def test_census_sees_the_dense_all_reduce_exactly(runs):
    # No column-wise table: besides the dense gradient all-reduce only the input-dist verdict.
    for r in runs["2d_row_wise"]["ranks"]:
        verdict = r["dtrec_comm_stats"]["input_dist.verdict"]["bytes"]
        dense = r["dtrec_comm_stats"]["dense.grad_sync"]["bytes"]
        census = r["census_per_step"]["c10d.allreduce_"]["bytes"]
        assert census == dense + verdict
        assert "grad_sync.replicate.sparse" in r["dtrec_comm_stats"]


@pytest.mark.parametrize("config", CONFIGS)
def test_cost_model_predicts_measured_bytes(runs, config):
    check = runs[config]["cost_model_check"]
    assert check["model_mean_bytes"] == pytest.approx(check["measured_mean_bytes"], rel=0.1)
    measured = runs[config]["median"]["dtrec_comm_stats"]  # the tables' kinds: the model's
    assert set(check["model_by_kind"]) - {"input_dist.lengths", "input_dist.id_values"} == {
        k for k in measured if not k.startswith("dense.")
    }


def test_zipf_sampler_matches_row_probabilities():
    rows, n = 1000, 200_000
    p = zipf_row_probs(rows, 1.1)
    assert p.sum() == pytest.approx(1.0, abs=1e-12) and (p > 0).all()
    ids = zipf_ids(rows, n, 1.1, torch.Generator().manual_seed(0)).numpy()
    counts = np.bincount(ids, minlength=rows)
    hot = np.argsort(p)[-5:]
    sigma = np.sqrt(n * p[hot] * (1 - p[hot]))
    assert np.all(np.abs(counts[hot] - n * p[hot]) < 5 * sigma)
    draws = 20_000
    expected_unique = np.sum(-np.expm1(draws * np.log1p(-p)))
    assert len(np.unique(ids[:draws])) == pytest.approx(expected_unique, rel=0.03)


def test_cost_model_row_wise_closed_forms():
    w = workload()  # the benchmark's real sizes: every row block is non-empty
    tables, batch, bag, dim = len(w.rows), w.batch, w.mean_bag, w.dim
    for shards in (8, 64):
        by_world = {}
        for world in (shards, 8 * shards):
            kinds = table_kinds("row_wise", shards, tables)
            by_world[world] = m = cost_model(w, kinds, world, shards)["mean_by_kind"]
            # Every peer gets B lengths per table; ids leave unless their row is local;
            # both as int32 (every table has fewer than 2**31 rows).
            assert m["input_dist.lengths"] == pytest.approx(4 * batch * tables * (shards - 1))
            assert m["input_dist.id_values"] == pytest.approx(
                4 * batch * bag * tables * (shards - 1) / shards
            )
            # The header: 4 int32 fields and an id count per segment (one per table) a peer
            # serves.
            assert m["input_dist.header"] == pytest.approx(4 * (4 + tables) * (shards - 1))
            partials = (shards - 1) * batch * tables * dim * 4
            assert m["output_dist"] == pytest.approx(partials)
            assert m["output_dist.backward"] == pytest.approx(partials)
        small, large = by_world[shards], by_world[8 * shards]
        # Input dist depends on S, not on W; only replica sync grows with R.
        assert small["input_dist.ids"] == large["input_dist.ids"]
        assert "grad_sync.replicate.counts" not in small
        sync = sum(v for k, v in large.items() if k.startswith("grad_sync.replicate."))
        assert sync > 0


def test_cost_model_table_is_finite_and_beats_dense_all_reduce():
    rows = cost_model_table(TINY)
    assert rows
    for row in rows:
        if "error" in row:  # column-wise needs embedding_dim >= S
            assert row["type"] in ("column_wise", "mixed", "grid") and row["S"] > TINY.dim
            continue
        assert math.isfinite(row["max_total"])
        assert 0 < row["mean_total"] <= row["max_total"] * (1 + 1e-12)
        if row["type"] == "data_parallel":
            # Sparse-or-dense sync never sends more than a full-table all-reduce (whose rows
            # carry one extra touch-count column in dtrec's dense path), plus the counts
            # and the input-dist verdict (8 bytes all-reduced).
            world, tables = row["W"], len(TINY.rows)
            dense = 2 * (world - 1) / world * sum(TINY.rows) * (TINY.dim + 1) * 4
            assert row["mean_total"] <= dense + (world - 1) * tables * 8 + 16


def test_config_shards():
    assert config_shards("row_wise", 4) == 4 and config_shards("2d_mixed", 4) == 2
    assert table_kinds("mixed", 2) == ["dp", "dp", "tw:0", "tw:1", "cw", "cw", "rw", "rw"]


def test_targets_are_ratios_of_one_run(capsys):
    def run(ms: float, nbytes: float) -> dict:
        return {"status": "ok", "median": {"step_ms": ms, "total_bytes_per_step": nbytes}}

    results = {
        "table_wise": {"dtrec": run(7.0, 90.0), "torchrec": run(10.0, 100.0)},
        "row_wise": {"dtrec": run(8.0, 90.0), "torchrec": run(10.0, 100.0)},
        "column_wise": {"dtrec": run(7.0, 110.0), "torchrec": run(10.0, 100.0)},
        "data_parallel": {"dtrec": run(7.0, 90.0)},  # no TorchRec run: no verdict
    }
    out = check_targets(results, 0.75)
    assert {k: v["meets"] for k, v in out.items()} == {
        "table_wise": True, "row_wise": False, "column_wise": False,
    }  # fmt: skip
    assert out["row_wise"]["step_ratio"] == pytest.approx(0.8)
    assert "MISSES" in capsys.readouterr().out


def test_processor_is_recorded():
    from benchmarks.probes.machine import FLAGS_THAT_MATTER, processor, processor_line

    info = processor()
    assert info["model"] and info["aten"] and info["cores"] >= 1
    assert set(info["flags"]) <= set(FLAGS_THAT_MATTER)
    assert info["model"] in processor_line(info)


def test_the_report_predicts_each_step_from_calibrated_constants(runs, capsys) -> None:
    """The calibration's compute probes (in this process: the world's collective probes and
    host floor run only in the benchmark) feed the predicted-vs-measured table."""
    sample = functools.partial(_zipf, s=TINY.zipf)
    calibration = cpu_calibration.embedding_constants(sample, repeats=1)
    width = len(TINY.rows) * TINY.dim
    calibration["dense_s"] = cpu_calibration.dense_constants(_dense(TINY), TINY.batch, width, 1)
    calibration.update(latency_s=1e-3, a2a_bandwidth=1e9, gather_bandwidth=5e8, host_s=0.0,
                       wall_s=0.0)  # fmt: skip
    topology = cpu_calibration.topology(calibration)
    assert topology.hbm_bandwidth > 0 and topology.collective_latency == 1e-3
    # the machine got busy during the configs: calls 1000x dearer, far past DRIFT however
    # long the compute probes (measured here, on a machine maybe loaded) made the step
    slower = {**calibration, "latency_s": 1.0}
    # (the report's mechanics: "mixed" ran SMALL_TABLES, predicted here for TINY's tables)
    report = check(TINY, {c: {"dtrec": runs[c]} for c in CONFIGS}, calibration, after=slower)
    for config in CONFIGS:
        row = report["configs"][config]
        assert row["predicted_ms"] > 0 and row["measured_ms"] == runs[config]["median"]["step_ms"]
        assert row["error"] == pytest.approx(row["predicted_ms"] / row["measured_ms"] - 1)
        assert row["drift"] > 0
    out = capsys.readouterr().out
    assert "ordering: " in out and "WARNING, the machine's speed changed" in out
