"""Smoke test of benchmarks/managed_collision_quality.py at tiny sizes (one process, a few
seconds): every model trains and is scored, evictions reset rows, the collision rate and
the AUC mean what they say."""

from __future__ import annotations

import itertools

import pytest
import torch

from benchmarks.managed_collision_quality import (
    Task,
    auc,
    collision_rate,
    make_world,
    print_report,
    run,
)


def _pairwise_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """P(a positive outscores a negative), ties half: the definition, pair by pair."""
    pos = [float(s) for s, y in zip(scores, labels, strict=True) if y > 0.5]
    neg = [float(s) for s, y in zip(scores, labels, strict=True) if y <= 0.5]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_auc_is_the_pairwise_definition_with_ties() -> None:
    gen = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 5, (60,), generator=gen).float()  # many ties
    labels = (torch.rand(60, generator=gen) < 0.4).float()
    assert auc(scores, labels) == pytest.approx(_pairwise_auc(scores, labels), abs=1e-12)
    assert auc(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0])) == 1.0
    assert auc(torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0])) == 0.5
    with pytest.raises(ValueError, match="both labels"):
        auc(torch.tensor([1.0, 2.0]), torch.ones(2))


def test_collision_rate_counts_rows_shared_with_another_live_id() -> None:
    # live ids 0..3 in rows [0, 0, 1, 2]; eval lookups: live id 0 (row 0: shared), live id 2
    # (row 1: alone), a non-live id in row 2 (held by live id 3: shared), one in row 5 (empty)
    rate = collision_rate(
        torch.tensor([0, 0, 1, 2]),
        torch.tensor([0, 1, 2, 5]),
        torch.tensor([True, True, False, False]),
    )
    assert rate == {"ids": 0.5, "lookups": 0.5}


def test_world_ids_are_distinct_and_below_2_40() -> None:
    world = make_world(Task(true_ids=500))
    assert world.ids.unique().numel() == 500
    assert int(world.ids.min()) >= 0 and int(world.ids.max()) < 2**40
    assert float(world.popularity.sum()) == pytest.approx(1.0)


def test_quality_benchmark_smoke(capsys) -> None:
    t = Task(rows=64, true_ids=512, steps=30, batch=128, interval=3, eval_samples=2000, lr=0.1)
    report = run(t, ["lfu"])
    res = report["results"]
    assert set(res) == {"modulo", "zch_lfu", "bayes"}
    zch, modulo = res["zch_lfu"], res["modulo"]
    assert zch["rows_reset_by_evictions"] > 0  # evictions happened and reset rows
    assert zch["rows_held"] == t.rows - 1
    # 512 live-ish ids in 64 rows: nearly every modulo row is shared; ZCH shares only the
    # miss row, which the Zipf head avoids
    assert modulo["collision_rate"]["lookups"] > 0.9
    assert zch["collision_rate"]["lookups"] < modulo["collision_rate"]["lookups"]
    for r in res.values():
        assert 0.0 < r["eval_auc"] < 1.0 and r["eval_logloss"] > 0
    assert res["bayes"]["eval_logloss"] < modulo["eval_logloss"]
    assert report["summary"]["best_zch"] == "zch_lfu"
    print_report(report)
    assert "best ZCH (zch_lfu)" in capsys.readouterr().out
