"""Managed collision for sequence tables: TorchRec's ManagedCollisionEmbeddingCollection,
converted and distributed, equals the unsharded TorchRec module.

Unsharded: converted after 4 steps (inside both windows), dtrec's module remaps, evicts
and looks up as TorchRec's keeps doing. On 4 gloo ranks (S=4 with fused SGD, 2x2 with
Adam, row-wise; S=4 Adam and 2x2 SGD with a column-wise and a table-wise table; 30 steps
with evictions; on a node-aware mesh S=4 grid + data-parallel under Adam and 2x2
data-parallel + table-row-wise under SGD, 20 steps): every rank's remapped ids, evicted
rows and remapper buffers are those of the unsharded TorchRec module on the global batch
(run in TorchRec's sharded order: remap, reset evicted rows, look up), weights within
1e-5; state-dict keys are TorchRec's and the sharded state dict loads into the unsharded
module.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.managed_collision.test_sharded import _plan
from tests.managed_collision.test_torchrec_dropin import (
    BATCH,
    KEYS,
    LR,
    PER_BAG,
    _batches,
    _global,
    _loss,
    _remappers,
)
from tests.managed_collision.torchrec_mc import torchrec_remappers
from tests.multiprocess import run_world

trc = pytest.importorskip("torchrec", reason="torchrec not installed")

TABLES = [("user", 37, 4, ["u0", "u1"]), ("item", 10, 4, ["i0"])]
CONFIGS = {  # name: (shard group size, fused optimizer, steps, plan: default row-wise)
    "1d_sgd": (4, "sgd", 30, None),
    "2x2_adam": (2, "adam", 30, None),
    "1d_cw_tw_adam": (4, "adam", 30, ("cw", "tw")),
    "2x2_tw_cw_sgd": (2, "sgd", 30, ("tw", "cw")),
    # the other types, on a node-aware mesh (2 nodes)
    "1d_grid_dp_adam": (4, "adam", 20, ("grid", "dp")),
    "2x2_dp_trw_sgd": (2, "sgd", 20, ("dp", "trw")),
}


def _torchrec_mc_ec(intervals=None):
    from torchrec.modules import mc_modules as mcm
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection

    intervals = intervals or {"user": 3, "item": 1}
    cfgs = [
        trc.EmbeddingConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=f)
        for n, r, d, f in TABLES
    ]
    mcs = torchrec_remappers([(n, r) for n, r, *_ in TABLES], intervals)
    return ManagedCollisionEmbeddingCollection(
        trc.EmbeddingCollection(cfgs),
        mcm.ManagedCollisionCollection(mcs, cfgs),
        return_remapped_features=True,
    )


def _pool(rows, batch):
    """Per feature, each sample's rows summed: [batch, features * D]."""
    out = []
    for key in KEYS:
        jt = rows[key]
        sample = torch.repeat_interleave(torch.arange(batch), jt.lengths())
        out.append(torch.zeros(batch, jt.values().shape[1]).index_add(0, sample, jt.values()))
    return torch.cat(out, dim=1)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sparse = _torchrec_mc_ec()
        self.dense = nn.Linear(4 * len(KEYS), 1)

    def forward(self, kjt):
        rows, remapped = self.sparse(kjt)
        return self.dense(_pool(rows, BATCH)).squeeze(1), remapped


def _one(rank, world, shard, opt_name, steps, kinds):
    import dtrec
    from dtrec.modules.init import reset_rows_init, uniform_init_bounds
    from dtrec.placements.mesh import shard_position

    fused = dtrec.optim.SGD(lr=LR) if opt_name == "sgd" else dtrec.optim.Adam(lr=LR / 10)
    torch.manual_seed(0)
    model = Model()
    ref = copy.deepcopy(model)
    nodes = kinds is not None and bool({"trw", "grid"} & set(kinds))  # 2 nodes
    mesh = dtrec.init_mesh("cpu", shard_group_size=shard, node_size=shard // 2 if nodes else None)
    sharded = dtrec.distribute_module(model, mesh, _plan(kinds), optimizer=fused)
    out = {"mismatch": [], "evictions": 0, "kind": type(sharded.sparse).__name__}
    out["same_keys"] = list(sharded.state_dict()) == list(ref.state_dict())
    tables = ref.sparse._embedding_module.embeddings
    configs = {c.name: c for c in ref.sparse._embedding_module.embedding_configs()}
    state = {n: fused.init_state(t.weight) for n, t in tables.items()}
    ref_opt = torch.optim.SGD(ref.dense.parameters(), lr=LR)
    opt = torch.optim.SGD(sharded.parameters(), lr=LR)
    evicted = {}
    sharded.sparse.register_eviction_hook(lambda t, r: evicted.__setitem__(t, r.clone()))
    gen = torch.Generator().manual_seed(1)
    hot = torch.randint(0, 2**62, (60,), generator=gen)
    for step in range(steps):
        batches = _batches(world, gen, hot)
        evicted.clear()
        pred, remapped = sharded(batches[rank][0])
        _loss(pred, batches[rank][1]).backward()
        opt.step()
        opt.zero_grad()

        mcc = ref.sparse._managed_collision_collection
        ref_remapped = mcc(_global(batches))
        ref_evicted = {}
        for table, rows in mcc.evict().items():
            if rows is None or rows.numel() == 0:
                continue
            ref_evicted[table] = rows.clone()
            weight, cfg = tables[table].weight, configs[table]
            it = int(_remappers(ref.sparse)[table]._current_iter_tensor)
            with torch.no_grad():
                weight[rows] = reset_rows_init(
                    table, cfg.num_embeddings, cfg.embedding_dim, rows, it, 0,
                    bounds=uniform_init_bounds(cfg.init_fn),
                )  # fmt: skip
            fused.reset_rows(weight, state[table], rows)
        ref_pred = ref.dense(_pool(ref.sparse._embedding_module(ref_remapped), world * BATCH))
        ref_pred = ref_pred.squeeze(1)
        losses = [
            _loss(ref_pred[r * BATCH : (r + 1) * BATCH], t) for r, (_, t) in enumerate(batches)
        ]
        torch.stack(losses).mean().backward()
        for name, cfg in configs.items():
            weight = tables[name].weight
            rows = torch.unique(torch.cat([ref_remapped[f].values() for f in cfg.feature_names]))
            with torch.no_grad():
                fused.update_rows(weight, state[name], rows, weight.grad[rows])
            weight.grad = None
        ref_opt.step()
        ref_opt.zero_grad()

        n = BATCH * PER_BAG
        for key in KEYS:
            want = ref_remapped[key].values()[rank * n : (rank + 1) * n]
            if not torch.equal(remapped[key].values(), want):
                out["mismatch"].append((step, "remap", key))
        mine = {k: sorted(v.tolist()) for k, v in evicted.items()}
        if mine != {k: sorted(v.tolist()) for k, v in ref_evicted.items()}:
            out["mismatch"].append((step, "evicted"))
        out["evictions"] += len(mine)
        for name, mc in _remappers(sharded.sparse).items():
            want_state = _remappers(ref.sparse)[name].state_dict()
            got = mc.state_dict()
            if any(not torch.equal(got[k], want_state[k]) for k in want_state):
                out["mismatch"].append((step, "remapper", name))

    inner = sharded.sparse._embedding_module
    out["weight_diff"] = 0.0
    for name, table in inner.embeddings.items():
        block = table.layout.block_at(shard_position(mesh))
        if block is None:  # a table-wise table on another rank
            continue
        (r0, r1), (c0, c1) = block.rows, block.cols
        want = tables[name].weight.detach()[r0:r1, c0:c1]
        diff = (table.weight.to_local() - want).abs().max().item()
        out["weight_diff"] = max(out["weight_diff"], diff)
    full = dtrec.checkpoint.full_state_dict(sharded)
    plain = Model()
    plain.load_state_dict(full)
    out["into_torchrec"] = all(torch.equal(plain.state_dict()[k], v) for k, v in full.items())
    return out


def _run_all(rank, world, configs):
    return {name: _one(rank, world, *cfg) for name, cfg in configs.items()}


@pytest.fixture(scope="module")
def world_results():
    return run_world(4, _run_all, CONFIGS, timeout=600.0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_torchrec_mc_ec_distributed_equals_torchrec_unsharded(world_results, name):
    for rank, results in enumerate(world_results):
        got = results[name]
        assert got["kind"] == "ManagedCollisionEmbeddingCollection", rank
        assert got["same_keys"], rank
        assert got["mismatch"] == [], (rank, got["mismatch"][:5])
        assert got["evictions"] >= 10, (rank, got["evictions"])
        assert got["weight_diff"] <= 1e-5, (rank, got["weight_diff"])
        assert got["into_torchrec"], rank


def test_converted_mc_ec_continues_as_torchrec():
    import dtrec
    from dtrec.interop.managed_collision import from_torchrec_mc_collection

    theirs = _torchrec_mc_ec({"user": 3, "item": 2})
    gen = torch.Generator().manual_seed(0)
    hot = torch.randint(0, 2**62, (12,), generator=gen)

    def batch():
        lengths = torch.full((len(KEYS) * 3,), 2)
        n = int(lengths.sum())
        pick = hot[torch.randint(0, 12, (n,), generator=gen)]
        values = torch.where(
            torch.rand(n, generator=gen) < 0.7, pick, torch.randint(0, 2**62, (n,), generator=gen)
        )
        return trc.KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths)

    for _ in range(4):
        theirs(batch())
    ours = from_torchrec_mc_collection(theirs)
    assert isinstance(ours, dtrec.ManagedCollisionEmbeddingCollection)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    evicted = []
    ours.register_eviction_hook(lambda table, rows: evicted.append(table))
    for step in range(20):
        kjt = batch()
        rows, got = ours(kjt)  # first: its reset of evicted rows is what TorchRec looks up
        their_rows, want = theirs(kjt)
        assert torch.equal(got.values(), want.values()), step
        for key in KEYS:
            assert torch.equal(rows[key].values(), their_rows[key].values()), (step, key)
    assert len(evicted) >= 5
