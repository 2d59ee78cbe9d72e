"""1D or 2D: the planner's candidate plans on every (S, R) mesh of one world, compared.

Why: a 2D mesh (R > 1 replica groups) sends fewer shard-axis bytes per rank but adds
replica gradient syncs, and with them collective calls; whether that pays depends on the
tables and the fabric (issue 33: on 4 gloo ranks sharing 2 cores, 2D row-wise measured
slower than every 1D type but data-parallel). ``plan_tables`` plans one given mesh; this
runs it on each shard group size and ranks every candidate plan by the same predicted step
(``plan_step``), so the mesh is chosen by the model that chooses the specs:
``choose_shard_group_size`` is what a user sizing a job calls, ``python -m dtrec.planner
--shard-group-size auto`` what it prints.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from torch import nn

from dtrec.modules.config import EmbeddingBagConfig
from dtrec.placements import TableSpec
from dtrec.placements.constraints import TableConstraint
from dtrec.placements.mesh import ShardAxis, positions_per_node
from dtrec.planning.plan import check_plan_keys, model_tables
from dtrec.planning.plan_step import PlanCandidate
from dtrec.planning.planner import plan_tables
from dtrec.planning.topology import Topology

MAX_SIZES = 24
"""Shard group sizes compared by default at most: every divisor of the world size, or,
for a world with more divisors, its powers of two (and the world size itself)."""


def compare_shard_group_sizes(
    tables: Mapping[str, EmbeddingBagConfig],
    world_size: int,
    shard_group_sizes: Sequence[int],
    topology: Topology,
    node_size: int | None = None,
    constraints: Mapping[str, TableSpec | TableConstraint] | None = None,
) -> list[PlanCandidate]:
    """Every candidate plan ``plan_tables`` compares on each ``init_mesh`` mesh of
    ``world_size`` ranks with a shard group size in ``shard_group_sizes``, named
    ``"S=2 x R=2: row_wise"``, fastest first; ``chosen`` marks the fastest of the meshes'
    picks (the mesh and plan the model predicts fastest).

    Example::

        ranked = compare_shard_group_sizes(tables, 4, (4, 2), Topology.cpu())
        best = next(c for c in ranked if c.chosen)
    """
    out: list[PlanCandidate] = []
    for size in shard_group_sizes:
        if size < 1 or world_size % size:
            raise ValueError(f"shard group size {size} does not divide the world size {world_size}")
        out += _compare_one(tables, world_size, size, topology, node_size, constraints)
    return _ranked(out)


@dataclass(frozen=True)
class MeshChoice:
    """The shard group sizes of one world compared (``rank_shard_group_sizes``)."""

    shard_group_size: int
    """S the model predicts fastest; its mesh has R = ``world_size // S`` replica groups."""
    world_size: int
    candidates: list[PlanCandidate]
    """Every plan compared on every size, named ``"S=4 x R=2: row_wise"``, fastest first;
    ``chosen`` marks the pick (``compare_shard_group_sizes``' ranking)."""
    per_size: dict[int, PlanCandidate]
    """S -> the plan ``dtrec.plan`` would pick on that mesh, fastest size first (named
    with how many tables it fully shards over the replicas, when the exact plan does not
    fit: "S=1 x R=16: greedy (2 of 4 tables fully sharded)")."""
    skipped: dict[int, str] = field(default_factory=dict)
    """Sizes not compared, and why (not a divisor, the node size, tables that do not fit)."""

    def lines(self) -> list[str]:
        """The ranking, one line per shard group size (its mesh's pick), fastest first,
        the chosen one starred; then the sizes skipped."""
        lines = [f"shard group sizes of a world of {self.world_size} (predicted step of the "
                 "embedding part with its calls, communication share, mesh S x R, the "
                 "mesh's plan; * chosen):"]  # fmt: skip
        for size, c in self.per_size.items():
            star = "*" if c.chosen else " "
            mesh = f"S={size} x R={self.world_size // size}"
            plan = c.name.split(": ", 1)[1]
            lines.append(
                f"  {star} {mesh:<16} {1e3 * c.step.step:10.4f} ms  {c.step.comm_share:4.0%} "
                f"comm  {c.step.calls:2d} calls  {plan}"
            )
        lines += [f"    S={size}: skipped ({why})" for size, why in self.skipped.items()]
        return lines


def rank_shard_group_sizes(
    model_or_tables: nn.Module | Mapping[str, EmbeddingBagConfig],
    world_size: int,
    node_size: int | None = None,
    topology: Topology | None = None,
    constraints: Mapping[str, TableSpec | TableConstraint] | None = None,
    shard_group_sizes: Sequence[int] | None = None,
) -> MeshChoice:
    """Plan the tables on every shard group size S of ``world_size`` ranks (default: each
    divisor, at most ``MAX_SIZES``; given sizes that do not divide are skipped) and rank
    the meshes by the predicted step of their plans (``plan_step``, calls included).

    ``model_or_tables``: a model (its dtrec or TorchRec collections, as ``dtrec.plan``
    reads them) or plan key -> table config. ``node_size``: the ``init_mesh`` node size
    (node-aware types become candidates; the topology's nodes are set to it).
    ``topology``: default ``Topology.h100()`` (sizing a GPU job; ``Topology.cpu()`` for
    gloo). ``constraints``: plan key -> spec or ``TableConstraint``, as ``dtrec.plan``
    takes them; a size on which they cannot hold, or the tables do not fit, is skipped.

    Example::

        choice = rank_shard_group_sizes(model, world_size=64, node_size=8)
        print("\\n".join(choice.lines()))
        mesh = dtrec.init_mesh("cuda", choice.shard_group_size, node_size=8)
    """
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral):
        raise TypeError(f"world_size must be an int, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if node_size is not None:
        positions_per_node(world_size, world_size, node_size)  # an int dividing the world
    tables = _tables_of(model_or_tables)
    if constraints is not None:
        if not isinstance(constraints, Mapping):
            raise TypeError(
                f"constraints must be a mapping {{plan key: spec or TableConstraint}} or None, "
                f"got {type(constraints).__name__}"
            )
        check_plan_keys(constraints, tables)
    if topology is None:
        topology = Topology.h100(**({} if node_size is None else {"node_size": node_size}))
    elif not isinstance(topology, Topology):
        raise TypeError(f"topology must be a dtrec.Topology or None, got {topology!r}")
    elif node_size is not None:
        topology = replace(topology, node_size=node_size)
    sizes, skipped = _sizes(world_size, shard_group_sizes)
    if not sizes:
        raise ValueError(
            f"no shard group size in {list(shard_group_sizes or [])} divides the world size "
            f"{world_size}; its divisors are {_divisors(world_size)}"
        )
    compared: list[PlanCandidate] = []
    picks: dict[int, PlanCandidate] = {}
    for size in sizes:
        try:
            one = _compare_one(tables, world_size, size, topology, node_size, constraints)
        except ValueError as exc:  # the mesh cannot be built, or a table fits no spec there
            skipped[size] = str(exc)
            continue
        compared += one
        picks[size] = next(c for c in one if c.chosen)
    if not compared:
        reasons = "; ".join(f"S={s}: {why}" for s, why in skipped.items())
        raise ValueError(f"no shard group size of a world of {world_size} plans: {reasons}")
    best = min(picks, key=lambda s: picks[s].key)  # on a tie the first, as _ranked's min()
    per_size = {
        s: replace(c, chosen=s == best)
        for s, c in sorted(picks.items(), key=lambda item: item[1].key)
    }
    return MeshChoice(best, world_size, _ranked(compared), per_size, dict(sorted(skipped.items())))


def choose_shard_group_size(
    model_or_tables: nn.Module | Mapping[str, EmbeddingBagConfig],
    world_size: int,
    node_size: int | None = None,
    topology: Topology | None = None,
    constraints: Mapping[str, TableSpec | TableConstraint] | None = None,
) -> int:
    """The shard group size S the planner's model predicts fastest for ``world_size``
    ranks: what to give ``dtrec.init_mesh`` (R = ``world_size // S``). The ranking behind
    it: ``rank_shard_group_sizes`` (same arguments).

    Example::

        s = dtrec.choose_shard_group_size(model, world_size=64, node_size=8)
        mesh = dtrec.init_mesh("cuda", s, node_size=8)
        model = dtrec.distribute_module(model, mesh)
    """
    return rank_shard_group_sizes(
        model_or_tables, world_size, node_size, topology, constraints
    ).shard_group_size


def _compare_one(
    tables: Mapping[str, EmbeddingBagConfig],
    world_size: int,
    size: int,
    topology: Topology,
    node_size: int | None,
    constraints: Mapping[str, TableSpec | TableConstraint] | None,
) -> list[PlanCandidate]:
    """The plans ``plan_tables`` compares on the (S=size, R) mesh, named with the mesh;
    ``chosen``: that mesh's pick."""
    per_node = None if node_size is None else positions_per_node(world_size, size, node_size)
    axis = ShardAxis(size, world_size // size, per_node)
    compared: list[PlanCandidate] = []
    choices, _ = plan_tables(tables, axis, constraints, topology, compared)
    prefix = f"S={size} x R={world_size // size}: "
    # a mesh whose replicated shards do not fit is ranked with the tables the planner fully
    # sharded over its replicas (fully sharded 2D): its name says how many
    sliced = sum(bool(getattr(c.spec, "fully_sharded", False)) for c in choices.values())
    suffix = f" ({sliced} of {len(choices)} tables fully sharded)" if sliced else ""
    return [replace(c, name=prefix + c.name + suffix) for c in compared]


def _ranked(out: list[PlanCandidate]) -> list[PlanCandidate]:
    """Fastest first, ``chosen`` moved to the fastest of the meshes' picks."""
    picks = [c for c in out if c.chosen]
    best = min(picks, key=lambda c: c.key) if picks else None
    return sorted((replace(c, chosen=c is best) for c in out), key=lambda c: c.key)


def _divisors(world_size: int) -> list[int]:
    return [s for s in range(1, world_size + 1) if world_size % s == 0]


def _sizes(world_size: int, given: Sequence[int] | None) -> tuple[list[int], dict[int, str]]:
    """The sizes to compare and those skipped (with why)."""
    if given is None:
        sizes = _divisors(world_size)
        if len(sizes) > MAX_SIZES:
            sizes = [s for s in sizes if s & (s - 1) == 0 or s == world_size]
        return sizes, {}
    sizes, skipped = [], {}
    for s in dict.fromkeys(given):
        if isinstance(s, bool) or not isinstance(s, numbers.Integral):
            raise TypeError(f"a shard group size must be an int, got {s!r}")
        if s >= 1 and world_size % s == 0:
            sizes.append(int(s))
        else:
            skipped[s] = f"does not divide the world size {world_size}"
    return sizes, skipped


def _tables_of(
    model_or_tables: nn.Module | Mapping[str, EmbeddingBagConfig],
) -> dict[str, EmbeddingBagConfig]:
    """Plan key -> config: a model's tables (``model_tables``), or a mapping as given."""
    if isinstance(model_or_tables, nn.Module):
        tables = model_tables(model_or_tables)
    elif isinstance(model_or_tables, Mapping):
        tables = dict(model_or_tables)
    else:
        raise TypeError(
            "model_or_tables must be a torch.nn.Module or a mapping {plan key: table "
            f"config}}, got {type(model_or_tables).__name__}"
        )
    if not tables:
        raise ValueError("no embedding tables to plan: the model holds no collection")
    return tables


__all__ = [
    "MAX_SIZES",
    "MeshChoice",
    "choose_shard_group_size",
    "compare_shard_group_sizes",
    "rank_shard_group_sizes",
]
