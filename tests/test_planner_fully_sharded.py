"""The planner prices fully sharded tables: an owner slice's memory, routed rows' bytes."""

from __future__ import annotations

import re

import pytest
from torch import nn

import dtrec
from dtrec.placements import RowWise, TableWise
from dtrec.placements.mesh import ShardAxis
from dtrec.planning.cost_model import UniformIds, table_cost
from dtrec.planning.explain import explain
from dtrec.planning.plan import model_tables
from dtrec.planning.planner import TableConstraint, plan_tables
from dtrec.planning.step_model import collective_of
from tests.fake_world import fake_world

TOPOLOGY = dtrec.Topology.cpu(memory_per_rank=1e9, batch_size_per_rank=256)


@pytest.mark.parametrize("replicas", [2, 4])
def test_slice_memory_and_routed_bytes(replicas: int) -> None:
    cfg = dtrec.EmbeddingBagConfig("t", 1_000_000, 16, ["f"])
    axis = ShardAxis(2, replicas, None)
    exact = table_cost(cfg, RowWise(), axis, TOPOLOGY)
    sliced = table_cost(cfg, RowWise(fully_sharded=True), axis, TOPOLOGY)
    block = (16 * 4 + 4) * 500_000  # rows x (weight + row-wise Adagrad's sum) per position
    saved = exact.memory - sliced.memory
    touched = UniformIds(1_000_000).unique(2 * 256 * 1.0, 0, 500_000)
    # the block less its slice, less the compact table and its gradient rows
    assert saved == pytest.approx(block * (1 - 1 / replicas) - touched * 16 * 8, rel=1e-6)
    r = replicas
    # ids out and rows back; gradients back along the fetch, without ids
    routed = (r - 1) / r * touched * ((16 * 4 + 8) + 16 * 4)
    assert sliced.replica_bytes == pytest.approx([routed, routed], rel=1e-6)
    # under 2/R of exact 2D's sparse sync (R - 1) x U x (4D + 8)
    assert sliced.replica_bytes[0] < exact.replica_bytes[0] * 2 / r
    assert set(sliced.comm) >= {"replica_slices.fetch", "replica_slices.grads"}
    assert not any(k.startswith("grad_sync") for k in sliced.comm)
    assert collective_of("replica_slices.fetch") == ("replicate", "all_to_all")


class Model(nn.Module):
    def __init__(self, *tables: tuple[str, int]) -> None:
        super().__init__()
        configs = [dtrec.EmbeddingBagConfig(name, rows, 32, [f"f_{name}"])
                   for name, rows in tables]  # fmt: skip
        self.sparse = dtrec.EmbeddingBagCollection(configs, device="meta")


def _plan(model: nn.Module, shards: int, world: int, memory: float, constraints=None):
    topology = dtrec.Topology.cpu(memory_per_rank=memory, batch_size_per_rank=64)
    with fake_world(0, world):
        return dtrec.plan(model, dtrec.init_mesh("cpu", shards), constraints, topology=topology)


# 2M x 32 fp32 + row-wise Adagrad's sum: 264 MB; a row-wise shard on S = 2 is 132 MB, its
# owner slice on R = 2 66 MB. The budget is 90% of memory_per_rank.
BIG = ("big", 2_000_000)


def test_the_planner_fully_shards_a_table_whose_replicated_shard_does_not_fit() -> None:
    plan = _plan(Model(BIG), 2, 4, 100e6)
    spec = plan["sparse.big"]
    assert spec.fully_sharded and str(spec).endswith("+FS"), spec
    why = plan.report.why["sparse.big"]
    assert why.startswith("fully sharded 2D: replicated shard 0.13")  # 136 MB as its exact spec
    assert "does not fit the HBM budget of 0.090 GB per rank" in why
    assert "owner slice 1/2 fits (0.06" in why
    assert why in str(plan.report)
    # the same table with room for its replicated shard: exact 2D, nothing said
    roomy = _plan(Model(BIG), 2, 4, 400e6)
    assert not roomy["sparse.big"].fully_sharded and "sparse.big" not in roomy.report.why
    # on 1 x 4 there is nothing to split: (R = 1) the table fits exactly on 4 shards
    assert not _plan(Model(BIG), 4, 4, 100e6)["sparse.big"].fully_sharded


def test_explain_says_why_a_table_is_fully_sharded() -> None:
    from dtrec.planning.explain import explain
    from dtrec.planning.planner import plan_tables

    cfg = dtrec.EmbeddingBagConfig("big", 2_000_000, 32, ["f"])
    topology = dtrec.Topology.cpu(memory_per_rank=100e6, batch_size_per_rank=64)
    axis = ShardAxis(2, 2, None)
    choices, _ = plan_tables({"sparse.big": cfg}, axis, None, topology)
    text = explain({"sparse.big": cfg}, choices, axis, topology)
    line = next(x for x in text.splitlines() if x.strip().startswith("why:"))
    assert "replicated shard 0.13" in line and "does not fit the HBM budget of 0.090 GB" in line
    assert "owner slice 1/2 fits" in line


def test_only_as_many_tables_as_needed_are_fully_sharded() -> None:
    # big (264 MB) and small (66 MB): exact 2D holds at least 330 / 2 = 165 MB per
    # position, over a 150 MB x 0.9 budget, and small fits as it is; big fully sharded
    # (66 MB a rank) makes room, so small stays exact (both sliced would fit too).
    keys = ("sparse.big", "sparse.small")
    model = Model(BIG, ("small", 500_000))
    plan = _plan(model, 2, 4, 150e6)
    assert [k for k in keys if plan[k].fully_sharded] == ["sparse.big"], dict(plan)
    assert set(plan.report.why) == {"sparse.big"}
    exact = _plan(model, 2, 4, 400e6)
    assert not any(exact[k].fully_sharded for k in keys), dict(exact)


def test_pinned_and_offload_constrained_tables_are_not_fully_sharded() -> None:
    with pytest.raises(ValueError, match=r"'sparse.big' \(2000000 x 32\) does not fit: even as RW"):
        _plan(Model(BIG), 2, 4, 100e6, {"sparse.big": RowWise()})
    plan = _plan(Model(BIG), 2, 4, 100e6, {"sparse.big": RowWise(fully_sharded=True)})
    assert plan["sparse.big"] == RowWise(fully_sharded=True)
    assert str(plan["sparse.big"]) == "RW+FS" and "sparse.big" not in plan.report.why
    # a constraint on types leaves the planner its fully sharded variants
    plan = _plan(Model(BIG), 2, 4, 100e6, {"sparse.big": TableConstraint(types=(RowWise,))})
    assert plan["sparse.big"] == RowWise(fully_sharded=True)


def test_a_table_that_fits_neither_way_is_the_clear_error() -> None:
    # the owner slice alone (66 MB) is over a 50 MB x 0.9 budget
    with pytest.raises(ValueError) as info:
        _plan(Model(BIG), 2, 4, 50e6)
    text = str(info.value)
    exact = r"table 'sparse.big' \(2000000 x 32\) does not fit: even as \S+ it needs"
    assert re.search(exact, text), text
    assert "fully sharded over the 2 replicas too (1 table(s) that may move)" in text
    assert re.search(r"even as \S+\+FS it needs [0-9.]+ MiB more", text), text
    assert TableWise(rank=0, fully_sharded=True).fully_sharded


def test_planner_cli_fully_shards_and_says_why(tmp_path, capsys) -> None:
    import json

    from dtrec.planning.dry_run import main

    config = tmp_path / "model.json"
    config.write_text(json.dumps({
        "tables": [
            {"name": "big", "num_embeddings": 2_000_000, "embedding_dim": 32,
             "feature_names": ["f"], "pooling": "sum"},
            {"name": "small", "num_embeddings": 500_000, "embedding_dim": 32,
             "feature_names": ["g"], "pooling": "sum"},
        ],
        "batch_size_per_rank": 64, "pooling_factors": {"f": 1, "g": 1},
    }))  # fmt: skip
    args = ["--config", str(config), "--world-size", "4", "--shard-group-size", "2",
            "--device", "cpu", "--png", "", "--explain"]  # fmt: skip
    main([*args, "--memory-per-rank-gb", "0.15"])
    out = capsys.readouterr().out
    kinds = next(line for line in out.splitlines() if "types {" in line)
    assert "+FS': 1" in kinds and kinds.count("+FS") == 1, kinds  # big only
    assert "why: fully sharded 2D: replicated shard" in out
    main([*args, "--memory-per-rank-gb", "1"])  # room for both replicated: exact 2D
    out = capsys.readouterr().out
    assert "+FS" not in out and "why: fully sharded" not in out


def _host_plan(host: float):
    topology = dtrec.Topology.cpu(
        memory_per_rank=40e6, host_memory_per_rank=host, batch_size_per_rank=64
    )
    with fake_world(0, 4):
        plan = dtrec.plan(Model(BIG, ("small", 1000)), dtrec.init_mesh("cpu", 2), topology=topology)
    return plan, topology


def test_owner_slices_are_offloaded_when_host_memory_cannot_hold_whole_shards() -> None:
    # neither the shard (132 MB) nor its slice (66 MB) fits the 36 MB device budget; host
    # memory of 100 MB holds the slice but not the shard: offloaded owner slices
    plan, topology = _host_plan(100e6)
    big = plan["sparse.big"]
    assert big.fully_sharded and big.offloaded, plan
    assert 0 < big.cache_rows < 2_000_000 // 4  # rows of a slice, fewer than the slice's
    report = plan.report
    assert max(report.memory) <= topology.memory_budget
    assert 0 < max(report.host_memory) <= topology.host_budget
    assert "as owner slices (fully sharded 2D)" in str(plan)
    assert not plan["sparse.small"].offloaded
    with fake_world(0, 4):  # explain: the cache's share of an owner slice
        axis = ShardAxis(2, 2, None)
        tables = model_tables(Model(BIG, ("small", 1000)))
        choices, _ = plan_tables(tables, axis, None, topology)
        why = explain(tables, choices, axis, topology)
    share = 100 * big.cache_rows / (2_000_000 // 4)
    assert f"device caches of {big.cache_rows} rows (up to {share:.2f}% of an owner slice)" in why
    # with host memory for whole shards, the offloaded table keeps them (as before)
    whole, _ = _host_plan(400e6)
    assert whole["sparse.big"].offloaded and not whole["sparse.big"].fully_sharded, whole
    # and with too little host memory even for the slices, the error says both
    with pytest.raises(ValueError, match="owner slices over the 2 replicas"):
        _host_plan(30e6)


def test_an_offloaded_slice_is_priced_in_host_memory_and_its_cache() -> None:
    cfg = dtrec.EmbeddingBagConfig("t", 1_000_000, 16, ["f"])
    axis = ShardAxis(2, 2, None)
    whole = table_cost(cfg, RowWise(cache_rows=10_000), axis, TOPOLOGY)
    sliced = table_cost(cfg, RowWise(cache_rows=10_000, fully_sharded=True), axis, TOPOLOGY)
    row = 16 * 4 + 4  # weight + row-wise Adagrad's sum
    assert whole.host_memory[0] == 500_000 * row
    assert sliced.host_memory[0] == 250_000 * row  # the owner slice
    # the same cache rows (of the slice), plus a step's compact table and its gradients
    touched = UniformIds(1_000_000).unique(2 * 256 * 1.0, 0, 500_000)
    assert sliced.memory[0] - whole.memory[0] == pytest.approx(
        touched * 16 * 8 - 250_000 * 4,
        rel=1e-3,  # (the slot map: half the rows)
    )
    assert sliced.host_link_bytes[0] > 0 and sliced.replica_bytes[0] > 0
