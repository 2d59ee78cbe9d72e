"""A whole plan's predicted step: the cost model's slowest position plus what calls cost.

Why: the per-table search (``planner``) prices bytes only, since every table of a plan
shares its collectives; a plan's step also pays ``Topology.collective_latency`` per call,
and on gloo ranks sharing a host's cores that is milliseconds per call, so whether a plan
issues 5 collectives per step or 9 decides orderings (data-parallel and 2D plans add
gradient all-gathers). ``plan_step`` is what ``explain`` states and what
``benchmarks/distributed.py`` compares with its measured steps. It ignores overlap (the
benchmark's steps run one stage after another).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dtrec.placements.mesh import ShardAxis
from dtrec.planning.cost_model import HBM, HOST_LINK, TableCost, comm_by_kind, step_time
from dtrec.planning.topology import Topology

PARTS_OF_IDS = ("input_dist.lengths", "input_dist.id_values")
"""``comm_by_kind`` entries that travel inside ``input_dist.ids`` (no call of their own)."""


@dataclass(frozen=True)
class PlanStep:
    """Seconds of one step at a plan's slowest position, and where they go."""

    step: float
    compute: float
    """Memory-bound embedding work (and host-link copies) plus ``extra_compute``."""
    comm: float
    """Bytes over the links plus ``collective_latency`` per call."""
    calls: int
    """Collectives per step (one per ``comm_stats`` kind, as dtrec batches them)."""
    position: int

    @property
    def comm_share(self) -> float:
        """Share of the step spent in communication."""
        return self.comm / self.step if self.step > 0 else 0.0


def collective_calls(costs: Sequence[TableCost], axis: ShardAxis) -> int:
    """Collectives a plan issues per step: dtrec sends each kind in one call for all tables
    (``comm_by_kind``'s kinds, the input dist's parts as one)."""
    kinds = comm_by_kind(list(costs), axis)
    return sum(1 for k, v in kinds.items() if k not in PARTS_OF_IDS and np.any(v > 0))


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
    gradient all-reduce's calls and seconds, its forward + backward + optimizer seconds).

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
    calls = collective_calls(costs, axis) + extra_calls
    comm = link + calls * topology.collective_latency + extra_comm
    compute += extra_compute
    return PlanStep(compute + comm, compute, comm, calls, position)


__all__ = ["PlanStep", "collective_calls", "plan_step"]
