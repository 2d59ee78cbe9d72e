"""Property test of fully sharded 2D (issue 43): random cases equal the unsharded model.

Cases are drawn from one seeded ``random.Random`` at import (``SEED``; the same cases on
every run and every rank), ``CASES[4]`` for a 4-rank gloo world and ``CASES[8]`` for an
8-rank one, each world started once for all its cases. A case is:

* a mesh: S 2 x R 2 and S 1 x R 4 on 4 ranks, S 2 x R 4 and S 4 x R 2 on 8; with or
  without a node split (``node_size``), replicas within a node or strided across them;
* 1-3 random tables: 1-3 rows (fewer than S x R: empty owner slices) or 4-40 (mostly not
  divisible by S x R), 1-6 columns, sum or mean pooling, one or two features;
* per table a fully sharded spec: row-wise, column-wise (all positions or some),
  table-wise (a random position), and on node-split meshes table-row-wise and grid (the
  first table's kind cycles through them); now and then beside an exact 2D or
  data-parallel table;
* an optimizer: fused SGD, row-wise Adagrad, Adam, or torch's SGD or Adam with
  ``foreach=True`` on the tables' DTensor slices;
* 2-3 steps, each rank's batch size per step 0-3 (empty batches included), now and then
  per-sample weights.

Each case trains sharded and unsharded side by side (``tests/distributed/numerics.py``):
every rank's pooled outputs, losses and (torch optimizers) slice gradients every step,
and the weights at the end, within 1e-5 of the unsharded model on the global batch. Then
each rank's holdings at rest: every fully sharded table's stored block is its replica's
chunk of its shard's rows (torch's chunk, computed here, not by dtrec), its optimizer
state (fused or torch's) has the slice's rows, and the rank's packed table storage is
at most its blocks' bytes (no whole shard kept anywhere), and its table + state bytes
are 1/R of its shards' (up to torch's chunk rounding).

``pytest --slow`` runs 60 and 30 cases instead of 15 and 10 (the same first ones).
"""

from __future__ import annotations

import math
import random
from functools import partial

import pytest
import torch

from tests.multiprocess import run_world

SEED = 4343
TOLERANCE = 1e-5
OPTIMIZERS = ("fused_sgd", "fused_rowwise_adagrad", "fused_adam", "torch_sgd", "torch_adam")
MESHES = {  # world -> (S, node_size, replicas_within_node), cycled through the cases
    4: [(2, None, True), (1, None, True), (2, 1, True), (2, 2, False), (1, 1, True)],
    8: [(2, None, True), (4, None, True), (4, 2, True), (2, 1, False), (4, 4, False)],
}
COUNTS = {4: 15, 8: 10}  # cases per world (every optimizer on every world)
SLOW_COUNTS = {4: 60, 8: 30}  # ``pytest --slow``: the first COUNTS cases and more


FS_KINDS = ("row_wise", "column_wise", "table_wise", "table_row_wise", "grid")


def _draw_table(rng: random.Random, kind: str | None, shards: int, nodes: int | None) -> dict:
    """A random table; ``kind`` None: a random one (now and then exact 2D or data parallel)."""
    if kind is None:
        kinds = FS_KINDS if nodes is not None else FS_KINDS[:3]
        kind = rng.choice(kinds)
        if rng.random() < 0.2:
            kind = rng.choice(["exact_row_wise", "data_parallel"])
    rows = rng.randint(1, 3) if rng.random() < 0.3 else rng.randint(4, 40)
    need = {"column_wise": shards, "grid": nodes or 1}.get(kind, 1)
    spec = {"kind": kind}
    if kind == "table_wise":
        spec["rank"] = rng.randrange(shards)
    elif kind == "table_row_wise":
        spec["node"] = rng.randrange(nodes)
    elif kind == "column_wise" and shards > 1 and rng.random() < 0.4:
        spec["positions"] = sorted(rng.sample(range(shards), rng.randint(1, shards)))
        need = len(spec["positions"])
    return {
        "rows": rows,
        "dim": rng.randint(need, max(need, 6)),
        "features": rng.randint(1, 2),
        "pooling": rng.choice(["sum", "mean"]),
        "spec": spec,
    }


def draw_cases(world: int, count: int, seed: int) -> list[dict]:
    """``count`` random cases for a ``world``-rank mesh (see the module docstring)."""
    from dtrec.placements.mesh import positions_per_node

    rng = random.Random(seed)
    cases = []
    for i in range(count):
        shards, node_size, within = MESHES[world][i % len(MESHES[world])]
        nodes = None
        if node_size is not None:  # shard positions per node, as init_mesh reads node_size
            nodes = shards // positions_per_node(world, shards, node_size, within)
        kinds = FS_KINDS if nodes is not None else FS_KINDS[:3]
        first = kinds[(i + i // len(MESHES[world])) % len(kinds)]  # every kind, every mesh
        tables = [_draw_table(rng, first, shards, nodes)]
        tables += [_draw_table(rng, None, shards, nodes) for _ in range(rng.randint(0, 2))]
        weighted = rng.random() < 0.25
        if weighted:
            for t in tables:
                t["pooling"] = "sum"
        steps = rng.randint(2, 3)
        cases.append({
            "mesh": (shards, node_size, within),
            "tables": tables,
            "optimizer": OPTIMIZERS[i % len(OPTIMIZERS)],
            "weighted": weighted,
            "batch_sizes": [[rng.randint(0, 3) for _ in range(world)] for _ in range(steps)],
        })  # fmt: skip
    return cases


CASES = {world: draw_cases(world, SLOW_COUNTS[world], SEED + world) for world in (4, 8)}


def _label(case: dict) -> str:
    shards, node_size, within = case["mesh"]
    mesh = f"{shards}x{{R}}" + (f"n{node_size}" if node_size else "") + ("" if within else "s")
    tables = "+".join(
        f"{t['spec']['kind']}{t['rows']}x{t['dim']}" for t in case["tables"]
    )  # fmt: skip
    return f"{mesh}-{case['optimizer']}-{tables}"


def _spec(spec: dict):
    from dtrec.placements import ColumnWise, DataParallel, Grid, RowWise, TableRowWise, TableWise

    kind = spec["kind"]
    if kind == "exact_row_wise":
        return RowWise()
    if kind == "data_parallel":
        return DataParallel()
    make = {
        "row_wise": lambda: RowWise(fully_sharded=True),
        "column_wise": lambda: ColumnWise(positions=spec.get("positions"), fully_sharded=True),
        "table_wise": lambda: TableWise(rank=spec["rank"], fully_sharded=True),
        "table_row_wise": lambda: TableRowWise(node=spec["node"], fully_sharded=True),
        "grid": lambda: Grid(fully_sharded=True),
    }
    return make[kind]()


def _owner_rows(shard_rows: tuple[int, int], replica: int, replicas: int) -> tuple[int, int]:
    """The rows replica ``replica`` should own: torch's chunk of the shard's rows."""
    chunks = torch.arange(shard_rows[0], shard_rows[1]).chunk(replicas)
    if replica >= len(chunks) or not chunks[replica].numel():
        return (shard_rows[1], shard_rows[1])
    return (int(chunks[replica][0]), int(chunks[replica][-1]) + 1)


def _at_rest(mesh, model, opt) -> dict:
    """What this rank holds between steps, and what fully sharded 2D says it should."""
    from dtrec.placements.mesh import shard_position

    collection = model.sparse
    fused = collection.fused_optimizer_state() if collection.optimizer is not None else {}
    torch_state = {id(p): s for p, s in opt.state.items()}
    position, replica, replicas = shard_position(mesh), mesh.get_coordinate()[1], mesh.size(1)
    problems, held, shard_bytes, block_bytes, slack = [], 0, 0, 0, 0
    storages = {}
    for name, table in collection.embedding_bags.items():
        local = table.weight.to_local()
        if local.numel():
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        # torch's distribute_tensor pads a lone table's storage to its largest chunk: the
        # largest block (fully sharded: owner slice) the table has anywhere on the mesh
        largest = max(
            -(-b.num_rows // (replicas if table.layout.replica_sliced else 1)) * b.num_cols
            for b in table.layout.blocks
        )
        block_bytes += max(local.numel(), largest) * local.element_size()
        if not table.layout.replica_sliced:
            continue
        shard = table.layout.block_at(position)
        if shard is None:
            if table.block is not None or local.numel():
                problems.append(f"{name}: holds {tuple(local.shape)} off its sub-mesh")
            continue
        want = _owner_rows(shard.rows, replica, replicas)
        rows = want[1] - want[0]
        if table.block is None or (table.block.rows, table.block.cols) != (want, shard.cols):
            problems.append(f"{name}: block {table.block}, want rows {want} cols {shard.cols}")
        if tuple(local.shape) != (rows, shard.num_cols):
            problems.append(f"{name}: local {tuple(local.shape)}, want {(rows, shard.num_cols)}")
        states = dict(fused.get(name, {}))
        states.update(torch_state.get(id(table.weight), {}))
        row_bytes = shard.num_cols * local.element_size()  # a row: weight + state
        for key, value in states.items():
            if isinstance(value, torch.Tensor) and value.dim() >= 1:
                value = value.to_local() if hasattr(value, "to_local") else value
                if value.shape[0] != rows:
                    problems.append(f"{name}: state {key} has {value.shape[0]} rows, want {rows}")
                row_bytes += math.prod(value.shape[1:]) * value.element_size()
        held += rows * row_bytes
        shard_bytes += shard.num_rows * row_bytes
        slack += (replicas - 1) * row_bytes  # torch's chunk: at most R - 1 rows over 1/R
    if sum(storages.values()) > block_bytes:  # the tables' storage is their blocks, no more
        problems.append(f"table storage {sum(storages.values())} B > blocks {block_bytes} B")
    return {"problems": problems, "held": held, "shard_bytes": shard_bytes, "slack": slack}


def _run_cases(rank: int, world: int, cases: list[dict], device: str = "cpu") -> list[dict]:
    """Every case on this rank (``device``: where meshes, tables and batches live; the CUDA
    tier's ``tests/gpu/test_fully_sharded_cuda.py`` runs the first ones on a GPU)."""
    import dtrec
    from tests.distributed.numerics import check_numerics

    meshes = {}
    for case in cases:  # every mesh built once, in the same order on every rank
        shards, node_size, within = case["mesh"]
        if case["mesh"] not in meshes:
            meshes[case["mesh"]] = dtrec.init_mesh(
                device, shards, node_size=node_size, replicas_within_node=within
            )
    fused = {
        "fused_sgd": lambda: dtrec.optim.SGD(lr=0.5),
        "fused_rowwise_adagrad": lambda: dtrec.optim.RowWiseAdagrad(lr=0.1),
        "fused_adam": lambda: dtrec.optim.Adam(lr=0.05),
    }
    out = []
    for case in cases:
        mesh = meshes[case["mesh"]]
        tables = [
            dtrec.EmbeddingBagConfig(
                f"t{i}", t["rows"], t["dim"], [f"f{i}_{j}" for j in range(t["features"])],
                t["pooling"],
            )
            for i, t in enumerate(case["tables"])
        ]  # fmt: skip
        plan = {f"t{i}": _spec(t["spec"]) for i, t in enumerate(case["tables"])}
        opt = case["optimizer"]

        def optimizer(opt: str = opt) -> dict:  # a new fused optimizer for each run
            if opt in fused:
                return {"fused": fused[opt]()}
            return {"optimizer": opt.removeprefix("torch_"), "opt_kwargs": {"foreach": True}}

        run = partial(
            check_numerics, mesh, weighted=case["weighted"], tables=tables,
            batch_sizes=case["batch_sizes"], device=device,
        )  # fmt: skip
        r = run(plan, inspect=partial(_at_rest, mesh), **optimizer())
        notes = list(r.notes)
        if not (r.grads_sharded_like_weights and r.shapes_match):
            notes.append("grads or outputs not shaped like the unsharded model's")
        worst = max(r.max_weight_diff, r.max_output_diff, r.max_loss_diff, r.max_grad_diff)
        # float reassociation grows with the weights (fused SGD at lr 0.5 can make them
        # hundreds): a case past TOLERANCE on any rank is held to exact 2D's own difference
        # on the same case (every rank decides alike: the largest over the world)
        largest = torch.tensor([worst], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
        exact_worst = None
        if largest.item() >= TOLERANCE:
            exact_plan = {k: _exact(v) for k, v in plan.items()}
            e = run(exact_plan, **optimizer())
            exact_worst = max(e.max_weight_diff, e.max_output_diff, e.max_loss_diff,
                              e.max_grad_diff)  # fmt: skip
        out.append({"worst": worst, "exact_worst": exact_worst, "notes": notes, **r.inspected})
    return out


def _exact(spec):
    """The exact 2D spec of a fully sharded one (others as they are)."""
    from dataclasses import replace

    return replace(spec, fully_sharded=False) if getattr(spec, "fully_sharded", False) else spec


def _cases(config: pytest.Config, world: int) -> list[dict]:
    return CASES[world][: (SLOW_COUNTS if config.getoption("--slow") else COUNTS)[world]]


@pytest.fixture(scope="module")
def outcomes(request) -> dict[int, list[list[dict]]]:
    return {
        world: run_world(world, _run_cases, _cases(request.config, world), timeout=900)
        for world in (4, 8)
    }


def test_cases_cover_the_issue() -> None:
    """The drawn cases meet every mesh shape, spec, optimizer, tiny and uneven tables."""
    for world in CASES:
        cases = CASES[world][: COUNTS[world]]  # what every run meets
        assert {c["optimizer"] for c in cases} == set(OPTIMIZERS), world
        assert {c["mesh"] for c in cases} == set(MESHES[world]), world
        kinds = {t["spec"]["kind"] for c in cases for t in c["tables"]}
        assert {"row_wise", "column_wise", "table_wise", "table_row_wise", "grid"} <= kinds
        rows = [t["rows"] for c in cases for t in c["tables"]]
        assert any(r < world for r in rows) and any(r % world for r in rows), world
        assert any(0 in step for c in cases for step in c["batch_sizes"]), world
    assert {world // s for world in CASES for s, _, _ in MESHES[world]} == {2, 4}  # R


@pytest.mark.parametrize("world", sorted(CASES))
def test_random_cases_train_like_unsharded_and_hold_owner_slices(request, outcomes, world) -> None:
    cases = _cases(request.config, world)
    assert all(len(results) == len(cases) for results in outcomes[world])
    failed = []
    for index, case in enumerate(cases):
        label = f"case {index} ({_label(case).format(R=world // case['mesh'][0])})"
        for rank, results in enumerate(outcomes[world]):
            got = results[index]
            bound = TOLERANCE
            if got["exact_worst"] is not None:  # see _run_cases: exact 2D's own difference
                bound = max(bound, 1.01 * got["exact_worst"])
            if got["notes"] or got["problems"] or not got["worst"] < bound:
                failed.append(f"{label}, rank {rank}: {got}\n  {case}")
    assert not failed, "\n".join(failed[:6])
    # held to exact 2D's own difference: the exception, not the rule
    fallbacks = sum(got["exact_worst"] is not None for got in outcomes[world][0])
    assert fallbacks <= len(cases) // 5, fallbacks
    # at rest each rank holds 1/R of its shards' rows and state (R = 2 and 4 both met)
    for index, case in enumerate(cases):
        replicas = world // case["mesh"][0]
        for results in outcomes[world]:
            got = results[index]
            assert got["held"] * replicas <= got["shard_bytes"] + got["slack"], (index, got)
