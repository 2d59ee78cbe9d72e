"""The 2D ("shard", "replicate") device mesh and the facts specs need from it."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dtrec._torch_compat import (
    concatenate_meshes,
    flatten_mesh_dims,
    root_mesh,
    unflatten_mesh_dim,
)

T = TypeVar("T")

SHARD = "shard"
REPLICATE = "replicate"
SHARD_NODE = "shard_node"
SHARD_LOCAL = "shard_local"


def init_mesh(
    device_type: str,
    shard_group_size: int,
    node_size: int | None = None,
    replicas_within_node: bool = True,
) -> DeviceMesh:
    """Build the (S, R) mesh ``arange(W).reshape(S, R)`` with dims ("shard", "replicate").

    Replica groups are contiguous ranks (their gradient all-reduce stays on a
    node's fast links); sharding groups are strided. ``replicas_within_node=False``
    turns that around (TorchRec's ``use_inter_host_allreduce``): the mesh is
    ``arange(W).reshape(R, S).T``, sharding groups are contiguous ranks (their
    all-to-alls stay inside a node) and replica groups strided across nodes, for
    models whose lookups move more bytes than their replica syncs. With ``node_size`` the mesh
    itself carries which shard positions share a node: it is a view of a root mesh
    ``arange(W).reshape(S // P, P, R)`` with dims ("shard_node", "shard_local",
    "replicate") whose first two dims are flattened into "shard" (P shard
    positions per node; ``shard_axis`` reads it back), so node-aware specs
    (TableRowWise, Grid) can place tables on those sub-dims.

    Example (W=8)::

        mesh = dtrec.init_mesh("cuda", shard_group_size=4)
        # sharding groups [0,2,4,6], [1,3,5,7]; replica groups [0,1], [2,3], [4,5], [6,7]
        mesh = dtrec.init_mesh("cuda", shard_group_size=4, replicas_within_node=False)
        # sharding groups [0,1,2,3], [4,5,6,7]; replica groups [0,4], [1,5], [2,6], [3,7]
    """
    if not dist.is_initialized():
        raise RuntimeError("init_mesh needs torch.distributed initialised (e.g. under torchrun)")
    world = dist.get_world_size()
    if isinstance(shard_group_size, bool) or not isinstance(shard_group_size, int):
        raise TypeError(f"shard_group_size must be an int, got {shard_group_size!r}")
    if shard_group_size < 1:
        raise ValueError(f"shard_group_size must be >= 1, got {shard_group_size}")
    if world % shard_group_size != 0:
        raise ValueError(
            f"world size {world} is not divisible by shard_group_size {shard_group_size}"
        )
    if not isinstance(replicas_within_node, bool):
        raise TypeError(f"replicas_within_node must be a bool, got {replicas_within_node!r}")
    shards, replicas = shard_group_size, world // shard_group_size
    if replicas_within_node:
        ranks = torch.arange(world).reshape(shards, replicas)
    else:
        ranks = torch.arange(world).reshape(replicas, shards).t().contiguous()
    if node_size is None:
        return DeviceMesh(device_type, ranks, mesh_dim_names=(SHARD, REPLICATE))
    per_node = positions_per_node(world, shards, node_size, replicas_within_node)
    root = DeviceMesh(
        device_type,
        ranks.reshape(shards // per_node, per_node, replicas),
        mesh_dim_names=(SHARD_NODE, SHARD_LOCAL, REPLICATE),
    )
    shard = flatten_mesh_dims(root[SHARD_NODE, SHARD_LOCAL], SHARD)
    return concatenate_meshes([shard, root[REPLICATE]])


def table_mesh(
    world_mesh: DeviceMesh,
    shard: str | tuple[str, ...],
    replicate: str | tuple[str, ...] | None = None,
    pipeline: str | None = None,
) -> DeviceMesh:
    """The tables' ("shard", "replicate") mesh as a view of the user's ``world_mesh``, so the
    tables, FSDP and TP work on meshes of one root (``docs/composing.md``).

    ``shard``: the world mesh dim(s) a table's shards are spread over (several are
    flattened into one, in the world mesh's order); ``replicate``: the dim(s) each shard is
    replicated over (None: no replicas, a size-1 "replicate" dim). Between them they must
    name every dim of ``world_mesh`` larger than 1, each once: tables are sharded over
    the whole world (``distribute_module`` checks that its mesh covers the world). Built
    with DeviceMesh's own flattening and concatenation (no new ranks layout, the world
    mesh's process groups where it has them).

    ``pipeline``: the world mesh's pipeline-parallel dim. The tables then live on this
    rank's pipeline stage only (its slice of the other dims), and ``distribute_module``
    on that stage's module runs every world-wide step (the dense parameters' sync, the
    check that ranks agree) over the stage's ranks, not the whole world
    (``docs/composing.md``, "Pipeline stages"). A ValueError names the dim for an unknown
    dim, a dim given twice, a dim left out, or a dim already called "shard" /
    "replicate" in the world mesh given the other role. Collective (flattening creates
    process groups): every rank calls it alike; call it once per world mesh and layout.

    Example (W=8, the model's MLP under FSDP / TP on the same world mesh)::

        world = init_device_mesh("cuda", (2, 2, 2), mesh_dim_names=("dp_replicate",
                                                                      "dp_shard", "tp"))
        mesh = dtrec.table_mesh(world, shard=("dp_shard", "tp"), replicate="dp_replicate")
        model = dtrec.distribute_module(model, mesh)
    """
    if not isinstance(world_mesh, DeviceMesh) or not world_mesh.mesh_dim_names:
        raise TypeError(f"world_mesh must be a DeviceMesh with dim names, got {world_mesh!r}")
    dims = world_mesh.mesh_dim_names
    roles = {SHARD: _dim_names(shard, SHARD), REPLICATE: _dim_names(replicate, REPLICATE)}
    if not roles[SHARD]:
        raise ValueError(f"table_mesh needs at least one shard dim of {dims}")
    named = roles[SHARD] + roles[REPLICATE]
    for name in named:
        if name not in dims:
            raise ValueError(f"table_mesh: {name!r} is not a dim of the world mesh {dims}")
        if named.count(name) > 1:
            raise ValueError(f"table_mesh: dim {name!r} is given twice (shard and replicate)")
    for role, other in ((SHARD, REPLICATE), (REPLICATE, SHARD)):
        if role in dims and role in roles[other]:
            raise ValueError(
                f"table_mesh: the world mesh's dim {role!r} cannot be the tables' {other!r}"
            )
    if pipeline is not None and (pipeline not in dims or pipeline in named):
        raise ValueError(
            f"table_mesh: pipeline {pipeline!r} must be a dim of the world mesh {dims} "
            "that is neither shard nor replicate"
        )
    left = [
        d for d in dims
        if d not in named and d != pipeline and world_mesh.size(dims.index(d)) > 1
    ]  # fmt: skip
    if left:
        raise ValueError(
            f"table_mesh: world mesh dims {left} are neither shard nor replicate; tables "
            "are sharded over the whole world, so every dim larger than 1 needs a role"
        )
    ordered = {role: tuple(d for d in dims if d in names) for role, names in roles.items()}
    shard_mesh = flatten_mesh_dims(world_mesh[ordered[SHARD]], SHARD)
    if not ordered[REPLICATE]:
        mesh = unflatten_mesh_dim(shard_mesh, SHARD, (shard_mesh.size(), 1), (SHARD, REPLICATE))
    else:
        replicate_mesh = flatten_mesh_dims(world_mesh[ordered[REPLICATE]], REPLICATE)
        mesh = concatenate_meshes([shard_mesh, replicate_mesh])
    if pipeline is not None and mesh.size() < dist.get_world_size():
        stage = tuple(d for d in dims if d in named)
        sub = world_mesh[stage]
        group = (sub if sub.ndim == 1 else flatten_mesh_dims(sub, "_".join(stage))).get_group()
        mesh_cache.get(mesh, (_STAGE,), lambda: group)
    return mesh


_STAGE = "pipeline stage"


def world_group(mesh: DeviceMesh) -> ProcessGroup | None:
    """The group dtrec's world-wide steps of a model on ``mesh`` run over: None (the
    default group) when ``mesh`` covers the world; a pipeline stage's group for a
    ``table_mesh(..., pipeline=...)`` mesh. ValueError for any other mesh of a part of
    the world."""
    if mesh.size() == dist.get_world_size():
        return None
    group = mesh_cache.peek(mesh, (_STAGE,))
    if group is None:
        raise ValueError(
            f"mesh covers {mesh.size()} ranks but the world has {dist.get_world_size()}; "
            "build it with dtrec.init_mesh, or with dtrec.table_mesh from a world mesh "
            "(with pipeline=<dim> for the tables of one pipeline stage)"
        )
    return group


def _dim_names(value: str | tuple[str, ...] | None, role: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TypeError(f"table_mesh: {role} must be a dim name or a tuple of them, got {value!r}")


def positions_per_node(
    world: int, shards: int, node_size: int, replicas_within_node: bool = True
) -> int:
    """How many shard-axis positions one node holds (1 when a replica group spans nodes;
    with replicas across nodes, the positions of one sharding group a node holds)."""
    replicas = world // shards
    if isinstance(node_size, bool) or not isinstance(node_size, int):
        raise TypeError(f"node_size must be an int or None, got {node_size!r}")
    if node_size < 1:
        raise ValueError(f"node_size must be >= 1, got {node_size}")
    if world % node_size != 0:
        raise ValueError(f"world size {world} is not divisible by node_size {node_size}")
    if not replicas_within_node:  # sharding groups are contiguous ranks
        if shards % node_size == 0:
            return node_size
        if node_size % shards == 0:
            return shards
        raise ValueError(
            f"node_size {node_size} and shard_group_size {shards} must divide one another "
            "(with replicas across nodes, a sharding group either fits in a node or spans "
            "whole nodes)"
        )
    if node_size % replicas == 0:
        return node_size // replicas
    if replicas % node_size == 0:
        return 1
    raise ValueError(
        f"node_size {node_size} and replica count {replicas} must divide one another "
        "(a replica group either fits in a node or spans whole nodes)"
    )


@dataclass(frozen=True)
class ShardAxis:
    """What a table spec needs to know about the mesh."""

    size: int
    """S: positions on the "shard" axis."""
    replicas: int
    """R: positions on the "replicate" axis."""
    per_node: int | None
    """Shard positions per node, or None if the mesh was built without node_size."""
    replica_stride: int = 1
    """Rank distance between neighbouring replicas: 1 (replicas within a node, the default
    mesh), S (``init_mesh(..., replicas_within_node=False)``), or 0 for a rank layout that
    is neither (a hand-made mesh: its replica groups are priced as spanning the world)."""

    @property
    def replica_span(self) -> int:
        """Consecutive ranks one replica group spans (what decides its links' bandwidth)."""
        if self.replica_stride == 0:
            return self.size * self.replicas
        return (self.replicas - 1) * self.replica_stride + 1

    def rank_of(self, position: int, replica: int = 0) -> int:
        """The world rank at (position, replica) of an ``init_mesh`` mesh."""
        if self.replica_stride == 1:
            return position * self.replicas + replica
        return replica * self.size + position

    @property
    def nodes(self) -> int | None:
        return None if self.per_node is None else self.size // self.per_node


def shard_axis(mesh: DeviceMesh) -> ShardAxis:
    """Read S, R and the node split off a mesh made by ``init_mesh``."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"expected a DeviceMesh from dtrec.init_mesh, got {type(mesh).__name__}")
    names = mesh.mesh_dim_names
    if names != (SHARD, REPLICATE):
        raise ValueError(
            f"expected a mesh with dims ({SHARD!r}, {REPLICATE!r}) from dtrec.init_mesh, "
            f"got dims {names}"
        )
    root = node_split_mesh(mesh)
    return ShardAxis(
        mesh.size(0), mesh.size(1), None if root is None else root.size(1), _replica_stride(mesh)
    )


def _replica_stride(mesh: DeviceMesh) -> int:
    """``ShardAxis.replica_stride`` of ``mesh``'s rank layout (0: not an ``init_mesh`` one)."""
    ranks = mesh.mesh
    shards, replicas = ranks.shape
    first = int(ranks.min())
    within = torch.arange(shards * replicas).reshape(shards, replicas) + first
    if replicas == 1 or torch.equal(ranks, within):
        return 1
    across = torch.arange(shards * replicas).reshape(replicas, shards).t() + first
    return shards if torch.equal(ranks, across) else 0


def check_one_mesh_family(mesh: DeviceMesh, dense: dict[str, DTensor]) -> None:
    """ValueError naming both meshes when ``mesh`` (the tables') is a view of a user's
    world mesh (``table_mesh``) and a dense parameter in ``dense`` (FQN -> DTensor,
    distributed by ``fully_shard`` / ``parallelize_module`` before ``distribute_module``)
    lies on a mesh of another root: the user asked for one mesh family, and DCP,
    ``clip_grad_norm_`` and the optimizers should see it. A mesh of ``init_mesh`` (its own
    root, dtrec's dim names) is not checked: FSDP and TP then build their own meshes."""
    world = root_mesh(mesh)
    if set(world.mesh_dim_names or ()) & {SHARD, REPLICATE, SHARD_NODE, SHARD_LOCAL}:
        return
    for name, value in dense.items():
        other = root_mesh(value.device_mesh)
        if other is not world:
            raise ValueError(
                f"dense parameter {name!r} is distributed on a mesh with dims "
                f"{value.device_mesh.mesh_dim_names} of the world mesh "
                f"{other.mesh_dim_names} {other.mesh.tolist()}, but the tables' mesh is a "
                f"view of another world mesh {world.mesh_dim_names} {world.mesh.tolist()} "
                "(dtrec.table_mesh): build FSDP's and TP's meshes from that world mesh too "
                "(e.g. fully_shard(..., mesh=world['dp_shard']), docs/composing.md)"
            )


def node_split_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The ("shard_node", "shard_local", "replicate") root ``init_mesh(..., node_size=N)``
    built ``mesh`` from (None for a mesh made without ``node_size``)."""
    root = root_mesh(mesh)
    if root is mesh or root.mesh_dim_names != (SHARD_NODE, SHARD_LOCAL, REPLICATE):
        return None
    return root


def shard_position(mesh: DeviceMesh) -> int | None:
    """This rank's coordinate on the "shard" axis (None if not in the mesh)."""
    coord = mesh.get_coordinate()
    return None if coord is None else coord[0]


class MeshCache:
    """Sub-meshes and process groups made for each parent mesh, alive exactly as long as it.

    Why a cache: a DeviceMesh or process group over some ranks is created collectively
    (and its communicators hold memory), and every table placed on the same positions
    should share one; ``distribute_tensor`` is public and called per table, so there is
    no caller object to hold them. Why keyed on the parent's identity and not on
    DeviceMesh equality or rank lists: two equal meshes from different worlds (e.g. a
    fake world per simulated rank, or a second ``init_process_group``) must not share
    groups. A ``weakref.finalize`` on the parent drops its entry, so an id is never
    looked up after its mesh is gone and nothing leaks.
    """

    def __init__(self) -> None:
        self._by_parent: dict[int, dict[tuple, Any]] = {}

    def get(self, parent: DeviceMesh, key: tuple, make: Callable[[], T]) -> T:
        subs = self._by_parent.get(id(parent))
        if subs is None:
            subs = self._by_parent[id(parent)] = {}
            weakref.finalize(parent, self._by_parent.pop, id(parent), None)
        if key not in subs:
            subs[key] = make()
        return subs[key]

    def peek(self, parent: DeviceMesh, key: tuple) -> Any:
        """What ``get`` made for ``parent`` and ``key``, or None."""
        return self._by_parent.get(id(parent), {}).get(key)


mesh_cache = MeshCache()
"""The one cache of what dtrec builds per mesh (sub-meshes, extra process groups)."""


def positions_mesh(
    mesh: DeviceMesh, positions: tuple[int, ...], shape: tuple[int, ...], names: tuple[str, ...]
) -> DeviceMesh:
    """The mesh of some shard positions (all their replicas), folded into ``shape``.

    All ranks must call this in the same order: it creates process groups.
    The whole shard axis returns ``mesh`` itself (or its node-split root).
    """
    axis = shard_axis(mesh)
    whole = positions == tuple(range(axis.size))
    if whole and names == (SHARD,):
        return mesh
    root = node_split_mesh(mesh)
    if whole and root is not None and names == (SHARD_NODE, SHARD_LOCAL):
        return root

    def make() -> DeviceMesh:
        ranks = mesh.mesh[list(positions)].reshape(*shape, axis.replicas)
        return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=(*names, REPLICATE))

    return mesh_cache.get(mesh, (positions, shape, names), make)


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's tensors on ``mesh`` live on (the current CUDA device on GPU)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)
