"""Quantized collectives: floats sent in fp16 / bf16, added up in the receiver's dtype.

A ``Codec`` says how one exchange sends its floats: multiplied by an optional loss
scale, cast to the wire dtype, sent, cast back to the dtype they had and divided by the
scale. Every sum happens after that cast back (fp32 accumulation), so each value
crossing the wire carries exactly one rounding to the wire format: a relative error of
at most ``Codec.unit_roundoff`` (2^-8 for bf16, 2^-11 for fp16) while it stays in the
format's normal range (fp16 flushes magnitudes under ~6e-5 to subnormals and overflows
above 65504; the loss scale moves small gradients into range).

The byte counts in ``dtrec.comm_stats`` are those of the wire dtype, so a bf16 / fp16
exchange counts half the bytes of its fp32 twin.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from dtrec.comm.collectives import all_gather_flat, all_to_all, collective

WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
"""The precisions a quantized exchange may send, by name."""


@dataclass(frozen=True)
class Codec:
    """How one exchange sends floats: ``dtype`` on the wire, after ``* scale``."""

    dtype: torch.dtype
    """The wire dtype (fp16 or bf16)."""
    scale: float | None = None
    """Loss scale: multiplied in before the cast, divided out after it (None: 1)."""

    @property
    def unit_roundoff(self) -> float:
        """Largest relative error of one cast to ``dtype`` (round to nearest), normal range."""
        return torch.finfo(self.dtype).eps / 2

    def encode(self, x: Tensor) -> Tensor:
        """``x`` as sent: scaled, cast to the wire dtype."""
        if self.scale is not None:
            x = x * self.scale
        return x.to(self.dtype)

    def decode(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        """Received wire values back in ``dtype``, unscaled."""
        x = x.to(dtype)
        return x if self.scale is None else x / self.scale


class _QuantizedAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, output_splits, input_splits, group, kind, fwd, bwd):  # type: ignore[override]
        ctx.splits, ctx.group, ctx.kind, ctx.codec = (output_splits, input_splits), group, kind, bwd
        sent = input if fwd is None else fwd.encode(input)
        received = all_to_all(sent, output_splits, input_splits, group, kind)
        return received if fwd is None else fwd.decode(received, input.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        output_splits, input_splits = ctx.splits
        codec, kind = ctx.codec, ctx.kind + ".backward"
        sent = grad if codec is None else codec.encode(grad)
        received = all_to_all(sent, input_splits, output_splits, ctx.group, kind)
        grad_in = received if codec is None else codec.decode(received, grad.dtype)
        return grad_in, None, None, None, None, None, None


def quantized_all_to_all(
    input: Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    group: ProcessGroup,
    kind: str,
    forward: Codec | None,
    backward: Codec | None,
) -> Tensor:
    """Differentiable uneven all-to-all sending ``forward``'s dtype, its gradient ``backward``'s.

    Received values are cast back to ``input``'s dtype (the gradient to the output
    gradient's) before anyone adds them up; None sends a direction as it is. Like
    ``all_to_all_autograd``, the backward runs on every rank, even one that sends nothing.

    Example::

        out = quantized_all_to_all(x, [4, 4], [4, 4], group, "output_dist",
                                   Codec(torch.bfloat16), Codec(torch.float16, scale=1024.0))
    """
    if torch.is_grad_enabled() and not input.requires_grad:
        input = input.detach().requires_grad_()
    return _QuantizedAllToAll.apply(
        input, list(output_splits), list(input_splits), group, kind, forward, backward
    )


def sum_quantized(flat: Tensor, group: ProcessGroup, kind: str, dtype: torch.dtype) -> Tensor:
    """Elementwise sum of fp32 ``flat`` over ``group``, sent in ``dtype``, added in fp32.

    A reduce-scatter done as an all-to-all of ``dtype`` chunks, each member adding its
    chunk's pieces in fp32, then an all-gather of the sums cast to ``dtype``: the bytes of
    a ring all-reduce in ``dtype`` (half an fp32 one), two calls, and every element
    rounded twice (the addends, then the sum). Every member ends with identical values.
    """
    size = dist.get_world_size(group)
    chunk = math.ceil(flat.numel() / size)
    padded = torch.zeros(size * chunk, dtype=dtype, device=flat.device)
    padded[: flat.numel()] = flat
    pieces = all_to_all(padded, [chunk] * size, [chunk] * size, group, kind)
    mine = pieces.view(size, chunk).float().sum(0).to(dtype)
    summed = torch.empty(size * chunk, dtype=dtype, device=flat.device)
    with collective(kind, (size - 1) * chunk * summed.element_size(), group):
        all_gather_flat(summed, mine, group)
    return summed[: flat.numel()].float()


__all__ = ["WIRE_DTYPES", "Codec", "quantized_all_to_all", "sum_quantized"]
