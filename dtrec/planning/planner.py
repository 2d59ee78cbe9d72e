"""The planner: choose a spec per table that minimises the slowest rank's step time.

Costs come from ``dtrec.planning.cost_model`` (per table and spec, per shard position). The
search, deterministic so every rank computes the same plan:

1. candidates per table: the pinned spec's variants (``TableWise(rank=None)`` -> every
   position), else data-parallel, table-wise on each position, row-wise, column-wise
   (when the dim splits over the shard axis), and table-row-wise / grid on node-aware
   meshes, filtered by a ``TableConstraint`` (allowed types, min / max shards; it may
   also set the table's pooling factor);
2. greedy: tables from the largest, each takes the candidate that keeps the slowest
   position fastest (then the fullest least full) within every position's memory budget;
3. whole plans: the greedy plan and one plan per type (every table table-wise, placed
   greedily; all row-wise; all column-wise; all data-parallel), where each fits, compared
   by ``plan_step``: their slowest position plus ``Topology.call_latency`` of each
   collective call, so on a fabric where calls are dear the plan with fewer of them wins
   (``PlanCandidate``, shown by ``explain``);
4. local search on the best of them and on the greedy plan: revisit every table, move
   it to a better candidate while the plan's slowest position gets faster (bytes only,
   as the greedy step: a table alone does not own its calls); stops when a full pass
   changes nothing, and is undone if the moves cost more in calls than they saved; the
   fastest of the results (``plan_step`` again) is the plan.

When the plan does not fit the device budget on a mesh with R > 1 replicas, the fewest
tables that make it fit are fully sharded over the replicas (``fully_shard_tables``:
each replica holds 1/R of their shards and state, rows routed to the owners each step);
never while the exact plan fits. A table no candidate fits even then raises ValueError
naming it and the bytes missing, unless ``Topology.host_memory_per_rank`` offers a
second tier: then the device keeps what fits
and the rest is offloaded (``offload_tables``): the tables with the fewest ids per byte
first, as few as needed, behind device caches of one fraction of their rows, the largest
fraction that still fits (cache misses priced by ``dtrec.planning.offload``). When host
memory cannot hold their whole shards either (R > 1), the same search offloads their
owner slices instead (fully sharded and offloaded: 1/R of each shard in host memory). A
world whose tables fit none of these ways raises ValueError before anything is allocated.
``dtrec.planning.dry_run`` runs this search at scale in one process (``python -m
dtrec.planner``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from dtrec.modules.config import EmbeddingBagConfig
from dtrec.placements import (
    ColumnWise,
    DataParallel,
    Grid,
    RowWise,
    TableRowWise,
    TableSpec,
    TableWise,
)
from dtrec.placements.constraints import TableConstraint
from dtrec.placements.mesh import ShardAxis
from dtrec.planning.cost_model import (
    PositionTotals,
    TableCost,
    Topology,
    node_of_positions,
    table_cost,
    table_ids,
)
from dtrec.planning.fully_sharded_plan import fully_shard_tables, fully_sharded_candidates
from dtrec.planning.offload import ids_per_byte, offloaded_spec
from dtrec.planning.offload_plan import DeviceFull, offload_tables
from dtrec.planning.plan_step import PlanCandidate, PlanSteps
from dtrec.planning.search import (
    Choice,
    MovedCost,
    Search,
    improve_seed,
    place_greedily,
    seed_of_type,
)

SEED_TYPES: dict[str, type] = {
    "table_wise": TableWise,
    "row_wise": RowWise,
    "column_wise": ColumnWise,
    "data_parallel": DataParallel,
}
"""The one-type plans the search compares with its greedy plan, by name."""


def candidates(
    cfg: EmbeddingBagConfig, axis: ShardAxis, constraint: TableSpec | TableConstraint | None
) -> list:
    """The resolved specs the planner may choose for ``cfg`` (a pinned spec: its variants)."""
    if isinstance(constraint, TableSpec):  # the user's choice: its layout errors are theirs
        options = constraint.candidates(axis)
        for spec in options:
            spec.layout(cfg, axis)
        return options
    options = [DataParallel(), *TableWise().candidates(axis), RowWise()]
    if cfg.embedding_dim >= axis.size > 1:
        options.append(ColumnWise())
    if axis.per_node is not None and axis.size > axis.per_node:
        options += [*TableRowWise().candidates(axis), Grid()]
    out = []
    verdicts: dict[type, bool] = {}  # a moved family (every rank, every node) shares one
    for spec in options:
        family = type(spec) if isinstance(spec, (TableWise, TableRowWise)) else None
        allowed = verdicts.get(family) if family is not None else None
        if allowed is None:
            allowed = _allowed(spec, cfg, axis, constraint)
            if family is not None:
                verdicts[family] = allowed
        if allowed:
            out.append(spec)
    if isinstance(constraint, TableConstraint) and constraint.cache_fraction is not None:
        cached = [
            replace(spec, cache_fraction=constraint.cache_fraction)  # type: ignore[type-var]
            for spec in out
            if not isinstance(spec, DataParallel)
        ]
        return cached
    return out


def _allowed(
    spec: TableSpec, cfg: EmbeddingBagConfig, axis: ShardAxis, constraint: TableConstraint | None
) -> bool:
    try:
        spec.layout(cfg, axis)
    except ValueError:
        return False  # e.g. column-wise with a dim smaller than the shard axis
    return constraint is None or constraint.allows(spec, cfg, axis)


def _costs(
    cfg: EmbeddingBagConfig, specs: list[TableSpec], axis: ShardAxis, topology: Topology
) -> list[tuple[TableSpec, TableCost]]:
    """Each candidate's cost; table-wise and table-row-wise ones are the first one's at the
    same place in its node, moved to their position (a move by whole nodes keeps each peer
    on or off the owner's node, so its intra- and inter-node bytes are the same floats:
    at S = 64 with a node per position that is 63 of 64 candidates of each)."""
    nodes = np.bincount(node_of_positions(axis, topology))
    if nodes.max() in (1, axis.size):  # every peer off the owner's node, or every one on it
        place = 1
    elif (nodes == nodes.max()).all():  # equal nodes: moves by whole nodes
        place = int(nodes.max())
    else:
        place = axis.size  # each position priced apart
    out: list[tuple[TableSpec, TableCost]] = []
    first: dict[tuple[tuple, int], tuple[int, TableCost]] = {}
    for spec in specs:
        offset, unplaced = _placed_at(spec, axis)
        key = (unplaced, offset % place) if offset is not None else None
        if key in first:
            at, first_cost = first[key]
            cost = MovedCost(first_cost, offset - at)
        else:
            cost = table_cost(cfg, spec, axis, topology, with_comm=False)
            if key is not None:
                first[key] = (offset, cost)
        out.append((spec, cost))
    return out


def _placed_at(spec: TableSpec, axis: ShardAxis) -> tuple[int | None, tuple]:
    """(first shard position, what the spec is but for its place) of a spec that is one
    layout moved along the shard axis (table-wise by rank, table-row-wise by node);
    (None, ()) for the others."""
    if isinstance(spec, TableWise) and spec.rank is not None:
        offset, place = spec.rank, "rank"
    elif isinstance(spec, TableRowWise) and spec.node is not None and axis.per_node is not None:
        offset, place = spec.node * axis.per_node, "node"
    else:
        return None, ()
    return offset, (type(spec), *((k, v) for k, v in vars(spec).items() if k != place))


def collection_of(key: str, cfg: EmbeddingBagConfig) -> str:
    """The collection FQN of plan key ``key`` (``"<collection fqn>.<table name>"``, or
    the bare name at the root)."""
    return key[: -len(cfg.name) - 1] if key != cfg.name else ""


def plan_tables(
    tables: Mapping[str, EmbeddingBagConfig],
    axis: ShardAxis,
    constraints: Mapping[str, TableSpec | TableConstraint] | None = None,
    topology: Topology | None = None,
    compared: list[PlanCandidate] | None = None,
) -> tuple[dict[str, Choice], PositionTotals]:
    """Choose a spec per table FQN (see the module doc); the choices and their totals.

    Starts from whichever whole plan ``plan_step`` predicts fastest on ``topology`` (the
    greedy plan, or one type for every table: the planner picks what its step model
    says runs fastest, collective calls included), then improves it by local search.
    When tables do not fit the device budget and the topology has host memory, offloads
    some (``offload_tables``). ``compared``: filled with the whole plans compared
    (``PlanCandidate``, fastest first), for ``explain``.
    """
    topology = topology or Topology()
    constraints = dict(constraints or {})
    try:
        return search_plan(tables, axis, constraints, topology, compared=compared)
    except DeviceFull as exc:
        exact_full = str(exc)
    order = offload_order(tables, constraints, topology)
    if axis.replicas > 1 and order:
        try:
            return fully_shard_tables(
                tables,
                axis,
                topology,
                order,
                lambda sliced: search_plan(
                    tables, axis, constraints, topology, compared=compared, sliced=sliced
                ),
                lambda key: _own_topology(key, tables[key], constraints.get(key), topology),
            )
        except DeviceFull as exc:
            exact_full += (
                f"; fully sharded over the {axis.replicas} replicas too ({len(order)} "
                f"table(s) that may move): {exc}"
            )
    if topology.host_budget <= 0:
        raise ValueError(exact_full)
    try:
        return offload_tables(
            tables,
            axis,
            topology,
            order,
            lambda offloaded: search_plan(tables, axis, constraints, topology, offloaded, compared),
        )
    except ValueError as exc:
        if axis.replicas < 2 or not order:
            raise
        whole_shards = str(exc)
    # even host memory cannot hold the offloaded tables' whole shards on every replica:
    # offload their owner slices (1/R each) instead (fully sharded and offloaded)
    try:
        choices, sums = offload_tables(
            tables,
            axis,
            topology,
            order,
            lambda offloaded: search_plan(
                tables,
                axis,
                constraints,
                topology,
                offloaded,
                compared,
                sliced=frozenset(offloaded),
            ),  # fmt: skip
        )
    except ValueError as exc:
        raise ValueError(
            f"{whole_shards}; offloaded as owner slices over the {axis.replicas} replicas "
            f"(fully sharded) too: {exc}"
        ) from None
    for choice in choices.values():
        if getattr(choice.spec, "fully_sharded", False) and choice.spec.offloaded:  # type: ignore[attr-defined]
            choice.why += (
                f"; as owner slices (fully sharded 2D): host memory cannot hold the whole "
                f"shards on each of the {axis.replicas} replicas, each holds 1/"
                f"{axis.replicas} of them, cached from its slice"
            )
    return choices, sums


def search_plan(
    tables: Mapping[str, EmbeddingBagConfig],
    axis: ShardAxis,
    constraints: Mapping[str, TableSpec | TableConstraint],
    topology: Topology,
    offloaded: Mapping[str, float] | None = None,
    compared: list[PlanCandidate] | None = None,
    sliced: frozenset[str] = frozenset(),
) -> tuple[dict[str, Choice], PositionTotals]:
    """The search of ``plan_tables`` with the tables in ``offloaded`` behind caches of
    that fraction of their rows (their candidates: each sharding type, offloaded) and
    those in ``sliced`` fully sharded over the replicas (their candidates: each type but
    data-parallel, ``fully_sharded=True``); DeviceFull when a table fits no candidate.
    ``compared``: filled with the whole plans compared, fastest first, the chosen one
    marked."""
    offloaded = offloaded or {}
    search = Search(axis, topology)
    options: dict[str, list[tuple[TableSpec, TableCost]]] = {}
    own_topologies: dict[str, Topology] = {}
    for key, cfg in tables.items():
        constraint = constraints.get(key)
        specs = candidates(cfg, axis, constraint)
        if not specs:
            raise ValueError(
                f"table {key!r}: no sharding spec on a shard axis of {axis.size} satisfies "
                f"{constraint or 'the layout rules'}"
            )
        own = _own_topology(key, cfg, constraint, topology)
        if key in sliced:
            specs = fully_sharded_candidates(specs) or specs  # data-parallel only: as is
        if key in offloaded:
            ids = table_ids(cfg, own)
            moved = (offloaded_spec(s, cfg, axis, own, offloaded[key], ids) for s in specs)
            specs = [s for s in moved if s is not None]
        options[key] = _costs(cfg, specs, axis, own)
        own_topologies[key] = own
    order = sorted(tables, key=lambda k: (-tables[k].num_embeddings * tables[k].embedding_dim, k))
    chosen, key = place_greedily(options, options, order, search)
    if key is not None:
        amount, spec = search.missing(options[key])
        if amount > 0 or math.isinf(search.host_budget):
            raise DeviceFull(
                f"table {key!r} ({tables[key].num_embeddings} x "
                f"{tables[key].embedding_dim}) does not fit: even as {spec} it needs "
                f"{amount / 2**20:.1f} MiB more on its fullest rank than the budget of "
                f"{search.budget / 2**20:.1f} MiB per rank (Topology.memory_per_rank minus "
                "headroom)"
            )
        over = min(
            float(np.max(search.totals.host_memory + c.host_memory - search.host_budget))
            for _, c in options[key]
        )
        raise DeviceFull(
            f"table {key!r} ({tables[key].num_embeddings} x {tables[key].embedding_dim}) "
            f"does not fit in host memory: it needs {over / 2**20:.1f} MiB more on its "
            f"fullest rank than the {search.host_budget / 2**20:.1f} MiB per rank of "
            "Topology.host_memory_per_rank"
        )
    steps = PlanSteps(tables, own_topologies, axis, topology)
    seeds = [(steps.candidate("greedy", chosen), chosen, search)]
    for name, kind in SEED_TYPES.items():
        trial = Search(axis, topology)
        seed = seed_of_type(options, order, kind, trial)
        if seed is not None:
            seeds.append((steps.candidate(name, seed), seed, trial))
    # Local search on the fastest seed and on the greedy one (a seed that starts slower
    # may end faster; every seed would multiply the search's time), then the fastest
    # whole plan; on equal keys the earlier (greedy first), as min() does.
    fastest = min(seeds, key=lambda s: s[0].key)
    ranked, finals = [], []
    for seed, seed_chosen, seed_search in seeds:
        ranked.append(seed)
        if seed is seeds[0][0] or seed is fastest[0]:
            seed = improve_seed(seed, seed_chosen, seed_search, order, steps)
            if seed is not ranked[-1]:
                ranked.append(seed)
        finals.append((seed, seed_chosen, seed_search))
    pick, chosen, search = min(finals, key=lambda f: f[0].key)
    if compared is not None:
        compared[:] = sorted((replace(c, chosen=c is pick) for c in ranked), key=lambda c: c.key)
    return {key: chosen[key] for key in tables}, search.totals


def _own_topology(
    key: str,
    cfg: EmbeddingBagConfig,
    constraint: TableSpec | TableConstraint | None,
    topology: Topology,
) -> Topology:
    """The topology a table is priced on: its collection's, with its constraint's ids."""
    own = topology.for_collection(collection_of(key, cfg))
    return constraint.topology(cfg, own) if isinstance(constraint, TableConstraint) else own


def offload_order(
    tables: Mapping[str, EmbeddingBagConfig],
    constraints: Mapping[str, TableSpec | TableConstraint],
    topology: Topology,
) -> list[str]:
    """The tables the planner may offload, coldest first (fewest ids per step per byte
    held: they lose the least to cache misses for the device memory they free). A table
    pinned to a spec, or constrained to data parallel, stays where it is."""
    movable = []
    for key in tables:
        constraint = constraints.get(key)
        if isinstance(constraint, TableSpec):
            continue
        if isinstance(constraint, TableConstraint) and (
            constraint.types == (DataParallel,) or constraint.cache_fraction is not None
        ):
            continue
        movable.append(key)
    return sorted(movable, key=lambda k: (ids_per_byte(tables[k], topology), k))
