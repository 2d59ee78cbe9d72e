"""Variable batch per feature (TorchRec's VBE) on every sharding type, on 4 gloo ranks.

Each rank feeds its own VBE KJT (own bag counts per feature, own inverse indices).
The sharded collection's output on each rank must equal the unsharded collection's on
that rank's batch (pooled rows expanded through ``inverse_indices``), and one SGD step
must give the unsharded model's weights trained on all ranks' batches (loss = mean of
the per-rank losses). Fused row-wise Adagrad and the 2D mesh are covered too.
"""

from __future__ import annotations

import pytest

from tests.multiprocess import run_world

PLANS = {
    "row_wise": "RowWise",
    "column_wise": "ColumnWise",
    "table_wise": "TableWise",
    "data_parallel": "DataParallel",
}
MESHES = {"1d": 4, "2d": 2}  # shard group size on 4 ranks


def _vbe_batch(rank: int, step: int):
    """This rank's VBE KJT: features f0, f1 (table t0) and f2 (table t1), full batch 3."""
    import torch

    import dtrec

    gen = torch.Generator().manual_seed(100 * rank + step)
    bags = [int(torch.randint(1, 4, (1,), generator=gen)) for _ in range(3)]
    lengths = torch.randint(0, 4, (sum(bags),), generator=gen)
    values = torch.randint(0, 11, (int(lengths.sum()),), generator=gen)
    inverse = torch.stack([torch.randint(0, n, (3,), generator=gen) for n in bags])
    return dtrec.KeyedJaggedTensor(
        ["f2", "f0", "f1"],
        values,
        lengths,
        stride_per_key_per_rank=[[n] for n in bags],
        inverse_indices=(["f0", "f1", "f2"], inverse[[1, 2, 0]]),
    )


def _tables():
    import dtrec

    return [
        dtrec.EmbeddingBagConfig("t0", 11, 4, ["f0", "f1"]),
        dtrec.EmbeddingBagConfig("t1", 11, 6, ["f2"], pooling="mean"),
    ]


def _check(rank: int, world: int, mesh_size: int, spec_name: str, fused: bool) -> dict:
    import copy

    import torch

    import dtrec

    torch.manual_seed(0)
    reference = dtrec.EmbeddingBagCollection(_tables())
    spec = getattr(dtrec.placements, spec_name)
    plan = {"t0": spec(rank=0) if spec_name == "TableWise" else spec(), "t1": spec(rank=1)
            if spec_name == "TableWise" else spec()}  # fmt: skip
    mesh = dtrec.init_mesh("cpu", mesh_size)
    optimizer = dtrec.optim.RowWiseAdagrad(lr=0.3) if fused else None
    sharded = dtrec.distribute_module(copy.deepcopy(reference), mesh, plan, optimizer=optimizer)
    kjt = _vbe_batch(rank, 0)
    out = sharded(kjt).values()
    want = reference(kjt).values()
    fwd_err = (out - want).abs().max().item()
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(rank))
    (out * up).sum().backward()  # dtrec averages gradients over the W ranks
    if not fused:
        torch.optim.SGD(sharded.parameters(), lr=0.3).step()
    # the unsharded model on every rank's batch, loss = mean of per-rank losses
    ref_opt = (torch.optim.Adagrad if fused else torch.optim.SGD)(reference.parameters(), lr=0.3)
    total = 0
    for r in range(world):
        ref_out = reference(_vbe_batch(r, 0)).values()
        ref_up = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(r))
        total = total + (ref_out * ref_up).sum() / world
    total.backward()
    if fused:  # row-wise Adagrad: one accumulator per row (mean of squared grads)
        with torch.no_grad():
            for p in reference.parameters():
                state = p.grad.square().mean(1, keepdim=True)
                p -= 0.3 * p.grad / (state.sqrt() + 1e-8)
    else:
        ref_opt.step()
    full = dtrec.checkpoint.full_state_dict(sharded)
    weight_err = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return {"fwd_err": fwd_err, "weight_err": weight_err, "rows": tuple(out.shape)}


def _run_all(rank: int, world: int) -> dict:
    results = {}
    for mesh_name, size in MESHES.items():
        for plan_name, spec in PLANS.items():
            if spec == "TableWise" and size < 2:
                continue
            for fused in (False, True):
                name = f"{mesh_name}-{plan_name}-{'fused' if fused else 'sgd'}"
                results[name] = _check(rank, world, size, spec, fused)
    return results


@pytest.fixture(scope="module")
def world():
    return run_world(4, _run_all, timeout=300)


CASES = [f"{m}-{p}-{o}" for m in MESHES for p in PLANS for o in ("sgd", "fused")]


@pytest.mark.parametrize("name", CASES)
def test_variable_batch_matches_unsharded(world, name):
    for rank, res in enumerate(world):
        r = res[name]
        assert r["rows"] == (3, 14), f"rank {rank}: output {r['rows']}, want the full batch"
        assert r["fwd_err"] < 1e-6, f"rank {rank}: forward off by {r['fwd_err']}"
        assert r["weight_err"] < 1e-5, f"rank {rank}: weights off by {r['weight_err']}"
