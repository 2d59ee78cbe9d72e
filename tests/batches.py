"""Random KJT batches for the distributed tests: one generator, features in order."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def random_kjt(
    gen: torch.Generator,
    features: Sequence[tuple[str, int]],
    size: int,
    lengths: tuple[int, int] = (0, 4),
):
    """A KJT of ``size`` samples: per (feature, rows) in order, lengths uniform in
    ``[lengths[0], lengths[1])`` then that many ids in ``[0, rows)``, all drawn from
    ``gen`` (a caller's later draws continue the same stream)."""
    import dtrec

    keys, values, all_lengths = [], [], []
    for key, rows in features:
        ls = torch.randint(*lengths, (size,), generator=gen)
        keys.append(key)
        all_lengths.append(ls)
        values.append(torch.randint(0, rows, (int(ls.sum()),), generator=gen))
    return dtrec.KeyedJaggedTensor(keys, torch.cat(values), torch.cat(all_lengths))
