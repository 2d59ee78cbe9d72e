"""Sharded EmbeddingCollection == unsharded: every sharding type, 1D and 2D meshes, with and
without fused optimizers; outputs, gradients, weights after 3 steps, output-dist bytes.

One spawned world per mesh shape runs every case; the tests assert on its results.
"""

from __future__ import annotations

import pytest

from tests.multiprocess import run_world

TOLERANCE = 1e-6
MESHES = {"1d": (4, 2), "2d": (2, 2)}  # (shard group size, node size) on 4 ranks
PLANS = ("data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "grid",
         "mixed")  # fmt: skip
OPTIMIZERS = ("none", "sgd", "rowwise_adagrad", "adam")
UNIFORM_OPTIMIZERS = ("none", "rowwise_adagrad")  # one dim: rows placed whole (column_unit)


def _optimizer(name: str):
    import dtrec

    return {
        "none": None,
        "sgd": dtrec.optim.SGD(lr=0.1),
        "rowwise_adagrad": dtrec.optim.RowWiseAdagrad(lr=0.1),
        "adam": dtrec.optim.Adam(lr=0.05),
    }[name]


def _run_cases(rank: int, world: int, shards: int, node: int) -> dict[str, object]:
    import dtrec
    from tests.sequence.numerics import UNIFORM_TABLES, check_sequence_numerics, plans

    mesh = dtrec.init_mesh("cpu", shards, node_size=node)
    out = {}
    for plan_name, plan in plans(mesh).items():
        for opt in OPTIMIZERS:
            out[f"{plan_name}/{opt}"] = check_sequence_numerics(mesh, plan, _optimizer(opt))
        for opt in UNIFORM_OPTIMIZERS:
            out[f"{plan_name}/{opt}/uniform"] = check_sequence_numerics(
                mesh, plan, _optimizer(opt), tables=UNIFORM_TABLES
            )
    out["bad_input"] = _bad_inputs(mesh)
    return out


def _bad_inputs(mesh) -> list[str]:
    """Rank 1 feeds a variable-batch KJT, then an out-of-range id: every rank fails the
    step (no hang), rank 1 with the specific error."""
    import torch
    import torch.distributed as dist

    import dtrec
    from dtrec.sharded.sequence import ShardedEmbeddingCollection
    from tests.sequence.numerics import make_batch, make_tables, plans

    tables = make_tables()
    weights = {cfg.name: torch.zeros(cfg.num_embeddings, cfg.embedding_dim) for cfg in tables}
    sharded = ShardedEmbeddingCollection(tables, weights, mesh, plans(mesh)["mixed"])
    good = make_batch(2, torch.Generator().manual_seed(0))
    vbe = dtrec.KeyedJaggedTensor(
        good.keys(), good.values(), good.lengths(),
        stride_per_key_per_rank=[[2]] * len(good.keys()),
        inverse_indices=(good.keys(), torch.tensor([[0, 1]] * len(good.keys()))),
    )  # fmt: skip
    bad_id = dtrec.KeyedJaggedTensor(
        good.keys(), torch.full_like(good.values(), 1000), good.lengths()
    )
    messages = []
    for bad in (vbe, bad_id):
        try:
            sharded(bad if dist.get_rank() == 1 else good)
            messages.append("no error")
        except (ValueError, IndexError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    sharded(good)  # the group is still in step after the refusals
    return messages


@pytest.fixture(scope="module", params=sorted(MESHES))
def world(request):
    shards, node = MESHES[request.param]
    return request.param, run_world(4, _run_cases, shards, node)


CASES = [f"{p}/{o}" for p in PLANS for o in OPTIMIZERS]
CASES += [f"{p}/{o}/uniform" for p in PLANS for o in UNIFORM_OPTIMIZERS]


@pytest.mark.parametrize("case", CASES)
def test_sharded_matches_unsharded(world, case: str) -> None:
    mesh, per_rank = world
    plan = case.split("/")[0]
    for rank, results in enumerate(per_rank):
        r = results[case]
        where = f"{mesh} mesh, rank {rank}"
        assert r.keys_match and r.lengths_match, where
        assert r.max_output_diff <= TOLERANCE, (where, r)
        assert r.max_grad_diff <= TOLERANCE, (where, r)
        assert r.max_weight_diff <= TOLERANCE, (where, r)
        # one output all-to-all per forward (none for data-parallel tables only)
        assert r.output_dist_calls == (0 if plan == "data_parallel" else 3), (where, r)
    sent = sum(results[case].output_dist_bytes for results in per_rank)
    assert sent == per_rank[0][case].expected_bytes_all_ranks
    if plan != "data_parallel":
        assert sent > 0


def test_bad_input_fails_every_rank(world) -> None:
    _, per_rank = world
    vbe, bad_id = per_rank[1]["bad_input"]
    assert vbe.startswith("ValueError: batch on rank 1 is a variable-batch KJT"), vbe
    assert bad_id.startswith("IndexError: feature 'f0' (table 't0') on rank 1: id 1000"), bad_id
    for rank in (0, 2, 3):
        for message in per_rank[rank]["bad_input"]:
            assert message.startswith("ValueError: rank") and "rejected" in message, message
