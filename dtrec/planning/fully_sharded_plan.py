"""Which tables the planner fully shards over the replicas (fully sharded 2D).

Exact 2D keeps each shard and its optimizer state whole on all R replicas. When the
device budget cannot hold the plan that way (``DeviceFull``) on a mesh with R > 1, the
planner splits the shards of as few tables as needed into owner slices, 1/R per replica
(``fully_sharded=True``, docs/fully_sharded_2d.md):

1. tables that may move (not pinned to a spec, not offloaded, not data-parallel only)
   go fully sharded coldest first (``offload_order``: fewest ids per step per byte held,
   so the most memory is freed per row routed over the replicas);
2. the count is the smallest that fits, found by bisection, as the offload step does.

A fully sharded table costs three all-to-alls forward and one (three after several
lookups) backward per step over "replicate" instead of one gradient sync, so the planner
never picks it while the exact plan fits; that is also why plans that fit exactly are
unchanged. It runs before the host tier
(``offload_plan``): a fully sharded table stays on the device and exact, an offloaded one
pays cache misses over the host link. Both at once (offloaded owner slices) only when
host memory cannot hold the offloaded tables' whole shards (``planner.plan_tables``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from dtrec.modules.config import EmbeddingBagConfig
from dtrec.placements import DataParallel, TableSpec
from dtrec.placements.mesh import ShardAxis
from dtrec.planning.cost_model import table_cost
from dtrec.planning.offload_plan import DeviceFull, Plan
from dtrec.planning.topology import Topology


def fully_sharded_candidates(specs: list[TableSpec]) -> list[TableSpec]:
    """The fully sharded variants of a table's exact candidates (data-parallel has none:
    a replicated table is FSDP's job)."""
    return [
        replace(spec, fully_sharded=True)  # type: ignore[type-var]
        for spec in specs
        if not isinstance(spec, DataParallel)
    ]


def fully_shard_tables(
    tables: Mapping[str, EmbeddingBagConfig],
    axis: ShardAxis,
    topology: Topology,
    order: list[str],
    search: Callable[[frozenset[str]], Plan],
    topology_of: Callable[[str], Topology],
) -> Plan:
    """The plan with as few tables fully sharded as make it fit (module doc). ``order``:
    the tables that may move, first to move first; ``search(sliced)`` plans with the
    tables in ``sliced`` fully sharded (DeviceFull when it does not fit);
    ``topology_of(key)``: the table's own topology (its collection's, its constraint's).
    DeviceFull when even every movable table fully sharded does not fit."""
    if not order or axis.replicas < 2:
        raise DeviceFull("no table may be fully sharded")
    plans = {len(order): search(frozenset(order))}  # its DeviceFull: missing even sliced

    def fits(count: int) -> bool:
        try:
            plans[count] = search(frozenset(order[:count]))
        except DeviceFull:
            return False
        return True

    lo, hi = 0, len(order)  # lo does not fit (exact 2D), hi does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    # the last search that fitted is hi's, so ``compared`` (filled by search) is its
    choices, sums = plans[hi]
    for key in order[:hi]:
        choices[key].why = why_fully_sharded(
            key, tables[key], choices[key].spec, axis, topology_of(key), topology
        )
    return choices, sums


def why_fully_sharded(
    key: str,
    cfg: EmbeddingBagConfig,
    spec: TableSpec,
    axis: ShardAxis,
    own: Topology,
    topology: Topology,
) -> str:
    """``explain``'s line for a table the planner fully sharded: its replicated shard and
    state against the budget, and its owner slice."""
    gb = 1e9
    exact = replace(spec, fully_sharded=False)  # type: ignore[type-var]
    whole = float(table_cost(cfg, exact, axis, own, with_comm=False).memory.max())
    sliced = float(table_cost(cfg, spec, axis, own, with_comm=False).memory.max())
    return (
        f"fully sharded 2D: replicated shard {whole / gb:.3f} GB + state (as {exact}, "
        f"{own.optimizer}) does not fit the HBM budget of {topology.memory_budget / gb:.3f} "
        f"GB per rank beside the other tables; owner slice 1/{axis.replicas} fits "
        f"({sliced / gb:.3f} GB with a step's compact table of touched rows, fetched "
        "from their owners and their gradients sent back over 'replicate' each step)"
    )


__all__ = ["fully_shard_tables", "fully_sharded_candidates", "why_fully_sharded"]
