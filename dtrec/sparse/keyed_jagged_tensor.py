"""Sparse ids for several features: ``KeyedJaggedTensor``, TorchRec's layout and method
names (variable batch per feature included), and ``as_kjt`` for TorchRec's own KJT.

One class with its constructors and views; it does not import torchrec.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from dtrec.sparse.checks import (
    check_inverse_indices,
    check_keys,
    check_stride_per_key_per_rank,
    check_tensors,
    exclusive_cumsum,
    key_and_bag,
    key_index,
    lengths_from,
    prefix_sums,
    slice_or_none,
    sum_per_key,
)
from dtrec.sparse.jagged import JaggedTensor, check_embedding_rows

__all__ = ["KeyedJaggedTensor", "as_kjt"]

_KJT_METHODS = ("keys", "values", "lengths", "weights_or_none")


class KeyedJaggedTensor:
    """Sparse ids for several features over one batch, in TorchRec's key-major layout.

    ``lengths[f * B + b]`` is the number of ids of ``keys[f]`` in sample ``b``; the ids
    themselves are concatenated in the same order in ``values``. Example::

        kjt = KeyedJaggedTensor(["f1", "f2"], torch.tensor([5, 6, 7]), torch.tensor([1, 0, 2, 0]))
        kjt["f1"].values()  # tensor([5]); kjt["f2"].lengths() -> tensor([2, 0])

    Variable batch per feature (TorchRec's VBE): ``stride_per_key_per_rank[f]`` lists
    key f's bag counts (per source rank; their sum is its stride), ``lengths`` holds
    each key's own bags in turn, and ``inverse_indices = (keys, [F, B] tensor)`` maps
    sample b of the full batch to its bag of key f. Embedding collections expand the
    pooled rows through ``inverse_indices`` (``dtrec.sparse.variable_batch``), as
    TorchRec's do. ``offsets`` may replace ``lengths`` (TorchRec's other constructor).

    ``values`` may also be a sequence collection's looked-up rows ``[ids, D]`` (float,
    one row per id; ``weights`` then may hold the ids): ``from_jt_dict(ec(kjt))``, as
    TorchRec users write it, and ``to_dict()`` back. Such a KJT is not a batch to look up.
    """

    def __init__(
        self,
        keys: Sequence[str],
        values: Tensor,
        lengths: Tensor | None = None,
        weights: Tensor | None = None,
        *,
        offsets: Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | None = None,
        inverse_indices: tuple[Sequence[str], Tensor] | None = None,
    ) -> None:
        keys = check_keys(keys)
        lengths = lengths_from(lengths, offsets)
        rows = isinstance(values, Tensor) and values.dim() == 2 and values.is_floating_point()
        if rows:  # looked-up rows (a sequence collection's output), one per id
            check_embedding_rows(values, lengths, weights)
        else:
            check_tensors(values, lengths, weights)
        num_keys, n = len(keys), lengths.numel()
        inverse = check_inverse_indices(inverse_indices, values.device)
        if stride_per_key_per_rank is not None:
            per_rank = check_stride_per_key_per_rank(stride_per_key_per_rank, keys)
            stride_per_key = [sum(r) for r in per_rank]
            if n != sum(stride_per_key):
                raise ValueError(
                    f"lengths.numel()={n} != sum of stride_per_key_per_rank="
                    f"{sum(stride_per_key)} (per key: {dict(zip(keys, stride_per_key))})"
                )
            # TorchRec: the full batch is the inverse indices' width, else the largest key's
            batch = inverse[1].shape[1] if inverse is not None else max(stride_per_key, default=0)
        else:
            per_rank = None
            if (n % num_keys) if num_keys else n:
                raise ValueError(
                    f"lengths.numel()={n} is not divisible by number of keys {num_keys}"
                )
            batch = n // num_keys if num_keys else 0
            if stride is not None and num_keys and stride != batch:
                raise ValueError(
                    f"stride={stride} but lengths has {n} entries for {num_keys} keys "
                    f"(stride {batch})"
                )
            stride_per_key = [batch] * num_keys
        negative = lengths < 0
        if n and bool(negative.any()):
            f, b = key_and_bag(int(negative.nonzero()[0]), stride_per_key)
            raise ValueError(
                f"negative length {int(lengths[int(negative.nonzero()[0])])} for key "
                f"{keys[f]!r} at sample {b}"
            )
        total = int(lengths.sum()) if n else 0
        if total != values.shape[0]:
            per_key = sum_per_key(lengths, stride_per_key).tolist()
            raise ValueError(
                f"sum(lengths)={total} != values.{'rows' if rows else 'numel()'}={values.shape[0]} "
                f"(per-key sums: {dict(zip(keys, per_key, strict=True))})"
            )
        self._set(keys, values, lengths, weights, batch, None, per_rank, inverse)

    def _set(
        self,
        keys: list[str],
        values: Tensor,
        lengths: Tensor,
        weights: Tensor | None,
        stride: int,
        length_per_key: list[int] | None,
        stride_per_key_per_rank: list[list[int]] | None = None,
        inverse_indices: tuple[list[str], Tensor] | None = None,
    ) -> None:
        self._keys, self._values, self._lengths, self._weights = keys, values, lengths, weights
        self._stride = stride if keys else 0
        self._length_per_key = length_per_key
        self._offsets: Tensor | None = None
        self._stride_per_key_per_rank = stride_per_key_per_rank
        self._inverse_indices = inverse_indices

    def _derived(
        self,
        keys: list[str],
        values: Tensor,
        lengths: Tensor,
        weights: Tensor | None,
        length_per_key: list[int] | None,
        stride_per_key_per_rank: list[list[int]] | None = None,
        inverse_indices: tuple[list[str], Tensor] | None = None,
        stride: int | None = None,
    ) -> KeyedJaggedTensor:
        # Build from pieces of this (already validated) KJT without re-validating.
        kjt = KeyedJaggedTensor.__new__(KeyedJaggedTensor)
        kjt._set(
            keys, values, lengths, weights, self._stride if stride is None else stride,
            length_per_key, stride_per_key_per_rank, inverse_indices,
        )  # fmt: skip
        return kjt

    @staticmethod
    def from_dict(d: Mapping[str, JaggedTensor]) -> KeyedJaggedTensor:
        """Concatenate per-feature ``JaggedTensor``s (same batch size) into one KJT.

        Also takes a sequence collection's output (``{feature: JaggedTensor}`` of rows
        ``[ids, D]``, as TorchRec users pass to ``from_jt_dict``): the KJT's values are then
        the rows ``[all ids, D]``, its keys the features in order, and ``to_dict`` gives the
        features back. Every feature must have rows of one dim (a ValueError naming them
        otherwise: build one KJT per dim).
        """
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
        shapes = {k: tuple(jt.values().shape[1:]) for k, jt in d.items()}
        if len(set(shapes.values())) > 1:
            kinds = {k: f"rows of dim {s[0]}" if s else "ids" for k, s in shapes.items()}
            raise ValueError(
                f"the features hold values of different shapes ({kinds}) but one "
                "KeyedJaggedTensor holds values of one shape: build one per embedding dim "
                "(or keep the dict)"
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

    @staticmethod
    def from_jt_dict(jt_dict: Mapping[str, JaggedTensor]) -> KeyedJaggedTensor:
        """TorchRec's name for ``from_dict``."""
        return KeyedJaggedTensor.from_dict(jt_dict)

    @staticmethod
    def from_lengths_sync(
        keys: Sequence[str],
        values: Tensor,
        lengths: Tensor,
        weights: Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | None = None,
        inverse_indices: tuple[Sequence[str], Tensor] | None = None,
    ) -> KeyedJaggedTensor:
        """TorchRec's constructor from lengths (same arguments); validated here, so synced."""
        return KeyedJaggedTensor(
            keys, values, lengths, weights, stride=stride,
            stride_per_key_per_rank=stride_per_key_per_rank, inverse_indices=inverse_indices,
        )  # fmt: skip

    @staticmethod
    def from_offsets_sync(
        keys: Sequence[str],
        values: Tensor,
        offsets: Tensor,
        weights: Tensor | None = None,
        stride: int | None = None,
        stride_per_key_per_rank: Sequence[Sequence[int]] | None = None,
        inverse_indices: tuple[Sequence[str], Tensor] | None = None,
    ) -> KeyedJaggedTensor:
        """TorchRec's constructor from offsets (``len(lengths) + 1`` entries from 0)."""
        return KeyedJaggedTensor(
            keys, values, None, weights, offsets=offsets, stride=stride,
            stride_per_key_per_rank=stride_per_key_per_rank, inverse_indices=inverse_indices,
        )  # fmt: skip

    def sync(self) -> KeyedJaggedTensor:
        """TorchRec computes its cached sizes here; dtrec's are computed on demand."""
        self.length_per_key()
        return self

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
        """B: samples per key (a variable-batch KJT: the full batch of ``inverse_indices``)."""
        return self._stride

    def stride_per_key(self) -> list[int]:
        """Bags per key (all equal to ``stride()`` unless the batch varies per key)."""
        if self._stride_per_key_per_rank is None:
            return [self._stride] * len(self._keys)
        return [sum(r) for r in self._stride_per_key_per_rank]

    def stride_per_key_per_rank(self) -> list[list[int]]:
        """Per key, its bag count per source rank (``[]`` for a fixed-batch KJT, as TorchRec)."""
        return [list(r) for r in self._stride_per_key_per_rank or []]

    def variable_stride_per_key(self) -> bool:
        return self._stride_per_key_per_rank is not None

    def inverse_indices(self) -> tuple[list[str], Tensor]:
        if self._inverse_indices is None:
            raise ValueError("KeyedJaggedTensor has no inverse_indices")
        return self._inverse_indices

    def inverse_indices_or_none(self) -> tuple[list[str], Tensor] | None:
        return self._inverse_indices

    def device(self) -> torch.device:
        """The device of ``values`` (a method, as in TorchRec)."""
        return self._values.device

    def offsets(self) -> Tensor:
        """int64 exclusive cumsum of ``lengths`` with a leading 0 (length F*B+1)."""
        if self._offsets is None:
            self._offsets = exclusive_cumsum(self._lengths)
        return self._offsets

    def length_per_key(self) -> list[int]:
        if self._length_per_key is None:
            self._length_per_key = sum_per_key(self._lengths, self.stride_per_key()).tolist()
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        return prefix_sums(self.length_per_key())

    def _key_indices(self) -> dict[str, int]:
        return {k: i for i, k in enumerate(self._keys)}

    def _bag_ranges(self) -> list[tuple[int, int]]:
        """Per key: its range of entries in ``lengths``."""
        starts = prefix_sums(self.stride_per_key())
        return list(zip(starts[:-1], starts[1:], strict=True))

    def _jagged(self, i: int) -> JaggedTensor:
        start, end = self.offset_per_key()[i : i + 2]
        lo, hi = self._bag_ranges()[i]
        return JaggedTensor._trusted(
            self._values[start:end], self._lengths[lo:hi], slice_or_none(self._weights, start, end)
        )

    def with_values(self, values: Tensor) -> KeyedJaggedTensor:
        """This batch (keys, lengths, weights, strides) with other ``values``, one per id:
        e.g. ids remapped by a managed-collision module. Not re-validated."""
        if values.shape[0] != self._values.shape[0]:
            raise ValueError(
                f"with_values: {values.shape[0]} values for {self._values.shape[0]} ids"
            )
        return self._derived(
            self._keys, values, self._lengths, self._weights, self._length_per_key,
            self._stride_per_key_per_rank, self._inverse_indices,
        )  # fmt: skip

    def to_dict(self) -> dict[str, JaggedTensor]:
        return {k: self._jagged(i) for i, k in enumerate(self._keys)}

    def __getitem__(self, key: str) -> JaggedTensor:
        return self._jagged(key_index(self._keys, key, "KeyedJaggedTensor"))

    def permute(self, order: Sequence[str] | Sequence[int]) -> KeyedJaggedTensor:
        """Reorder (or select a subset of) features, by key names or by indices."""
        num_keys, idx = len(self._keys), []
        for o in order:
            if isinstance(o, str):
                idx.append(key_index(self._keys, o, "KeyedJaggedTensor"))
            elif isinstance(o, int) and not isinstance(o, bool):
                if not -num_keys <= o < num_keys:
                    raise IndexError(f"key index {o} out of range for {num_keys} keys")
                idx.append(o % num_keys)
            else:
                raise TypeError(f"permute order entries must be str or int, got {o!r}")
        keys = check_keys([self._keys[i] for i in idx])
        opk, lpk = self.offset_per_key(), self.length_per_key()

        def gather(t: Tensor) -> Tensor:
            return torch.cat([t[opk[i] : opk[i + 1]] for i in idx]) if idx else t[:0]

        weights = None if self._weights is None else gather(self._weights)
        per_rank = self._stride_per_key_per_rank
        if per_rank is None:
            rows = torch.tensor(idx, dtype=torch.int64, device=self.device())
            lengths = self._lengths.view(num_keys, self._stride)[rows].reshape(-1)
        else:
            ranges = self._bag_ranges()
            lengths = torch.cat([self._lengths[slice(*ranges[i])] for i in idx])
            per_rank = [per_rank[i] for i in idx]
        return self._derived(
            keys, gather(self._values), lengths, weights, [lpk[i] for i in idx], per_rank,
            self._inverse_indices,
        )  # fmt: skip

    def split(self, segments: Sequence[int]) -> list[KeyedJaggedTensor]:
        """Split into KJTs over consecutive groups of keys; tensors are views."""
        segments = list(segments)
        if any(s < 0 for s in segments) or sum(segments) != len(self._keys):
            raise ValueError(
                f"segments {segments} must be non-negative and sum to the number of keys "
                f"({len(self._keys)})"
            )
        opk, lpk = self.offset_per_key(), self.length_per_key()
        bags = prefix_sums(self.stride_per_key())
        per_rank = self._stride_per_key_per_rank
        out, lo = [], 0
        for n in segments:
            hi, v0, v1 = lo + n, opk[lo], opk[lo + n]
            out.append(
                self._derived(
                    self._keys[lo:hi],
                    self._values[v0:v1],
                    self._lengths[bags[lo] : bags[hi]],
                    slice_or_none(self._weights, v0, v1),
                    lpk[lo:hi],
                    None if per_rank is None else per_rank[lo:hi],
                    self._inverse_indices,
                )
            )
            lo = hi
        return out

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedJaggedTensor:
        def move(t: Tensor) -> Tensor:
            return t.to(device, non_blocking=non_blocking)

        w = None if self._weights is None else move(self._weights)
        inverse = self._inverse_indices
        if inverse is not None:
            inverse = (inverse[0], move(inverse[1]))
        return self._derived(
            list(self._keys), move(self._values), move(self._lengths), w, self._length_per_key,
            self._stride_per_key_per_rank, inverse,
        )  # fmt: skip

    def __repr__(self) -> str:
        variable = ", variable batch" if self.variable_stride_per_key() else ""
        return (
            f"KeyedJaggedTensor(keys={self._keys}, stride={self._stride}{variable}, "
            f"values={self._values.numel()}, weighted={self._weights is not None}, "
            f"device={self.device()})"
        )


def as_kjt(obj: Any) -> KeyedJaggedTensor:
    """Accept our KJT unchanged, or convert (and validate) a TorchRec-style KJT, keeping
    its variable batch per feature (``stride_per_key_per_rank``, ``inverse_indices``).

    The batch of a lookup: a KJT of looked-up rows (2-D values) is a TypeError."""
    kjt = _as_kjt(obj)
    if kjt.values().dim() == 2:
        raise TypeError(
            f"batch values are embedding rows {tuple(kjt.values().shape)} (a KeyedJaggedTensor "
            "of a sequence collection's output), not ids: look up the KeyedJaggedTensor of ids"
        )
    return kjt


def _as_kjt(obj: Any) -> KeyedJaggedTensor:
    if isinstance(obj, KeyedJaggedTensor):
        return obj
    if all(callable(getattr(obj, m, None)) for m in _KJT_METHODS):
        per_rank = None
        variable = getattr(obj, "variable_stride_per_key", None)
        if callable(variable) and variable():
            per_rank = obj.stride_per_key_per_rank()
        inverse = None
        if callable(getattr(obj, "inverse_indices_or_none", None)):
            inverse = obj.inverse_indices_or_none()
        return KeyedJaggedTensor(
            list(obj.keys()), obj.values(), obj.lengths(), obj.weights_or_none(),
            stride_per_key_per_rank=per_rank,
            inverse_indices=None if inverse is None else (list(inverse[0]), inverse[1]),
        )  # fmt: skip
    raise TypeError(
        "expected a dtrec KeyedJaggedTensor or an object with TorchRec KJT methods "
        f"{list(_KJT_METHODS)}, got {type(obj).__name__}"
    )
