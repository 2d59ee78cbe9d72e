"""Storage: a collection's tables as DTensor parameters, this rank's shards packed.

Each table is a ``ShardedTable`` holding its DTensor weight
(``embedding_bags.<t>.weight``, the unsharded model's key). This rank's shards
live in one flat buffer, each weight a view of it, so a lookup reads every
local table with one kernel launch and in-place updates write through the views.
Fused optimizer state is kept alongside (``FusedUpdater.state``) and shown to
checkpoints as DTensors placed like its table.

An offloaded table (``dtrec.placements.offload``) keeps its block in host memory (its
DTensor's local tensor); what the flat device buffer holds for it is its device cache
(``ShardedTable.cache``, managed by ``dtrec.sharded.offload``).
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from dtrec._torch_compat import local_block, picklable_dtensor
from dtrec.modules.config import EmbeddingBagConfig
from dtrec.ops.lookup import packed_views, shared_storage
from dtrec.placements import TableLayout, TableSpec
from dtrec.placements.layout import Block
from dtrec.placements.mesh import mesh_device
from dtrec.sharded.tables.tensor import (
    distribute_tensor,
    like_dtensor,
    load_block,
    rank_block,
    state_dtensor,
)


class ShardedTable(nn.Module):
    """Holds one table's weight as a DTensor parameter (``embedding_bags.<t>.weight``).

    ``load_state_dict`` takes the weight as a full tensor (e.g. from the unsharded
    model) or as a DTensor of any placements, and copies this rank's block in place.
    ``state_dict`` values are DTensors around the live block (a view of the packed
    buffer) that ``torch.save`` pickles (``picklable_dtensor``).
    """

    def __init__(
        self, weight: nn.Parameter, spec: TableSpec, layout: TableLayout, block: Block | None
    ) -> None:
        super().__init__()
        self.weight = weight
        self.spec = spec
        self.layout = layout
        self.block = block  # this rank's block, or owner slice when fully sharded (None:
        # the table has none here)
        self.cache: Tensor | None = None
        """Offloaded (``layout.offloaded``): the device cache of this rank's block, whose
        rows all live in ``weight`` in host memory. None: the block is on the device."""

    def device_rows(self) -> Tensor:
        """What lookups read on the device: the local block, or an offloaded one's cache.
        Through ``to_local()`` (autograd's way to the DTensor's gradient) only when the
        table trains by autograd; a fused optimizer's table needs no node (one fewer
        DTensor dispatch per table per step)."""
        if self.cache is not None:
            return self.cache
        weight = self.weight
        if weight.requires_grad and torch.is_grad_enabled():
            return weight.to_local()
        return local_block(weight)

    def extra_repr(self) -> str:
        return f"spec={self.spec!r}"

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        key = prefix + "weight"
        if not keep_vars:  # a view of the packed buffer: make it pickle (torch.save)
            destination[key] = picklable_dtensor(destination[key])

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
            return
        try:
            load_block(self.weight, state_dict[key], self.block, key)
        except ValueError as exc:
            errors.append(str(exc))


def shard_tables(
    tables: list[EmbeddingBagConfig],
    weights: dict[str, Tensor],
    mesh: DeviceMesh,
    specs: dict[str, TableSpec],
    layouts: list[TableLayout],
    position: int,
    init_seed: int | None,
    requires_grad: bool,
) -> nn.ModuleDict:
    """Table name -> ``ShardedTable``, each weight distributed per its spec."""
    into = _packed_meta_blocks(tables, weights, specs, layouts, position, mesh)
    out = nn.ModuleDict()
    for cfg, layout in zip(tables, layouts, strict=True):
        target = None if layout.offloaded else into.get(cfg.name)  # offloaded: a host block
        dtensor = distribute_tensor(
            weights[cfg.name], mesh, specs[cfg.name], cfg.name, init_seed, target
        )
        block = rank_block(layout, mesh, position)
        if block is not None and tuple(dtensor.to_local().shape) != (
            block.num_rows,
            block.num_cols,
        ):
            raise AssertionError(
                f"table {cfg.name!r}: local shard {tuple(dtensor.to_local().shape)} does not "
                f"match its block {block}"
            )
        out[cfg.name] = ShardedTable(
            nn.Parameter(dtensor, requires_grad=requires_grad), specs[cfg.name], layout, block
        )
        cache_rows = cache_rows_here(layout, specs[cfg.name], position, block)
        if block is not None and cache_rows is not None:  # its cache: packed with the blocks
            out[cfg.name].cache = into.get(cfg.name, None)
            if out[cfg.name].cache is None:
                out[cfg.name].cache = torch.zeros(
                    cache_rows, block.num_cols, dtype=dtensor.dtype, device=mesh_device(mesh)
                )
    return out


def _packed_meta_blocks(
    tables: list[EmbeddingBagConfig],
    weights: dict[str, Tensor],
    specs: dict[str, TableSpec],
    layouts: list[TableLayout],
    position: int,
    mesh: DeviceMesh,
) -> dict[str, Tensor]:
    """For meta-device tables: this rank's blocks (an offloaded table's: its device cache)
    as views of one new flat buffer, to be initialised in place (already packed: no second
    copy of the shards)."""
    if not tables or not all(weights[cfg.name].is_meta for cfg in tables):
        return {}
    dtype = weights[tables[0].name].dtype
    shapes = {}
    for cfg, layout in zip(tables, layouts, strict=True):
        block = rank_block(layout, mesh, position)
        if block is not None:
            cache = cache_rows_here(layout, specs[cfg.name], position, block)
            shapes[cfg.name] = (block.num_rows if cache is None else cache, block.num_cols)
    views = packed_views(list(shapes.values()), dtype, mesh_device(mesh))
    return dict(zip(shapes, views, strict=True))


def cache_rows_here(
    layout: TableLayout, spec: TableSpec, position: int, block: Block | None
) -> int | None:
    """Device cache rows of this rank's stored ``block`` of an offloaded table (None: on
    the device): the layout's per block, or, fully sharded, the spec's cache option
    applied to this replica's owner slice (``block``), which is its host block."""
    if block is None or not layout.offloaded:
        return None
    if layout.replica_sliced:
        return spec.cache_capacity(block.num_rows)  # type: ignore[attr-defined]
    return layout.cache_rows_at(position)


def pack_local_shards(tables: list[ShardedTable]) -> None:
    """Put these tables' local shards in one flat buffer, each parameter a view of it.

    Lookup kernels then read every local table in place with one launch
    (no per-call packing copy); in-place optimizer updates and
    ``load_state_dict`` keep writing through the views. An offloaded table's device
    cache is packed in its place (its block stays in host memory).
    """
    locals_ = [table.device_rows() for table in tables]
    if len(locals_) < 2:
        return
    shared = shared_storage(locals_)
    if shared is not None and shared[1] == list(
        itertools.accumulate((w.numel() for w in locals_[:-1]), initial=locals_[0].storage_offset())
    ):
        return  # already one buffer, in order (meta-device tables are made that way)
    views = packed_views([w.shape for w in locals_], locals_[0].dtype, locals_[0].device)
    for table, local, view in zip(tables, locals_, views, strict=True):
        with torch.no_grad():  # the views become new leaf parameters below
            view.copy_(local)
        if table.cache is not None:
            table.cache = view
            continue
        old = table.weight
        table.weight = nn.Parameter(like_dtensor(view, old), requires_grad=old.requires_grad)


def state_dtensors(
    states: dict[str, dict[str, Tensor]], tables: nn.ModuleDict, kinds: dict[str, str]
) -> dict[str, dict[str, Tensor]]:
    """Table name -> its fused optimizer state as DTensors placed like the table.

    ``kinds``: ``FusedOptimizer.state_layout()``. The DTensors wrap the live state:
    loading into them writes the optimizer's own buffers.
    """
    return {
        name: {k: state_dtensor(v, tables[name].weight, kinds[k]) for k, v in state.items()}
        for name, state in states.items()
    }
