"""Property test: the numerics contract holds per collection over per-collection mesh shapes.

A model with a pooled and a sequence collection (``SeqModel`` of test_distribute.py) on 4
gloo ranks, each collection on a mesh of its own (TorchRec's Dynamic 2D): every pair of
shard group sizes (S_pooled, S_seq) in {1, 2, 4}^2, each pair drawn with a seeded RNG:

* a sharding type per table (table-wise on a drawn shard position, row-wise,
  column-wise, data-parallel);
* each mesh with replicas within a node or across nodes (``replicas_within_node``);
* the mesh of the dense part (its S), which shards no table here;
* torch SGD on DTensor parameters, or a fused optimizer (SGD, row-wise Adagrad, Adam),
  or fused SGD with ``sync_every=1`` (weights averaged instead of gradients summed: the
  same step for SGD).

Each case trains the sharded model and the unsharded one on the global batch side by side
(``_train_side_by_side``) and must end with the same losses and weights to 1e-5, with
each collection on the mesh shape asked for and the plan made per mesh. One world runs every case;
``pytest --slow`` draws 3 cases per pair instead of 1.
"""

from __future__ import annotations

import itertools
import random

import pytest

from tests.multiprocess import run_world
from tests.sequence.test_distribute import BAG_TABLES, SEQ_TABLES, TOL

SHARDS = (1, 2, 4)
WORLD = 4
OPTIMIZERS = ("torch_sgd", "sgd", "rowwise_adagrad", "adam", "sgd_sync_every_1")
SEED = 34


def draw_cases(per_pair: int, seed: int = SEED) -> list[dict]:
    """Every (S_pooled, S_seq) pair ``per_pair`` times, the rest drawn from ``seed``.

    A table spec is a (type, shard position) pair (position for table-wise only), so the
    cases travel to the ranks as plain data."""
    rng = random.Random(seed)
    tables = [f"pooled.{t[0]}" for t in BAG_TABLES] + [f"seq.{t[0]}" for t in SEQ_TABLES]
    cases = []
    for (s_pooled, s_seq), i in itertools.product(
        itertools.product(SHARDS, SHARDS), range(per_pair)
    ):
        shards = {"pooled": s_pooled, "seq": s_seq}
        specs = {}
        for table in tables:
            kind = rng.choice(["table_wise", "row_wise", "column_wise", "data_parallel"])
            position = rng.randrange(shards[table.split(".")[0]]) if kind == "table_wise" else None
            specs[table] = (kind, position)
        cases.append({
            "name": f"pooled{s_pooled}_seq{s_seq}_{i}",
            "shards": shards,
            "within_node": {c: rng.random() < 0.5 for c in shards},
            "dense_shards": rng.choice(SHARDS),
            "specs": specs,
            "optimizer": rng.choice(OPTIMIZERS),
        })  # fmt: skip
    return cases


def _spec(kind: str, position: int | None):
    from dtrec.placements import ColumnWise, DataParallel, RowWise, TableWise

    if kind == "table_wise":
        return TableWise(rank=position)
    return {"row_wise": RowWise, "column_wise": ColumnWise, "data_parallel": DataParallel}[kind]()


def _run_cases(rank: int, world: int, cases: list[dict]) -> dict:
    import dtrec
    from tests.sequence.test_distribute import _train_side_by_side

    meshes: dict = {}

    def mesh(shards: int, within_node: bool = True):
        # one mesh (and its process groups) per layout, shared by the cases
        key = (shards, within_node)
        if key not in meshes:
            meshes[key] = dtrec.init_mesh("cpu", shards, replicas_within_node=within_node)
        return meshes[key]

    out = {}
    for case in cases:
        opt = case["optimizer"]
        fused = {
            "torch_sgd": None,
            "sgd": dtrec.optim.SGD(lr=0.1),
            "rowwise_adagrad": dtrec.optim.RowWiseAdagrad(lr=0.1),
            "adam": dtrec.optim.Adam(lr=0.05),
            "sgd_sync_every_1": dtrec.optim.SGD(lr=0.1),
        }[opt]
        own = {c: mesh(s, case["within_node"][c]) for c, s in case["shards"].items()}
        result = _train_side_by_side(
            mesh(case["dense_shards"]),
            {table: _spec(*spec) for table, spec in case["specs"].items()},
            fused,
            seed=len(out),
            sync_every=1 if opt == "sgd_sync_every_1" else None,
            meshes=own,
        )
        result.pop("explained")
        out[case["name"]] = result
    return out


def _per_pair(config: pytest.Config) -> int:
    return 3 if config.getoption("--slow") else 1


@pytest.fixture(scope="module")
def cases(request) -> list[dict]:
    return draw_cases(_per_pair(request.config))


@pytest.fixture(scope="module")
def results(cases) -> list[dict]:
    return run_world(WORLD, _run_cases, cases, timeout=600)


def test_cases_cover_every_pair_of_mesh_shapes(cases) -> None:
    pairs = {(c["shards"]["pooled"], c["shards"]["seq"]) for c in cases}
    assert pairs == set(itertools.product(SHARDS, SHARDS))
    kinds = {spec[0] for c in cases for spec in c["specs"].values()}
    assert kinds == {"table_wise", "row_wise", "column_wise", "data_parallel"}, kinds
    assert {c["optimizer"] for c in cases} == set(OPTIMIZERS)
    assert {w for c in cases for w in c["within_node"].values()} == {True, False}
    # drawn once, the same everywhere: the world and this test see the same cases
    assert draw_cases(1) == draw_cases(1) and len(draw_cases(2)) == 2 * len(SHARDS) ** 2


def test_every_collection_meets_the_numerics_contract_on_its_own_mesh(cases, results) -> None:
    for case in cases:
        name = case["name"]
        want_shapes = {c: (s, WORLD // s) for c, s in case["shards"].items()}
        for rank, per_rank in enumerate(results):
            r = per_rank[name]
            assert r["keys_kept"], (name, rank)
            assert r["loss_diff"] <= TOL and r["weight_diff"] <= TOL, (name, rank, case, r)
            assert r["mesh_shapes"] == want_shapes, (name, r["mesh_shapes"])
        plan = results[0][name]["plan"]
        assert set(plan) == set(case["specs"]), (name, plan)
        # planned and explained per mesh (one mesh object per layout: collections sharing
        # a layout share a mesh, and one mesh for all is one plan with no per-mesh report)
        layouts: dict = {}
        for c, s in case["shards"].items():
            layouts.setdefault((s, case["within_node"][c]), []).append(c)
        want_reports = [] if len(layouts) == 1 else sorted(
            f"{', '.join(sorted(held))} on mesh {s} x {WORLD // s}"
            for (s, _), held in layouts.items()
        )  # fmt: skip
        assert results[0][name]["reports"] == want_reports, (name, results[0][name]["reports"])
