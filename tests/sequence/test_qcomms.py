"""Quantized communication on a sharded EmbeddingCollection: rows and their gradients.

One gloo world of 4 ranks trains each case with fp32 and with bf16 / fp16 exchanges on
the same batches. The loss is a fixed positive readout of the rows, so gradients do not
depend on the forward's rounding and the bound is the one the bag test states
(``tests/distributed/test_qcomms.py``): every returned row element is rounded once
(|out_q - out| <= u_f |out|), and with fused SGD every gradient part once in the
backward exchange and k times in the replica sum, all of one sign, so
|w_q - w| <= (u_b + k u_r) |w_N - w_0|. The sequence output dist and its backward send
exactly half the fp32 bytes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import run_world

WORLD, STEPS, BATCH = 4, 3, 5
TABLES = [("t0", 40, 8, ["f0", "f1"]), ("t1", 13, 4, ["f2"])]
PRECISIONS = {
    "bf16": dict(
        forward_precision="bf16", backward_precision="bf16", replica_sync_precision="bf16"
    ),
    "fp16": dict(
        forward_precision="fp16", backward_precision="fp16", replica_sync_precision="fp16"
    ),
}
CASES = {  # name -> (shard group size, spec name)
    "1d-table_wise": (4, "TableWise"),
    "1d-row_wise": (4, "RowWise"),
    "1d-column_wise": (4, "ColumnWise"),
    "2d-row_wise": (2, "RowWise"),
}
KINDS = ("sequence_output_dist", "sequence_output_dist.backward")


def _batch(step: int, rank: int):
    import dtrec

    gen = torch.Generator().manual_seed(100 * step + rank)
    keys, values, lengths = [], [], []
    for _, rows, _, feats in TABLES:
        for f in feats:
            ls = torch.randint(0, 5, (BATCH,), generator=gen)
            keys.append(f)
            lengths.append(ls)
            values.append(torch.randint(0, rows, (int(ls.sum()),), generator=gen))
    return dtrec.KeyedJaggedTensor(keys, torch.cat(values), torch.cat(lengths))


def _train(mesh, reference, spec: str, qcomms) -> tuple:
    import dtrec

    plan = {name: getattr(dtrec.placements, spec)() for name, *_ in TABLES}
    if spec == "TableWise":
        plan = {name: dtrec.placements.TableWise(rank=i + 1) for i, (name, *_) in enumerate(TABLES)}
    model = dtrec.distribute_module(
        copy.deepcopy(reference), mesh, plan, optimizer=dtrec.optim.SGD(lr=0.5), qcomms=qcomms
    )
    with dtrec.comm_stats() as stats:
        for step in range(STEPS):
            out = model(_batch(step, dist.get_rank()))
            rows = torch.cat([jt.values().reshape(-1) for jt in out.values()])
            if step == 0:
                first = rows.detach().clone()
            (rows * 0.75).sum().backward()
    full = dtrec.checkpoint.full_state_dict(model)
    return first, {n: full[f"embeddings.{n}.weight"] for n, *_ in TABLES}, dict(stats.bytes_sent)


def _check(mesh, spec: str, precision: str) -> dict:
    import dtrec

    torch.manual_seed(0)
    reference = dtrec.EmbeddingCollection([dtrec.EmbeddingConfig(*t) for t in TABLES])
    config = dtrec.QCommsConfig(**PRECISIONS[precision])
    out32, w32, bytes32 = _train(mesh, reference, spec, None)
    outq, wq, bytesq = _train(mesh, reference, spec, config)
    u_f, u_b, u_r = (
        c.unit_roundoff
        for c in (config.forward_codec, config.backward_codec, config.replica_sync_codec)
    )
    out_ratio = ((outq - out32).abs() / (u_f * out32.abs() + 1e-7)).max().item()
    k = 0 if mesh.shape[1] == 1 else 1  # sparse replica sum: one rounding
    w_ratio = 0.0
    for name, w in w32.items():
        moved = (w - reference.embeddings[name].weight).abs()
        bound = (u_b + k * u_r) * moved + 1e-7
        w_ratio = max(w_ratio, ((wq[name] - w).abs() / bound).max().item())
    return {
        "out_ratio": out_ratio,
        "w_ratio": w_ratio,
        "moved": max(
            (w - reference.embeddings[n].weight).abs().max().item() for n, w in w32.items()
        ),
        "bytes32": {k: bytes32.get(k, 0) for k in KINDS},
        "bytesq": {k: bytesq.get(k, 0) for k in KINDS},
    }


def _run_all(rank: int, world: int) -> dict:
    import dtrec

    out = {}
    for name, (shards, spec) in CASES.items():
        mesh = dtrec.init_mesh("cpu", shards)
        for precision in PRECISIONS:
            out[f"{name}-{precision}"] = _check(mesh, spec, precision)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(WORLD, _run_all, timeout=600)


NAMES = [f"{c}-{p}" for c in CASES for p in PRECISIONS]


@pytest.mark.parametrize("name", NAMES)
def test_rows_and_weights_within_the_bound(results, name: str) -> None:
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        assert got["moved"] > 1e-3, (rank, got)  # the tables were trained
        assert got["out_ratio"] <= 1.0 and got["w_ratio"] <= 1.0, (rank, got)


@pytest.mark.parametrize("name", NAMES)
def test_sequence_exchanges_send_half_the_bytes(results, name: str) -> None:
    total32 = sum(r[name]["bytes32"][k] for r in results for k in KINDS)
    assert total32 > 0
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        for kind in KINDS:
            assert 2 * got["bytesq"][kind] == got["bytes32"][kind], (rank, kind, got)
