"""Building a collection's offloaded tables: host-tier state, caches, the verdict group."""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from dtrec.ops.lookup import shared_storage
from dtrec.optim import FusedOptimizer
from dtrec.placements import TableLayout
from dtrec.placements.mesh import mesh_device
from dtrec.sharded.dist.groups import world_group
from dtrec.sharded.offload.host import CopyJobs, CopyStream, host_block
from dtrec.sharded.offload.row_cache import RowCache
from dtrec.sharded.offload.tables import OffloadedTables
from dtrec.sharded.tables.tensor import like_dtensor
from dtrec.sharded.update.fused_update import FusedUpdater


def offload_tables(
    names: list[str],
    layouts: list[TableLayout],
    stored: nn.ModuleDict,
    local_tables: list[int],
    updater: FusedUpdater | None,
    mesh: DeviceMesh,
    sync_every: int | None,
    slice_starts: dict[int, int] | None = None,
) -> OffloadedTables | None:
    """The collection's ``OffloadedTables`` (None when no table is offloaded), its caches
    hooked into ``updater``. Collective when some cache can overflow (the verdict group):
    every rank calls it with the same layouts. ``slice_starts``: fully sharded local
    tables -> the shard row where this rank's owner slice (its host block) starts."""
    offloaded = [name for name, layout in zip(names, layouts, strict=True) if layout.offloaded]
    if not offloaded:
        return None
    if sync_every is not None:
        raise ValueError(
            f"tables {offloaded} are offloaded: they train with the exact per-step replica "
            f"sync only, not sync_every={sync_every} (averaging replicas' host tables would "
            "stream them through the device); drop sync_every or the tables' cache option"
        )
    device = mesh_device(mesh)
    jobs = CopyJobs(CopyStream(device))
    mine = [t for t in local_tables if layouts[t].offloaded]
    pack_host_blocks([stored[names[t]] for t in mine], device)
    optimizer = updater.optimizer if updater is not None else None
    states = host_states(optimizer, [stored[names[t]].weight.to_local() for t in mine], device)
    caches = {}
    for t, host_state in zip(mine, states, strict=True):
        table = stored[names[t]]
        host = table.weight.to_local()
        state = updater.state[t] if updater is not None else {}
        caches[t] = RowCache(names[t], host, host_state, table.cache, state, jobs.copies)
        caches[t].slice_start = (slice_starts or {}).get(t)
        if updater is not None:
            updater.tables[t].cache = caches[t]
    can_overflow = any(  # a fully sharded table's cache may be smaller than its slice
        rows < block.num_rows or layout.replica_sliced
        for layout in layouts
        for block, rows in zip(layout.blocks, layout.cache_rows, strict=False)
    )
    group = world_group(mesh) if can_overflow else None
    tables = OffloadedTables(
        caches, jobs, group, device, updater is not None, offloaded, len(names)
    )
    if updater is not None:
        updater.offload = tables
    return tables


def pack_host_blocks(tables: list[nn.Module], device: torch.device) -> None:
    """Make these offloaded tables' host blocks views of one host buffer (each weight a
    DTensor around its view), so a fill copies the rows of every table with one gather
    and one scatter (``group.py``). Blocks already packed stay; else each is copied once
    (the host tier briefly twice)."""
    blocks = [table.weight.to_local() for table in tables]
    if not blocks or shared_storage(blocks) is not None:
        return
    views = host_views([tuple(b.shape) for b in blocks], blocks[0].dtype, device)
    for table, block, view in zip(tables, blocks, views, strict=True):
        with torch.no_grad():
            view.copy_(block)
        old = table.weight
        table.weight = nn.Parameter(like_dtensor(view, old), requires_grad=old.requires_grad)


def host_views(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device):
    """Contiguous views of one new host-tier buffer (``host_block``), one per shape."""
    sizes = [math.prod(shape) for shape in shapes]
    flat = host_block((max(sum(sizes), 1),), dtype, device)
    starts = [0, *itertools.accumulate(sizes)]
    return [flat[a : a + n].view(shape) for a, n, shape in zip(starts, sizes, shapes, strict=False)]


def host_states(
    optimizer: FusedOptimizer | None, hosts: list[Tensor], device: torch.device
) -> list[dict[str, Tensor]]:
    """Per block: the optimizer state entries with one value per row of the block (row- or
    weight-shaped), zero, in the host tier (each entry of every block a view of one
    buffer); per-table scalars stay with the cache's state."""
    if optimizer is None or not hosts:
        return [{} for _ in hosts]
    probes = [
        optimizer.init_state(torch.empty(tuple(h.shape), dtype=h.dtype, device="meta"))
        for h in hosts
    ]
    out: list[dict[str, Tensor]] = [{} for _ in hosts]
    for key, value in probes[0].items():
        if value.dim() == 0:
            continue
        views = host_views([tuple(p[key].shape) for p in probes], value.dtype, device)
        for entry, view in zip(out, views, strict=True):
            entry[key] = view.zero_()
    return out
