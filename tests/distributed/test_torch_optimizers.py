"""Every torch optimizer over ``model.parameters()`` of a distributed model, on the settings
it has on CUDA, and ``clip_grad_norm_`` over the same parameters.

On CUDA torch's optimizers default to ``foreach=True`` (and take ``fused=True``); their
foreach kernels refuse a list mixing DTensors (tables) and plain tensors, and DTensor
computes a foreach op only on the ranks of its first tensor's mesh (a table-wise table's
sub-mesh leaves the other ranks' dense parameters un-updated). CPU defaults to
``foreach=False``, so only asking for it here catches that class of bug on CPU CI.
Each case trains the sharded model and the unsharded one on the global batch and
compares weights and losses (``check_numerics``); the clip cases also compare the total
norm ``clip_grad_norm_`` returns, with table-wise tables on sub-meshes, node-aware grid
meshes, and fused tables (no ``.grad``). On main at 57977ad every foreach / fused case
and every clip case failed ("got mixed torch.Tensor and DTensor"; "aten.stack.default
must have the same mesh" with ``foreach=False``).
"""

from __future__ import annotations

import pytest

from tests.multiprocess import run_world

TOLERANCE = 1e-5
# mesh: (shard group size, node size) on W=4; (2, 2) is 2D, (4, 2) 1D with two nodes.
MESHES = ((2, 2), (4, 2))
PLANS = ("mixed", "table_wise", "grid")
OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw", "adagrad", "rmsprop")
# fused=True: what torch implements on CPU (on CUDA also these; RMSprop has none).
FUSED_CAPABLE = ("sgd", "adam", "adamw", "adagrad")
CLIPS = {
    "l2_foreach": {"max_norm": 0.1, "foreach": True},
    "l2_loop": {"max_norm": 0.1, "foreach": False},
    "l1": {"max_norm": 0.5, "norm_type": 1.0},
}
CLIP_PLANS = ("mixed", "table_wise", "grid", "row_wise", "table_row_wise")


def _cases() -> dict[str, dict]:
    cases: dict[str, dict] = {}
    for shards, node in MESHES:
        mesh = f"S{shards}-node{node}"
        for plan in PLANS:
            for opt in OPTIMIZERS:
                kw = {"foreach": True}
                cases[f"{mesh}-{plan}-{opt}-foreach"] = dict(
                    mesh=(shards, node), plan=plan, optimizer=opt, opt_kwargs=kw
                )
        for opt in FUSED_CAPABLE:
            cases[f"{mesh}-mixed-{opt}-fused"] = dict(
                mesh=(shards, node), plan="mixed", optimizer=opt, opt_kwargs={"fused": True}
            )
        # a fused table optimizer: only the dense parameters are the torch optimizer's
        cases[f"{mesh}-mixed-adam-foreach-fused_tables"] = dict(
            mesh=(shards, node), plan="mixed", optimizer="adam",
            opt_kwargs={"foreach": True}, fused_tables=True,
        )  # fmt: skip
        for plan in CLIP_PLANS:
            for clip_name, clip in CLIPS.items():
                cases[f"{mesh}-{plan}-clip_{clip_name}"] = dict(
                    mesh=(shards, node), plan=plan, optimizer="sgd",
                    opt_kwargs={"foreach": True}, clip=clip,
                )  # fmt: skip
        cases[f"{mesh}-mixed-clip_l2-fused_tables"] = dict(
            mesh=(shards, node), plan="mixed", optimizer="sgd", opt_kwargs={"foreach": True},
            clip=CLIPS["l2_foreach"], fused_tables=True,
        )  # fmt: skip
    return cases


CASES = _cases()


def _run(rank: int, world: int) -> dict[str, tuple]:
    import dtrec
    from tests.distributed.numerics import PLANS as PLAN_SPECS
    from tests.distributed.numerics import check_numerics

    meshes: dict = {}
    out = {}
    for name, case in CASES.items():
        shards, node = case["mesh"]
        if (shards, node) not in meshes:
            meshes[shards, node] = dtrec.init_mesh("cpu", shards, node_size=node)
        fused = dtrec.optim.RowWiseAdagrad(lr=0.1) if case.get("fused_tables") else None
        r = check_numerics(
            meshes[shards, node], PLAN_SPECS[case["plan"]], weighted=False, steps=2,
            optimizer=case["optimizer"], opt_kwargs=case["opt_kwargs"], clip=case.get("clip"),
            fused=fused,
        )  # fmt: skip
        out[name] = (r.max_weight_diff, r.max_loss_diff, r.max_norm_diff, r.max_norm,
                     r.grads_sharded_like_weights, r.notes)  # fmt: skip
    out["sequence"] = _sequence_cases(rank, world)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(4, _run, timeout=900)


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_optimizer_trains_like_the_unsharded_model(results, name: str) -> None:
    for rank, r in enumerate(results):
        weight_diff, loss_diff, norm_diff, norm, grads_ok, notes = r[name]
        assert weight_diff < TOLERANCE, f"rank {rank}: weights differ by {weight_diff}"
        assert loss_diff < TOLERANCE, f"rank {rank}: losses differ by {loss_diff}"
        assert grads_ok, f"rank {rank}: {notes}"
        if "clip" in name:
            assert norm > 0.5, f"rank {rank}: the norm {norm} does not clip (max_norm 0.1/0.5)"
            assert norm_diff < TOLERANCE * max(1.0, norm), f"rank {rank}: norm off by {norm_diff}"


# --------------------------------------------------------------------------- sequence


def _sequence_cases(rank: int, world: int) -> dict[str, float]:
    """An EmbeddingCollection (a table-wise table on a sub-mesh, a row-wise one) under a
    dense layer, one step per optimizer with ``foreach=True``: largest weight difference."""
    import copy

    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor

    import dtrec
    from dtrec.placements import RowWise, TableWise

    class SeqModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seq = dtrec.EmbeddingCollection(
                [
                    dtrec.EmbeddingConfig("a", 10, 4, ["fa"]),
                    dtrec.EmbeddingConfig("b", 7, 4, ["fb"]),
                ]
            )
            self.dense = nn.Linear(4, 1)

        def forward(self, kjt):
            rows = torch.cat([jt.values() for jt in self.seq(kjt).values()])
            return self.dense(rows).sum()

    def batch(r: int):
        gen = torch.Generator().manual_seed(r)
        lengths = torch.randint(1, 3, (4,), generator=gen)
        values = torch.cat(
            [
                torch.randint(0, 10, (int(lengths[:2].sum()),), generator=gen),
                torch.randint(0, 7, (int(lengths[2:].sum()),), generator=gen),
            ]
        )
        return dtrec.KeyedJaggedTensor(["fa", "fb"], values, lengths)

    mesh = dtrec.init_mesh("cpu", 2)
    out = {}
    for opt_name in OPTIMIZERS:
        torch.manual_seed(0)
        ref = SeqModel()
        model = dtrec.distribute_module(
            copy.deepcopy(ref), mesh, {"seq.a": TableWise(rank=1), "seq.b": RowWise()}
        )
        kind, kw = {
            "sgd": ("SGD", {"lr": 0.1}),
            "sgd_momentum": ("SGD", {"lr": 0.1, "momentum": 0.9}),
            "adam": ("Adam", {"lr": 0.01}),
            "adamw": ("AdamW", {"lr": 0.01}),
            "adagrad": ("Adagrad", {"lr": 0.1}),
            "rmsprop": ("RMSprop", {"lr": 0.01}),
        }[opt_name]

        def make(ps, kind=kind, kw=kw):
            return getattr(torch.optim, kind)(ps, foreach=True, **kw)

        opt, ref_opt = make(model.parameters()), make(ref.parameters())
        model(batch(rank)).backward()  # gradients are averaged over the W ranks
        sum(ref(batch(r)) for r in range(world)).div(world).backward()
        opt.step()
        ref_opt.step()
        full = dtrec.checkpoint.full_state_dict(model)
        diff = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
        dense = model.dense.weight
        out[opt_name] = (diff, isinstance(dense, DTensor))
    return out


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_sequence_collection_with_foreach_optimizer(results, optimizer: str) -> None:
    for rank, r in enumerate(results):
        diff, dense_is_dtensor = r["sequence"][optimizer]
        assert dense_is_dtensor, rank
        assert diff < TOLERANCE, f"rank {rank}: weights differ by {diff}"
