"""The scale model's checks (issue 33): bytes simulated on the mirror world equal the bytes
of a real gloo run, rank by rank and collective by collective; the H200 step calibration
predicts the measured one-GPU steps within 15%.

One spawned 4-rank world runs every plan (one-dimensional, 2D and mixed ones).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import dtrec
from benchmarks.scale.sim import Workload, make_features, simulate_rank
from dtrec.placements import ColumnWise, DataParallel, RowWise, TableRowWise, TableWise
from tests.multiprocess import run_world

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
WORLD = 4
W = Workload(rows=(1000, 50, 3000, 20000), hotness=(3, 1, 8, 20), dim=16, batch=64, seed=3)
PLANS = {  # name -> (shard group size, node size, specs)
    "row_wise": (4, None, {f"t{i}": RowWise() for i in range(4)}),
    "table_wise": (4, None, {f"t{i}": TableWise(rank=(i + 1) % 4) for i in range(4)}),
    "column_wise": (4, None, {f"t{i}": ColumnWise() for i in range(4)}),
    "table_row_wise": (4, 2, {f"t{i}": TableRowWise(node=i % 2) for i in range(4)}),
    "2d_row_wise": (2, None, {f"t{i}": RowWise() for i in range(4)}),
    "2d_mixed": (
        2,
        None,
        {"t0": RowWise(), "t1": DataParallel(), "t2": TableWise(rank=1), "t3": ColumnWise()},
    ),  # fmt: skip
    # replicas average weights and Adagrad state every 2 steps instead of summing gradients
    "2d_mixed_sync_every_2": (
        2,
        None,
        {"t0": RowWise(), "t1": DataParallel(), "t2": TableWise(rank=1), "t3": ColumnWise()},
        2,
    ),  # fmt: skip
}


class _Model(nn.Module):
    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        self.sparse = dtrec.EmbeddingBagCollection(W.tables(), device=device or "cpu")
        width = len(W.rows) * W.dim
        self.dense = nn.Sequential(nn.Linear(width, 32), nn.ReLU(), nn.Linear(32, 1))
        if device is not None:
            self.dense.to(device)

    def forward(self, kjt):
        return self.dense(self.sparse(kjt).values())


PLANS_8 = {  # W = 8: a 2D mix with 4 replicas' worth of syncs, table-row-wise on 2 nodes
    "2d_mixed": (4, None, PLANS["2d_mixed"][2]),
    "table_row_wise": (8, 4, {f"t{i}": TableRowWise(node=i % 2) for i in range(4)}),
}


def _real_bytes(rank: int, world_size: int, plans: dict | None = None) -> dict:
    """Per plan: this rank's comm_stats per step of its steps after the first (which may
    set things up): one step, or ``sync_every`` steps (one replica average among them)."""
    out = {}
    for name, (shards, node, specs, *every) in (plans or PLANS).items():
        sync_every = every[0] if every else None
        torch.manual_seed(0)
        mesh = dtrec.init_mesh("cpu", shards, node)
        model = dtrec.distribute_module(
            _Model(), mesh, {f"sparse.{k}": v for k, v in specs.items()},
            optimizer=dtrec.optim.RowWiseAdagrad(lr=0.01, eps=1e-8), sync_every=sync_every,
        )  # fmt: skip
        kjt = make_features(W, rank)
        model(kjt).sum().backward()
        steps = sync_every or 1
        with dtrec.comm_stats() as stats:
            for _ in range(steps):
                model(kjt).sum().backward()
        out[name] = {k: {"calls": v["calls"], "bytes": v["bytes"]}
                     for k, v in stats.per_step(steps).items()}  # fmt: skip
    return out


@pytest.fixture(scope="module")
def real() -> list[dict]:
    return run_world(WORLD, _real_bytes, timeout=240)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_simulated_bytes_equal_a_real_run(real: list[dict], name: str) -> None:
    shards, node, specs, *every = PLANS[name]
    dense = _Model("meta").dense
    for rank in range(WORLD):
        sim = simulate_rank(
            W, specs, WORLD, shards, rank, node, dense, sync_every=every[0] if every else None
        )
        assert sim.comm == real[rank][name], f"rank {rank}"


@pytest.fixture(scope="module")
def real_8() -> list[dict]:
    return run_world(8, _real_bytes, PLANS_8, timeout=240)


@pytest.mark.parametrize("name", sorted(PLANS_8))
def test_simulated_bytes_equal_a_real_run_at_w8(real_8: list[dict], name: str) -> None:
    shards, node, specs = PLANS_8[name]
    dense = _Model("meta").dense
    for rank in range(8):
        sim = simulate_rank(W, specs, 8, shards, rank, node, dense)
        assert sim.comm == real_8[rank][name], f"rank {rank}"


PLANS_16 = {  # W = 16: S 4 x R 4 (exact sync and sync_every), table-row-wise on 4 nodes
    "2d_mixed": (4, None, PLANS["2d_mixed"][2]),
    "2d_mixed_sync_every_2": (4, None, PLANS["2d_mixed"][2], 2),
    "table_row_wise": (16, 4, {f"t{i}": TableRowWise(node=i % 4) for i in range(4)}),
}


@pytest.fixture(scope="module")
def real_16() -> list[dict]:
    return run_world(16, _real_bytes, PLANS_16, timeout=400)


@pytest.mark.parametrize("name", sorted(PLANS_16))
def test_simulated_bytes_equal_a_real_run_at_w16(real_16: list[dict], name: str) -> None:
    shards, node, specs, *every = PLANS_16[name]
    dense = _Model("meta").dense
    for rank in range(16):
        sim = simulate_rank(W, specs, 16, shards, rank, node, dense,
                            sync_every=every[0] if every else None)  # fmt: skip
        assert sim.comm == real_16[rank][name], f"rank {rank}"


def test_every_plan_exercises_its_exchanges(real: list[dict]) -> None:
    """The comparison is not vacuous: the plans together run every kind the model prices."""
    kinds = {k for per_rank in real for plan in per_rank.values() for k in plan}
    expected = {
        "input_dist.ids",
        "output_dist.backward",
        "grad_sync.replicate.sparse",
        "grad_sync.data_parallel.counts",
        "optim.row_sq_sum",
        "dense.grad_sync",
        "replica_sync.weights",
    }
    assert expected <= kinds


def test_one_gpu_step_within_15_percent_of_h200() -> None:
    from benchmarks.scale.run import one_gpu_check

    path = RESULTS / "gpu_step_h200_2026-11-27.json"
    rows = one_gpu_check(json.loads(path.read_text()))
    assert rows, "no gpu_step configs"
    for row in rows:
        assert abs(row["error"]) <= 0.15, row


def test_planner_mesh_choice_orders_2d_shapes_as_the_scale_model() -> None:
    """``dtrec.choose_shard_group_size``'s ranking (the planner's cost model, its H100 call
    latencies) orders the sweep's exact-sync 2D shapes of each W <= 256 as the scale
    model's committed steps do (``scale_2026-12-02.json``; the sweep checks every W up to
    4096 with ``--mesh-choice``)."""
    from benchmarks.scale.run import mesh_choices, mlperf

    report = json.loads((RESULTS / "scale_2026-12-02.json").read_text())
    rows = [r for r in report["configs"] if r["W"] <= 256]
    checked = mesh_choices(rows, mlperf(report["workload"]["batch_per_gpu"]))
    assert [c["W"] for c in checked] == [16, 32, 64, 128, 256]
    for c in checked:
        assert c["planner_order"] == c["model_order"], c


def test_one_d_layouts_are_torchrecs_own_plans() -> None:
    """The sweep's 1D row-wise and table-row-wise plans are TorchRec's
    (``construct_module_sharding_plan`` with ``row_wise()`` / ``table_row_wise(host_index)``)
    read by ``dtrec.interop.plans``: the same blocks as dtrec's ``RowWise()`` and
    ``TableRowWise(node=i mod nodes)``, whose bytes the checks above compare."""
    pytest.importorskip("torchrec")
    from benchmarks.scale.run import _one_d

    for kind, want in (("row_wise", lambda i: RowWise()),
                       ("table_row_wise", lambda i: TableRowWise(node=i % 2))):  # fmt: skip
        specs, _, source = _one_d(W, 16, kind)
        assert source == "torchrec plan via dtrec.interop.plans"
        assert specs == {f"t{i}": want(i) for i in range(4)}


def _replica_slice_bytes(comm: dict) -> float:
    return sum(v["bytes"] for k, v in comm.items() if k.startswith("replica_slices."))


def test_fully_sharded_rank_holds_its_slice_and_routes_rows_not_gradient_sums() -> None:
    """Fully sharded 2D on the mirror world (S 2 x R 4, every table row-wise): the real
    ``fetch_touched`` / ``route_to_owners`` send (R-1)/R x U x (8D + 8) per rank over
    the replicas (ids, rows, gradients back; ``docs/fully_sharded_2d.md``), no replica
    gradient sum runs, and the rank holds 1/R of exact 2D's table + state."""
    from benchmarks.scale.run import _fully_sharded, _memory

    world, shards, replicas = 8, 2, 4
    exact = {f"t{i}": RowWise() for i in range(4)}
    sliced = _fully_sharded(exact)
    assert all(s.fully_sharded for s in sliced.values())
    for rank in (0, 5):
        ex = simulate_rank(W, exact, world, shards, rank)
        fs = simulate_rank(W, sliced, world, shards, rank)
        assert not any(k.startswith("grad_sync.replicate") for k in fs.comm)
        assert ex.comm["grad_sync.replicate.sparse"]["bytes"] > 0
        # U: the distinct ids this rank's shard group (ranks q R + replica) sends its blocks
        position, replica = divmod(rank, replicas)
        batches = [make_features(W, q * replicas + replica).to_dict() for q in range(shards)]
        touched = 0
        for i, rows in enumerate(W.rows):
            lo = position * -(-rows // shards)
            hi = min(rows, lo + -(-rows // shards))
            ids = torch.cat([b[f"f{i}"].values() for b in batches])
            touched += torch.unique(ids[(ids >= lo) & (ids < hi)]).numel()
        formula = (replicas - 1) / replicas * touched * (8 * W.dim + 8)
        assert _replica_slice_bytes(fs.comm) == pytest.approx(formula, rel=0.03)
        # shard-axis traffic is exact 2D's: only the replicate axis changes
        for kind in ("input_dist.ids", "output_dist", "output_dist.backward"):
            assert fs.comm[kind] == ex.comm[kind]
        held_exact, _, _ = _memory(W, exact, world, shards, rank)
        held_fs, _, _ = _memory(W, sliced, world, shards, rank)
        blocks = len(W.rows)  # uneven slices: at most one row per block more or less
        slack = blocks * (W.dim + 1) * 4
        assert abs(held_fs - held_exact / replicas) <= slack


def test_scale_report_prices_fully_sharded_2d_at_every_world() -> None:
    """The committed scale report has a fully sharded row beside every exact 2D shape with
    replicas (W = 16 .. 4096; W = 8's only shape is S 8 x R 1): its table + state per rank
    is exact's sharded part / R (data-parallel tables stay whole), its replicate-axis
    bytes are the planner's cost model's ``replica_slices`` bytes for the rank, and it
    runs no replica gradient sum."""
    from benchmarks.scale.mirror_world import mirror_world
    from benchmarks.scale.run import _fully_sharded, _planned, _topology, mlperf
    from dtrec.placements.mesh import init_mesh, shard_axis
    from dtrec.planning.cost_model import table_cost

    report = json.loads((RESULTS / "scale_2026-12-02.json").read_text())
    w = mlperf(report["workload"]["batch_per_gpu"])
    rows = {(r["W"], r["plan"]): r for r in report["configs"] if "skipped" not in r}
    exact = [r for r in rows.values() if r["plan"].startswith("2d_") and r["R"] > 1
             and r.get("sync_every") is None and not r.get("fully_sharded")
             and not r["plan"].endswith("_planner")]  # fmt: skip
    assert {r["W"] for r in exact} == {2**k for k in range(4, 13)}
    checked_bytes = 0
    for ex in exact:
        fs = rows[ex["W"], ex["plan"] + "_fs"]
        assert fs["fully_sharded"]
        assert (fs["S"], fs["R"], fs["rank"]) == (ex["S"], ex["R"], ex["rank"])
        assert not any(k.startswith("grad_sync.replicate") for k in fs["comm"])
        assert _replica_slice_bytes(fs["comm"]) > 0
        assert fs["table_gb_per_rank"] < ex["table_gb_per_rank"]
        assert (ex["W"], "2d_fs_planner") in rows
        if ex["W"] not in (64, 4096):  # the planner runs per shape: two worlds suffice
            continue
        specs, rank = _planned(w, ex["W"], ex["S"])
        assert rank == ex["rank"]
        with mirror_world(rank, ex["W"]):
            axis = shard_axis(init_mesh("cpu", ex["S"], 8))
        position = rank // axis.replicas
        whole = sum(r * (w.dim + 1) * 4 for c, r in zip(w.tables(), w.rows, strict=True)
                    if type(specs[c.name]).__name__ == "DataParallel")  # fmt: skip
        sharded = 1e9 * ex["table_gb_per_rank"] - whole
        assert 1e9 * fs["table_gb_per_rank"] == pytest.approx(whole + sharded / ex["R"], rel=1e-3)
        priced = 0.0
        for cfg in w.tables():
            cost = table_cost(cfg, _fully_sharded(specs)[cfg.name], axis, _topology(w))
            for kind, sent in (cost.comm or {}).items():
                if kind.startswith("replica_slices"):
                    priced += float(sent[position])
        assert priced > 0
        sim = _replica_slice_bytes(fs["comm"])
        assert sim == pytest.approx(priced, rel=0.02), (ex["W"], ex["plan"])
        checked_bytes += 1
    assert checked_bytes >= 2


PLANS_FS = {  # W = 4: S 2 x R 2, every table but t1 fully sharded 2D
    "2d_fs": (
        2,
        None,
        {
            "t0": RowWise(fully_sharded=True),
            "t1": DataParallel(),
            "t2": TableWise(rank=1, fully_sharded=True),
            "t3": RowWise(fully_sharded=True),
        },
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def real_fs() -> list[dict]:
    return run_world(WORLD, _real_bytes, PLANS_FS, timeout=240)


def test_simulated_fully_sharded_bytes_match_a_real_run(real_fs: list[dict]) -> None:
    """Fully sharded 2D on 4 gloo ranks against the mirror world: the same collectives;
    every kind but the replica exchanges byte for byte per rank; the replica exchanges'
    bytes summed over the ranks within 10% (each replica asks its owners for its own
    touched rows, which the mirror world answers with this rank's own counts)."""
    shards, node, specs = PLANS_FS["2d_fs"]
    dense = _Model("meta").dense
    sims = [simulate_rank(W, specs, WORLD, shards, rank, node, dense) for rank in range(WORLD)]
    for rank, sim in enumerate(sims):
        real = real_fs[rank]["2d_fs"]
        assert set(sim.comm) == set(real), rank
        assert not any(k.startswith("grad_sync.replicate") for k in real)
        for kind in real:
            if not kind.startswith("replica_slices.") or kind.endswith(".counts"):
                assert sim.comm[kind] == real[kind], (rank, kind)
    for kind in ("replica_slices.fetch.ids", "replica_slices.fetch.rows",
                 "replica_slices.grads.values"):  # fmt: skip
        real = sum(r["2d_fs"][kind]["bytes"] for r in real_fs)
        assert real > 0
        assert sum(s.comm[kind]["bytes"] for s in sims) == pytest.approx(real, rel=0.10), kind
