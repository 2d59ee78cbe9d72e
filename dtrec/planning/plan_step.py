"""A whole plan's predicted step: the cost model's slowest position plus what calls cost.

Why: the per-table search (``planner``) prices bytes only, since every table of a plan
shares its collectives; a plan's step also pays a latency per call (``Topology.call_latency``),
and on gloo ranks sharing a host's cores that is milliseconds per call, so whether a plan
issues 5 collectives per step or 9 decides orderings (data-parallel and 2D plans add
gradient all-gathers). ``plan_step`` is what the planner ranks whole candidate plans by
(``PlanSteps``, ``PlanCandidate``), what ``explain`` states and what
``benchmarks/distributed.py`` compares with its measured steps. It ignores overlap (the
benchmark's steps run one stage after another).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dtrec.modules.config import EmbeddingBagConfig
from dtrec.placements import TableRowWise, TableWise
from dtrec.placements.mesh import ShardAxis
from dtrec.planning.cost_model import (
    HBM,
    HOST_LINK,
    TableCost,
    comm_by_kind,
    node_of_positions,
    step_time,
    table_cost,
)
from dtrec.planning.step_model import collective_of
from dtrec.planning.topology import Topology

PARTS_OF_IDS = ("input_dist.lengths", "input_dist.id_values")
"""``comm_by_kind`` entries that travel inside ``input_dist.ids`` (no call of their own)."""
NOT_COLLECTIVES = ("offload.",)
"""``comm_by_kind`` kind prefixes that are no collective (an offloaded block's host <-> device
copies: its cache misses, priced as bytes over the host link)."""


@dataclass(frozen=True)
class PlanStep:
    """Seconds of one step at a plan's slowest position, and where they go."""

    step: float
    compute: float
    """Memory-bound embedding work (and host-link copies) plus ``extra_compute``."""
    comm: float
    """Bytes over the links plus ``Topology.call_latency`` per call."""
    calls: int
    """Collectives per step (one per ``comm_stats`` kind, as dtrec batches them)."""
    position: int

    @property
    def comm_share(self) -> float:
        """Share of the step spent in communication."""
        return self.comm / self.step if self.step > 0 else 0.0


def call_op(kind: str) -> tuple[str, int]:
    """(collective op, calls per step) of a ``comm_by_kind`` kind, as ``dtrec`` issues it:
    the op the scale model gives the kind (``step_model.collective_of``: verdict, row norms
    and dense gradient sums all-reduce, a gradient sync's counts and sparse rows
    all-gather, the rest all-to-all), a sparse gradient sync in two calls (ids, then rows).
    The census of a real step counts the same (``benchmarks/distributed.py``:
    ``collectives_per_step``)."""
    return collective_of(kind)[1], 2 if kind.endswith(".sparse") else 1


def call_group(kind: str, header: bool) -> str:
    """The mesh group a ``comm_by_kind`` kind's call runs over: "shard", "replicate" or
    "world", as ``step_model.collective_of`` says, but the verdict: over the replicas with
    an input-dist ``header``, else the world, as ``comm_by_kind`` sizes it."""
    if kind == "input_dist.verdict" and not header:
        return "world"
    return collective_of(kind)[0]


def group_shape(group: str, axis: ShardAxis, topology: Topology) -> tuple[int, int]:
    """(ranks, ranks per node) of one ``group`` of ``axis``'s mesh: what a call's
    latency grows with (``Topology.call_latency``). Shard positions per node as the cost
    model places them (``node_of_positions``); replica groups by their stride."""
    world = axis.size * axis.replicas
    if group == "shard":
        return axis.size, int(np.bincount(node_of_positions(axis, topology)).max())
    if group == "replicate":
        stride = axis.replica_stride or world  # 0: a hand-made mesh, priced as spread out
        return axis.replicas, max(1, min(axis.replicas, topology.node_size // stride))
    return world, min(world, topology.node_size)


def _calls(costs: Sequence[TableCost], axis: ShardAxis) -> list[tuple[str, int, str]]:
    """(op, calls, group) per collective kind the plan sends."""
    kinds = comm_by_kind(list(costs), axis)
    header = "input_dist.lengths" in kinds
    return [
        (*call_op(k), call_group(k, header))
        for k, v in kinds.items()
        if k not in PARTS_OF_IDS and not k.startswith(NOT_COLLECTIVES) and np.any(v > 0)
    ]


def collective_calls(costs: Sequence[TableCost], axis: ShardAxis) -> int:
    """Collectives a plan issues per step: dtrec sends each kind in one call for all tables
    (``comm_by_kind``'s kinds, the input dist's parts as one; ``call_op``)."""
    return sum(n for _, n, _ in _calls(costs, axis))


def plan_step(
    costs: Sequence[TableCost],
    axis: ShardAxis,
    topology: Topology,
    extra_calls: int = 0,
    extra_comm: float = 0.0,
    extra_compute: float = 0.0,
) -> PlanStep:
    """The step of a plan of ``costs`` (``table_cost(..., with_comm=True)`` per table).

    ``extra_*``: what the tables do not show, from the caller (the dense part: its
    gradient all-reduce calls and seconds, its forward + backward + optimizer seconds).
    Each call costs ``Topology.call_latency`` of its op.

    Example::

        step = plan_step([table_cost(cfg, RowWise(), axis, topo)], axis, topo)
        print(f"{1e3 * step.step:.1f} ms, {step.comm_share:.0%} communication")
    """
    if costs:
        stack = sum(c.stack for c in costs)
        time = step_time(stack, axis, topology)
        only = np.zeros_like(stack)
        only[[HBM, HOST_LINK]] = stack[[HBM, HOST_LINK]]
        local = step_time(only, axis, topology)
        position = int(np.argmax(time))
        compute, link = float(local[position]), float(time[position] - local[position])
    else:
        position, compute, link = 0, 0.0, 0.0
    ops = _calls(costs, axis) if costs else []
    calls = sum(n for _, n, _ in ops) + extra_calls
    shapes = {g: group_shape(g, axis, topology) for g in ("shard", "replicate", "world")}
    latency = sum(n * topology.call_latency(op, *shapes[group]) for op, n, group in ops)
    dense = extra_calls * topology.call_latency("all_reduce", *shapes["world"])
    comm = link + latency + dense + extra_comm
    compute += extra_compute
    return PlanStep(compute + comm, compute, comm, calls, position)


@dataclass(frozen=True)
class PlanCandidate:
    """One whole plan the search compared, and its predicted step (``plan_step``)."""

    name: str
    """"greedy", a ``SEED_TYPES`` name, or either with " + local search"."""
    step: PlanStep
    total: float
    """Seconds summed over positions (the tie-break after ``step``)."""
    memory: float
    """Bytes on the fullest position (the last tie-break)."""
    chosen: bool = False

    @property
    def key(self) -> tuple[float, float, float]:
        """What ranks plans: lower is faster."""
        return self.step.step, self.total, self.memory


class PlanSteps:
    """``plan_step`` of the planner's whole plans from its bytes-only costs (``Choice``:
    ``.spec``, ``.cost``): which collective kinds a table sends is priced once per table
    and spec shape (a table-wise table sends the same kinds from any position), so
    comparing plans costs no new per-table search.

    Example::

        steps = PlanSteps(tables, {k: topology for k in tables}, axis, topology)
        print(steps.candidate("greedy", choices).step.step)
    """

    def __init__(
        self,
        tables: Mapping[str, EmbeddingBagConfig],
        own: Mapping[str, Topology],
        axis: ShardAxis,
        topology: Topology,
    ) -> None:
        self.tables, self.own, self.axis, self.topology = tables, own, axis, topology
        self._kinds: dict[tuple[str, object], dict[str, np.ndarray] | None] = {}

    def candidate(self, name: str, chosen: Mapping[str, Any]) -> PlanCandidate:
        """The plan of ``chosen`` (table key -> the search's choice), named ``name``."""
        costs: list[TableCost] = []
        if not chosen:
            return PlanCandidate(name, plan_step(costs, self.axis, self.topology), 0.0, 0.0)
        for key, choice in chosen.items():
            spec = choice.spec
            shape = type(spec) if isinstance(spec, (TableWise, TableRowWise)) else spec
            if (key, shape) not in self._kinds:
                cost = table_cost(self.tables[key], spec, self.axis, self.own[key])
                self._kinds[key, shape] = cost.comm
            priced = TableCost(self.axis.size, with_comm=False)
            priced.stack, priced.comm = choice.cost.stack, self._kinds[key, shape]
            costs.append(priced)
        stack = sum(c.stack for c in costs)
        time = step_time(stack, self.axis, self.topology)
        return PlanCandidate(
            name,
            plan_step(costs, self.axis, self.topology),
            float(time.sum()),
            float(stack[0].max()),
        )


def candidate_lines(compared: Sequence[PlanCandidate]) -> list[str]:
    """The whole plans the planner compared, one line each, fastest first, the chosen one
    starred: why it picked that plan (predicted step, communication share, calls)."""
    if not compared:
        return []
    width = max(len(c.name) for c in compared)
    lines = ["candidate plans (predicted step of the embedding part, communication share, "
             "collective calls; * chosen):"]  # fmt: skip
    for c in sorted(compared, key=lambda c: c.key):
        lines.append(
            f"  {'*' if c.chosen else ' '} {c.name:<{width}}  {1e3 * c.step.step:10.4f} ms  "
            f"{c.step.comm_share:4.0%} comm  {c.step.calls} calls"
        )
    return lines


__all__ = [
    "PlanCandidate",
    "PlanStep",
    "PlanSteps",
    "call_group",
    "call_op",
    "candidate_lines",
    "collective_calls",
    "group_shape",
    "plan_step",
]
