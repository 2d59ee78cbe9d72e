"""Managed-collision collections: TorchRec's state-dict keys and remapped ids, evicted
rows reset before their first lookup (weights and optimizer state)."""

from __future__ import annotations

import pytest
import torch

from dtrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from dtrec.modules.eviction import LFU, LRU, DistanceLFU
from dtrec.modules.init import reset_rows_init
from dtrec.modules.managed_collision import MCHManagedCollisionModule
from dtrec.modules.mc_collection import (
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    reset_torch_optimizer_rows,
)
from dtrec.optim import Adam
from dtrec.placements import TableSpec
from tests.managed_collision.torchrec_mc import torchrec_remappers

# table "user" read by two features (one remapper step sees both), "item" by one
TABLES = [("user", 11, 4, ["u0", "u1"], "sum"), ("item", 7, 3, ["i0"], "mean")]
POLICY = {"user": LFU(), "item": DistanceLFU(decay_exponent=0.5)}
INTERVAL = {"user": 2, "item": 1}


def _dtrec_module(return_remapped=True):
    cfgs = [EmbeddingBagConfig(n, r, d, f, p) for n, r, d, f, p in TABLES]
    mcs = {
        n: MCHManagedCollisionModule(
            r, eviction_policy=POLICY[n], eviction_interval=INTERVAL[n], name=n
        )
        for n, r, *_ in TABLES
    }
    return ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(cfgs),
        ManagedCollisionCollection(mcs, cfgs),
        return_remapped_features=return_remapped,
    )


def _batches(steps, batch=6, seed=0):
    """Raw ids over the full int63 range: a few hot, many cold; lengths vary per bag but
    every step has the same number of ids per table (TorchRec's window buffer)."""
    gen = torch.Generator().manual_seed(seed)
    hot = torch.randint(0, 2**62, (12,), generator=gen)
    keys = ["i0", "u1", "u0", "extra"]  # any order, a key no table reads
    for _ in range(steps):
        lengths = torch.stack([torch.randperm(batch, generator=gen) % 3 for _ in keys]).flatten()
        n = int(lengths.sum())
        pick = torch.randint(0, 12, (n,), generator=gen)
        cold = torch.randint(0, 2**62, (n,), generator=gen)
        values = torch.where(torch.rand(n, generator=gen) < 0.7, hot[pick], cold)
        yield keys, values, lengths


def _torchrec_module():
    trc = pytest.importorskip("torchrec", reason="torchrec not installed")
    from torchrec.modules import mc_modules as mcm
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection

    cfgs = [
        trc.EmbeddingBagConfig(
            name=n,
            num_embeddings=r,
            embedding_dim=d,
            feature_names=f,
            pooling=trc.PoolingType.SUM if p == "sum" else trc.PoolingType.MEAN,
        )
        for n, r, d, f, p in TABLES
    ]
    mcs = torchrec_remappers([(n, r) for n, r, *_ in TABLES], INTERVAL)
    return ManagedCollisionEmbeddingBagCollection(
        trc.EmbeddingBagCollection(cfgs),
        mcm.ManagedCollisionCollection(mcs, cfgs),
        return_remapped_features=True,
    ), trc


def test_state_dict_matches_torchrec_both_ways():
    theirs, _ = _torchrec_module()
    ours = _dtrec_module()
    mine, their = ours.state_dict(), theirs.state_dict()
    assert list(mine) == list(their)
    for key in mine:
        assert mine[key].shape == their[key].shape and mine[key].dtype == their[key].dtype, key
    ours.load_state_dict(their)
    theirs.load_state_dict(mine)


def test_remap_and_pooling_equal_torchrec_over_a_stream():
    theirs, trc = _torchrec_module()
    ours = _dtrec_module()
    ours.load_state_dict(theirs.state_dict())
    evicted_steps = 0
    evictions = {}
    ours.register_eviction_hook(lambda t, r: evictions.__setitem__(t, r.clone()))

    def removed(table, rows):
        raise AssertionError("a removed hook ran")

    ours.register_eviction_hook(removed).remove()
    for step, (keys, values, lengths) in enumerate(_batches(30)):
        kjt = KeyedJaggedTensor(keys, values, lengths)
        trc_kjt = trc.KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)
        before = {n: ours.table_weight(n).detach().clone() for n, *_ in TABLES}
        evictions.clear()
        pooled, remapped = ours(kjt)
        _, their_remapped = theirs(trc_kjt)
        assert remapped.keys() == their_remapped.keys() == ["u0", "u1", "i0"]
        assert torch.equal(remapped.values(), their_remapped.values()), step
        assert torch.equal(remapped.lengths(), their_remapped.lengths()), step
        # the pooled output is TorchRec's EBC on the remapped batch with our (reset) weights
        theirs._embedding_module.load_state_dict(ours._embedding_module.state_dict())
        want = theirs._embedding_module(their_remapped)
        assert want.keys() == pooled.keys() and torch.allclose(want.values(), pooled.values())
        for name, rows in evictions.items():
            evicted_steps += 1
            weight = ours.table_weight(name).detach()
            it = ours._managed_collision_collection._managed_collision_modules[name].current_iter
            fresh = reset_rows_init(name, weight.shape[0], weight.shape[1], rows, it, 0)
            assert torch.equal(weight[rows], fresh), (step, name)
            kept = torch.ones(weight.shape[0], dtype=torch.bool)
            kept[rows] = False
            assert torch.equal(weight[kept], before[name][kept]), (step, name)
    assert evicted_steps >= 10
    # the remapper state after the stream is TorchRec's
    their = theirs.state_dict()
    for key, value in ours.state_dict().items():
        if "_managed_collision_collection" in key:
            assert torch.equal(value, their[key]), key


def test_training_resets_optimizer_rows():
    torch.manual_seed(0)
    ours = _dtrec_module(return_remapped=False)
    opt = torch.optim.Adam(ours.parameters(), lr=0.01)
    seen = []

    def reset(table, rows):
        seen.append((table, rows.clone()))
        reset_torch_optimizer_rows(opt, ours.table_weight(table), rows)
        state = opt.state.get(ours.table_weight(table))
        if state:
            assert not state["exp_avg"][rows].any() and not state["exp_avg_sq"][rows].any()

    ours.register_eviction_hook(reset)
    for keys, values, lengths in _batches(12, seed=3):
        pooled, none = ours(KeyedJaggedTensor(keys, values, lengths))
        assert none is None
        opt.zero_grad()
        pooled.values().pow(2).sum().backward()
        opt.step()
    assert {t for t, _ in seen} == {"user", "item"}


def test_fused_optimizer_reset_rows():
    weight = torch.randn(6, 3)
    rule = Adam(lr=0.1)
    state = rule.init_state(weight)
    rule.update_rows(weight, state, torch.tensor([0, 2, 4]), torch.randn(3, 3))
    step = state["step"].clone()
    rule.reset_rows(weight, state, torch.tensor([2, 4]))
    assert not state["exp_avg"][[2, 4]].any() and not state["exp_avg_sq"][[2, 4]].any()
    assert state["exp_avg"][0].any() and torch.equal(state["step"], step)


def test_reset_values_do_not_depend_on_the_row_subset():
    rows = torch.tensor([9, 2, 5, 0])
    whole = reset_rows_init("t", 10, 8, rows, 7, 0)
    part = reset_rows_init("t", 10, 8, rows[1:3], 7, 0, cols=(3, 8))
    assert torch.equal(whole[1:3, 3:], part)
    assert whole.abs().max() <= (1 / 10) ** 0.5
    assert not torch.equal(whole, reset_rows_init("t", 10, 8, rows, 8, 0))


def test_mismatched_tables_are_clear_errors():
    cfgs = [EmbeddingBagConfig("user", 11, 4, ["u0"])]
    mc = MCHManagedCollisionModule(10, eviction_policy=LRU(), eviction_interval=1)
    with pytest.raises(ValueError, match="'user'.*zch_size 10.*num_embeddings 11"):
        ManagedCollisionCollection({"user": mc}, cfgs)
    with pytest.raises(TypeError, match="'user'.*got none"):
        ManagedCollisionCollection({}, cfgs)
    good = MCHManagedCollisionModule(11, eviction_policy=LRU(), eviction_interval=1)
    with pytest.raises(KeyError, match="other"):
        ManagedCollisionCollection({"user": good, "other": mc}, cfgs)
    mcc = ManagedCollisionCollection({"user": good}, cfgs)
    other = EmbeddingBagCollection([EmbeddingBagConfig("user", 11, 4, ["u9"])])
    with pytest.raises(ValueError, match="same tables and features"):
        ManagedCollisionEmbeddingBagCollection(other, mcc)
    with pytest.raises(KeyError, match="lacks feature"):
        mcc(KeyedJaggedTensor(["x"], torch.tensor([1]), torch.tensor([1])))


class _OtherSpec(TableSpec):
    """A user-defined table type: managed collision does not know how it holds rows."""

    def layout(self, table, axis):
        raise NotImplementedError


def test_distribute_module_refuses_what_is_not_supported_by_name():
    import dtrec
    from dtrec.planning.plan import find_collections
    from tests.fake_world import fake_world

    alone = torch.nn.Module()
    alone.remap = MCHManagedCollisionModule(5, eviction_policy=LFU(), eviction_interval=1)
    with pytest.raises(TypeError, match="'remap' is a dtrec MCHManagedCollisionModule outside"):
        find_collections(alone)
    model = torch.nn.Module()
    model.sparse = _dtrec_module()
    assert list(find_collections(model)) == ["sparse._embedding_module"]
    with fake_world(0, 2):
        mesh = dtrec.init_mesh("cpu", 2)
        sgd = dtrec.optim.SGD(lr=0.1)
        refused = {
            "offloaded tables": dtrec.placements.RowWise(cache_rows=4),
            "fully sharded": dtrec.placements.TableWise(rank=0, fully_sharded=True),
            "only RowWise": _OtherSpec(),
        }
        for why, spec in refused.items():
            plan = {"sparse._embedding_module.item": spec}
            with pytest.raises(ValueError, match=f"'sparse._embedding_module.item': {why}"):
                dtrec.distribute_module(model, mesh, plan, optimizer=sgd)
        with pytest.raises(ValueError, match="same_batch"):
            dtrec.distribute_module(model, mesh, optimizer=sgd, same_batch=mesh["shard"])
