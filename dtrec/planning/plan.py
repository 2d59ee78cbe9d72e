"""Sharding plans: table FQN -> spec, printable with the planner's reasons, and JSON.

``plan`` runs the cost-model planner (``dtrec.planner``): it resolves the choices
users leave open (``TableWise(rank=None)``, ``TableRowWise(node=None)``) and fills
in tables a user plan omits.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtrec.interop.plans import from_torchrec, is_torchrec_plan, is_torchrec_plan_dict
from dtrec.interop.qcomms import qcomms_per_collection
from dtrec.modules.config import EmbeddingBagConfig
from dtrec.placements import SPEC_TYPES, TableSpec
from dtrec.placements.mesh import ShardAxis, shard_axis
from dtrec.planning.cost_model import Topology, totals
from dtrec.planning.plan_step import PlanCandidate, candidate_lines
from dtrec.planning.planner import TableConstraint, collection_of, plan_tables


def spec_to_dict(spec: TableSpec) -> dict:
    """``{"type": "RowWise", <its fields>}``; the cache fields only when set (offloaded)."""
    values = {f.name: getattr(spec, f.name) for f in fields(spec)}
    unset = [k for k in ("cache_rows", "cache_fraction") if values.get(k, 0) is None]
    return {"type": type(spec).__name__, **{k: v for k, v in values.items() if k not in unset}}


def spec_from_dict(data: Mapping, key: str = "?") -> TableSpec:
    """The spec ``spec_to_dict`` wrote; ValueError naming the plan ``key`` otherwise."""
    if not isinstance(data, Mapping):
        raise ValueError(
            f'plan JSON entry {key!r}: expected an object like {{"type": "RowWise"}}, got {data!r}'
        )
    kind = data.get("type")
    if kind not in SPEC_TYPES:
        raise ValueError(
            f"plan JSON entry {key!r}: unknown spec type {kind!r}; expected one of "
            f"{list(SPEC_TYPES)}"
        )
    cls = SPEC_TYPES[kind]
    allowed = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - allowed - {"type"})
    if unknown:
        raise ValueError(
            f"plan JSON entry {key!r}: {kind} has no field(s) {unknown}; its fields: "
            f"{sorted(allowed)}"
        )
    return cls(**{k: v for k, v in data.items() if k != "type"})


@dataclass
class PlanReport:
    """Why the planner chose what it chose: per table, per rank (shard position)."""

    tables: list[tuple[str, TableSpec, list[tuple[TableSpec, float, float]]]]
    """(table, chosen spec, every candidate's (spec, max MiB on a rank, max ms on a rank))."""
    memory: list[float]
    """Bytes per shard position (every replica holds the same)."""
    time: list[float]
    """Estimated seconds per step per shard position."""
    topology: Topology
    host_memory: list[float] = field(default_factory=list)
    """Host-memory bytes per shard position (offloaded tables' blocks)."""
    why: dict[str, str] = field(default_factory=dict)
    """Table -> why it is where it is, where the costs alone do not say (offloaded)."""
    compared: list[PlanCandidate] = field(default_factory=list)
    """The whole plans the planner compared (``plan_step``), fastest first, one chosen."""

    @property
    def imbalance(self) -> float:
        """Slowest position's time over the mean (1.0 = perfectly balanced)."""
        mean = sum(self.time) / len(self.time)
        return max(self.time) / mean if mean > 0 else 1.0

    def __str__(self) -> str:
        lines = ["table -> spec (candidates: spec max MiB/rank, max ms/rank; chosen first)"]
        for key, spec, options in self.tables:
            ranked = sorted(options, key=lambda o: (o[0] != spec, o[2], o[1]))
            shown = ", ".join(f"{s} {m:.1f} MiB {t:.3f} ms" for s, m, t in ranked[:4])
            more = f", +{len(ranked) - 4} more" if len(ranked) > 4 else ""
            lines.append(f"  {key}: {spec}  ({shown}{more})")
            if key in self.why:
                lines.append(f"    {self.why[key]}")
        host = any(self.host_memory)
        lines.append(f"per shard position: MiB{' (+ host MiB)' if host else ''} / est. ms per step")
        for p, (m, t) in enumerate(zip(self.memory, self.time, strict=True)):
            extra = f" + {self.host_memory[p] / 2**20:.1f} host" if host else ""
            lines.append(f"  {p}: {m / 2**20:.1f} MiB{extra}  {1e3 * t:.3f} ms")
        lines.append(
            f"slowest {1e3 * max(self.time):.3f} ms, imbalance (max / mean) {self.imbalance:.2f}"
            f"; budget {self.topology.memory_budget / 2**20:.0f} MiB per rank"
        )
        return "\n".join(lines + candidate_lines(self.compared))


class ShardingPlan(dict[str, TableSpec]):
    """``{"<module fqn>.<table name>": spec}``, printable; JSON with ``to_json`` / ``from_json``.

    Plans from ``dtrec.plan`` carry ``report`` (a ``PlanReport``): ``print(plan)`` then
    also shows why each spec was chosen and every rank's memory and estimated time.

    Example::

        plan = ShardingPlan({"sparse.t0": RowWise(), "sparse.t1": TableWise(rank=0)})
    """

    report: PlanReport | None = None
    reports: dict[str, PlanReport] | None = None
    """With collections on meshes of their own (``plan(..., meshes=)``): one report per
    mesh, keyed by what it holds (``"sparse.ebc on mesh 2 x 2"``); ``report`` is then None."""

    def __str__(self) -> str:
        width = max((len(k) for k in self), default=0)
        text = "\n".join(f"{k:<{width}}  {spec}" for k, spec in self.items())
        if self.reports:
            return "\n".join([text, *(f"== {name}\n{r}" for name, r in self.reports.items())])
        return text if self.report is None else f"{text}\n{self.report}"

    def to_json(self) -> str:
        return json.dumps({k: spec_to_dict(v) for k, v in self.items()}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("plan JSON must be an object {table fqn: spec}")
        return cls({key: spec_from_dict(value, key) for key, value in data.items()})


def find_collections(model: nn.Module) -> dict[str, nn.Module]:
    """FQN -> every unsharded ``EmbeddingBagCollection`` and ``EmbeddingCollection`` in
    ``model`` (outermost only).

    A ``torchrec.EmbeddingBagCollection`` (``EmbeddingCollection``) is returned as dtrec's
    collection over the same weights (``dtrec.interop``), the one inside TorchRec's
    ``ManagedCollisionEmbedding(Bag)Collection`` too (at ``<fqn>._embedding_module``, as in
    dtrec's; ``distribute_module`` converts the whole module first); any other TorchRec
    sparse module
    is a TypeError naming it (``dtrec.interop.unsupported_module``), never left silently
    replicated.
    """
    from dtrec.interop import (
        from_torchrec_bag_collection,
        is_torchrec_bag_collection,
        unsupported_module,
    )
    from dtrec.interop.managed_collision import from_torchrec_mc_collection
    from dtrec.interop.modules import (
        from_torchrec_sequence_collection,
        is_torchrec_mc_collection,
        is_torchrec_sequence_collection,
    )
    from dtrec.modules import EmbeddingBagCollection, EmbeddingCollection
    from dtrec.modules.mc_collection import (
        MANAGED_COLLISION_MODULES,
        ManagedCollisionLookup,
    )

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    found: dict[str, nn.Module] = {}
    remapped: list[str] = []  # managed-collision collections: their EBC is found inside
    converted: list[str] = []  # TorchRec's: converted whole, their children not looked at
    for fqn, module in model.named_modules():
        if any(fqn.startswith(f + ".") or f == "" for f in [*found, *converted]):
            continue
        error = unsupported_module(fqn, module)
        if error is not None:
            raise error
        if is_torchrec_mc_collection(module):
            converted.append(fqn)
            inner = from_torchrec_mc_collection(module)._embedding_module
            found[f"{fqn}._embedding_module" if fqn else "_embedding_module"] = inner
        elif isinstance(module, ManagedCollisionLookup):
            remapped.append(fqn)
        elif isinstance(module, MANAGED_COLLISION_MODULES) and not any(
            fqn.startswith(f + ".") or f == "" for f in remapped
        ):
            where = repr(fqn) if fqn else "the model itself"
            raise TypeError(
                f"module {where} is a dtrec {type(module).__name__} outside a "
                "ManagedCollisionEmbeddingBagCollection or ManagedCollisionEmbeddingCollection: "
                "distribute_module shards managed collision only as such a collection (its "
                "remap shared by every rank)"
            )
        if isinstance(module, (EmbeddingBagCollection, EmbeddingCollection)):
            found[fqn] = module
        elif is_torchrec_bag_collection(module):
            found[fqn] = from_torchrec_bag_collection(module)
        elif is_torchrec_sequence_collection(module):
            found[fqn] = from_torchrec_sequence_collection(module)
    return found


def model_collections(model: nn.Module) -> dict[str, nn.Module]:
    """FQN -> every collection of ``model``: the unsharded ones (``find_collections``) and
    the sharded ones of a ``distribute_module`` model (what ``dtrec.plan`` re-plans, e.g.
    for ``dtrec.reshard``), outermost only."""
    found = find_collections(model)
    for fqn, module in model.named_modules():
        if any(fqn.startswith(f + ".") or f == fqn or f == "" for f in found):
            continue
        if hasattr(type(module), "tables_attr") and hasattr(module, "specs"):  # sharded
            found[fqn] = module
    return found


def collection_configs(collection: nn.Module) -> list:
    """The table configs of a (sharded or unsharded) pooled or sequence collection."""
    if hasattr(collection, "embedding_bag_configs"):
        return collection.embedding_bag_configs()
    return collection.embedding_configs()


def collection_tables(collection: nn.Module) -> nn.ModuleDict:
    """Table name -> module holding ``.weight`` (``embedding_bags`` or ``embeddings``)."""
    if hasattr(collection, "embedding_bags"):
        return collection.embedding_bags
    return collection.embeddings


def table_fqn(collection_fqn: str, table: str) -> str:
    """The plan key of a table: ``"<collection fqn>.<table name>"`` (just the name at the root)."""
    return f"{collection_fqn}.{table}" if collection_fqn else table


def model_tables(model: nn.Module) -> dict[str, EmbeddingBagConfig]:
    """Plan key -> table config, over every collection of ``model`` (pooled and sequence)."""
    return {
        table_fqn(fqn, cfg.name): cfg
        for fqn, ebc in model_collections(model).items()
        for cfg in collection_configs(ebc)
    }


def plan(
    model: nn.Module,
    mesh: DeviceMesh,
    constraints: Mapping[str, object] | None = None,
    topology: Topology | None = None,
    meshes: Mapping[str, DeviceMesh] | None = None,
    id_counters: object | None = None,
) -> ShardingPlan:
    """A complete plan for every table of ``model`` on ``mesh``, from the cost model.

    ``constraints`` pins specs per table FQN (an unresolved one, e.g.
    ``TableWise(rank=None)``, gets its choice made here) or limits them with a
    ``dtrec.planner.TableConstraint`` (types, shard counts, pooling factor). A TorchRec
    ``ShardingPlan``, or TorchRec ``ParameterConstraints`` per table name, are accepted
    too (``dtrec.interop.plans`` maps them onto the mesh). Tables get the
    spec that keeps the slowest rank fastest within each rank's memory budget (see
    ``dtrec.planner``). ``topology`` defaults to ``Topology.h100()`` on CUDA meshes and
    ``Topology.cpu()`` otherwise; its ``qcomms`` may name collections, like
    ``distribute_module``'s (a name the model lacks is a KeyError). Deterministic, so
    every rank computes the same plan.
    ``meshes``: collection FQN -> the mesh its tables are sharded on
    (``distribute_module(..., meshes=)``); each mesh's collections are planned on it
    apart, in collection order, within what the meshes planned before them left of each
    rank's memory, and get a report of their own (``ShardingPlan.reports``).
    ``id_counters``: a ``dtrec.IdCounters`` of ``model``: plan from what its tables have
    seen instead of the static pooling factors (``IdCounters.topology(topology)``: the
    measured pooling factors, batch size and each table's id distribution); collective
    then (one all-reduce), every rank calls it. ``model`` may be a ``distribute_module``
    model (its tables are re-planned, e.g. for ``dtrec.reshard``).
    ``print(plan)`` explains it.

    Example::

        p = dtrec.plan(model, mesh, constraints={"sparse.big": RowWise()})
        p = dtrec.plan(model, mesh, id_counters=counters)  # from the ids seen so far
    """
    tables = model_tables(model)
    groups = mesh_groups(tables, mesh, meshes)
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"topology must be a dtrec.Topology or None, got {topology!r}")
    if topology is None:
        topology = Topology.h100() if mesh.device_type == "cuda" else Topology.cpu()
    if id_counters is not None:
        if not hasattr(id_counters, "topology"):
            raise TypeError(f"id_counters must be a dtrec.IdCounters, got {id_counters!r}")
        topology = id_counters.topology(topology)
    if isinstance(topology.qcomms, Mapping):  # a collection the model lacks: KeyError
        qcomms_per_collection(topology.qcomms, {collection_of(k, c) for k, c in tables.items()})
    plans: list[ShardingPlan] = []
    left = topology  # what each rank's memory budget still holds for the next mesh's tables
    for group_mesh, keys in groups:
        group_tables = {k: tables[k] for k in keys}
        given = from_torchrec(_for_group(constraints, group_tables, tables), tables, group_mesh)
        if given is not None and not isinstance(given, Mapping):
            raise TypeError(
                f"constraints must be a mapping {{table fqn: spec or TableConstraint}}, a "
                f"TorchRec ShardingPlan or None, got {type(given).__name__}"
            )
        given = dict(given or {})
        check_plan_keys(given, tables)
        given = {k: v for k, v in given.items() if k in group_tables}
        plans.append(_plan_on(group_tables, shard_axis(group_mesh), given, left))
        left = _after(left, plans[-1].report)  # type: ignore[arg-type]
    if len(plans) == 1:
        return plans[0]
    specs = {key: spec for p in plans for key, spec in p.items()}
    result = ShardingPlan({key: specs[key] for key in tables})  # the model's table order
    result.reports = {}
    for (group_mesh, keys), p in zip(groups, plans, strict=True):
        holds = sorted({collection_of(k, tables[k]) for k in keys})
        shape = " x ".join(str(n) for n in group_mesh.mesh.shape)
        result.reports[f"{', '.join(holds)} on mesh {shape}"] = p.report  # type: ignore[assignment]
    return result


def _for_group(
    constraints: object,
    group: Mapping[str, EmbeddingBagConfig],
    tables: Mapping[str, EmbeddingBagConfig],
) -> object:
    """The part of a TorchRec ``ShardingPlan`` that plans ``group``'s collections (each
    mesh's tables are mapped onto that mesh); other constraints are returned whole."""
    plan = constraints.plan if is_torchrec_plan(constraints) else constraints  # type: ignore[attr-defined]
    if len(group) == len(tables) or not is_torchrec_plan_dict(plan):
        return constraints
    assert isinstance(plan, Mapping)
    return {
        path: module_plan
        for path, module_plan in plan.items()
        if any(key == path or key.startswith(f"{path}.") or not path for key in group)
    }


def _after(topology: Topology, report: PlanReport) -> Topology:
    """``topology`` with what ``report``'s plan holds on its fullest position taken off every
    rank's device and host budgets: every mesh spans every rank, so the next mesh's tables
    share each rank with these (conservative: a rank holds one position of each mesh)."""
    device = max(report.memory, default=0.0) / (1.0 - topology.memory_headroom)
    host = max(report.host_memory, default=0.0)
    return replace(
        topology,
        memory_per_rank=max(topology.memory_per_rank - device, 1.0),
        host_memory_per_rank=max(topology.host_memory_per_rank - host, 0.0),
    )


def _plan_on(
    tables: Mapping[str, EmbeddingBagConfig],
    axis: ShardAxis,
    constraints: Mapping[str, object],
    topology: Topology,
) -> ShardingPlan:
    """``tables`` planned on one mesh's axis, with the report of why."""
    compared: list[PlanCandidate] = []
    choices, sums = plan_tables(tables, axis, constraints, topology, compared)  # type: ignore[arg-type]
    result = ShardingPlan({key: choices[key].spec for key in tables})
    rows = []
    for key, choice in choices.items():
        options = []
        for spec, cost in choice.costs:
            one = totals([cost], axis.size)
            options.append(
                (spec, float(one.memory.max()) / 2**20, 1e3 * float(one.time(axis, topology).max()))
            )
        rows.append((key, choice.spec, options))
    time = sums.time(axis, topology)
    why = {key: choice.why for key, choice in choices.items() if choice.why}
    result.report = PlanReport(
        rows,
        sums.memory.tolist(),
        time.tolist(),
        topology,
        sums.host_memory.tolist(),
        why,
        compared,
    )
    return result


def mesh_groups(
    tables: Mapping[str, EmbeddingBagConfig],
    mesh: DeviceMesh,
    meshes: Mapping[str, DeviceMesh] | None,
) -> list[tuple[DeviceMesh, list[str]]]:
    """The meshes tables are sharded on, each with its tables' keys (in table order):
    ``meshes[collection]``, else ``mesh``. Checks ``meshes``: its keys name collections
    of the model, its values are ``dtrec.init_mesh`` meshes over the whole world of
    ``mesh``, on its device type."""
    shard_axis(mesh)
    meshes = dict(meshes or {})
    collections = {collection_of(k, c) for k, c in tables.items()}
    unknown = sorted(set(meshes) - collections)
    if unknown:
        raise KeyError(
            f"meshes names unknown collection(s) {unknown}; the model's collections are "
            f"{sorted(collections)}"
        )
    world = sorted(mesh.mesh.flatten().tolist())
    for fqn, own in meshes.items():
        if not isinstance(own, DeviceMesh):
            raise TypeError(
                f"meshes[{fqn!r}] must be a DeviceMesh from dtrec.init_mesh, got "
                f"{type(own).__name__}"
            )
        try:
            shard_axis(own)
        except ValueError as exc:
            raise ValueError(f"meshes[{fqn!r}]: {exc}") from None
        covers = sorted(own.mesh.flatten().tolist())
        if own.device_type != mesh.device_type or covers != world:
            raise ValueError(
                f"meshes[{fqn!r}] covers ranks {covers} on {own.device_type!r}, but the "
                f"model's mesh covers {world} on {mesh.device_type!r}: every collection's "
                "mesh must come from dtrec.init_mesh over the same world"
            )
    groups: dict[int, tuple[DeviceMesh, list[str]]] = {}
    for key, cfg in tables.items():
        own = meshes.get(collection_of(key, cfg), mesh)
        groups.setdefault(id(own), (own, []))[1].append(key)
    return list(groups.values())


def check_plan_keys(plan: Mapping[str, object], tables: Mapping[str, EmbeddingBagConfig]) -> None:
    """Every key names a table of the model and every value is a spec or a constraint."""
    unknown = [k for k in plan if k not in tables]
    if unknown:
        raise KeyError(
            f"plan names unknown table(s) {unknown}; the model's tables are {sorted(tables)}"
        )
    for key, spec in plan.items():
        if not isinstance(spec, (TableSpec, TableConstraint)):
            raise TypeError(
                f"plan entry {key!r}: expected a dtrec.placements spec (or a "
                f"dtrec.planner.TableConstraint), got {spec!r}"
            )
