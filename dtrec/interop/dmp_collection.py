"""TorchRec's Dynamic 2D (``DMPCollectionConfig`` per module type) as dtrec's meshes.

TorchRec's ``DMPCollection(..., submodule_configs=[DMPCollectionConfig(module, plan,
sharding_group_size, node_group_size, use_inter_host_allreduce)])`` gives every module
of a type its own sharding group size, plan and replica groups. In dtrec that is one
``init_mesh`` per config and ``distribute_module(model, mesh, plan, meshes=...)``: each
collection of the config's module type is sharded on its config's mesh, by its plan
(made for one sharding group, ranks 0..S-1, as a ``DMPCollection`` plan is), and the
collections no config names stay on ``mesh``.

Example::

    from dtrec.interop.dmp_collection import dmp_collection_meshes

    meshes, plan = dmp_collection_meshes(model, configs, "cuda", plan)
    model = dtrec.distribute_module(model, mesh, plan, meshes=meshes)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtrec.interop.plans import is_torchrec_plan, is_torchrec_plan_dict
from dtrec.placements.mesh import init_mesh


def dmp_collection_meshes(
    model: nn.Module,
    configs: Sequence[object],
    device_type: str,
    plan: object | None = None,
) -> tuple[dict[str, DeviceMesh], dict[str, Mapping[str, object]]]:
    """(collection FQN -> its config's mesh, the TorchRec plan of every module) for
    TorchRec ``DMPCollectionConfig``s: what ``distribute_module(model, mesh, plan,
    meshes=...)`` takes for TorchRec's Dynamic 2D.

    Per config, one mesh: ``init_mesh(device_type, sharding_group_size,
    replicas_within_node=not use_inter_host_allreduce)``, with ``node_size`` from
    ``node_group_size`` (TorchRec's logical node of a sharding group's ranks: that many
    shard positions per node). Every module in ``model`` whose type is the config's
    ``module`` gets it. ``plan`` (the ``DMPCollection``'s own plan, for the modules no
    config names) and the configs' plans merge into one plan dict (module path -> module
    plan). Collective: every rank calls it alike (meshes create process groups).
    """
    world = dist.get_world_size()
    meshes: dict[str, DeviceMesh] = {}
    merged: dict[str, Mapping[str, object]] = dict(_plan_dict(plan, "plan"))
    for i, config in enumerate(configs):
        module_type = getattr(config, "module", None)
        size = getattr(config, "sharding_group_size", None)
        if not isinstance(module_type, type) or not isinstance(size, int):
            raise TypeError(
                f"configs[{i}] must be a TorchRec DMPCollectionConfig (module type, plan, "
                f"sharding_group_size, ...), got {config!r}"
            )
        across = bool(getattr(config, "use_inter_host_allreduce", False))
        node_group = getattr(config, "node_group_size", None)
        node_size = None
        if node_group is not None:  # positions per node -> ranks per node
            node_size = node_group if across else node_group * (world // size)
        mesh = init_mesh(device_type, size, node_size, replicas_within_node=not across)
        paths = [fqn for fqn, m in model.named_modules() if type(m) is module_type]
        if not paths:
            raise ValueError(
                f"configs[{i}] names module type {module_type.__name__}, which the model "
                "does not have"
            )
        taken = sorted(set(paths) & set(meshes))
        if taken:
            raise ValueError(
                f"configs[{i}] ({module_type.__name__}) covers module(s) {taken} that an "
                "earlier config already gives a mesh"
            )
        meshes.update(dict.fromkeys(paths, mesh))
        merged.update(_plan_dict(getattr(config, "plan", None), f"configs[{i}].plan"))
    return meshes, merged


def _plan_dict(plan: object, what: str) -> Mapping[str, Mapping[str, object]]:
    """A TorchRec ``ShardingPlan``'s module path -> module plan ({} for None)."""
    if plan is None:
        return {}
    if is_torchrec_plan(plan):
        plan = plan.plan  # type: ignore[attr-defined]
    if not is_torchrec_plan_dict(plan):
        raise TypeError(f"{what} must be a TorchRec ShardingPlan (or its .plan dict), got {plan!r}")
    return plan  # type: ignore[return-value]


__all__ = ["dmp_collection_meshes"]
