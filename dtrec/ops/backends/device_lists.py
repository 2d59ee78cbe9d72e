"""Small host lists (table offsets, dims, flags, step scalars) as device tensors, without a sync.

A copy from pageable host memory to the GPU waits for the stream to drain, and
a lookup step builds a handful of these lists: each would stall the host behind
the kernels already queued. Lists that repeat every step (they change only when
the tables do) are cached by value; others go through pinned memory.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor


@functools.lru_cache(maxsize=512)
def _cached(values: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    return _copy(values, dtype, device)


def _copy(values: Sequence, dtype: torch.dtype, device: torch.device) -> Tensor:
    if device.type != "cuda":
        return torch.tensor(list(values), dtype=dtype, device=device)
    host = torch.tensor(list(values), dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)


def device_list(
    values: Sequence[int | float | bool],
    dtype: torch.dtype,
    device: torch.device,
    cached: bool = True,
) -> Tensor:
    """``torch.tensor(values)`` on ``device`` without waiting for the device.

    ``cached``: reuse one tensor per distinct (values, dtype, device); callers must
    treat it as read-only. Pass False for values that change every call.
    """
    device = torch.device(device)
    if cached:
        return _cached(tuple(values), dtype, device)
    return _copy(values, dtype, device)


__all__ = ["device_list"]
