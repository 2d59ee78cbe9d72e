"""distribute_tensor / distribute_module on a real gloo world: round trips, comm, bad input.

One world of 4 ranks runs every check; each returns plain data per rank.
"""

from __future__ import annotations

import pytest

from tests.multiprocess import error_of, run_world


def _round_trips(rank: int) -> dict:
    import torch

    import dtrec
    from dtrec.placements import ColumnWise, DataParallel, Grid, RowWise, TableRowWise, TableWise

    out = {}
    for shards in (4, 2):
        mesh = dtrec.init_mesh("cpu", shards, node_size=2)
        specs = [DataParallel(), TableWise(rank=1), RowWise(), ColumnWise(), TableRowWise(node=0)]
        for spec in [*specs, Grid()]:
            torch.manual_seed(0)
            weight = torch.randn(11, 6)
            d = dtrec.distribute_tensor(weight, mesh, spec, "t")
            member = d.device_mesh.get_coordinate() is not None
            full = d.full_tensor() if member else None
            out[(shards, str(spec))] = (
                member,
                tuple(d.placements),
                None if full is None else bool(torch.equal(full, weight)),
            )
    return out


def _model(weighted: bool = False):
    import torch

    from tests.distributed.numerics import TinyModel, make_tables

    torch.manual_seed(0)
    return TinyModel(make_tables(weighted))


def _batch(rank: int, batch: int = 3):
    import torch

    from tests.distributed.numerics import make_batch, make_tables

    gen = torch.Generator().manual_seed(100 + rank)
    return make_batch(make_tables(False), batch, False, gen)[0]


def _comm_counts(rank: int) -> dict:
    import torch
    from torch.distributed.tensor.debug import CommDebugMode

    import dtrec
    from dtrec.placements import RowWise

    mesh = dtrec.init_mesh("cpu", 4)
    model = dtrec.distribute_module(_model(), mesh, {f"sparse.t{i}": RowWise() for i in range(4)})
    kjt = _batch(rank)
    with CommDebugMode() as debug, dtrec.count_comm() as stats:
        out = model.sparse(kjt).values()
    forward = {str(k): v for k, v in debug.get_comm_counts().items()}
    with dtrec.count_comm() as bstats:
        out.sum().backward()
    return {
        "forward_c10d": forward,
        "forward_calls": dict(stats.calls),
        "backward_calls": dict(bstats.calls),
        # Every table gets a grad shaped like its local shard on every rank, empty where a
        # position has no rows (t1: 3 rows on 4 positions), so all ranks list the same
        # .grad parameters (clip_grad_norm_ stacks their norms in one order everywhere).
        "grad_local_rows": {
            n: tuple(t.weight.grad.to_local().shape)
            for n, t in model.sparse.embedding_bags.items()
            if t.weight.grad is not None
        },
        "weight_local_rows": {
            n: tuple(t.weight.to_local().shape) for n, t in model.sparse.embedding_bags.items()
        },
        "dtype": str(torch.get_default_dtype()),
    }


def _weighted_comm(rank: int) -> dict:
    """Per-sample weights ride in the ids buffer: no collective of their own. Rank 0's
    batch has none (its peers send it ones), the others' have them."""
    import torch

    import dtrec
    from dtrec.placements import ColumnWise, RowWise, TableWise
    from tests.distributed.numerics import make_batch, make_tables

    tables = make_tables(True)
    gen = torch.Generator().manual_seed(200 + rank)
    kjt = make_batch(tables, 3, True, gen)[0]
    if rank == 0:
        kjt = dtrec.KeyedJaggedTensor(kjt.keys(), kjt.values(), kjt.lengths())
    reference = _model(weighted=True)
    want = reference.sparse(kjt).values()
    specs = [RowWise(), TableWise(rank=2), ColumnWise(), RowWise()]
    mesh = dtrec.init_mesh("cpu", 4)
    model = dtrec.distribute_module(
        _model(weighted=True), mesh, {f"sparse.t{i}": specs[i % 4] for i in range(len(tables))}
    )
    with dtrec.count_comm() as stats:
        got = model.sparse(kjt).values()
    return {"calls": dict(stats.calls), "max_diff": float((got - want).abs().max())}


def _bad_input(rank: int) -> dict:
    import torch

    import dtrec
    from dtrec.placements import ColumnWise, RowWise, TableRowWise, TableWise

    out = {}
    mesh = dtrec.init_mesh("cpu", 4)
    plan = {"sparse.t0": RowWise(), "sparse.t1": TableWise(rank=0), "sparse.t2": ColumnWise()}
    model = dtrec.distribute_module(_model(), mesh, plan)
    before = {n: t.weight.to_local().clone() for n, t in model.sparse.embedding_bags.items()}
    good = _batch(rank)

    # An out-of-range id on rank 1 fails the step on every rank of its sharding group.
    bad = good
    if rank == 1:
        values = good.values().clone()
        values[-1] = 10_000
        bad = dtrec.KeyedJaggedTensor(good.keys(), values, good.lengths())
    out["out_of_range"] = error_of(lambda: model(bad).sum().backward())
    out["weights_unchanged"] = all(
        torch.equal(t.weight.to_local(), before[n]) for n, t in model.sparse.embedding_bags.items()
    )
    # An out-of-range id on rank 1 while rank 2's batch is empty: still every rank fails.
    empty_elsewhere = bad if rank != 2 else _batch(rank, 0)
    out["bad_beside_empty"] = error_of(lambda: model(empty_elsewhere).sum().backward())
    out["weights_unchanged_beside_empty"] = all(
        torch.equal(t.weight.to_local(), before[n]) for n, t in model.sparse.embedding_bags.items()
    )
    # Ranks with different batch sizes, one of them empty: a normal step.
    out["batch_size"] = error_of(lambda: model(_batch(rank, [3, 4, 0, 3][rank])).sum().backward())
    # A rank missing a feature.
    missing = good.permute([k for k in good.keys() if k != "f3"]) if rank == 3 else good
    out["missing_key"] = error_of(lambda: model(missing))
    # After all that, the ranks are still in step: a good batch works everywhere.
    out["recovers"] = error_of(lambda: model(good).sum().backward())

    # Plans that do not fit.
    out["unknown_table"] = error_of(
        lambda: dtrec.distribute_module(_model(), mesh, {"sparse.nope": RowWise()})
    )
    narrow = dtrec.EmbeddingBagCollection([dtrec.EmbeddingBagConfig("narrow", 10, 3)])
    out["narrow_cw"] = error_of(
        lambda: dtrec.distribute_module(narrow, mesh, {"narrow": ColumnWise()})
    )
    out["trw_without_nodes"] = error_of(
        lambda: dtrec.distribute_module(_model(), mesh, {"sparse.t3": TableRowWise()})
    )
    out["tw_rank_out_of_range"] = error_of(
        lambda: dtrec.distribute_module(_model(), mesh, {"sparse.t3": TableWise(rank=4)})
    )
    out["not_a_spec"] = error_of(
        lambda: dtrec.distribute_module(_model(), mesh, {"sparse.t3": "RW"})
    )
    out["no_collection"] = error_of(
        lambda: dtrec.distribute_module(torch.nn.Linear(2, 2), mesh, {})
    )
    with torch.device("meta"):
        dense_on_meta = _model()  # tables may be on meta, dense parameters may not
    out["meta"] = error_of(lambda: dtrec.distribute_module(dense_on_meta, mesh, plan))
    # Ranks that disagree on a table or on the plan: every rank refuses, before any step.
    from tests.distributed.numerics import TinyModel, make_tables

    tables = make_tables(False)
    if rank == 2:
        tables[0] = dtrec.EmbeddingBagConfig("t0", 51, 8, ["f0", "f1"], "sum")
    out["config_mismatch"] = error_of(
        lambda: dtrec.distribute_module(TinyModel(tables), mesh, plan)
    )
    other = {**plan, "sparse.t1": TableWise(rank=1)} if rank == 1 else plan
    out["plan_mismatch"] = error_of(lambda: dtrec.distribute_module(_model(), mesh, other))
    return out


def _bad_batch_everywhere(rank: int) -> dict:
    """A bad id on rank 1 fails the step on every rank, not only its sharding group's:
    on a 2D mesh, in a data-parallel-only collection, and one step ahead in a pipeline."""
    import torch

    import dtrec
    from dtrec.checkpoint import full_state_dict
    from dtrec.placements import ColumnWise, DataParallel, RowWise, TableWise

    def bad_on_rank_1(kjt):
        if rank != 1:
            return kjt
        values = kjt.values().clone()
        values[-1] = 10_000
        return dtrec.KeyedJaggedTensor(kjt.keys(), values, kjt.lengths())

    mixed = {"sparse.t0": RowWise(), "sparse.t1": TableWise(rank=1), "sparse.t2": ColumnWise()}
    cases = {
        "2d_fused": (2, mixed, dtrec.optim.RowWiseAdagrad(lr=0.1)),
        "2d_torch": (2, mixed, None),
        "data_parallel_only": (4, {f"sparse.t{i}": DataParallel() for i in range(4)}, None),
    }
    out = {}
    for name, (shards, plan, fused) in cases.items():
        model = dtrec.distribute_module(_model(), dtrec.init_mesh("cpu", shards), plan, fused)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        before = {k: v.clone() for k, v in full_state_dict(model).items()}

        def step(kjt, model=model, opt=opt):
            model(kjt).square().sum().backward()
            opt.step()
            opt.zero_grad()

        error = error_of(lambda step=step: step(bad_on_rank_1(_batch(rank))))
        after = full_state_dict(model)
        unchanged = all(torch.equal(after[k], before[k]) for k in before)
        out[name] = {
            "error": error,
            "unchanged": unchanged,
            "next": error_of(lambda step=step: step(_batch(rank))),
        }

    # Pipeline: batch 1 is bad on rank 1; its prefetch runs during step 0, which completes
    # on every rank; step 1 then fails on every rank.
    model = dtrec.distribute_module(_model(), dtrec.init_mesh("cpu", 2), mixed)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    pipeline = dtrec.TrainPipeline(model, opt, lambda m, b: m(b).square().sum())
    batches = [_batch(rank), bad_on_rank_1(_batch(rank + 10)), _batch(rank + 20)]
    losses = []

    def run():
        for loss in pipeline.run(batches):
            losses.append(float(loss))

    out["pipeline"] = {"error": error_of(run), "steps_done": len(losses)}
    return out


def _plans(rank: int) -> dict:
    import dtrec
    from dtrec.placements import RowWise, TableWise

    mesh = dtrec.init_mesh("cpu", 2)
    auto = dtrec.plan(_model(), mesh)
    pinned = dtrec.plan(_model(), mesh, {"sparse.t2": RowWise(), "sparse.t0": TableWise(rank=1)})
    model = dtrec.distribute_module(_model(), mesh, {"sparse.t1": TableWise()})
    state = model.state_dict()
    from tests.distributed.numerics import check_numerics

    planned = {k.removeprefix("sparse."): v for k, v in auto.items()}
    trained = check_numerics(
        mesh, planned, weighted=False, steps=2, fused=dtrec.optim.RowWiseAdagrad(lr=0.1)
    )
    return {
        "planned_training": (trained.max_weight_diff, trained.max_loss_diff),
        "state_keys": sorted(state),
        "unsharded_keys": sorted(_model().state_dict()),
        "table_values_are_dtensors": all(
            type(v).__name__ == "DTensor" for k, v in state.items() if "embedding_bags" in k
        ),
        "auto": {k: str(v) for k, v in auto.items()},
        "pinned": {k: str(v) for k, v in pinned.items()},
        "resolved": {k: str(v) for k, v in model.sharding_plan.items()},
        "printed": str(model.sharding_plan),
    }


def _fused(rank: int) -> dict:
    import torch

    import dtrec
    from dtrec.placements import ColumnWise, RowWise, TableWise

    mesh = dtrec.init_mesh("cpu", 2)
    plan = {"sparse.t0": RowWise(), "sparse.t1": TableWise(rank=1), "sparse.t2": ColumnWise()}
    model = dtrec.distribute_module(_model(), mesh, plan, optimizer=dtrec.optim.RowWiseAdagrad(0.1))
    before = {n: t.weight.to_local().clone() for n, t in model.sparse.embedding_bags.items()}
    model(_batch(rank)).sum().backward()
    full = model.fused_optimizer.state_dict()
    state = full["state"]
    changed = {
        n: not torch.equal(t.weight.to_local(), before[n])
        for n, t in model.sparse.embedding_bags.items()
        if t.weight.to_local().numel()
    }
    local_rows = {
        n: t.weight.to_local().shape[0] if t.weight.to_local().dim() == 2 else 0
        for n, t in model.sparse.embedding_bags.items()
    }
    locals_ = [
        t.weight.to_local()
        for t in model.sparse.embedding_bags.values()
        if t.weight.to_local().numel()
    ]
    storages = {w.untyped_storage().data_ptr() for w in locals_}
    # Round trip, then a mismatch.
    model.fused_optimizer.load_state_dict(full)
    bad = {"state": {k: dict(v) for k, v in state.items()}, "param_groups": full["param_groups"]}
    bad["state"]["sparse.t0"]["sum"] = torch.zeros(1000)
    return {
        "one_storage": len(locals_) < 2 or len(storages) == 1,
        "keys": sorted(state),
        "sum_rows": {k: tuple(v["sum"].to_local().shape) for k, v in state.items()},
        "sum_global": {k: tuple(v["sum"].shape) for k, v in state.items()},
        "sum_placements": {k: str(v["sum"].placements) for k, v in state.items()},
        "local_rows": local_rows,
        "no_grads": all(t.weight.grad is None for t in model.sparse.embedding_bags.values()),
        "changed": changed,
        "mismatch": error_of(lambda: model.fused_optimizer.load_state_dict(bad)),
        "torch_optimizer": error_of(
            lambda: dtrec.distribute_module(_model(), mesh, plan, optimizer=torch.optim.SGD)
        ),
    }


def _bf16(rank: int) -> dict:
    """bf16 tables through the sharded step, against fp32 math on the same (rounded) weights."""
    import torch

    import dtrec
    from dtrec.placements import ColumnWise, DataParallel, RowWise, TableWise

    mesh = dtrec.init_mesh("cpu", 2)
    plan = {
        "sparse.t0": RowWise(),
        "sparse.t1": TableWise(rank=1),
        "sparse.t2": ColumnWise(),
        "sparse.t3": DataParallel(),
    }
    out = {}
    for name, fused in (("plain", None), ("fused_sgd", dtrec.optim.SGD(lr=0.5))):
        reference = _model().to(torch.bfloat16).float()  # fp32 copy of the bf16 weights
        model = _model().to(torch.bfloat16)
        model = dtrec.distribute_module(model, mesh, plan, optimizer=fused)
        kjt = _batch(rank)
        y = model.sparse(kjt).values()
        want = reference.sparse(kjt).values()
        before = {n: t.weight.to_local().clone() for n, t in model.sparse.embedding_bags.items()}
        y.float().square().sum().backward()
        if fused is None:
            torch.optim.SGD(model.parameters(), lr=0.5).step()
        out[name] = {
            "dtype": str(y.dtype),
            "max_rel_err": ((y.float() - want).abs().max() / want.abs().max()).item(),
            "weights_bf16": all(
                t.weight.dtype == torch.bfloat16 for t in model.sparse.embedding_bags.values()
            ),
            "updated": any(
                not torch.equal(t.weight.to_local(), before[n])
                for n, t in model.sparse.embedding_bags.items()
            ),
        }
    return out


def _determinism(rank: int) -> dict:
    """Same seed, plan and batches twice: bit-identical weights and fused state (CPU)."""
    import torch

    import dtrec
    from dtrec.checkpoint import full_state_dict, full_tensor
    from dtrec.placements import ColumnWise, DataParallel, RowWise, TableWise

    mesh = dtrec.init_mesh("cpu", 2)  # 4 ranks: S=2, R=2 (replica sync included)
    plan = {
        "sparse.t0": RowWise(),
        "sparse.t1": TableWise(rank=1),
        "sparse.t2": ColumnWise(),
        "sparse.t3": DataParallel(),
    }
    fused = {
        "torch_sgd": None,
        "rowwise_adagrad": dtrec.optim.RowWiseAdagrad(lr=0.1),
        "adam": dtrec.optim.Adam(lr=0.05),
    }

    def run(optimizer) -> dict:
        model = dtrec.distribute_module(_model(), mesh, plan, optimizer=optimizer)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=0.1)
        for step in range(3):
            model(_batch(rank + 10 * step)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        state = full_state_dict(model)
        if optimizer is not None:
            for table, entries in model.fused_optimizer.state_dict()["state"].items():
                state.update({f"{table}.{k}": full_tensor(v) for k, v in entries.items()})
        return state

    out = {}
    for name, optimizer in fused.items():
        first, second = run(optimizer), run(optimizer)
        out[name] = sorted(first) == sorted(second) and all(
            torch.equal(first[k], second[k]) for k in first
        )
    return out


def _meta_tables(rank: int) -> dict:
    """Tables on the meta device: each rank creates only its blocks; the same full tables
    under two plans, equal to ``dtrec.modules.init.table_block`` of the whole table."""
    import torch

    import dtrec
    from dtrec.checkpoint import full_state_dict
    from dtrec.modules.init import table_block
    from dtrec.placements import ColumnWise, DataParallel, RowWise, TableWise
    from tests.distributed.numerics import TinyModel, make_tables

    plans = [
        {"sparse.t0": RowWise(), "sparse.t1": TableWise(rank=1), "sparse.t2": ColumnWise(),
         "sparse.t3": DataParallel()},
        # t1's 5 columns over 4 positions: the last column chunk is empty
        {"sparse.t0": ColumnWise(), "sparse.t1": ColumnWise(), "sparse.t2": TableWise(rank=0),
         "sparse.t3": RowWise()},
    ]  # fmt: skip
    fulls = []
    for shards, plan in zip((2, 4), plans):
        torch.manual_seed(7)
        model = TinyModel(make_tables(False))
        model.sparse = dtrec.EmbeddingBagCollection(make_tables(False), device="meta")
        model = dtrec.distribute_module(model, dtrec.init_mesh("cpu", shards), plan)
        loss = model(_batch(rank)).square().sum()  # trains like any sharded model
        loss.backward()
        fulls.append({k: v for k, v in full_state_dict(model).items() if "embedding_bags" in k})
    want = {
        f"sparse.embedding_bags.{cfg.name}.weight": table_block(
            cfg.name, cfg.num_embeddings, cfg.embedding_dim, (0, cfg.num_embeddings),
            (0, cfg.embedding_dim), seed=7,
        )
        for cfg in make_tables(False)
    }  # fmt: skip
    return {
        "same_under_both_plans": all(torch.equal(fulls[0][k], fulls[1][k]) for k in want),
        "equal_to_init": all(torch.equal(fulls[0][k], want[k]) for k in want),
        "not_all_zero": all(bool(w.abs().sum() > 0) for w in want.values()),
    }


def _all_checks(rank: int, world: int) -> dict:
    return {
        "meta_tables": _meta_tables(rank),
        "determinism": _determinism(rank),
        "bf16": _bf16(rank),
        "fused": _fused(rank),
        "round_trips": _round_trips(rank),
        "comm": _comm_counts(rank),
        "weighted_comm": _weighted_comm(rank),
        "bad_input": _bad_input(rank),
        "bad_batch_everywhere": _bad_batch_everywhere(rank),
        "plans": _plans(rank),
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(4, _all_checks, timeout=600, collective_timeout=60)


def test_distribute_tensor_round_trips(results) -> None:
    for rank, r in enumerate(results):
        for (shards, spec), (member, _placements, equal) in r["round_trips"].items():
            if member:
                assert equal, f"rank {rank} S={shards} {spec}: full_tensor differs"
            else:
                # Only table-wise / table-row-wise tables leave ranks out of their sub-mesh.
                assert spec.startswith(("TW", "TRW")), (rank, shards, spec)
    # RW on S=4 is (Shard(0), Replicate()) on the 2D mesh.
    assert "Shard(dim=0)" in str(results[0]["round_trips"][(4, "RW")][1])


def test_row_wise_forward_collectives_and_sharded_grads(results) -> None:
    for rank, r in enumerate(results):
        comm = r["comm"]
        # header + ids + pooled output: three all-to-alls, nothing else (no all-gather).
        assert comm["forward_calls"] == {
            "input_dist.header": 1,
            "input_dist.ids": 1,
            "output_dist": 1,
        }, rank
        assert sum(comm["forward_c10d"].values()) == 3, comm["forward_c10d"]
        assert all("all_to_all" in k or "alltoall" in k for k in comm["forward_c10d"]), comm
        # backward: one all-to-all for the partials; R=1 so no replicate all-reduce.
        assert comm["backward_calls"] == {"output_dist.backward": 1}, rank
        # No rank ever holds a full-size gradient of a row-wise table.
        assert comm["grad_local_rows"] == comm["weight_local_rows"]
        for name, shape in comm["grad_local_rows"].items():
            assert shape[0] <= 97 // 4 + 1, (name, shape)


def test_per_sample_weights_travel_with_the_ids(results) -> None:
    for rank, r in enumerate(results):
        w = r["weighted_comm"]
        assert w["calls"] == {"input_dist.header": 1, "input_dist.ids": 1, "output_dist": 1}, rank
        assert w["max_diff"] <= 1e-6, (rank, w["max_diff"])


def test_bad_batch_fails_every_rank_cleanly(results) -> None:
    by_rank = [r["bad_input"] for r in results]
    assert by_rank[1]["out_of_range"].startswith("IndexError")
    assert "table 't" in by_rank[1]["out_of_range"] and "on rank 1" in by_rank[1]["out_of_range"]
    assert by_rank[1]["bad_beside_empty"] == by_rank[1]["out_of_range"]
    for rank in (0, 2, 3):
        for case in ("out_of_range", "bad_beside_empty"):
            assert by_rank[rank][case].startswith("ValueError"), by_rank[rank]
            assert "rank(s) [1]" in by_rank[rank][case]
    for rank in range(4):
        assert by_rank[rank]["weights_unchanged"]
        assert by_rank[rank]["weights_unchanged_beside_empty"]
        assert by_rank[rank]["batch_size"] == "ok", by_rank[rank]  # uneven batches train
        assert by_rank[rank]["recovers"] == "ok", by_rank[rank]
    assert by_rank[3]["missing_key"].startswith("KeyError") and "'f3'" in by_rank[3]["missing_key"]
    assert "rank(s) [3]" in by_rank[0]["missing_key"]


def test_bad_batch_fails_the_step_on_every_sharding_group(results) -> None:
    for name in ("2d_fused", "2d_torch", "data_parallel_only", "pipeline"):
        for rank, r in enumerate(results):
            case = r["bad_batch_everywhere"][name]
            if rank == 1:
                assert case["error"].startswith("IndexError"), (name, case)
            else:
                assert case["error"].startswith("ValueError"), (name, rank, case)
                assert "rank 1 " in case["error"] or "rank(s) [1]" in case["error"], case
            if name == "pipeline":
                assert case["steps_done"] == 1, (name, rank, case)  # step 0 ran everywhere
            else:
                assert case["unchanged"], (name, rank)  # weights and fused state
                assert case["next"] == "ok", (name, rank, case["next"])


def test_ranks_that_disagree_on_model_or_plan_all_refuse(results) -> None:
    for r in results:
        config, plan = r["bad_input"]["config_mismatch"], r["bad_input"]["plan_mismatch"]
        assert config.startswith("ValueError") and "ranks [2] disagree" in config, config
        assert "num_embeddings=50" in config and "num_embeddings=51" in config, config
        assert plan.startswith("ValueError") and "ranks [1] disagree" in plan, plan
        assert "plan 'sparse.t1'" in plan and "TableWise(rank=1)" in plan, plan


def test_plans_that_do_not_fit_are_clear_errors(results) -> None:
    r = results[0]["bad_input"]
    assert r["unknown_table"].startswith("KeyError") and "sparse.nope" in r["unknown_table"]
    assert r["narrow_cw"].startswith("ValueError") and "'narrow'" in r["narrow_cw"]
    assert "RowWise()" in r["narrow_cw"]
    assert r["trw_without_nodes"].startswith("ValueError") and "node_size" in r["trw_without_nodes"]
    assert "TableWise(rank=4)" in r["tw_rank_out_of_range"]
    assert r["not_a_spec"].startswith("TypeError") and "sparse.t3" in r["not_a_spec"]
    assert "no dtrec.EmbeddingBagCollection" in r["no_collection"]
    assert r["meta"].startswith("ValueError") and "dense.weight" in r["meta"], r["meta"]
    assert "only embedding tables" in r["meta"]


def test_planner_fills_and_resolves(results) -> None:
    plans = [{k: v for k, v in r["plans"].items() if k != "planned_training"} for r in results]
    assert all(p == plans[0] for p in plans), "ranks computed different plans"
    p = plans[0]
    assert set(p["auto"]) == {"sparse.t0", "sparse.t1", "sparse.t2", "sparse.t3"}
    assert all("?" not in v for v in p["auto"].values()), p["auto"]  # every choice made
    assert p["pinned"]["sparse.t2"] == "RW" and p["pinned"]["sparse.t0"] == "TW(1)"
    assert p["resolved"]["sparse.t1"] in ("TW(0)", "TW(1)")
    assert "sparse.t1" in p["printed"] and "imbalance" in p["printed"]  # explained
    for r in results:  # the planner's plan trains exactly
        weight_diff, loss_diff = r["plans"]["planned_training"]
        assert weight_diff < 1e-5 and loss_diff < 1e-5, r["plans"]["planned_training"]
    # state_dict: the unsharded model's keys, DTensor values for tables.
    assert p["state_keys"] == p["unsharded_keys"]
    assert "sparse.embedding_bags.t0.weight" in p["state_keys"]
    assert p["table_values_are_dtensors"]


def test_fused_optimizer_state_and_no_grads(results) -> None:
    for rank, r in enumerate(results):
        f = r["fused"]
        assert f["keys"] == ["sparse.t0", "sparse.t1", "sparse.t2", "sparse.t3"]
        assert f["no_grads"], rank
        assert f["one_storage"], f"rank {rank}: local shards are not packed in one buffer"
        assert all(f["changed"].values()), (rank, f["changed"])
        for table, rows in f["local_rows"].items():
            assert f["sum_rows"][f"sparse.{table}"] == (rows,), (rank, table)
        # DTensors placed like their table: rows sharded as the table's, global shape [rows].
        rows = {"sparse.t0": 50, "sparse.t1": 3, "sparse.t2": 97, "sparse.t3": 20}
        assert f["sum_global"] == {k: (n,) for k, n in rows.items()}, f["sum_global"]
        assert f["sum_placements"]["sparse.t0"] == "(Shard(dim=0), Replicate())"  # row-wise
        assert f["sum_placements"]["sparse.t2"] == "(Replicate(), Replicate())"  # column-wise
        assert f["mismatch"].startswith("ValueError") and "sparse.t0.sum" in f["mismatch"]
        assert f["torch_optimizer"].startswith("TypeError")


def test_bf16_tables(results) -> None:
    for rank, r in enumerate(results):
        for name, b in r["bf16"].items():
            assert b["dtype"] == "torch.bfloat16", (rank, name)
            assert b["max_rel_err"] < 1e-2, (rank, name, b["max_rel_err"])
            assert b["weights_bf16"] and b["updated"], (rank, name, b)


def test_two_runs_are_bit_identical(results) -> None:
    for rank, r in enumerate(results):
        assert r["determinism"] == {"torch_sgd": True, "rowwise_adagrad": True, "adam": True}, (
            rank,
            r["determinism"],
        )


def test_meta_device_tables_are_created_sharded_with_plan_independent_values(results) -> None:
    for rank, r in enumerate(results):
        assert r["meta_tables"] == {
            "same_under_both_plans": True,
            "equal_to_init": True,
            "not_all_zero": True,
        }, (rank, r["meta_tables"])
