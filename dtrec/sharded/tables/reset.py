"""Resetting given rows of a sharded table in place: weights and fused optimizer state.

A managed-collision table reassigns rows whose id was evicted; every rank learns the
same global row ids and resets those it holds (its block's rows and columns), so all
replicas and the unsharded table agree. Runs at eviction steps only: the boolean mask
below is a host sync there, nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dtrec.optim import FusedOptimizer
from dtrec.placements.layout import Block

RowValues = Callable[[Tensor, tuple[int, int]], Tensor]
"""(global rows, column range) -> the new values of those rows' columns."""


@torch.no_grad()
def reset_block_rows(
    local: Tensor,
    block: Block | None,
    rows: Tensor,
    values: RowValues,
    optimizer: FusedOptimizer | None = None,
    state: dict[str, Tensor] | None = None,
) -> None:
    """Write ``values`` into the rows of ``rows`` that ``block`` (stored as ``local``)
    holds, and reset their fused optimizer ``state`` (``FusedOptimizer.reset_rows``)."""
    if block is None or rows.numel() == 0:
        return
    (r0, r1), cols = block.rows, block.cols
    mine = rows[(rows >= r0) & (rows < r1)]
    if mine.numel() == 0:
        return
    local_rows = (mine - r0).to(local.device)
    local[local_rows] = values(mine, cols).to(device=local.device, dtype=local.dtype)
    if optimizer is not None and state is not None:
        optimizer.reset_rows(local, state, local_rows)


__all__ = ["RowValues", "reset_block_rows"]
