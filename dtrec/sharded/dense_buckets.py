"""The dense gradient buckets of ``dtrec.sharded.dense``: which parameters' gradients
travel in one all-reduce, and the flat buffer that carries them."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dtrec._torch_compat import local_block
from dtrec.comm.collectives import PendingTensor

FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20
"""DDP's defaults: the first bucket small, so the first exchange starts early."""


class Bucket:
    """Parameters whose gradients travel in one all-reduce."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)
        self.ready: set[int] = set()
        self.pending: PendingTensor | None = None
        self.missing = False  # whether this rank sent a zero for a parameter without grad
        self._counts: Tensor | None = None  # ones, one per parameter (made once)

    def flat_gradients(self, world: int) -> Tensor:
        """This rank's gradients divided by ``world``, then one 1 per parameter (0 where it
        has no gradient), as one fp32 buffer: what the all-reduce sums."""
        grads = [local_block(p.grad) if p.grad is not None else None for p in self.params]
        self.missing = any(g is None for g in grads)
        like = next((g for g in grads if g is not None), None)
        if like is None:
            like = local_block(self.params[0])
        if self._counts is None or self._counts.device != like.device:
            self._counts = torch.ones(len(self.params), dtype=torch.float32, device=like.device)
        counts = self._counts
        if self.missing:
            counts = torch.tensor([float(g is not None) for g in grads], device=like.device)
        parts = [
            (g if g is not None else like.new_zeros(n)).reshape(-1).float()
            for g, n in zip(grads, self.sizes, strict=True)
        ]
        flat = torch.cat([*parts, counts])
        flat[: self.numel].div_(world)
        return flat


def make_buckets(params: list[nn.Parameter]) -> list[Bucket]:
    """Reverse registration order, DDP's caps, one dtype and device per bucket."""
    out: list[Bucket] = []
    current: list[nn.Parameter] = []
    size, cap = 0, FIRST_BUCKET_BYTES
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and (
            size + nbytes > cap or (p.dtype, p.device) != (current[0].dtype, current[0].device)
        ):
            out.append(Bucket(current))
            current, size, cap = [], 0, BUCKET_BYTES
        current.append(p)
        size += nbytes
    if current:
        out.append(Bucket(current))
    return out
