"""Smoke test of benchmarks/managed_collision.py at tiny sizes on 4 gloo ranks: both models
train, the remap is timed inside the MC step, eviction steps are told apart, and only the
MC model gathers eviction windows."""

from __future__ import annotations

from benchmarks.managed_collision import eviction_cost, print_summary, run, workload


def test_managed_collision_benchmark_smoke(capsys) -> None:
    w = workload(scale=0.002, batch=16, vocab=4.0, interval=2)
    report = run(w, {"warmup": 3, "steps": 4, "timeout": 300.0}, world=4)
    s = report["summary"]
    assert s["modulo_step_ms"] > 0 and s["mc_step_ms"] > 0
    assert 0 < s["mc_remap_ms"] < s["mc_step_ms"]
    assert 0 < s["remap_share_of_step"] < 1
    assert s["eviction"]["steps_timed"] == 2  # steps 4 and 6 of 3..6
    assert s["eviction"]["evict_ms"] > 0 and s["eviction"]["window_bytes_per_eviction_step"] > 0
    ev = s["eviction"]
    assert 0 < ev["admit_cpu_ms"] <= ev["evict_cpu_ms"]  # CPU time, the gather left out
    mc, modulo = s["comm_per_step"]["mc"], s["comm_per_step"]["modulo"]
    assert "managed_collision.window" in mc and "input_dist.ids" in mc
    assert not any(k.startswith("managed_collision") for k in modulo)
    assert "input_dist.ids" in modulo
    print_summary(s)
    assert "remap" in capsys.readouterr().out


def test_eviction_cost_times_every_table_in_one_process() -> None:
    w = workload(scale=0.002, batch=16, vocab=4.0, interval=2)
    cost = eviction_cost(w, world=2, evictions=2)
    assert len(cost["evict_cpu_s_per_table"]) == len(w.rows)
    assert all(c > 0 for c in cost["evict_cpu_s_per_table"])
    assert cost["evict_cpu_s"] == sum(cost["evict_cpu_s_per_table"])
