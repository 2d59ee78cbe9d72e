"""Building a collection's offloaded tables: host-tier state, caches, the verdict group."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from dtrec.optim import FusedOptimizer
from dtrec.placements import TableLayout
from dtrec.placements.mesh import mesh_device
from dtrec.sharded.fused_update import FusedUpdater
from dtrec.sharded.groups import world_group
from dtrec.sharded.offload.host import CopyJobs, CopyStream, host_block
from dtrec.sharded.offload.row_cache import RowCache
from dtrec.sharded.offload.tables import OffloadedTables


def offload_tables(
    names: list[str],
    layouts: list[TableLayout],
    stored: nn.ModuleDict,
    local_tables: list[int],
    updater: FusedUpdater | None,
    mesh: DeviceMesh,
    sync_every: int | None,
) -> OffloadedTables | None:
    """The collection's ``OffloadedTables`` (None when no table is offloaded), its caches
    hooked into ``updater``. Collective when some cache can overflow (the verdict group):
    every rank calls it with the same layouts."""
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
    caches = {}
    for t in local_tables:
        if not layouts[t].offloaded:
            continue
        table = stored[names[t]]
        host = table.weight.to_local()
        state = updater.state[t] if updater is not None else {}
        optimizer = updater.optimizer if updater is not None else None
        caches[t] = RowCache(
            names[t], host, host_state(optimizer, host, device), table.cache, state, jobs.copies
        )
        if updater is not None:
            updater.tables[t].cache = caches[t]
    can_overflow = any(
        rows < block.num_rows
        for layout in layouts
        for block, rows in zip(layout.blocks, layout.cache_rows, strict=False)
    )
    group = world_group(mesh) if can_overflow else None
    tables = OffloadedTables(caches, jobs, group, device, updater is not None, offloaded)
    if updater is not None:
        updater.offload = tables
    return tables


def host_state(
    optimizer: FusedOptimizer | None, host: Tensor, device: torch.device
) -> dict[str, Tensor]:
    """The optimizer state entries with one value per row of the block (row- or
    weight-shaped), zero, in the host tier; per-table scalars stay with the cache's state."""
    if optimizer is None:
        return {}
    probe = optimizer.init_state(torch.empty(tuple(host.shape), dtype=host.dtype, device="meta"))
    return {
        k: host_block(tuple(v.shape), v.dtype, device).zero_()
        for k, v in probe.items()
        if v.dim() > 0
    }
