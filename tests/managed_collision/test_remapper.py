"""The managed-collision remapper: TorchRec's hand-worked cases, and equality with
TorchRec's own ``MCHManagedCollisionModule`` over streams of batches with evictions."""

from __future__ import annotations

import pytest
import torch

from dtrec.modules.eviction import (
    LFU,
    LRU,
    DistanceLFU,
    average_threshold_filter,
    dynamic_threshold_filter,
    select_evictions,
    select_evictions_by_sort,
)
from dtrec.modules.managed_collision import MCHManagedCollisionModule, merge_order

MAX = torch.iinfo(torch.int64).max


def _mc(policy, zch_size=5, interval=1, **kw):
    return MCHManagedCollisionModule(
        zch_size, eviction_policy=policy, eviction_interval=interval, input_hash_size=100, **kw
    )


def _ids(*values):
    return torch.tensor(values, dtype=torch.int64)


def test_lfu_keeps_the_most_frequent_ids():
    # TorchRec's test_lfu_eviction: 4 (10 counts) and 5 (1 count) kept; a batch where
    # 6, 7, 8 appear three times: 5 and three empty slots give way, 4 stays
    mc = _mc(LFU())
    mc._mch_sorted_raw_ids[0:2] = _ids(4, 5)
    mc._mch_counts[0:2] = _ids(10, 1)
    mc(_ids(3, 4, 5, 6, 6, 6, 7, 7, 7, 8, 8, 8, 9, 10))
    assert mc._mch_sorted_raw_ids.tolist() == [4, 6, 7, 8, MAX]
    assert mc._mch_counts.tolist() == [11, 3, 3, 3, MAX]
    # the rows of 5 and of two empty slots went to new ids; the miss row (4) never moves
    assert sorted(mc.evict().tolist()) == [1, 2, 3]
    assert mc.evict() is None
    out = mc.eval()(_ids(4, 6, 7, 8, 5, 99))
    assert out[-2:].tolist() == [4, 4] and len(set(out[:4].tolist())) == 4
    assert 4 not in out[:4].tolist()


def test_lru_keeps_the_most_recent_ids():
    mc = _mc(LRU(decay_exponent=1.0))
    for batch in ((5, 6, 7), (3, 4, 5), (7, 8)):
        mc(_ids(*batch))
    assert mc._mch_sorted_raw_ids.tolist() == [3, 4, 7, 8, MAX]
    assert mc._mch_last_access_iter.tolist() == [2, 2, 3, 3, 3]


@pytest.mark.parametrize(
    ("decay", "ids", "counts", "access"),
    [
        (1.0, [3, 5, 7, 8], [1, 5, 1, 1], [2, 1, 3, 3]),
        (10.0, [3, 4, 7, 8], [1, 1, 1, 1], [2, 2, 3, 3]),
    ],
)
def test_distance_lfu(decay, ids, counts, access):
    mc = _mc(DistanceLFU(decay_exponent=decay))
    for batch in ((5, 5, 5, 5, 5, 6), (3, 4), (7, 8)):
        mc(_ids(*batch))
    assert mc._mch_sorted_raw_ids.tolist() == [*ids, MAX]
    assert mc._mch_counts.tolist() == [*counts, MAX]
    assert mc._mch_last_access_iter.tolist() == [*access, 3]


def test_threshold_filters():
    mc = _mc(LFU(threshold_filter=lambda c: dynamic_threshold_filter(c, 0.75)))
    mc(_ids(5, 5, 5, 5, 5, 4, 4, 4, 4, 3, 3, 3, 2, 2, 1))
    assert mc._mch_sorted_raw_ids.tolist() == [3, 4, 5, MAX, MAX]
    assert mc._mch_counts.tolist() == [3, 4, 5, 0, MAX]

    mc = _mc(LFU(threshold_filter=average_threshold_filter))
    mc._mch_sorted_raw_ids[0:2] = _ids(4, 5)
    mc._mch_counts[0:2] = _ids(10, 1)
    mc(_ids(3, 4, 5, 6, 6, 6, 7, 8, 8, 9, 10))
    assert mc._mch_sorted_raw_ids.tolist() == [4, 5, 6, 8, MAX]
    assert mc._mch_counts.tolist() == [10, 1, 3, 2, MAX]


def test_bad_ids_and_configs_are_clear_errors():
    mc = _mc(LFU(), name="user")
    with pytest.raises(IndexError, match="'user'.*id 100 outside"):
        mc(_ids(1, 100))
    with pytest.raises(IndexError, match="id -3"):
        mc(_ids(-3))
    hashed = _mc(LFU(), input_hash_func=lambda v, n: v.abs() % n)
    assert hashed(_ids(-3, 1003)).shape == (2,)
    with pytest.raises(ValueError, match="zch_size"):
        MCHManagedCollisionModule(0, eviction_policy=LFU(), eviction_interval=1)
    with pytest.raises(ValueError, match="eviction_interval"):
        MCHManagedCollisionModule(4, eviction_policy=LFU(), eviction_interval=0)
    with pytest.raises(TypeError, match="eviction_policy"):
        MCHManagedCollisionModule(4, eviction_policy="lfu", eviction_interval=1)
    with pytest.raises(ValueError, match="decay_exponent"):
        LRU(decay_exponent=-1.0)
    with pytest.raises(TypeError, match="threshold_filter"):
        LFU(threshold_filter=0.5)
    assert DistanceLFU(0.5).decay_exponent == 0.5  # TorchRec's positional order


def test_state_round_trip_keeps_the_map():
    mc = _mc(DistanceLFU(), zch_size=8, interval=2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        mc(torch.randint(0, 30, (20,), generator=gen))
    fresh = _mc(DistanceLFU(), zch_size=8, interval=2)
    fresh.load_state_dict(mc.state_dict())
    batch = torch.randint(0, 30, (50,), generator=gen)
    assert torch.equal(fresh.eval()(batch), mc.eval()(batch))
    assert fresh.current_iter == mc.current_iter == 6


# -- against TorchRec's own module ---------------------------------------------------


def _stream(steps, batch, id_range, seed):
    """Zipf-like ids (a few hot, many cold), same size every step (TorchRec's window
    buffer holds 1.25x the first batch's ids per step: no silent drop)."""
    gen = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, id_range + 1, dtype=torch.float64) ** 1.1
    perm = torch.randperm(id_range, generator=gen) * 7919 + 11
    for _ in range(steps):
        yield perm[torch.multinomial(weights, batch, replacement=True, generator=gen)]


def _torchrec_policy(tr, policy):
    kw = {"threshold_filtering_func": policy.threshold_filter}
    if isinstance(policy, LFU):
        return tr.LFU_EvictionPolicy(**kw)
    cls = tr.LRU_EvictionPolicy if isinstance(policy, LRU) else tr.DistanceLFU_EvictionPolicy
    return cls(decay_exponent=policy.decay_exponent, **kw)


POLICIES = [
    LFU(),
    LFU(threshold_filter=average_threshold_filter),
    LRU(),
    LRU(decay_exponent=0.5),
    DistanceLFU(),
    DistanceLFU(decay_exponent=2.0, threshold_filter=lambda c: dynamic_threshold_filter(c, 0.5)),
]


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
@pytest.mark.parametrize(("zch_size", "interval"), [(5, 1), (23, 3)])
def test_equals_torchrec_over_a_stream(policy, zch_size, interval):
    tr = pytest.importorskip("torchrec.modules.mc_modules", reason="torchrec not installed")
    from torchrec.sparse.jagged_tensor import JaggedTensor as TRJagged

    ours = MCHManagedCollisionModule(
        zch_size, eviction_policy=policy, eviction_interval=interval, name="t"
    )
    theirs = tr.MCHManagedCollisionModule(
        zch_size=zch_size,
        device=torch.device("cpu"),
        eviction_policy=_torchrec_policy(tr, policy),
        eviction_interval=interval,
    )
    evictions = 0
    for step, ids in enumerate(_stream(40, 32, 80, seed=zch_size)):
        training = step % 7 != 6  # an evaluation step now and then: remap only
        ours.train(training)
        theirs.train(training)
        want = theirs({"f": TRJagged(values=ids, lengths=torch.ones_like(ids))})["f"].values()
        got = ours(ids)
        assert torch.equal(got, want), step
        mine, their = ours.evict(), theirs.evict()
        assert (mine is None) == (their is None), step
        if mine is not None:
            evictions += 1
            assert torch.equal(mine.sort().values, their.sort().values), step
    assert evictions >= 40 // interval // 2
    theirs_state = theirs.state_dict()
    assert ours.state_dict().keys() == theirs_state.keys()
    for key, value in ours.state_dict().items():
        assert torch.equal(value, theirs_state[key]), key


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_select_evictions_sorts_only_the_tail_and_pairs_as_a_full_sort(dtype):
    """Many tied scores (LFU counts, LRU's few distances): the tail cut at the n-th
    smallest score must take the tied candidates at the highest positions, as the stable
    sort ranks them, and pair losers with newcomers in the same order."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(500):
        zch_size = int(torch.randint(1, 40, (1,), generator=gen))
        new = int(torch.randint(0, 40, (1,), generator=gen))
        scores = torch.randint(0, 5, (zch_size + new,), generator=gen).to(dtype)
        if dtype.is_floating_point:
            scores = -(scores + 1).pow(0.5)  # LRU-like: negative, few distinct values
        got, want = select_evictions(scores, zch_size), select_evictions_by_sort(scores, zch_size)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (scores, zch_size)


def test_merge_order_is_a_stable_argsort_after_an_eviction():
    """Sorted kept ids (empty slots = int64 max at the end) with some positions rewritten to
    new ids interleaving the untouched ones: the merge is the stable argsort."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(500):
        kept = (
            2 * torch.randperm(60, generator=gen)[: int(torch.randint(0, 40, (1,), generator=gen))]
        )
        empty = int(torch.randint(1, 6, (1,), generator=gen))
        values = torch.cat([kept.sort().values, torch.full((empty,), MAX)])
        k = int(torch.randint(0, values.numel(), (1,), generator=gen))
        changed = torch.randperm(values.numel() - 1, generator=gen)[:k]  # the miss slot stays
        values[changed] = 2 * torch.randperm(60, generator=gen)[:k] + 1  # odd: never kept
        assert torch.equal(merge_order(values, changed), torch.argsort(values, stable=True))


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every ATen op: a host sync shows up as ``_local_scalar_dense`` (``.item()``,
    ``bool()``) or ``nonzero`` (boolean-mask indexing)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "item"}


def test_lookup_path_has_no_host_sync(monkeypatch):
    """The torch ops of the lookup (what a GPU runs; dtrec's C pass off): no host sync
    and a bounded number of ops (launches on a GPU)."""
    from dtrec.kernels import cpu as cpu_kernels

    monkeypatch.setenv(cpu_kernels.ENV, "0")
    mc = MCHManagedCollisionModule(
        64, eviction_policy=DistanceLFU(), eviction_interval=4, bounds_check="off"
    )
    stream = _stream(9, 32, 200, seed=1)
    for ids in list(stream)[:4]:  # first eviction done; the step counter read once
        mc(ids)
    mc.evict()
    assert mc._index_key == mc._map_state()  # indexed at the eviction (interval > 1)
    for ids in _stream(3, 32, 200, seed=2):  # steps 5-7: record and remap only
        with _Ops() as rec:
            mc(ids)
        assert not SYNCS & set(rec.ops), rec.ops
        # the step counter's add_, then the index lookup: home (mul, >>), window (add),
        # ids and rows gathered (2 index), eq, where, amin, and 2 unsqueeze views
        assert len(rec.ops) <= 12, rec.ops
    with _Ops() as rec:
        mc.eval()(ids)
    assert not SYNCS & set(rec.ops) and len(rec.ops) <= 11, rec.ops
    searched = MCHManagedCollisionModule(  # evicting every step: the sorted-ids search
        64, eviction_policy=DistanceLFU(), eviction_interval=1, bounds_check="off"
    )
    searched(ids)
    with _Ops() as rec:
        searched.eval()(ids)
    assert not SYNCS & set(rec.ops) and len(rec.ops) <= 7, rec.ops
