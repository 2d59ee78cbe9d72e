"""The meshes ``dtrec.reshard`` moves collections and the dense part to.

``reshard(model, plan, mesh=..., meshes=...)`` names them as ``distribute_module`` does:
``mesh`` for the dense part and every collection ``meshes`` does not name, ``meshes``
per collection FQN. Every new mesh spans the model's world (a mesh over other ranks is
refused before anything moves). A mesh equal to a collection's current one (same ranks
in the same places, same node split) is no move: the current object is kept.

Dense parameters are DTensors replicated over the model's mesh (``dense.py``): each rank
already holds their whole value, so moving them to a new mesh sends nothing. Each keeps
its identity (its spec is swapped in place, ``_torch_compat.move_to_mesh``), so the
hooks and buckets of ``ReplicatedDense`` and a torch optimizer's param groups stay
valid; the optimizer's DTensor state of them (given as ``optimizers``) moves alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dtrec._torch_compat import fsdp_managed, move_to_mesh
from dtrec.placements.mesh import shard_axis
from dtrec.planning.plan import mesh_groups, model_tables
from dtrec.sharded.collection import ShardedCollection


def model_mesh(model: nn.Module, collections: Mapping[str, ShardedCollection]) -> DeviceMesh:
    """The mesh the dense part is replicated over (the first collection's without one)."""
    dense = model._dtrec_state.dense
    if dense is not None:
        return dense.mesh
    return next(iter(collections.values())).mesh


def same_mesh(a: DeviceMesh, b: DeviceMesh) -> bool:
    """Whether ``a`` and ``b`` place the same ranks alike: same shape, ranks and node split."""
    return a is b or (
        a.device_type == b.device_type
        and a.mesh.tolist() == b.mesh.tolist()
        and shard_axis(a) == shard_axis(b)
    )


def target_meshes(
    model: nn.Module,
    collections: Mapping[str, ShardedCollection],
    mesh: object,
    meshes: object,
) -> dict[str, DeviceMesh]:
    """Collection FQN -> the mesh it is to sit on (its current object when unchanged).

    TypeError / ValueError for a ``mesh`` that is not a ``dtrec.init_mesh`` mesh of the
    model's world; ``meshes`` checked as ``distribute_module`` checks it (unknown
    collections, values that are not such meshes)."""
    current = {fqn: c.mesh for fqn, c in collections.items()}
    if mesh is None and not meshes:
        return current
    reference = model_mesh(model, collections)
    if mesh is not None:
        shard_axis(mesh)  # type: ignore[arg-type]  # TypeError / ValueError: not init_mesh's
        assert isinstance(mesh, DeviceMesh)
        world = sorted(reference.mesh.flatten().tolist())
        covers = sorted(mesh.mesh.flatten().tolist())
        if covers != world or mesh.device_type != reference.device_type:
            raise ValueError(
                f"reshard: mesh covers ranks {covers} on {mesh.device_type!r}, but the "
                f"model's mesh covers {world} on {reference.device_type!r}: the new mesh "
                "must come from dtrec.init_mesh over the same world"
            )
    if meshes is not None and not isinstance(meshes, Mapping):
        raise TypeError(
            f"reshard: meshes must be a mapping {{collection fqn: DeviceMesh}}, got "
            f"{type(meshes).__name__}"
        )
    named = dict(meshes or {})
    mesh_groups(model_tables(model), mesh if mesh is not None else reference, named)
    out = {}
    for fqn, now in current.items():
        target = named.get(fqn, mesh if mesh is not None else now)
        out[fqn] = now if same_mesh(target, now) else target
    return out


def dense_names(model: nn.Module) -> list[str]:
    """The names of the dense parameters dtrec replicates (none without a dense part)."""
    dense = model._dtrec_state.dense
    if dense is None:
        return []
    ids = {id(p) for p in dense._params}
    return [n for n, p in model.named_parameters() if id(p) in ids]


def foreign_dense(
    model: nn.Module, collections: Mapping[str, ShardedCollection]
) -> list[tuple[str, str]]:
    """(FQN, who distributes it) of each dense DTensor parameter that dtrec does not
    replicate: ``fully_shard``'s (FSDP2) and those distributed before ``distribute_module``
    (``parallelize_module``, ``distribute_tensor``), which it leaves to their owners."""
    tables = {id(p) for c in collections.values() for p in c.parameters()}
    dense = model._dtrec_state.dense
    own = {id(p) for p in dense._params} if dense is not None else set()
    out, seen = [], set()
    for prefix, module in model.named_modules():
        for name, p in module._parameters.items():
            if not isinstance(p, DTensor) or id(p) in tables | own | seen:
                continue
            seen.add(id(p))
            holder = (
                "torch's fully_shard (FSDP2)"
                if fsdp_managed(module)
                else "torch's parallelize_module or distribute_tensor (a DTensor on its own "
                f"mesh of shape {tuple(p.device_mesh.mesh.shape)})"
            )
            out.append((f"{prefix}.{name}" if prefix else name, holder))
    return out


def dense_refusal(
    model: nn.Module,
    collections: Mapping[str, ShardedCollection],
    mesh: DeviceMesh | None,
    optimizers: Sequence[torch.optim.Optimizer] | None,
) -> ValueError | None:
    """Why the dense part cannot follow ``mesh`` yet: some of it is distributed by torch's
    own parallelisms (FSDP2, TP), whose state reshard cannot move (E374); or its
    parameters' optimizer state would stay on the old mesh unless the optimizers holding
    them are given (E357), each trained one held by one of them (E375; ``[]``: none holds
    them, unchecked: state in an optimizer not given is out of sight)."""
    if mesh is None or same_mesh(mesh, model_mesh(model, collections)):
        return None
    foreign = foreign_dense(model, collections)
    if foreign:
        name, holder = foreign[0]
        return ValueError(
            f"reshard: dense parameter {name!r} is distributed by {holder}, which reshard "
            f"cannot move to a new mesh ({len(foreign)} such parameter(s)); move only the "
            "tables, reshard(model, plan, meshes={collection fqn: new_mesh, ...}), leaving "
            "the dense part where it is, or save a checkpoint (dtrec.checkpoint.save) and "
            "build the model again on the new mesh"
        )
    if optimizers:  # each trained dense parameter held by one of them: its state moves
        held = {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}
        dense = model._dtrec_state.dense
        ids = {id(p) for p in dense._params} if dense is not None else set()
        left = [
            n for n, p in model.named_parameters()
            if id(p) in ids and p.requires_grad and id(p) not in held
        ]  # fmt: skip
        if left:
            return ValueError(
                f"reshard: the dense parameters {left[:3]} move to the new mesh, but none of "
                f"the {len(optimizers)} optimizer(s) given holds them: pass the optimizer "
                "that trains them too (its state of them would stay on the old mesh), or "
                "freeze those no optimizer trains (requires_grad_(False))"
            )
    if optimizers is not None:
        return None
    names = dense_names(model)
    if not names:
        return None
    return ValueError(
        f"reshard: the dense parameters {names[:3]} move to the new mesh (their DTensors' "
        "mesh changes): pass the optimizer(s) holding them, reshard(model, plan, mesh=mesh, "
        "optimizers=[opt]), so their state moves too (optimizers=[] if none holds them)"
    )


def move_dense(
    model: nn.Module,
    collections: Mapping[str, ShardedCollection],
    mesh: DeviceMesh | None,
    optimizers: Sequence[torch.optim.Optimizer] | None,
) -> None:
    """Put the dense parameters, their gradients and their torch optimizer state on
    ``mesh`` in place (nothing sent: every rank holds them whole). No collective."""
    dense = model._dtrec_state.dense
    if dense is None or mesh is None or same_mesh(mesh, dense.mesh):
        return
    for p in dense._params:
        move_to_mesh(p, mesh)
        if isinstance(p.grad, DTensor):
            move_to_mesh(p.grad, mesh)
        for optimizer in optimizers or []:
            for value in optimizer.state.get(p, {}).values():
                if isinstance(value, DTensor) and value.device_mesh is not mesh:
                    move_to_mesh(value, mesh)
    dense.mesh = mesh
