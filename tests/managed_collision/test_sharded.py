"""Sharded managed collision == the unsharded module on the global batch (4 gloo ranks).

Every rank remaps its own batch with its copy of each remapper; eviction steps merge
every rank's window (``dtrec.sharded.managed_collision``). Over a stream of batches
with evictions (one config 200 steps), on a 1D (S=4) and a 2x2 mesh, with fused SGD
and Adam on row-wise tables, Adam / row-wise Adagrad / SGD (fused and torch) on a
table-wise and a column-wise table, and data-parallel, table-row-wise and grid tables
(a node-aware mesh, 2 nodes) under fused Adam / SGD and torch Adam: each rank's
remapped ids are the unsharded module's for its part of the global batch, every rank's
remapper state equals the unsharded one after every step, the evicted rows are the same,
only eviction steps add collectives (one window all-gather per evicting table), and the
weights and fused state end within 1e-5 (``zch_size`` 37 and 10: not multiples of the shard count).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.multiprocess import run_world

TABLES = [("user", 37, 6, ["u0", "u1"], "sum"), ("item", 10, 4, ["i0"], "mean")]
KEYS = ["u0", "u1", "i0"]
BATCH, LR = 4, 0.3
CONFIGS = {  # name: (shard group size, fused optimizer, steps, plan: default row-wise)
    "1d_sgd": (4, "sgd", 40, None),
    "1d_adam": (4, "adam", 40, None),
    "2x2_sgd": (2, "sgd", 40, None),
    "2x2_adam": (2, "adam", 200, None),
    "1d_cw_tw_adam": (4, "adam", 60, ("cw", "tw")),
    "2x2_tw_cw_rowwise_adagrad": (2, "rowwise_adagrad", 60, ("tw", "cw")),
    # no fused optimizer: torch Adam steps the tables; an eviction hook resets its state
    "1d_torch_adam": (4, "torch_adam", 40, None),
    "2x2_cw_tw_torch_adam": (2, "torch_adam", 40, ("cw", "tw")),
    # plain SGD (no state: only the weights' reset) on table- and column-wise tables
    "1d_tw_cw_sgd": (4, "sgd", 20, ("tw", "cw")),
    "2x2_cw_tw_torch_sgd": (2, "torch_sgd", 20, ("cw", "tw")),
    # the other types (node-aware mesh: 2 shard positions per node when S=4)
    "1d_dp_trw_adam": (4, "adam", 20, ("dp", "trw")),
    "1d_grid_dp_torch_adam": (4, "torch_adam", 20, ("grid", "dp")),
    "2x2_trw_grid_sgd": (2, "sgd", 20, ("trw", "grid")),
}


def _plan(kinds):
    """user and item tables as ``kinds`` ("tw": table-wise on shard position 1, "cw":
    column-wise over the shard axis, "dp": data-parallel, "trw": table-row-wise on the
    last node, "grid"), or None (row-wise, the default)."""
    if kinds is None:
        return None
    from dtrec.placements import ColumnWise, DataParallel, Grid, TableRowWise, TableWise

    spec = {
        "tw": TableWise(rank=1),
        "cw": ColumnWise(),
        "dp": DataParallel(),
        "trw": TableRowWise(node=1),
        "grid": Grid(),
    }
    return {
        f"sparse._embedding_module.{t}": spec[k]
        for t, k in zip(("user", "item"), kinds, strict=True)
    }


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import dtrec
        from dtrec.modules.eviction import LFU, DistanceLFU

        cfgs = [dtrec.EmbeddingBagConfig(n, r, d, f, p) for n, r, d, f, p in TABLES]
        policies = {"user": (LFU(), 3), "item": (DistanceLFU(0.5), 1)}
        mcs = {
            n: dtrec.MCHManagedCollisionModule(
                r, eviction_policy=policies[n][0], eviction_interval=policies[n][1], name=n
            )
            for n, r, *_ in TABLES
        }
        self.sparse = dtrec.ManagedCollisionEmbeddingBagCollection(
            dtrec.EmbeddingBagCollection(cfgs),
            dtrec.ManagedCollisionCollection(mcs, cfgs),
            return_remapped_features=True,
        )
        self.dense = nn.Linear(6 * 2 + 4, 1)

    def forward(self, kjt):
        pooled, remapped = self.sparse(kjt)
        return self.dense(pooled.values()).squeeze(1), remapped


def _batches(world, gen, hot):
    """Every rank's batch of one step: ids mostly from a hot set, the rest cold, all over
    [0, 2**63 - 1) (so every raw-id range of a split eviction gets some)."""
    import dtrec

    out = []
    for _ in range(world):
        lengths = torch.randint(0, 4, (len(KEYS) * BATCH,), generator=gen)
        n = int(lengths.sum())
        pick = hot[torch.randint(0, hot.numel(), (n,), generator=gen)]
        cold = torch.randint(0, 2**63 - 1, (n,), generator=gen)
        values = torch.where(torch.rand(n, generator=gen) < 0.8, pick, cold)
        out.append(
            (dtrec.KeyedJaggedTensor(KEYS, values, lengths), torch.randn(BATCH, generator=gen))
        )
    return out


def _global(batches):
    import dtrec

    parts = [kjt.to_dict() for kjt, _ in batches]
    values = torch.cat([p[k].values() for k in KEYS for p in parts])
    lengths = torch.cat([p[k].lengths() for k in KEYS for p in parts])
    return dtrec.KeyedJaggedTensor(KEYS, values, lengths)


def _loss(pred, target):
    return ((pred - target) ** 2).sum() / max(target.numel(), 1)


def _remappers(model):
    return model.sparse._managed_collision_collection._managed_collision_modules


def _fused(opt_name):
    """A new fused optimizer for ``opt_name`` (None: a torch optimizer steps the tables)."""
    import dtrec

    return {
        "sgd": lambda: dtrec.optim.SGD(lr=LR),
        "adam": lambda: dtrec.optim.Adam(lr=LR / 10),
        "rowwise_adagrad": lambda: dtrec.optim.RowWiseAdagrad(lr=LR),
        "torch_adam": lambda: None,
        "torch_sgd": lambda: None,
    }[opt_name]()


def _torch_opt(opt_name, params):
    return {
        "torch_adam": lambda ps: torch.optim.Adam(ps, lr=LR / 10),
        "torch_sgd": lambda ps: torch.optim.SGD(ps, lr=LR),
    }[opt_name](params)


@functools.cache
def _unsharded(opt_name, world, lengths):
    """The unsharded module's run under ``opt_name`` on the global batches: the same for
    every config with that optimizer (the plan and mesh change only the sharded side), so
    each rank computes it once, ``max(lengths)`` steps. Per step: every rank's batch, the
    remapped global batch, the remappers' state and the evicted rows; after each step
    count in ``lengths``: the tables, their optimizer state and the dense weight."""
    from dtrec.modules import reset_torch_optimizer_rows

    fused = _fused(opt_name)
    torch.manual_seed(0)
    reference = Model()
    run = {"initial": copy.deepcopy(reference), "keys": list(reference.state_dict())}
    ref_tables = reference.sparse._embedding_module.embedding_bags
    state = {} if fused is None else {n: fused.init_state(t.weight) for n, t in ref_tables.items()}
    ref_evicted = {}

    def ref_reset(table, rows):
        ref_evicted[table] = rows.clone()
        if fused is None:
            reset_torch_optimizer_rows(ref_opt, ref_tables[table].weight, rows)
        else:
            fused.reset_rows(ref_tables[table].weight, state[table], rows)

    reference.sparse.register_eviction_hook(ref_reset)
    if fused is None:  # a torch optimizer on everything, tables included
        ref_opt = _torch_opt(opt_name, reference.parameters())
    else:
        ref_opt = torch.optim.SGD(reference.dense.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(1)
    hot = torch.randint(0, 2**63 - 1, (60,), generator=gen)
    run["steps"], run["after"] = [], {}
    for step in range(max(lengths)):
        batches = _batches(world, gen, hot)
        ref_evicted.clear()
        pooled, ref_remapped = reference.sparse(_global(batches))
        ref_pred = reference.dense(pooled.values()).squeeze(1)
        losses = [
            _loss(ref_pred[r * BATCH : (r + 1) * BATCH], t) for r, (_, t) in enumerate(batches)
        ]
        torch.stack(losses).mean().backward()
        for cfg in reference.sparse._embedding_module.embedding_bag_configs():
            if fused is None:
                break  # ref_opt steps the tables
            weight = ref_tables[cfg.name].weight
            ids = torch.cat([ref_remapped[f].values() for f in cfg.feature_names])
            rows = torch.unique(ids)
            with torch.no_grad():
                fused.update_rows(weight, state[cfg.name], rows, weight.grad[rows])
            weight.grad = None
        ref_opt.step()
        ref_opt.zero_grad()
        run["steps"].append({
            "batches": batches,
            "remapped": {key: ref_remapped[key].values().clone() for key in KEYS},
            "remappers": {
                name: {k: v.clone() for k, v in mc.state_dict().items()}
                for name, mc in _remappers(reference).items()
            },
            "evicted": {k: v.tolist() for k, v in ref_evicted.items()},
        })  # fmt: skip
        if step + 1 in lengths:
            run["after"][step + 1] = {
                "tables": {n: t.weight.detach().clone() for n, t in ref_tables.items()},
                "fused": {n: {k: v.clone() for k, v in s.items()} for n, s in state.items()},
                "torch": {
                    n: {k: v.clone() for k, v in ref_opt.state[t.weight].items()}
                    for n, t in ref_tables.items()
                    if fused is None
                },
                "dense": reference.dense.weight.detach().clone(),
            }
    return run


def _one(rank, world, shard, opt_name, steps, kinds):
    import dtrec
    from dtrec.modules import reset_torch_optimizer_rows
    from dtrec.placements.mesh import shard_position

    lengths = tuple(sorted({c[2] for c in CONFIGS.values() if c[1] == opt_name} | {steps}))
    ref = _unsharded(opt_name, world, lengths)
    fused = _fused(opt_name)
    # node-aware specs need nodes: two of them (S/2 shard positions each)
    nodes = kinds is not None and bool({"trw", "grid"} & set(kinds))
    mesh = dtrec.init_mesh("cpu", shard_group_size=shard, node_size=shard // 2 if nodes else None)
    sharded = dtrec.distribute_module(
        copy.deepcopy(ref["initial"]), mesh, _plan(kinds), optimizer=fused
    )
    evicted = {}

    def reset(table, rows):
        evicted[table] = rows.clone()
        if fused is None:
            reset_torch_optimizer_rows(opt, sharded.sparse.table_weight(table), rows)

    sharded.sparse.register_eviction_hook(reset)
    if fused is None:  # a torch optimizer on everything, tables included
        opt = _torch_opt(opt_name, sharded.parameters())
    else:
        opt = torch.optim.SGD(sharded.parameters(), lr=LR)
    out = {
        "remap_mismatch": [],
        "state_mismatch": [],
        "evicted_mismatch": [],
        "window_calls": [],
        "evictions": 0,
    }
    out["same_keys"] = list(sharded.state_dict()) == ref["keys"]
    for step in range(steps):
        want_step = ref["steps"][step]
        batches = want_step["batches"]
        evicted.clear()
        kjt, target = batches[rank]
        with dtrec.comm_stats() as stats:
            pred, remapped = sharded(kjt)
        # an eviction step gathers each evicting table's window once (sizes, then data);
        # "item" evicts every step, "user" every third: no other step talks for the remap
        evicting = 1 + ((step + 1) % 3 == 0)
        calls = (
            stats.calls["managed_collision.window"],
            stats.calls["managed_collision.window.sizes"],
        )
        if calls != (evicting, evicting):
            out["window_calls"].append((step, calls))
        _loss(pred, target).backward()
        opt.step()
        opt.zero_grad()

        for key in KEYS:  # this rank's part of the global batch, remapped alike
            counts = [int(b[key].lengths().sum()) for b, _ in batches]
            start = sum(counts[:rank])
            want = want_step["remapped"][key][start : start + counts[rank]]
            if not torch.equal(remapped[key].values(), want):
                out["remap_mismatch"].append((step, key))
        for name, mc in _remappers(sharded).items():
            mine, want = mc.state_dict(), want_step["remappers"][name]
            if any(not torch.equal(mine[k], want[k]) for k in want):
                out["state_mismatch"].append((step, name))
        if {k: v.tolist() for k, v in evicted.items()} != want_step["evicted"]:
            out["evicted_mismatch"].append(step)
        out["evictions"] += sum(v.numel() > 0 for v in evicted.values())

    after = ref["after"][steps]
    weight_diff, state_diff = 0.0, 0.0
    inner = sharded.sparse._embedding_module
    fused_state = inner.fused_optimizer_state()
    for name, table in inner.embedding_bags.items():
        block = table.layout.block_at(shard_position(mesh))
        if block is None:  # a table-wise table on another rank
            continue
        (r0, r1), (c0, c1) = block.rows, block.cols
        want = after["tables"][name][r0:r1, c0:c1]
        weight_diff = max(weight_diff, (table.weight.to_local() - want).abs().max().item())
        if fused is None:  # the torch optimizer's state, sharded like the weight
            mine, want_state = opt.state[table.weight], after["torch"][name]
            for key in ("exp_avg", "exp_avg_sq") if opt_name == "torch_adam" else ():
                got = mine[key].to_local()
                diff = (got - want_state[key][r0:r1, c0:c1]).abs().max().item()
                state_diff = max(state_diff, diff)
        for key, value in fused_state.get(name, {}).items():
            if value.dim():
                ref_value = after["fused"][name][key][r0:r1]
                ref_value = ref_value[:, c0:c1] if ref_value.dim() == 2 else ref_value
                state_diff = max(state_diff, (value - ref_value).abs().max().item())
    dense = sharded.dense.weight.to_local()
    out["weight_diff"] = weight_diff
    out["state_diff"] = state_diff
    out["dense_diff"] = (dense - after["dense"]).abs().max().item()
    # every rank holds the same remapper: compare a digest across the world
    digest = torch.stack([m._mch_sorted_raw_ids.sum() for m in _remappers(sharded).values()])
    digests = [torch.empty_like(digest) for _ in range(world)]
    dist.all_gather(digests, digest)
    out["same_on_every_rank"] = all(torch.equal(d, digest) for d in digests)
    return out


def _run_all(rank, world, configs):
    return {name: _one(rank, world, *cfg) for name, cfg in configs.items()}


@pytest.fixture(scope="module")
def world_results():
    return run_world(4, _run_all, CONFIGS, timeout=600.0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sharded_equals_unsharded(world_results, name):
    for rank, results in enumerate(world_results):
        got = results[name]
        assert got["remap_mismatch"] == [], (rank, got["remap_mismatch"][:5])
        assert got["state_mismatch"] == [], (rank, got["state_mismatch"][:5])
        assert got["evicted_mismatch"] == [], (rank, got["evicted_mismatch"][:5])
        assert got["evictions"] >= 10, (rank, got["evictions"])
        assert got["window_calls"] == [], (rank, got["window_calls"][:5])
        assert got["weight_diff"] <= 1e-5, (rank, got["weight_diff"])
        assert got["state_diff"] <= 1e-5, (rank, got["state_diff"])
        assert got["dense_diff"] <= 1e-5, (rank, got["dense_diff"])
        assert got["same_on_every_rank"], rank
        assert got["same_keys"], rank
