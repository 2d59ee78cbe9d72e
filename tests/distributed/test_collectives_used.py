"""dtrec's training step issues only plain c10d collectives, never functional ones.

gloo runs all-reduce, all-gather (list and into-tensor), all-to-all and reduce-scatter on
CUDA tensors, but not the functional ``all_gather_into_tensor`` DTensor's redistribute
uses: every rank of the one-GPU W=2 / W=4 gloo worlds died in it, during backward
(shared/gpu-runs/2026-11-26-h200/w2.log, gloo_cuda_matrix.txt). It came from autograd's
gradient accumulation: when it cannot take a table's gradient as is, it copies it into
``new_empty_strided``, which torch 2.11 makes ``Replicate`` for unevenly sharded tables,
so the copy all-gathers (``dtrec/sharded/tables/dtensor_handlers.py``). Here every plan type
trains a step (forward, backward, a foreach optimizer step; then ``clip_grad_norm_``) with a
gradient hook that keeps each table gradient referenced, which forces that copy path on
CPU as CUDA's device threads do, and counts calls of ``torch.ops._c10d_functional.*``;
then ``checkpoint.full_state_dict`` (which used ``DTensor.full_tensor``) likewise.
On main at 57977ad under torch 2.11 this step all-gathered (the column-wise and grid
tables' gradients came out Replicate); torch 2.13 keeps uneven shards, so on this CPU CI
the test guards against any new functional collective in the step.
"""

from __future__ import annotations

import pytest

from tests.multiprocess import run_world

PLANS = ("data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "grid",
         "mixed")  # fmt: skip
FUNCTIONAL = ("all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor",
              "all_to_all_single", "broadcast", "all_gather_into_tensor_coalesced",
              "all_reduce_coalesced", "reduce_scatter_tensor_coalesced")  # fmt: skip


class _Counted:
    """``torch.ops._c10d_functional.<name>`` that counts its calls."""

    def __init__(self, op, name: str, calls: dict) -> None:
        self._op, self._name, self._calls = op, name, calls

    def __call__(self, *args, **kwargs):
        self._calls[self._name] = self._calls.get(self._name, 0) + 1
        return self._op(*args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self._op, attr)


def _run(rank: int, world: int) -> dict:
    import copy

    import torch
    from torch.distributed.tensor import DTensor

    import dtrec
    from tests.distributed.numerics import PLANS as SPECS
    from tests.distributed.numerics import TinyModel, make_batch, make_tables

    calls: dict[str, int] = {}
    namespace = torch.ops._c10d_functional
    for name in FUNCTIONAL:
        if hasattr(namespace, name):
            setattr(namespace, name, _Counted(getattr(namespace, name), name, calls))
    mesh = dtrec.init_mesh("cpu", 2, node_size=2)
    tables = make_tables(False)
    out = {}
    for plan in PLANS:
        torch.manual_seed(0)
        model = dtrec.distribute_module(
            copy.deepcopy(TinyModel(tables)), mesh,
            {f"sparse.{k}": v for k, v in SPECS[plan].items()},
        )  # fmt: skip
        kept = []
        for table in model.sparse.embedding_bags.values():
            # a user's grad logger: keeps the gradient referenced
            table.weight.register_hook(lambda g, kept=kept: kept.append(g))
        opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=True)
        kjt, target = make_batch(tables, 3, False, torch.Generator().manual_seed(rank))
        calls.clear()
        ((model(kjt) - target) ** 2).mean().backward()
        opt.step()
        step_calls = dict(calls)
        calls.clear()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        clip_calls = dict(calls)
        calls.clear()
        dtrec.checkpoint.full_state_dict(model)  # user-facing assembly: c10d only too
        full_calls = dict(calls)
        layouts_ok = all(
            t.weight.grad is None
            or (
                isinstance(t.weight.grad, DTensor)
                and t.weight.grad.placements == t.weight.placements
                and t.weight.grad.to_local().shape == t.weight.to_local().shape
            )
            for t in model.sparse.embedding_bags.values()
        )
        out[plan] = {"step": step_calls, "clip": clip_calls, "full": full_calls,
                     "grads_like_weights": layouts_ok}  # fmt: skip
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(4, _run, timeout=300)


@pytest.mark.parametrize("plan", PLANS)
def test_training_step_uses_no_functional_collective(results, plan: str) -> None:
    for rank, r in enumerate(results):
        assert r[plan]["step"] == {}, (rank, r[plan])
        assert r[plan]["full"] == {}, (rank, r[plan])
        # clip_grad_norm_ over one mesh is DTensor's own reduction: a functional all_reduce
        # (gloo runs it on CUDA); over several meshes dtrec's c10d one. Never an all-gather.
        assert not any("gather" in k for k in r[plan]["clip"]), (rank, r[plan])
        assert r[plan]["grads_like_weights"], (rank, r[plan])
