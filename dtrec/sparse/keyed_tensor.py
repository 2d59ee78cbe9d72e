"""Pooled outputs with TorchRec-compatible method names: ``KeyedTensor``.

What an ``EmbeddingBagCollection`` returns: one ``[B, sum D]`` tensor whose column
blocks belong to the features, in the collection's feature order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dtrec.sparse.checks import check_keys, key_index, prefix_sums

__all__ = ["KeyedTensor"]


class KeyedTensor:
    """Pooled embeddings for several features: ``values`` is [B, sum(length_per_key)].

    Columns ``offset_per_key()[i]:offset_per_key()[i + 1]`` belong to ``keys()[i]``,
    matching TorchRec's ``KeyedTensor`` with ``key_dim() == 1``.
    """

    def __init__(self, keys: Sequence[str], length_per_key: Sequence[int], values: Tensor) -> None:
        keys = check_keys(keys)
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

    @staticmethod
    def from_tensor_list(
        keys: Sequence[str], tensors: Sequence[Tensor], key_dim: int = 1, cat_dim: int = 1
    ) -> KeyedTensor:
        """One KeyedTensor from per-key ``[B, D_k]`` tensors (TorchRec's signature; dim 1 only)."""
        if key_dim != 1 or cat_dim != 1:
            raise ValueError(f"dtrec's KeyedTensor is [B, sum D]: key_dim and cat_dim must be 1, "
                             f"got {key_dim}, {cat_dim}")  # fmt: skip
        return KeyedTensor(keys, [t.shape[1] for t in tensors], torch.cat(list(tensors), dim=1))

    @staticmethod
    def regroup(
        keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]
    ) -> list[Tensor]:
        """Per group, its keys' columns side by side (``[B, sum D of the group]``).

        TorchRec's ``KeyedTensor.regroup`` (and ``KTRegroupAsDict``) accept dtrec's
        KeyedTensors too; this is the same without torchrec. A key found in several
        inputs is taken from the last one, as TorchRec does.
        """
        where: dict[str, KeyedTensor] = {}
        for kt in keyed_tensors:
            for key in kt.keys():
                where[key] = kt
        out = []
        for group in groups:
            unknown = [k for k in group if k not in where]
            if unknown:
                raise KeyError(f"regroup: keys {unknown} are in none of the KeyedTensors")
            out.append(torch.cat([where[k][k] for k in group], dim=1))
        return out

    @staticmethod
    def regroup_as_dict(
        keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]], keys: Sequence[str]
    ) -> dict[str, Tensor]:
        """``regroup`` with a name per group."""
        if len(groups) != len(keys):
            raise ValueError(f"regroup_as_dict: {len(groups)} groups but {len(keys)} keys")
        return dict(zip(keys, KeyedTensor.regroup(keyed_tensors, groups), strict=True))

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> Tensor:
        return self._values

    def key_dim(self) -> int:
        return 1

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        return prefix_sums(self._length_per_key)

    def device(self) -> torch.device:
        """The device of ``values`` (a method, as in TorchRec)."""
        return self._values.device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedTensor:
        values = self._values.to(device, non_blocking=non_blocking)
        return KeyedTensor(self._keys, self._length_per_key, values)

    def _key_indices(self) -> dict[str, int]:
        """Key -> its position (TorchRec's regroup reads it)."""
        return {k: i for i, k in enumerate(self._keys)}

    def to_dict(self) -> dict[str, Tensor]:
        opk = self.offset_per_key()
        return {k: self._values[:, opk[i] : opk[i + 1]] for i, k in enumerate(self._keys)}

    def __getitem__(self, key: str) -> Tensor:
        i = key_index(self._keys, key, "KeyedTensor")
        opk = self.offset_per_key()
        return self._values[:, opk[i] : opk[i + 1]]

    def __repr__(self) -> str:
        return (
            f"KeyedTensor(keys={self._keys}, length_per_key={self._length_per_key}, "
            f"shape={tuple(self._values.shape)})"
        )
