"""One rank's step of a W-rank job, run through dtrec's own exchanges in one process.

Why: the bytes each collective sends at W = 4096 should come from the code that sends
them, not from a formula beside it. ``simulate_rank`` builds the (S, R) mesh on the mirror
process group (``benchmarks.scale.mirror_world``), feeds the rank a real batch and runs the
real ``InputDist`` (header, verdict and ids all-to-alls), ``OutputDist`` forward and
backward (the partials as meta tensors: their sizes only), the fused update's replica
sync (``record_sync_rows``: the exchanges ``sync_rows`` runs, sized by the same
``sync_wire``, no data) and column peers' row-norm all-reduce, and the dense model's bucketed
gradient all-reduce (``dtrec.sharded.dense``), all under ``dtrec.comm_stats()``. No table
is allocated, so MLPerf's 40M-row tables cost nothing.

What the mirror world cannot know is taken from real batches: the rows a block's update
touches (the replica sync's size) are the distinct ids the shard group's batches send to
it, each peer's batch generated with its own seed (``make_features``), and the sparse
sync pads to the largest count over the replicas, computed the same way while the world
is small (``EXACT_WORLD``); beyond it a replica's own count stands for the largest (the
counts of R similar batches differ by well under 1%). The same ``make_features`` feeds
the real gloo runs the simulation is checked against (tests/test_scale.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from benchmarks.scale.mirror_world import mirror_world
from dtrec.comm.collectives import all_reduce_coalesced_start, all_reduce_start, comm_stats
from dtrec.modules.config import EmbeddingBagConfig
from dtrec.placements import TableSpec
from dtrec.placements.mesh import REPLICATE, SHARD, init_mesh, shard_axis, shard_position
from dtrec.planning.step_model import collective_of
from dtrec.sharded.dense import KIND as DENSE_KIND
from dtrec.sharded.dense_buckets import make_buckets as _buckets
from dtrec.sharded.dist.groups import column_groups
from dtrec.sharded.dist.input_dist import InputDist
from dtrec.sharded.dist.output_dist import OutputDist
from dtrec.sharded.dist.replica_slices import (
    OwnerSlices,
    fetch_of,
    fetch_touched,
    route_to_owners,
)
from dtrec.sharded.dist.routed_batch import wire_dtype
from dtrec.sharded.dist.routing import Routing
from dtrec.sharded.update.grad_sync import RowsShape, record_sync_rows
from dtrec.sharded.update.sync_plan import GradSyncPlan
from dtrec.sparse import KeyedJaggedTensor

EXACT_WORLD = 64
"""Up to this many ranks every peer's batch is generated (exact touched-row counts)."""


@dataclass(frozen=True)
class Workload:
    """Tables (one feature ``f<i>`` each, sum pooling) and the batch every rank feeds."""

    rows: tuple[int, ...]
    """Rows of table ``t<i>``."""
    hotness: tuple[int, ...]
    """Mean ids per bag of feature ``f<i>`` (bags hold uniform [1, 2h - 1] ids)."""
    dim: int
    """Embedding dim of every table."""
    batch: int
    """Samples per rank per step."""
    seed: int = 0

    def tables(self) -> list[EmbeddingBagConfig]:
        return [
            EmbeddingBagConfig(f"t{i}", r, self.dim, [f"f{i}"], "sum")
            for i, r in enumerate(self.rows)
        ]


def make_features(w: Workload, rank: int, dtype: torch.dtype = torch.int64) -> KeyedJaggedTensor:
    """Rank ``rank``'s batch: per feature, lengths uniform in [1, 2h - 1], ids uniform over
    the table's rows (seeded by ``w.seed`` and the rank, so any process can rebuild it).
    ``dtype``: of ids and lengths (the simulation feeds the input dist's wire dtype, so its
    send buffer is built once, not as int64 and then cast: the same bytes go out)."""
    gen = torch.Generator().manual_seed(w.seed * 1_000_003 + rank)
    lengths, values = [], []
    for rows, hot in zip(w.rows, w.hotness, strict=True):
        ls = torch.randint(1, 2 * hot, (w.batch,), generator=gen)
        lengths.append(ls)
        values.append(torch.randint(0, rows, (int(ls.sum()),), generator=gen))
    keys = [f"f{i}" for i in range(len(w.rows))]
    return KeyedJaggedTensor(keys, torch.cat(values).to(dtype), torch.cat(lengths).to(dtype))


def _feature_ids(kjt: KeyedJaggedTensor, t: int) -> torch.Tensor:
    return kjt.to_dict()[f"f{t}"].values()


@dataclass
class RankStep:
    """What one rank sends and computes in a step (``simulate_rank``)."""

    world: int
    shards: int
    rank: int
    comm: dict[str, dict[str, float]]
    """``comm_stats`` kind -> {"calls", "bytes"} this rank sends per step."""
    looked_up: float = 0.0
    """Row elements gathered by its lookups (ids x block columns)."""
    ids: int = 0
    """Ids its lookups read."""
    bags: int = 0
    """Bags it pools (served blocks and its own data-parallel features)."""
    pooled: int = 0
    """Elements of the partials it writes in forward (and reads back in backward)."""
    updated: float = 0.0
    """Row elements its update reads and writes (touched rows x block columns)."""
    rows_touched: int = 0
    groups: dict[str, int] = field(default_factory=dict)
    """Size of the group each kind runs over."""


Job = tuple[int, int, int, list[int]]
"""(table, first row, end row, ranks) whose distinct ids ``_touched`` counts."""


def _touched(
    w: Workload, jobs: dict[object, Job], own: KeyedJaggedTensor, me: int
) -> dict[object, torch.Tensor]:
    """Per job ``(table, first row, end row, ranks)``: the distinct ids of the table in those
    rows over the batches of those ranks. Each rank's batch is generated once."""
    found: dict[object, list[torch.Tensor]] = {key: [] for key in jobs}
    for r in sorted({r for *_, ranks in jobs.values() for r in ranks}):
        features = (own if r == me else make_features(w, r)).to_dict()
        for key, (t, lo, hi, ranks) in jobs.items():
            if r in ranks:
                ids = features[f"f{t}"].values()
                found[key].append(torch.unique(ids[(ids >= lo) & (ids < hi)]))
    return {key: torch.unique(torch.cat(parts)) for key, parts in found.items()}


def _expected_distinct(draws: float, rows: int) -> int:
    """Distinct rows among ``draws`` uniform draws over ``rows`` (for worlds too large to
    generate every peer's batch; it sizes only the update's compute there: such worlds
    have no replicas in the sweep's 1D plans, and 2D ones use ``_touched``)."""
    if rows <= 0:
        return 0
    return int(round(rows * -math.expm1(-draws / rows)))


def simulate_rank(
    w: Workload,
    specs: dict[str, TableSpec],
    world: int,
    shard_group_size: int,
    rank: int = 0,
    node_size: int | None = None,
    dense: nn.Module | None = None,
    exact_world: int = EXACT_WORLD,
    group_batches: int = EXACT_WORLD,
    sync_every: int | None = None,
) -> RankStep:
    """Run rank ``rank``'s exchanges of one training step (module docstring) and return
    the bytes ``comm_stats`` recorded per kind, with the rank's lookup and update sizes.
    ``exact_world``: up to this many ranks every member's batch is generated;
    ``group_batches``: up to this S the shard group's batches are (beyond, the touched rows
    are the expected distinct count of the ids received: uniform ids, so the same in
    expectation). ``sync_every=k``: replicas do not sum gradients; every k-th step they
    average weights and row-wise Adagrad state (``GradSyncPlan.start_average``, the real
    call on meta blocks), counted as 1/k of it per step."""
    tables = w.tables()
    with mirror_world(rank, world):
        mesh = init_mesh("cpu", shard_group_size, node_size)
        axis = shard_axis(mesh)
        position = shard_position(mesh)
        assert position is not None
        coord = mesh.get_coordinate()
        assert coord is not None
        layouts = [specs[cfg.name].layout(cfg, axis) for cfg in tables]
        routing = Routing(tables, layouts, axis.size, position)
        grid = mesh.mesh  # [S, R] global ranks
        with comm_stats() as stats:
            own = make_features(w, rank, wire_dtype(tables))
            step = RankStep(world, axis.size, rank, {})
            routed = InputDist(tables, routing, mesh)(own, "off")
            if routed.error is not None:
                raise routed.error
            if routing.has_sharded:
                _output_dist(routing, tables, mesh, routed, step)
            touched = _sync_rows(
                w, routing, layouts, grid, coord, position, own, routed, exact_world, group_batches
            )
            sync_plan = GradSyncPlan(mesh, routing)
            sliced = _fully_sharded(routing, layouts, world // axis.size)
            _syncs(routing, layouts, sync_plan, mesh, position, touched, tables, step, sync_every,
                   sliced)  # fmt: skip
            _replica_slices(sliced, layouts, mesh, position, touched, tables, step)
            _data_parallel_lookups(routing, tables, own, step)
            if dense is not None:
                for bucket in _buckets(list(dense.parameters())):
                    flat = torch.empty(bucket.numel + len(bucket.params), device="meta")
                    all_reduce_start(flat, None, DENSE_KIND).wait()
        per_step = stats.per_step()
        if sync_every is not None:
            with comm_stats() as every:
                _average_replicas(layouts, sync_plan, position)
            per_step.update(every.per_step(sync_every))
        step.comm = {k: {"calls": v["calls"], "bytes": v["bytes"]} for k, v in
                     per_step.items()}  # fmt: skip
        step.groups = _group_sizes(step.comm, axis.size, world // axis.size, world)
    return step


def _output_dist(routing, tables, mesh, routed, step: RankStep) -> None:
    """Forward and backward of the real output dist on meta partials; the lookup's sizes."""
    served = None
    batch = routed.served_batch
    if routing.served:
        shape = (batch, routing.shard_size * routing.served_width)
        served = torch.empty(shape, device="meta", requires_grad=True)
        segs = routing.served
        for counts in routed.peer_segment_counts:
            for seg, count in zip(segs, counts, strict=True):
                step.ids += count
                step.looked_up += count * seg.block.num_cols
        step.bags += batch * routing.shard_size * len(segs)
        step.pooled += served.numel()
    out = OutputDist(tables, routing, mesh.get_group(SHARD), torch.float32)(
        served, routed.batch, routed.peer_batches, torch.device("cpu")
    )
    out.backward(torch.ones_like(out))


@dataclass(frozen=True)
class Touched:
    """One local table's touched rows: as the replica sync pads them, and after it."""

    padded: int
    """The largest count over the sync group's members (what each member sends)."""
    union: int
    """Distinct rows over the group (what the update and the row norms cover)."""
    own: int
    """This rank's own (what it updates when replicas sync weights, ``sync_every``)."""


def _sync_rows(
    w, routing, layouts, grid, coord, position, own, routed, exact_world: int, group_batches: int
) -> dict[int, Touched]:
    """Per local table: the rows its update touches (``Touched``), from generated batches:
    every member's while the world is small, else this shard group's (the union over R
    replicas then as for R independent draws of as many rows)."""
    shards, replicas = grid.shape
    exact = shards * replicas <= exact_world
    me = int(grid[coord[0], coord[1]])
    jobs: dict[object, Job] = {}
    for t in routing.local_tables:
        if t in routing.data_parallel_tables:  # synced over the world, own rows each
            for r in grid.flatten().tolist() if exact else [me]:
                jobs["dp", t, r] = (t, 0, w.rows[t], [r])
        elif exact or shards <= group_batches:
            block = next(b for b in layouts[t].blocks if b.position == position)
            for c in range(replicas) if exact else [coord[1]]:
                jobs["block", t, c] = (t, *block.rows, grid[:, c].tolist())
    sets = _touched(w, jobs, own, me)
    out: dict[int, Touched] = {}
    for t in routing.local_tables:
        mine = [v for k, v in sets.items() if k[1] == t]
        if t in routing.data_parallel_tables:
            rows, members = w.rows[t], shards * replicas
        else:
            block = next(b for b in layouts[t].blocks if b.position == position)
            rows, members = block.num_rows, replicas
        if not mine:  # a shard group too large to generate (1D at large W)
            seg_ids = sum(
                count
                for counts in routed.peer_segment_counts
                for seg, count in zip(routing.served, counts, strict=True)
                if seg.table == t
            )
            n = _expected_distinct(seg_ids, rows)
            out[t] = Touched(n, _union(n, rows, members), n)
            continue
        padded = max(x.numel() for x in mine)
        own_key = ("dp", t, me) if t in routing.data_parallel_tables else ("block", t, coord[1])
        own_rows = sets[own_key].numel() if own_key in sets else mine[0].numel()
        union = torch.unique(torch.cat(mine)).numel() if exact else _union(
            mine[0].numel(), rows, members
        )  # fmt: skip
        out[t] = Touched(padded, int(union), own_rows)
    return out


def _union(n: int, rows: int, sets: int) -> int:
    """Distinct rows of ``sets`` independent sets of ``n`` uniform rows out of ``rows``."""
    if rows <= 0 or sets <= 1:
        return n
    return int(round(rows * -math.expm1(sets * math.log1p(-min(n, rows - 0.5) / rows))))


def _syncs(
    routing, layouts, plan, mesh, position, touched, tables, step: RankStep, sync_every,
    sliced: frozenset[int] = frozenset(),
) -> None:  # fmt: skip
    """The fused update's exchanges: column peers' row norms, then the replica syncs
    grouped as ``FusedUpdater._sync_and_update`` groups them (none for routed tables
    whose replicas average weights instead, ``sync_every``, nor for fully sharded ones,
    ``sliced``: ``_replica_slices``); ``plan``: the step's ``GradSyncPlan``."""
    if sync_every is not None:  # each replica updates its own rows; no gradient sum
        touched = {
            t: Touched(v.own, v.own, v.own)
            if t not in routing.data_parallel_tables else v
            for t, v in touched.items()
        }  # fmt: skip
    routed_layouts = {
        t: layouts[t] for t in routing.local_tables if t not in routing.data_parallel_tables
    }
    columns = column_groups(mesh, routed_layouts, position)
    by_group: dict[int, tuple[object, str, list[int]]] = {}
    for t in sorted(touched):
        cols = _cols(layouts[t], position) if t in routed_layouts else tables[t].embedding_dim
        if t in sliced:  # the owner updates its slice's share of the replicas' union
            share = touched[t].union / mesh[REPLICATE].size()
            step.updated += share * cols
            step.rows_touched += int(round(share))
            continue
        step.updated += touched[t].union * cols
        step.rows_touched += touched[t].union
        sync = plan.table(t, sync_every)
        if sync.group is not None:
            by_group.setdefault(id(sync.group), (sync.group, sync.kind, []))[2].append(t)
    by_columns: dict[int, tuple[object, list[int]]] = {}  # one all-reduce per peer group
    for t, group in sorted(columns.items()):
        by_columns.setdefault(id(group), (group, []))[1].append(t)
    for group, ts in by_columns.values():  # over the rows the replica sync left
        sums = [torch.empty(touched[t].union, device="meta") for t in ts]
        all_reduce_coalesced_start(sums, group, "optim.row_sq_sum").wait()
    for group, kind, ts in by_group.values():
        shapes = [
            RowsShape(
                _cols(layouts[t], position) if t in routed_layouts else tables[t].embedding_dim,
                _num_rows(layouts[t], position, tables[t]),
            )
            for t in ts
        ]
        record_sync_rows(shapes, [touched[t].padded for t in ts], group, kind)


def _fully_sharded(routing, layouts, replicas: int) -> frozenset[int]:
    """The local routed tables laid out fully sharded 2D (owner slices over R > 1)."""
    if replicas < 2:
        return frozenset()
    return frozenset(
        t
        for t in routing.local_tables
        if t not in routing.data_parallel_tables and layouts[t].replica_sliced
    )


def _replica_slices(sliced, layouts, mesh, position, touched, tables, step: RankStep) -> None:
    """Fully sharded 2D's exchanges (``dtrec.sharded.dist.replica_slices``), the real
    ``fetch_touched`` and ``route_to_owners`` on meta owner slices: each table's touched
    rows (``Touched.own``: the distinct ids this rank's shard group sends to its block)
    fetched from their owners, and their gradients sent back the way they came. The rows
    are spread evenly over the block (uniform ids: as many to each owner, in
    expectation); the mirror world answers each peer's requests with this rank's own."""
    if not sliced:
        return
    group = mesh.get_group(REPLICATE)
    keys = sorted(sliced)
    owners, slices, uniques = {}, [], []
    for i, t in enumerate(keys):
        rows = _num_rows(layouts[t], position, tables[t])
        owners[i] = OwnerSlices(rows, group)
        cols = _cols(layouts[t], position)
        slices.append(torch.empty(owners[i].slice_rows, cols, device="meta"))
        n = min(touched[t].own, rows)
        uniques.append(torch.arange(n, dtype=torch.long) * rows // max(n, 1))
    value_table = torch.cat([torch.full((u.numel(),), i) for i, u in enumerate(uniques)])
    compact, _ = fetch_touched(owners, slices, value_table, torch.cat(uniques))
    merged = {i: (uniques[i], torch.empty_like(compact[i])) for i in owners}
    fetched = {i: fetch_of(compact[i]) for i in owners}
    route_to_owners(owners, merged, fetched)
    for i in range(len(keys)):
        step.updated += uniques[i].numel() * slices[i].shape[1]  # the compact rows' grads
        step.rows_touched += uniques[i].numel()


def _average_replicas(layouts, plan: GradSyncPlan, position: int) -> None:
    """``sync_every``'s replica average: each routed block and its row-wise Adagrad state
    (one float per row), as meta tensors through ``GradSyncPlan.start_average``."""

    def blocks(t: int) -> list[torch.Tensor]:
        block = next(b for b in layouts[t].blocks if b.position == position)
        weight = torch.empty(block.num_rows, block.num_cols, device="meta")
        return [weight, torch.empty(block.num_rows, device="meta")]

    pending = plan.start_average(blocks)
    if pending is not None:
        pending.finish()


def _cols(layout, position: int) -> int:
    return next(b.num_cols for b in layout.blocks if b.position == position)


def _num_rows(layout, position: int, cfg: EmbeddingBagConfig) -> int:
    block = next((b for b in layout.blocks if b.position == position), None)
    return cfg.num_embeddings if block is None else block.num_rows


def _data_parallel_lookups(routing, tables, own: KeyedJaggedTensor, step: RankStep) -> None:
    for k in routing.local_features:
        t = routing.slots[k].table
        n = int(_feature_ids(own, t).numel())
        step.ids += n
        step.looked_up += n * tables[t].embedding_dim
        step.bags += own.stride()
        step.pooled += own.stride() * tables[t].embedding_dim


def _group_sizes(comm: dict, shards: int, replicas: int, world: int) -> dict[str, int]:
    """The size of the group each recorded kind runs over (``step_model.COLLECTIVES``)."""
    size = {"shard": shards, "replicate": replicas, "world": world}
    return {kind: size[collective_of(kind)[0]] for kind in comm}
