"""The cost model prices quantized communication (``Topology.qcomms``): the bytes it
predicts are the bytes ``dtrec.comm_stats()`` measures with that ``QCommsConfig``: the
output dists of pooled and sequence tables (W=2), and every kind of a 2D step (W=4, S=2,
R=2), the replicate-axis gradient sums on both paths included; only the quantized kinds
change."""

from __future__ import annotations

import json
import re

import pytest
import torch

import dtrec
from dtrec.placements import ColumnWise, DataParallel, RowWise, TableWise
from dtrec.placements.mesh import ShardAxis, shard_axis
from dtrec.planning.cost_model import Topology, comm_by_kind, table_cost
from dtrec.planning.dry_run import dry_run, load_config, main
from dtrec.planning.explain import explain
from dtrec.planning.plan import model_tables
from dtrec.planning.planner import plan_tables
from tests.fake_world import fake_world
from tests.multiprocess import run_world

QCOMMS = dtrec.QCommsConfig(forward_precision="bf16", backward_precision="fp16")
AXIS = ShardAxis(size=4, replicas=2, per_node=None)
TABLES = [
    dtrec.EmbeddingBagConfig("bag", 1000, 16, ["f0", "f1"]),
    dtrec.EmbeddingConfig("seq", 1000, 16, ["h"]),
]


def _comm(cfg, spec, qcomms) -> dict:
    topology = Topology(batch_size_per_rank=64, default_pooling_factor=5.0, qcomms=qcomms)
    return table_cost(cfg, spec, AXIS, topology).comm


@pytest.mark.parametrize("spec", [TableWise(rank=1), RowWise(), ColumnWise()], ids=str)
@pytest.mark.parametrize("cfg", TABLES, ids=lambda c: c.name)
def test_quantized_output_dist_costs_half_the_bytes(cfg, spec) -> None:
    fp32, quantized = _comm(cfg, spec, None), _comm(cfg, spec, QCOMMS)
    forward_only = _comm(cfg, spec, dtrec.QCommsConfig(forward_precision="bf16"))
    out = "sequence_output_dist" if isinstance(cfg, dtrec.EmbeddingConfig) else "output_dist"
    assert set(fp32) == set(quantized) and fp32[out].sum() > 0
    for kind, sent in fp32.items():
        halved = kind in (out, f"{out}.backward")
        assert (quantized[kind] == (sent / 2 if halved else sent)).all(), kind
        halved = kind == out
        assert (forward_only[kind] == (sent / 2 if halved else sent)).all(), kind


def test_torchrec_qcomms_config_is_accepted() -> None:
    pytest.importorskip("torchrec", reason="needs torchrec (the bench extra)")
    from torchrec.distributed.fbgemm_qcomm_codec import CommType
    from torchrec.distributed.fbgemm_qcomm_codec import QCommsConfig as TorchRecQComms

    theirs = Topology(qcomms=TorchRecQComms(CommType.BF16, CommType.FP16))
    assert theirs.qcomms == QCOMMS


def _measure(rank: int, world: int) -> dict:
    """Bytes the output dists send on one step, per kind, with and without QCOMMS, and
    the cost model's prediction for the same tables, plan and batch."""
    import torch

    from tests.sequence.numerics import make_batch

    mesh = dtrec.init_mesh("cpu", world)
    plan = {"bag": TableWise(rank=0), "seq": TableWise(rank=1)}
    batch = 6
    gen = torch.Generator().manual_seed(rank)
    bag_kjt = dtrec.KeyedJaggedTensor(
        ["f0", "f1"], torch.randint(0, 1000, (24,), generator=gen), torch.full((12,), 2)
    )
    seq_kjt = make_batch(batch, gen, [("seq", 1000, 16, ["h"])])
    out: dict = {"measured": {}, "predicted": {}, "ids": int(seq_kjt.lengths().sum())}
    for name, qcomms in (("fp32", None), ("quantized", QCOMMS)):
        model = torch.nn.Module()
        model.bags = dtrec.EmbeddingBagCollection([TABLES[0]])
        model.seq = dtrec.EmbeddingCollection([TABLES[1]])
        full_plan = {"bags.bag": plan["bag"], "seq.seq": plan["seq"]}
        model = dtrec.distribute_module(model, mesh, full_plan, qcomms=qcomms)
        with dtrec.comm_stats() as stats:
            pooled = model.bags(bag_kjt).values().sum()
            rows = model.seq(seq_kjt)["h"].values().sum()
            (pooled + rows).backward()
        out["measured"][name] = {
            k: v for k, v in stats.bytes_sent.items() if k.startswith(("output", "sequence"))
        }
        topology = Topology(batch_size_per_rank=batch, qcomms=qcomms)
        axis = ShardAxis(size=world, replicas=1, per_node=None)
        bag = table_cost(TABLES[0], plan["bag"], axis, topology).comm
        out["predicted"][name] = {k: float(v[rank]) for k, v in bag.items() if "output" in k}
    return out


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_world(2, _measure, timeout=120)


def test_predicted_output_dist_bytes_are_measured_bytes(measured) -> None:
    """A table-wise pooled table's output dist moves a fixed number of rows, so the cost
    model's bytes are exact; a sequence table's move one row per id, halved the same way."""
    for rank, r in enumerate(measured):
        for name in ("fp32", "quantized"):
            for kind, predicted in r["predicted"][name].items():
                assert r["measured"][name].get(kind, 0) == predicted, (rank, name, kind)
        assert r["predicted"]["quantized"]["output_dist" if rank == 0 else "output_dist.backward"]
        fp32, quantized = r["measured"]["fp32"], r["measured"]["quantized"]
        assert fp32.get("sequence_output_dist", 0) > 0 or rank == 0, rank  # rank 1 serves
        for kind in fp32:
            assert 2 * quantized[kind] == fp32[kind], (rank, kind)


def test_predicted_sequence_rows_are_measured_rows(measured) -> None:
    """Rank 1 holds the sequence table and sends rank 0 one row per id of rank 0's batch:
    with rank 0's ids per sample as the pooling factor, the prediction is exact."""
    axis = ShardAxis(size=2, replicas=1, per_node=None)
    for name, qcomms in (("fp32", None), ("quantized", QCOMMS)):
        ids_per_sample = measured[0]["ids"] / 6
        topology = Topology(batch_size_per_rank=6, pooling_factors={"h": ids_per_sample},
                            qcomms=qcomms)  # fmt: skip
        comm = table_cost(TABLES[1], TableWise(rank=1), axis, topology).comm
        predicted = comm["sequence_output_dist"][1]
        assert predicted == pytest.approx(measured[1]["measured"][name]["sequence_output_dist"])
        assert predicted == measured[0]["ids"] * 16 * (4 if qcomms is None else 2)


def test_topology_rejects_a_qcomms_that_is_no_config() -> None:
    with pytest.raises(TypeError, match=r"Topology.qcomms must be a dtrec.QCommsConfig"):
        Topology(qcomms="bf16")


# A 2D run (W=4: S=2 shard positions x R=2 replicas) whose batches make every count the
# cost model predicts exact: fixed bag lengths, and ids that hit a new row each until a
# table's (or block's) rows are all hit, which ``_DistinctIds`` describes to the model.
# Sizes keep each dense replica-sum buffer even (no padding in the 2-rank reduce-scatter).
TABLES_2D = {  # name: (rows, dim, spec, ids per bag); the name says its sum's path
    "dense_tw": (8, 7, TableWise(rank=0), 4),
    "sparse_tw": (1000, 16, TableWise(rank=1), 3),
    "dense_rw": (40, 5, RowWise(), 10),
    "dp": (6, 3, DataParallel(), 2),  # summed over the world, in fp32 whatever qcomms says
}
BATCH_2D = 4
QCOMMS_2D = {
    "fp32": None,
    "bf16": dtrec.QCommsConfig(replica_sync_precision="bf16"),
    "fp16-scaled": dtrec.QCommsConfig(
        forward_precision="bf16",
        backward_precision="fp16",
        replica_sync_precision="fp16",
        backward_loss_scale=1024.0,
    ),
}
ID_PARTS = ("input_dist.lengths", "input_dist.id_values")
"""Sub-kinds the cost model keeps apart; ``comm_stats`` sees them as ``input_dist.ids``."""


class _DistinctIds:
    """The test batches' ids: spread evenly over the rows, each id a new row until all
    rows are hit (so ``n`` ids touch ``min(n x share, rows)`` rows of a block)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def mass(self, start: int, end: int) -> float:
        return (end - start) / self.rows

    def unique(self, n: float, start: int, end: int) -> float:
        return min(n * self.mass(start, end), end - start)


def _batch_2d(position: int) -> dtrec.KeyedJaggedTensor:
    """Shard position p's ids for each table: ``p n .. p n + n - 1`` modulo its rows (n ids
    per rank), so the S positions' ids are distinct until they cover the rows."""
    import torch

    values, lengths = [], []
    for rows, _, _, per_bag in TABLES_2D.values():
        n = BATCH_2D * per_bag
        values.append((position * n + torch.arange(n)) % rows)
        lengths.append(torch.full((BATCH_2D,), per_bag))
    return dtrec.KeyedJaggedTensor(
        [f"f_{name}" for name in TABLES_2D], torch.cat(values), torch.cat(lengths)
    )


def _measure_2d(rank: int, world: int) -> dict:
    """Per QCOMMS_2D config: the bytes one fused SGD step sends per kind, and the cost
    model's ``comm_by_kind`` for this rank's shard position."""
    import torch

    mesh = dtrec.init_mesh("cpu", 2)
    axis = ShardAxis(size=2, replicas=world // 2, per_node=None)
    position = rank // axis.replicas
    configs = [
        dtrec.EmbeddingBagConfig(name, rows, dim, [f"f_{name}"])
        for name, (rows, dim, *_) in TABLES_2D.items()
    ]
    plan = {name: spec for name, (_, _, spec, *_) in TABLES_2D.items()}
    pooling = {f"f_{name}": float(t[3]) for name, t in TABLES_2D.items()}
    kjt = _batch_2d(position)
    out: dict = {"measured": {}, "predicted": {}}
    for name, qcomms in QCOMMS_2D.items():
        torch.manual_seed(0)
        model = dtrec.distribute_module(
            dtrec.EmbeddingBagCollection(configs), mesh, plan,
            optimizer=dtrec.optim.SGD(lr=0.1), qcomms=qcomms,
        )  # fmt: skip
        with dtrec.comm_stats() as stats:
            model(kjt).values().sum().backward()
        out["measured"][name] = dict(stats.bytes_sent)
        topology = Topology(batch_size_per_rank=BATCH_2D, pooling_factors=pooling, qcomms=qcomms)
        costs = [
            table_cost(cfg, plan[cfg.name], axis, topology, _DistinctIds(cfg.num_embeddings))
            for cfg in configs
        ]
        predicted = comm_by_kind(costs, axis)
        out["predicted"][name] = {k: float(v[position]) for k, v in predicted.items()}
    return out


@pytest.fixture(scope="module")
def measured_2d() -> list[dict]:
    return run_world(4, _measure_2d, timeout=300)


@pytest.mark.parametrize("name", sorted(QCOMMS_2D))
def test_predicted_2d_bytes_are_measured_bytes(measured_2d, name) -> None:
    """Every kind a 2D step sends, the replicate-axis gradient sums (sparse and dense,
    quantized or not) included, is predicted to the byte."""
    for rank, r in enumerate(measured_2d):
        measured, predicted = r["measured"][name], r["predicted"][name]
        per_kind = {k: v for k, v in predicted.items() if v and k not in ID_PARTS}
        assert per_kind == measured, rank
        assert any(k.startswith("grad_sync.replicate.") for k in measured), rank


def test_quantized_replica_sum_is_priced_at_half(measured_2d) -> None:
    """Priced (and so, by the test above, measured): the replicate-axis sums halve on
    both paths in ``replica_sync_precision``; everything else, the data-parallel world
    sum included, stays as it was."""
    paths = {"grad_sync.replicate.sparse", "grad_sync.replicate.dense"}
    for rank, r in enumerate(measured_2d):
        fp32, bf16 = r["predicted"]["fp32"], r["predicted"]["bf16"]
        assert paths & set(fp32), rank
        for kind, sent in fp32.items():
            assert bf16[kind] == (sent / 2 if kind in paths else sent), (rank, kind)
    position_paths = [
        {k for k in r["measured"]["fp32"] if k in paths} for r in measured_2d
    ]  # position 0 serves dense_tw and a dense_rw block, position 1 sparse_tw too
    assert position_paths[0] == {"grad_sync.replicate.dense"}
    assert position_paths[3] == paths


CLI_TABLES = [
    {"name": "big", "num_embeddings": 2_000_000, "embedding_dim": 128, "feature_names": ["fb"]},
    {"name": "small", "num_embeddings": 5000, "embedding_dim": 64, "feature_names": ["fs"]},
]
CLI_QCOMMS = {
    "forward_precision": "bf16", "backward_precision": "FP16", "replica_sync_precision": "bf16",
    "backward_loss_scale": 1024,
}  # fmt: skip


def _cli(tmp_path, capsys, qcomms: dict | None) -> tuple[dict, str]:
    """The dry run's result and the CLI's --explain output for a W=64, S=8 mesh."""
    config = {"tables": CLI_TABLES, "batch_size_per_rank": 512,
              "pooling_factors": {"fb": 20.0, "fs": 2.0}}  # fmt: skip
    if qcomms is not None:
        config["qcomms"] = qcomms
    path = tmp_path / f"model_{qcomms is not None}.json"
    path.write_text(json.dumps(config))
    args = ["--config", str(path), "--world-size", "64", "--shard-group-size", "8"]
    main([*args, "--node-size", "8", "--png", "", "--explain"])
    tables, options = load_config(str(path))
    result = dry_run(tables, 64, 8, 8, Topology.h100(node_size=8, **options))
    return result, capsys.readouterr().out


def _mib_of(out: str, table: str, kind: str) -> float:
    """The MiB ``--explain`` shows for ``kind`` on ``table``'s lines."""
    lines = out.split(f"\n{table}: ", 1)[1].split("\n  other candidates", 1)[0]
    return float(re.search(rf"\b{re.escape(kind)} ([0-9.]+) MiB", lines).group(1))


def test_cli_config_qcomms_prices_the_exchanges(tmp_path, capsys) -> None:
    """``"qcomms"`` in the planner config is a ``QCommsConfig``: the dry run's replicate-
    axis bytes halve, its output dists halve, ``--explain`` says so and shows it."""
    fp32, out32 = _cli(tmp_path, capsys, None)
    quantized, outq = _cli(tmp_path, capsys, CLI_QCOMMS)
    _, options = load_config(str(tmp_path / "model_True.json"))
    assert options["qcomms"] == dtrec.QCommsConfig(
        "bf16", "fp16", "bf16", backward_loss_scale=1024.0
    )
    assert dict(fp32["plan"]) == dict(quantized["plan"])  # same specs: bytes comparable
    # both sharded over every position, so every rank syncs replicas (all row-wise since
    # Topology.h100 prices calls: column-wise's row-norm all-reduce is one call more)
    assert {type(s).__name__ for s in fp32["plan"].values()} <= {"RowWise", "ColumnWise"}
    assert (quantized["replicate_bytes"] == fp32["replicate_bytes"] / 2).all()
    assert fp32["replicate_bytes"].min() > 0
    assert (quantized["shard_bytes"] < fp32["shard_bytes"]).all()
    assert (quantized["time"] < fp32["time"]).all()
    assert "exchanges: all fp32 (no qcomms)" in out32
    said = "output dist forward bf16, backward fp16; replicate-axis gradient sum bf16"
    assert outq.count(said) == 2  # the summary line and the --explain header
    for table, kind in (
        ("big", "grad_sync.replicate.sparse"),
        ("small", "grad_sync.replicate.dense"),
        ("big", "output_dist"),
        ("big", "output_dist.backward"),
    ):
        halved = _mib_of(out32, table, kind) / 2
        assert _mib_of(outq, table, kind) == pytest.approx(halved, abs=1e-3), (table, kind)
    ids = "input_dist.id_values"
    assert _mib_of(outq, "big", ids) == _mib_of(out32, "big", ids) > 0


ALL_BF16 = dtrec.QCommsConfig("bf16", "bf16", "bf16")


def _two_collections() -> torch.nn.Module:
    model = torch.nn.Module()
    model.a = dtrec.EmbeddingBagCollection([dtrec.EmbeddingBagConfig("t", 50_000, 32, ["fa"])])
    model.b = dtrec.EmbeddingBagCollection([dtrec.EmbeddingBagConfig("t", 50_000, 32, ["fb"])])
    return model


def test_qcomms_per_collection_prices_each_collection_its_own() -> None:
    """``Topology(qcomms={collection fqn: config})``, as ``distribute_module`` takes it:
    each table is priced with its collection's precisions (fp32 where none is named)."""
    axis = ShardAxis(size=4, replicas=2, per_node=None)
    cfg = dtrec.EmbeddingBagConfig("t", 50_000, 32, ["f"])
    tables = {"a.t": cfg, "b.t": cfg}
    base = dict(batch_size_per_rank=64, default_pooling_factor=5.0)
    choices, _ = plan_tables(tables, axis, None, Topology(qcomms={"a": ALL_BF16}, **base))
    alone = {"a.t": Topology(qcomms=ALL_BF16, **base), "b.t": Topology(**base)}
    for key, topology in alone.items():
        for spec, cost in choices[key].costs:
            expected = table_cost(cfg, spec, axis, topology, with_comm=False)
            assert (cost.stack == expected.stack).all(), (key, spec)
    quantized = dict(choices["a.t"].costs)[RowWise()]
    fp32 = dict(choices["b.t"].costs)[RowWise()]
    assert (quantized.replica_bytes == fp32.replica_bytes / 2).all()
    assert fp32.replica_bytes.min() > 0 and (quantized.shard_sent < fp32.shard_sent).all()


def test_plan_takes_qcomms_per_collection() -> None:
    """``dtrec.plan``: a dict naming every collection plans like that one config for all;
    a collection the model lacks is the KeyError ``distribute_module`` raises."""
    with fake_world(0, 8):
        mesh = dtrec.init_mesh("cpu", 4)
        model = _two_collections()
        every = dtrec.plan(
            model, mesh, topology=Topology.cpu(qcomms={"a": ALL_BF16, "b": ALL_BF16})
        )
        one = dtrec.plan(model, mesh, topology=Topology.cpu(qcomms=ALL_BF16))
        assert dict(every) == dict(one) and every.report.time == one.report.time
        tables, axis = model_tables(model), shard_axis(mesh)
        only_a = Topology.cpu(qcomms={"a": ALL_BF16})
        why = explain(tables, plan_tables(tables, axis, None, only_a)[0], axis, only_a)
        assert "per collection ('a': output dist forward bf16" in why  # and no E254
        with pytest.raises(KeyError, match=r"qcomms names collection\(s\) \['c'\]"):
            dtrec.plan(model, mesh, topology=Topology.cpu(qcomms={"a": ALL_BF16, "c": ALL_BF16}))
