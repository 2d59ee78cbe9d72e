"""Which tables the planner offloads, and how big their caches are.

When the device budget cannot hold every table (``DeviceFull``) and the topology has
host memory (``Topology.host_memory_per_rank``), the device keeps what fits:

1. tables are offloaded coldest first (``offload_order``: fewest ids per step per byte),
   as few as make the plan fit with the smallest caches (``min_cache_rows``: three
   steps' distinct rows), found by bisection on the count;
2. those tables' caches get one fraction of their blocks' rows, the largest that still
   fits (bisection): the leftover device budget goes to the caches.

The search itself (sharding types, balance) is ``search_plan``'s, with each offloaded
table's candidates offloaded and their cache misses priced in the cost model. A world
whose tables fit neither way is a ValueError before anything is allocated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from dtrec.modules.config import EmbeddingBagConfig
from dtrec.placements.mesh import ShardAxis
from dtrec.planning.offload import row_bytes
from dtrec.planning.topology import Topology

FRACTION_STEPS = 12
"""Bisection steps on the cache fraction (to within 2**-12 of the largest that fits)."""


class DeviceFull(ValueError):
    """A table fits no candidate on the device (the planner's error without a host tier)."""


Plan = tuple[dict[str, Any], Any]
"""``search_plan``'s result: table FQN -> ``Choice``, and the per-position totals."""


def offload_tables(
    tables: Mapping[str, EmbeddingBagConfig],
    axis: ShardAxis,
    topology: Topology,
    order: list[str],
    search: Callable[[Mapping[str, float]], Plan],
) -> Plan:
    """The plan with as few tables offloaded as fit, behind the largest caches that fit
    (module doc). ``order``: the tables that may move, coldest first; ``search(offloaded)``
    plans with the tables of ``offloaded`` behind caches of that fraction of their rows
    (DeviceFull when they do not fit). ValueError when even every movable table
    offloaded does not fit."""
    last_error = ""

    def attempt(count: int, fraction: float) -> Plan | None:
        nonlocal last_error
        try:
            return search(dict.fromkeys(order[:count], fraction))
        except DeviceFull as exc:
            last_error = str(exc)
            return None

    if not order or attempt(len(order), 0.0) is None:
        raise ValueError(_too_big(tables, axis, topology, last_error))
    lo, hi = 0, len(order)  # attempt(lo) does not fit (the device alone), attempt(hi) does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if attempt(mid, 0.0) is not None else (mid, hi)
    count, low, high = hi, 0.0, 1.0
    for _ in range(FRACTION_STEPS):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if attempt(count, mid) is not None else (low, mid)
    plan = attempt(count, low)
    assert plan is not None
    choices, sums = plan
    budget, host = topology.memory_budget / 2**20, topology.host_budget / 2**20
    moved = order[:count]
    for key in moved:
        choices[key].why = (
            f"offloaded: on the device alone the tables need more than the {budget:.1f} MiB "
            f"budget per rank; the {count} with the fewest ids per byte ({moved}) live in host "
            f"memory (budget {host:.1f} MiB per rank) behind device caches of {100 * low:.2f}% "
            "of their rows (at least 3 steps' distinct rows), the largest share that fits"
        )
    return choices, sums


def _too_big(
    tables: Mapping[str, EmbeddingBagConfig], axis: ShardAxis, topology: Topology, why: str
) -> str:
    """The error for tables that fit neither on the devices nor behind caches."""
    world = axis.size * axis.replicas
    need = sum(cfg.num_embeddings * row_bytes(cfg, cfg.embedding_dim, topology)
               for cfg in tables.values())  # fmt: skip
    per_rank = (topology.memory_budget + topology.host_budget) / 2**30
    return (
        f"the tables do not fit in device plus host memory: {need / 2**30:.2f} GiB of weights "
        f"and optimizer state ({topology.optimizer}) for {len(tables)} table(s), and the "
        f"{world} ranks hold {per_rank:.2f} GiB each ({topology.memory_budget / 2**30:.2f} GiB "
        f"device budget + {topology.host_budget / 2**30:.2f} GiB host memory); with every "
        f"table that may move offloaded behind its smallest cache: {why}"
    )
