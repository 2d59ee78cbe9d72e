"""An eviction split by raw-id range over the ranks (``dtrec.modules.split_eviction``)
makes the unsharded remapper's decisions, on 4 gloo ranks.

Bare remappers (no tables), each rank feeding its part of a global batch, the reference
fed all of it: after every step each rank's map (sorted ids, rows, counts, last access)
and the rows it reports evicted equal the reference's. Streams are chosen for ties
(few distinct counts and access steps: tied scores between kept rows and new ids), with
ids spread over all of ``[0, 2**63 - 1)`` or packed into the first rank's range (the
others decide for empty ranges). A policy with a threshold filter takes the unsplit path; so does
``split_eviction = False``; both give the same decisions. The split eviction step adds
its collectives (the count of new ids, the union of each range's last, the decisions);
the unsplit one only the window gather.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiprocess import run_world

STEPS = 40
CASES = {  # name: (policy, zch_size, interval, id range, split)
    "lfu_spread": ("lfu", 13, 1, 2**63 - 1, True),
    "lru_spread": ("lru1", 11, 1, 2**63 - 1, True),
    "lru1_packed": ("lru1", 9, 3, 2**20, True),
    "distance_lfu_spread": ("dlfu", 17, 1, 2**63 - 1, True),
    "distance_lfu_unsplit": ("dlfu", 17, 1, 2**63 - 1, False),
    "lfu_threshold_filter": ("lfu_filtered", 13, 2, 2**63 - 1, True),
}


def _policy(name):
    from dtrec.modules.eviction import LFU, LRU, DistanceLFU, average_threshold_filter

    return {
        "lfu": LFU(),
        "lru1": LRU(1.0),
        "dlfu": DistanceLFU(0.5),
        "lfu_filtered": LFU(threshold_filter=average_threshold_filter),
    }[name]


def _one(rank, world, policy, zch, interval, high, split):
    import dtrec

    def remapper():
        return dtrec.MCHManagedCollisionModule(
            zch, eviction_policy=_policy(policy), eviction_interval=interval, name="t"
        )

    mine, reference = remapper(), remapper()
    mine.share_window(None)
    mine.split_eviction = split
    gen = torch.Generator().manual_seed(3)
    hot = torch.randint(0, high, (2 * zch,), generator=gen)
    out = {"mismatch": [], "evictions": 0, "calls": set()}
    for step in range(STEPS):
        parts = []
        for _ in range(world):
            n = int(torch.randint(0, 8, (1,), generator=gen))
            cold = torch.randint(0, high, (n,), generator=gen)
            pick = hot[torch.randint(0, hot.numel(), (n,), generator=gen)]
            parts.append(torch.where(torch.rand(n, generator=gen) < 0.7, pick, cold))
        with dtrec.comm_stats() as stats:
            got = mine(parts[rank])
        want = reference(torch.cat(parts))
        start = sum(p.numel() for p in parts[:rank])
        if not torch.equal(got, want[start : start + parts[rank].numel()]):
            out["mismatch"].append((step, "remap"))
        a, b = mine.state_dict(), reference.state_dict()
        if any(not torch.equal(a[k], b[k]) for k in b):
            out["mismatch"].append((step, "state"))
        rows, ref_rows = mine.evict(), reference.evict()
        if (rows is None) != (ref_rows is None) or (
            rows is not None and rows.tolist() != ref_rows.tolist()
        ):
            out["mismatch"].append((step, "evicted"))
        out["evictions"] += rows is not None and rows.numel() > 0
        out["calls"] |= {k for k, v in stats.calls.items() if v}
    out["calls"] = sorted(out["calls"])
    return out


def _run_all(rank, world):
    return {name: _one(rank, world, *case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def results():
    return run_world(4, _run_all, timeout=300.0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_split_eviction_equals_the_unsharded_remapper(results, name):
    split = CASES[name][4] and CASES[name][0] != "lfu_filtered"
    evict_calls = [
        "managed_collision.evict.apply",
        "managed_collision.evict.apply.sizes",
        "managed_collision.evict.scores",
        "managed_collision.evict.scores.sizes",
        "managed_collision.evict.tied",
        "managed_collision.evict.tied.sizes",
        "managed_collision.evict.new",
    ]
    window_calls = ["managed_collision.window", "managed_collision.window.sizes"]
    for rank, got in enumerate(results):
        case = got[name]
        assert case["mismatch"] == [], (rank, case["mismatch"][:5])
        assert case["evictions"] >= 5, (rank, case["evictions"])
        assert case["calls"] == sorted(window_calls + (evict_calls if split else [])), (
            rank,
            case["calls"],
        )
