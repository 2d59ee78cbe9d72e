"""Uneven and empty batches on the paths around the lookup, and the bad-batch contract.

On 4 gloo ranks, with per-rank batch sizes that differ and are sometimes 0 (on one rank
or on every rank):

* ``TrainPipeline`` trains bit-identically to the plain loop (pooled and sequence);
* variable-batch (VBE) KJTs give the unsharded outputs and step;
* quantized communication (bf16 forward, fp16 backward) stays within its stated bound
  of the fp32 run, pooled and sequence;
* position-weighted features (``FeatureProcessedEmbeddingBagCollection``) train their
  tables, position weights and dense layer like the unsharded model;
* a bad batch on one rank (an id out of range, a missing feature, a bag longer than its
  position weights, a failure while bucketizing) fails that step on every rank before
  any weight or fused state changes, also when another rank's batch is empty, and the
  next (uneven) step trains everywhere.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.multiprocess import run_world

TOLERANCE = 1e-5
SIZES = [[3, 5, 0, 2], [0, 0, 0, 0], [4, 0, 1, 0], [2, 3, 3, 1]]  # per step, per rank
MESHES = {"1d": (4, 2), "2d": (2, 2)}  # (shard group size, node size)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _flat_locals(model) -> list[torch.Tensor]:
    return [_local(p).detach() for p in model.parameters()]


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if hasattr(x, "to_local") else x


def _fused_state(model) -> dict[str, torch.Tensor]:
    """Copies of this rank's fused optimizer state ({} without a fused optimizer)."""
    if model.fused_optimizer is None:
        return {}
    state = model.fused_optimizer.state_dict()["state"]
    return {f"{t}.{k}": _local(v).clone() for t, per in state.items() for k, v in per.items()}


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((float((x - y).abs().max()) for x, y in zip(a, b) if x.numel()), default=0.0)


def _pipeline(mesh, fused_name: str | None, sequence: bool) -> dict:
    """The pipeline and the plain loop on the same uneven batches: equal bit for bit."""
    import dtrec
    from tests.distributed.numerics import PLANS, TinyModel, make_batch, make_tables, rank_loss
    from tests.sequence import numerics as seq

    fused = {None: None, "rowwise_adagrad": dtrec.optim.RowWiseAdagrad(lr=0.1)}[fused_name]
    gen = torch.Generator().manual_seed(10 + _rank())
    torch.manual_seed(0)
    if sequence:
        model = SequenceModel(seq.make_tables())
        plan = {f"sparse.{k}": v for k, v in seq.plans(mesh)["mixed"].items()}
        batches = [(seq.make_batch(sizes[_rank()], gen),) for sizes in SIZES]

        def loss_fn(m, batch):
            return seq.loss_of(m(batch[0]))
    else:
        tables = make_tables(False)
        model = TinyModel(tables)
        plan = {f"sparse.{k}": v for k, v in PLANS["mixed"].items()}
        batches = [make_batch(tables, sizes[_rank()], False, gen) for sizes in SIZES]

        def loss_fn(m, batch):
            return rank_loss(m(batch[0]), batch[1])

    plain = dtrec.distribute_module(copy.deepcopy(model), mesh, plan, optimizer=fused)
    piped = dtrec.distribute_module(copy.deepcopy(model), mesh, plan, optimizer=fused)

    def optimizer(model):  # None when a fused optimizer trains every parameter
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.SGD(params, lr=0.5) if params else None

    plain_opt = optimizer(plain)
    plain_losses = []
    for batch in batches:
        loss = loss_fn(plain, batch)
        loss.backward()
        if plain_opt is not None:
            plain_opt.step()
            plain_opt.zero_grad()
        plain_losses.append(loss.item())
    opt = optimizer(piped)
    piped_losses = [loss.item() for loss in dtrec.TrainPipeline(piped, opt, loss_fn).run(batches)]
    return {
        "same_losses": plain_losses == piped_losses,
        "max_param_diff": _max_diff(_flat_locals(plain), _flat_locals(piped)),
        "trained": any(  # the steps moved the weights (sparse and dense)
            not torch.equal(w, model.state_dict()[k])
            for k, w in dtrec.checkpoint.full_state_dict(plain).items()
        ),
    }


class SequenceModel(torch.nn.Module):
    def __init__(self, tables) -> None:
        super().__init__()
        import dtrec

        self.sparse = dtrec.EmbeddingCollection(tables)

    def forward(self, kjt):
        return self.sparse(kjt)


def _vbe_batch(rank: int, step: int, batch: int):
    """Rank ``rank``'s VBE KJT at ``step``: features f0, f1 (table t0), f2 (t1); full batch
    ``batch`` (0 included), 1-3 distinct bags per feature."""
    import dtrec

    gen = torch.Generator().manual_seed(100 * rank + step)
    bags = [int(torch.randint(1, 4, (1,), generator=gen)) for _ in range(3)]
    lengths = torch.randint(0, 4, (sum(bags),), generator=gen)
    values = torch.randint(0, 11, (int(lengths.sum()),), generator=gen)
    inverse = torch.stack([torch.randint(0, n, (batch,), generator=gen) for n in bags])
    return dtrec.KeyedJaggedTensor(
        ["f2", "f0", "f1"],
        values,
        lengths,
        stride_per_key_per_rank=[[n] for n in bags],
        inverse_indices=(["f0", "f1", "f2"], inverse[[1, 2, 0]]),
    )


def _variable_batch(mesh, spec_name: str, fused: bool) -> dict:
    """VBE batches of uneven full sizes: outputs and weights after every step equal the
    unsharded collection's (loss: a random readout of each rank's rows, summed over W)."""
    import dtrec

    tables = [
        dtrec.EmbeddingBagConfig("t0", 11, 4, ["f0", "f1"]),
        dtrec.EmbeddingBagConfig("t1", 11, 6, ["f2"], pooling="mean"),
    ]
    torch.manual_seed(0)
    reference = dtrec.EmbeddingBagCollection(tables)
    spec = getattr(dtrec.placements, spec_name)
    plan = {"t0": spec(rank=0), "t1": spec(rank=1)} if spec_name == "TableWise" else {
        "t0": spec(), "t1": spec()}  # fmt: skip
    optimizer = dtrec.optim.SGD(lr=0.3) if fused else None
    sharded = dtrec.distribute_module(copy.deepcopy(reference), mesh, plan, optimizer=optimizer)
    opt = None if fused else torch.optim.SGD(sharded.parameters(), lr=0.3)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.3)
    world, fwd_err, rows_ok = len(SIZES[0]), 0.0, True
    for step, sizes in enumerate(SIZES):
        kjt = _vbe_batch(_rank(), step, sizes[_rank()])
        out = sharded(kjt).values()
        want = reference(kjt).values()
        rows_ok &= tuple(out.shape) == (sizes[_rank()], 14)
        if out.numel():
            fwd_err = max(fwd_err, (out - want).abs().max().item())
        up = torch.randn(out.shape, generator=torch.Generator().manual_seed(_rank() + step))
        (out * up).sum().backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        total = 0
        for r in range(world):
            ref_out = reference(_vbe_batch(r, step, sizes[r])).values()
            ref_up = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(r + step))
            total = total + (ref_out * ref_up).sum() / world
        if isinstance(total, torch.Tensor) and total.requires_grad:  # not when every B = 0
            total.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = dtrec.checkpoint.full_state_dict(sharded)
    weight_err = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return {"fwd_err": fwd_err, "weight_err": weight_err, "rows_ok": rows_ok}


def _qcomms(mesh, kind: str, sequence: bool) -> dict:
    """bf16 forward / fp16 backward qcomms against the fp32 run, same uneven batches, fused
    SGD, a positive readout: outputs within u_f of the output with |weights|, weights
    within u_b |w_N - w_0| (+1e-6) of the fp32 ones (the bounds of tests/.../test_qcomms.py;
    on the 2D mesh the replica sum stays fp32 here)."""
    import dtrec
    from dtrec.placements import ColumnWise, RowWise, TableWise
    from tests.sequence import numerics as seq

    config = dtrec.QCommsConfig(forward_precision="bf16", backward_precision="fp16")
    spec = {"table_wise": TableWise(rank=None), "row_wise": RowWise(),
            "column_wise": ColumnWise()}[kind]  # fmt: skip
    if sequence:
        configs = seq.make_tables(seq.UNIFORM_TABLES)
        make = dtrec.EmbeddingCollection
    else:
        configs = [dtrec.EmbeddingBagConfig(t[0], t[1], 8, t[3]) for t in seq.UNIFORM_TABLES]
        make = dtrec.EmbeddingBagCollection
    torch.manual_seed(0)
    reference = make(configs)
    plan = {cfg.name: spec for cfg in configs}
    gen = torch.Generator().manual_seed(3 + _rank())
    batches = [seq.make_batch(sizes[_rank()], gen, seq.UNIFORM_TABLES) for sizes in SIZES]

    def values(out) -> torch.Tensor:
        if sequence:
            return torch.cat([jt.values() for jt in out.values()])
        return out.values()

    def train(qcomms) -> tuple[list[torch.Tensor], dict]:
        model = dtrec.distribute_module(
            copy.deepcopy(reference), mesh, plan, optimizer=dtrec.optim.SGD(lr=0.5),
            qcomms=qcomms,
        )  # fmt: skip
        outs = []
        for kjt in batches:
            out = values(model(kjt))
            outs.append(out.detach().clone())
            (out * 0.7).sum().backward()
        full = dtrec.checkpoint.full_state_dict(model)
        prefix = "embeddings" if sequence else "embedding_bags"
        return outs, {c.name: full[f"{prefix}.{c.name}.weight"] for c in configs}

    out32, w32 = train(None)
    outq, wq = train(config)
    absolute = copy.deepcopy(reference)
    with torch.no_grad():
        for p in absolute.parameters():
            p.abs_()
    u_f = config.forward_codec.unit_roundoff
    u_b = config.backward_codec.unit_roundoff
    # step 0's outputs (same weights on both sides): within one rounding of the output
    bound = u_f * values(absolute(batches[0])) + 1e-6
    out_ratio = ((outq[0] - out32[0]).abs() / bound).max().item() if bound.numel() else 0.0
    w_ratio = 0.0
    for name, w in w32.items():
        start = reference.state_dict()[f"{'embeddings' if sequence else 'embedding_bags'}."
                                       f"{name}.weight"]  # fmt: skip
        moved = (w - start).abs()
        w_ratio = max(w_ratio, ((wq[name] - w).abs() / (u_b * moved + 1e-6)).max().item())
    shapes = [tuple(a.shape) == tuple(b.shape) for a, b in zip(out32, outq, strict=True)]
    return {"out_ratio": out_ratio, "w_ratio": w_ratio, "shapes": all(shapes)}


def _position_weighted(mesh, plan: str, processors: str, fused: str) -> dict:
    from tests.distributed.test_position_weighted import check_training, dtrec_model

    torch.manual_seed(0)
    return check_training(mesh, dtrec_model(processors), plan, fused, batch_sizes=SIZES)


def _bad_batches(mesh) -> dict:
    """Each case: a bad batch on one rank while other ranks' batches are empty; every rank
    fails that step, nothing changes, and the next uneven step trains."""
    import dtrec
    from dtrec.checkpoint import full_state_dict
    from dtrec.placements import ColumnWise, DataParallel, RowWise, TableWise
    from tests.distributed.numerics import TinyModel, make_batch, make_tables, rank_loss
    from tests.distributed.test_position_weighted import _plan as fp_plan
    from tests.distributed.test_position_weighted import dtrec_model as fp_model
    from tests.distributed.test_position_weighted import make_batch as fp_batch
    from tests.multiprocess import error_of

    rank = _rank()
    tables = make_tables(False)
    gen = torch.Generator().manual_seed(50 + rank)
    mixed = {"sparse.t0": RowWise(), "sparse.t1": TableWise(rank=1), "sparse.t2": ColumnWise(),
             "sparse.t3": DataParallel()}  # fmt: skip
    dp_only = {f"sparse.t{i}": DataParallel() for i in range(4)}

    def out_of_range(kjt):
        values = kjt.values().clone()
        values[-1] = 10_000
        return dtrec.KeyedJaggedTensor(kjt.keys(), values, kjt.lengths())

    def missing(kjt):
        return kjt.permute([i for i, k in enumerate(kjt.keys()) if k != "f3"])

    def bucketize_fails(*args, **kwargs):
        raise RuntimeError(f"bucketize broke on rank {rank}")

    cases = {  # name: (plan, fused, bad rank, how its batch is bad, ranks with B=0)
        "out_of_range": (mixed, dtrec.optim.RowWiseAdagrad(lr=0.1), 1, out_of_range, (0, 2)),
        "missing_feature": (mixed, None, 3, missing, (1,)),
        "data_parallel_only": (dp_only, None, 1, out_of_range, (0,)),
        "bucketize_raises": (mixed, dtrec.optim.SGD(lr=0.1), 1, bucketize_fails, (2, 3)),
    }
    out = {}
    for name, (plan, fused, bad_rank, spoil, empty) in cases.items():
        torch.manual_seed(0)
        model = dtrec.distribute_module(TinyModel(tables), mesh, plan, optimizer=fused)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        before = {k: v.clone() for k, v in full_state_dict(model).items()}
        state_before = _fused_state(model)

        def step(kjt, target, model=model, opt=opt):
            rank_loss(model(kjt), target).backward()
            opt.step()
            opt.zero_grad()

        kjt, target = make_batch(tables, 0 if rank in empty else 3, False, gen)
        routing = model.sparse._routing
        if rank == bad_rank and spoil is bucketize_fails:
            routing.bucketize = bucketize_fails  # an instance attribute, deleted below
        elif rank == bad_rank:
            kjt = spoil(kjt)
        try:
            error = error_of(lambda step=step, kjt=kjt, target=target: step(kjt, target))
        finally:
            vars(routing).pop("bucketize", None)
        after = full_state_dict(model)
        state_after = _fused_state(model)
        unchanged = all(torch.equal(after[k], before[k]) for k in before) and all(
            torch.equal(state_after[k], state_before[k]) for k in state_before
        )
        nxt = make_batch(tables, [2, 0, 1, 3][rank], False, gen)
        out[name] = {
            "bad_rank": bad_rank,
            "error": error,
            "unchanged": unchanged,
            "next": error_of(lambda step=step, nxt=nxt: step(*nxt)),
        }
    # a bag longer than its position weights on rank 2 (its feature processor raises),
    # rank 0's batch empty
    torch.manual_seed(0)
    model = dtrec.distribute_module(fp_model("modules"), mesh, fp_plan("mixed"))
    before = {k: v.clone() for k, v in full_state_dict(model).items()}
    kjt, target = fp_batch(gen, 0 if rank == 0 else 3)
    if rank == 2:
        lengths = kjt.lengths().clone()
        lengths[0] = 50
        values = torch.zeros(int(lengths.sum()), dtype=torch.long)
        kjt = dtrec.KeyedJaggedTensor(kjt.keys(), values, lengths)
    error = error_of(lambda: rank_loss(model(kjt), target).backward())
    after = full_state_dict(model)
    nxt = fp_batch(gen, [2, 0, 1, 3][rank])
    out["position_weights_too_short"] = {
        "bad_rank": 2,
        "error": error,
        "unchanged": all(torch.equal(after[k], before[k]) for k in before),
        "next": error_of(lambda: rank_loss(model(nxt[0]), nxt[1]).backward()),
    }
    return out


def _run_all(rank: int, world: int) -> dict:
    import dtrec

    out = {}
    for mesh_name, (shards, node) in MESHES.items():
        mesh = dtrec.init_mesh("cpu", shards, node_size=node)
        for fused in (None, "rowwise_adagrad"):
            for sequence in (False, True):
                kind = "sequence" if sequence else "pooled"
                out[f"pipeline-{mesh_name}-{kind}-{fused}"] = _pipeline(mesh, fused, sequence)
        for spec in ("RowWise", "ColumnWise", "TableWise", "DataParallel"):
            for fused in (False, True):
                out[f"vbe-{mesh_name}-{spec}-{fused}"] = _variable_batch(mesh, spec, fused)
        for kind in ("table_wise", "row_wise", "column_wise"):
            for sequence in (False, True):
                name = f"qcomms-{mesh_name}-{kind}-{'sequence' if sequence else 'pooled'}"
                out[name] = _qcomms(mesh, kind, sequence)
        for plan, processors, fused in (("mixed", "modules", "none"),
                                        ("row_wise", "collection", "none"),
                                        ("mixed", "modules", "rowwise_adagrad")):  # fmt: skip
            name = f"position_weighted-{mesh_name}-{plan}-{processors}-{fused}"
            out[name] = _position_weighted(mesh, plan, processors, fused)
        out[f"bad-{mesh_name}"] = _bad_batches(mesh)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(4, _run_all, timeout=900, collective_timeout=60)


def _cases(prefix: str) -> list[str]:
    names = {
        "pipeline": [f"{k}-{f}" for k in ("pooled", "sequence") for f in (None, "rowwise_adagrad")],
        "vbe": [
            f"{s}-{f}"
            for s in ("RowWise", "ColumnWise", "TableWise", "DataParallel")
            for f in (False, True)
        ],  # fmt: skip
        "qcomms": [
            f"{k}-{s}"
            for k in ("table_wise", "row_wise", "column_wise")
            for s in ("pooled", "sequence")
        ],  # fmt: skip
        "position_weighted": [
            "mixed-modules-none",
            "row_wise-collection-none",
            "mixed-modules-rowwise_adagrad",
        ],  # fmt: skip
    }[prefix]
    return [f"{prefix}-{m}-{n}" for m in MESHES for n in names]


@pytest.mark.parametrize("name", _cases("pipeline"))
def test_pipeline_with_uneven_batches_is_the_plain_loop(results, name: str) -> None:
    for rank, r in enumerate(results):
        case = r[name]
        assert case["same_losses"] and case["max_param_diff"] == 0.0, (rank, case)
        assert case["trained"], rank


@pytest.mark.parametrize("name", _cases("vbe"))
def test_variable_batch_with_uneven_batches_matches_unsharded(results, name: str) -> None:
    for rank, r in enumerate(results):
        case = r[name]
        assert case["rows_ok"], (rank, case)
        assert case["fwd_err"] < 1e-6 and case["weight_err"] < TOLERANCE, (rank, case)


@pytest.mark.parametrize("name", _cases("qcomms"))
def test_qcomms_with_uneven_batches_within_bound(results, name: str) -> None:
    for rank, r in enumerate(results):
        case = r[name]
        assert case["shapes"], (rank, case)
        assert case["out_ratio"] <= 1.0 and case["w_ratio"] <= 1.0, (rank, case)


@pytest.mark.parametrize("name", _cases("position_weighted"))
def test_position_weighted_with_uneven_batches_matches_unsharded(results, name: str) -> None:
    for rank, r in enumerate(results):
        case = r[name]
        for key in ("loss", "tables", "position_weights", "dense"):
            assert case[key] < TOLERANCE, (rank, key, case)
        assert case["position_weight_grad_seen"] > 0, rank


BAD = ("out_of_range", "missing_feature", "data_parallel_only", "bucketize_raises",
       "position_weights_too_short")  # fmt: skip


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("case", BAD)
def test_bad_batch_beside_empty_ones_fails_every_rank(results, mesh: str, case: str) -> None:
    expected = {"out_of_range": "IndexError", "missing_feature": "KeyError",
                "data_parallel_only": "IndexError", "bucketize_raises": "RuntimeError",
                "position_weights_too_short": "ValueError"}[case]  # fmt: skip
    for rank, r in enumerate(results):
        got = r[f"bad-{mesh}"][case]
        bad = got["bad_rank"]
        if rank == bad:
            assert got["error"].startswith(expected), (rank, got)
        else:
            assert got["error"].startswith("ValueError"), (rank, got)
            assert f"rank {bad} " in got["error"] or f"rank(s) [{bad}]" in got["error"], got
        assert got["unchanged"], (rank, got)  # weights, dense layer, fused state
        assert got["next"] == "ok", (rank, got)
