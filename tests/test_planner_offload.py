"""The planner's host tier: tables that do not fit the device budget are offloaded.

The device keeps what fits; the tables with the fewest ids per byte move to host memory
behind device caches sized from what is left of the budget; the cost model prices their
cache misses (LRU by Che's approximation, checked here against a simulated LRU cache),
and the plan's explanation says why. A world whose tables fit in neither tier is refused.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import pytest
from torch import nn

import dtrec
from dtrec.placements import TableWise
from dtrec.placements.mesh import ShardAxis
from dtrec.planning.cost_model import UniformIds, table_cost
from dtrec.planning.explain import explain
from dtrec.planning.offload import ZipfIds, expected_misses, row_buckets
from dtrec.planning.plan import model_tables
from dtrec.planning.planner import TableConstraint, plan_tables
from tests.fake_world import fake_world

MiB = 2**20


def _model() -> nn.Module:
    model = nn.Module()
    model.sparse = dtrec.EmbeddingBagCollection(
        [
            dtrec.EmbeddingBagConfig("big", 1_000_000, 64, ["f0"]),  # 1 id / 1M rows: coldest
            dtrec.EmbeddingBagConfig("mid", 200_000, 64, ["f1", "f2"]),
            dtrec.EmbeddingBagConfig("small", 5_000, 32, ["f3"]),
        ],
        device="meta",
    )
    return model


def _topology(memory: float, host: float = 2e9, **kw) -> dtrec.Topology:
    return dtrec.Topology.cpu(
        memory_per_rank=memory, host_memory_per_rank=host, batch_size_per_rank=256, **kw
    )


def _plan(topology: dtrec.Topology):
    with fake_world(0, 4):
        mesh = dtrec.init_mesh("cpu", 4)
        return dtrec.plan(_model(), mesh, topology=topology)


def test_everything_on_the_device_when_it_fits() -> None:
    plan = _plan(_topology(200e6))
    assert not any(getattr(spec, "offloaded", False) for spec in plan.values()), plan
    assert not any(plan.report.host_memory)


def test_a_table_that_does_not_fit_the_budget_is_offloaded_and_the_plan_says_why() -> None:
    topology = _topology(50e6, zipf_exponent=1.1)
    plan = _plan(topology)
    big = plan["sparse.big"]
    assert big.offloaded and big.cache_rows is not None, plan
    assert not plan["sparse.mid"].offloaded and not plan["sparse.small"].offloaded, plan
    block_rows = 1_000_000 // 4 if "CW" not in str(big) else 1_000_000
    assert 0 < big.cache_rows < block_rows  # a cache, not the whole block
    report = plan.report
    assert max(report.memory) <= topology.memory_budget
    assert 0 < max(report.host_memory) <= topology.host_budget
    text = str(plan)
    assert "offloaded: on the device alone the tables need more than the 42.9 MiB budget" in text
    assert "(['sparse.big']) live in host memory" in text
    assert "+ " in text and " host" in text  # per position: device MiB + host MiB
    # the explanation: cache size, expected hit rate and the ids it assumes
    with fake_world(0, 4):
        axis = ShardAxis(4, 1, None)
        tables = model_tables(_model())
        choices, _ = plan_tables(tables, axis, None, topology)
        why = explain(tables, choices, axis, topology)
    assert f"device caches of {big.cache_rows} rows" in why
    assert "expected hit rate" in why and "Zipf(1.1) ids" in why
    assert "host link" in why and "offload.host_to_device" in why


def test_the_leftover_device_budget_goes_to_the_cache() -> None:
    small, large = _plan(_topology(45e6)), _plan(_topology(60e6))
    assert small["sparse.big"].cache_rows < large["sparse.big"].cache_rows


def test_without_host_memory_a_table_that_does_not_fit_is_an_error() -> None:
    with pytest.raises(ValueError, match="'sparse.big' .1000000 x 64. does not fit: even as"):
        _plan(_topology(50e6, host=0.0))


def test_an_offload_constraint_is_kept() -> None:
    with fake_world(0, 4):
        mesh = dtrec.init_mesh("cpu", 4)
        plan = dtrec.plan(
            _model(), mesh, {"sparse.small": TableConstraint(cache_fraction=0.5)},
            topology=_topology(200e6),
        )  # fmt: skip
    assert plan["sparse.small"].cache_fraction == 0.5, plan


def test_offloaded_cost_device_cache_host_block_and_miss_bytes() -> None:
    cfg = dtrec.EmbeddingBagConfig("t", 100_000, 16, ["f"])
    axis, topology = ShardAxis(2, 1, None), _topology(1e9)
    device = table_cost(cfg, TableWise(rank=0), axis, topology)
    cached = table_cost(cfg, TableWise(rank=0, cache_rows=10_000), axis, topology)
    row = 16 * 4 + 4  # weight + row-wise Adagrad's sum
    assert cached.host_memory[0] == 100_000 * row and cached.host_memory[1] == 0
    assert cached.memory[0] < device.memory[0] / 4
    ids = 2 * 256 * 1.0  # one id per sample, two ranks' batches
    read, missed = expected_misses(*row_buckets(UniformIds(100_000), 0, 100_000), ids, 10_000)
    assert missed == pytest.approx(read * 0.9, rel=1e-6)  # uniform: hit rate = cache share
    assert cached.host_link_bytes[0] == pytest.approx(missed * row)
    assert device.host_link_bytes.sum() == 0


@pytest.mark.parametrize("s", [0.0, 0.8, 1.1])
def test_expected_misses_match_a_simulated_lru_cache(s: float) -> None:
    rows, capacity, per_step, steps = 20_000, 2_000, 400, 400
    rng = random.Random(0)
    if s == 0:
        probs = np.full(rows, 1 / rows)
    else:  # rank k (1..rows): the power law's mass on [k, k + 1), as benchmarks draw ids
        edge = np.arange(1, rows + 2, dtype=np.float64) ** (1 - s)
        probs = (edge[:-1] - edge[1:]) / (edge[0] - edge[-1])
    scatter = list(range(rows))
    rng.shuffle(scatter)  # hashed ids: hot ranks anywhere in the table
    cache: OrderedDict[int, None] = OrderedDict()
    read = missed = 0
    draws = np.random.default_rng(1).choice(rows, size=(steps, per_step), p=probs)
    for step, ranks in enumerate(draws):
        batch = {scatter[r] for r in ranks}
        if step >= steps // 4:  # after warm-up
            read += len(batch)
            missed += sum(r not in cache for r in batch)
        for r in batch:
            cache.pop(r, None)
            cache[r] = None
        while len(cache) > capacity:
            cache.popitem(last=False)
    ids = UniformIds(rows) if s == 0 else ZipfIds(rows, s)
    want_read, want_missed = expected_misses(*row_buckets(ids, 0, rows), per_step, capacity)
    measured = steps - steps // 4
    assert read / measured == pytest.approx(want_read, rel=0.05)
    assert 1 - missed / read == pytest.approx(1 - want_missed / want_read, abs=0.03)


def test_planner_cli_offloads_with_host_memory(tmp_path, capsys) -> None:
    import json

    from dtrec.planning.dry_run import main

    config = tmp_path / "model.json"
    config.write_text(json.dumps({
        "tables": [
            {"name": "big", "num_embeddings": 2_000_000_000, "embedding_dim": 128,
             "feature_names": ["fb"], "pooling": "sum"},
            {"name": "small", "num_embeddings": 1_000_000, "embedding_dim": 64,
             "feature_names": ["fs"], "pooling": "sum"},
        ],
        "batch_size_per_rank": 512, "pooling_factors": {"fb": 1, "fs": 4},
    }))  # fmt: skip
    args = ["--config", str(config), "--world-size", "8", "--shard-group-size", "8", "--png", ""]
    main([*args, "--host-memory-per-rank-gb", "400", "--zipf-exponent", "1.1", "--explain"])
    out = capsys.readouterr().out
    assert "host memory per rank (offloaded tables ['big'])" in out
    assert "expected hit rate" in out and "why: offloaded" in out
    with pytest.raises(ValueError, match="'big' .2000000000 x 128. does not fit"):
        main(args)  # no host memory: the device alone


def test_an_offloaded_blocks_copies_are_no_collective_call() -> None:
    """A cache's misses are host <-> device copies (bytes over the host link), not a
    collective: an offloaded row-wise table issues the calls of one on the device, so on
    H100, where each call is priced, it pays no extra call latency."""
    from dtrec.planning.plan_step import plan_step

    axis = ShardAxis(4, 1, None)
    cfg = dtrec.EmbeddingBagConfig("t", 100_000, 32, ["f"])
    topology = dtrec.Topology.h100(batch_size_per_rank=256, default_pooling_factor=5.0)
    device = table_cost(cfg, dtrec.placements.RowWise(), axis, topology)
    offloaded = table_cost(cfg, dtrec.placements.RowWise(cache_rows=1000), axis, topology)
    assert offloaded.comm["offload.host_to_device"].sum() > 0
    on_device = plan_step([device], axis, topology)
    assert plan_step([offloaded], axis, topology).calls == on_device.calls == 4
