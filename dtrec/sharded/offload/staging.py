"""Rows a synced update touches that this rank's cache does not hold: staged for the step.

With replicas, a fused update also reaches rows that only another replica's batch read;
an offloaded block may not cache them here. They are copied from host memory into
staging buffers on the device, stepped there, and written back (``RowCache.stage``,
``RowCache.write_back_staged``). Every table's staged rows of one step share one weight
buffer (and one buffer per optimizer state entry, laid out alike), so the backend steps
them in one call as it steps packed tables (on Triton one kernel, tiled as the uncached
step is: ``RowUpdate.tile_dim``), and each row rounds exactly as without the cache.
"""

from __future__ import annotations

import torch

from dtrec.ops.backends.base import RowUpdate
from dtrec.ops.lookup import packed_views
from dtrec.sharded.offload.row_cache import FarRows


def staged_updates(far: list[FarRows]) -> list[RowUpdate]:
    """The step of every table's far rows, in packed staging buffers (module doc); each
    cache writes its rows back after the step (``write_back_staged``)."""
    if not far:
        return []
    first = far[0].cache
    device = first.weight.device
    shapes = [(f.rows.numel(), f.cache.weight.shape[1]) for f in far]
    weights = packed_views(shapes, first.weight.dtype, device)
    states = {
        key: packed_views(
            [(f.rows.numel(), *f.cache.host_state[key].shape[1:]) for f in far],
            value.dtype,
            device,
        )
        for key, value in first.host_state.items()
    }
    updates = []
    for i, f in enumerate(far):
        state = {key: views[i] for key, views in states.items()}
        f.cache.stage(f.rows, weights[i], state)
        scalars = {k: v.clone() for k, v in f.cache.state.items() if k not in state}
        updates.append(
            RowUpdate(
                weights[i],
                {**state, **scalars},  # scalars (Adam's step) stepped alike in this call
                torch.arange(f.rows.numel(), device=device),
                f.grads,
                f.row_sq_sum,
                f.full_dim,
                f.tile_dim,
            )
        )
    return updates
