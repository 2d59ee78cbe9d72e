"""Property test: random per-rank batch sizes, 0 included, train like the unsharded model.

Hypothesis draws the examples inside one world of 4 gloo ranks. Every rank draws the
same ones (``derandomize=True``, no database, no shrinking: a shrink step decided by one
rank's outcome would put the ranks out of step), and each example first checks, with
one all-gather, that every rank drew it. An example is:

* pooled (``EmbeddingBagCollection``, sum and mean pooling or per-sample weights) or
  sequence (``EmbeddingCollection``);
* a 1D (S=4, nodes of 2) or 2D (2x2) mesh;
* torch SGD or a fused optimizer (SGD, row-wise Adagrad, Adam);
* row-split ids bucketized by fbgemm (when it loads) or by the sort path;
* 1-3 steps, each rank's batch size per step drawn from 0..5 (often 0);

and each example runs on every sharding type and the mixed plan.

Every rank's outputs, losses and table gradients every step, and the weights at the
end, must equal the unsharded model's on the concatenated batch (loss = sum of the
per-rank losses / W) to 1e-5. The world is bounded by ``run_world``'s timeout and a
60 s collective timeout, so a desync fails the test instead of hanging it.
``pytest --slow`` runs 60 examples instead of 12 (x 7 plans); ``DTREC_UNEVEN_EXAMPLES`` sets the
count directly.
"""

from __future__ import annotations

import os

import pytest

from tests.multiprocess import run_world

TOLERANCE = 1e-5
MESHES = {"1d": 4, "2d": 2}  # shard group size on 4 ranks (nodes of 2)
PLANS = ("data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "grid",
         "mixed")  # fmt: skip


def _examples(config: pytest.Config) -> int:
    given = int(os.environ.get("DTREC_UNEVEN_EXAMPLES", "0"))
    return given or (60 if config.getoption("--slow") else 12)


def _run(rank: int, world: int, examples: int) -> list[dict]:
    import traceback

    import torch.distributed as dist
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    import dtrec
    import dtrec.sharded.dist.routing as routing_module
    from tests.distributed.numerics import PLANS as POOLED_PLANS
    from tests.distributed.numerics import check_numerics
    from tests.sequence.numerics import check_sequence_numerics
    from tests.sequence.numerics import plans as sequence_plans

    meshes = {s: dtrec.init_mesh("cpu", shards, node_size=2) for s, shards in MESHES.items()}
    real_fbgemm = routing_module.fbgemm_ops
    outcomes: list[dict] = []

    size = st.one_of(st.just(0), st.integers(0, 5))
    case = st.tuples(
        st.sampled_from(["pooled", "pooled_weighted", "sequence"]),
        st.sampled_from(sorted(meshes)),
        st.sampled_from(["none", "sgd", "rowwise_adagrad", "adam"]),
        st.sampled_from(["fbgemm", "sort"]),
        st.lists(st.lists(size, min_size=world, max_size=world), min_size=1, max_size=3),
    )

    @settings(
        max_examples=examples, derandomize=True, database=None, deadline=None,
        phases=[Phase.generate], suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(case)
    def each(drawn) -> None:
        kind, mesh_name, opt, bucketize, sizes = drawn
        labels = [None] * world
        dist.all_gather_object(labels, repr(drawn))  # every rank drew this very example
        if len(set(labels)) != 1:
            raise AssertionError(f"ranks drew different examples: {labels}")
        for plan in PLANS:  # every sharding type sees every example
            outcomes.append(one(kind, plan, meshes[mesh_name], opt, bucketize, sizes))
            outcomes[-1]["case"] = f"{kind} {plan} {mesh_name} {opt} {bucketize} sizes={sizes}"

    def one(kind, plan, mesh, opt, bucketize, sizes) -> dict:
        fused = {
            "none": None,
            "sgd": dtrec.optim.SGD(lr=0.5),
            "rowwise_adagrad": dtrec.optim.RowWiseAdagrad(lr=0.1),
            "adam": dtrec.optim.Adam(lr=0.05),
        }[opt]
        if bucketize == "sort":
            routing_module.fbgemm_ops = lambda: None
        try:
            if kind == "sequence":
                r = check_sequence_numerics(
                    mesh, sequence_plans(mesh)[plan], fused, batch_sizes=sizes
                )
                same = r.keys_match and r.lengths_match
                diffs = [r.max_output_diff, r.max_grad_diff, r.max_weight_diff]
            else:
                r = check_numerics(
                    mesh, POOLED_PLANS[plan], kind == "pooled_weighted", fused=fused,
                    batch_sizes=sizes,
                )  # fmt: skip
                same = r.shapes_match and r.grads_sharded_like_weights
                diffs = [r.max_output_diff, r.max_loss_diff, r.max_grad_diff, r.max_weight_diff]
        except Exception:  # noqa: BLE001 - reported to the parent, same on every rank
            return {"error": traceback.format_exc()[-2000:]}
        finally:
            routing_module.fbgemm_ops = real_fbgemm
        empty = any(0 in step for step in sizes)
        uneven = any(len(set(step)) > 1 for step in sizes)
        return {"same": same, "max_diff": max(diffs), "empty": empty, "uneven": uneven}

    each()
    return outcomes


@pytest.fixture(scope="module")
def world_outcomes(request) -> tuple[int, list[list[dict]]]:
    examples = _examples(request.config)
    return examples, run_world(4, _run, examples, timeout=1800, collective_timeout=60)


def test_random_uneven_batch_sizes_match_the_unsharded_model(world_outcomes) -> None:
    examples, outcomes = world_outcomes
    assert len(outcomes[0]) == examples * len(PLANS)
    failed = []
    for rank, results in enumerate(outcomes):
        for r in results:
            if "error" in r:
                failed.append(f"rank {rank}: {r['case']}\n{r['error']}")
            elif not r["same"] or r["max_diff"] >= TOLERANCE:
                failed.append(f"rank {rank}: {r['case']}: {r}")
    assert not failed, "\n\n".join(failed[:5])
    ran = [r for r in outcomes[0] if "error" not in r]
    assert any(r["empty"] for r in ran) and any(r["uneven"] for r in ran)
    assert len({r["case"].split()[0] for r in ran}) > 1  # pooled and sequence examples
