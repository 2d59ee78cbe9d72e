"""Uneven and empty local batches train like the unsharded model, on every sharding type.

The last batch of a ``drop_last=False`` loop is smaller on some ranks, or empty. Each
rank feeds its own batch size (3 vs 5, 0 vs 3, 0 everywhere, one rank alone); its loss
is over its own batch (``rank_loss``: ``sum / max(B, 1)``), gradients are averaged over
the W ranks (TorchRec's ``GRADIENT_DIVISION``), and the unsharded reference is the model
on the concatenated batch with loss = sum of the per-rank losses / W. A rank with B=0
joins every collective and gets a ``(0, D)`` output (sequence: empty JaggedTensors).

Pooled (``EmbeddingBagCollection``: sum and mean pooling, weighted) and sequence
(``EmbeddingCollection``) collections, every sharding type and the mixed plan, a 1D
(S=4 on nodes of 2: table-row-wise and grid split rows inside a node) and a 2D (2x2)
mesh of 4 gloo ranks, torch and fused optimizers (and on 2D, SGD with ``sync_every=1``:
replicas average weights instead of summing gradients). One world runs them with fbgemm as it
loads (row-wise ids then go through fbgemm's ``block_bucketize_sparse_features``: the
calls are counted) and one with ``DTREC_DISABLE_FBGEMM=1`` (the sort path) runs the plans
whose ids are split by rows.
"""

from __future__ import annotations

import pytest

from tests.multiprocess import run_world

TOLERANCE = 1e-5
# Per step, each rank's batch size: uneven, one empty, every rank empty, one rank alone.
SIZES = [[3, 5, 1, 4], [0, 3, 2, 0], [0, 0, 0, 0], [2, 0, 0, 0]]
MESHES = {"1d": (4, 2), "2d": (2, 2)}  # (shard group size, node size) on 4 ranks
PLANS = ("data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "grid",
         "mixed")  # fmt: skip
ROW_SPLIT_PLANS = ("row_wise", "table_row_wise", "grid", "mixed")
# pooled: (per-sample weights, optimizer: torch SGD or a fused rule)
POOLED = {
    "sgd": (False, None),
    "sgd_weighted": (True, None),
    "fused_rowwise_adagrad": (False, "rowwise_adagrad"),
    "fused_sgd_weighted": (True, "sgd"),
}
SEQUENCE = ("none", "rowwise_adagrad")


def _fused(name: str | None):
    import dtrec

    return {
        None: None,
        "none": None,
        "sgd": dtrec.optim.SGD(lr=0.5),
        "rowwise_adagrad": dtrec.optim.RowWiseAdagrad(lr=0.1),
    }[name]


def _run(rank: int, world: int, plans: tuple[str, ...]) -> dict:
    import dtrec
    import dtrec.sharded.dist.routing as routing_module
    from dtrec.ops.backends.fbgemm_loader import fbgemm_available
    from tests.distributed.numerics import PLANS as POOLED_PLANS
    from tests.distributed.numerics import check_numerics
    from tests.sequence.numerics import check_sequence_numerics
    from tests.sequence.numerics import plans as sequence_plans

    real, calls = routing_module.fbgemm_ops, []

    def counted():
        ops = real()
        if ops is not None:
            calls.append(1)
        return ops

    routing_module.fbgemm_ops = counted
    out: dict = {"fbgemm": fbgemm_available()}
    try:
        for mesh_name, (shards, node) in MESHES.items():
            mesh = dtrec.init_mesh("cpu", shards, node_size=node)
            for plan in plans:
                for variant, (weighted, fused) in POOLED.items():
                    r = check_numerics(
                        mesh, POOLED_PLANS[plan], weighted, fused=_fused(fused), batch_sizes=SIZES
                    )
                    out[f"pooled-{mesh_name}-{plan}-{variant}"] = vars(r)
                if shards < world:  # replicas average weights every step instead (SGD only)
                    for variant, fused in (("sync_every_sgd", None), ("sync_every_fused", "sgd")):
                        r = check_numerics(
                            mesh, POOLED_PLANS[plan], False, fused=_fused(fused),
                            batch_sizes=SIZES, sync_every=1,
                        )  # fmt: skip
                        out[f"pooled-{mesh_name}-{plan}-{variant}"] = vars(r)
                for fused in SEQUENCE:
                    r = check_sequence_numerics(
                        mesh, sequence_plans(mesh)[plan], _fused(fused), batch_sizes=SIZES
                    )
                    out[f"sequence-{mesh_name}-{plan}-{fused}"] = vars(r)
    finally:
        routing_module.fbgemm_ops = real
    out["fbgemm_calls"] = len(calls)
    return out


@pytest.fixture(scope="module")
def with_fbgemm() -> list[dict]:
    return run_world(4, _run, PLANS, timeout=900)


@pytest.fixture(scope="module")
def without_fbgemm() -> list[dict]:
    return run_world(4, _run, ROW_SPLIT_PLANS, timeout=900, env={"DTREC_DISABLE_FBGEMM": "1"})


def _check_pooled(results: list[dict], name: str) -> None:
    for rank, per_rank in enumerate(results):
        r = per_rank[name]
        assert r["shapes_match"], f"rank {rank}: output shapes {r['notes']}"
        for key in ("max_weight_diff", "max_loss_diff", "max_output_diff", "max_grad_diff"):
            assert r[key] < TOLERANCE, f"rank {rank}: {key} {r[key]}"
        assert r["grads_sharded_like_weights"], (rank, r["notes"])


def _check_sequence(results: list[dict], name: str) -> None:
    for rank, per_rank in enumerate(results):
        r = per_rank[name]
        assert r["keys_match"] and r["lengths_match"], rank  # (0, D) rows where B = 0
        for key in ("max_output_diff", "max_grad_diff", "max_weight_diff"):
            assert r[key] < TOLERANCE, f"rank {rank}: {key} {r[key]}"


SYNC_EVERY = ("sync_every_sgd", "sync_every_fused")  # 2D only: sync_every=1
POOLED_CASES = [f"{m}-{p}-{v}" for m in MESHES for p in PLANS for v in POOLED] + [
    f"2d-{p}-{v}" for p in PLANS for v in SYNC_EVERY
]
SEQUENCE_CASES = [f"{m}-{p}-{f}" for m in MESHES for p in PLANS for f in SEQUENCE]


@pytest.mark.parametrize("case", POOLED_CASES)
def test_pooled_uneven_batches_match_unsharded(with_fbgemm, case: str) -> None:
    _check_pooled(with_fbgemm, f"pooled-{case}")


@pytest.mark.parametrize("case", SEQUENCE_CASES)
def test_sequence_uneven_batches_match_unsharded(with_fbgemm, case: str) -> None:
    _check_sequence(with_fbgemm, f"sequence-{case}")


def test_row_wise_ids_went_through_fbgemm(with_fbgemm) -> None:
    if not with_fbgemm[0]["fbgemm"]:
        pytest.skip("fbgemm_gpu does not load here: only the sort path exists")
    for rank, r in enumerate(with_fbgemm):
        assert r["fbgemm_calls"] > 0, rank


@pytest.mark.parametrize(
    "case",
    [f"pooled-{m}-{p}-{v}" for m in MESHES for p in ROW_SPLIT_PLANS for v in POOLED]
    + [f"pooled-2d-{p}-{v}" for p in ROW_SPLIT_PLANS for v in SYNC_EVERY]
    + [f"sequence-{m}-{p}-{f}" for m in MESHES for p in ROW_SPLIT_PLANS for f in SEQUENCE],
)
def test_sort_bucketize_without_fbgemm(without_fbgemm, case: str) -> None:
    for rank, r in enumerate(without_fbgemm):
        assert not r["fbgemm"] and r["fbgemm_calls"] == 0, rank
    check = _check_pooled if case.startswith("pooled") else _check_sequence
    check(without_fbgemm, case)
