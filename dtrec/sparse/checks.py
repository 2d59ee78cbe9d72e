"""Checks and small helpers shared by the sparse types (ids, lengths, keys, VBE metadata).

Every check raises the error a user sees (naming the key, the sample, the shapes),
so ``JaggedTensor``, ``KeyedJaggedTensor`` and ``KeyedTensor`` reject bad input alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

INDEX_DTYPES = (torch.int32, torch.int64)


def check_keys(keys: Sequence[str]) -> list[str]:
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


def key_index(keys: list[str], key: str, owner: str) -> int:
    try:
        return keys.index(key)
    except ValueError:
        raise KeyError(f"key {key!r} not in {owner} keys {keys}") from None


def describe(t: object) -> str:
    return f"dim={t.dim()} dtype={t.dtype}" if isinstance(t, Tensor) else type(t).__name__


def check_tensors(values: object, lengths: object, weights: object) -> None:
    """dtypes, dims and devices shared by ``JaggedTensor`` and ``KeyedJaggedTensor``."""
    for name, t in (("values", values), ("lengths", lengths)):
        if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype not in INDEX_DTYPES:
            raise TypeError(f"{name} must be a 1-D int32/int64 tensor, got {describe(t)}")
    assert isinstance(values, Tensor) and isinstance(lengths, Tensor)
    if weights is not None:
        if not isinstance(weights, Tensor) or not weights.is_floating_point():
            raise TypeError(f"weights must be floating point, got {describe(weights)}")
        if weights.dim() != 1 or weights.numel() != values.numel():
            raise ValueError(
                f"weights must be 1-D with numel == values.numel()={values.numel()}, "
                f"got shape {tuple(weights.shape)}"
            )
    for name, t in (("lengths", lengths), ("weights", weights)):
        if t is not None and t.device != values.device:
            raise ValueError(f"{name} on {t.device} but values on {values.device}")


def prefix_sums(lengths: Sequence[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def exclusive_cumsum(lengths: Tensor) -> Tensor:
    """int64 ``[0, cumsum(lengths)...]``: two launches (a zeroed buffer, the cumsum written
    into its tail), not three (a slice assignment copies the cumsum once more)."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, dim=0, dtype=torch.int64, out=offsets[1:])
    return offsets


def slice_or_none(t: Tensor | None, start: int, end: int) -> Tensor | None:
    return None if t is None else t[start:end]


def lengths_from(lengths: Tensor | None, offsets: Tensor | None) -> Tensor:
    """``lengths``, or the differences of ``offsets`` (exactly one of them given)."""
    if (lengths is None) == (offsets is None):
        raise ValueError("give exactly one of lengths and offsets")
    if lengths is not None:
        return lengths
    if not isinstance(offsets, Tensor) or offsets.dim() != 1 or offsets.dtype not in INDEX_DTYPES:
        raise TypeError(f"offsets must be a 1-D int32/int64 tensor, got {describe(offsets)}")
    if offsets.numel() == 0 or int(offsets[0]) != 0:
        raise ValueError("offsets must start with 0 (len(lengths) + 1 entries)")
    return torch.diff(offsets)


def check_stride_per_key_per_rank(
    per_rank: Sequence[Sequence[int]], keys: list[str]
) -> list[list[int]]:
    """A list per key of non-negative bag counts (one per source rank)."""
    rows = [list(r) for r in per_rank] if not isinstance(per_rank, Tensor) else per_rank.tolist()
    if len(rows) != len(keys):
        raise ValueError(
            f"stride_per_key_per_rank has {len(rows)} entries for {len(keys)} keys {keys}"
        )
    for key, row in zip(keys, rows, strict=True):
        if not row or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in row):
            raise ValueError(
                f"stride_per_key_per_rank for key {key!r} must be a non-empty list of ints "
                f">= 0 (bags per rank), got {row!r}"
            )
    return rows


def check_inverse_indices(
    inverse: tuple[Sequence[str], Tensor] | None, device: torch.device
) -> tuple[list[str], Tensor] | None:
    """``(keys, [len(keys), B] int tensor)`` on the values' device, or None."""
    if inverse is None:
        return None
    if not isinstance(inverse, tuple) or len(inverse) != 2:
        raise TypeError(f"inverse_indices must be a (keys, tensor) tuple, got {inverse!r}")
    keys, index = check_keys(inverse[0]), inverse[1]
    if not isinstance(index, Tensor) or index.dim() != 2 or index.dtype not in INDEX_DTYPES:
        raise TypeError(f"inverse_indices[1] must be a 2-D int tensor, got {describe(index)}")
    if index.shape[0] != len(keys):
        raise ValueError(
            f"inverse_indices[1] has {index.shape[0]} rows for {len(keys)} keys {keys}"
        )
    if index.device != device:
        raise ValueError(f"inverse_indices on {index.device} but values on {device}")
    return keys, index


def key_and_bag(position: int, stride_per_key: Sequence[int]) -> tuple[int, int]:
    """(key, bag within the key) of entry ``position`` of ``lengths``."""
    for f, n in enumerate(stride_per_key):
        if position < n:
            return f, position
        position -= n
    raise IndexError(position)


def sum_per_key(lengths: Tensor, stride_per_key: Sequence[int]) -> Tensor:
    """Per key, the sum of its entries of ``lengths`` (int64)."""
    num_keys = len(stride_per_key)
    if not num_keys:
        return lengths.new_zeros(0, dtype=torch.int64)
    if len(set(stride_per_key)) == 1:
        return lengths.view(num_keys, stride_per_key[0]).sum(1, dtype=torch.int64)
    key = torch.repeat_interleave(
        torch.arange(num_keys, device=lengths.device),
        torch.tensor(list(stride_per_key), device=lengths.device),
    )
    return torch.zeros(num_keys, dtype=torch.int64, device=lengths.device).index_add_(
        0, key, lengths.long()
    )
