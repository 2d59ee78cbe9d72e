"""An eviction decided by raw-id range over the ranks that share a window, exactly.

Every rank keeps the whole remapper (it remaps its own batch before the input dist), so
every rank must end an eviction with the same map; the unsplit eviction has each of them
coalesce the merged window, match it against the map, score and select over all
``zch_size`` rows. Here rank ``r`` of the ``R`` ranks of the window's group does that
only for the raw ids in its range (``[0, input_hash_size)`` cut in ``R`` equal parts; the
map's positions of those ids are one contiguous segment, the map being sorted), and the
ranks exchange only decisions:

1. the window summaries are all-gathered as before; each rank coalesces the ids of its
   range, matches them against its segment (counts and last access of matched rows
   updated) and scores its segment's rows and its new ids;
2. ``n``, the number of new ids over all ranges, is all-reduced; the ``n`` candidates
   ranked last overall are the evicted rows and the new ids left out. The score of the
   ``n``-th last (the cut) is among each range's ``n`` lowest scores: each rank sends
   those and every rank takes the ``n``-th smallest of them;
3. candidates below the cut are among the last; of those tied at it, the ones ranked
   last fill the ``n`` (``select_evictions``'s order: score descending, ties by candidate
   order: kept rows by position, then new ids by count descending, id ascending). As the
   ranges are in id (and position) order, each rank sends only its count below the cut,
   its tied kept rows and its tied new ids per count, and every rank works out how many
   of its own tied ones rank last;
4. each rank sends its matched rows' new metadata, its evicted positions and its
   admitted new ids; every rank applies the matches and pairs the admitted ids (best
   first) with the evicted positions (best first), as ``select_evictions`` pairs them.

Scores are recomputed from the exchanged counts and last access by the policy's own
elementwise ops, so they are bit-identical to the unsplit ones. The re-sort and the
index rebuild stay on every rank (each needs the whole map). Policies with a
``threshold_filter`` are not split: the filters read the whole window's counts (or draw
random numbers in its order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from dtrec.comm.collectives import all_gather_varied, collective
from dtrec.modules.eviction import INT64_MAX, EvictionPolicy


@dataclass
class Decisions:
    """What every rank applies to its copy of the map, the same on every rank."""

    matched: Tensor
    """Map positions whose id the window saw."""
    matched_counts: Tensor | None
    """Their counts after the window (None: the policy keeps no counts)."""
    matched_access: Tensor | None
    """Their last access after the window (None: the policy keeps none)."""
    evicted: Tensor
    """Map positions given up, best ranked first."""
    admitted: Tensor
    """Raw ids taking them, paired in order."""
    admitted_counts: Tensor | None
    """Their window counts."""
    admitted_access: Tensor | None
    """Their window last access."""


@torch.no_grad()
def coalesce_window(
    ids: Tensor, counts: Tensor, access: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Window summaries with repeated ids as one: sorted unique ids, summed counts,
    latest access (``torch.unique`` over the ids they summarise gives the same)."""
    merged, inverse = torch.unique(ids, return_inverse=True)
    total = torch.zeros_like(merged).scatter_add_(0, inverse, counts)
    if access is None:
        return merged, total, None
    latest = torch.zeros_like(merged).scatter_reduce_(
        0, inverse, access, reduce="amax", include_self=False
    )
    return merged, total, latest


def range_bounds(input_hash_size: int, ranks: int) -> list[int]:
    """``ranks + 1`` raw-id bounds: rank ``r`` decides for ``[b[r], b[r + 1])``; the last
    range also holds ``INT64_MAX`` (the map's empty slots and its miss position), the first
    starts at int64 min (ids below 0 can only come with ``bounds_check="off"``)."""
    step = -(-input_hash_size // ranks)
    return [-INT64_MAX - 1] + [min(r * step, INT64_MAX) for r in range(1, ranks)] + [INT64_MAX]


def _scores(policy: EvictionPolicy, it: int, counts: Tensor, access: Tensor) -> Tensor:
    meta = policy.metadata
    return policy.scores(
        it, counts if "counts" in meta else None, access if "last_access_iter" in meta else None
    )


@torch.no_grad()
def split_admit(
    kept: Tensor,
    counts_buf: Tensor | None,
    access_buf: Tensor | None,
    policy: EvictionPolicy,
    it: int,
    window: Tensor,
    input_hash_size: int,
    group: ProcessGroup | None,
) -> Decisions:
    """The decisions of an eviction at step ``it``, this rank deciding for its raw-id
    range. ``kept``: the sorted map's ids; ``counts_buf`` / ``access_buf``: its metadata
    (read only); ``window``: every rank's window summaries, gathered, ``[N, 3]`` int64
    (id, count, last access; repeated ids allowed). Collective over ``group``."""
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    device = kept.device
    bounds = range_bounds(input_hash_size, ranks)
    lo, hi = bounds[me], bounds[me + 1]
    ids = window[:, 0]
    mine = (ids >= lo) & ((ids < hi) if me < ranks - 1 else (ids <= hi))
    uniq, counts, access = coalesce_window(ids[mine], window[mine, 1], window[mine, 2])
    assert access is not None
    zch = kept.numel()
    p0 = int(torch.searchsorted(kept, torch.tensor([lo], device=device)))
    end = torch.tensor([hi], device=device)
    p1 = zch if me == ranks - 1 else int(torch.searchsorted(kept, end))
    segment = kept[p0:p1]
    at = torch.searchsorted(segment, uniq)
    if segment.numel():
        hit = (at < segment.numel()) & (segment[at.clamp(max=segment.numel() - 1)] == uniq)
    else:
        hit = torch.zeros_like(uniq, dtype=torch.bool)
    matched = p0 + at[hit]
    zeros = torch.zeros(p1 - p0, dtype=torch.int64, device=device)
    seg_counts = zeros.clone() if counts_buf is None else counts_buf[p0:p1].clone()
    seg_access = zeros.clone() if access_buf is None else access_buf[p0:p1].clone()
    seg_counts[at[hit]] += counts[hit]
    seg_access[at[hit]] = access[hit]
    if me == ranks - 1 and p1 > p0:  # the miss position (the map's last) is never evicted
        seg_counts[-1], seg_access[-1] = INT64_MAX, it
    new = ~hit
    new_ids, new_counts, new_access = uniq[new], counts[new], access[new]

    # 2. the score of the global n-th last (the cut): among each range's n lowest scores
    n = torch.tensor([new_ids.numel()], dtype=torch.int64, device=device)
    with collective("managed_collision.evict.new", 8 * (ranks - 1), group):
        dist.all_reduce(n, group=group)
    total_new = int(n)
    positions = torch.arange(p0, p1, device=device)
    kept_scores = _scores(policy, it, seg_counts, seg_access)
    new_scores = _scores(policy, it, new_counts, new_access)
    scores = torch.cat([kept_scores, new_scores])
    if 0 < total_new < scores.numel():
        local_cut = torch.kthvalue(scores, total_new).values
        lows = scores[scores < local_cut]
        lows = torch.cat([lows, local_cut.repeat(total_new - lows.numel())])
    else:
        lows = scores if total_new else scores[:0]
    lows = torch.cat(all_gather_varied(lows, group, "managed_collision.evict.scores"))
    if total_new:
        cut = torch.kthvalue(lows, total_new).values
        kept_below, new_below = kept_scores < cut, new_scores < cut
        kept_tied, new_tied = kept_scores == cut, new_scores == cut
    else:
        kept_below = kept_tied = torch.zeros_like(kept_scores, dtype=torch.bool)
        new_below = new_tied = torch.zeros_like(new_scores, dtype=torch.bool)

    # 3. of the candidates tied at the cut, those ranked last fill the n. Ranked last
    # first: new ids (by count ascending, then id descending), then kept rows (position
    # descending); ranges are in id and position order, so within a count the last
    # range's ids come first, and the last range's kept rows. Each range sends how many
    # it has below the cut, tied kept rows, and tied new ids per count; every rank
    # then knows how many of its own tied ones are ranked last.
    below = int(kept_below.sum() + new_below.sum())
    values, numbers = torch.unique(new_counts[new_tied], return_counts=True)
    head = torch.tensor([below, int(kept_tied.sum())], dtype=torch.int64, device=device)
    parts = all_gather_varied(
        torch.cat([head, values, numbers]), group, "managed_collision.evict.tied"
    )
    short = total_new - sum(int(part[0]) for part in parts)
    tied_kept = [int(part[1]) for part in parts]
    per_count: dict[int, list[int]] = {}
    for r, part in enumerate(parts):
        k = (part.numel() - 2) // 2
        for value, number in zip(part[2 : 2 + k].tolist(), part[2 + k :].tolist(), strict=True):
            per_count.setdefault(value, [0] * ranks)[r] = number
    full_below = None  # tied new ids with a count below this are all ranked last
    take_new, take_kept = 0, 0  # this rank's tied ids of count full_below / kept rows taken
    for value in sorted(per_count):
        numbers_r = per_count[value]
        if short >= sum(numbers_r):
            short -= sum(numbers_r)
            continue
        full_below = value
        for r in range(ranks - 1, -1, -1):
            taken = min(short, numbers_r[r])
            take_new = taken if r == me else take_new
            short -= taken
        break
    for r in range(ranks - 1, -1, -1):
        taken = min(short, tied_kept[r])
        take_kept = taken if r == me else take_kept
        short -= taken
    new_last = new_below.clone()
    if full_below is None:  # every tied new id is ranked last
        new_last |= new_tied
    else:
        new_last |= new_tied & (new_counts < full_below)
        at_value = (new_tied & (new_counts == full_below)).nonzero().squeeze(1)
        new_last[at_value[at_value.numel() - take_new :] if take_new else at_value[:0]] = True
    kept_at = kept_tied.nonzero().squeeze(1)
    evicted = kept_below.clone()
    evicted[kept_at[kept_at.numel() - take_kept :] if take_kept else kept_at[:0]] = True
    admitted = ~new_last

    # 4. matched metadata, evicted positions and admitted ids, from every range; ranges
    # are in id order, so their evicted positions and admitted ids come out ascending
    matches = torch.stack([matched, seg_counts[at[hit]], seg_access[at[hit]]], 1)
    givers = torch.stack([positions, seg_counts, seg_access], 1)[evicted]
    takers = torch.stack([new_ids, new_counts, new_access], 1)[admitted]
    header = torch.tensor([matches.shape[0], givers.shape[0]], dtype=torch.int64, device=device)
    sent = torch.cat([header, matches.flatten(), givers.flatten(), takers.flatten()])
    matched_all, give, take = [], [], []
    for part in all_gather_varied(sent, group, "managed_collision.evict.apply"):
        m, g = int(part[0]), int(part[1])
        matched_all.append(part[2 : 2 + 3 * m].view(-1, 3))
        give.append(part[2 + 3 * m : 2 + 3 * (m + g)].view(-1, 3))
        take.append(part[2 + 3 * (m + g) :].view(-1, 3))
    match_rows, give_rows, adm_rows = torch.cat(matched_all), torch.cat(give), torch.cat(take)
    # best ranked first, as select_evictions pairs them: evicted by score descending, then
    # position ascending; admitted by score descending, then count descending, id ascending
    give_scores = _scores(policy, it, give_rows[:, 1], give_rows[:, 2])
    evicted_pos = give_rows[torch.argsort(give_scores, descending=True, stable=True), 0]
    by_count = torch.argsort(adm_rows[:, 1], descending=True, stable=True)
    adm_rows = adm_rows[by_count]
    adm_scores = _scores(policy, it, adm_rows[:, 1], adm_rows[:, 2])
    adm_rows = adm_rows[torch.argsort(adm_scores, descending=True, stable=True)]
    assert adm_rows.shape[0] == evicted_pos.numel()
    meta = policy.metadata
    return Decisions(
        matched=match_rows[:, 0],
        matched_counts=match_rows[:, 1] if "counts" in meta else None,
        matched_access=match_rows[:, 2] if "last_access_iter" in meta else None,
        evicted=evicted_pos,
        admitted=adm_rows[:, 0],
        admitted_counts=adm_rows[:, 1] if "counts" in meta else None,
        admitted_access=adm_rows[:, 2] if "last_access_iter" in meta else None,
    )


__all__ = ["Decisions", "coalesce_window", "range_bounds", "split_admit"]
