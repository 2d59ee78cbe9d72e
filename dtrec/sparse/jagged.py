"""One feature's ids for a batch: ``JaggedTensor`` (TorchRec's method names)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from dtrec.sparse.checks import check_tensors, exclusive_cumsum

__all__ = ["JaggedTensor"]


class JaggedTensor:
    """One feature's ids for a batch: ``values`` split into rows by ``lengths``.

    Returned by ``KeyedJaggedTensor.to_dict`` / ``__getitem__`` and accepted by
    ``KeyedJaggedTensor.from_dict``. Immutable; tensors are not copied. Checked on
    construction like a KJT (dtypes, devices, ``sum(lengths) == values.numel()``).
    """

    __slots__ = ("_values", "_lengths", "_weights")

    def __init__(self, values: Tensor, lengths: Tensor, weights: Tensor | None = None) -> None:
        check_tensors(values, lengths, weights)
        if lengths.numel() and bool((lengths < 0).any()):
            b = int((lengths < 0).nonzero()[0])
            raise ValueError(f"negative length {int(lengths[b])} at sample {b}")
        total = int(lengths.sum()) if lengths.numel() else 0
        if total != values.numel():
            raise ValueError(f"sum(lengths)={total} != values.numel()={values.numel()}")
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

    def __repr__(self) -> str:
        return (
            f"JaggedTensor(batch={self._lengths.numel()}, values={self._values.numel()}, "
            f"weighted={self._weights is not None})"
        )
