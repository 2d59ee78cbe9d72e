"""Single-process simulation of any rank of a large world (torch's fake process group)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """Be ``rank`` of ``world_size`` for the block; collectives are no-ops."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
