"""Smoke test of benchmarks/dynamic_2d/run.py: dtrec with a mesh per collection vs TorchRec's
``DMPCollection(submodule_configs=...)`` at tiny sizes, one world of 4 gloo ranks (pooled
collection 2 x 2, sequence collection 4 x 1).

The equal-weights check must have run and passed for both dtrec runs (exact per-step sync
and ``sync_every=1``), the byte counters must agree with dtrec's own ``comm_stats``, and
TorchRec's weight average must send what dtrec's ``sync_every=1`` average sends (the same
tables, averaged over the same replica groups). The check itself is shown to fail on
weights that differ by a fraction of the update.
"""

from __future__ import annotations

import pytest
import torch

from tests.interop.torchrec_or_skip import needs_torchrec

pytestmark = needs_torchrec

OPTS = {"warmup": 1, "steps": 2, "rounds": 1, "libs": ("torchrec", "dtrec", "dtrec_k1"),
        "timeout": 300.0}  # fmt: skip


@pytest.fixture(scope="module")
def run():
    from dataclasses import replace

    from benchmarks.dynamic_2d.model import MixedWorkload
    from benchmarks.dynamic_2d.run import run

    tiny = replace(MixedWorkload(pooled_shards=2, seq_shards=4), batch=8).scaled(0.001)
    return run(tiny, OPTS, 4)


def test_weights_equal_torchrec(run):
    from benchmarks.dynamic_2d.run import verdict

    assert run["status"] == "ok", run.get("error")
    check = verdict(run, tolerance=1e-5)
    assert check["weights_equal"] == {"dtrec_vs_torchrec": True, "dtrec_k1_vs_torchrec": True}
    assert check["passed"]
    for key, v in run["weights"].items():
        assert v["least_moved"] > 0 and v["of_update"] < 1e-2, (key, v)
    assert set(check) >= {"dtrec_step_ratio", "dtrec_bytes_ratio", "dtrec_k1_step_ratio"}


def test_bytes_are_counted_alike(run):
    for r in run["ranks"]:
        for lib in ("dtrec", "dtrec_k1"):
            mine = r["libs"][lib]
            stats = sum(v["bytes"] for v in mine["dtrec_comm_stats"].values())
            assert mine["bytes_per_step"] == pytest.approx(stats, rel=1e-9), lib
            assert mine["dense_ddp_estimate"] == 0
        theirs = r["libs"]["torchrec"]
        assert theirs["dtrec_comm_stats"] is None and theirs["dense_ddp_estimate"] > 0
        assert theirs["bytes_by_collective"]["all_to_all_single"]["bytes"] > 0
    m = run["median"]
    # The pooled collection's replica groups average the same tables, one way or the other
    average = m["torchrec"]["bytes_by_collective"]["ProcessGroup.allreduce_coalesced"]
    assert average > 0
    assert m["dtrec_k1"]["dtrec_comm_stats"]["replica_sync.weights"] == average
    # dtrec's exact sync sums gradients instead: no weight average
    assert "replica_sync.weights" not in m["dtrec"]["dtrec_comm_stats"]
    assert "grad_sync.replicate.counts" in m["dtrec"]["dtrec_comm_stats"]
    # the census (dispatch level) sees DDP's gradient all-reduce the wrappers cannot
    assert m["torchrec"]["census_bytes"]["c10d.allreduce_"] >= m["torchrec"]["dense_ddp_estimate"]


def test_check_fails_on_weights_that_differ():
    from benchmarks.dynamic_2d.model import compare_weights
    from benchmarks.dynamic_2d.run import verdict

    initial = {"t": torch.zeros(4, 2)}
    want = {"t": torch.full((4, 2), 0.01)}
    off = {"t": want["t"] + torch.tensor([[0.005, 0.0]] * 4)}  # half the update, on one column
    same = compare_weights({"t": want["t"].clone()}, want, initial)
    differ = compare_weights(off, want, initial)
    assert same["max_abs"] == 0 and same["least_moved"] == pytest.approx(0.01)
    assert differ["of_update"] == pytest.approx(0.5) and differ["max_rel"] == pytest.approx(0.5)
    result = {"weights": {"a_vs_torchrec": same, "b_vs_torchrec": differ}, "median": {}}
    assert verdict(result, 1e-5)["weights_equal"] == {"a_vs_torchrec": True, "b_vs_torchrec": False}
    still = compare_weights(want, want, {"t": want["t"].clone()})  # nothing trained
    assert not verdict({"weights": {"x": still}, "median": {}}, 1e-5)["passed"]
