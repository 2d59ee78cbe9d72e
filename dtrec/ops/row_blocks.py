"""Ids relative to a row block, and the mean-pooling factor of a bag.

The two facts every sharded lookup needs, written once: the sharded module's
input-dist (the sender shifts each id into the block that holds its row) and the
DTensor op path (each row shard keeps its own ids and drops the rest) both call
``ids_in_rows``; both turn a mean into a sum scaled by ``bag_scale`` of the
*global* bag length, so partial sums over row blocks add up to the exact mean.
"""

from __future__ import annotations

import torch
from torch import Tensor


def ids_in_rows(
    values: Tensor, owner: Tensor, starts: Tensor, sizes: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """Each id relative to the first row of its block, and which ids fall inside it.

    ``owner[i]`` indexes the block of id ``i`` in ``starts`` (its first row) and ``sizes``
    (its row count). Without ``sizes`` the caller already knows every id is inside
    (input-dist picks each id's block by its row) and the mask is None.

    Example::

        ids_in_rows(torch.tensor([7, 2]), torch.tensor([1, 0]), torch.tensor([0, 5]),
                    torch.tensor([5, 5]))  # -> (tensor([2, 2]), tensor([True, True]))
    """
    shifted = values.long() - starts.index_select(0, owner)
    if sizes is None:
        return shifted, None
    inside = (shifted >= 0) & (shifted < sizes.index_select(0, owner))
    return shifted, inside


def bag_scale(lengths: Tensor, is_mean: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Per bag: ``1 / length`` where the bag is mean-pooled (an empty bag counts as 1), else 1.

    ``lengths`` and ``is_mean`` broadcast together (e.g. ``[F, B]`` lengths with a
    ``[F, 1]`` mask); ``lengths`` are the bags' full (global) lengths.
    """
    inv = 1.0 / lengths.clamp(min=1).to(dtype)
    return torch.where(is_mean, inv, torch.ones((), dtype=dtype, device=lengths.device))
