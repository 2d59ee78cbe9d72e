"""The soak harness stays alive: a short ``benchmarks/soak/run.py`` run (about 30-60 s on 2
cores) with every fault type, each once or twice, ends with nothing lost and the final
weights equal to the unsharded reference that replays the run's log.

Marked ``slow`` (``-m "not slow"`` leaves it out of a quick loop) and ``always``: unlike
the other slow tests it runs in ``make test`` without ``--slow`` (``tests/conftest.py``),
so CI keeps the harness working. Odd batches (half a batch, or none, on one rank)
must train on every rank (``--uneven train``), and the reference replays them.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.soak.run import FAULTS, TOL, main


@pytest.mark.slow
@pytest.mark.always
def test_short_soak_loses_nothing(tmp_path, capsys) -> None:
    out = tmp_path / "soak.json"
    png = tmp_path / "soak.png"
    report = main(["--steps", "150", "--faults", "1", "--uneven", "train",
                   "--json", str(out), "--plot", str(png)])  # fmt: skip
    printed = capsys.readouterr().out
    assert "final weights vs unsharded reference: max abs diff" in printed
    assert json.loads(out.read_text())["ok"] == report["ok"]
    assert png.stat().st_size > 0
    for kind in FAULTS:
        row = report["faults"][kind]
        assert row["injected"] >= 1 and row["lost"] == 0, (kind, row, report["attempts"])
        assert row["survived"] == row["injected"], (kind, row)
    assert report["faults"]["unexpected"]["lost"] == 0, report["unexpected"]
    # two killed saves and a killed rank: three relaunches, each from a checkpoint whose
    # full state was bitwise the one saved
    starts = [a["start"] for a in report["attempts"]]
    assert len(starts) == 4 and all(s["digest_ok"] for s in starts), starts
    assert report["reference"]["max_abs_diff"] <= TOL, report["reference"]
    assert report["reference"]["max_loss_diff"] <= 1e-4, report["reference"]
    steps = report["steps"]
    assert len(set(steps["plan"])) == 3 and any(t == "good" for t in steps["tag"])
    assert steps["tag"].count("uneven") >= 1  # an odd batch trained (and was replayed)
    assert report["ok"]
