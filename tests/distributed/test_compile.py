"""``torch.compile`` of a distributed model (issue 32, docs/compile.md), CPU gloo.

A 4-table ``EmbeddingBagCollection`` (sum and mean pooling) under an MLP head, per
sharding type, with the fused row-wise Adagrad:

* graph breaks in one forward, counted with ``torch._dynamo.explain`` on a function that
  calls the model (hooks and all, as ``torch.compile(model)`` traces them), within
  ``BREAK_BUDGET`` per world size (main before issue 32: 5 at W=1, 9-13 at W=4);
* compiled training equals eager training (3 steps, numerics contract): one-rank worlds
  with ``fullgraph=True``, forward and backward; 4 ranks on a 2x2 and a 1D mesh with the
  default ``torch.compile``; fused and torch optimizers (4 ranks: the cases in ``CASES``);
* the same for a sharded ``EmbeddingCollection`` (sequence lookups): traced whole in a
  one-rank world (no break, ``fullgraph=True``, fused and torch optimizers; its sizes per
  feature are read on the host, so breaks are counted with ``capture_scalar_outputs``, as
  ``fullgraph=True`` traces them), one break at 4 ranks (default compile);
* the same with variable batches per feature (VBE, ``inverse_indices``; ``VBE_CASES``,
  ``VBE_IN_CASES``);
* recompiles over 50 steps of varying batches (multi-hot lengths, uneven batch sizes,
  VBE): at most ``MAX_RECOMPILES`` after the first compile;
* a one-rank model with an offloaded table falls back to eager with one named graph
  break (``fullgraph=True`` refuses it, naming the reason) and trains like eager; one fed
  prefetched batches (``prefetch``, as ``TrainPipeline`` does) is traced whole and trains
  like eager.

One spawned world per world size runs every case.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.multiprocess import run_world

KINDS = ("table_wise", "row_wise", "column_wise", "data_parallel")
# world size -> breaks per forward; each remaining one is named in docs/compile.md
BREAK_BUDGET = {1: 0, 4: 1}
# A sharded EmbeddingCollection: traced whole at W=1, its exchanged step eager at W > 1.
SEQUENCE_BREAK_BUDGET = {1: 0, 4: 1}
# Dense buffers (a BatchNorm in the head) add none: their broadcast from rank 0 at W > 1
# is traced (functional collectives) under compile.
OPTIMIZERS = ("rowwise_adagrad", "torch_sgd")
# world size -> {(shard group size, kind): optimizers checked against eager}. Four ranks
# (each compile costs seconds there) run every kind on the 2 x 2 mesh (replicas and
# shards), the 1D mesh for the row- and column-split kinds, and the plain torch optimizer
# (DTensor gradients, the grad sync) where its path differs by kind.
CASES = {
    1: {(1, kind): OPTIMIZERS for kind in KINDS},
    4: {
        (2, "table_wise"): ("rowwise_adagrad",),
        (2, "row_wise"): OPTIMIZERS,
        (2, "column_wise"): ("rowwise_adagrad",),
        (2, "data_parallel"): OPTIMIZERS,
        (4, "row_wise"): ("rowwise_adagrad",),
        (4, "column_wise"): ("torch_sgd",),
    },
}
# world size -> {(shard group size, kind): optimizer}. One rank: every kind takes the same
# traced path, so the optimizers alternate over the kinds.
SEQUENCE_CASES = {
    1: {(1, kind): OPTIMIZERS[i % 2] for i, kind in enumerate(KINDS)},
    4: {(2, "table_wise"): "rowwise_adagrad", (2, "row_wise"): "rowwise_adagrad"},
}
# world size -> {(shard group size, kind): optimizers checked against eager} on VBE
# batches only (the expansion is traced at W=1; every kind takes the same path there).
VBE_CASES = {1: {(1, "table_wise"): ("rowwise_adagrad",), (1, "row_wise"): ("torch_sgd",)}}
# world size -> the case of ``CASES`` whose second batch is a VBE batch of the same full
# size (the expansion is in the eager input dist at W > 1: no extra compile, no extra run).
VBE_IN_CASES = {4: (2, "row_wise", "rowwise_adagrad")}
BUFFER_SHARDS = {1: 1, 4: 2}  # the dense-buffers model's mesh per world size
TOLERANCE = 1e-5
MAX_RECOMPILES = 2
RECOMPILE_STEPS = 50
NUM_TABLES, DIM = 4, 8


def _spec(kind: str, i: int, shards: int):
    from dtrec.placements import ColumnWise, DataParallel, RowWise, TableWise

    return {"table_wise": lambda: TableWise(rank=i % shards), "row_wise": RowWise,
            "column_wise": ColumnWise, "data_parallel": DataParallel}[kind]()  # fmt: skip


def _sequence_model(kind: str, shards: int, optimizer: str, cache_rows: int | None = None):
    """An ``EmbeddingCollection`` of 4 tables, each feature's rows through one MLP;
    ``cache_rows``: t0 offloaded behind a device cache of that many rows."""
    import torch

    import dtrec

    tables = [dtrec.EmbeddingConfig(f"t{i}", 40 + 3 * i, DIM, [f"f{i}"]) for i in range(NUM_TABLES)]

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ec = dtrec.EmbeddingCollection(tables)
            self.mlp = torch.nn.Linear(DIM, 1)

        def forward(self, kjt):
            out = self.ec(kjt)
            return sum(self.mlp(out[f"f{i}"].values()).square().sum() for i in range(NUM_TABLES))

    torch.manual_seed(0)
    fused = dtrec.optim.RowWiseAdagrad(lr=0.1) if optimizer == "rowwise_adagrad" else None
    plan = {f"ec.{t.name}": _spec(kind, i, shards) for i, t in enumerate(tables)}
    if cache_rows is not None:
        plan["ec.t0"] = dataclasses.replace(plan["ec.t0"], cache_rows=cache_rows)
    return dtrec.distribute_module(Model(), dtrec.init_mesh("cpu", shards), plan, optimizer=fused)


def _model(
    kind: str,
    shards: int,
    optimizer: str,
    weighted: bool = False,
    buffers: bool = False,
    cache_rows: int | None = None,
):
    """Sum and mean pooled tables; all sum pooled when the batches are ``weighted``;
    ``buffers``: a BatchNorm in the head (its buffers are broadcast from rank 0);
    ``cache_rows``: t0 offloaded behind a device cache of that many rows."""
    import torch

    import dtrec

    pooling = ["sum" if weighted or i % 2 == 0 else "mean" for i in range(NUM_TABLES)]
    tables = [
        dtrec.EmbeddingBagConfig(f"t{i}", 40 + 3 * i, DIM, [f"f{i}"], pooling[i])
        for i in range(NUM_TABLES)
    ]

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = dtrec.EmbeddingBagCollection(tables)
            norm = [torch.nn.BatchNorm1d(NUM_TABLES * DIM)] if buffers else []
            self.mlp = torch.nn.Sequential(*norm, torch.nn.Linear(NUM_TABLES * DIM, 8),
                                           torch.nn.ReLU(), torch.nn.Linear(8, 1))  # fmt: skip

        def forward(self, kjt):
            return self.mlp(self.ebc(kjt).values()).square().mean()

    torch.manual_seed(0)
    fused = dtrec.optim.RowWiseAdagrad(lr=0.1) if optimizer == "rowwise_adagrad" else None
    plan = {f"ebc.{t.name}": _spec(kind, i, shards) for i, t in enumerate(tables)}
    if cache_rows is not None:
        plan["ebc.t0"] = dataclasses.replace(plan["ebc.t0"], cache_rows=cache_rows)
    return dtrec.distribute_module(Model(), dtrec.init_mesh("cpu", shards), plan, optimizer=fused)


def _batch(gen, batch: int, weighted: bool = False):
    import torch

    import dtrec

    lengths = torch.randint(0, 4, (NUM_TABLES * batch,), generator=gen)
    values = torch.randint(0, 40, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.shape, generator=gen) if weighted else None
    keys = [f"f{i}" for i in range(NUM_TABLES)]
    return dtrec.KeyedJaggedTensor(keys, values, lengths, weights=weights)


def _vbe_batch(gen, batch: int):
    """A variable batch per feature (TorchRec's VBE): feature f sends 1 to ``batch``
    distinct bags, and ``inverse_indices`` say which one each of ``batch`` samples uses."""
    import torch

    import dtrec

    bags = torch.randint(1, batch + 1, (NUM_TABLES,), generator=gen)
    lengths = torch.randint(0, 4, (int(bags.sum()),), generator=gen)
    values = torch.randint(0, 40, (int(lengths.sum()),), generator=gen)
    inverse = (torch.rand(NUM_TABLES, batch, generator=gen) * bags.unsqueeze(1)).long()
    keys = [f"f{i}" for i in range(NUM_TABLES)]
    return dtrec.KeyedJaggedTensor(
        keys, values, lengths, stride_per_key_per_rank=[[int(b)] for b in bags],
        inverse_indices=(keys, inverse),
    )  # fmt: skip


def _mark_dynamic(batches) -> None:
    """Mark the sizes that vary from batch to batch dynamic (docs/compile.md), so the
    first compile serves every batch (else the second batch recompiles)."""
    import torch

    for kjt in batches:
        for t in (kjt.values(), kjt.lengths(), kjt.weights_or_none()):
            if t is not None:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        if kjt.inverse_indices_or_none() is not None:
            torch._dynamo.maybe_mark_dynamic(kjt.inverse_indices()[1], 1)


def _train(model, step_fn, batches, prefetch: bool = False) -> dict:
    """``prefetch``: each batch's input dist started (``prefetch``) before its step."""
    import torch

    import dtrec

    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for kjt in batches:
        opt.zero_grad()
        if prefetch:
            model.ebc.prefetch(kjt)
        step_fn(kjt).backward()
        opt.step()
    return dtrec.checkpoint.full_state_dict(model)


def _rel_error(eager: dict, compiled: dict) -> float:
    return max(
        ((eager[k] - compiled[k]).abs().max() / eager[k].abs().max().clamp_min(1e-12)).item()
        for k in eager
    )


def _breaks(kind: str, shards: int, build=_model, scalars: bool = False) -> int:
    """``scalars``: count as ``fullgraph=True`` traces (data-dependent sizes read on the
    host are traced, ``capture_scalar_outputs``)."""
    import torch

    model = build(kind, shards, "rowwise_adagrad")
    torch._dynamo.reset()
    kjt = _batch(torch.Generator().manual_seed(0), 6)
    with torch._dynamo.config.patch(capture_scalar_outputs=scalars):
        return torch._dynamo.explain(lambda k: model(k))(kjt).graph_break_count


def _max_rel_error(
    kind: str,
    shards: int,
    optimizer: str,
    rank: int,
    fullgraph: bool,
    build=_model,
    weighted: bool = False,
    vbe: str = "",
) -> float:
    """``vbe``: "all": variable batches per feature, full batch sizes 4 to 7 from step to
    step; "middle": the second batch a VBE one of the others' full batch size."""
    import functools

    import torch

    gen = torch.Generator().manual_seed(rank)
    if vbe == "all":
        batches = [_vbe_batch(gen, 4 + (rank + i) % 4) for i in range(3)]
    else:
        batches = [_batch(gen, 5 + rank, weighted) for _ in range(3)]  # uneven over ranks
    if vbe == "middle":
        batches[1] = _vbe_batch(gen, 5 + rank)
    _mark_dynamic(batches)
    if weighted:
        build = functools.partial(build, weighted=True)
    model = build(kind, shards, optimizer)
    eager = _train(model, model, batches)
    torch._dynamo.reset()
    model = build(kind, shards, optimizer)
    compiled = _train(model, torch.compile(model, fullgraph=fullgraph), batches)
    return _rel_error(eager, compiled)


def _fullgraph_refusal(model, kjt) -> str:
    """The error of ``torch.compile(model, fullgraph=True)`` on ``kjt`` ("" if it traces)."""
    import torch

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(model, fullgraph=True)(kjt)
    except Exception as exc:  # noqa: BLE001 - its message is the result
        return str(exc)
    return ""


def _eager_fallback(cause: str) -> dict:
    """A one-rank model with t0 offloaded (``cause`` "offload": its forward eager under
    compile) or every batch prefetched ("prefetch": traced). Its graph breaks (``explain``),
    the error of ``fullgraph=True`` (it must name the reason; "" when it traces), and the
    default compile's 3 steps against eager's."""
    import functools

    import torch

    gen = torch.Generator().manual_seed(0)
    batches = [_batch(gen, 5) for _ in range(3)]
    _mark_dynamic(batches)
    build = functools.partial(
        _model, "table_wise", 1, "rowwise_adagrad", cache_rows=16 if cause == "offload" else None
    )
    prefetch = cause == "prefetch"
    model = build()
    eager = _train(model, model, batches, prefetch)
    torch._dynamo.reset()
    model = build()
    if prefetch:
        model.ebc.prefetch(batches[0])
    breaks = torch._dynamo.explain(lambda k: model(k))(batches[0]).graph_break_count
    model = build()
    if prefetch:
        model.ebc.prefetch(batches[0])
    refused = _fullgraph_refusal(model, batches[0])
    torch._dynamo.reset()
    model = build()
    compiled = _train(model, torch.compile(model), batches, prefetch)
    stats = model.ebc.cache_stats()
    return {
        "breaks": breaks,
        "refused": refused,
        "error": _rel_error(eager, compiled),
        "misses": sum(s["misses"] for s in stats.values()),
    }


def _recompiles(rank: int) -> int:
    """Compiles after warm-up (the first step of each batch structure: fixed, variable per
    feature) over ``RECOMPILE_STEPS`` steps of varying batches: multi-hot lengths, batch
    sizes from 1 to 8, every third one a variable batch per feature (VBE, 2 to 8 samples:
    a full batch of one is a compile of its own, as for fixed batches); values, lengths
    and inverse indices marked dynamic."""
    import torch

    compiles: list = []
    model = _model("table_wise", 1, "rowwise_adagrad")
    torch._dynamo.reset()
    step = torch.compile(model, backend=_counting_backend(compiles), fullgraph=True)
    gen = torch.Generator().manual_seed(rank)
    warm: dict[bool, int] = {}
    for i in range(RECOMPILE_STEPS):
        batch, vbe = (6, 7, 3, 8, 5, 1, 6)[i % 7], i % 3 == 2
        kjt = _vbe_batch(gen, max(batch, 2)) if vbe else _batch(gen, batch)
        for t in (kjt.values(), kjt.lengths()):  # batch sizes vary: say so (docs/compile.md)
            torch._dynamo.maybe_mark_dynamic(t, 0)
        if vbe:
            torch._dynamo.maybe_mark_dynamic(kjt.inverse_indices()[1], 1)
        step(kjt).backward()
        warm.setdefault(vbe, len(compiles))
    return len(compiles) - max(warm.values())


def _bad_id_error(build=_model) -> str:
    """The error a compiled one-rank step raises for an id outside its table (checked in
    the lookup op, before any update), and whether the tables stayed unchanged."""
    import torch

    import dtrec

    model = build("table_wise", 1, "rowwise_adagrad")
    torch._dynamo.reset()
    step = torch.compile(model, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    good, bad = _batch(gen, 4), _batch(gen, 4)
    _mark_dynamic([good, bad])
    step(good).backward()
    before = dtrec.checkpoint.full_state_dict(model)
    bad.values()[-1] = 10_000
    try:
        step(bad).backward()
    except Exception as exc:  # noqa: BLE001 - its type is the result
        error = type(exc).__name__
    else:
        error = "none"
    after = dtrec.checkpoint.full_state_dict(model)
    return f"{error}, unchanged={all(torch.equal(before[k], after[k]) for k in before)}"


def _counting_backend(compiles: list):
    """``aot_eager``, recording each graph dynamo hands it (one per compile)."""
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm, example_inputs):
        compiles.append(gm)
        return aot_eager(gm, example_inputs)

    return backend


def _world_cases(rank: int, world: int) -> dict:
    import functools

    import torch

    torch._dynamo.config.cache_size_limit = 64
    out: dict = {}
    for (shards, kind), optimizers in CASES[world].items():
        out["breaks", shards, kind] = _breaks(kind, shards)
        for optimizer in optimizers:
            vbe = "middle" if (shards, kind, optimizer) == VBE_IN_CASES.get(world) else ""
            out["error", shards, kind, optimizer] = _max_rel_error(
                kind, shards, optimizer, rank, world == 1, vbe=vbe
            )
            if vbe:
                out["vbe_error", shards, kind, optimizer] = out["error", shards, kind, optimizer]
    for (shards, kind), optimizer in SEQUENCE_CASES[world].items():
        out["seq_breaks", shards, kind] = _breaks(kind, shards, _sequence_model, world == 1)
        out["seq_error", shards, kind] = _max_rel_error(
            kind, shards, optimizer, rank, world == 1, _sequence_model
        )
    for (shards, kind), optimizers in VBE_CASES.get(world, {}).items():
        for optimizer in optimizers:
            out["vbe_error", shards, kind, optimizer] = _max_rel_error(
                kind, shards, optimizer, rank, world == 1, vbe="all"
            )
    shards = BUFFER_SHARDS[world]
    with_buffers = functools.partial(_model, buffers=True)
    out["buffers_breaks"] = _breaks("table_wise", shards, with_buffers)
    out["buffers_error"] = _max_rel_error(
        "table_wise", shards, "rowwise_adagrad", rank, world == 1, with_buffers
    )
    if world == 1:
        out["recompiles"] = _recompiles(rank)
        for optimizer in OPTIMIZERS:  # per-sample weights, sum pooling
            out["weighted_error", optimizer] = _max_rel_error(
                "table_wise", 1, optimizer, rank, True, weighted=True
            )
        out["bad_id"] = _bad_id_error()
        out["seq_bad_id"] = _bad_id_error(_sequence_model)
        for cause in ("offload", "prefetch"):
            out["fallback", cause] = _eager_fallback(cause)
        sequence = _sequence_model("table_wise", 1, "rowwise_adagrad", cache_rows=16)
        out["seq_offload_refused"] = _fullgraph_refusal(
            sequence, _batch(torch.Generator().manual_seed(0), 4)
        )
    torch._dynamo.reset()
    return out


@pytest.fixture(scope="module")
def one_rank() -> dict:
    return run_world(1, _world_cases, timeout=900)[0]


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_world(4, _world_cases, timeout=900)


def _cases(world: int) -> list:
    return list(CASES[world])


def _error_cases(world: int) -> list:
    return [(*case, opt) for case, optimizers in CASES[world].items() for opt in optimizers]


@pytest.mark.parametrize("shards,kind", _cases(1))
def test_one_rank_forward_has_no_graph_break(one_rank, shards: int, kind: str) -> None:
    assert one_rank["breaks", shards, kind] <= BREAK_BUDGET[1]


@pytest.mark.parametrize("shards,kind,optimizer", _error_cases(1))
def test_one_rank_fullgraph_trains_like_eager(one_rank, shards, kind, optimizer) -> None:
    assert one_rank["error", shards, kind, optimizer] <= TOLERANCE


def test_one_rank_varying_batches_recompile_at_most_twice(one_rank) -> None:
    assert one_rank["recompiles"] <= MAX_RECOMPILES


@pytest.mark.parametrize("shards,kind", _cases(4))
def test_four_ranks_graph_breaks_within_budget(four_ranks, shards: int, kind: str) -> None:
    for rank, got in enumerate(four_ranks):
        assert got["breaks", shards, kind] <= BREAK_BUDGET[4], rank


@pytest.mark.parametrize("shards,kind,optimizer", _error_cases(4))
def test_four_ranks_compiled_trains_like_eager(four_ranks, shards, kind, optimizer) -> None:
    for rank, got in enumerate(four_ranks):
        assert got["error", shards, kind, optimizer] <= TOLERANCE, rank


SEQUENCE_PARAMS = [(world, *case) for world, cases in SEQUENCE_CASES.items() for case in cases]


def _results(one_rank: dict, four_ranks: list[dict], world: int) -> list[dict]:
    return [one_rank] if world == 1 else four_ranks


@pytest.mark.parametrize("world,shards,kind", SEQUENCE_PARAMS)
def test_sequence_forward_breaks_within_budget(one_rank, four_ranks, world, shards, kind) -> None:
    for rank, got in enumerate(_results(one_rank, four_ranks, world)):
        assert got["seq_breaks", shards, kind] <= SEQUENCE_BREAK_BUDGET[world], rank


@pytest.mark.parametrize("world,shards,kind", SEQUENCE_PARAMS)
def test_sequence_compiled_trains_like_eager(one_rank, four_ranks, world, shards, kind) -> None:
    for rank, got in enumerate(_results(one_rank, four_ranks, world)):
        assert got["seq_error", shards, kind] <= TOLERANCE, rank


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_one_rank_fullgraph_trains_like_eager_with_per_sample_weights(one_rank, optimizer) -> None:
    assert one_rank["weighted_error", optimizer] <= TOLERANCE


@pytest.mark.parametrize("key", ["bad_id", "seq_bad_id"])
def test_one_rank_compiled_step_refuses_a_bad_id_before_any_update(one_rank, key) -> None:
    assert one_rank[key] == "IndexError, unchanged=True"


@pytest.mark.parametrize("world", [1, 4])
def test_dense_buffers_breaks_within_budget_and_train_like_eager(one_rank, four_ranks, world):
    for rank, got in enumerate(_results(one_rank, four_ranks, world)):
        assert got["buffers_breaks"] <= BREAK_BUDGET[world], rank
        assert got["buffers_error"] <= TOLERANCE, rank


VBE_PARAMS = [
    (world, *case, opt) for world, cases in VBE_CASES.items() for case, opts in cases.items()
    for opt in opts
] + [(world, *case) for world, case in VBE_IN_CASES.items()]  # fmt: skip


@pytest.mark.parametrize("world,shards,kind,optimizer", VBE_PARAMS)
def test_variable_batches_compiled_train_like_eager(
    one_rank, four_ranks, world, shards, kind, optimizer
) -> None:
    for rank, got in enumerate(_results(one_rank, four_ranks, world)):
        assert got["vbe_error", shards, kind, optimizer] <= TOLERANCE, rank


def test_one_rank_offloaded_table_falls_back_with_one_named_break(one_rank) -> None:
    from dtrec.sharded.collection import OFFLOADED_STEP

    got = one_rank["fallback", "offload"]
    assert got["breaks"] == 1 and OFFLOADED_STEP in got["refused"]
    assert got["error"] <= TOLERANCE and got["misses"] > 0  # read through its cache
    assert OFFLOADED_STEP in one_rank["seq_offload_refused"]  # sequence tables alike


def test_one_rank_prefetched_batches_trace_whole_and_train_like_eager(one_rank) -> None:
    got = one_rank["fallback", "prefetch"]
    assert got["breaks"] == BREAK_BUDGET[1] and got["refused"] == ""
    assert got["error"] <= TOLERANCE
