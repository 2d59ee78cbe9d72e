"""What ``dtrec.reshard`` checks before anything moves, and how ranks agree on it.

Every check runs on every rank without communicating (a plan naming unknown tables, a
value that is not a spec, a spec that does not fit the mesh, an unsupported case, a
batch or gradients in flight); one small all-gather then makes every rank raise if any
rank refused or was given another plan.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtrec.interop.plans import from_torchrec, is_torchrec_plan, is_torchrec_plan_dict
from dtrec.placements import TableLayout, TableSpec
from dtrec.placements.mesh import shard_axis, world_group
from dtrec.planning.plan import model_tables, table_fqn
from dtrec.sharded.collection import ShardedCollection
from dtrec.sharded.reshard.torch_state import table_entries, torch_optimizer_refusal, weights_of


def as_specs(
    model: nn.Module,
    collections: Mapping[str, ShardedCollection],
    plan: object,
    targets: Mapping[str, DeviceMesh],
) -> object:
    """``plan`` as ``{table fqn: spec}``: a TorchRec ``ShardingPlan`` (or its ``.plan``
    dict) mapped onto each collection's target mesh as ``distribute_module`` maps it
    (``dtrec.interop.plans``: ValueError naming a table whose layout dtrec cannot
    reproduce); anything else as it is."""
    if not (is_torchrec_plan(plan) or is_torchrec_plan_dict(plan)):
        return plan
    raw = plan.plan if is_torchrec_plan(plan) else plan  # type: ignore[attr-defined]
    tables = model_tables(model)
    by_mesh: dict[int, tuple[object, list[str]]] = {}
    for fqn in collections:
        by_mesh.setdefault(id(targets[fqn]), (targets[fqn], []))[1].append(fqn)
    specs: dict[str, object] = {}
    for mesh, fqns in by_mesh.values():

        def mine(path: str, fqns: list[str] = fqns) -> bool:  # a feature-processed one: inside
            return any(path == f or f.startswith(f"{path}.") or not path for f in fqns)

        part = {path: module_plan for path, module_plan in raw.items() if mine(path)}
        own = {k: cfg for k, cfg in tables.items() if any(
            k.startswith(f"{f}.") or not f for f in fqns)}  # fmt: skip
        if part:
            specs.update(from_torchrec(part, own, mesh))  # type: ignore[arg-type]
    return specs


def plan_changes(
    collections: Mapping[str, ShardedCollection],
    plan: object,
    targets: Mapping[str, DeviceMesh],
) -> dict[str, dict[str, TableSpec]]:
    """Collection FQN -> every table's new spec, for the collections with a changed spec
    or a new mesh (``targets``: each collection's mesh after the move). KeyError /
    TypeError / ValueError for a plan naming unknown tables, a value that is not a spec,
    or a spec (given, or kept on a new mesh) that does not fit its collection's target
    mesh (no collective)."""
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"plan must be a mapping {{'<collection fqn>.<table>': spec}}, got "
            f"{type(plan).__name__}"
        )
    where = {
        table_fqn(fqn, cfg.name): (fqn, cfg)
        for fqn, collection in collections.items()
        for cfg in collection._tables
    }
    unknown = sorted(k for k in plan if k not in where)
    if unknown:
        raise KeyError(
            f"reshard: plan names unknown table(s) {unknown}; the model's tables are "
            f"{sorted(where)}"
        )
    changes: dict[str, dict[str, TableSpec]] = {}
    for key, spec in plan.items():
        fqn, cfg = where[key]
        if not isinstance(spec, TableSpec):
            raise TypeError(
                f"reshard: plan entry {key!r}: expected a dtrec.placements spec, got {spec!r}"
            )
        if not spec.resolved:
            raise ValueError(
                f"reshard: plan entry {key!r}: {spec!r} leaves a choice to the planner; "
                "give it resolved (e.g. TableWise(rank=1))"
            )
        try:
            spec.layout(cfg, shard_axis(targets[fqn]))
        except ValueError as exc:
            raise ValueError(f"reshard: plan entry {key!r}: {exc}") from exc
        current = collections[fqn].specs()
        if spec != current[cfg.name]:
            changes.setdefault(fqn, dict(current))[cfg.name] = spec
    for fqn, collection in collections.items():
        if targets[fqn] is collection.mesh:
            continue
        specs = changes.setdefault(fqn, collection.specs())
        axis = shard_axis(targets[fqn])
        for cfg in collection._tables:
            try:
                specs[cfg.name].layout(cfg, axis)
            except ValueError as exc:
                raise ValueError(
                    f"reshard: table {table_fqn(fqn, cfg.name)!r} keeps {specs[cfg.name]!r}, "
                    f"which does not fit its new mesh ({exc}); give it a spec in the plan"
                ) from exc
    return changes


def refusal_of(
    collections: Mapping[str, ShardedCollection],
    changes: Mapping[str, Mapping[str, TableSpec]],
    optimizers: Sequence[torch.optim.Optimizer] | None,
    targets: Mapping[str, DeviceMesh],
) -> ValueError | None:
    """Why this rank cannot move the changed collections (to their ``targets`` meshes)
    yet (None: it can)."""
    for fqn, specs in changes.items():
        collection = collections[fqn]
        first = table_fqn(fqn, collection._tables[0].name)
        if collection._updater is None:
            refusal = torch_optimizer_refusal(fqn, collection._tables[0].name, optimizers)
            if refusal is not None:
                return refusal
        if collection._batch_split is not None:
            return ValueError(
                f"reshard: table {first!r}'s collection looks batches up with same_batch, "
                "which reshard does not support yet"
            )
        if collection._prefetched:
            return ValueError(
                f"reshard: collection {fqn!r} has a prefetched batch in flight (prefetch "
                "without its forward yet, e.g. a dtrec.TrainPipeline's next batch); run its "
                "forward first (drain the pipeline), or reshard before prefetching"
            )
        updater = collection._updater
        if updater is not None and (updater._pending or updater.accumulating):
            return ValueError(
                f"reshard: collection {fqn!r} holds gradients not applied yet (inside "
                "dtrec.accumulate_gradients, or a backward in progress); reshard between steps"
            )
        old, now = shard_axis(collection.mesh), shard_axis(targets[fqn])
        current = collection.specs()
        for cfg in collection._tables:
            for spec, axis in ((current[cfg.name], old), (specs[cfg.name], now)):
                why = _unsupported(spec.layout(cfg, axis))
                if why is not None:
                    return ValueError(
                        f"reshard: table {table_fqn(fqn, cfg.name)!r}: {spec!r} is {why}, "
                        "which reshard does not move yet"
                    )
            target = specs[cfg.name]
            if collection.sync_every is not None and target.layout(cfg, now).offloaded:
                return ValueError(
                    f"reshard: table {table_fqn(fqn, cfg.name)!r}: {target!r} is offloaded, "
                    "and offloaded tables train with the exact per-step replica sync only, "
                    f"not its collection's sync_every={collection.sync_every}; keep it on "
                    "the device"
                )
    return None


def offloaded_torch_state(
    collections: Mapping[str, ShardedCollection],
    changes: Mapping[str, Mapping[str, TableSpec]],
    entries: Mapping[str, Mapping[int, list[str]]],
    targets: Mapping[str, DeviceMesh],
) -> ValueError | None:
    """Why a table with torch optimizer state cannot go where reshard would put it: an
    offloaded table trains only with a fused optimizer, so that state would be stranded."""
    for fqn, tables in entries.items():
        collection, axis = collections[fqn], shard_axis(targets[fqn])
        for t, names in tables.items():
            cfg = collection._tables[t]
            spec = changes[fqn][cfg.name]
            if names and spec.layout(cfg, axis).offloaded:
                return ValueError(
                    f"reshard: table {table_fqn(fqn, cfg.name)!r} has torch optimizer state "
                    f"({', '.join(n.split('.', 1)[1] for n in names)}), but {spec!r} is "
                    "offloaded, and offloaded tables "
                    "train only with a fused optimizer (distribute_module(..., "
                    "optimizer=dtrec.optim...)); keep it on the device"
                )
    return None


def torch_entries(
    collections: Mapping[str, ShardedCollection],
    changes: Mapping[str, Mapping[str, TableSpec]],
    optimizers: Sequence[torch.optim.Optimizer] | None,
) -> dict[str, dict[int, list[str]]]:
    """Collection FQN -> table index -> its torch optimizer state entries that move."""
    out = {}
    for fqn in changes:
        collection = collections[fqn]
        if collection._updater is None and optimizers:
            names = [cfg.name for cfg in collection._tables]
            out[fqn] = table_entries(optimizers, fqn, names, weights_of(collection._stored()))
    return out


def _unsupported(layout: TableLayout) -> str | None:
    if layout.replica_sliced:
        return "fully sharded 2D (fully_sharded=True)"
    return None


def agree(
    collections: Mapping[str, ShardedCollection],
    changes: Mapping[str, Mapping[str, TableSpec]],
    refusal: Exception | None,
    entries: Mapping[str, Mapping[int, list[str]]],
    targets: Mapping[str, DeviceMesh] | None = None,
) -> None:
    """Raise on every rank unless every rank has the same changes and none refuses (one
    small all-gather, before anything is built): a refusing rank raises its own error,
    the others a ValueError naming it."""
    if not collections:
        return
    group = world_group(next(iter(collections.values())).mesh)
    described = repr(
        (
            sorted((fqn, sorted(s.items())) for fqn, s in changes.items()),
            sorted((fqn, sorted(e.items())) for fqn, e in entries.items()),
            sorted(
                (fqn, m.mesh.tolist(), repr(shard_axis(m))) for fqn, m in (targets or {}).items()
            ),
        )
    )
    digest = hashlib.sha256(described.encode()).hexdigest()
    size = dist.get_world_size(group)
    gathered: list[tuple[str, str | None] | None] = [None] * size
    dist.all_gather_object(gathered, (digest, None if refusal is None else str(refusal)), group)
    if refusal is not None:
        raise refusal
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    for rank, item in zip(ranks, gathered, strict=True):
        assert item is not None
        if item[1] is not None:
            raise ValueError(f"reshard refused on rank {rank}: {item[1]}")
    differ = [
        rank for rank, item in zip(ranks, gathered, strict=True) if item and item[0] != digest
    ]
    if differ:
        raise ValueError(
            f"reshard: ranks {differ} were given another plan than rank {dist.get_rank()} "
            "(or hold other torch optimizer state of its tables); every rank must reshard "
            "to the same plan"
        )
