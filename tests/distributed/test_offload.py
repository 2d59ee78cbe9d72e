"""Offloaded tables (host memory behind a device cache) train exactly like device tables.

One 4-rank gloo world runs every configuration. For each fused optimizer (SGD,
row-wise Adagrad, Adam) and sharding type (table-, row-, column-, table-row-wise and
grid on a node-aware 1D mesh; table-, row- and column-wise on a 2D mesh, S=2, R=2, where
a replica's update also reaches rows only the other replica's batch touched), a model
whose tables all live in host memory behind a cache of 5% of each block's rows and the
same model on the device train side by side on the same batches for 25 steps; their
weights and optimizer states must be bitwise equal. Bitwise, not within a tolerance: the
cache changes where a row is stored, never an arithmetic step (the pooled sums add the
same rows in the same order, a row's gradient sums its bags in the same order, replicas
exchange rows by block row as without the cache, and each optimizer step is row-local).

The checkpoint round trip: both models save after 15 steps (DCP), load into another
plan and cache size (column-wise behind a 10% cache, on an S=4 mesh; the device model
into column-wise on the device) and train 15 more; again bitwise equal. The sequence
collection (``EmbeddingCollection``) runs the same comparison for three types.

A planned model: ``dtrec.plan`` on a device budget the tables exceed offloads two of
them; trained, it equals the same plan on the device.

``TrainPipeline`` (row-wise, 2D mesh, each optimizer): the cached model trained by the
pipeline equals the device model trained by the plain loop, bitwise; batch i + 1's fill
is issued after batch i's forward and before its update, and its row copies run on the
offload worker thread, not the training thread.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tests.multiprocess import run_world

STEPS, SAVE_AT = 30, 15
"""The checkpoint round trip: saved after 15 steps (each 5% cache of the row-wise blocks,
25-50 slots, full after 3-5 steps of 8-16 ids), loaded, 15 more steps (the 10% caches of
the column-wise blocks, 200-400 slots, fill in 6-10 steps of 32-64 ids, then evict)."""
SIDE_STEPS = 25
"""Steps of each side-by-side and pipeline comparison. The 5% caches (25-200 slots a block)
fill within the first 3-7 steps (8-64 ids a block a step), so 25 steps still evict, write
back and miss evicted rows again for 20 steps or more (asserted: misses and write-backs);
50 steps repeated the same thing at twice the cost (the world's CPU is in its steps)."""
BATCH = 4
TABLES = [  # (name, rows, dim, features, pooling)
    ("t0", 4000, 8, ["f0", "f1"], "sum"),
    ("t1", 2000, 6, ["f2"], "mean"),
    ("t2", 3000, 4, ["f3"], "sum"),
]
OPTIMIZERS = ("sgd", "adagrad", "adam")
TYPES_1D = ("table_wise", "row_wise", "column_wise", "table_row_wise", "grid")
TYPES_2D = ("table_wise", "row_wise", "column_wise")
CONFIGS = [f"{o}/{t}/1d" for o in OPTIMIZERS for t in TYPES_1D]
CONFIGS += [f"{o}/{t}/2d" for o in OPTIMIZERS for t in TYPES_2D]
CONFIGS += ["adagrad/column_positions/1d"]  # ColumnWise(positions=(1, 3)): a sub-mesh
SEQUENCE = ("table_wise", "row_wise", "column_wise")
DEVICE = "cpu"
"""Where models and batches live: the CUDA tier (``tests/gpu/test_offload_cuda.py``) sets
"cuda" in its workers and runs these same checks on the GPU."""


def _tables(sequence: bool = False) -> list:
    import dtrec

    if sequence:
        return [dtrec.EmbeddingConfig(n, r, 4, f) for n, r, _, f, _ in TABLES]
    return [dtrec.EmbeddingBagConfig(n, r, d, f, p) for n, r, d, f, p in TABLES]


def _optimizer(name: str):
    import dtrec

    return {
        "sgd": lambda: dtrec.optim.SGD(lr=0.5),
        "adagrad": lambda: dtrec.optim.RowWiseAdagrad(lr=0.3),
        "adam": lambda: dtrec.optim.Adam(lr=0.05),
    }[name]()


def _spec(kind: str, shard_size: int = 4, **cache):
    from dtrec.placements import ColumnWise, Grid, RowWise, TableRowWise, TableWise

    return {
        "table_wise": lambda: TableWise(rank=min(1, shard_size - 1), **cache),
        "row_wise": lambda: RowWise(**cache),
        "column_wise": lambda: ColumnWise(**cache),
        "column_positions": lambda: ColumnWise(positions=(1, 3), **cache),
        "table_row_wise": lambda: TableRowWise(node=1, **cache),
        "grid": lambda: Grid(**cache),
    }[kind]()


class _SequenceModel(torch.nn.Module):
    def __init__(self) -> None:
        import dtrec

        super().__init__()
        self.sparse = dtrec.EmbeddingCollection(_tables(sequence=True))
        self.dense = torch.nn.Linear(4, 1)

    def forward(self, kjt):
        rows = self.sparse(kjt)
        pooled = [rows[f].values().sum(0) for f in kjt.keys()]
        return self.dense(torch.stack(pooled)).sum()


def _build(mesh, kind: str, optimizer: str, cache: dict, sequence: bool = False):
    import dtrec
    from tests.distributed.numerics import TinyModel

    torch.manual_seed(0)
    model = (_SequenceModel() if sequence else TinyModel(_tables())).to(DEVICE)
    shard_size = mesh["shard"].size()
    plan = {f"sparse.{name}": _spec(kind, shard_size, **cache) for name, *_ in TABLES}
    model = dtrec.distribute_module(model, mesh, plan, optimizer=_optimizer(optimizer))
    dense = torch.optim.SGD([p for n, p in model.named_parameters() if n.startswith("dense")], 0.1)
    return model, dense


def _step(model, dense, kjt, target, sequence: bool) -> None:
    out = model(kjt)
    loss = out if sequence else ((out - target) ** 2).mean()
    loss.backward()
    dense.step()
    dense.zero_grad()


def _state(model) -> dict[str, torch.Tensor]:
    """Every weight and fused optimizer state entry as a full tensor (this rank's view)."""
    from dtrec.checkpoint import to_full_state_dict

    state = dict(model.state_dict())
    for table, entries in model.fused_optimizer.state_dict()["state"].items():
        for name, value in entries.items():
            state[f"{table}.{name}"] = value
    return to_full_state_dict(state)  # one gather of them all


def _differences(a: dict, b: dict) -> list[str]:
    """Keys whose tensors are not bitwise equal (shapes, dtypes, values)."""
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return [k for k in a if not torch.equal(a[k], b[k])]


def _largest_difference(a: dict, b: dict) -> float:
    """The largest |a - b| over every entry (what the CUDA tier bounds)."""
    diffs = [(a[k].float() - b[k].float()).abs().max().item() for k in a if a[k].numel()]
    return max(diffs, default=0.0)


def _batches(gen: torch.Generator, sequence: bool = False) -> list:
    import torch.distributed as dist

    from tests.distributed.numerics import make_batch

    tables = _tables(sequence)
    batches = [make_batch(tables, BATCH, False, gen) for _ in range(dist.get_world_size())]
    return [(kjt.to(DEVICE), target.to(DEVICE)) for kjt, target in batches]


def _side_by_side(
    mesh, kind: str, optimizer: str, steps: int, sequence: bool = False, device_state=None
) -> dict:
    """Device model vs 5%-cache model, ``steps`` steps on the same batches (seed 11); the
    device model's state also into the dict ``device_state`` where given."""
    import torch.distributed as dist

    rank = dist.get_rank()
    plain = _build(mesh, kind, optimizer, {}, sequence)
    cached = _build(mesh, kind, optimizer, {"cache_fraction": 0.05}, sequence)
    gen = torch.Generator().manual_seed(11)
    for _ in range(steps):
        kjt, target = _batches(gen, sequence)[rank]
        _step(*plain, kjt, target, sequence)
        _step(*cached, kjt, target, sequence)
    stats = cached[0].sparse.cache_stats()
    want, got = _state(plain[0]), _state(cached[0])
    if device_state is not None:
        device_state.update(want)
    return {
        "differ": _differences(want, got),
        "largest": _largest_difference(want, got),
        "misses": sum(s["misses"] for s in stats.values()),
        "rows": sum(s["rows"] for s in stats.values()),
        "written_back": sum(s["d2h_bytes"] for s in stats.values()),
    }


def _full_cache(mesh, steps: int) -> dict:
    """A cache with a slot for every row is filled whole before its first batch and again
    after a flush (``state_dict()`` here, halfway): no lookup misses, and the model still
    equals the device one bitwise."""
    import torch.distributed as dist

    plain = _build(mesh, "row_wise", "adagrad", {})
    cached = _build(mesh, "row_wise", "adagrad", {"cache_fraction": 1.0})
    gen = torch.Generator().manual_seed(17)
    for step in range(steps):
        kjt, target = _batches(gen)[dist.get_rank()]
        _step(*plain, kjt, target, False)
        _step(*cached, kjt, target, False)
        if step == steps // 2:
            cached[0].state_dict()
    stats = cached[0].sparse.cache_stats()
    return {
        "differ": _differences(_state(plain[0]), _state(cached[0])),
        "misses": sum(s["misses"] for s in stats.values()),
        "rows": sum(s["rows"] for s in stats.values()),
        "h2d_bytes": sum(s["h2d_bytes"] for s in stats.values()),
        "block_bytes": sum(
            t.weight.to_local().numel() * 4 + t.weight.to_local().shape[0] * 4  # + Adagrad sum
            for t in cached[0].sparse.embedding_bags.values()
        ),
    }


def _edge_cases(mesh, steps: int) -> dict:
    """Steps the plain loop does not take: training in eval mode (grad enabled), and a
    ``state_dict()`` (which writes the caches back and empties them) between a forward and
    its backward; the cached model must still equal the device one."""
    import torch.distributed as dist

    plain = _build(mesh, "table_wise", "adagrad", {})  # one owner: the one-pass update
    cached = _build(mesh, "table_wise", "adagrad", {"cache_fraction": 0.05})
    gen = torch.Generator().manual_seed(13)
    for step in range(steps):
        kjt, target = _batches(gen)[dist.get_rank()]
        for model, dense in (plain, cached):
            model.train(step % 3 != 1)  # every third step in eval mode
            loss = ((model(kjt) - target) ** 2).mean()
            if step % 3 == 2:
                model.state_dict()
            loss.backward()
            dense.step()
            dense.zero_grad()
    return {"differ": _differences(_state(plain[0]), _state(cached[0]))}


def _sequence_pipelined(mesh, steps: int) -> dict:
    """The sequence collection, cached, through ``TrainPipeline`` vs on the device through
    the plain loop (the sequence lookup's prefetch fill)."""
    import torch.distributed as dist

    import dtrec

    plain = _build(mesh, "row_wise", "adam", {}, sequence=True)
    cached, dense = _build(mesh, "row_wise", "adam", {"cache_fraction": 0.05}, sequence=True)
    gen = torch.Generator().manual_seed(17)
    batches = [_batches(gen, sequence=True)[dist.get_rank()] for _ in range(steps)]
    for kjt, target in batches:
        _step(*plain, kjt, target, True)
    pipeline = dtrec.TrainPipeline(cached, dense, lambda m, b: m(b[0]), lambda b: b[0])
    for _ in pipeline.run(batches):
        pass
    return {"differ": _differences(_state(plain[0]), _state(cached))}


def _inference(mesh, steps: int) -> dict:
    """Without a fused optimizer: no-grad forwards of offloaded tables (evaluation) read
    what the device tables hold; a training forward is E325."""
    import torch.distributed as dist

    import dtrec
    from tests.distributed.numerics import TinyModel

    models = []
    for cache in ({}, {"cache_fraction": 0.05}):
        torch.manual_seed(0)
        plan = {f"sparse.{name}": _spec("row_wise", **cache) for name, *_ in TABLES}
        models.append(dtrec.distribute_module(TinyModel(_tables()).to(DEVICE), mesh, plan))
    gen = torch.Generator().manual_seed(19)
    differ = 0
    for _ in range(steps):
        kjt, _target = _batches(gen)[dist.get_rank()]
        with torch.no_grad():
            outs = [model(kjt) for model in models]
        differ += not torch.equal(*outs)
    try:
        models[1](kjt)
        refused = None
    except RuntimeError as exc:
        refused = str(exc)
    return {"differ": differ, "refused": refused}


def _pipelined(mesh, optimizer: str, steps: int, device_state: dict | None = None) -> dict:
    """Device model, plain loop vs 5%-cache model, ``TrainPipeline``; the order of the
    cached model's forwards, fills and updates, and the threads its row copies ran on.
    ``device_state``: the device model's state after these steps, where ``_side_by_side``
    of row-wise on this mesh has trained it (the same build and batches), else trained here."""
    import torch.distributed as dist

    import dtrec

    rank = dist.get_rank()
    cached, dense = _build(mesh, "row_wise", optimizer, {"cache_fraction": 0.05})
    gen = torch.Generator().manual_seed(11)  # _side_by_side's batches
    batches = [_batches(gen)[rank] for _ in range(steps)]
    if device_state is None:
        plain = _build(mesh, "row_wise", optimizer, {})
        for kjt, target in batches:
            _step(*plain, kjt, target, False)
        device_state = _state(plain[0])
    events: list[str] = []
    threads: set[int] = set()
    offload = cached.sparse._offload

    def logged(fn, event: str):
        def call(*args, **kwargs):
            events.append(event)
            return fn(*args, **kwargs)

        return call

    offload.slot_ids = logged(offload.slot_ids, "forward")
    offload.fill = logged(offload.fill, "fill")
    offload.after_update = logged(offload.after_update, "update")
    for cache in offload.caches.values():
        move = cache.move
        cache.move = lambda moves, move=move: (threads.add(threading.get_ident()), move(moves))

    pipeline = dtrec.TrainPipeline(
        cached, dense, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), sparse_features=lambda b: b[0]
    )
    for _ in pipeline.run(batches):
        pass
    want, got = device_state, _state(cached)
    return {
        "differ": _differences(want, got),
        "largest": _largest_difference(want, got),
        "events": events,
        "copies_on_main_thread": threading.get_ident() in threads,
        "copies_elsewhere": bool(threads - {threading.get_ident()}),
    }


def _planned(mesh, steps: int) -> dict:
    """``dtrec.plan`` with 60 kB of device memory per rank (and host memory): the specs it
    offloads, and its model trained against the same specs on the device."""
    import dataclasses

    import torch.distributed as dist

    import dtrec
    from tests.distributed.numerics import TinyModel

    topology = dtrec.Topology.cpu(
        memory_per_rank=60e3, memory_headroom=0.0, host_memory_per_rank=1e8,
        batch_size_per_rank=BATCH, default_pooling_factor=2.0,
    )  # fmt: skip
    plan = dtrec.plan(TinyModel(_tables()), mesh, topology=topology)
    on_device = {k: dataclasses.replace(v, cache_rows=None) for k, v in plan.items()}
    models = []
    for specs in (on_device, plan):
        torch.manual_seed(0)
        model = TinyModel(_tables()).to(DEVICE)
        model = dtrec.distribute_module(model, mesh, specs, _optimizer("adam"))
        dense = [p for n, p in model.named_parameters() if n.startswith("dense")]
        models.append((model, torch.optim.SGD(dense, 0.1)))
    gen = torch.Generator().manual_seed(9)
    for _ in range(steps):
        kjt, target = _batches(gen)[dist.get_rank()]
        for model, dense in models:
            _step(model, dense, kjt, target, False)
    return {
        "offloaded": sorted(k for k, v in plan.items() if v.offloaded),
        "differ": _differences(_state(models[0][0]), _state(models[1][0])),
    }


def _round_trip(root: Path, optimizer: str) -> dict:
    """Save both models after SAVE_AT steps (row-wise, S=2 x R=2), load into column-wise
    on S=4 (the cached model behind a 10% cache), train on to STEPS; compare."""
    import torch.distributed as dist

    import dtrec
    from dtrec.checkpoint import dcp as checkpoint

    rank = dist.get_rank()
    device = torch.device(DEVICE).type
    mesh2d, mesh1d = dtrec.init_mesh(device, 2), dtrec.init_mesh(device, 4)
    first = {
        "plain": _build(mesh2d, "row_wise", optimizer, {}),
        "cached": _build(mesh2d, "row_wise", optimizer, {"cache_fraction": 0.05}),
    }
    then = {
        "plain": _build(mesh1d, "column_wise", optimizer, {}),
        "cached": _build(mesh1d, "column_wise", optimizer, {"cache_fraction": 0.1}),
    }
    gen = torch.Generator().manual_seed(5)
    saved, snapshot = {}, {}
    for step in range(STEPS):
        kjt, target = _batches(gen)[rank]
        models = first if step < SAVE_AT else then
        for model, dense in models.values():
            _step(model, dense, kjt, target, False)
        if step == SAVE_AT - 1:
            for name, (model, dense) in first.items():
                saved[name] = _state(model)
                checkpoint.save(root / optimizer / name, model, dense)
            snapshot = _snapshot(first["plain"][0])
            for name, (model, dense) in then.items():
                checkpoint.load(root / optimizer / name, model, dense)
    want, got = _state(then["plain"][0]), _state(then["cached"][0])
    out = {
        "saved_differ": _differences(saved["plain"], saved["cached"]),
        "differ": _differences(want, got),
        "largest": _largest_difference(want, got),
    }
    # after one more step (the caches hold its rows), load_state_dict of step 25's full
    # tensors into both (the cached rows are then stale), five more steps: still equal
    for step in range(6):
        kjt, target = _batches(gen)[rank]
        for model, dense in then.values():
            _step(model, dense, kjt, target, False)
            if step == 0:
                model.load_state_dict(snapshot["model"])
                model.fused_optimizer.load_state_dict(snapshot["fused"])
    out["reloaded_differ"] = _differences(_state(then["plain"][0]), _state(then["cached"][0]))
    return out


def _snapshot(model) -> dict:
    """The model's and its fused optimizer's state as full tensors (a copy)."""
    from dtrec.checkpoint import full_state_dict, to_full_state_dict

    fused = model.fused_optimizer.state_dict()
    state = {t: to_full_state_dict(e) for t, e in fused["state"].items()}
    return {"model": full_state_dict(model), "fused": {**fused, "state": state}}


def _world(rank: int, world: int, root: str) -> dict:
    import dtrec

    meshes = {
        "1d": dtrec.init_mesh("cpu", 4, node_size=2),
        "2d": dtrec.init_mesh("cpu", 2),
    }
    out = {}
    device_states: dict[str, dict] = {o: {} for o in OPTIMIZERS}  # row-wise 2D: the pipelines'
    for name in CONFIGS:
        optimizer, kind, mesh = name.split("/")
        keep = device_states[optimizer] if (kind, mesh) == ("row_wise", "2d") else None
        out[name] = _side_by_side(meshes[mesh], kind, optimizer, SIDE_STEPS, False, keep)
    for kind in SEQUENCE:
        out[f"sequence/{kind}"] = _side_by_side(meshes["2d"], kind, "adam", SIDE_STEPS, True)
    out["planned"] = _planned(meshes["2d"], SIDE_STEPS)
    out["edge_cases"] = _edge_cases(meshes["1d"], SIDE_STEPS)
    out["full_cache"] = _full_cache(meshes["2d"], 10)
    out["sequence_pipeline"] = _sequence_pipelined(meshes["2d"], SIDE_STEPS)
    out["inference"] = _inference(meshes["2d"], 10)
    for optimizer in OPTIMIZERS:
        out[f"round_trip/{optimizer}"] = _round_trip(Path(root), optimizer)
        pipelined = _pipelined(meshes["2d"], optimizer, SIDE_STEPS, device_states[optimizer])
        out[f"pipeline/{optimizer}"] = pipelined
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_world(4, _world, str(tmp_path_factory.mktemp("offload")), timeout=1500)


@pytest.mark.parametrize("name", CONFIGS + [f"sequence/{k}" for k in SEQUENCE])
def test_cached_training_equals_device_training(results, name) -> None:
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        assert got["differ"] == [], f"rank {rank}: {got['differ']} differ"
    misses = sum(r[name]["misses"] for r in results)
    rows = sum(r[name]["rows"] for r in results)
    assert 0 < misses < rows, (misses, rows)  # the caches filled, evicted and hit
    assert sum(r[name]["written_back"] for r in results) > 0


def test_a_cache_that_holds_its_table_never_misses(results) -> None:
    """Filled whole (one copy per tier) at first and after the flush: two block copies in,
    no miss, the device model's weights and state bitwise."""
    for rank, per_rank in enumerate(results):
        got = per_rank["full_cache"]
        assert got["differ"] == [], f"rank {rank}: {got['differ']} differ"
        assert got["rows"] > 0 and got["misses"] == 0, (rank, got)
        assert got["h2d_bytes"] == 2 * got["block_bytes"], (rank, got)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_checkpoint_round_trip_into_another_plan_and_cache(results, optimizer) -> None:
    for rank, per_rank in enumerate(results):
        got = per_rank[f"round_trip/{optimizer}"]
        assert got["saved_differ"] == [], f"rank {rank}: saved {got['saved_differ']}"
        assert got["differ"] == [], f"rank {rank}: after loading, {got['differ']} differ"
        assert got["reloaded_differ"] == [], f"rank {rank}: {got['reloaded_differ']}"


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_pipeline_fills_the_next_batch_during_this_backward(results, optimizer) -> None:
    want = ["forward", "fill", "update"] * (SIDE_STEPS - 1) + ["forward", "update"]
    for rank, per_rank in enumerate(results):
        got = per_rank[f"pipeline/{optimizer}"]
        assert got["differ"] == [], f"rank {rank}: {got['differ']} differ from the plain loop"
        assert got["events"] == want, f"rank {rank}: {got['events'][:9]}"
        # batch 0 fills in its forward (nothing was prefetched): on the training thread
        assert got["copies_on_main_thread"] and got["copies_elsewhere"], rank


def test_a_planned_model_offloads_what_does_not_fit_and_trains_exactly(results) -> None:
    for rank, per_rank in enumerate(results):
        got = per_rank["planned"]
        assert got["offloaded"] == ["sparse.t0", "sparse.t2"], (rank, got["offloaded"])
        assert got["differ"] == [], f"rank {rank}: {got['differ']}"


def test_eval_mode_training_and_a_state_dict_between_forward_and_backward(results) -> None:
    for rank, per_rank in enumerate(results):
        assert per_rank["edge_cases"]["differ"] == [], (rank, per_rank["edge_cases"])


def test_sequence_collection_through_the_pipeline(results) -> None:
    for rank, per_rank in enumerate(results):
        assert per_rank["sequence_pipeline"]["differ"] == [], (rank, per_rank["sequence_pipeline"])


def test_without_a_fused_optimizer_offloaded_tables_evaluate(results) -> None:
    for rank, per_rank in enumerate(results):
        assert per_rank["inference"]["differ"] == 0, rank
        assert "train only with a fused optimizer" in per_rank["inference"]["refused"], rank
