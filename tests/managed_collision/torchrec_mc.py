"""TorchRec's remappers for the managed-collision tests: one per table, the user table
LFU and the item table DistanceLFU (decay 0.5), as the tests compare dtrec against."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch


def torchrec_remappers(tables: Iterable[tuple[str, int]], intervals: Mapping[str, int]) -> dict:
    """``{name: MCHManagedCollisionModule(zch_size=rows, ...)}`` for ``(name, rows)`` pairs."""
    from torchrec.modules import mc_modules as mcm

    policies = {
        "user": mcm.LFU_EvictionPolicy(),
        "item": mcm.DistanceLFU_EvictionPolicy(decay_exponent=0.5),
    }
    return {
        n: mcm.MCHManagedCollisionModule(
            zch_size=r,
            device=torch.device("cpu"),
            eviction_policy=policies[n],
            eviction_interval=intervals[n],
        )
        for n, r in tables
    }
