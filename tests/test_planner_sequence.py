"""The planner CLI on sequence tables: the JSON config describes them (``"kind":
"sequence"``), the dry run plans them as ``dtrec.plan`` plans an EmbeddingCollection, and
``--explain`` shows the numbers their spec came from (output rows per id, so output-dist
bytes that grow with the ids)."""

from __future__ import annotations

import json
import re

import pytest
import torch.distributed as dist
from torch import nn

import dtrec
from dtrec.planning.dry_run import dry_run, load_config, main
from dtrec.planning.plan import ShardingPlan
from dtrec.planning.topology import Topology
from tests.fake_world import fake_world

SEQUENCE = {
    "name": "item", "kind": "sequence", "num_embeddings": 200_000, "embedding_dim": 32,
    "feature_names": ["history"],
}  # fmt: skip
POOLED = [
    {"name": "users", "num_embeddings": 500_000, "embedding_dim": 32, "feature_names": ["uid"]},
    {"name": "cats", "num_embeddings": 1000, "embedding_dim": 8, "feature_names": ["cat"],
     "pooling": "mean"},
]  # fmt: skip


def _config(tmp_path, history: float, batch: int = 256) -> str:
    path = tmp_path / f"model_{history:g}_{batch}.json"
    config = {
        "tables": [SEQUENCE, *POOLED],
        "batch_size_per_rank": batch,
        "pooling_factors": {"history": history, "uid": 1.0, "cat": 3.0},
    }
    path.write_text(json.dumps(config))
    return str(path)


def test_config_describes_sequence_tables(tmp_path) -> None:
    tables, options = load_config(_config(tmp_path, 20.0))
    assert [type(t) for t in tables] == [
        dtrec.EmbeddingConfig,
        dtrec.EmbeddingBagConfig,
        dtrec.EmbeddingBagConfig,
    ]
    assert tables[0] == dtrec.EmbeddingConfig("item", 200_000, 32, ["history"])
    assert tables[2].pooling == "mean"
    assert options["pooling_factors"]["history"] == 20.0


def test_dry_run_plans_sequence_tables_like_dtrec_plan(tmp_path) -> None:
    """The CLI's plan of the config equals ``dtrec.plan`` of a model holding the same
    tables in an EmbeddingCollection and an EmbeddingBagCollection (same topology)."""
    tables, options = load_config(_config(tmp_path, 20.0))
    topology = Topology.cpu(**options)
    result = dry_run(tables, 4, 4, None, topology)
    model = nn.Module()
    model.seq = dtrec.EmbeddingCollection([tables[0]])
    model.bags = dtrec.EmbeddingBagCollection(tables[1:])
    with fake_world(0, 4):
        expected = dtrec.plan(model, dtrec.init_mesh("cpu", 4), topology=topology)
    assert {k.split(".", 1)[1]: v for k, v in expected.items()} == dict(result["plan"])
    assert result["sequence_tables"] == 1 and result["explanation"] is None


def _explained(tmp_path, capsys, history: float, batch: int = 256) -> dict[str, list[str]]:
    """Run the CLI with --explain; table name -> its explanation lines."""
    args = ["--config", _config(tmp_path, history, batch), "--world-size", "8"]
    plan_json = tmp_path / "plan.json"
    main([*args, "--shard-group-size", "4", "--device", "cpu", "--png", "", "--explain",
          "--plan-json", str(plan_json)])  # fmt: skip
    out = capsys.readouterr().out
    assert "3 tables (1 sequence)" in out
    assert sorted(ShardingPlan.from_json(plan_json.read_text())) == ["cats", "item", "users"]
    assert not dist.is_initialized()
    tables: dict[str, list[str]] = {}
    for line in out.split("why each spec", 1)[1].splitlines()[1:]:
        if line.startswith("wrote "):
            break
        if not line.startswith(" "):
            tables[line.split(":")[0]] = []
        tables[list(tables)[-1]].append(line)
    return tables


def _mib(lines: list[str], kind: str) -> float:
    text = " ".join(lines)
    return float(re.search(rf"\b{re.escape(kind)} ([0-9.]+) MiB", text).group(1))


def test_explain_shows_why_a_sequence_table_got_its_spec(tmp_path, capsys) -> None:
    short = _explained(tmp_path, capsys, history=10.0)
    long = _explained(tmp_path, capsys, history=40.0)
    items = short["item"]
    assert "sequence table, 200000 x 32" in items[0] and "10 ids/sample" in items[0]
    assert "256 samples x 10 ids = 2560 rows of 32" in items[1]  # one row per id
    assert "1 feature(s) = 256 rows" in items[1]  # what pooling would have made
    assert re.search(r"= HBM [0-9.]+ \+ shard axis [0-9.]+ \+ replicate axis", items[2])
    assert "pooled (mean) table" in short["cats"][0] and "= 256 rows of 8" in short["cats"][1]
    assert "sequence_output_dist" not in " ".join(short["users"])
    for lines in short.values():
        assert lines[-1].startswith(
            "  other candidates (alone: predicted ms, communication share, max MiB)"
        )
    # The numbers are the cost model's: row-wise over 4 positions, a block owner sends
    # the ids in its quarter of the rows back as rows to the 3 other positions, so 4x the
    # ids send 4x the bytes; a pooled table's output dist does not move.
    for history, explained in ((10, items), (40, long["item"])):
        assert explained[0].startswith("item: RW ")
        expected = 256 * history * 32 * 4 / 4 * 3 / 2**20
        assert _mib(explained, "sequence_output_dist") == pytest.approx(expected, abs=1e-3)
    assert _mib(long["users"], "output_dist") == _mib(short["users"], "output_dist")
    pooled_rows = 256 * 1 * 32 * 4 * 3 / 2**20  # one pooled partial per sample, to 3 peers
    assert f"sequence_output_dist 0.234 MiB vs {pooled_rows:.3f} MiB if" in " ".join(items)


def test_explain_is_opt_in(tmp_path, capsys) -> None:
    main(["--config", _config(tmp_path, 10.0), "--world-size", "4", "--shard-group-size", "4",
          "--png", ""])  # fmt: skip
    assert "why each spec" not in capsys.readouterr().out
