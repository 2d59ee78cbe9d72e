"""Process groups dtrec needs beyond the mesh's own dims.

Every function here creates groups collectively: all ranks must call it with
the same arguments in the same order (they do: plans are identical on all
ranks). Groups are cached per mesh (``dtrec.placements.mesh.mesh_cache``), so a
second world never gets a group of the first one back.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dtrec.placements import TableLayout
from dtrec.placements.mesh import mesh_cache


def _group(mesh: DeviceMesh, ranks: list[int]) -> dist.ProcessGroup:
    """The process group over ``ranks`` made for ``mesh`` (created once). Collective: every
    rank calls it in the same order."""
    return mesh_cache.get(mesh, ("group", tuple(ranks)), lambda: dist.new_group(list(ranks)))


def world_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """A group over all mesh ranks, separate from the default one DDP reduces on."""
    return _group(mesh, sorted(mesh.mesh.flatten().tolist()))


def column_groups(
    mesh: DeviceMesh, layouts: dict[int, TableLayout], position: int
) -> dict[int, dist.ProcessGroup]:
    """Per table: the group of this rank's column-shard peers (same rows, other columns).

    ``layouts``: the routed tables' layouts by table index (a data-parallel table's
    full copies are not column shards of one another).
    """
    coord = mesh.get_coordinate()
    assert coord is not None
    out: dict[int, dist.ProcessGroup] = {}
    for t, layout in sorted(layouts.items()):
        by_rows: dict[tuple[int, int], list[int]] = {}
        for block in layout.blocks:
            by_rows.setdefault(block.rows, []).append(block.position)
        for _, positions in sorted(by_rows.items()):
            if len(positions) < 2:
                continue
            for c in range(mesh.size(1)):
                group = _group(mesh, [int(mesh.mesh[p, c]) for p in positions])
                if position in positions and c == coord[1]:
                    out[t] = group
    return out
