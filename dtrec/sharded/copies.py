"""``copy.deepcopy`` of a distributed model: its own weights, optimizer state and hooks,
the process groups and device meshes shared.

A copy trains independently of the original (torch's composable DDP refused to be
copied). Communication handles cannot be copied (a ``ProcessGroup`` is a connection; a
copied ``DeviceMesh`` would be a second object for the same ranks, which dtrec's
per-mesh caches would treat as a new mesh), so they are shared: every rank copies the
model in the same order, and the copy's collectives run on the same groups in program
order, like any two models'. What needs more than Python's default is done where it
lives: a sharded collection re-links its tables to the copy of its packed storage
(``ShardedCollection.__deepcopy__``), the dense replication re-registers its gradient
hooks (``ReplicatedDense.__deepcopy__``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

_SHARED = (ProcessGroup, DeviceMesh)
_MISSING = object()


@contextmanager
def sharing_communication() -> Iterator[None]:
    """Inside the block, ``copy.deepcopy`` returns process groups and meshes themselves."""
    saved = [(cls, cls.__dict__.get("__deepcopy__", _MISSING)) for cls in _SHARED]
    for cls in _SHARED:
        cls.__deepcopy__ = _itself  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for cls, old in saved:
            if old is _MISSING:
                del cls.__deepcopy__  # type: ignore[attr-defined]
            else:
                cls.__deepcopy__ = old  # type: ignore[attr-defined]


def _itself(obj: Any, memo: dict[int, Any]) -> Any:
    return obj


def deepcopy_module(module: Any, memo: dict[int, Any]) -> Any:
    """Python's default deepcopy of an ``nn.Module`` (a new object of its class, every
    attribute copied with ``memo``), with communication shared."""
    with sharing_communication():
        new = object.__new__(type(module))
        memo[id(module)] = new
        for key, value in module.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
    return new
