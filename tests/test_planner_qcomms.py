"""The cost model prices quantized output dists (``Topology.qcomms``): the bytes it
predicts are the bytes ``dtrec.comm_stats()`` measures with that ``QCommsConfig``, for
pooled and sequence tables, and only the output dist's kinds change."""

from __future__ import annotations

import pytest

import dtrec
from dtrec.placements import ColumnWise, RowWise, TableWise
from dtrec.placements.mesh import ShardAxis
from dtrec.planning.cost_model import Topology, table_cost
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
