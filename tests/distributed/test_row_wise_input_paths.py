"""Row-wise input dist: fbgemm's block bucketize and dtrec's own sort send the same ids.

On CPU with fbgemm, ``Routing.bucketize`` lays row-wise ids out with fbgemm's
``block_bucketize_sparse_features``; without it (``fbgemm_ops()`` None, as on a machine
where fbgemm does not load) a stable sort by segment does. Both must give bit-identical
training: same pooled outputs, same tables after fused row-wise Adagrad steps, with and
without per-sample weights, and with a table smaller than the shard axis (empty blocks).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.multiprocess import run_world

CASES = [(weighted, fused) for weighted in (False, True) for fused in (False, True)]


def _train(mesh, reference, tables, weighted: bool, fused: bool, steps: int = 3):
    import dtrec
    from dtrec.placements import RowWise
    from tests.distributed.numerics import make_batch

    plan = {f"sparse.{name}": RowWise() for name in reference.sparse.embedding_bags}
    optimizer = dtrec.optim.RowWiseAdagrad(lr=0.1) if fused else None
    model = dtrec.distribute_module(copy.deepcopy(reference), mesh, plan, optimizer=optimizer)
    dense = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    gen = torch.Generator().manual_seed(10 + torch.distributed.get_rank())
    outputs = []
    for _ in range(steps):
        kjt, target = make_batch(tables, 6, weighted, gen)
        pooled = model.sparse(kjt).values()
        loss = ((model.head(pooled) - target) ** 2).mean()
        dense.zero_grad()
        loss.backward()
        dense.step()
        outputs.append(pooled.detach().clone())
    tables = {k: v.to_local().clone() for k, v in model.state_dict().items() if "sparse" in k}
    return outputs, tables


def _run(rank: int, world: int) -> dict:
    import dtrec
    import dtrec.sharded.dist.routing as routing_module
    from dtrec.ops.backends.fbgemm_loader import fbgemm_available
    from tests.distributed.numerics import TinyModel, make_tables

    if not fbgemm_available():
        return {"fbgemm": False}
    mesh = dtrec.init_mesh("cpu", world)
    real = routing_module.fbgemm_ops
    calls: list[int] = []
    out: dict = {"fbgemm": True}
    for weighted, fused in CASES:
        torch.manual_seed(0)
        tables = make_tables(weighted)
        reference = TinyModel(tables)
        runs = {}
        for path, ops in (("fbgemm", lambda: calls.append(1) or real()), ("sort", lambda: None)):
            routing_module.fbgemm_ops = ops
            try:
                runs[path] = _train(mesh, reference, tables, weighted, fused)
            finally:
                routing_module.fbgemm_ops = real
        (out_f, tab_f), (out_s, tab_s) = runs["fbgemm"], runs["sort"]
        out[(weighted, fused)] = {
            "outputs_equal": all(torch.equal(a, b) for a, b in zip(out_f, out_s, strict=True)),
            "tables_equal": tab_f.keys() == tab_s.keys()
            and all(torch.equal(tab_f[k], tab_s[k]) for k in tab_f),
            "fbgemm_calls": len(calls),
        }
        calls.clear()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    got = run_world(4, _run, timeout=600)
    if not got[0]["fbgemm"]:
        pytest.skip("fbgemm_gpu does not load here: only the sort path exists")
    return got


@pytest.mark.parametrize(("weighted", "fused"), CASES)
def test_fbgemm_and_sort_bucketize_train_bit_identically(results, weighted: bool, fused: bool):
    for rank, r in enumerate(results):
        case = r[(weighted, fused)]
        assert case["outputs_equal"] and case["tables_equal"], (rank, case)
        assert case["fbgemm_calls"] == 3, (rank, case)  # one bucketize per step went to fbgemm
