"""The byte formulas behind docs/fully_sharded_2d.md's design choice hold their claims."""

from __future__ import annotations

import pytest

from benchmarks.fully_sharded_bytes import per_rank


@pytest.mark.parametrize("shards, replicas", [(2, 2), (4, 2), (2, 4), (64, 64)])
def test_routed_never_sends_more_than_the_alternatives(shards, replicas):
    x = per_rank([1000, 50, 10**6], [20, 3, 1], 64, 512, shards, replicas)
    assert x["routed_gb"] <= x["gather_gb"]
    assert x["routed_gb"] <= x["exact_sparse_gb"] * (1 + 1e-9)
    assert x["routed_peak_gb"] <= x["gather_peak_gb"]
    assert x["slice_gb"] == pytest.approx(x["shard_gb"] / replicas)


def test_every_row_touched_routed_equals_gather():
    x = per_rank([4], [1000], 8, 64, 2, 4)  # 4 rows, thousands of ids: all touched
    assert x["touched_share"] == pytest.approx(1.0)
    assert x["routed_gb"] == pytest.approx(x["gather_gb"] * (8 * 8 + 8) / (2 * 4 * 8))
