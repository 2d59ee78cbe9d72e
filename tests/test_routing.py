"""Routing.bucketize + send_layout (vectorized) vs a per-segment loop that states the send
layout plainly."""

from __future__ import annotations

import pytest
import torch

import dtrec
from dtrec.placements import ColumnWise, DataParallel, Grid, RowWise, TableRowWise, TableWise
from dtrec.placements.mesh import ShardAxis
from dtrec.sharded.dist.routing import Routing

AXIS = ShardAxis(size=4, replicas=1, per_node=2)
TABLES = [
    dtrec.EmbeddingBagConfig("rw", 10, 4, ["a", "b"]),
    dtrec.EmbeddingBagConfig("cw", 7, 6, ["c"]),
    dtrec.EmbeddingBagConfig("tw", 5, 3, ["d"]),
    dtrec.EmbeddingBagConfig("dp", 6, 2, ["e"]),
    dtrec.EmbeddingBagConfig("grid", 9, 8, ["f"]),
    dtrec.EmbeddingBagConfig("trw", 3, 4, ["g"]),  # 3 rows over 2 shards: uneven blocks
]
SPECS = [RowWise(), ColumnWise(), TableWise(rank=2), DataParallel(), Grid(),
         TableRowWise(node=0)]  # fmt: skip


def _bucketize(routing: Routing, values, lengths, weights):
    """What the input dist sends each position: runs laid out on the device, their sizes read
    (the header's read), sliced; per position ``[lengths | ids]``, weights and id count."""
    runs = routing.bucketize(values, lengths, weights)
    layout = routing.send_layout(runs, runs.lengths.sum(1).tolist())
    buffers = [
        torch.cat([*(x.long() for x in ls), *(x.long() for x in ids)]) if ls else values[:0]
        for ls, ids in zip(layout.lengths, layout.ids, strict=True)
    ]
    sent = [None] * len(buffers)
    if layout.weights is not None:
        sent = [torch.cat(ws) if ws else weights[:0] for ws in layout.weights]
    return buffers, sent, layout.counts


def _loop_bucketize(routing: Routing, values, lengths, weights):
    """The layout spelled out: per position, per served segment, that feature's ids in rows."""
    batch = lengths.shape[1]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.sum(1).cumsum(0)])
    bags = lengths.reshape(-1)
    buffers, sent, counts = [], [], []
    for segs in routing.segments_to:
        seg_lengths, seg_ids, seg_w = [], [], []
        for seg in segs:
            k = seg.feature
            ids = values[offsets[k] : offsets[k + 1]]
            bag = torch.repeat_interleave(torch.arange(batch), bags[k * batch : (k + 1) * batch])
            mask = (ids >= seg.block.rows[0]) & (ids < seg.block.rows[1])
            seg_lengths.append(torch.bincount(bag[mask], minlength=batch))
            seg_ids.append(ids[mask] - seg.block.rows[0])
            if weights is not None:
                seg_w.append(weights[offsets[k] : offsets[k + 1]][mask])
        ids_cat = torch.cat(seg_ids) if seg_ids else values.new_zeros(0)
        buffers.append(torch.cat([*seg_lengths, ids_cat]) if segs else values.new_zeros(0))
        sent.append(None if weights is None else (torch.cat(seg_w) if seg_w else weights[:0]))
        counts.append(ids_cat.numel())
    return buffers, sent, counts


@pytest.mark.parametrize("path", ["fbgemm", "sort", "search"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("position", [0, 3])
def test_bucketize_matches_the_per_segment_layout(
    monkeypatch: pytest.MonkeyPatch, weighted: bool, position: int, path: str
) -> None:
    import dtrec.sharded.dist.routing as routing_module
    from dtrec.ops.backends.fbgemm_loader import fbgemm_available

    if path == "fbgemm" and not fbgemm_available():
        pytest.skip("fbgemm_gpu is not importable: only the sort path runs")
    layouts = [spec.layout(cfg, AXIS) for spec, cfg in zip(SPECS, TABLES, strict=True)]
    routing = Routing(TABLES, layouts, AXIS.size, position)
    # chunks: id // rows per block; fbgemm's buckets are the row blocks (grid's column
    # blocks share theirs)
    assert routing._run_maps.chunk_rows is not None
    assert routing._run_maps.fbgemm_segment_run is not None
    if path != "fbgemm":  # what a machine without fbgemm runs
        monkeypatch.setattr(routing_module, "fbgemm_ops", lambda: None)
    if path == "search":  # the general path: each id's block by searchsorted over block starts
        routing._run_maps.chunk_rows = None
    g = torch.Generator().manual_seed(position)
    batch = 5
    rows = [cfg.num_embeddings for cfg in TABLES for _ in cfg.feature_names]
    lengths = torch.randint(0, 4, (len(rows), batch), generator=g)
    lengths[0, 1] = 0  # an empty bag
    values = torch.cat([torch.randint(0, r, (int(n),), generator=g)
                        for r, n in zip(rows, lengths.sum(1))])  # fmt: skip
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    got = _bucketize(routing, values, lengths, weights)
    want = _loop_bucketize(routing, values, lengths, weights)
    assert got[2] == want[2]
    for p, (a, b) in enumerate(zip(got[0], want[0], strict=True)):
        assert torch.equal(a, b), p
    for a, b in zip(got[1], want[1], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    # column-wise ids are sent to every column block: more ids than the batch holds
    assert sum(got[2]) > values.numel() - int(lengths[4].sum())  # dp feature "e" stays home


def test_data_parallel_tables_are_decided_once_and_not_routed() -> None:
    layouts = [spec.layout(cfg, AXIS) for spec, cfg in zip(SPECS, TABLES, strict=True)]
    routing = Routing(TABLES, layouts, AXIS.size, position=1)
    assert routing.data_parallel_tables == {3}
    assert routing.local_features == [4]  # feature "e", in output order
    assert all(s.table != 3 for segs in routing.segments_to for s in segs)
    assert 3 in routing.local_tables  # every rank holds a data-parallel table whole


def test_only_routing_reads_the_data_parallel_flag() -> None:
    """The sharded engine asks ``Routing.data_parallel_tables``; the flag is read once."""
    import pathlib

    sharded = pathlib.Path(dtrec.__file__).parent / "sharded"
    readers = sorted(
        p.relative_to(sharded).as_posix()
        for p in sharded.rglob("*.py")
        if "batch_local" in p.read_text()
    )
    assert readers == ["dist/routing.py"]


@pytest.mark.parametrize("sync_every", [None, 2])
def test_grad_sync_plan_sums_data_parallel_tables_over_the_world(sync_every) -> None:
    from dtrec.placements.mesh import REPLICATE
    from dtrec.sharded.dist.groups import world_group
    from dtrec.sharded.update.sync_plan import GradSyncPlan
    from tests.fake_world import fake_world

    with fake_world(0, 8):
        mesh = dtrec.init_mesh("cpu", AXIS.size, node_size=AXIS.per_node)
        layouts = [spec.layout(cfg, AXIS) for spec, cfg in zip(SPECS, TABLES, strict=True)]
        plan = GradSyncPlan(mesh, Routing(TABLES, layouts, AXIS.size, position=0))
        dp, rw = plan.table(3, sync_every), plan.table(0, sync_every)
        assert (dp.group, dp.scale, dp.kind) == (
            world_group(mesh),
            1 / 8,
            "grad_sync.data_parallel",
        )
        if sync_every is None:  # replicas sum, so the sum covers all 8 batches
            assert (rw.group, rw.scale) == (mesh.get_group(REPLICATE), 1 / 8)
        else:  # replicas average weights every k steps instead: own 4 batches only
            assert (rw.group, rw.scale) == (None, 1 / 4)
        assert rw.kind == "grad_sync.replicate"


# Row-split tables whose row block i sits at position i (row-wise chunks, one node's
# table-row-wise, a table with fewer rows than shards): fbgemm's block bucketize serves them.
RW_TABLES = [*TABLES[:4], dtrec.EmbeddingBagConfig("rw2", 9, 8, ["f"]), TABLES[5]]
RW_SPECS = [RowWise(), ColumnWise(), TableWise(rank=2), DataParallel(), RowWise(), RowWise()]


def _batch(tables, seed: int, weights: str):
    g = torch.Generator().manual_seed(seed)
    batch = 5
    rows = [cfg.num_embeddings for cfg in tables for _ in cfg.feature_names]
    lengths = torch.randint(0, 4, (len(rows), batch), generator=g)
    lengths[0, 1] = 0  # an empty bag
    values = torch.cat([torch.randint(0, r, (int(n),), generator=g)
                        for r, n in zip(rows, lengths.sum(1))])  # fmt: skip
    w = {
        "none": None,
        "fp32": torch.rand(values.numel(), generator=g),
        "fp64": torch.rand(values.numel(), generator=g, dtype=torch.float64),
        "positions": torch.arange(values.numel()),  # the sequence path's int64 "weights"
    }[weights]
    return values, lengths, w


@pytest.mark.parametrize("weights", ["none", "fp32", "fp64", "positions"])
@pytest.mark.parametrize("path", ["fbgemm", "sort"])
@pytest.mark.parametrize("position", [0, 3])
def test_row_wise_bucketize_paths_match_the_per_segment_layout(
    monkeypatch: pytest.MonkeyPatch, path: str, weights: str, position: int
) -> None:
    import dtrec.sharded.dist.routing as routing_module
    from dtrec.ops.backends.fbgemm_loader import fbgemm_available

    if path == "fbgemm" and not fbgemm_available():
        pytest.skip("fbgemm_gpu is not importable: only the sort path runs")
    calls = []
    if path == "sort":  # what a machine without fbgemm runs
        monkeypatch.setattr(routing_module, "fbgemm_ops", lambda: None)
    else:
        real = routing_module.fbgemm_ops
        monkeypatch.setattr(routing_module, "fbgemm_ops", lambda: calls.append(1) or real())
    layouts = [spec.layout(cfg, AXIS) for spec, cfg in zip(RW_SPECS, RW_TABLES, strict=True)]
    routing = Routing(RW_TABLES, layouts, AXIS.size, position)
    assert routing._run_maps.fbgemm_segment_run is not None
    values, lengths, w = _batch(RW_TABLES, position, weights)
    got = _bucketize(routing, values, lengths, w)
    want = _loop_bucketize(routing, values, lengths, w)
    assert len(calls) == (path == "fbgemm")
    assert got[2] == want[2]
    for p, (a, b) in enumerate(zip(got[0], want[0], strict=True)):
        assert torch.equal(a, b), p
    for a, b in zip(got[1], want[1], strict=True):
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))


def test_trained_weights_take_the_sort_path(monkeypatch) -> None:
    """fbgemm's op has no autograd: weights that need a gradient are laid out by the sort,
    and their gradient flows back. fbgemm serves every chunked layout otherwise, column
    blocks (grid) and a node's rows at positions 2-3 included."""
    import dtrec.sharded.dist.routing as routing_module

    real = routing_module.fbgemm_ops
    calls = []
    monkeypatch.setattr(routing_module, "fbgemm_ops", lambda: calls.append(1) or real())
    for specs in (SPECS, [*RW_SPECS[:5], TableRowWise(node=1)]):
        layouts = [spec.layout(cfg, AXIS) for spec, cfg in zip(specs, TABLES, strict=True)]
        assert Routing(TABLES, layouts, AXIS.size, 0)._run_maps.fbgemm_segment_run is not None
    layouts = [spec.layout(cfg, AXIS) for spec, cfg in zip(RW_SPECS, RW_TABLES, strict=True)]
    routing = Routing(RW_TABLES, layouts, AXIS.size, 1)
    values, lengths, w = _batch(RW_TABLES, 1, "fp32")
    w_loop = w.clone().requires_grad_(True)
    w.requires_grad_(True)
    got = _bucketize(routing, values, lengths, w)
    want = _loop_bucketize(routing, values, lengths, w_loop)
    assert not calls
    for sent in (got[1], want[1]):  # each position's weights scaled differently
        sum(((p + 1) * x).sum() for p, x in enumerate(sent)).backward()
    assert torch.equal(w.grad, w_loop.grad) and bool(w.grad.max() > 1)


def test_chunks_fbgemm_cannot_bucket_take_the_sort_path() -> None:
    """fbgemm sends an id to bucket ``id // c`` of S: a table of more than S chunks (or an
    empty block with no empty bucket to stand for it) is not fbgemm's."""
    from dtrec.placements import Block
    from dtrec.sharded.dist.row_buckets import fbgemm_runs_of

    five = [(0, Block(p, rows, (0, 4))) for p, rows in enumerate([(0, 2), (2, 4), (4, 5), (5, 5)])]
    assert fbgemm_runs_of([5], five, [2], 4) == (0, 1, 2, 3)  # bucket 3 ([6, 8)) is empty
    assert fbgemm_runs_of([5], five[:3], [2], 3) == (0, 1, 2)
    assert fbgemm_runs_of([5], five[:2], [2], 2) is None  # ids 4 would wrap to bucket 0
    full = [(0, Block(p, rows, (0, 4))) for p, rows in enumerate([(0, 2), (2, 3), (3, 3)])]
    assert fbgemm_runs_of([3], full, [2], 3) == (0, 1, 2)
    assert fbgemm_runs_of([4], [*five[:2], (0, Block(2, (4, 4), (0, 4)))], [2], 2) is None


def test_tables_on_few_positions_of_a_large_axis_take_the_sort_path() -> None:
    """Table-row-wise over a large shard axis: fbgemm's op would write ``[S * F, B]``
    lengths, mostly for no segment (S = 1024, 26 tables over 8 positions each: 1.7 GB at
    B = 16384); the sort path's ``[runs, B]`` is taken instead. Up to ``SPARSE_BUCKETS``
    rows per segment fbgemm stays (every row-wise table: one per segment)."""
    from dtrec.placements import Block
    from dtrec.sharded.dist.row_buckets import SPARSE_BUCKETS, fbgemm_runs_of

    def node_blocks(shards: int, features: int) -> list:
        # feature f in 8 chunks of 4 rows on positions 8 (f mod nodes) .. + 7
        nodes = shards // 8
        return [(f, Block(8 * (f % nodes) + i, (4 * i, 4 * i + 4), (0, 4)))
                for f in range(features) for i in range(8)]  # fmt: skip

    assert fbgemm_runs_of([32] * 4, node_blocks(8 * SPARSE_BUCKETS, 4), [4] * 4, 8 * SPARSE_BUCKETS)
    assert (
        fbgemm_runs_of([32] * 4, node_blocks(16 * SPARSE_BUCKETS, 4), [4] * 4, 16 * SPARSE_BUCKETS)
        is None
    )
    rows = [(f, Block(p, (p, p + 1), (0, 4))) for f in range(4) for p in range(1024)]
    assert fbgemm_runs_of([1024] * 4, rows, [1] * 4, 1024) is not None


@pytest.mark.parametrize("path", ["fbgemm", "sort", "search"])
def test_ids_outside_their_table_are_laid_out_without_indexing_out_of_range(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """The input dist lays a batch out before the header says whether some rank refused it,
    so a batch with ids outside their table (negative, past the last row, past int32) must
    lay out without an error: each id lands in some run, every segment gets its ids' count,
    and the good ids are laid out as for a good batch."""
    import dtrec.sharded.dist.routing as routing_module
    from dtrec.ops.backends.fbgemm_loader import fbgemm_available

    if path == "fbgemm" and not fbgemm_available():
        pytest.skip("fbgemm_gpu is not importable: only the sort path runs")
    if path != "fbgemm":
        monkeypatch.setattr(routing_module, "fbgemm_ops", lambda: None)
    layouts = [spec.layout(cfg, AXIS) for spec, cfg in zip(SPECS, TABLES, strict=True)]
    routing = Routing(TABLES, layouts, AXIS.size, 0)
    if path == "search":
        routing._run_maps.chunk_rows = None
    values, lengths, _ = _batch(TABLES, 7, "none")
    good_runs = routing.bucketize(values, lengths, None)
    good = routing.send_layout(good_runs, good_runs.lengths.sum(1).tolist())
    bad = values.clone()
    last = bad.numel() - 1  # feature "g" (table-row-wise), its last id
    bad[0], bad[1], bad[last] = -1, 2**31 + 3, 10_000  # feature "a" (row-wise): two bad ids
    runs = routing.bucketize(bad, lengths, None)
    sizes = runs.lengths.sum(1)
    assert int(sizes.sum()) == runs.ids.numel() and runs.ids.numel() >= bad.numel()
    got = routing.send_layout(runs, sizes.tolist())
    # the features without bad ids are laid out as in the good batch
    for p in range(AXIS.size):
        for i, seg in enumerate(routing.segments_to[p]):
            if seg.feature not in (0, len(routing.slots) - 1):
                assert torch.equal(got.lengths[p][i], good.lengths[p][i]), (p, seg)
                assert torch.equal(got.ids[p][i], good.ids[p][i]), (p, seg)
