"""``distribute_module(..., same_batch=world["tp"])`` on 4 gloo ranks, (dp 2) x (tp 2).

The two ranks of a tp group feed the same batch; with ``same_batch`` each looks up half
of it and the pooled rows are all-gathered (``dtrec.sharded.dist.batch_split``). The MLP
is tensor parallel over tp (Colwise / Rowwise) and FSDP over dp, the tables over dp x tp
(``tests/distributed/test_compose.py``'s model and plan). Every configuration trains 3
steps and must end where the unsharded model ends when trained on the distinct dp
batches (loss = mean of the per-batch losses), to 1e-5 relative: torch SGD, Adam and a
fused RowWiseAdagrad, odd (uneven split), even and one-sample batches (an empty chunk),
prefetched input dist. The
tables' all-to-all bytes with ``same_batch`` are about half of those without, and
``DTREC_CHECK_SAME_BATCH=1`` refuses a tp group whose ranks feed different batches. One
spawned world runs everything (``tests/multiprocess.py``).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_compose import (
    TOL,
    Net,
    _full,
    _mesh,
    _optimizer,
    _plan,
    _rel,
    tp_then_fsdp,
)
from tests.multiprocess import run_world

STEPS = 3
TABLE_KINDS = ("input_dist.ids", "output_dist")  # output_dist.backward counted under it


def _batch(step: int, group: int, size: int):
    """Data-parallel group ``group``'s batch of ``size`` samples at ``step``."""
    import dtrec

    gen = torch.Generator().manual_seed(1000 * step + group + 7 * size)
    keys, values, lengths = [], [], []
    for key, rows in (("f0", 20), ("f1", 20), ("f2", 10), ("f3", 12)):
        ls = torch.randint(1, 4, (size,), generator=gen)
        keys.append(key)
        lengths.append(ls)
        values.append(torch.randint(0, rows, (int(ls.sum()),), generator=gen))
    kjt = dtrec.KeyedJaggedTensor(keys, torch.cat(values), torch.cat(lengths))
    return kjt, torch.randn(size, generator=gen)


def _distribute(model, split: bool, fused=None):
    """TP over tp and FSDP over dp on the MLP, then the tables over dp x tp."""
    import dtrec

    mesh = tp_then_fsdp(model)
    return dtrec.distribute_module(
        model,
        _mesh("dp_tp_tables"),
        _plan(),
        optimizer=fused,
        same_batch=mesh["tp"] if split else None,
    )


def _train(opt: str, batch: int, split: bool = True, fused: str | None = None,
           prefetch: bool = False) -> dict:  # fmt: skip
    import copy

    import dtrec
    from tests.distributed.numerics import fused_reference_update

    torch.manual_seed(0)
    ref = Net()
    rule = dtrec.optim.RowWiseAdagrad(lr=0.1) if fused == "rowwise_adagrad" else None
    model = _distribute(copy.deepcopy(ref), split, rule)
    mesh = _mesh("dp_tp")
    group, groups = mesh["dp"].get_local_rank(), mesh["dp"].size()
    tables = ref.sparse.embedding_bag_configs()
    table_params = {id(t.weight) for t in ref.sparse.embedding_bags.values()}
    ref_params = [p for p in ref.parameters() if rule is None or id(p) not in table_params]
    fused_state = {
        cfg.name: rule.init_state(ref.sparse.embedding_bags[cfg.name].weight) for cfg in tables
    } if rule is not None else {}  # fmt: skip
    ref_opt = _optimizer(opt, ref_params, None)
    dist_opt = _optimizer(opt, [p for p in model.parameters() if p.requires_grad], None)
    loss_errs, table_bytes, gather_bytes, axes, calls = [], [], [], [], []
    for step in range(STEPS):
        batches = [_batch(step, g, batch) for g in range(groups)]
        kjt, y = batches[group]
        with dtrec.comm_stats() as stats:
            if prefetch:
                model.sparse.prefetch(kjt)
            loss = ((model(kjt) - y) ** 2).mean()
            loss.backward()
        table_bytes.append(sum(n for k, n in stats.bytes_sent.items() if k.startswith(TABLE_KINDS)))
        gather_bytes.append(stats.bytes_sent.get("same_batch.gather", 0))
        axes.append((dict(stats.bytes_per_axis), stats.total_bytes))
        calls.append(dict(stats.calls))
        ref_losses = [((ref(k) - t) ** 2).mean() for k, t in batches]
        torch.stack(ref_losses).mean().backward()
        dist_opt.step()
        dist_opt.zero_grad()
        if rule is not None:
            fused_reference_update(ref, tables, rule, fused_state, [k for k, _ in batches])
        ref_opt.step()
        ref_opt.zero_grad()
        loss_errs.append(_rel(loss.detach(), ref_losses[group].detach()))
    got = dict(model.named_parameters())
    return {
        "loss": max(loss_errs),
        "weights": {name: _rel(_full(got[name]), p.detach()) for name, p in ref.named_parameters()},
        "table_bytes": table_bytes,
        "gather_bytes": gather_bytes,
        "axes": axes,
        "calls": calls,
        "prefetch_left": model.sparse.is_prefetched(kjt),
    }


CONFIGS = {
    "sgd_odd": dict(opt="sgd", batch=3),
    "adam_odd": dict(opt="adam", batch=3),
    "rowwise_adagrad_odd": dict(opt="sgd", batch=3, fused="rowwise_adagrad"),
    "adam_even_prefetch": dict(opt="adam", batch=4, prefetch=True),
    "sgd_even": dict(opt="sgd", batch=4),
    "sgd_even_whole": dict(opt="sgd", batch=4, split=False),
    "sgd_odd_whole": dict(opt="sgd", batch=3, split=False),
    "adam_one_sample": dict(opt="adam", batch=1),  # the tp rank 1 looks up an empty chunk
}


def _errors() -> dict:
    """The same_batch check on matched and mismatched batches, VBE and a bad mesh."""
    import copy
    import os

    import dtrec
    from tests.multiprocess import error_of

    out: dict = {}
    mesh = _mesh("dp_tp")
    group = mesh["dp"].get_local_rank()
    os.environ["DTREC_CHECK_SAME_BATCH"] = "1"
    try:
        model = _distribute(copy.deepcopy(Net()), True)
    finally:
        del os.environ["DTREC_CHECK_SAME_BATCH"]
    with dtrec.comm_stats() as stats:
        model(_batch(0, group, 3)[0]).sum().backward()  # the same batch: no error
    out["check_bytes"] = stats.bytes_sent.get("same_batch.check", 0)
    # rank 3 (dp 1, tp 1) feeds a batch of its own
    mine = _batch(0, group, 3)[0] if torch.distributed.get_rank() != 3 else _batch(5, 9, 3)[0]
    out["mismatch"] = error_of(lambda: model(mine))
    out["after"] = error_of(lambda: model(_batch(1, group, 3)[0]).sum().backward())
    vbe = dtrec.KeyedJaggedTensor(
        ["f0", "f1", "f2", "f3"], torch.tensor([1, 2, 3, 4, 5, 6]), torch.ones(6, dtype=torch.long),
        stride_per_key_per_rank=[[2], [1], [2], [1]],
    )  # fmt: skip
    out["vbe"] = error_of(lambda: model(vbe))
    out["not_1d"] = error_of(
        lambda: dtrec.distribute_module(Net(), _mesh("dp_tp_tables"), _plan(), same_batch=mesh)
    )
    out.update(_different_sizes())
    # ranks that disagree on same_batch: refused by distribute_module's agreement check
    from torch.distributed.device_mesh import init_device_mesh

    rank = torch.distributed.get_rank()
    transposed = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))  # tp: [0, 2]
    disagree = {
        "missing": None if rank == 1 else mesh["tp"],  # rank 1 passes none
        "other_dim": mesh["dp"] if rank == 3 else mesh["tp"],  # rank 3: its dp group
        "other_groups": mesh["tp"] if rank == 0 else transposed["tp"],  # [0, 1] vs [1, 3]
    }
    for case, same_batch in disagree.items():
        out[f"disagree_{case}"] = error_of(
            lambda s=same_batch: dtrec.distribute_module(
                Net(), _mesh("dp_tp_tables"), _plan(), same_batch=s
            )
        )
    return out


def _different_sizes() -> dict:
    """Rank 3 feeds 4 samples, its tp peer rank 2 feeds 3 (no DTREC_CHECK_SAME_BATCH):
    with the tables over dp x tp (the header reaches the world, and carries the sizes)
    and over tp with dp replicas (one all-gather of the sizes over the tp group)."""
    import copy

    import dtrec
    from tests.multiprocess import error_of

    out: dict = {}
    mesh = _mesh("dp_tp")
    rank, group = torch.distributed.get_rank(), mesh["dp"].get_local_rank()
    from torch.distributed.device_mesh import init_device_mesh

    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # its own flatten
    layouts = {
        "header": (_mesh("dp_tp_tables"), mesh["tp"]),
        "gathered": (dtrec.table_mesh(other, shard="tp", replicate="dp"), other["tp"]),
    }
    for layout, (tables, tp) in layouts.items():
        model = dtrec.distribute_module(copy.deepcopy(Net()), tables, _plan(), same_batch=tp)
        with dtrec.comm_stats() as stats:
            model(_batch(0, group, 3)[0]).sum().backward()  # the same batch: no error
        out[f"sizes_{layout}_calls"] = dict(stats.calls)
        out[f"sizes_{layout}_bytes"] = stats.bytes_sent.get("same_batch.sizes", 0)
        mine = _batch(0, group, 4 if rank == 3 else 3)[0]
        out[f"sizes_{layout}"] = error_of(lambda m=model, b=mine: m(b))
        out[f"sizes_{layout}_after"] = error_of(
            lambda m=model: m(_batch(1, group, 3)[0]).sum().backward()
        )
    return out


def _run_all(rank: int, world: int, configs: dict) -> dict:
    return {**{name: _train(**cfg) for name, cfg in configs.items()}, "errors": _errors()}


@pytest.fixture(scope="module")
def world_results() -> list[dict]:
    return run_world(4, _run_all, CONFIGS, timeout=600)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_trains_like_the_unsharded_model_on_the_distinct_batches(world_results, name) -> None:
    for rank, per_rank in enumerate(world_results):
        r = per_rank[name]
        assert r["loss"] < TOL, (rank, r)
        for param, err in r["weights"].items():
            assert err < TOL, (rank, param, err)
        assert not r["prefetch_left"], rank


def test_a_tp_group_sends_its_batch_once(world_results) -> None:
    """Summed over the world, the tables' ids and pooled-row all-to-alls (forward and
    backward) carry about half the bytes with same_batch: each tp group's batch travels
    once instead of twice. The gather of the pooled rows is what it costs."""
    for name, whole in (("sgd_even", "sgd_even_whole"), ("sgd_odd", "sgd_odd_whole")):
        for step in range(STEPS):
            split = sum(r[name]["table_bytes"][step] for r in world_results)
            full = sum(r[whole]["table_bytes"][step] for r in world_results)
            assert 0.4 * full < split < 0.6 * full, (name, step, split, full)
            assert all(r[name]["gather_bytes"][step] > 0 for r in world_results), name
            assert all(r[whole]["gather_bytes"][step] == 0 for r in world_results), whole


def test_comm_stats_count_bytes_per_mesh_dim(world_results) -> None:
    """``comm_stats().bytes_per_axis``: every byte on the mesh dim it crossed: the pooled
    rows' gather on "tp", the tables' exchanges on the tables' "shard" dim (dp x tp
    flattened over the whole world: the default group, "world"), none on "replicate"."""
    for rank, per_rank in enumerate(world_results):
        for name in ("sgd_even", "sgd_odd_whole"):
            r = per_rank[name]
            for step, (axes, total) in enumerate(r["axes"]):
                assert sum(axes.values()) == total, (rank, name, step, axes)
                assert axes.get("tp", 0) == r["gather_bytes"][step], (rank, name, step, axes)
                assert axes.get("world", 0) > 0 and "replicate" not in axes, (rank, axes)


def test_check_same_batch_refuses_a_group_feeding_different_batches(world_results) -> None:
    for rank, per_rank in enumerate(world_results):
        e = per_rank["errors"]
        assert e["check_bytes"] > 0, rank
        assert e["mismatch"] != "ok", rank
        if rank in (2, 3):  # the tp group of rank 3
            assert e["mismatch"].startswith("ValueError"), (rank, e)
            assert "feed different batches" in e["mismatch"], (rank, e)
            assert "[2, 3]" in e["mismatch"] and "rank(s) [3]" in e["mismatch"], (rank, e)
        assert e["after"] == "ok", (rank, e["after"])  # the next step runs


def test_variable_batch_per_feature_is_a_clear_error(world_results) -> None:
    for rank, per_rank in enumerate(world_results):
        err = per_rank["errors"]["vbe"]
        assert err.startswith("ValueError") and "VBE" in err and "'f1'" in err, (rank, err)


def test_same_batch_must_be_a_1d_mesh(world_results) -> None:
    for rank, per_rank in enumerate(world_results):
        err = per_rank["errors"]["not_1d"]
        assert err.startswith("TypeError") and "1-D DeviceMesh" in err, (rank, err)


def test_ranks_that_disagree_on_same_batch_are_refused_by_distribute_module(
    world_results,
) -> None:
    """``same_batch`` given on some ranks only, or a mesh of another dim, or of the same
    name but other groups: a ValueError on every rank naming the ranks, never a hang."""
    for rank, per_rank in enumerate(world_results):
        e = per_rank["errors"]
        missing, other_dim = e["disagree_missing"], e["disagree_other_dim"]
        assert missing.startswith("ValueError") and "ranks [1] disagree" in missing, (rank, e)
        assert "same_batch" in missing and "None" in missing, (rank, missing)
        assert other_dim.startswith("ValueError") and "ranks [3] disagree" in other_dim, rank
        assert "('dp',)" in other_dim and "('tp',)" in other_dim, (rank, other_dim)
        groups = e["disagree_other_groups"]
        assert groups.startswith("ValueError"), (rank, groups)
        assert "rank 0's group is ranks [0, 1] but rank 1's is [1, 3]" in groups, (rank, groups)


def test_a_group_feeding_batches_of_different_sizes_is_refused_on_every_rank(
    world_results,
) -> None:
    """Without DTREC_CHECK_SAME_BATCH: a ValueError on every rank of the world in the same
    step (none hangs, none trains on a wrong split), and the next step runs. Where the
    header carries the sizes every rank names the group's ranks and sizes; with the
    all-gather the group's ranks do, and the others name the rank that refused."""
    for rank, per_rank in enumerate(world_results):
        e = per_rank["errors"]
        for layout in ("header", "gathered"):
            err = e[f"sizes_{layout}"]
            assert err.startswith("ValueError"), (rank, layout, err)
            if layout == "gathered" and rank not in (2, 3):
                assert "rank 2 rejected its input batch" in err, (rank, layout, err)
                continue
            assert "different sizes [3, 4]" in err and "[2, 3]" in err, (rank, layout, err)
            assert "2: 3, 3: 4" in err, (rank, layout, err)
            assert e[f"sizes_{layout}_after"] == "ok", (rank, layout, e)


def test_the_size_check_adds_no_collective_where_the_header_reaches_the_world(
    world_results,
) -> None:
    """Tables over dp x tp (no replicas): the sizes ride the input dist's header, so a
    same_batch step issues the collectives of a whole-batch step plus the pooled rows'
    gather, nothing else. Tables over tp with dp replicas: one 8-byte all-gather more."""
    for rank, per_rank in enumerate(world_results):
        for step in range(STEPS):
            split, whole = (
                per_rank["sgd_even"]["calls"][step],
                per_rank["sgd_even_whole"]["calls"][step],
            )
            assert split == {**whole, "same_batch.gather": 1}, (rank, step, split, whole)
        e = per_rank["errors"]
        assert "same_batch.sizes" not in e["sizes_header_calls"], (rank, e["sizes_header_calls"])
        assert e["sizes_gathered_calls"]["same_batch.sizes"] == 1, (rank, e)
        assert e["sizes_gathered_bytes"] == 8, (rank, e)
