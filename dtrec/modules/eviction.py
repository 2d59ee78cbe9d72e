"""Eviction policies of a managed-collision remapper: which raw ids keep a row.

Every ``eviction_interval`` steps the remapper merges the ids it saw in that window
with the ids it keeps and asks its policy for one score per candidate; the
``zch_size`` highest scores keep (or get) a row. The scores are TorchRec's
(``torchrec.modules.mc_modules``), computed with the same tensor ops and dtypes so
ties and float rounding break the same way:

- ``LFU``: the id's total count since it got its row.
- ``LRU``: ``-(iter - last_access + 1) ** decay_exponent``.
- ``DistanceLFU``: ``count / (iter - last_access + 1) ** decay_exponent``.

An optional ``threshold_filter`` drops rare ids of the window before scoring:
``dynamic_threshold_filter``, ``average_threshold_filter``,
``probabilistic_threshold_filter`` or any function of the window's per-id counts
returning (mask, threshold).

Example::

    policy = DistanceLFU(decay_exponent=0.5, threshold_filter=average_threshold_filter)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

INT64_MAX = torch.iinfo(torch.int64).max

Counts = Tensor | None
ThresholdFilter = Callable[[Tensor], tuple[Tensor, "Tensor | float"]]


@torch.no_grad()
def dynamic_threshold_filter(
    id_counts: Tensor, threshold_skew_multiplier: float = 10.0
) -> tuple[Tensor, Tensor]:
    """Keep ids seen more than ``total / unique * threshold_skew_multiplier`` times."""
    threshold = (1 / id_counts.numel()) * threshold_skew_multiplier * id_counts.sum()
    return id_counts > threshold, threshold


@torch.no_grad()
def average_threshold_filter(id_counts: Tensor) -> tuple[Tensor, Tensor]:
    """Keep ids seen more often than the window's mean count."""
    if id_counts.dtype != torch.float:
        id_counts = id_counts.float()
    threshold = id_counts.mean()
    return id_counts > threshold, threshold


@torch.no_grad()
def probabilistic_threshold_filter(
    id_counts: Tensor, per_id_probability: float = 0.01
) -> tuple[Tensor, Tensor]:
    """Keep an id seen ``c`` times with probability ``1 - (1 - per_id_probability) ** c``.

    Draws from torch's global generator: replicas of a sharded table must seed it alike.
    """
    probability = torch.full_like(id_counts, 1 - per_id_probability, dtype=torch.float)
    scores = 1 - torch.pow(probability, id_counts)
    threshold = torch.rand(id_counts.size(), device=id_counts.device)
    return scores > threshold, threshold


def _check_decay(policy: str, decay_exponent: float) -> None:
    if not isinstance(decay_exponent, (int, float)) or isinstance(decay_exponent, bool):
        raise TypeError(f"{policy}: decay_exponent must be a number, got {decay_exponent!r}")
    if not math.isfinite(decay_exponent) or decay_exponent < 0:
        raise ValueError(f"{policy}: decay_exponent must be finite and >= 0, got {decay_exponent}")


@dataclasses.dataclass(frozen=True)
class EvictionPolicy:
    """Base of the policies: what per-row metadata a remapper keeps, and the score."""

    #: drops rare ids of a window before scoring (None: every id competes)
    threshold_filter: ThresholdFilter | None = dataclasses.field(default=None, kw_only=True)

    #: per-row metadata the remapper keeps for this policy (buffer ``_mch_<name>``)
    metadata: tuple[str, ...] = dataclasses.field(default=(), init=False)

    def __post_init__(self) -> None:
        if self.threshold_filter is not None and not callable(self.threshold_filter):
            raise TypeError(
                f"{type(self).__name__}: threshold_filter must be a function of the window's "
                f"id counts, got {self.threshold_filter!r}"
            )

    def scores(self, current_iter: int, counts: Counts, last_access: Counts) -> Tensor:
        """One score per candidate (kept rows first, then the window's new ids); the
        ``zch_size`` highest keep a row."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class LFU(EvictionPolicy):
    """Least frequently used: an id's count since it got its row (TorchRec's
    ``LFU_EvictionPolicy``)."""

    metadata: tuple[str, ...] = dataclasses.field(default=("counts",), init=False)

    def scores(self, current_iter: int, counts: Counts, last_access: Counts) -> Tensor:
        assert counts is not None
        return counts


@dataclasses.dataclass(frozen=True)
class LRU(EvictionPolicy):
    """Least recently used (TorchRec's ``LRU_EvictionPolicy``)."""

    #: how fast a row's score falls with the steps since its id was last seen
    decay_exponent: float = 1.0
    metadata: tuple[str, ...] = dataclasses.field(default=("last_access_iter",), init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_decay("LRU", self.decay_exponent)

    def scores(self, current_iter: int, counts: Counts, last_access: Counts) -> Tensor:
        assert last_access is not None
        return torch.neg(torch.pow(current_iter - last_access + 1, self.decay_exponent))


@dataclasses.dataclass(frozen=True)
class DistanceLFU(EvictionPolicy):
    """Count discounted by the steps since last seen (TorchRec's
    ``DistanceLFU_EvictionPolicy``)."""

    #: how fast a row's score falls with the steps since its id was last seen
    decay_exponent: float = 1.0
    metadata: tuple[str, ...] = dataclasses.field(
        default=("counts", "last_access_iter"), init=False
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_decay("DistanceLFU", self.decay_exponent)

    def scores(self, current_iter: int, counts: Counts, last_access: Counts) -> Tensor:
        assert counts is not None and last_access is not None
        distance = torch.pow(current_iter - last_access + 1, self.decay_exponent)
        return torch.div(counts, distance)


def select_evictions(scores: Tensor, zch_size: int) -> tuple[Tensor, Tensor]:
    """(kept positions to give up, new candidates to admit), paired in order.

    ``scores`` holds the ``zch_size`` kept rows first, then the new ids. A stable
    descending sort ranks them; new ids in the top ``zch_size`` take the rows of the kept
    ids outside it, the k-th best newcomer the k-th best loser's row (TorchRec's pairing,
    which decides which row each new id gets).

    Only the ``n`` new ids' worth of candidates is sorted, not all ``zch_size + n``: the
    ``n`` ranked last are those below the ``n``-th smallest score plus, of the ones equal
    to it, those at the highest positions (a stable descending sort puts ties in position
    order); ``select_evictions_by_sort`` is the full sort, and gives the same pairs."""
    n = scores.numel() - zch_size
    empty = torch.empty(0, dtype=torch.int64, device=scores.device)
    if n <= 0:
        return empty, empty
    cut = torch.kthvalue(scores, n).values
    last = scores < cut
    tied = (scores == cut).nonzero().squeeze(1)
    short = n - int(last.sum())  # how many of the tied rank last: the highest positions
    last[tied[tied.numel() - short :]] = True
    rest = last.nonzero().squeeze(1)
    rest = rest[torch.argsort(scores[rest], descending=True, stable=True)]
    top_new = (~last[zch_size:]).nonzero().squeeze(1) + zch_size
    top_new = top_new[torch.argsort(scores[top_new], descending=True, stable=True)]
    return rest[rest < zch_size], top_new - zch_size


def select_evictions_by_sort(scores: Tensor, zch_size: int) -> tuple[Tensor, Tensor]:
    """``select_evictions`` by one stable sort of every score (TorchRec's way; the
    reference its tests compare with)."""
    order = torch.argsort(scores, descending=True, stable=True)
    top, rest = order[:zch_size], order[zch_size:]
    evicted = rest[rest < zch_size]
    admitted = top[top >= zch_size] - zch_size
    return evicted, admitted


def as_policy(policy: object) -> EvictionPolicy:
    """A dtrec policy, or TorchRec's (duck-typed by class name) as its dtrec twin."""
    if isinstance(policy, EvictionPolicy):
        return policy
    name = type(policy).__name__
    twins: dict[str, type[EvictionPolicy]] = {
        "LFU_EvictionPolicy": LFU,
        "LRU_EvictionPolicy": LRU,
        "DistanceLFU_EvictionPolicy": DistanceLFU,
    }
    if name not in twins:
        raise TypeError(
            f"eviction_policy must be dtrec.modules.eviction.LFU, LRU or DistanceLFU (or "
            f"TorchRec's LFU/LRU/DistanceLFU_EvictionPolicy), got {name}"
        )
    given: Any = policy
    kwargs: dict[str, object] = {"threshold_filter": given._threshold_filtering_func}
    if twins[name] is not LFU:
        kwargs["decay_exponent"] = given._decay_exponent
    return twins[name](**kwargs)  # type: ignore[arg-type]


__all__ = [
    "DistanceLFU",
    "EvictionPolicy",
    "LFU",
    "LRU",
    "average_threshold_filter",
    "dynamic_threshold_filter",
    "probabilistic_threshold_filter",
    "select_evictions",
    "select_evictions_by_sort",
]
