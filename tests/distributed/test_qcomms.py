"""Quantized communication: the stated error bound holds, the bytes halve, None is fp32.

One gloo world of 4 ranks trains every case twice on the same batches: fp32
(``qcomms=None``) and quantized; ``QCommsConfig()`` (all fp32) must match None bit for bit.

The bound (``dtrec.QCommsConfig``'s doc, docs/qcomms.md), with
u_f, u_b, u_r the unit roundoffs of the forward, backward and replica-sync precisions
(2^-8 bf16, 2^-11 fp16, 0 fp32):

* outputs, same weights: |out_q - out| <= u_f * A, A = the collection's output on the
  same batch with every weight replaced by its absolute value (bounds sum |partial|);
* weights after N steps: the loss is a fixed positive readout of the pooled output, so
  every gradient element of a step is a sum of positive terms, each with relative error
  <= u_b after the backward exchange; the replica sum adds u_r per member (sparse) or 2u_r
  (dense): eps = u_b + k u_r. SGD steps then err by <= eps |step|, row-wise Adagrad by
  <= 2 eps |step| (the gradient and the root of its accumulated squares), and steps of one
  element all have the same sign, so |w_q - w| <= c eps |w_N - w_0| (c = 1 SGD, 2 Adagrad),
  plus 1e-6 for fp32 rounding.

With gradients of ~1e-6 fp16 is subnormal and breaks the bound; ``backward_loss_scale``
moves them into range and restores it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import dtrec
from dtrec.optim import SGD, RowWiseAdagrad
from dtrec.placements import ColumnWise, RowWise, TableWise
from tests.multiprocess import run_world

WORLD = 4
STEPS = 4
BATCH = 6
# Rows even and dims odd: each local [rows, dim + 1] dense replica-sync block has an even
# size, so the 2-rank reduce-scatter splits it without padding (bytes exactly halve).
TABLES = [
    ("t0", 40, 7, ["f0", "f1"], "sum"),
    ("t1", 24, 5, ["f2"], "mean"),
    ("t2", 60, 9, ["f3"], "sum"),
]
TYPES = {
    "table_wise": lambda: TableWise(rank=None),
    "row_wise": RowWise,
    "column_wise": ColumnWise,
}
BF16 = dict(forward_precision="bf16", backward_precision="bf16", replica_sync_precision="bf16")
FP16 = dict(
    forward_precision="fp16",
    backward_precision="fp16",
    replica_sync_precision="fp16",
    backward_loss_scale=1024.0,
)
TINY_FP16 = dict(forward_precision="fp16", backward_precision="fp16", replica_sync_precision="fp16")
SCALED_TINY_FP16 = {**TINY_FP16, "backward_loss_scale": 2.0**14}


def _cases() -> dict[str, dict]:
    cases: dict[str, dict] = {}
    for kind in TYPES:
        for opt in ("sgd", "adagrad"):
            for name, q in (("bf16", BF16), ("fp16", FP16)):
                cases[f"{kind}-{opt}-{name}"] = dict(kind=kind, shards=WORLD, opt=opt, qcomms=q)
    for kind in ("row_wise", "column_wise"):  # 2D: S=2, R=2
        for opt in ("sgd", "adagrad"):
            for mode in ("sparse", "dense"):
                for name, q in (("bf16", BF16), ("fp16", FP16)):
                    cases[f"2d-{kind}-{opt}-{mode}-{name}"] = dict(
                        kind=kind, shards=2, opt=opt, qcomms=q, mode=mode
                    )
    for mode in ("sparse", "dense"):  # not fused: autograd grads, torch SGD
        cases[f"2d-row_wise-unfused-{mode}-bf16"] = dict(
            kind="row_wise", shards=2, opt="torch_sgd", qcomms=BF16, mode=mode
        )
    cases["mixed-forward-bf16-backward-fp32"] = dict(
        kind="row_wise", shards=2, opt="adagrad", qcomms=dict(forward_precision="bf16")
    )
    for shards in (WORLD, 2):
        for name, q in (("tiny-fp16-unscaled", TINY_FP16), ("tiny-fp16-scaled", SCALED_TINY_FP16)):
            cases[f"{name}-s{shards}"] = dict(
                kind="row_wise", shards=shards, opt="adagrad", qcomms=q, readout=1e-6
            )
    return cases


CASES = _cases()
QUANTIZED_KINDS = ("output_dist", "output_dist.backward", "grad_sync.replicate.sparse",
                   "grad_sync.replicate.dense")  # fmt: skip


def _configs() -> list[dtrec.EmbeddingBagConfig]:
    return [dtrec.EmbeddingBagConfig(n, r, d, f, p) for n, r, d, f, p in TABLES]


def _batch(step: int, rank: int) -> dtrec.KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    keys, values, lengths = [], [], []
    for cfg in _configs():
        for f in cfg.feature_names:
            ls = torch.randint(0, 5, (BATCH,), generator=gen)
            keys.append(f)
            lengths.append(ls)
            values.append(torch.randint(0, cfg.num_embeddings, (int(ls.sum()),), generator=gen))
    return dtrec.KeyedJaggedTensor(keys, torch.cat(values), torch.cat(lengths))


def _train(mesh, reference, plan, opt, qcomms, readout, mode):
    """Outputs of step 0, full weights after STEPS steps and the bytes sent, per kind."""
    Sharded = dtrec.ShardedEmbeddingBagCollection
    fused = {"sgd": SGD(lr=0.5), "adagrad": RowWiseAdagrad(lr=0.05)}.get(opt)
    model = dtrec.distribute_module(
        copy.deepcopy(reference), mesh, plan, optimizer=fused, qcomms=qcomms
    )
    torch_opt = torch.optim.SGD(model.parameters(), lr=0.5) if fused is None else None
    Sharded.replica_sync = mode
    try:
        with dtrec.comm_stats() as stats:
            for step in range(STEPS):
                out = model(_batch(step, dist.get_rank())).values()
                if step == 0:
                    first = out.detach().clone()
                (out * readout).sum().backward()
                if torch_opt is not None:
                    torch_opt.step()
                    torch_opt.zero_grad()
    finally:
        Sharded.replica_sync = "auto"
    full = dtrec.checkpoint.full_state_dict(model)
    weights = {n: full[f"embedding_bags.{n}.weight"] for n in model.embedding_bags}
    return first, weights, dict(stats.bytes_sent), dict(stats.calls)


def _check_case(mesh, kind, opt, qcomms, readout=1.0, mode="auto") -> dict:
    torch.manual_seed(0)
    reference = dtrec.EmbeddingBagCollection(_configs())
    plan = {cfg.name: TYPES[kind]() for cfg in _configs()}
    gen = torch.Generator().manual_seed(7 + dist.get_rank())
    width = sum(len(f) * d for _, _, d, f, _ in TABLES)
    scale = readout * (0.5 + torch.rand(BATCH, width, generator=gen))
    config = dtrec.QCommsConfig(**qcomms)
    out32, w32, bytes32, calls32 = _train(mesh, reference, plan, opt, None, scale, mode)
    outq, wq, bytesq, callsq = _train(mesh, reference, plan, opt, config, scale, mode)

    absolute = copy.deepcopy(reference)
    with torch.no_grad():
        for table in absolute.embedding_bags.values():
            table.weight.abs_()
    u_f, u_b, u_r = (
        0.0 if c is None else c.unit_roundoff
        for c in (config.forward_codec, config.backward_codec, config.replica_sync_codec)
    )
    bound_out = u_f * absolute(_batch(0, dist.get_rank())).values() + 1e-6
    out_ratio = ((outq - out32).abs() / bound_out).max().item()

    replicas = WORLD // mesh.shape[0]
    k = 0 if replicas == 1 else (2 if mode == "dense" else 1)
    eps = u_b + k * u_r
    c = 2.0 if opt == "adagrad" else 1.0
    w_ratio = 0.0
    for name, w in w32.items():
        moved = (w - reference.embedding_bags[name].weight).abs()
        diff = (wq[name] - w).abs()
        w_ratio = max(w_ratio, (diff / (c * eps * moved + 1e-6)).max().item())
    return {
        "out_ratio": out_ratio,
        "w_ratio": w_ratio,
        "bytes32": bytes32,
        "bytesq": bytesq,
        "calls32": calls32,
        "callsq": callsq,
    }


def _fp32_config_is_none(mesh, kind, opt) -> bool:
    """``QCommsConfig()`` (all fp32) trains bit-identically to ``qcomms=None``."""
    torch.manual_seed(0)
    reference = dtrec.EmbeddingBagCollection(_configs())
    plan = {cfg.name: TYPES[kind]() for cfg in _configs()}
    scale = torch.ones(BATCH, sum(len(f) * d for _, _, d, f, _ in TABLES))
    a = _train(mesh, reference, plan, opt, None, scale, "auto")
    b = _train(mesh, reference, plan, opt, dtrec.QCommsConfig(), scale, "auto")
    same_weights = all(torch.equal(a[1][n], b[1][n]) for n in a[1])
    return torch.equal(a[0], b[0]) and same_weights and a[2] == b[2]


def _run_all(rank: int, world_size: int) -> dict:
    meshes = {s: dtrec.init_mesh("cpu", s) for s in (WORLD, 2)}
    out = {}
    for name, case in CASES.items():
        case = dict(case)
        out[name] = _check_case(meshes[case.pop("shards")], **case)
    out["fp32_is_none"] = {
        f"{s}-{kind}-{opt}": _fp32_config_is_none(meshes[s], kind, opt)
        for s in (WORLD, 2)
        for kind in TYPES
        for opt in ("sgd", "adagrad")
    }
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(WORLD, _run_all, timeout=600)


BOUNDED = sorted(n for n in CASES if not n.startswith("tiny-fp16-unscaled"))


@pytest.mark.parametrize("name", BOUNDED)
def test_within_stated_bound(results, name) -> None:
    for rank, per_rank in enumerate(results):
        r = per_rank[name]
        assert r["out_ratio"] <= 1.0, f"rank {rank}: outputs off by {r['out_ratio']:.3g}x bound"
        assert r["w_ratio"] <= 1.0, f"rank {rank}: weights off by {r['w_ratio']:.3g}x bound"


@pytest.mark.parametrize("shards", [WORLD, 2])
def test_fp16_needs_the_loss_scale_for_tiny_gradients(results, shards) -> None:
    """Subnormal fp16 gradients break the bound; a loss scale of 2^14 restores it."""
    worst = max(r[f"tiny-fp16-unscaled-s{shards}"]["w_ratio"] for r in results)
    assert worst > 2.0, worst


@pytest.mark.parametrize("name", sorted(CASES))
def test_quantized_collectives_send_half_the_bytes(results, name) -> None:
    q = dtrec.QCommsConfig(**CASES[name]["qcomms"])
    halved = {
        "output_dist": q.forward_codec is not None,
        "output_dist.backward": q.backward_codec is not None,
        "grad_sync.replicate.sparse": q.replica_sync_codec is not None,
        "grad_sync.replicate.dense": q.replica_sync_codec is not None,
    }
    for rank, per_rank in enumerate(results):
        r = per_rank[name]
        assert set(r["bytesq"]) == set(r["bytes32"]), rank
        for kind, fp32_bytes in r["bytes32"].items():
            sent = r["bytesq"][kind]
            if halved.get(kind):
                assert 2 * sent == fp32_bytes, (rank, kind, sent, fp32_bytes)
            else:  # ids, headers, counts, row norms: as before
                assert sent == fp32_bytes, (rank, kind, sent, fp32_bytes)
        assert sum(r["bytes32"].get(k, 0) for k in QUANTIZED_KINDS if halved[k]) > 0, rank


def test_dense_replica_sum_takes_two_calls(results) -> None:
    """The fp32 dense sum is one all-reduce; quantized, a reduce-scatter (all-to-all) of
    half-size pieces and an all-gather of their fp32-added sums."""
    for per_rank in results:
        r = per_rank["2d-row_wise-sgd-dense-bf16"]
        assert (
            r["callsq"]["grad_sync.replicate.dense"]
            == 2 * r["calls32"]["grad_sync.replicate.dense"]
        )


def test_fp32_config_is_bit_identical_to_none(results) -> None:
    for rank, per_rank in enumerate(results):
        assert all(per_rank["fp32_is_none"].values()), (rank, per_rank["fp32_is_none"])
