"""A one-process stand-in for a W-rank world whose every rank feeds the same kind of batch.

torch's fake process group makes every collective a no-op, so an all-to-all returns
whatever its output buffer held and dtrec's input dist, which reads the sizes its peers
send, cannot run on it. The *mirror* process group answers every collective as a world
of identical peers would: each peer sends this rank what this rank sends itself (an
all-to-all fills every received chunk with the chunk this rank keeps, cut or padded to
the size the caller expects), an all-gather returns this rank's input from every
member, an all-reduce leaves the tensor as it is (a MIN or MAX of equal values). That is
exact for every size that depends on the sender's own batch and the plan, and lets the
real ``InputDist``, ``OutputDist``, replica syncs and dense all-reduce run at W = 4096 in
one process, so ``comm_stats()`` records the bytes dtrec would send (benchmarks/scale/run.py).

Meta tensors pass through untouched (only their sizes exist), and outputs above
``FILL_LIMIT`` elements are left unwritten: the simulation never reads them, so the pages
of a multi-GB receive buffer are never touched.

    with mirror_world(rank=0, world_size=4096):
        mesh = dtrec.init_mesh("cpu", 64, node_size=8)
        ...
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.futures import Future

BACKEND = "dtrec_mirror"
FILL_LIMIT = 1 << 22
"""All-to-all outputs with more elements are left as allocated (never read here)."""


class _Done(dist.Work):
    """A collective that completed when it was issued."""

    def __init__(self, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: object = None) -> bool:
        return True

    def get_future(self) -> Future:
        fut: Future = Future()
        fut.set_result(self._result)
        return fut


class MirrorProcessGroup(dist.ProcessGroup):
    """Answers collectives as a world of peers identical to this rank (module docstring)."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:  # DeviceMesh keys its groups by name
        return dist.distributed_c10d._world.pg_names[self]

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        if output.is_meta or input.is_meta or output.numel() > FILL_LIMIT:
            return _Done([output])
        n = self._size
        outs = list(output_splits) or [output.numel() // n] * n
        ins = list(input_splits) or [input.numel() // n] * n
        start = sum(ins[: self._rank])
        own = input.reshape(-1)[start : start + ins[self._rank]]
        flat, at = output.reshape(-1), 0
        for size in outs:
            k = min(size, own.numel())
            flat[at : at + k].copy_(own[:k])
            flat[at + k : at + size].zero_()
            at += size
        return _Done([output])

    def allreduce(self, tensors, opts=None):
        return _Done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return _Done(tensors)

    def _allgather_base(self, output, input, opts=None):
        if not (output.is_meta or input.is_meta):
            output.view(self._size, -1).copy_(input.reshape(1, -1))
        return _Done([output])

    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    def allgather(self, outputs, input, opts=None):
        for out_list, x in zip(outputs, input, strict=True):
            for out in out_list:
                if not (out.is_meta or x.is_meta):
                    out.copy_(x)
        return _Done([t for out_list in outputs for t in out_list])

    def broadcast(self, tensors, opts=None):
        return _Done(tensors)

    def barrier(self, opts=None):
        return _Done([])


def _create(store: object, rank: int, size: int, timeout: object) -> MirrorProcessGroup:
    return MirrorProcessGroup(rank, size)


def register_mirror_backend() -> None:
    """Register the backend with torch.distributed (idempotent)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])


@contextmanager
def mirror_world(rank: int, world_size: int) -> Iterator[None]:
    """Be ``rank`` of a ``world_size`` mirror world for the block (module docstring)."""
    register_mirror_backend()
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
