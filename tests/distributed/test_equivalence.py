"""Property-based equivalence: any tables, plan and mesh train like the unsharded model.

Hypothesis draws the cases inside one world per size W in {1, 2, 4}. Every rank draws the
same examples (``derandomize=True``, no database, no shrinking), so the collectives of each
example line up; each example's differences are collected and checked in the parent.
A case is:

* 1-4 tables: rows 1..5000 (rows < shards included), dims 1..9 (odd ones included), one
  or two features, sum or mean pooling, fp32 or bf16;
* a random spec per table among those valid on a random (S, R) mesh with S x R = W (on
  W=4 also S=4 on nodes of 2 ranks: table-row-wise, grid);
* per-sample weights (sum pooling) or none; plain SGD or a fused optimizer (SGD,
  row-wise Adagrad, Adam); with replicas and SGD, ``sync_every=1`` or the default sync;
* batches of 1-4 samples with empty bags, duplicate ids, and features a rank leaves empty.

Over 3 steps this rank's pooled embeddings, loss and table gradients (plain SGD), and at
the end the weights, must equal the unsharded model's on the global batch: to 1e-5 in
fp32; bf16 weights to within 4 bf16 spacings at the row's largest weight (sharded and
unsharded round partial sums differently; 300 examples: at most 3), pooled embeddings,
loss and gradients to 2% of their scale (at most 0.9%). ``pytest --slow`` runs 12x the
examples; ``DTREC_EQUIVALENCE_EXAMPLES`` sets the count on W=4 directly (W=2 and W=1 run
a third and a fifth as many).
"""

from __future__ import annotations

import os

import pytest

from tests.multiprocess import run_world

TOL = 1e-5
BF16_SPACINGS = 4.0  # weights, in bf16 spacings at the unsharded row's largest |weight|
BF16_REL = 2e-2  # pooled embeddings and loss, relative to their largest magnitude


def _examples(config: pytest.Config, world: int) -> int:
    base = int(os.environ.get("DTREC_EQUIVALENCE_EXAMPLES", "0")) or (
        300 if config.getoption("--slow") else 25
    )
    return max(1, {4: base, 2: base // 3, 1: base // 5}[world])


def _run(rank: int, world: int, examples: int) -> list[dict]:
    import traceback

    import torch
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    import dtrec
    from dtrec.placements import ColumnWise, DataParallel, Grid, RowWise, TableRowWise, TableWise
    from tests.distributed.numerics import check_numerics

    # (S, node size): plain meshes, and on 4 ranks S=4 on nodes of 2 (node-aware specs)
    meshes = {(s, None): dtrec.init_mesh("cpu", s) for s in (1, 2, 4) if world % s == 0}
    if world == 4:
        meshes[(4, 2)] = dtrec.init_mesh("cpu", 4, node_size=2)
    outcomes: list[dict] = []

    @st.composite
    def case(draw):
        shards, node = draw(st.sampled_from(sorted(meshes, key=str)))
        weighted = draw(st.booleans())
        bf16 = draw(st.integers(0, 3)) == 0
        tables, plan = [], {}
        for i in range(draw(st.integers(1, 4))):
            rows = draw(st.one_of(st.integers(1, 64), st.integers(65, 5000)))
            dim = draw(st.integers(1, 9))
            features = [f"f{i}"] + ([f"g{i}"] if draw(st.booleans()) else [])
            pooling = "sum" if weighted else draw(st.sampled_from(["sum", "mean"]))
            tables.append(dtrec.EmbeddingBagConfig(f"t{i}", rows, dim, features, pooling))
            options = [DataParallel(), TableWise(rank=draw(st.integers(0, shards - 1))), RowWise()]
            if dim >= shards:
                options.append(ColumnWise())
            if node is not None:  # 2 nodes of 2 shard positions
                options.append(TableRowWise(node=draw(st.integers(0, 1))))
                if dim >= 2:
                    options.append(Grid())
            plan[f"t{i}"] = draw(st.sampled_from(options))
        fused = draw(st.sampled_from(["none", "sgd", "rowwise_adagrad", "adam"]))
        # sync_every=1 averages weights over replicas: the same math as the gradient sum
        # only for SGD (other optimizers' state is not linear in the gradient)
        replicas = world // shards > 1
        sync_every = (
            draw(st.sampled_from([None, 1])) if replicas and fused in ("none", "sgd") else None
        )
        features = [f for t in tables for f in t.feature_names]
        empty = {r: [f for f in features if draw(st.integers(0, 4)) == 0] for r in range(world)}
        batch = draw(st.integers(1, 4))
        return (shards, node), weighted, bf16, tables, plan, fused, sync_every, empty, batch

    @settings(
        max_examples=examples, derandomize=True, database=None, deadline=None,
        phases=[Phase.generate], suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(case())
    def each(drawn) -> None:
        mesh_key, weighted, bf16, tables, plan, fused, sync_every, empty, batch = drawn
        optimizer = {
            "none": None,
            "sgd": dtrec.optim.SGD(lr=0.05),
            "rowwise_adagrad": dtrec.optim.RowWiseAdagrad(lr=0.1),
            "adam": dtrec.optim.Adam(lr=0.05),
        }[fused]
        label = (
            f"W={world} S,node={mesh_key} weighted={weighted} bf16={bf16} fused={fused} "
            f"sync_every={sync_every} batch={batch} "
            f"empty={ {r: e for r, e in empty.items() if e} } "
            + ", ".join(
                f"{t.name}({t.num_embeddings}x{t.embedding_dim},{len(t.feature_names)}f,"
                f"{t.pooling}):{plan[t.name]}"
                for t in tables
            )
        )
        try:
            # lr 0.05: a one-row table read by every id grows fast at larger rates, and
            # fp32's absolute error with it (the comparison is absolute)
            r = check_numerics(
                meshes[mesh_key], plan, weighted, steps=3, batch=batch, lr=0.05, fused=optimizer,
                tables=tables, dtype=torch.bfloat16 if bf16 else torch.float32,
                sync_every=sync_every, empty=empty,
            )  # fmt: skip
            outcomes.append({"case": label, "bf16": bf16, **vars(r)})
        except Exception:  # noqa: BLE001 - reported to the parent, same on every rank
            outcomes.append({"case": label, "error": traceback.format_exc()[-2000:]})

    each()
    return outcomes


@pytest.fixture(scope="module", params=[4, 2, 1], ids=lambda w: f"W{w}")
def world_outcomes(request) -> tuple[int, list[list[dict]]]:
    world = request.param
    examples = _examples(request.config, world)
    return examples, run_world(world, _run, examples, timeout=1800, collective_timeout=120)


def test_random_tables_plans_and_meshes_match_the_unsharded_model(world_outcomes) -> None:
    examples, outcomes = world_outcomes
    assert len(outcomes[0]) == examples
    failed = []
    for rank, results in enumerate(outcomes):
        for r in results:
            if "error" in r:
                failed.append(f"rank {rank}: {r['case']}\n{r['error']}")
            elif not _within_tolerance(r):
                diffs = {k: v for k, v in r.items() if k.startswith("max_") or k == "notes"}
                failed.append(f"rank {rank}: {r['case']}\n{diffs}")
    assert not failed, f"{len(failed)} failed:\n" + "\n".join(failed[:8])


def _within_tolerance(r: dict) -> bool:
    if not r["grads_sharded_like_weights"]:
        return False
    if r["bf16"]:
        return (
            r["max_weight_diff"] <= BF16_SPACINGS
            and max(r["max_output_diff"], r["max_loss_diff"])
            <= BF16_REL * max(1.0, r["max_output"])
            and r["max_grad_diff"] <= BF16_REL * max(1e-3, r["max_grad"])
        )
    diffs = ("max_weight_diff", "max_output_diff", "max_loss_diff", "max_grad_diff")
    return max(r[k] for k in diffs) < TOL
