"""Checkpoints of sharded managed-collision models: DCP save, load resharded, continue
exactly (remapper buffers and the eviction window in progress included).

World of 4 gloo ranks: a model sharded S=4 trains 8 steps (inside the "user" table's
3-step window) and is saved; a fresh 2x2 model loads it and both continue 12 steps on
the same batches: the same remapped ids and remapper state every step, weights and
fused Adam state within 1e-5; the same from an S=4 model with a column-wise and a
table-wise table into a 2x2 row-wise one. A fused-SGD S=4 checkpoint then loads into a 2-rank world
(S=2) and into the unsharded model there; both continue 12 steps alike. A load that
drops the window (``load_state_dict``, TorchRec's way) evicts differently: the window
is what makes the resumed run exact.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.managed_collision.test_sharded import (
    BATCH,
    KEYS,
    LR,
    Model,
    _batches,
    _global,
    _loss,
    _plan,
    _remappers,
)
from tests.multiprocess import run_world

BEFORE, AFTER = 8, 12


def _fused(name):
    import dtrec

    return dtrec.optim.SGD(lr=LR) if name == "sgd" else dtrec.optim.Adam(lr=LR / 10)


def _train(model, batches, rank, opt):
    pred, remapped = model(batches[rank][0])
    _loss(pred, batches[rank][1]).backward()
    opt.step()
    opt.zero_grad()
    return remapped


def _remapper_state(model):
    return {
        name: {k: v.clone() for k, v in mc.state_dict().items()}
        for name, mc in _remappers(model).items()
    }


def _same_state(a, b):
    return all(torch.equal(a[n][k], b[n][k]) for n in a for k in a[n])


def _table_diff(a, b):
    import dtrec

    full_a, full_b = dtrec.checkpoint.full_state_dict(a), dtrec.checkpoint.full_state_dict(b)
    diff = max((full_a[k].double() - full_b[k].double()).abs().max().item() for k in full_a)
    fa, fb = a.fused_optimizer.state_dict()["state"], b.fused_optimizer.state_dict()["state"]
    keys = [(t, k) for t in fa for k, v in fa[t].items() if isinstance(v, torch.Tensor) and v.dim()]
    full = dtrec.checkpoint.full_tensors(  # both models' state in one gather
        [fa[t][k] for t, k in keys] + [fb[t][k] for t, k in keys]
    )
    for left, right in zip(full[: len(keys)], full[len(keys) :], strict=True):
        diff = max(diff, (left.double() - right.double()).abs().max().item())
    return diff


def _torch_adam(model):
    """A torch Adam over every parameter (tables included: no fused optimizer) whose state
    of evicted rows an eviction hook resets, as the unsharded module's user does."""
    from dtrec.modules import reset_torch_optimizer_rows

    opt = torch.optim.Adam(model.parameters(), lr=LR / 10)
    model.sparse.register_eviction_hook(
        lambda t, rows: reset_torch_optimizer_rows(opt, model.sparse.table_weight(t), rows)
    )
    return opt


def _adam_state_diff(a, opt_a, b, opt_b):
    """Largest difference of two models' weights and torch Adam state (``exp_avg``,
    ``exp_avg_sq``, ``step``), parameter by parameter name, sharded or not."""
    import dtrec

    def full(t):
        return dtrec.checkpoint.full_tensor(t).double() if t.dim() else t.double()

    params_b = dict(b.named_parameters())
    diff = 0.0
    for name, pa in a.named_parameters():
        pb = params_b[name]
        diff = max(diff, (full(pa.detach()) - full(pb.detach())).abs().max().item())
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            diff = max(diff, (full(sa[key]) - full(sb[key])).abs().max().item())
    return diff


def _world4(rank, world, root):
    """S=4 Adam -> 2x2 (continued beside the uninterrupted S=4 model); S=4 SGD saved."""
    import dtrec

    out = {}
    torch.manual_seed(0)
    base = Model()
    fused = _fused("adam")
    first = dtrec.distribute_module(copy.deepcopy(base), dtrec.init_mesh("cpu", 4), optimizer=fused)
    opt = torch.optim.SGD(first.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(1)
    hot = torch.randint(0, 2**63 - 1, (60,), generator=gen)
    for _ in range(BEFORE):
        _train(first, _batches(world, gen, hot), rank, opt)
    dtrec.checkpoint.save(f"{root}/adam", first, opt)
    windows = [mc._window_summary()[0].numel() for mc in _remappers(first).values()]
    out["window_ids_saved"] = windows

    torch.manual_seed(5)  # other initial weights: the load must bring everything
    resumed = dtrec.distribute_module(Model(), dtrec.init_mesh("cpu", 2), optimizer=fused)
    resumed_opt = torch.optim.SGD(resumed.parameters(), lr=LR)
    dtrec.checkpoint.load(f"{root}/adam", resumed, resumed_opt)
    torch.manual_seed(5)
    dropped = dtrec.distribute_module(Model(), dtrec.init_mesh("cpu", 2), optimizer=fused)
    dropped.load_state_dict(first.state_dict())  # buffers only: the window restarts
    dropped_opt = torch.optim.SGD(dropped.parameters(), lr=LR)
    out["mismatch"], out["dropped_differs"] = [], False
    for step in range(AFTER):
        batches = _batches(world, gen, hot)
        want = _train(first, batches, rank, opt)
        got = _train(resumed, batches, rank, resumed_opt)
        _train(dropped, batches, rank, dropped_opt)
        if any(not torch.equal(got[k].values(), want[k].values()) for k in KEYS):
            out["mismatch"].append((step, "remap"))
        if not _same_state(_remapper_state(resumed), _remapper_state(first)):
            out["mismatch"].append((step, "remapper"))
        if not _same_state(_remapper_state(dropped), _remapper_state(first)):
            out["dropped_differs"] = True
    out["adam_diff"] = _table_diff(resumed, first)

    torch.manual_seed(0)
    sgd = dtrec.distribute_module(
        copy.deepcopy(base), dtrec.init_mesh("cpu", 4), optimizer=_fused("sgd")
    )
    sgd_opt = torch.optim.SGD(sgd.parameters(), lr=LR)
    for _ in range(BEFORE):
        _train(sgd, _batches(world, gen, hot), rank, sgd_opt)
    dtrec.checkpoint.save(f"{root}/sgd", sgd, sgd_opt)

    # column-wise "user" + table-wise "item" (S=4, Adam) saved, loaded into 2x2 row-wise
    torch.manual_seed(0)
    mesh4 = dtrec.init_mesh("cpu", 4)
    typed = dtrec.distribute_module(
        copy.deepcopy(base), mesh4, _plan(("cw", "tw")), optimizer=fused
    )
    typed_opt = torch.optim.SGD(typed.parameters(), lr=LR)
    for _ in range(BEFORE):
        _train(typed, _batches(world, gen, hot), rank, typed_opt)
    dtrec.checkpoint.save(f"{root}/typed", typed, typed_opt)
    torch.manual_seed(5)
    rowwise = dtrec.distribute_module(Model(), dtrec.init_mesh("cpu", 2), optimizer=fused)
    rowwise_opt = torch.optim.SGD(rowwise.parameters(), lr=LR)
    dtrec.checkpoint.load(f"{root}/typed", rowwise, rowwise_opt)
    out["typed_mismatch"] = []
    for step in range(AFTER):
        batches = _batches(world, gen, hot)
        want = _train(typed, batches, rank, typed_opt)
        got = _train(rowwise, batches, rank, rowwise_opt)
        out["typed_mismatch"] += _lockstep_mismatches(step, got, want, rowwise, typed)
    out["typed_diff"] = _table_diff(rowwise, typed)

    # torch Adam on every parameter (no fused optimizer), S=4 row-wise, saved mid-window
    # with evictions behind it; loaded into 2x2 with "user" column-wise and "item"
    # table-wise, both continue: the Adam state of rows evicted after the load is reset
    # alike, that of rows evicted before it was saved reset
    torch.manual_seed(0)
    plain = dtrec.distribute_module(copy.deepcopy(base), dtrec.init_mesh("cpu", 4))
    plain_opt = _torch_adam(plain)
    for _ in range(BEFORE):
        _train(plain, _batches(world, gen, hot), rank, plain_opt)
    dtrec.checkpoint.save(f"{root}/torch_adam", plain, plain_opt)
    torch.manual_seed(5)
    moved = dtrec.distribute_module(Model(), dtrec.init_mesh("cpu", 2), _plan(("cw", "tw")))
    moved_opt = _torch_adam(moved)
    dtrec.checkpoint.load(f"{root}/torch_adam", moved, moved_opt)
    out["torch_loaded_diff"] = _adam_state_diff(moved, moved_opt, plain, plain_opt)
    out["torch_mismatch"] = []
    evicted = []
    moved.sparse.register_eviction_hook(lambda t, rows: evicted.append(t))
    for step in range(AFTER):
        batches = _batches(world, gen, hot)
        want = _train(plain, batches, rank, plain_opt)
        got = _train(moved, batches, rank, moved_opt)
        out["torch_mismatch"] += _lockstep_mismatches(step, got, want, moved, plain)
    out["torch_evictions"] = len(evicted)
    out["torch_diff"] = _adam_state_diff(moved, moved_opt, plain, plain_opt)
    return out


def _world2(rank, world, root):
    """The S=4 SGD checkpoint in a 2-rank world: sharded S=2 and unsharded, continued."""
    import dtrec

    fused = _fused("sgd")
    torch.manual_seed(7)
    sharded = dtrec.distribute_module(Model(), dtrec.init_mesh("cpu", 2), optimizer=fused)
    opt = torch.optim.SGD(sharded.parameters(), lr=LR)
    dtrec.checkpoint.load(f"{root}/sgd", sharded, opt)
    reference = Model()
    dtrec.checkpoint.load(f"{root}/sgd", reference)
    ref_opt = torch.optim.SGD(reference.dense.parameters(), lr=LR)
    tables = reference.sparse._embedding_module.embedding_bags
    state = {n: fused.init_state(t.weight) for n, t in tables.items()}
    gen = torch.Generator().manual_seed(3)
    hot = torch.randint(0, 2**63 - 1, (60,), generator=gen)
    out = {"mismatch": [], "evictions": 0}
    evicted = []
    sharded.sparse.register_eviction_hook(lambda t, r: evicted.append(t))
    for step in range(AFTER):
        batches = _batches(world, gen, hot)
        remapped = _train(sharded, batches, rank, opt)
        pooled, ref_remapped = reference.sparse(_global(batches))
        pred = reference.dense(pooled.values()).squeeze(1)
        losses = [_loss(pred[r * BATCH : (r + 1) * BATCH], t) for r, (_, t) in enumerate(batches)]
        torch.stack(losses).mean().backward()
        for cfg in reference.sparse._embedding_module.embedding_bag_configs():
            weight = tables[cfg.name].weight
            rows = torch.unique(torch.cat([ref_remapped[f].values() for f in cfg.feature_names]))
            with torch.no_grad():
                fused.update_rows(weight, state[cfg.name], rows, weight.grad[rows])
            weight.grad = None
        ref_opt.step()
        ref_opt.zero_grad()
        out["mismatch"] += _remap_mismatches(step, batches, rank, remapped, ref_remapped,
                                             sharded, reference)  # fmt: skip
    out["evictions"] = len(evicted)
    full = dtrec.checkpoint.full_state_dict(sharded)
    out["weight_diff"] = max(
        (full[k].double() - v.double()).abs().max().item()
        for k, v in reference.state_dict().items()
    )

    # the S=4 torch-Adam checkpoint: S=2 sharded and unsharded, each with its torch Adam
    torch.manual_seed(7)
    sharded = dtrec.distribute_module(Model(), dtrec.init_mesh("cpu", 2))
    opt = _torch_adam(sharded)
    dtrec.checkpoint.load(f"{root}/torch_adam", sharded, opt)
    reference = Model()
    ref_opt = _torch_adam(reference)
    dtrec.checkpoint.load(f"{root}/torch_adam", reference, ref_opt)
    out["torch_loaded_diff"] = _adam_state_diff(sharded, opt, reference, ref_opt)
    out["torch_mismatch"], evicted = [], []
    sharded.sparse.register_eviction_hook(lambda t, r: evicted.append(t))
    for step in range(AFTER):
        batches = _batches(world, gen, hot)
        remapped = _train(sharded, batches, rank, opt)
        pooled, ref_remapped = reference.sparse(_global(batches))
        pred = reference.dense(pooled.values()).squeeze(1)
        losses = [_loss(pred[r * BATCH : (r + 1) * BATCH], t) for r, (_, t) in enumerate(batches)]
        torch.stack(losses).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out["torch_mismatch"] += _remap_mismatches(step, batches, rank, remapped, ref_remapped,
                                                   sharded, reference)  # fmt: skip
    out["torch_evictions"] = len(evicted)
    out["torch_diff"] = _adam_state_diff(sharded, opt, reference, ref_opt)
    return out


def _lockstep_mismatches(step, got, want, model, other) -> list:
    """(step, "remap" / "remapper") where two sharded models fed the same batches differ
    in their remapped ids ``got`` / ``want`` or in their remappers' states."""
    import torch

    bad = []
    if any(not torch.equal(got[k].values(), want[k].values()) for k in KEYS):
        bad.append((step, "remap"))
    if not _same_state(_remapper_state(model), _remapper_state(other)):
        bad.append((step, "remapper"))
    return bad


def _remap_mismatches(step, batches, rank, remapped, ref_remapped, sharded, reference) -> list:
    """(step, feature or "remapper") where this rank's remapped ids differ from the
    reference's slice of the global batch, or the remappers' states differ."""
    import torch

    bad = []
    for key in KEYS:
        counts = [int(b[key].lengths().sum()) for b, _ in batches]
        start = sum(counts[:rank])
        want = ref_remapped[key].values()[start : start + counts[rank]]
        if not torch.equal(remapped[key].values(), want):
            bad.append((step, key))
    if not _same_state(_remapper_state(sharded), _remapper_state(reference)):
        bad.append((step, "remapper"))
    return bad


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mc_ckpt"))
    four = run_world(4, _world4, root, timeout=600.0)
    two = run_world(2, _world2, root, timeout=600.0)
    return four, two


def test_resharded_s4_to_2x2_continues_exactly(results):
    for rank, got in enumerate(results[0]):
        assert got["window_ids_saved"][0] > 0, (rank, got["window_ids_saved"])  # "user"
        assert got["mismatch"] == [], (rank, got["mismatch"][:5])
        assert got["adam_diff"] <= 1e-5, (rank, got["adam_diff"])
        assert got["dropped_differs"], rank  # without the window the run is not the same


def test_column_and_table_wise_checkpoint_loads_row_wise_and_continues_exactly(results):
    """S=4 with "user" column-wise and "item" table-wise (fused Adam), saved mid-window,
    loaded into a 2x2 row-wise model: both continue with the same remaps and state."""
    for rank, got in enumerate(results[0]):
        assert got["typed_mismatch"] == [], (rank, got["typed_mismatch"][:5])
        assert got["typed_diff"] <= 1e-5, (rank, got["typed_diff"])


def test_s4_checkpoint_in_a_2_rank_world_continues_as_the_unsharded_model(results):
    for rank, got in enumerate(results[1]):
        assert got["mismatch"] == [], (rank, got["mismatch"][:5])
        assert got["evictions"] >= 5, (rank, got["evictions"])
        assert got["weight_diff"] <= 1e-5, (rank, got["weight_diff"])


def test_torch_adam_checkpoint_resharded_continues_exactly(results):
    """Tables trained by torch Adam (an eviction hook resets evicted rows' state), saved
    S=4 row-wise mid-window: loaded into 2x2 column- and table-wise, the state equals the
    saved one and both continue with the same remaps, evictions, weights and Adam state."""
    for rank, got in enumerate(results[0]):
        assert got["torch_loaded_diff"] == 0.0, (rank, got["torch_loaded_diff"])
        assert got["torch_mismatch"] == [], (rank, got["torch_mismatch"][:5])
        assert got["torch_evictions"] >= 5, (rank, got["torch_evictions"])
        assert got["torch_diff"] <= 1e-5, (rank, got["torch_diff"])


def test_torch_adam_checkpoint_in_a_2_rank_world_continues_as_the_unsharded_model(results):
    """The same checkpoint in a 2-rank world, S=2 and unsharded (torch Adam each): both
    load the same state and continue alike over evictions."""
    for rank, got in enumerate(results[1]):
        assert got["torch_loaded_diff"] == 0.0, (rank, got["torch_loaded_diff"])
        assert got["torch_mismatch"] == [], (rank, got["torch_mismatch"][:5])
        assert got["torch_evictions"] >= 5, (rank, got["torch_evictions"])
        assert got["torch_diff"] <= 1e-5, (rank, got["torch_diff"])
