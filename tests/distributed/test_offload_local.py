"""Offloaded tables on the paths main added: a shard axis of one position, uneven batches.

A shard axis of one position (a world of one rank, and a 1x2 mesh: replicas only) takes
the one-rank local path (``dtrec/sharded/lookup/local_path.py``), which pools the batch as it
came, without routing: offloaded tables must still be read through their caches. For each
fused optimizer, a model whose tables live in host memory behind a 2.5% cache and the same
model on the device train side by side for 15 steps, with per-rank batch sizes that vary
and include 0 (on one rank at a time, and on every rank); weights and optimizer states
must be bitwise equal, and the caches must have missed, hit and written back. Once on
the torch backend and once on the Triton one (its kernels in Triton's interpreter: the
one-pass fused backward + step writes the cache slots).

``TrainPipeline.progress`` (features found by the collection's forward input, the next
batch's fill from the local path's prefetched batch): the cached model equals the device
model through the same pipeline, each batch but the first filled before the previous
backward; a batch with an id outside its table on the last rank is refused on every
rank at its step (after its fill, on the 1x2 mesh), both models alike, the later steps
train on, and no cache row stays pinned at the end; ``copy.deepcopy`` of the cached model
between two steps (the next batch's fill left in flight) holds the same state.

Uneven batches on the routed path (a 1D mesh of two positions, row-wise and table-wise):
a rank with a batch of 0 while the other has 6, and the other way round, cached vs device,
bitwise (the received ids come in blocks of the largest batch).
"""

from __future__ import annotations

import pytest
import torch

from tests.multiprocess import run_world

STEPS = 30
LOCAL_STEPS, LOCAL_CACHE = 15, 0.025
"""The one-position worlds' side-by-side runs (Triton's interpreter: its kernels are most of
this file's time) take 15 steps behind a 2.5% cache: as many lookups per cache slot as 30
steps behind 5% (each cache fills, then evicts, writes back and misses again), every batch
size pattern of ``_size`` (steps 3, 8 and 12) included, and a cache still twice the
largest batch's rows (6 bags of 4 ids, 2 features: 48 of t0's 100 slots)."""
OPTIMIZERS = ("sgd", "adagrad", "adam")
BACKENDS = ("torch", "triton")


def _size(step: int, rank: int, world: int) -> int:
    """Per-rank batch sizes: 1..6, one rank at 0 every fifth step, every rank at 0 at
    step 12."""
    if step == 12 or (step % 5 == 3 and rank == (step // 5) % world):
        return 0
    return 1 + (step * 7 + rank * 3) % 6


def _batch(gen: torch.Generator, step: int, rank: int, world: int, bad_at: int = -1):
    """This rank's batch of ``step`` (every rank draws every rank's batch: one stream);
    at ``bad_at`` the last rank's batch has an id outside t0."""
    from tests.distributed.numerics import make_batch
    from tests.distributed.test_offload import _tables

    batches = [make_batch(_tables(), _size(step, r, world), False, gen) for r in range(world)]
    kjt, target = batches[rank]
    if step == bad_at and rank == world - 1:
        values = kjt.values().clone()
        values[0] = 4000
        kjt = type(kjt)(kjt.keys(), values, kjt.lengths())
    return kjt, target


def _train(model, dense, kjt, target) -> None:
    ((model(kjt) - target) ** 2).sum().backward()
    dense.step()
    dense.zero_grad()


def _cache_stats(model) -> dict[str, int]:
    stats = model.sparse.cache_stats().values()
    return {k: sum(s[k] for s in stats) for k in ("rows", "misses", "d2h_bytes")}


def _side_by_side(mesh, kind: str, optimizer: str, steps: int, cache: float = 0.05) -> dict:
    import torch.distributed as dist

    from tests.distributed.test_offload import _build, _differences, _state

    rank, world = dist.get_rank(), dist.get_world_size()
    plain = _build(mesh, kind, optimizer, {})
    cached = _build(mesh, kind, optimizer, {"cache_fraction": cache})
    gen = torch.Generator().manual_seed(23)
    for step in range(steps):
        kjt, target = _batch(gen, step, rank, world)
        _train(*plain, kjt, target)
        _train(*cached, kjt, target)
    return {
        "differ": _differences(_state(plain[0]), _state(cached[0])),
        "local": (plain[0].sparse._local is not None, cached[0].sparse._local is not None),
        **_cache_stats(cached[0]),
    }


def _pipelined(mesh, optimizer: str, steps: int, bad_at: int) -> dict:
    """Both models through ``TrainPipeline.progress`` on the same batches, the cached one's
    fills and forwards logged; the cached one deep-copied after step 3."""
    import copy

    import torch.distributed as dist

    import dtrec
    from tests.distributed.test_offload import _build, _differences, _state

    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(29)
    batches = [_batch(gen, step, rank, world, bad_at) for step in range(steps)]
    events: list[str] = []
    refused: dict[str, list[tuple[int, str]]] = {}
    models = {}
    for name, cache in (("plain", {}), ("cached", {"cache_fraction": 0.05})):
        model, dense = _build(mesh, "row_wise", optimizer, cache)
        if cache:
            offload = model.sparse._offload
            for method in ("fill", "slot_ids"):
                real = getattr(offload, method)
                setattr(offload, method, lambda *a, f=real, m=method: (events.append(m), f(*a))[1])

        def loss(m, batch):
            kjt, target = batch
            return ((m(kjt) - target) ** 2).sum()

        pipeline = dtrec.TrainPipeline(model, dense, loss)
        it = iter(batches)
        refused[name] = []
        for step in range(steps + 1):
            try:
                pipeline.progress(it)
            except StopIteration:
                break
            except (IndexError, ValueError) as exc:
                refused[name].append((step, type(exc).__name__))
            if step == 3 and cache:  # the next batch's fill may still be copying rows
                twin = copy.deepcopy(model)
                full = dtrec.checkpoint.full_state_dict
                copied = _differences(full(model), full(twin))
        models[name] = model
    caches = models["cached"].sparse._offload.caches.values()
    return {
        "differ": _differences(_state(models["plain"]), _state(models["cached"])),
        "events": events,
        "refused": refused,
        "pinned": sum(int(c.pins.sum()) for c in caches),
        "found": pipeline.describe(),
        "copied_differ": copied,
    }


def _one_position(rank: int, world: int) -> dict:
    import dtrec

    mesh = dtrec.init_mesh("cpu", 1)  # S = 1: W = 1, or replicas only
    out = {}
    for backend in BACKENDS:
        dtrec.ops.set_backend(backend)
        for optimizer in OPTIMIZERS:
            out[(backend, optimizer)] = _side_by_side(
                mesh, "row_wise", optimizer, LOCAL_STEPS, LOCAL_CACHE
            )
    dtrec.ops.set_backend("torch")
    for optimizer in OPTIMIZERS:
        out[("pipeline", optimizer)] = _pipelined(mesh, optimizer, 12, bad_at=6)
    dtrec.ops.set_backend("auto")
    return out


def _two_positions(rank: int, world: int) -> dict:
    import dtrec

    mesh = dtrec.init_mesh("cpu", 2)  # S = 2: the routed path
    return {
        (kind, optimizer): _side_by_side(mesh, kind, optimizer, STEPS)
        for kind in ("row_wise", "table_wise")
        for optimizer in ("adagrad", "adam")
    }


_ENV = {"TRITON_INTERPRET": "1"}


@pytest.fixture(scope="module", params=[1, 2], ids=["W1", "1x2"])
def one_position(request) -> list[dict]:
    pytest.importorskip("triton")
    return run_world(request.param, _one_position, timeout=1200, env=_ENV)


@pytest.fixture(scope="module")
def two_positions() -> list[dict]:
    return run_world(2, _two_positions, timeout=900)


def _check_side_by_side(results: list[dict], key: tuple) -> None:
    for rank, per_rank in enumerate(results):
        got = per_rank[key]
        assert got["differ"] == [], f"rank {rank}: {got['differ']} differ"
    assert 0 < sum(r[key]["misses"] for r in results) < sum(r[key]["rows"] for r in results)
    assert sum(r[key]["d2h_bytes"] for r in results) > 0  # evicted rows were written back


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_position_reads_offloaded_tables_through_the_cache(
    one_position, backend, optimizer
) -> None:
    assert all(r[(backend, optimizer)]["local"] == (True, True) for r in one_position)
    _check_side_by_side(one_position, (backend, optimizer))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_one_position_pipeline_fills_and_refuses_alike(one_position, optimizer) -> None:
    world = len(one_position)
    for rank, per_rank in enumerate(one_position):
        got = per_rank[("pipeline", optimizer)]
        assert got["differ"] == [], f"rank {rank}: {got['differ']} differ"
        assert got["found"] == {"sparse": "batch[0]"}, got["found"]
        want = "IndexError" if rank == world - 1 else "ValueError"
        assert got["refused"] == {"plain": [(6, want)], "cached": [(6, want)]}, got["refused"]
        # batches 1..11 are filled before the previous backward, but for batch 7 (the
        # refused step 6 has no backward: filled in its forward) and, at W=1, the refused
        # batch 6 (refused at its prefetch; on the 1x2 mesh its forward drops the fill)
        fills = got["events"].count("fill")
        assert fills == (9 if world == 1 else 10), got["events"]
        assert got["events"][:3] == ["slot_ids", "fill", "slot_ids"], got["events"]
        assert got["pinned"] == 0, f"rank {rank}: {got['pinned']} slots still pinned"
        assert got["copied_differ"] == [], f"rank {rank}: the copy differs"


@pytest.mark.parametrize("kind", ["row_wise", "table_wise"])
@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_uneven_and_empty_batches_on_the_routed_path(two_positions, kind, optimizer) -> None:
    assert all(r[(kind, optimizer)]["local"] == (False, False) for r in two_positions)
    _check_side_by_side(two_positions, (kind, optimizer))
