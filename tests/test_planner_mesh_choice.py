"""The planner chooses the mesh shape S x R (issue 33): ``choose_shard_group_size`` and
``python -m dtrec.planner --shard-group-size auto`` rank every shard group size of a world
by the predicted step of the plan ``dtrec.plan`` would make on it, and pick the fastest;
the pick follows the fabric (dear shard all-to-alls: small S; dear replica syncs: large S).
Numbers only, one process: the dry run's mesh is on torch's fake process group."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import dtrec
from dtrec.modules.config import EmbeddingBagConfig
from dtrec.placements import TableWise
from dtrec.planning.dry_run import main
from dtrec.planning.mesh_choice import (
    choose_shard_group_size,
    compare_shard_group_sizes,
    rank_shard_group_sizes,
)
from dtrec.planning.topology import Topology
from tests.interop.torchrec_or_skip import needs_torchrec, torchrec

SIZES = (1000, 30_000, 200_000, 2_000_000)


def _tables() -> dict[str, EmbeddingBagConfig]:
    return {f"t{i}": EmbeddingBagConfig(f"t{i}", n, 32, [f"f{i}"]) for i, n in enumerate(SIZES)}


def _model() -> nn.Module:
    model = nn.Module()
    model.sparse = dtrec.EmbeddingBagCollection(list(_tables().values()), device="meta")
    return model


def test_cli_auto_ranks_every_shard_group_size_and_dry_runs_the_pick(tmp_path, capsys) -> None:
    """W=8, ``--shard-group-size`` left at ``auto``: one ranking line per S in 1, 2, 4, 8,
    exactly one starred, and the dry run that follows is on that mesh."""
    config = {
        "tables": [{"name": f"t{i}", "num_embeddings": n, "embedding_dim": 32,
                    "feature_names": [f"f{i}"], "pooling": "sum"} for i, n in enumerate(SIZES)],
        "batch_size_per_rank": 256,
        "pooling_factors": {f"f{i}": 2.0 + 3 * i for i in range(len(SIZES))},
    }  # fmt: skip
    path = tmp_path / "model.json"
    path.write_text(json.dumps(config))
    main(["--config", str(path), "--world-size", "8", "--node-size", "8", "--png", ""])
    out = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(out) if line.startswith("shard group sizes of"))
    rows = out[start + 1 : start + 5]
    assert sorted(r.split()[1 if r.lstrip().startswith("*") else 0] for r in rows) == [
        "S=1", "S=2", "S=4", "S=8"
    ]  # fmt: skip
    assert all(" ms " in r and "% comm" in r and "calls" in r for r in rows), rows
    starred = [r for r in rows if r.lstrip().startswith("*")]
    assert len(starred) == 1 and starred[0] == rows[0]  # fastest first
    size = int(starred[0].split()[1].removeprefix("S="))
    assert any(line.startswith(f"W=8 = S {size} x R {8 // size} ") for line in out), out
    steps = [float(r.split(" ms")[0].split()[-1]) for r in rows]
    assert steps == sorted(steps)

    with pytest.raises(SystemExit):  # neither an int nor "auto": argparse's usage error
        main(["--config", str(path), "--world-size", "8", "--shard-group-size", "many"])


@pytest.mark.parametrize("world, node", [(8, None), (8, 8), (64, 8)])
def test_choose_shard_group_size_is_compare_shard_group_sizes_pick(world, node) -> None:
    """The function returns the mesh of ``compare_shard_group_sizes``' chosen plan over every
    divisor of the world, for a model (dtrec's collection) as for its configs; its ranking is
    that function's, and its per-size picks are the plans ``dtrec.plan`` makes there."""
    topology = Topology.h100(batch_size_per_rank=512, default_pooling_factor=8.0)
    divisors = [s for s in range(1, world + 1) if world % s == 0]
    keyed = {f"sparse.{k}": cfg for k, cfg in _tables().items()}
    ranked = compare_shard_group_sizes(keyed, world, divisors, topology, node)
    pick = next(c for c in ranked if c.chosen)
    want = int(pick.name.split(" x ")[0].removeprefix("S="))
    assert choose_shard_group_size(keyed, world, node, topology) == want
    assert choose_shard_group_size(_model(), world, node, topology) == want
    choice = rank_shard_group_sizes(_model(), world, node, topology)
    assert choice.candidates == ranked and choice.shard_group_size == want
    assert sorted(choice.per_size) == divisors and not choice.skipped
    assert [c.chosen for c in choice.per_size.values()] == [True] + [False] * (len(divisors) - 1)
    assert choice.per_size[want].step == pick.step


@needs_torchrec
def test_choose_shard_group_size_reads_a_torchrec_model() -> None:
    configs = [
        torchrec.EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=n, embedding_dim=32, feature_names=[f"f{i}"]
        )
        for i, n in enumerate(SIZES)
    ]
    model = nn.Module()
    model.sparse = torchrec.EmbeddingBagCollection(configs, device=torch.device("meta"))
    topology = Topology.h100(batch_size_per_rank=512, default_pooling_factor=8.0)
    assert choose_shard_group_size(model, 8, 8, topology) == choose_shard_group_size(
        _model(), 8, 8, topology
    )


def _fabric(shard_dear: bool) -> Topology:
    """Dear shard all-to-alls (1 s a call, slow links) with free replica and world sums, or
    the reverse."""
    dear, free = (1.0, 0.0) if shard_dear else (0.0, 1.0)
    return Topology.cpu(
        batch_size_per_rank=512,
        default_pooling_factor=8.0,
        collective_latency=dear,  # all-to-all
        reduce_latency=free,
        gather_latency=free,
        intra_node_bandwidth=1e6 if shard_dear else 1e15,
        replica_bandwidth=1e15 if shard_dear else 1e6,
    )


def test_the_pick_follows_the_fabric() -> None:
    """Free replica sums and dear all-to-alls: S=1 (every table whole on every rank, no
    shard-axis exchange). Free all-to-alls and dear replica sums: S=W (no replica group).
    Swapping the fabrics swaps the picks, so the test can fail."""
    tables = _tables()
    assert choose_shard_group_size(tables, 8, topology=_fabric(shard_dear=True)) == 1
    assert choose_shard_group_size(tables, 8, topology=_fabric(shard_dear=False)) == 8
    choice = rank_shard_group_sizes(tables, 16, topology=_fabric(shard_dear=False))
    assert choice.shard_group_size == 16 and list(choice.per_size)[-1] == 1


def test_a_mesh_whose_shards_do_not_fit_is_ranked_fully_sharded() -> None:
    """Dear shard all-to-alls favour S=1 (R=8), where every rank would hold every table:
    with 0.2 GB a rank that does not fit, so the planner fully shards the coldest table
    that makes it fit over the 8 replicas (fully sharded 2D, issue 43) and the mesh is
    still ranked, and picked, its line saying so; R=1 has no replicas to shard over."""
    from dataclasses import replace

    tables = _tables()
    roomy = replace(_fabric(shard_dear=True), host_memory_per_rank=0.0)
    choice = rank_shard_group_sizes(tables, 8, topology=roomy)
    assert choice.shard_group_size == 1
    assert not any("fully sharded" in c.name for c in choice.candidates)
    tight = replace(roomy, memory_per_rank=0.2e9)
    choice = rank_shard_group_sizes(tables, 8, topology=tight)
    assert choice.shard_group_size == 1 and not choice.skipped
    assert choice.per_size[1].name.endswith("(1 of 4 tables fully sharded)")
    assert "fully sharded" not in choice.per_size[8].name
    assert any(line.startswith("  * S=1 x R=8") and "fully sharded" in line
               for line in choice.lines())  # fmt: skip
    assert choose_shard_group_size(tables, 8, topology=tight) == 1


def test_sizes_that_cannot_plan_are_skipped_with_why() -> None:
    """W=48 on nodes of 8: S=4, 8, 16 make replica groups of 12, 6, 3 ranks, which
    ``init_mesh`` refuses; given sizes that do not divide are skipped; a pinned spec that
    does not exist on a small shard axis skips those sizes."""
    tables = _tables()
    topology = Topology.h100(batch_size_per_rank=64)
    choice = rank_shard_group_sizes(tables, 48, node_size=8, topology=topology)
    assert sorted(choice.skipped) == [4, 8, 16]
    assert all("node_size 8" in why for why in choice.skipped.values())
    assert sorted(choice.per_size) == [1, 2, 3, 6, 12, 24, 48]
    assert sum(line.lstrip().startswith("*") for line in choice.lines()) == 1
    choice = rank_shard_group_sizes(tables, 8, topology=topology, shard_group_sizes=[3, 4, 8])
    assert sorted(choice.per_size) == [4, 8] and "does not divide" in choice.skipped[3]
    pinned = {"t3": TableWise(rank=5)}
    choice = rank_shard_group_sizes(tables, 8, topology=topology, constraints=pinned)
    assert list(choice.per_size) == [8] and sorted(choice.skipped) == [1, 2, 4]


def test_bad_input_is_a_clear_error() -> None:
    tables = _tables()
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        choose_shard_group_size(tables, 0)
    with pytest.raises(TypeError, match="world_size must be an int"):
        choose_shard_group_size(tables, 8.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world size 12 is not divisible by node_size 8"):
        choose_shard_group_size(tables, 12, node_size=8)
    with pytest.raises(ValueError, match=r"no shard group size in \[3, 5\] divides the world"):
        rank_shard_group_sizes(tables, 8, shard_group_sizes=[3, 5])
    with pytest.raises(TypeError, match="model_or_tables must be"):
        choose_shard_group_size([EmbeddingBagConfig("t", 10, 4)], 8)  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="unknown table"):
        choose_shard_group_size(tables, 8, constraints={"nope": TableWise()})
    with pytest.raises(ValueError, match="no shard group size of a world of 8 plans"):
        choose_shard_group_size(tables, 8, topology=Topology.h100(memory_per_rank=1e3))
