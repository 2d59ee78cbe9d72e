"""The plan a model carries after ``dtrec.reshard``: its specs, and the planner's reports
of the new layout.

``model.sharding_plan`` of a ``distribute_module`` model carries the planner's report
(``print(model.sharding_plan)``: every table's candidates, every rank's memory and
time). After a move, the old one would describe the old layout (its ranks, its mesh);
the new one is what ``dtrec.plan`` reports with every spec pinned on the target meshes,
as a model distributed there directly carries.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtrec.placements import TableSpec
from dtrec.planning.plan import ShardingPlan, table_fqn
from dtrec.planning.plan import plan as make_plan
from dtrec.planning.topology import Topology
from dtrec.sharded.collection import ShardedCollection
from dtrec.sharded.reshard.meshes import model_mesh, same_mesh


def plan_after(
    model: nn.Module,
    collections: Mapping[str, ShardedCollection],
    changes: Mapping[str, Mapping[str, TableSpec]],
    targets: Mapping[str, DeviceMesh],
    mesh: DeviceMesh | None,
    topology: Topology | None,
    plan: object,
) -> ShardingPlan:
    """The model's plan after the move: every table's spec, and, when the plan it had
    carried the planner's reports, reports of the new layout (``dtrec.plan`` with every
    spec pinned, on the target meshes, under ``topology``, else the target plan's
    report's, else the old one's), as a model distributed there directly would carry.
    Deterministic and local: every rank computes the same (before anything moves)."""
    old = model._dtrec_state.sharding_plan
    moved = {table_fqn(fqn, n): s for fqn, specs in changes.items() for n, s in specs.items()}
    specs = ShardingPlan({key: moved.get(key, spec) for key, spec in old.items()})
    base = topology or _report_topology(plan) or _report_topology(old)
    if base is None:
        return specs
    dense = mesh if mesh is not None else model_mesh(model, collections)
    own = {fqn: m for fqn, m in targets.items() if not same_mesh(m, dense)}
    try:
        refreshed = make_plan(model, dense, constraints=dict(specs), topology=base, meshes=own)
    except (KeyError, TypeError, ValueError):  # the planner refuses the layout: no report
        return specs
    return refreshed if dict(refreshed) == dict(specs) else specs


def _report_topology(plan: object) -> Topology | None:
    """The topology ``plan``'s planner report was made under (None: no report)."""
    if not isinstance(plan, ShardingPlan):
        return None
    if plan.report is not None:
        return plan.report.topology
    first = next(iter((plan.reports or {}).values()), None)
    return None if first is None else first.topology
