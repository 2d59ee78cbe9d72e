"""``full_tensor`` of replicated state takes the first copy, not the last rank's; and
``full_tensors`` assembles many tensors as ``full_tensor`` does each, in a few gathers.

A column-wise table with 6 columns on 4 shards splits them 2, 2, 2, 0: rank 3 holds
no column block, so its copy of row-wise Adagrad's row sums (placed ``Replicate`` over
the column shards) is never updated. ``full_tensor`` assembled every rank's block in
rank order, so rank 3's zeros overwrote the others' sums on every rank: the fused
optimizer's full state, and what the soak's restore check compares, read all zeros
(``benchmarks/soak/run.py`` lost every restore into such a plan).
"""

from __future__ import annotations

import pytest

from tests.multiprocess import run_world


def _run(rank: int, world: int) -> dict:
    import torch
    from torch import nn

    import dtrec
    from dtrec.checkpoint import full_tensor
    from dtrec.placements import ColumnWise, RowWise

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sparse = dtrec.EmbeddingBagCollection([
                dtrec.EmbeddingBagConfig("narrow", 30, 6, ["f0"]),  # 2, 2, 2, 0 columns
                dtrec.EmbeddingBagConfig("rows", 40, 4, ["f1"]),
            ])  # fmt: skip

        def forward(self, kjt):
            return self.sparse(kjt).values().sum(1)

    torch.manual_seed(0)
    model = dtrec.distribute_module(
        Model(), dtrec.init_mesh("cpu", world),
        {"sparse.narrow": ColumnWise(), "sparse.rows": RowWise()},
        optimizer=dtrec.optim.RowWiseAdagrad(lr=0.1),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        lengths = torch.randint(1, 4, (2 * 3,), generator=gen)
        f0, f1 = int(lengths[:3].sum()), int(lengths[3:].sum())
        ids = torch.cat([torch.randint(0, 30, (f0,), generator=gen),
                         torch.randint(0, 40, (f1,), generator=gen)])  # fmt: skip
        model(dtrec.KeyedJaggedTensor(["f0", "f1"], ids, lengths)).pow(2).sum().backward()
    state = model.fused_optimizer.state_dict()["state"]["sparse.narrow"]["sum"]
    local = state.to_local().clone()
    copies = [torch.zeros_like(local) for _ in range(world)]
    torch.distributed.all_gather(copies, local)
    return {
        "full": full_tensor(state), "rank0": copies[0], "placements": str(state.placements),
        **_together(model, rank),
    }  # fmt: skip


def _together(model, rank: int) -> dict:
    """``full_tensors`` of a model's weights and fused state, with a partial, a 0-dim, an
    uneven, a plain and a 2-D mesh DTensor whose replicas disagree, vs ``full_tensor`` of
    each: as gathered together, by tiny rounds, and by blocks streamed alone."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import dtrec
    import dtrec.sharded.tables.tensor as tensor_module
    from dtrec.checkpoint import full_tensor, full_tensors

    mesh = init_device_mesh("cpu", (4,))
    grid = init_device_mesh("cpu", (2, 2))
    values = list(model.state_dict().values())
    for entries in model.fused_optimizer.state_dict()["state"].values():
        values += list(entries.values())
    values += [
        DTensor.from_local(torch.full((3,), float(rank)), mesh, [Partial()]),
        DTensor.from_local(torch.tensor(2.5), mesh, [Replicate()]),
        distribute_tensor(torch.arange(10.0), mesh, [Shard(0)]),  # 3, 3, 3, 1 rows
        torch.arange(4, dtype=torch.long),
        DTensor.from_local(torch.full((2, 3), float(rank)), grid, [Shard(0), Replicate()]),
        distribute_tensor(torch.arange(24).view(6, 4), grid, [Shard(1), Shard(0)]),
    ]
    one_by_one = [full_tensor(v) for v in values]
    with dtrec.comm_stats() as stats:
        together = full_tensors(values)
    saved = tensor_module._STREAM_BYTES
    try:
        tensor_module._STREAM_BYTES = 40  # rounds of a few values; larger blocks alone
        by_rounds = full_tensors(values)
    finally:
        tensor_module._STREAM_BYTES = saved
    same = [
        a.dtype == b.dtype == c.dtype and torch.equal(a, b) and torch.equal(a, c)
        for a, b, c in zip(one_by_one, together, by_rounds, strict=True)
    ]
    gathers = {k: v for k, v in stats.calls.items() if k.startswith("full_tensor")}
    bad = [(i, one_by_one[i], together[i], by_rounds[i]) for i, ok in enumerate(same) if not ok]
    return {"same": same, "gathers": gathers, "count": len(values), "bad": bad}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(4, _run, timeout=300)


def test_full_tensor_of_replicated_row_sums_is_the_first_copy(results) -> None:
    for rank, r in enumerate(results):
        assert r["placements"] == "(Replicate(), Replicate())", r["placements"]
        assert r["rank0"].abs().sum() > 0  # rows were touched
        assert (r["full"] == r["rank0"]).all(), (rank, r["full"][:5], r["rank0"][:5])


def test_full_tensors_equal_full_tensor_of_each_in_a_few_gathers(results) -> None:
    for rank, r in enumerate(results):
        assert all(r["same"]), (rank, r["bad"])
        # the partial one all-reduces on its own; the rest: one gather of the places,
        # one of the float blocks, one of the long one (not 4 per tensor: 4 * 20 here)
        assert r["gathers"] == {"full_tensor.meta": 1, "full_tensor": 2}, (r["count"], r)
