"""1D or 2D: the planner's candidate plans on every (S, R) mesh of one world, compared.

Why: a 2D mesh (R > 1 replica groups) sends fewer shard-axis bytes per rank but adds
replica gradient syncs, and with them collective calls; whether that pays depends on the
tables and the fabric (issue 33: on 4 gloo ranks sharing 2 cores, 2D row-wise measured
slower than every 1D type but data-parallel). ``plan_tables`` plans one given mesh; this
runs it on each shard group size and ranks every candidate plan by the same predicted step
(``plan_step``), so the mesh is chosen by the model that chooses the specs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from dtrec.modules.config import EmbeddingBagConfig
from dtrec.placements import TableSpec
from dtrec.placements.constraints import TableConstraint
from dtrec.placements.mesh import ShardAxis, positions_per_node
from dtrec.planning.plan_step import PlanCandidate
from dtrec.planning.planner import plan_tables
from dtrec.planning.topology import Topology


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
        per_node = None if node_size is None else positions_per_node(world_size, size, node_size)
        axis = ShardAxis(size, world_size // size, per_node)
        compared: list[PlanCandidate] = []
        plan_tables(tables, axis, constraints, topology, compared)
        prefix = f"S={size} x R={world_size // size}: "
        out += [replace(c, name=prefix + c.name) for c in compared]
    picks = [c for c in out if c.chosen]
    best = min(picks, key=lambda c: c.key) if picks else None
    return sorted((replace(c, chosen=c is best) for c in out), key=lambda c: c.key)


__all__ = ["compare_shard_group_sizes"]
