"""Smoke test of benchmarks/composed.py at a tiny size: the example's composition (TP +
HSDP dense, tables on the 2D table mesh with same_batch), dtrec with FSDP2 only and
TorchRec's DMP + DDP train the same HSTU model on 8 gloo ranks; the report has step times,
peak RSS, the dense part's bytes per rank (FSDP's a fraction of the full model's, DDP's all
of it) and dtrec's collective bytes per mesh dim."""

from __future__ import annotations

import json

from benchmarks.composed import main
from tests.interop.torchrec_or_skip import needs_torchrec


@needs_torchrec
def test_composed_benchmark_runs_dtrec_and_torchrec(tmp_path, capsys) -> None:
    path = tmp_path / "composed.json"
    argv = [
        "--steps",
        "1",
        "--warmup",
        "1",
        "--repeats",
        "1",
        "--batch",
        "4",
        "--malloc-default",
        "--json",
        str(path),
    ]
    main(argv)
    out = capsys.readouterr().out
    assert "dtrec_tp_hsdp / torchrec_ddp: step" in out and "by mesh dim" in out
    report = json.loads(path.read_text())
    meta = report["meta"]
    assert meta["device"] == "cpu" and meta["processor"]["model"]
    assert meta["torch"] and meta["torchrec"] and meta["date"][:2] == "20"
    assert meta["command"].startswith("python -m benchmarks.composed")
    results = report["results"]
    ours, fsdp, theirs = (results[m] for m in ("dtrec_tp_hsdp", "dtrec_fsdp", "torchrec_ddp"))
    assert ours["status"] == fsdp["status"] == theirs["status"] == "ok", results
    # rank 0 is dp group 0 in all: the same batch, the same starting weights, the same loss
    assert abs(ours["losses_rank0"][0] - theirs["losses_rank0"][0]) < 1e-5
    assert abs(fsdp["losses_rank0"][0] - theirs["losses_rank0"][0]) < 1e-5
    for run in (ours, fsdp, theirs):
        assert run["step_ms"] > 0 and run["samples_per_s"] > 0 and run["peak_rss_mb"] > 0
        assert len(run["step_ms_per_rank"]) == 8
    full = ours["full_dense_bytes"]
    assert full == theirs["full_dense_bytes"] > 0
    # FSDP (dp_shard 2) x TP 2 really shards: about a quarter (the root's parameters are
    # not TP-split), never the whole
    assert ours["dense_bytes_max"] < 0.5 * full
    # FSDP over 8: an eighth plus padding (and Adam's per-parameter step scalars)
    assert fsdp["dense_bytes_max"] < 0.2 * full
    mem, ddp = ours["memory_per_rank"], theirs["memory_per_rank"]
    assert all(b < f for b, f in zip(mem["dense_param_bytes"], mem["full_dense_param_bytes"]))
    # DDP holds the whole dense model, its gradients and Adam state on every rank
    assert ddp["dense_param_bytes"] == ddp["full_dense_param_bytes"]
    assert ddp["dense_grad_bytes"] == ddp["full_dense_param_bytes"]
    assert theirs["dense_bytes_max"] == full
    for run in (mem, fsdp["memory_per_rank"], ddp):  # tables are sharded: no rank holds them all
        assert 0 < max(run["table_weight_bytes"]) < sum(run["table_weight_bytes"]) / 2
    # dtrec's bytes: same_batch's gather crosses tp, the tables' gradient sync the replicas
    axes = ours["bytes_per_axis_per_step"]
    assert axes["tp"] > 0 and axes["replicate"] > 0 and axes["shard"] > 0
    assert ours["comm_per_step"]["same_batch.gather"]["bytes"] > 0
    assert set(fsdp["bytes_per_axis_per_step"]) >= {"world"} and "tp" not in fsdp["comm_per_step"]
    assert theirs["comm_per_step"] == {}  # comm_stats sees only dtrec's collectives
