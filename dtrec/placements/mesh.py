"""The 2D ("shard", "replicate") device mesh and the facts specs need from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

SHARD = "shard"
REPLICATE = "replicate"
SHARD_NODE = "shard_node"
SHARD_LOCAL = "shard_local"


def init_mesh(device_type: str, shard_group_size: int, node_size: int | None = None) -> DeviceMesh:
    """Build the (S, R) mesh ``arange(W).reshape(S, R)`` with dims ("shard", "replicate").

    Replica groups are contiguous ranks (their gradient all-reduce stays on a
    node's fast links); sharding groups are strided. With ``node_size`` dtrec
    records which shard positions share a node, so node-aware specs
    (TableRowWise, Grid) can place tables on ("shard_node", "shard_local")
    sub-meshes.

    Example (W=8)::

        mesh = dtrec.init_mesh("cuda", shard_group_size=4)
        # sharding groups [0,2,4,6], [1,3,5,7]; replica groups [0,1], [2,3], [4,5], [6,7]
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
    shards = shard_group_size
    per_node = None if node_size is None else positions_per_node(world, shards, node_size)
    mesh = DeviceMesh(
        device_type,
        torch.arange(world).reshape(shards, world // shards),
        mesh_dim_names=(SHARD, REPLICATE),
    )
    if per_node is not None:
        _NODE_SPLITS[id(mesh)] = (mesh, per_node)
    return mesh


# id(mesh) -> (mesh, shard positions per node); holding the mesh keeps its id unique.
_NODE_SPLITS: dict[int, tuple[DeviceMesh, int]] = {}


def positions_per_node(world: int, shards: int, node_size: int) -> int:
    """How many shard-axis positions one node holds (1 when a replica group spans nodes)."""
    replicas = world // shards
    if isinstance(node_size, bool) or not isinstance(node_size, int):
        raise TypeError(f"node_size must be an int or None, got {node_size!r}")
    if node_size < 1:
        raise ValueError(f"node_size must be >= 1, got {node_size}")
    if world % node_size != 0:
        raise ValueError(f"world size {world} is not divisible by node_size {node_size}")
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
    split = _NODE_SPLITS.get(id(mesh))
    return ShardAxis(mesh.size(0), mesh.size(1), None if split is None else split[1])


def shard_position(mesh: DeviceMesh) -> int | None:
    """This rank's coordinate on the "shard" axis (None if not in the mesh)."""
    coord = mesh.get_coordinate()
    return None if coord is None else coord[0]


# key -> (mesh, sub-mesh); holding the mesh keeps its id from being reused.
_SUBMESHES: dict[tuple, tuple[DeviceMesh, DeviceMesh]] = {}


def positions_mesh(
    mesh: DeviceMesh, positions: tuple[int, ...], shape: tuple[int, ...], names: tuple[str, ...]
) -> DeviceMesh:
    """The mesh of some shard positions (all their replicas), folded into ``shape``.

    All ranks must call this in the same order: it creates process groups.
    The whole shard axis returns ``mesh`` itself (or its node-split root).
    """
    axis = shard_axis(mesh)
    if positions == tuple(range(axis.size)) and names == (SHARD,):
        return mesh
    key = (id(mesh), positions, shape, names)
    if key not in _SUBMESHES:
        ranks = mesh.mesh[list(positions)].reshape(*shape, axis.replicas)
        sub = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=(*names, REPLICATE))
        _SUBMESHES[key] = (mesh, sub)
    return _SUBMESHES[key][1]


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's tensors on ``mesh`` live on (the current CUDA device on GPU)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)
