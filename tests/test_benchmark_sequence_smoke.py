"""Smoke test of benchmarks/sequence.py at tiny sizes: both libraries train the same
sequence model on 4 gloo ranks, from the same weights on the same batches, and the JSON
report has step times and bytes per collective."""

from __future__ import annotations

import json

from benchmarks.plots.sequence import main as plot_main
from benchmarks.probes.stages import STAGES
from benchmarks.sequence import main
from tests.interop.torchrec_or_skip import needs_torchrec


@needs_torchrec
def test_sequence_benchmark_runs_both_libraries(tmp_path, capsys) -> None:
    path = tmp_path / "sequence.json"
    argv = ["--scale", "0.01", "--batch", "8", "--steps", "2", "--warmup", "1"]
    main([*argv, "--configs", "table_wise,column_wise", "--json", str(path)])
    out = capsys.readouterr().out
    assert "ratio" in out and "CPU ms per step by stage" in out
    results = json.loads(path.read_text())["results"]
    for config in ("table_wise", "column_wise"):
        ours, theirs = results[config]["dtrec"], results[config]["torchrec"]
        assert ours["status"] == theirs["status"] == "ok", (ours, theirs)
        assert ours["step_ms"] > 0 and ours["bytes_per_step"] > 0
        # same weights, same batches: the first loss agrees (the models are the same)
        assert abs(ours["losses_rank0"][0] - theirs["losses_rank0"][0]) < 1e-5
        for lib, run in (("dtrec", ours), ("torchrec", theirs)):
            # every wrapped stage exists in the installed library (else the table lies)
            assert run["stages_not_timed"] == [], (lib, run["stages_not_timed"])
            cpu = run["median"]["stage_cpu_ms"]
            assert set(STAGES) <= set(cpu) and sum(cpu[s] for s in STAGES) > 0
            assert run["median"]["stage_ms"]["lookup_fwd"] > 0, lib
        assert ours["median"]["stage_cpu_ms"]["fused_update"] > 0
    # table-wise: the same rows cross the wire; dtrec adds only its fixed-size header
    tw = results["table_wise"]
    assert tw["dtrec"]["bytes_per_step"] <= tw["torchrec"]["bytes_per_step"] * 1.01
    png = tmp_path / "sequence.png"
    plot_main([str(path), "-o", str(png)])
    assert png.stat().st_size > 0
