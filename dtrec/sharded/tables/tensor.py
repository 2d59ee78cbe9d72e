"""Turning a spec into a real DTensor, and tensors into and out of a table's blocks:
the one place tables meet DeviceMesh."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import distribute_tensor as _torch_distribute_tensor

from dtrec._torch_compat import (
    contiguous_dtensor,
    is_sharded_tensor,
    local_shape_and_offset,
    picklable_dtensor,
    sharded_tensor_full,
)
from dtrec.comm.collectives import all_gather_sized, all_gather_varied
from dtrec.modules.config import EmbeddingBagConfig
from dtrec.ops.dtensor_bridge import register_dtensor_rules
from dtrec.placements.fully_sharded import replica_slice
from dtrec.placements.layout import Block, TableLayout
from dtrec.placements.mesh import mesh_device, positions_mesh, shard_axis
from dtrec.placements.specs import TableSpec


def rank_block(layout: TableLayout, mesh: DeviceMesh, position: int | None) -> Block | None:
    """This rank's stored part of a table: the block at its shard ``position``, or, fully
    sharded (``layout.replica_sliced``), its replica's owner slice of that block (maybe
    empty rows). None: the table has no block here."""
    block = None if position is None else layout.block_at(position)
    if block is None or not layout.replica_sliced:
        return block
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # a position implies membership
    return replica_slice(block, coordinate[1], mesh.size(1))


def table_mesh(mesh: DeviceMesh, layout: TableLayout) -> DeviceMesh:
    """The (sub-)mesh a table's DTensor lives on. Collective: call on every rank."""
    return positions_mesh(mesh, layout.positions, layout.mesh_shape, layout.mesh_dim_names)


def distribute_tensor(
    weight: Tensor,
    mesh: DeviceMesh,
    spec: TableSpec,
    name: str = "table",
    seed: int | None = 0,
    out: Tensor | None = None,
) -> DTensor:
    """Shard one ``[rows, dim]`` table over a ``dtrec.init_mesh`` mesh per ``spec``.

    The result's ``full_tensor()`` is ``weight`` on every rank that holds part
    of the table; ranks outside a table-wise table's sub-mesh hold an empty
    local tensor. Data comes from each sub-mesh's first rank (like torch's
    ``distribute_tensor``). A ``weight`` on the meta device is not copied: every rank
    creates its own block with ``dtrec.modules.init.table_block`` (default init from ``seed``,
    the same values under any plan), in ``out`` when given (this rank's block shape);
    ``seed=None`` leaves it uninitialised, for a caller that fills every block.
    An offloaded spec (``RowWise(cache_rows=...)``) puts this rank's block in host memory
    (pinned on CUDA), copied from this rank's own ``weight`` (no communication, so the
    table never passes through the device). Collective: call on every rank in the same order.

    Example::

        w = dtrec.distribute_tensor(torch.randn(1000, 64), mesh, dtrec.placements.RowWise())
    """
    if not isinstance(weight, Tensor):
        raise TypeError(f"table {name!r}: expected a 2-D tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"table {name!r}: expected a 2-D weight, got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise TypeError(f"table {name!r}: weight must be floating point, got {weight.dtype}")
    if not isinstance(spec, TableSpec):
        raise TypeError(f"table {name!r}: expected a dtrec.placements spec, got {spec!r}")
    rows, dim = weight.shape
    layout = spec.layout(EmbeddingBagConfig(name, max(rows, 1), dim), shard_axis(mesh))
    if rows == 0:
        raise ValueError(f"table {name!r}: has no rows")
    sub = table_mesh(mesh, layout)
    register_dtensor_rules()  # so dtrec's ops run on the result through DTensor dispatch
    if weight.is_meta or layout.offloaded:  # each rank makes its own block: no full table
        return _init_on_ranks(name, weight, mesh, layout, sub, seed, out)  # anywhere
    with torch.no_grad():
        return _torch_distribute_tensor(weight.detach(), sub, list(layout.placements))


def _init_on_ranks(
    name: str,
    weight: Tensor,
    mesh: DeviceMesh,
    layout: TableLayout,
    sub: DeviceMesh,
    seed: int | None,
    out: Tensor | None,
) -> DTensor:
    from dtrec.modules.init import table_block
    from dtrec.placements.mesh import shard_position
    from dtrec.sharded.offload.host import host_block

    rows, dim = weight.shape
    device = mesh_device(mesh)
    block = rank_block(layout, mesh, shard_position(mesh))
    if block is None:  # no rows here, or an empty block (a column chunk past the last
        shape = (0, dim)  # column): this rank's share of the table, empty
        if sub.get_coordinate() is not None:
            shape = local_shape_and_offset((rows, dim), sub, layout.placements)[0]
        local = torch.empty(shape, dtype=weight.dtype, device=device)
    else:
        if layout.offloaded:  # the block in host memory, never on the device
            out = host_block((block.num_rows, block.num_cols), weight.dtype, device)
        shape = (block.num_rows, block.num_cols)
        if weight.is_meta and seed is None:  # its caller fills it (``dtrec.reshard``)
            local = torch.empty(shape, dtype=weight.dtype, device=device) if out is None else out
        elif weight.is_meta:
            local = table_block(
                name, rows, dim, block.rows, block.cols, seed, weight.dtype, device, out=out
            )
        else:
            assert out is not None
            local = out
            with torch.no_grad():
                local.copy_(
                    weight.detach()[block.rows[0] : block.rows[1], block.cols[0] : block.cols[1]]
                )
    return _wrap(local, sub, layout.placements, (rows, dim))


def _wrap(local: Tensor, mesh: DeviceMesh, placements, shape: tuple[int, ...]) -> DTensor:
    """``local`` as this rank's part of a contiguous DTensor of ``shape``, kept where it is:
    ``DTensor.from_local`` would move a host-memory block (an offloaded table's) to the
    mesh's device."""
    if local.device.type == mesh.device_type or local.is_meta:
        stride = tuple(torch.Size(shape[i + 1 :]).numel() for i in range(len(shape)))
        return DTensor.from_local(
            local, mesh, list(placements), shape=shape, stride=stride, run_check=False
        )
    return contiguous_dtensor(local, mesh, placements, shape)


def state_dtensor(state: Tensor, weight: DTensor, kind: str) -> Tensor:
    """A table's optimizer state tensor as a DTensor placed like ``weight``.

    ``kind`` (``FusedOptimizer.state_layout``): "weight" state has the table's
    placements; "row" state (one value per row) is sharded like the table's rows and
    replicated over column shards (exact row-wise Adagrad keeps it equal there);
    "scalar" state is returned as is.
    """
    if kind == "scalar":
        return state
    if kind == "weight":
        placements, shape = weight.placements, weight.shape
    elif kind == "row":
        placements = tuple(p if p == Shard(0) else Replicate() for p in weight.placements)
        shape = weight.shape[:1]
    else:
        raise ValueError(f"unknown optimizer state kind {kind!r}")
    if weight.device_mesh.get_coordinate() is None:  # holds none of it: empty, right rank
        state = state.new_empty((0,) * len(shape))
    # packed state views (and host-tier blocks) pickle too (torch.save)
    return picklable_dtensor(_wrap(state, weight.device_mesh, placements, tuple(shape)))


def load_block(target: DTensor, value: Tensor, block: Block | None, key: str) -> None:
    """Copy this rank's block of a table-shaped (or row-shaped) ``value`` into ``target``.

    ``value``: a full tensor, a DTensor (same mesh and placements: its local part is
    copied; others: assembled with ``full_tensor``, a collective over the world that every
    rank runs for every table in the same order), or a TorchRec ``ShardedTensor``
    (assembled over its process group, then this rank's block copied). ValueError naming
    ``key`` and both shapes on a shape mismatch.
    """
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"{key}: expected shape {tuple(target.shape)}, got {tuple(value.shape)}")
    local = target.to_local()
    if is_sharded_tensor(value):  # a TorchRec sharded state dict: assembled (collective)
        value = full_tensor(value)
    if isinstance(value, DTensor):
        if value.device_mesh == target.device_mesh and value.placements == target.placements:
            with torch.no_grad():
                local.copy_(value.to_local())
            return
        value = full_tensor(value)  # collective: every rank loads every table in order
    if block is None or not local.numel():
        return
    part = value[block.rows[0] : block.rows[1]]
    if value.dim() == 2:
        part = part[:, block.cols[0] : block.cols[1]]
    with torch.no_grad():
        local.copy_(part)


def full_tensor(value: Tensor) -> Tensor:
    """``value`` as a full CPU tensor on every rank (a DTensor or a TorchRec ShardedTensor
    is assembled).

    Collective for a DTensor or ShardedTensor: call on every rank in the same order. A
    DTensor's blocks (with their offsets) are all-gathered over the world with plain c10d
    all-gathers, never DTensor's functional one, which gloo does not run on CUDA tensors
    (so one-GPU gloo worlds can checkpoint); a ShardedTensor is summed over its own
    process group. Several tensors: ``full_tensors`` (far fewer collectives).
    """
    if is_sharded_tensor(value):
        return sharded_tensor_full(value)
    if not isinstance(value, DTensor):
        return value.detach().cpu().clone()
    if not any(p.is_partial() for p in value.placements):
        return _assembled(value)
    members = sorted(value.device_mesh.mesh.flatten().tolist())
    full = value.full_tensor() if value.device_mesh.get_coordinate() is not None else None
    if len(members) < dist.get_world_size():
        if full is None:
            full = value.to_local().new_empty(value.shape)
        dist.broadcast(full, src=members[0])
    return full.detach().cpu().clone()


def full_tensors(values: Sequence[Tensor]) -> list[Tensor]:
    """``[full_tensor(v) for v in values]`` in a few collectives, not four per DTensor:
    every block's place travels in one all-gather, and the blocks in one per device and
    dtype (more where they pass ``_STREAM_BYTES`` per rank; a block larger than that is
    streamed alone, as ``full_tensor`` does). A model's state dict of hundreds of tables
    and optimizer states is assembled in two or three gathers. Collective: every rank,
    the same list in the same order."""
    out: list[Tensor | None] = [None] * len(values)
    together = []
    for i, value in enumerate(values):
        if isinstance(value, DTensor) and not any(p.is_partial() for p in value.placements):
            together.append(i)
        else:  # plain, partial or ShardedTensor: its own way, in this list's order
            out[i] = full_tensor(value)
    if together:
        for i, full in zip(together, _assembled_together([values[i] for i in together])):
            out[i] = full
    return out  # type: ignore[return-value]


def _own_block(value: DTensor) -> tuple[Tensor, list[int], list[int]] | None:
    """This rank's block of ``value`` with its shape and offset, or None where the rank
    sends nothing: not a member, empty, or a copy replicated over a mesh dim other than
    the one at coordinate 0 there (the copies should agree, and where one does not it
    must not win by rank order: a column-wise table with fewer columns than shards leaves
    its last ranks without a column block; their copy of row-wise Adagrad's replicated row
    sums is never updated, and as the last writer it zeroed every rank's full tensor;
    found by the soak)."""
    coordinate = value.device_mesh.get_coordinate()
    if coordinate is None or any(
        c != 0 for c, p in zip(coordinate, value.placements, strict=True) if p.is_replicate()
    ):
        return None
    local = value.to_local().detach()
    if local.numel() == 0:
        return None
    shape, offset = local_shape_and_offset(value.shape, value.device_mesh, value.placements)
    return local, list(shape), list(offset)


def _put(full: Tensor, block: Tensor, shape: list[int], offset: list[int]) -> None:
    """``block`` (flat, ``shape``'s rows from its first) into ``full`` at ``offset``."""
    if not full.dim():
        full.copy_(block.view(()).cpu())
        return
    rows = block.numel() // max(1, math.prod(shape[1:]))
    size = [rows, *shape[1:]]
    full[tuple(slice(o, o + k) for o, k in zip(offset, size, strict=True))] = block.view(size).cpu()


_STREAM_BYTES = 64 << 20
"""Most bytes of rows one rank sends per round of ``_assembled`` (a larger tensor is
gathered in rounds of rows: a huge offloaded table never lands whole on the device)."""


def _assembled(value: DTensor) -> Tensor:
    """``value``'s blocks gathered from every rank and put at their offsets (CPU).

    A block in host memory (an offloaded table's) travels through the mesh's device,
    where the process group's collectives run (NCCL takes no CPU tensors), by rounds of
    at most ``_STREAM_BYTES`` of rows per rank, so the device never holds a whole huge
    block (nor the world's blocks of one round more than once). A block replicated over
    mesh dims comes from the rank at coordinate 0 of them only (``_own_block``)."""
    device = mesh_device(value.device_mesh)
    own = _own_block(value)
    n = value.dim()
    meta = [] if own is None else [1, *own[1], *own[2]]  # the 1: a 0-dim block is sent too
    metas = all_gather_varied(torch.tensor(meta, dtype=torch.long, device=device), None,
                              "full_tensor.meta")  # fmt: skip
    full = torch.zeros(tuple(value.shape), dtype=value.dtype)
    placed = [(m[1 : n + 1].tolist(), m[n + 1 :].tolist()) if m.numel() else None for m in metas]
    row = max(1, math.prod(value.shape[1:])) * value.element_size()
    step = max(1, _STREAM_BYTES // row) if n else 1
    rounds = max([math.ceil(p[0][0] / step) for p in placed if p is not None and n] or [1])
    for i in range(max(rounds, 1)):
        if own is None:
            data = value.to_local().new_empty(0, device=device)
        else:
            data = (own[0][i * step : (i + 1) * step] if n else own[0]).reshape(-1).to(device)
        blocks = all_gather_varied(data, None, "full_tensor")
        for where_r, block in zip(placed, blocks, strict=True):
            if where_r is not None and block.numel():
                shape_r, offset_r = where_r
                _put(full, block, shape_r, [offset_r[0] + i * step, *offset_r[1:]] if n else [])
    return full


def _assembled_together(values: list[DTensor]) -> list[Tensor]:
    """``_assembled`` of each of ``values`` (DTensors without partial placements), their
    blocks gathered together (``full_tensors``)."""
    device = mesh_device(values[0].device_mesh)
    owns = [_own_block(v) for v in values]
    meta = []  # per tensor: sends?, its block's shape, its offset (a fixed length each)
    for value, own in zip(values, owns, strict=True):
        meta += [0] * (1 + 2 * value.dim()) if own is None else [1, *own[1], *own[2]]
    world = dist.get_world_size()
    metas = all_gather_sized(
        torch.tensor(meta, dtype=torch.long, device=device), [len(meta)] * world, None,
        "full_tensor.meta",
    )  # fmt: skip
    places: list[list[tuple[list[int], list[int]] | None]] = []  # [rank][tensor]
    for m in (m.tolist() for m in metas):
        at, per_rank = 0, []
        for value in values:
            n = value.dim()
            per_rank.append(
                (m[at + 1 : at + 1 + n], m[at + 1 + n : at + 1 + 2 * n]) if m[at] else None
            )
            at += 1 + 2 * n
        places.append(per_rank)
    fulls = [torch.zeros(tuple(v.shape), dtype=v.dtype) for v in values]
    counts = [
        [0 if p[j] is None else math.prod(p[j][0]) for j in range(len(values))] for p in places
    ]
    rounds: dict[tuple[torch.dtype, torch.device], list[list[int]]] = {}
    for j, value in enumerate(values):
        largest = max(c[j] for c in counts) * value.element_size()
        if largest > _STREAM_BYTES:  # streamed by rows on its own, in this list's order
            fulls[j] = _assembled(value)
            continue
        same = rounds.setdefault((value.dtype, mesh_device(value.device_mesh)), [[]])
        bytes_now = max(sum(c[k] for k in same[-1]) for c in counts) * value.element_size()
        if bytes_now + largest > _STREAM_BYTES:  # a new round
            same.append([])
        same[-1].append(j)
    me = dist.get_rank()
    for (dtype, dev), groups in rounds.items():
        for group in groups:
            mine = [owns[j][0].reshape(-1).to(dev) for j in group if owns[j] is not None]
            data = torch.cat(mine) if mine else torch.empty(0, dtype=dtype, device=dev)
            sizes = [sum(c[j] for j in group) for c in counts]
            assert data.numel() == sizes[me]
            for r, gathered in enumerate(all_gather_sized(data, sizes, None, "full_tensor")):
                for j, block in zip(group, gathered.split([counts[r][j] for j in group])):
                    if places[r][j] is not None:
                        _put(fulls[j], block, *places[r][j])
    return fulls


def like_dtensor(local: Tensor, like: DTensor) -> DTensor:
    """``local`` as this rank's part of a DTensor placed and shaped like ``like`` (no copy)."""
    if local.device.type != like.device_mesh.device_type:  # a host block stays in host memory
        return _wrap(local, like.device_mesh, like.placements, tuple(like.shape))
    return DTensor.from_local(
        local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride(),
        run_check=False,
    )  # fmt: skip
