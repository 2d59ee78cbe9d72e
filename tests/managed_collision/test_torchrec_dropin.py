"""TorchRec's ManagedCollisionEmbeddingBagCollection as a drop-in for distribute_module.

The TorchRec module is converted (``dtrec.interop.managed_collision``: same weights,
remapper state and window in progress, same state-dict keys) and sharded row-wise, or on
the types TorchRec does not shard managed collision on (grid and data-parallel S=4 under
Adam, table-row-wise and column-wise 2x2 under SGD). On 4 gloo ranks (S=4 and 2x2, fused
SGD and Adam) over a stream of batches with evictions,
the distributed model equals the unsharded TorchRec module run on the global batch in
TorchRec's sharded order (remap, reset the evicted rows, look up): each rank's
remapped ids, the evicted rows and every remapper buffer are TorchRec's after every
step, weights and fused state within 1e-5; its state dict loads into the unsharded
TorchRec module and back.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.managed_collision.test_sharded import _plan
from tests.managed_collision.torchrec_mc import torchrec_remappers
from tests.multiprocess import run_world

trc = pytest.importorskip("torchrec", reason="torchrec not installed")

TABLES = [("user", 37, 6, ["u0", "u1"], "sum"), ("item", 10, 4, ["i0"], "mean")]
KEYS = ["u0", "u1", "i0"]
BATCH, LR, PER_BAG = 4, 0.3, 2
INTERVAL = {"user": 3, "item": 1}
CONFIGS = {  # name: (shard group size, fused optimizer, steps, plan: default row-wise)
    "1d_sgd": (4, "sgd", 40, None),
    "2x2_adam": (2, "adam", 40, None),
    # the types TorchRec does not shard managed collision on (it is row-wise only)
    "1d_grid_dp_adam": (4, "adam", 25, ("grid", "dp")),
    "2x2_trw_cw_sgd": (2, "sgd", 25, ("trw", "cw")),
}


def _torchrec_mc_ebc(intervals=None):
    from torchrec.modules import mc_modules as mcm
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection

    intervals = intervals or INTERVAL
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
    mcs = torchrec_remappers([(n, r) for n, r, *_ in TABLES], intervals)
    return ManagedCollisionEmbeddingBagCollection(
        trc.EmbeddingBagCollection(cfgs),
        mcm.ManagedCollisionCollection(mcs, cfgs),
        return_remapped_features=True,
    )


class Model(nn.Module):
    """A user's model holding TorchRec's MC-EBC, unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.sparse = _torchrec_mc_ebc()
        self.dense = nn.Linear(6 * 2 + 4, 1)

    def forward(self, kjt):
        pooled, remapped = self.sparse(kjt)
        return self.dense(pooled.values()).squeeze(1), remapped


def _batches(world, gen, hot):
    """Every rank's batch of one step (TorchRec KJTs): mostly hot ids, the rest cold 62-bit;
    a fixed number of ids per step, as TorchRec's window buffer needs."""
    out = []
    for _ in range(world):
        lengths = torch.full((len(KEYS) * BATCH,), PER_BAG)
        n = int(lengths.sum())
        pick = hot[torch.randint(0, hot.numel(), (n,), generator=gen)]
        cold = torch.randint(0, 2**62, (n,), generator=gen)
        values = torch.where(torch.rand(n, generator=gen) < 0.8, pick, cold)
        kjt = trc.KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths)
        out.append((kjt, torch.randn(BATCH, generator=gen)))
    return out


def _global(batches):
    parts = [kjt.to_dict() for kjt, _ in batches]
    values = torch.cat([p[k].values() for k in KEYS for p in parts])
    lengths = torch.cat([p[k].lengths() for k in KEYS for p in parts])
    return trc.KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths)


def _loss(pred, target):
    return ((pred - target) ** 2).sum() / max(target.numel(), 1)


def _remappers(mc_ebc):
    return mc_ebc._managed_collision_collection._managed_collision_modules


class Reference:
    """The unsharded TorchRec module on the global batch, in TorchRec's sharded order:
    remap, reset evicted rows (weights to the config's uniform init redrawn as dtrec
    does, fused state to its init), look up; the fused update by hand."""

    def __init__(self, model, fused):
        self.model, self.fused = model, fused
        self.tables = model.sparse._embedding_module.embedding_bags
        self.state = {n: fused.init_state(t.weight) for n, t in self.tables.items()}
        self.opt = torch.optim.SGD(model.dense.parameters(), lr=LR)

    def step(self, batches):
        from dtrec.modules.init import reset_rows_init, uniform_init_bounds

        sparse = self.model.sparse
        remapped = sparse._managed_collision_collection(_global(batches))
        evicted = {}
        configs = {c.name: c for c in sparse._embedding_module.embedding_bag_configs()}
        for table, rows in sparse._managed_collision_collection.evict().items():
            if rows is None or rows.numel() == 0:
                continue
            evicted[table] = rows.clone()
            weight, cfg = self.tables[table].weight, configs[table]
            step = int(_remappers(sparse)[table]._current_iter_tensor)
            with torch.no_grad():
                weight[rows] = reset_rows_init(
                    table, cfg.num_embeddings, cfg.embedding_dim, rows, step, 0,
                    bounds=uniform_init_bounds(cfg.init_fn),
                )  # fmt: skip
            self.fused.reset_rows(weight, self.state[table], rows)
        pooled = sparse._embedding_module(remapped)
        pred = self.model.dense(pooled.values()).squeeze(1)
        losses = [_loss(pred[r * BATCH : (r + 1) * BATCH], t) for r, (_, t) in enumerate(batches)]
        torch.stack(losses).mean().backward()
        for name, cfg in configs.items():
            weight = self.tables[name].weight
            rows = torch.unique(torch.cat([remapped[f].values() for f in cfg.feature_names]))
            with torch.no_grad():
                self.fused.update_rows(weight, self.state[name], rows, weight.grad[rows])
            weight.grad = None
        self.opt.step()
        self.opt.zero_grad()
        return remapped, evicted


def _one(rank, world, shard, opt_name, steps, kinds):
    import dtrec
    from dtrec.placements.mesh import shard_position

    fused = dtrec.optim.SGD(lr=LR) if opt_name == "sgd" else dtrec.optim.Adam(lr=LR / 10)
    torch.manual_seed(0)
    model = Model()
    reference = Reference(copy.deepcopy(model), fused)
    nodes = kinds is not None and bool({"trw", "grid"} & set(kinds))  # 2 nodes
    mesh = dtrec.init_mesh("cpu", shard_group_size=shard, node_size=shard // 2 if nodes else None)
    sharded = dtrec.distribute_module(model, mesh, _plan(kinds), optimizer=fused)
    out = {"mismatch": [], "evictions": 0, "is_dtrec": type(sharded.sparse).__module__}
    out["same_keys"] = list(sharded.state_dict()) == list(reference.model.state_dict())
    evicted = {}
    sharded.sparse.register_eviction_hook(lambda t, r: evicted.__setitem__(t, r.clone()))
    opt = torch.optim.SGD(sharded.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(1)
    hot = torch.randint(0, 2**62, (60,), generator=gen)
    for step in range(steps):
        batches = _batches(world, gen, hot)
        evicted.clear()
        pred, remapped = sharded(batches[rank][0])
        _loss(pred, batches[rank][1]).backward()
        opt.step()
        opt.zero_grad()
        ref_remapped, ref_evicted = reference.step(batches)
        for key in KEYS:  # this rank's part of the global batch
            n = BATCH * PER_BAG
            want = ref_remapped[key].values()[rank * n : (rank + 1) * n]
            if not torch.equal(remapped[key].values(), want):
                out["mismatch"].append((step, "remap", key))
        mine = {k: sorted(v.tolist()) for k, v in evicted.items()}
        if mine != {k: sorted(v.tolist()) for k, v in ref_evicted.items()}:
            out["mismatch"].append((step, "evicted"))
        out["evictions"] += len(mine)
        for name, mc in _remappers(sharded.sparse).items():
            want = _remappers(reference.model.sparse)[name].state_dict()
            got = mc.state_dict()
            if list(got) != list(want) or any(not torch.equal(got[k], want[k]) for k in want):
                out["mismatch"].append((step, "remapper", name))

    inner = sharded.sparse._embedding_module
    fused_state = inner.fused_optimizer_state()
    out["weight_diff"] = out["state_diff"] = 0.0
    for name, table in inner.embedding_bags.items():
        block = table.layout.block_at(shard_position(mesh))
        if block is None:  # a table-wise table on another rank
            continue
        (r0, r1), (c0, c1) = block.rows, block.cols
        want = reference.tables[name].weight.detach()[r0:r1, c0:c1]
        diff = (table.weight.to_local() - want).abs().max().item()
        out["weight_diff"] = max(out["weight_diff"], diff)
        for key, value in fused_state[name].items():
            if value.dim():
                ref_value = reference.state[name][key][r0:r1]
                ref_value = ref_value[:, c0:c1] if ref_value.dim() == 2 else ref_value
                diff = (value - ref_value).abs().max().item()
                out["state_diff"] = max(out["state_diff"], diff)
    out["dense_diff"] = (
        (sharded.dense.weight.to_local() - reference.model.dense.weight).abs().max().item()
    )

    # the sharded state dict loads into the unsharded TorchRec module, and back
    full = dtrec.checkpoint.full_state_dict(sharded)
    plain = Model()
    plain.load_state_dict(full)
    loaded = plain.state_dict()
    out["into_torchrec_keys"] = list(loaded) == list(full)
    out["into_torchrec_diff"] = max(
        (loaded[k].double() - v.double()).abs().max().item() for k, v in full.items()
    )
    out["into_torchrec_vs_reference"] = max(
        (loaded[k].double() - v.double()).abs().max().item()
        for k, v in reference.model.state_dict().items()
    )
    sharded.load_state_dict(plain.state_dict())
    again = dtrec.checkpoint.full_state_dict(sharded)
    out["round_trip"] = all(torch.equal(again[k], full[k]) for k in full)
    return out


def _run_all(rank, world, configs):
    return {name: _one(rank, world, *cfg) for name, cfg in configs.items()}


@pytest.fixture(scope="module")
def world_results():
    return run_world(4, _run_all, CONFIGS, timeout=600.0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_torchrec_mc_ebc_distributed_equals_torchrec_unsharded(world_results, name):
    for rank, results in enumerate(world_results):
        got = results[name]
        assert got["is_dtrec"] == "dtrec.modules.mc_collection", (rank, got["is_dtrec"])
        assert got["same_keys"], rank
        assert got["mismatch"] == [], (rank, got["mismatch"][:5])
        assert got["evictions"] >= 10, (rank, got["evictions"])
        assert got["weight_diff"] <= 1e-5, (rank, got["weight_diff"])
        assert got["state_diff"] <= 1e-5, (rank, got["state_diff"])
        assert got["dense_diff"] <= 1e-5, (rank, got["dense_diff"])
        assert got["into_torchrec_keys"], rank
        assert got["into_torchrec_diff"] == 0.0, (rank, got["into_torchrec_diff"])
        assert got["into_torchrec_vs_reference"] <= 1e-5, (rank, got)
        assert got["round_trip"], rank


# ---------------------------------------------------------------- unsharded conversion


def _stream(steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hot = torch.randint(0, 2**62, (12,), generator=gen)
    for _ in range(steps):
        lengths = torch.full((len(KEYS) * 3,), 2)
        n = int(lengths.sum())
        pick = hot[torch.randint(0, 12, (n,), generator=gen)]
        cold = torch.randint(0, 2**62, (n,), generator=gen)
        yield torch.where(torch.rand(n, generator=gen) < 0.7, pick, cold), lengths


def test_converted_mid_window_continues_as_torchrec():
    """Converted after 4 steps (inside both tables' windows), dtrec's module remaps and
    evicts as TorchRec's keeps doing; weights are shared, keys equal."""
    import dtrec
    from dtrec.interop.managed_collision import from_torchrec_mc_collection

    theirs = _torchrec_mc_ebc({"user": 3, "item": 2})
    stream = _stream(24)
    for _, (values, lengths) in zip(range(4), stream, strict=False):
        theirs(trc.KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths))
    ours = from_torchrec_mc_collection(theirs)
    assert isinstance(ours, dtrec.ManagedCollisionEmbeddingBagCollection)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert ours.table_weight("user") is theirs._embedding_module.embedding_bags["user"].weight
    assert ours.tables_with_init_fn() == []  # TorchRec's default uniform init: redrawn
    evicted = []
    ours.register_eviction_hook(lambda table, rows: evicted.append(table))
    for step, (values, lengths) in enumerate(stream):
        _, want = theirs(trc.KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths))
        _, got = ours(trc.KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths))
        assert torch.equal(got.values(), want.values()), step
        for name, mc in _remappers(ours).items():
            state, their_state = mc.state_dict(), _remappers(theirs)[name].state_dict()
            assert all(torch.equal(state[k], their_state[k]) for k in their_state), (step, name)
    assert len(evicted) >= 10


def test_unsupported_torchrec_fields_and_modules_are_named():
    """What distribute_module and dtrec.plan see (``find_collections``) names the table and
    field, or the module."""
    from torchrec.modules import mc_modules as mcm

    import dtrec
    from dtrec.planning.plan import find_collections

    model = Model()
    _remappers(model.sparse)["item"]._output_global_offset = 5
    with pytest.raises(ValueError, match="'item'.*output_global_offset=5"):
        find_collections(model)
    lone = nn.Module()
    lone.remap = mcm.MCHManagedCollisionModule(
        zch_size=5, device=torch.device("cpu"),
        eviction_policy=mcm.LFU_EvictionPolicy(), eviction_interval=1,
    )  # fmt: skip
    lone.ebc = dtrec.EmbeddingBagCollection([dtrec.EmbeddingBagConfig("t", 5, 4, ["f"])])
    with pytest.raises(
        TypeError, match=r"'remap'.*only inside a ManagedCollisionEmbedding\(Bag\)Collection"
    ):
        find_collections(lone)
    assert list(find_collections(Model())) == ["sparse._embedding_module"]
