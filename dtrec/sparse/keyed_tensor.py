"""Pooled outputs with TorchRec-compatible method names: ``KeyedTensor``.

What an ``EmbeddingBagCollection`` returns: one ``[B, sum D]`` tensor whose column
blocks belong to the features, in the collection's feature order.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from dtrec.sparse.jagged import _check_keys, _key_index, _prefix_sums

__all__ = ["KeyedTensor"]


class KeyedTensor:
    """Pooled embeddings for several features: ``values`` is [B, sum(length_per_key)].

    Columns ``offset_per_key()[i]:offset_per_key()[i + 1]`` belong to ``keys()[i]``,
    matching TorchRec's ``KeyedTensor`` with ``key_dim() == 1``.
    """

    def __init__(self, keys: Sequence[str], length_per_key: Sequence[int], values: Tensor) -> None:
        keys = _check_keys(keys)
        length_per_key = [int(n) for n in length_per_key]
        if len(length_per_key) != len(keys) or any(n < 0 for n in length_per_key):
            raise ValueError(
                f"length_per_key {length_per_key} must be {len(keys)} non-negative ints "
                f"(one per key)"
            )
        if not isinstance(values, Tensor):
            raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
        if values.dim() != 2 or values.shape[1] != sum(length_per_key):
            raise ValueError(
                f"values must be [B, sum(length_per_key)={sum(length_per_key)}], "
                f"got shape {tuple(values.shape)}"
            )
        self._keys, self._length_per_key, self._values = keys, length_per_key, values

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> Tensor:
        return self._values

    def key_dim(self) -> int:
        return 1

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        return _prefix_sums(self._length_per_key)

    def to_dict(self) -> dict[str, Tensor]:
        opk = self.offset_per_key()
        return {k: self._values[:, opk[i] : opk[i + 1]] for i, k in enumerate(self._keys)}

    def __getitem__(self, key: str) -> Tensor:
        i = _key_index(self._keys, key, "KeyedTensor")
        opk = self.offset_per_key()
        return self._values[:, opk[i] : opk[i + 1]]

    def __repr__(self) -> str:
        return (
            f"KeyedTensor(keys={self._keys}, length_per_key={self._length_per_key}, "
            f"shape={tuple(self._values.shape)})"
        )
