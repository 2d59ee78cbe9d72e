"""Sparse inputs with TorchRec-compatible method names.

``KeyedJaggedTensor`` carries the per-feature id lists fed to embedding tables
(``JaggedTensor`` one feature's). Neither imports torchrec; ``as_kjt`` converts
TorchRec's KJT (or anything with its methods) into ours.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "as_kjt"]

_INDEX_DTYPES = (torch.int32, torch.int64)
_KJT_METHODS = ("keys", "values", "lengths", "weights_or_none")


def _check_keys(keys: Sequence[str]) -> list[str]:
    if isinstance(keys, str):
        raise TypeError(f"keys must be a sequence of str, got the str {keys!r}; write [{keys!r}]")
    keys, seen = list(keys), set()
    for k in keys:
        if not isinstance(k, str):
            raise TypeError(f"keys must be str, got {type(k).__name__} ({k!r})")
        if k in seen:
            raise ValueError(f"duplicate key {k!r} in keys {keys}")
        seen.add(k)
    return keys


def _key_index(keys: list[str], key: str, owner: str) -> int:
    try:
        return keys.index(key)
    except ValueError:
        raise KeyError(f"key {key!r} not in {owner} keys {keys}") from None


def _describe(t: object) -> str:
    return f"dim={t.dim()} dtype={t.dtype}" if isinstance(t, Tensor) else type(t).__name__


def _check_tensors(values: object, lengths: object, weights: object) -> None:
    """dtypes, dims and devices shared by ``JaggedTensor`` and ``KeyedJaggedTensor``."""
    for name, t in (("values", values), ("lengths", lengths)):
        if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{name} must be a 1-D int32/int64 tensor, got {_describe(t)}")
    assert isinstance(values, Tensor) and isinstance(lengths, Tensor)
    if weights is not None:
        if not isinstance(weights, Tensor) or not weights.is_floating_point():
            raise TypeError(f"weights must be floating point, got {_describe(weights)}")
        if weights.dim() != 1 or weights.numel() != values.numel():
            raise ValueError(
                f"weights must be 1-D with numel == values.numel()={values.numel()}, "
                f"got shape {tuple(weights.shape)}"
            )
    for name, t in (("lengths", lengths), ("weights", weights)):
        if t is not None and t.device != values.device:
            raise ValueError(f"{name} on {t.device} but values on {values.device}")


def _prefix_sums(lengths: Sequence[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _exclusive_cumsum(lengths: Tensor) -> Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    offsets[1:] = torch.cumsum(lengths, dim=0)
    return offsets


def _slice(t: Tensor | None, start: int, end: int) -> Tensor | None:
    return None if t is None else t[start:end]


class JaggedTensor:
    """One feature's ids for a batch: ``values`` split into rows by ``lengths``.

    Returned by ``KeyedJaggedTensor.to_dict`` / ``__getitem__`` and accepted by
    ``KeyedJaggedTensor.from_dict``. Immutable; tensors are not copied. Checked on
    construction like a KJT (dtypes, devices, ``sum(lengths) == values.numel()``).
    """

    __slots__ = ("_values", "_lengths", "_weights")

    def __init__(self, values: Tensor, lengths: Tensor, weights: Tensor | None = None) -> None:
        _check_tensors(values, lengths, weights)
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
        return _exclusive_cumsum(self._lengths)

    def weights_or_none(self) -> Tensor | None:
        return self._weights

    def __repr__(self) -> str:
        return (
            f"JaggedTensor(batch={self._lengths.numel()}, values={self._values.numel()}, "
            f"weighted={self._weights is not None})"
        )


class KeyedJaggedTensor:
    """Sparse ids for several features over one batch, in TorchRec's key-major layout.

    ``lengths[f * B + b]`` is the number of ids of ``keys[f]`` in sample ``b``; the ids
    themselves are concatenated in the same order in ``values``. Example::

        kjt = KeyedJaggedTensor(["f1", "f2"], torch.tensor([5, 6, 7]), torch.tensor([1, 0, 2, 0]))
        kjt["f1"].values()  # tensor([5]); kjt["f2"].lengths() -> tensor([2, 0])
    """

    def __init__(
        self, keys: Sequence[str], values: Tensor, lengths: Tensor, weights: Tensor | None = None
    ) -> None:
        keys = _check_keys(keys)
        _check_tensors(values, lengths, weights)
        num_keys, n = len(keys), lengths.numel()
        if (n % num_keys) if num_keys else n:
            raise ValueError(f"lengths.numel()={n} is not divisible by number of keys {num_keys}")
        stride = n // num_keys if num_keys else 0
        negative = lengths < 0
        if n and bool(negative.any()):
            f, b = divmod(int(negative.nonzero()[0]), stride)
            raise ValueError(
                f"negative length {int(lengths[f * stride + b])} for key {keys[f]!r} at sample {b}"
            )
        total = int(lengths.sum()) if n else 0
        if total != values.numel():
            per_key = lengths.view(num_keys, stride).sum(1).tolist() if num_keys else []
            raise ValueError(
                f"sum(lengths)={total} != values.numel()={values.numel()} "
                f"(per-key sums: {dict(zip(keys, per_key, strict=True))})"
            )
        self._set(keys, values, lengths, weights, stride, None)

    def _set(
        self,
        keys: list[str],
        values: Tensor,
        lengths: Tensor,
        weights: Tensor | None,
        stride: int,
        length_per_key: list[int] | None,
    ) -> None:
        self._keys, self._values, self._lengths, self._weights = keys, values, lengths, weights
        self._stride = stride if keys else 0
        self._length_per_key = length_per_key
        self._offsets: Tensor | None = None

    def _derived(
        self,
        keys: list[str],
        values: Tensor,
        lengths: Tensor,
        weights: Tensor | None,
        length_per_key: list[int] | None,
    ) -> KeyedJaggedTensor:
        # Build from pieces of this (already validated) KJT without re-validating.
        kjt = KeyedJaggedTensor.__new__(KeyedJaggedTensor)
        kjt._set(keys, values, lengths, weights, self._stride, length_per_key)
        return kjt

    @staticmethod
    def from_dict(d: Mapping[str, JaggedTensor]) -> KeyedJaggedTensor:
        """Concatenate per-feature ``JaggedTensor``s (same batch size) into one KJT."""
        if not isinstance(d, Mapping):
            raise TypeError(f"from_dict takes a dict key -> JaggedTensor, got {type(d).__name__}")
        for k, jt in d.items():
            if not isinstance(jt, JaggedTensor):
                raise TypeError(f"key {k!r}: expected a JaggedTensor, got {type(jt).__name__}")
        keys, jts = list(d), list(d.values())
        if not jts:
            empty = torch.empty(0, dtype=torch.int64)
            return KeyedJaggedTensor([], empty, empty)
        batch = jts[0].lengths().numel()
        for k, jt in d.items():
            if jt.lengths().numel() != batch:
                raise ValueError(
                    f"key {k!r} has batch size {jt.lengths().numel()}, expected {batch} "
                    f"(batch size of key {keys[0]!r})"
                )
        missing = [k for k, jt in d.items() if jt.weights_or_none() is None]
        if missing and len(missing) != len(keys):
            raise ValueError(f"either all or no keys must have weights; {missing} have none")
        return KeyedJaggedTensor(
            keys,
            torch.cat([jt.values() for jt in jts]),
            torch.cat([jt.lengths() for jt in jts]),
            None if missing else torch.cat([jt.weights_or_none() for jt in jts]),
        )

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> Tensor:
        return self._values

    def lengths(self) -> Tensor:
        return self._lengths

    def weights(self) -> Tensor:
        if self._weights is None:
            raise ValueError("KeyedJaggedTensor has no weights")
        return self._weights

    def weights_or_none(self) -> Tensor | None:
        return self._weights

    def stride(self) -> int:
        return self._stride

    @property
    def device(self) -> torch.device:
        return self._values.device

    def offsets(self) -> Tensor:
        """int64 exclusive cumsum of ``lengths`` with a leading 0 (length F*B+1)."""
        if self._offsets is None:
            self._offsets = _exclusive_cumsum(self._lengths)
        return self._offsets

    def length_per_key(self) -> list[int]:
        if self._length_per_key is None:
            f = len(self._keys)
            self._length_per_key = self._lengths.view(f, self._stride).sum(1).tolist() if f else []
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        return _prefix_sums(self.length_per_key())

    def _jagged(self, i: int) -> JaggedTensor:
        start, end = self.offset_per_key()[i : i + 2]
        b = self._stride
        lengths = self._lengths[i * b : (i + 1) * b]
        return JaggedTensor._trusted(
            self._values[start:end], lengths, _slice(self._weights, start, end)
        )

    def to_dict(self) -> dict[str, JaggedTensor]:
        return {k: self._jagged(i) for i, k in enumerate(self._keys)}

    def __getitem__(self, key: str) -> JaggedTensor:
        return self._jagged(_key_index(self._keys, key, "KeyedJaggedTensor"))

    def permute(self, order: Sequence[str] | Sequence[int]) -> KeyedJaggedTensor:
        """Reorder (or select a subset of) features, by key names or by indices."""
        num_keys, idx = len(self._keys), []
        for o in order:
            if isinstance(o, str):
                idx.append(_key_index(self._keys, o, "KeyedJaggedTensor"))
            elif isinstance(o, int) and not isinstance(o, bool):
                if not -num_keys <= o < num_keys:
                    raise IndexError(f"key index {o} out of range for {num_keys} keys")
                idx.append(o % num_keys)
            else:
                raise TypeError(f"permute order entries must be str or int, got {o!r}")
        keys = _check_keys([self._keys[i] for i in idx])
        opk, lpk = self.offset_per_key(), self.length_per_key()

        def gather(t: Tensor) -> Tensor:
            return torch.cat([t[opk[i] : opk[i + 1]] for i in idx]) if idx else t[:0]

        rows = torch.tensor(idx, dtype=torch.int64, device=self.device)
        lengths = self._lengths.view(num_keys, self._stride)[rows].reshape(-1)
        weights = None if self._weights is None else gather(self._weights)
        return self._derived(keys, gather(self._values), lengths, weights, [lpk[i] for i in idx])

    def split(self, segments: Sequence[int]) -> list[KeyedJaggedTensor]:
        """Split into KJTs over consecutive groups of keys; tensors are views."""
        segments = list(segments)
        if any(s < 0 for s in segments) or sum(segments) != len(self._keys):
            raise ValueError(
                f"segments {segments} must be non-negative and sum to the number of keys "
                f"({len(self._keys)})"
            )
        opk, lpk, b = self.offset_per_key(), self.length_per_key(), self._stride
        out, lo = [], 0
        for n in segments:
            hi, v0, v1 = lo + n, opk[lo], opk[lo + n]
            out.append(
                self._derived(
                    self._keys[lo:hi],
                    self._values[v0:v1],
                    self._lengths[lo * b : hi * b],
                    _slice(self._weights, v0, v1),
                    lpk[lo:hi],
                )
            )
            lo = hi
        return out

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedJaggedTensor:
        def move(t: Tensor) -> Tensor:
            return t.to(device, non_blocking=non_blocking)

        w = None if self._weights is None else move(self._weights)
        lpk = self._length_per_key
        return self._derived(list(self._keys), move(self._values), move(self._lengths), w, lpk)

    def __repr__(self) -> str:
        return (
            f"KeyedJaggedTensor(keys={self._keys}, stride={self._stride}, "
            f"values={self._values.numel()}, weighted={self._weights is not None}, "
            f"device={self.device})"
        )


def as_kjt(obj: Any) -> KeyedJaggedTensor:
    """Accept our KJT unchanged, or convert (and validate) a TorchRec-style KJT."""
    if isinstance(obj, KeyedJaggedTensor):
        return obj
    if all(callable(getattr(obj, m, None)) for m in _KJT_METHODS):
        return KeyedJaggedTensor(
            list(obj.keys()), obj.values(), obj.lengths(), obj.weights_or_none()
        )
    raise TypeError(
        "expected a dtrec KeyedJaggedTensor or an object with TorchRec KJT methods "
        f"{list(_KJT_METHODS)}, got {type(obj).__name__}"
    )
