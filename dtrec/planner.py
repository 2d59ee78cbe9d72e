"""The planner: choose a spec per table that minimises the slowest rank's step time.

Costs come from ``dtrec.cost_model`` (per table and spec, per shard position). The
search, deterministic so every rank computes the same plan:

1. candidates per table: the pinned spec's variants (``TableWise(rank=None)`` -> every
   position), else data-parallel, table-wise on each position, row-wise, column-wise
   (when the dim splits over the shard axis), and table-row-wise / grid on node-aware
   meshes;
2. greedy: tables from the largest, each takes the candidate that keeps the slowest
   position fastest (then the fullest least full) within every position's memory budget;
3. local search: revisit every table, move it to a better candidate while the plan's
   slowest position gets faster; stops when a full pass changes nothing.

A table no candidate fits raises ValueError naming it and the bytes missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from dtrec.config import EmbeddingBagConfig
from dtrec.cost_model import PositionTotals, TableCost, Topology, table_cost
from dtrec.mesh import ShardAxis
from dtrec.placements import (
    ColumnWise,
    DataParallel,
    Grid,
    RowWise,
    TableRowWise,
    TableSpec,
    TableWise,
)

MAX_PASSES = 8


def candidates(cfg: EmbeddingBagConfig, axis: ShardAxis, pinned: TableSpec | None) -> list:
    """The resolved specs the planner may choose for ``cfg`` (pinned: its variants only)."""
    if pinned is not None:  # the user's choice: its layout errors are theirs to see
        options = pinned.candidates(axis)
        for spec in options:
            spec.layout(cfg, axis)
        return options
    options = [DataParallel(), *TableWise().candidates(axis), RowWise()]
    if cfg.embedding_dim >= axis.size > 1:
        options.append(ColumnWise())
    if axis.per_node is not None and axis.size > axis.per_node:
        options += [*TableRowWise().candidates(axis), Grid()]
    out = []
    for spec in options:
        try:
            spec.layout(cfg, axis)
        except ValueError:
            continue  # e.g. column-wise with a dim smaller than the shard axis
        out.append(spec)
    return out


@dataclass
class Choice:
    """One table's chosen spec, and what every candidate would have cost (for ``explain``)."""

    spec: TableSpec
    costs: list[tuple[TableSpec, TableCost]]

    @property
    def cost(self) -> TableCost:
        return next(c for s, c in self.costs if s == self.spec)


class Search:
    """The greedy + local search state: per-position totals and each table's choice."""

    def __init__(self, axis: ShardAxis, topology: Topology) -> None:
        self.axis, self.topology = axis, topology
        self.totals = PositionTotals.zeros(axis.size)
        self.budget = topology.memory_budget

    def score(self, cost: TableCost | None = None) -> tuple[float, float, float]:
        """(slowest position's time, total time, fullest position's memory) with ``cost``."""
        if cost is not None:
            self.totals.add(cost)
        time = self.totals.time(self.axis, self.topology)
        out = (float(time.max()), float(time.sum()), float(self.totals.memory.max()))
        if cost is not None:
            self.totals.add(cost, -1.0)
        return out

    def fits(self, cost: TableCost) -> bool:
        return bool(np.all(self.totals.memory + cost.memory <= self.budget))

    def best(self, costs: list[tuple[TableSpec, TableCost]]) -> tuple[TableSpec, TableCost] | None:
        feasible = [(self.score(c), i) for i, (_, c) in enumerate(costs) if self.fits(c)]
        return costs[min(feasible)[1]] if feasible else None

    def missing(self, costs: list[tuple[TableSpec, TableCost]]) -> tuple[float, TableSpec]:
        """Bytes the cheapest candidate lacks on its fullest position, and that candidate."""
        over = [
            (float(np.max(self.totals.memory + c.memory - self.budget)), i)
            for i, (_, c) in enumerate(costs)
        ]
        amount, i = min(over)
        return amount, costs[i][0]


def plan_tables(
    tables: Mapping[str, EmbeddingBagConfig],
    axis: ShardAxis,
    constraints: Mapping[str, TableSpec] | None = None,
    topology: Topology | None = None,
) -> tuple[dict[str, Choice], PositionTotals]:
    """Choose a spec per table FQN (see the module doc); the choices and their totals."""
    topology = topology or Topology()
    constraints = dict(constraints or {})
    search = Search(axis, topology)
    options: dict[str, list[tuple[TableSpec, TableCost]]] = {}
    for key, cfg in tables.items():
        specs = candidates(cfg, axis, constraints.get(key))
        if not specs:
            raise ValueError(f"table {key!r}: no sharding spec fits a shard axis of {axis.size}")
        options[key] = [(spec, table_cost(cfg, spec, axis, topology)) for spec in specs]
    order = sorted(tables, key=lambda k: (-tables[k].num_embeddings * tables[k].embedding_dim, k))
    chosen: dict[str, Choice] = {}
    for key in order:
        picked = search.best(options[key])
        if picked is None:
            amount, spec = search.missing(options[key])
            raise ValueError(
                f"table {key!r} ({tables[key].num_embeddings} x {tables[key].embedding_dim}) "
                f"does not fit: even as {spec} it needs {amount / 2**20:.1f} MiB more on its "
                f"fullest rank than the budget of {search.budget / 2**20:.1f} MiB per rank "
                "(Topology.memory_per_rank minus headroom)"
            )
        search.totals.add(picked[1])
        chosen[key] = Choice(picked[0], options[key])
    for _ in range(MAX_PASSES):
        moved = False
        for key in order:
            current = chosen[key]
            search.totals.add(current.cost, -1.0)
            before = search.score(current.cost)
            spec, cost = search.best(options[key]) or (current.spec, current.cost)
            if search.score(cost) < before and spec != current.spec:
                current.spec, moved = spec, True
            search.totals.add(current.cost)
        if not moved:
            break
    return {key: chosen[key] for key in tables}, search.totals
