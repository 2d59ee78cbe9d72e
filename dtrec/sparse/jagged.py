"""One feature's ids or looked-up rows for a batch: ``JaggedTensor`` (TorchRec's method names)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dtrec.sparse.checks import INDEX_DTYPES, check_tensors, describe, exclusive_cumsum

__all__ = ["JaggedTensor", "check_embedding_rows"]


class JaggedTensor:
    """One feature's ids for a batch: ``values`` split into rows by ``lengths``.

    Returned by ``KeyedJaggedTensor.to_dict`` / ``__getitem__`` and accepted by
    ``KeyedJaggedTensor.from_dict``. Immutable; tensors are not copied. Checked on
    construction like a KJT (dtypes, devices, ``sum(lengths) == values.numel()``).

    A sequence lookup's output (``EmbeddingCollection``) has 2-D float ``values``
    ``[ids, D]``: ``lengths`` then split its rows, and ``weights`` may hold the ids
    (TorchRec's ``need_indices``).
    """

    __slots__ = ("_values", "_lengths", "_weights")

    def __init__(self, values: Tensor, lengths: Tensor, weights: Tensor | None = None) -> None:
        if isinstance(values, Tensor) and values.dim() == 2:
            check_embedding_rows(values, lengths, weights)
        else:
            check_tensors(values, lengths, weights)
        if lengths.numel() and bool((lengths < 0).any()):
            b = int((lengths < 0).nonzero()[0])
            raise ValueError(f"negative length {int(lengths[b])} at sample {b}")
        total = int(lengths.sum()) if lengths.numel() else 0
        if total != values.shape[0]:
            what = "rows" if values.dim() == 2 else "numel()"
            raise ValueError(f"sum(lengths)={total} != values.{what}={values.shape[0]}")
        self._init(values, lengths, weights)

    def _init(self, values: Tensor, lengths: Tensor, weights: Tensor | None) -> None:
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_lengths", lengths)
        object.__setattr__(self, "_weights", weights)

    @classmethod
    def _trusted(cls, values: Tensor, lengths: Tensor, weights: Tensor | None) -> JaggedTensor:
        # A slice of an already validated KJT: no second validation (it would sync).
        jt = cls.__new__(cls)
        jt._init(values, lengths, weights)
        return jt

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def values(self) -> Tensor:
        return self._values

    def lengths(self) -> Tensor:
        return self._lengths

    def offsets(self) -> Tensor:
        return exclusive_cumsum(self._lengths)

    def weights_or_none(self) -> Tensor | None:
        return self._weights

    def weights(self) -> Tensor:
        if self._weights is None:
            raise ValueError("this JaggedTensor has no weights")
        return self._weights

    def to_dense(self) -> list[Tensor]:
        """One tensor per sample: its ids (or its rows, for 2-D values)."""
        return list(torch.split(self._values, self._lengths.tolist()))

    def __repr__(self) -> str:
        return (
            f"JaggedTensor(batch={self._lengths.numel()}, values={tuple(self._values.shape)}, "
            f"weighted={self._weights is not None})"
        )


def check_embedding_rows(values: Tensor, lengths: object, weights: object) -> None:
    """2-D values are looked-up rows: float, one row per id; weights (if any) the ids."""
    if not values.is_floating_point():
        raise TypeError(f"2-D values must be floating point (embedding rows), got {values.dtype}")
    if not isinstance(lengths, Tensor) or lengths.dim() != 1 or lengths.dtype not in INDEX_DTYPES:
        raise TypeError(f"lengths must be a 1-D int32/int64 tensor, got {describe(lengths)}")
    if weights is not None and (
        not isinstance(weights, Tensor) or weights.dim() != 1 or weights.numel() != values.shape[0]
    ):
        raise ValueError(
            f"weights of 2-D values must be 1-D with one entry per row ({values.shape[0]}), "
            f"got {describe(weights)}"
        )
    for name, t in (("lengths", lengths), ("weights", weights)):
        if t is not None and t.device != values.device:
            raise ValueError(f"{name} on {t.device} but values on {values.device}")
