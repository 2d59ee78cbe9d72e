"""``full_tensor`` of replicated state takes the first copy, not the last rank's.

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
    return {"full": full_tensor(state), "rank0": copies[0], "placements": str(state.placements)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(4, _run, timeout=300)


def test_full_tensor_of_replicated_row_sums_is_the_first_copy(results) -> None:
    for rank, r in enumerate(results):
        assert r["placements"] == "(Replicate(), Replicate())", r["placements"]
        assert r["rank0"].abs().sum() > 0  # rows were touched
        assert (r["full"] == r["rank0"]).all(), (rank, r["full"][:5], r["rank0"][:5])
