"""The planner's search state: per-position totals, each table's choice, and the greedy
and local-search steps over them (``dtrec.planning.planner`` runs them; see its docstring).

Why apart: the search's numbers (a ``[rows, S]`` stack per candidate, scored in numpy
passes) are what make 26 tables at S = 4096 plan in seconds and in bounded memory; the
planner reads as its steps without them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from dtrec.placements import TableSpec
from dtrec.placements.mesh import ShardAxis
from dtrec.planning.cost_model import HOST_MEMORY, PositionTotals, TableCost, Topology, step_time
from dtrec.planning.plan_step import PlanCandidate, PlanSteps

MAX_PASSES = 8
PASS_BYTES = 16 << 20
"""Candidate stacks ``Search.best`` scores in one numpy pass (and keeps, if all fit)."""


@dataclass
class Choice:
    """One table's chosen spec, and what every candidate would have cost (for ``explain``)."""

    spec: TableSpec
    costs: list[tuple[TableSpec, TableCost]]
    why: str = ""
    """Why the table is where it is, when the search alone does not say (offloaded)."""

    @property
    def cost(self) -> TableCost:
        return next(c for s, c in self.costs if s == self.spec)


def work(cost: TableCost, axis: ShardAxis, topology: Topology) -> float:
    """Seconds a table adds summed over positions (what balancing spreads around)."""
    return float(step_time(cost.stack, axis, topology).sum())


class Work:
    """``work`` of the search's candidates, each computed once (the greedy step runs once
    per seed over the same candidates). A moved table-wise candidate's per-position time is
    its base's rolled: ``step_time`` is per position, so the same floats, summed alike."""

    def __init__(self, axis: ShardAxis, topology: Topology) -> None:
        self.axis, self.topology = axis, topology
        self._done: dict[int, float] = {}
        self._times: dict[int, np.ndarray] = {}  # id(base cost) -> its per-position time

    def __call__(self, cost: TableCost) -> float:
        done = self._done.get(id(cost))
        if done is None:
            if isinstance(cost, MovedCost):
                base = self._times.get(id(cost.base))
                if base is None:
                    base = step_time(cost.base.stack, self.axis, self.topology)
                    self._times[id(cost.base)] = base
                done = float(rolled(base, cost.shift).sum())
            else:
                done = work(cost, self.axis, self.topology)
            self._done[id(cost)] = done
        return done


class Search:
    """The greedy + local search state: per-position totals and each table's choice.

    Score of a state (lower is better): the larger of the slowest position's time and
    the mean time once the tables not yet placed add their least work (so early
    tables do not split just to flatten a peak the later ones would fill), then the
    total time, then the fullest position's memory.
    """

    def __init__(self, axis: ShardAxis, topology: Topology) -> None:
        self.axis, self.topology = axis, topology
        self.totals = PositionTotals.zeros(axis.size)
        self.budget = topology.memory_budget
        self.host_budget = topology.host_budget or math.inf  # 0: not planned, not checked
        self.remaining = 0.0  # least work of the tables not placed yet
        self._stacked: dict[int, np.ndarray] = {}  # id(candidate list) -> their stacks
        self.work = Work(axis, topology)

    def score(self, cost: TableCost | None = None) -> tuple[float, float, float]:
        stack = self.totals.stack if cost is None else self.totals.stack + cost.stack
        time = step_time(stack, self.axis, self.topology)
        total = float(time.sum())
        bound = max(float(time.max()), (total + self.remaining) / self.axis.size)
        return bound, total, float(stack[0].max())

    def best(self, costs: list[tuple[TableSpec, TableCost]]) -> tuple[TableSpec, TableCost] | None:
        """The candidate with the lowest score that fits (candidates in numpy passes of at
        most ``PASS_BYTES``: S table-wise candidates of [rows, S] are GBs at S = 4096)."""
        parts = [self._scores(stacked) for stacked in self._stacks(costs)]
        bound, total, memory, host = (np.concatenate(p) for p in zip(*parts, strict=True))
        fits = np.flatnonzero((memory <= self.budget) & (host <= self.host_budget))
        if not fits.size:
            return None
        # Lowest (bound, total, memory), then the first candidate: as min() over tuples.
        pick = fits[np.lexsort((fits, memory[fits], total[fits], bound[fits]))[0]]
        return costs[pick]

    def _stacks(self, costs: list[tuple[TableSpec, TableCost]]) -> Iterator[np.ndarray]:
        """The candidates' stacks, ``[candidates, rows, S]`` per pass; kept for the next call
        when they fit one pass (the search scores each table's list several times)."""
        key = id(costs)
        if key in self._stacked:
            yield self._stacked[key]
            return
        per = max(1, PASS_BYTES // self.totals.stack.nbytes)  # a candidate's stack is as big
        if per >= len(costs):
            self._stacked[key] = np.stack([c.stack for _, c in costs])
            yield self._stacked[key]
            return
        for i in range(0, len(costs), per):
            yield np.stack([c.stack for _, c in costs[i : i + per]])

    def _scores(self, stacked: np.ndarray) -> tuple[np.ndarray, ...]:
        """Per candidate: the score's bound and total, its fullest memory and host memory."""
        trial = self.totals.stack[None] + stacked  # [candidates, rows, S]
        time = step_time(trial, self.axis, self.topology)
        total = time.sum(1)
        bound = np.maximum(time.max(1), (total + self.remaining) / self.axis.size)
        return bound, total, trial[:, 0].max(1), trial[:, HOST_MEMORY].max(1)

    def missing(self, costs: list[tuple[TableSpec, TableCost]]) -> tuple[float, TableSpec]:
        """Bytes the cheapest candidate lacks on its fullest position, and that candidate."""
        over = [
            (float(np.max(self.totals.memory + c.memory - self.budget)), i)
            for i, (_, c) in enumerate(costs)
        ]
        amount, i = min(over)
        return amount, costs[i][0]

    def improve(self, chosen: dict[str, Choice], order: list[str]) -> None:
        """Local search: move single tables while the score improves (at most MAX_PASSES)."""
        for _ in range(MAX_PASSES):
            moved = False
            for key in order:
                current = chosen[key]
                self.totals.add(current.cost, -1.0)
                before = self.score(current.cost)
                spec, cost = self.best(current.costs) or (current.spec, current.cost)
                if spec != current.spec and self.score(cost) < before:
                    current.spec, moved = spec, True
                self.totals.add(current.cost)
            if not moved:
                return


def seed_of_type(
    options: dict[str, list[tuple[TableSpec, TableCost]]],
    order: list[str],
    kind: type,
    search: Search,
) -> dict[str, Choice] | None:
    """Every table as ``kind`` (e.g. all row-wise; table-wise ones placed greedily, largest
    first), in ``search`` (empty); None if a table lacks the type or it does not fit."""
    limited = {k: [(s, c) for s, c in options[k] if type(s) is kind] for k in order}
    if not all(limited.values()):
        return None
    chosen, unplaced = place_greedily(limited, options, order, search)
    return None if unplaced is not None else chosen


def place_greedily(
    offers: Mapping[str, list[tuple[TableSpec, TableCost]]],
    options: Mapping[str, list[tuple[TableSpec, TableCost]]],
    order: list[str],
    search: Search,
) -> tuple[dict[str, Choice], str | None]:
    """The greedy step: tables in ``order`` each take the offer ``search.best`` picks (the
    later tables' least work counted in its score), added to ``search.totals``. Returns
    the choices (each keeps the table's ``options``, for the local search) and the first
    table no offer fits (None: every table placed; else ``search`` is as it was then)."""
    # in the offers' order: the sum of the reserve is the same float as the callers' was
    least = {k: min(search.work(c) for _, c in v) for k, v in offers.items()}
    search.remaining = sum(least.values())
    chosen: dict[str, Choice] = {}
    for key in order:
        search.remaining -= least[key]
        picked = search.best(offers[key])
        if picked is None:
            return chosen, key
        search.totals.add(picked[1])
        chosen[key] = Choice(picked[0], options[key])
    search.remaining = 0.0
    return chosen, None


def improve_seed(
    seed: PlanCandidate,
    chosen: dict[str, Choice],
    search: Search,
    order: list[str],
    steps: PlanSteps,
) -> PlanCandidate:
    """Local search on one seed (``Search.improve``, bytes only), kept when ``plan_step``
    says the whole plan got faster: the moves may save bytes but add dearer calls (a
    data-parallel table in a sharded plan adds its gradient sync), then they are undone.
    Returns the plan ``chosen`` now holds."""
    before = {key: choice.spec for key, choice in chosen.items()}
    stack = search.totals.stack.copy()
    search.improve(chosen, order)
    if all(chosen[key].spec == spec for key, spec in before.items()):
        return seed
    improved = steps.candidate(f"{seed.name} + local search", chosen)
    if improved.key < seed.key:
        return improved
    for key, spec in before.items():
        chosen[key].spec = spec
    search.totals.stack = stack
    return seed


class MovedCost(TableCost):
    """A table-wise candidate's cost: another position's, moved ``shift`` positions (a
    roll) when read. S candidates then hold one ``[rows, S]`` stack instead of S of them
    (26 tables at S = 2048: 9 GB)."""

    def __init__(self, base: TableCost, shift: int) -> None:
        self.base, self.shift, self.comm = base, shift, None

    @property
    def stack(self) -> np.ndarray:  # type: ignore[override]
        return rolled(self.base.stack, self.shift)


def rolled(values: np.ndarray, shift: int) -> np.ndarray:
    """``np.roll(values, shift, axis=-1)`` without its generic overhead (the search reads
    tens of thousands of moved candidates)."""
    k = shift % values.shape[-1]
    if k == 0:
        return values.copy()
    return np.concatenate((values[..., -k:], values[..., :-k]), axis=-1)
