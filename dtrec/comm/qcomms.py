"""``QCommsConfig``: which of a collection's exchanges travel in fp16 / bf16 (opt-in).

TorchRec's ``QCommsConfig`` (``torchrec.distributed.fbgemm_qcomm_codec``) is the model:
the forward pooled-embedding exchange and its gradient may each travel in a narrower
float; dtrec adds the replicate-axis gradient sum of 2D meshes. Receivers always add
up in fp32 (``dtrec.comm.quantized``), so the error is one rounding per value sent.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from dtrec.comm.quantized import WIRE_DTYPES, Codec

PRECISIONS = ("fp32", *WIRE_DTYPES)
"""The precision names a field takes; "fp32" sends values as they are."""

_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class QCommsConfig:
    """Precisions of a sharded collection's float exchanges (``distribute_module(qcomms=)``).

    Error bound, per value sent (u = 2^-8 for "bf16", 2^-11 for "fp16", in the format's
    normal range): a received pooled partial or gradient element is within u of the fp32
    value, relatively; sums are taken in fp32 after the cast back, so a row-wise output
    (a sum of partials p_i) is within u * sum |p_i|. The replicate-axis sum adds u per
    member's gradient row on its sparse path (row all-gather) and 2u on its dense path
    (the sum is rounded once more before it is shared). See docs/qcomms.md
    for what that means for weights after N steps.

    Example::

        model = dtrec.distribute_module(
            model, mesh, optimizer=dtrec.optim.RowWiseAdagrad(lr=0.1),
            qcomms=dtrec.QCommsConfig(forward_precision="bf16", backward_precision="fp16",
                                      backward_loss_scale=1024.0),
        )
    """

    forward_precision: str = "fp32"
    """Dtype the forward output dist sends pooled partials in: "fp32", "fp16" or "bf16"."""
    backward_precision: str = "fp32"
    """Dtype the output dist's backward sends output gradients in."""
    replica_sync_precision: str = "fp32"
    """Dtype of the replicate-axis gradient sum of sharded tables (2D meshes)."""
    forward_loss_scale: float | None = None
    """Factor the forward partials are multiplied by before the cast and divided by after
    it (None: none); only with a quantized ``forward_precision``."""
    backward_loss_scale: float | None = None
    """The same for gradients: the output gradient exchange and the replica sum, so fp16
    gradients do not underflow (a power of two keeps the scaling itself exact)."""

    def __post_init__(self) -> None:
        for name in ("forward_precision", "backward_precision", "replica_sync_precision"):
            object.__setattr__(self, name, _precision_name(name, getattr(self, name)))
        for name, applies_to in (
            ("forward_loss_scale", ("forward_precision",)),
            ("backward_loss_scale", ("backward_precision", "replica_sync_precision")),
        ):
            scale = getattr(self, name)
            if scale is None:
                continue
            if (
                isinstance(scale, bool)
                or not isinstance(scale, numbers.Real)
                or not math.isfinite(scale)
                or scale <= 0
            ):
                raise ValueError(f"{name} must be a positive finite number or None, got {scale!r}")
            object.__setattr__(self, name, float(scale))
            if all(getattr(self, p) == "fp32" for p in applies_to):
                given = ", ".join(f"{p}={getattr(self, p)!r}" for p in applies_to)
                raise ValueError(
                    f"{name} scales values sent in fp16 or bf16, but {given}: set a quantized "
                    f"precision or drop the scale"
                )

    @property
    def forward_codec(self) -> Codec | None:
        """How the forward output dist sends (None: as it is)."""
        return _codec(self.forward_precision, self.forward_loss_scale)

    @property
    def backward_codec(self) -> Codec | None:
        """How the output dist's backward sends gradients (None: as they are)."""
        return _codec(self.backward_precision, self.backward_loss_scale)

    @property
    def replica_sync_codec(self) -> Codec | None:
        """How the replicate-axis gradient sum sends gradient rows (None: fp32)."""
        return _codec(self.replica_sync_precision, self.backward_loss_scale)


def _codec(precision: str, scale: float | None) -> Codec | None:
    return None if precision == "fp32" else Codec(WIRE_DTYPES[precision], scale)


def _precision_name(field: str, value: object) -> str:
    """ "fp32" / "fp16" / "bf16" for a name or torch dtype; ValueError otherwise."""
    if isinstance(value, torch.dtype) and value in _DTYPE_NAMES:
        return _DTYPE_NAMES[value]
    if isinstance(value, str) and value.lower() in PRECISIONS:
        return value.lower()
    raise ValueError(
        f"{field} must be one of {list(PRECISIONS)} (or torch.float32 / float16 / bfloat16), "
        f"got {value!r}"
    )


__all__ = ["PRECISIONS", "QCommsConfig"]
