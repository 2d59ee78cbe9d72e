"""dtrec composed with torch's own parallelisms (FSDP2, HSDP, TP) on 4 gloo ranks.

Every configuration trains a model of three sharded tables (row-, column-, table-wise)
and an MLP for 3 steps with a torch optimizer, and must end where the unsharded model
ends when trained on the concatenated *distinct* batches (loss = mean of the per-batch
losses): the losses of every step and the full weights of every table and dense
parameter, to 1e-5 relative. Under TP the two ranks of a tp group feed the same batch,
so the unsharded model sees only the dp groups' batches. The ``compiled_*`` configurations
compile the MLP in torchtitan's order (TP, activation checkpointing,
``torch.compile(fullgraph=True)``, FSDP, then dtrec) and must train the same. One spawned
world runs every configuration (``tests/multiprocess.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.multiprocess import run_world

TOL = 1e-5
BF16_TOL = 2e-3  # bf16 compute against the fp32 unsharded model, SGD (measured <= 1.4e-3)
STEPS = 3
BATCH = 3


class Net(nn.Module):
    def __init__(self) -> None:
        import dtrec

        super().__init__()
        self.sparse = dtrec.EmbeddingBagCollection(
            [
                dtrec.EmbeddingBagConfig("rows", 20, 4, ["f0", "f1"]),
                dtrec.EmbeddingBagConfig("cols", 10, 8, ["f2"], pooling="mean"),
                dtrec.EmbeddingBagConfig("whole", 12, 4, ["f3"]),
            ]
        )
        self.mlp = nn.Sequential(nn.Linear(20, 8), nn.ReLU(), nn.Linear(8, 4))
        self.scale = nn.Parameter(torch.ones(1))  # dense, outside the MLP

    def forward(self, kjt):
        return self.mlp(self.sparse(kjt).values()).mean(1) * self.scale


def _plan() -> dict:
    from dtrec.placements import ColumnWise, RowWise, TableWise

    return {"sparse.rows": RowWise(), "sparse.cols": ColumnWise(), "sparse.whole": TableWise(1)}


def _batch(step: int, group: int):
    """The batch of data-parallel group ``group`` at ``step`` (the same on every rank)."""
    from tests.batches import random_kjt

    gen = torch.Generator().manual_seed(1000 * step + group)
    kjt = random_kjt(gen, (("f0", 20), ("f1", 20), ("f2", 10), ("f3", 12)), BATCH, (1, 4))
    return kjt, torch.randn(BATCH, generator=gen)


_MESHES: dict[str, object] = {}


def _mesh(name: str):
    """One mesh per name for the whole world (each new mesh makes process groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    import dtrec

    if name not in _MESHES:
        _MESHES[name] = {
            "tables": lambda: dtrec.init_mesh("cpu", 4),
            "tables_2x2": lambda: dtrec.init_mesh("cpu", 2),
            "hsdp": lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard")),
            "dp_tp": lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
            "world": lambda: init_device_mesh(
                "cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard")
            ),
            # the tables' meshes as views of the world meshes (one flatten per root)
            "world_tables": lambda: dtrec.table_mesh(
                _mesh("world"), shard="dp_shard", replicate="dp_replicate"
            ),
            "dp_tp_tables": lambda: dtrec.table_mesh(_mesh("dp_tp"), shard=("dp", "tp")),
        }[name]()
    return _MESHES[name]


def _compile_block(model: nn.Module) -> None:
    """torchtitan's per-block steps after TP: activation checkpointing, then
    ``torch.compile(block, fullgraph=True)`` in place of the block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model.mlp = torch.compile(checkpoint_wrapper(model.mlp), fullgraph=True)


def tp_then_fsdp(model: nn.Module, compiled: bool = False):
    """torchtitan's order on the MLP over the (dp, tp) world mesh: TP (column- then
    row-wise) over tp, (AC + compile), FSDP over dp; returns the mesh."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = _mesh("dp_tp")
    parallelize_module(model.mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if compiled:
        _compile_block(model)
    fully_shard(model.mlp, mesh=mesh["dp"])
    return mesh


_DTYPES: list[torch.dtype] = []  # what the MLP's first layer computed in, per forward


def _record_dtype(module: nn.Module, args: tuple) -> None:
    _DTYPES.append(module.weight.dtype)


def _compose(kind: str, model: nn.Module) -> tuple[nn.Module, int, int]:
    """Apply ``kind``'s parallelisms to ``model``, in its order; return the distributed
    model, this rank's data-parallel group and the number of groups."""
    import torch.distributed as dist
    from torch.distributed.fsdp import DataParallelMeshDims, MixedPrecisionPolicy, fully_shard

    import dtrec

    rank, world = dist.get_rank(), dist.get_world_size()
    compiled = kind.startswith("compiled_")  # AC + compile after TP, before FSDP
    kind = kind.removeprefix("compiled_")
    if kind == "dense":  # no FSDP: dtrec replicates the compiled block's parameters
        _compile_block(model)
        return dtrec.distribute_module(model, _mesh("tables"), _plan()), rank, world
    if compiled and kind != "tp_fsdp_before":
        _compile_block(model)
    if kind == "fsdp_before":
        fully_shard(model.mlp)
        return dtrec.distribute_module(model, _mesh("tables"), _plan()), rank, world
    if kind == "fsdp_before_collection_mesh":  # the collection on a mesh of its own
        fully_shard(model.mlp)
        meshes = {"sparse": _mesh("tables_2x2")}
        return dtrec.distribute_module(model, _mesh("tables"), _plan(), meshes=meshes), rank, world
    if kind == "tp_fsdp_before_collection_mesh":
        mesh = tp_then_fsdp(model)
        meshes = {"sparse": _mesh("tables_2x2")}
        model = dtrec.distribute_module(model, _mesh("tables"), _plan(), meshes=meshes)
        return model, mesh["dp"].get_local_rank(), mesh["dp"].size()
    if kind == "fsdp_before_kept":  # unsharded parameters kept from forward to backward
        fully_shard(model.mlp, reshard_after_forward=False)
        return dtrec.distribute_module(model, _mesh("tables"), _plan()), rank, world
    if kind in ("fsdp_before_bf16", "hsdp_after_bf16"):  # bf16 compute, fp32 reduce
        bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model.mlp[0].register_forward_pre_hook(_record_dtype)  # inside FSDP's unshard
        if kind == "fsdp_before_bf16":
            fully_shard(model.mlp, mp_policy=bf16)
            return dtrec.distribute_module(model, _mesh("tables"), _plan()), rank, world
        model = dtrec.distribute_module(model, _mesh("tables_2x2"), _plan())
        dims = DataParallelMeshDims(shard="shard", replicate="replicate")
        fully_shard(model.mlp, mesh=_mesh("tables_2x2"), dp_mesh_dims=dims, mp_policy=bf16)
        return model, rank, world
    if kind == "hsdp_before":
        fully_shard(model.mlp, mesh=_mesh("hsdp"))
        return dtrec.distribute_module(model, _mesh("tables"), _plan()), rank, world
    if kind == "tp_fsdp_before":
        mesh = tp_then_fsdp(model, compiled)
        model = dtrec.distribute_module(model, _mesh("tables"), _plan())
        return model, mesh["dp"].get_local_rank(), mesh["dp"].size()
    if kind in ("fsdp_after", "hsdp_after"):  # FSDP's SPMD mode on dtrec's dense mesh
        mesh = _mesh("tables_2x2")
        model = dtrec.distribute_module(model, mesh, _plan())
        dims = (
            DataParallelMeshDims(shard=("shard", "replicate"))
            if kind == "fsdp_after"
            else DataParallelMeshDims(shard="shard", replicate="replicate")
        )
        fully_shard(model.mlp, mesh=mesh, dp_mesh_dims=dims)
        return model, rank, world
    if kind == "world_hsdp_before":  # one world mesh: HSDP on it, the tables on a view
        fully_shard(model.mlp, mesh=_mesh("world"))
        return dtrec.distribute_module(model, _mesh("world_tables"), _plan()), rank, world
    if kind == "world_hsdp_after":
        mesh = _mesh("world_tables")
        model = dtrec.distribute_module(model, mesh, _plan())
        dims = DataParallelMeshDims(shard="shard", replicate="replicate")
        fully_shard(model.mlp, mesh=mesh, dp_mesh_dims=dims)
        return model, rank, world
    if kind == "world_tp_fsdp_before":  # the tables over dp x tp of the TP world mesh
        mesh = tp_then_fsdp(model)
        model = dtrec.distribute_module(model, _mesh("dp_tp_tables"), _plan())
        return model, mesh["dp"].get_local_rank(), mesh["dp"].size()
    raise AssertionError(kind)


def _full(value):
    """The full tensor of a parameter (collective on every rank alike)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import dtrec

    if not isinstance(value, DTensor):
        return value.detach().clone()
    if value.device_mesh.size() == dist.get_world_size():
        return value.full_tensor().detach()
    return dtrec.checkpoint.full_tensor(value)  # a table-wise table's one-rank mesh


def _unwrapped(name: str) -> str:
    """A parameter's name without the wrappers' modules (``torch.compile``, AC)."""
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


def _rel(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def _optimizer(name: str, params, foreach: bool | None):
    import torch

    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, foreach=foreach)
    return torch.optim.Adam(params, lr=0.01, foreach=foreach)


def _train(
    kind: str, opt: str, foreach: bool | None = None, clip: bool = False, tol: float = TOL
) -> dict:
    import copy
    import time

    import torch
    from torch._dynamo.utils import counters

    import dtrec

    start, captured = time.perf_counter(), counters["stats"]["calls_captured"]
    checks = _TAKEOVER_CHECKS[0]
    torch.manual_seed(0)
    ref = Net()
    init = {name: p.detach().clone() for name, p in ref.named_parameters()}
    _DTYPES.clear()
    model, group, groups = _compose(kind, copy.deepcopy(ref))
    ref_opt = _optimizer(opt, ref.parameters(), foreach)
    dist_opt = _optimizer(opt, model.parameters(), foreach)
    loss_errs, norm_errs, clipped = [], [], True
    for step in range(STEPS):
        batches = [_batch(step, g) for g in range(groups)]
        kjt, y = batches[group]
        with dtrec.comm_stats() as stats:
            loss = ((model(kjt) - y) ** 2).mean()
            loss.backward()
        ref_losses = [((ref(k) - t) ** 2).mean() for k, t in batches]
        torch.stack(ref_losses).mean().backward()
        if clip:  # a small max_norm: every step clips
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            norm_errs.append(_rel(_full(norm), ref_norm))
            clipped &= bool(ref_norm > 0.05)
        dist_opt.step()
        dist_opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_errs.append(_rel(loss.detach(), ref_losses[group].detach()))
    got = {_unwrapped(name): p for name, p in model.named_parameters()}
    names = [name for name, _ in ref.named_parameters()]
    fulls = dtrec.checkpoint.full_tensors([got[name].detach() for name in names])  # few gathers
    weight_errs = {
        name: _rel(full, p.detach())
        for name, full, (_, p) in zip(names, fulls, ref.named_parameters(), strict=True)
    }
    mlp = list(model.mlp.parameters())
    return {
        "loss": max(loss_errs),
        "norm": max(norm_errs, default=None),
        "clipped": clipped,
        "dense_sync_bytes": stats.bytes_sent.get("dense.grad_sync", 0),  # the last step's
        "weights": weight_errs,
        "moved": {name: _rel(p.detach(), init[name]) for name, p in ref.named_parameters()},
        "mlp_local_numel": sum(p.to_local().numel() for p in mlp),
        "mlp_numel": sum(p.numel() for p in mlp),
        "compute_dtypes": sorted({str(d) for d in _DTYPES}),
        "param_dtypes": sorted({str(p.dtype) for p in mlp}),
        "captured": counters["stats"]["calls_captured"] - captured,  # graphs dynamo traced
        "seconds": time.perf_counter() - start,
        "takeover_checks": _TAKEOVER_CHECKS[0] - checks,
    }


_TAKEOVER_CHECKS = [0]  # calls of dense_fsdp.taken_over (counted by _count_takeover_checks)


def _count_takeover_checks() -> None:
    """Count ``ReplicatedDense``'s full takeover checks in this rank."""
    from dtrec.sharded import dense

    def counted(*args, **kwargs):
        _TAKEOVER_CHECKS[0] += 1
        return real(*args, **kwargs)

    real = dense.taken_over
    dense.taken_over = counted


CONFIGS = {
    "fsdp_before_sgd": dict(kind="fsdp_before", opt="sgd"),
    "fsdp_before_adam_foreach": dict(kind="fsdp_before", opt="adam", foreach=True),
    "hsdp_before_sgd_foreach": dict(kind="hsdp_before", opt="sgd", foreach=True),
    "hsdp_before_adam": dict(kind="hsdp_before", opt="adam"),
    "tp_fsdp_before_sgd": dict(kind="tp_fsdp_before", opt="sgd"),
    "tp_fsdp_before_adam_foreach": dict(kind="tp_fsdp_before", opt="adam", foreach=True),
    "fsdp_after_sgd_clip": dict(kind="fsdp_after", opt="sgd", clip=True),
    "fsdp_after_adam_foreach": dict(kind="fsdp_after", opt="adam", foreach=True),
    "hsdp_after_sgd_foreach": dict(kind="hsdp_after", opt="sgd", foreach=True),
    "hsdp_after_adam_clip": dict(kind="hsdp_after", opt="adam", clip=True),
    "tp_fsdp_before_sgd_clip": dict(kind="tp_fsdp_before", opt="sgd", clip=True),
    "world_hsdp_before_sgd": dict(kind="world_hsdp_before", opt="sgd"),
    "world_hsdp_after_adam_foreach_clip": dict(
        kind="world_hsdp_after", opt="adam", foreach=True, clip=True
    ),
    "world_hsdp_after_sgd": dict(kind="world_hsdp_after", opt="sgd"),
    "world_tp_fsdp_before_adam": dict(kind="world_tp_fsdp_before", opt="adam"),
    "fsdp_before_kept_adam": dict(kind="fsdp_before_kept", opt="adam"),
    # per-collection meshes beside FSDP / TP: the collection's tables on S=2 x R=2
    "fsdp_before_collection_mesh_adam": dict(kind="fsdp_before_collection_mesh", opt="adam"),
    "tp_fsdp_before_collection_mesh_sgd": dict(kind="tp_fsdp_before_collection_mesh", opt="sgd"),
    # bf16 parameters in forward/backward, fp32 gradient reduction: within bf16's error
    # (SGD: Adam's normalised steps turn bf16's noise in tiny gradients into whole steps)
    "fsdp_before_bf16_sgd": dict(kind="fsdp_before_bf16", opt="sgd", tol=BF16_TOL),
    "hsdp_after_bf16_sgd": dict(kind="hsdp_after_bf16", opt="sgd", tol=BF16_TOL),
    # torchtitan's order with a compiled block: TP, AC, torch.compile(fullgraph=True), FSDP
    "compiled_fsdp_before_sgd": dict(kind="compiled_fsdp_before", opt="sgd"),
    "compiled_fsdp_before_adam": dict(kind="compiled_fsdp_before", opt="adam"),
    "compiled_fsdp_after_sgd": dict(kind="compiled_fsdp_after", opt="sgd"),
    "compiled_fsdp_after_adam": dict(kind="compiled_fsdp_after", opt="adam"),
    "compiled_tp_fsdp_before_sgd": dict(kind="compiled_tp_fsdp_before", opt="sgd"),
    "compiled_tp_fsdp_before_adam": dict(kind="compiled_tp_fsdp_before", opt="adam"),
    "compiled_dense_sgd": dict(kind="compiled_dense", opt="sgd"),
    "compiled_dense_adam": dict(kind="compiled_dense", opt="adam"),
}


def _errors() -> dict:
    """What fails, and how, when the dense part is changed after ``distribute_module``
    other than through FSDP's SPMD mode."""
    import copy

    from torch.distributed.fsdp import fully_shard

    import dtrec
    from tests.multiprocess import error_of

    torch.manual_seed(0)
    out = {}
    model = dtrec.distribute_module(copy.deepcopy(Net()), _mesh("tables"), _plan())
    model.mlp[0].weight = nn.Parameter(torch.zeros(8, 20))  # replaced by a plain parameter
    out["replaced"] = error_of(lambda: model(_batch(0, 0)[0]))
    model = dtrec.distribute_module(copy.deepcopy(Net()), _mesh("tables"), _plan())
    out["plain_fully_shard_after"] = error_of(lambda: fully_shard(model.mlp))
    world = _mesh("world")
    for name, shard, replicate in (
        ("unknown", "dp_shard", "dp_rep"),
        ("twice", ("dp_shard", "dp_replicate"), "dp_shard"),
        ("left_out", "dp_shard", None),
        ("no_shard", (), "dp_replicate"),
    ):
        out[f"table_mesh_{name}"] = error_of(lambda: dtrec.table_mesh(world, shard, replicate))  # noqa: B023
    tables = _mesh("world_tables")
    out["table_mesh"] = (tables.mesh_dim_names, tables.mesh.tolist())
    out["table_mesh_dp_tp"] = (
        _mesh("dp_tp_tables").mesh_dim_names,
        _mesh("dp_tp_tables").mesh.tolist(),
    )
    other_root = copy.deepcopy(Net())  # FSDP on a mesh of another root than the tables'
    fully_shard(other_root.mlp, mesh=_mesh("hsdp"))
    out["other_root"] = error_of(
        lambda: dtrec.distribute_module(other_root, _mesh("world_tables"), _plan())
    )
    half = dtrec.table_mesh(world["dp_shard"], shard="dp_shard")  # 2 of the 4 ranks
    out["not_the_world"] = error_of(lambda: dtrec.distribute_module(Net(), half, _plan()))
    out.update(_changed_after_a_step())
    return out


def _changed_after_a_step() -> dict:
    """The dense part changed after steps ran (the per-forward takeover check is cached,
    ``dense_fsdp.takeover_signature``): FSDP's SPMD mode then takes the MLP's gradient
    sync over; a replaced parameter is still a TypeError."""
    import copy

    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard

    import dtrec
    from tests.multiprocess import error_of

    def step(model) -> int:
        with dtrec.comm_stats() as stats:
            ((model(_batch(0, 0)[0]) - 1) ** 2).mean().backward()
        model.zero_grad(set_to_none=True)
        return stats.bytes_sent.get("dense.grad_sync", 0)

    out = {}
    mesh = _mesh("tables_2x2")
    model = dtrec.distribute_module(copy.deepcopy(Net()), mesh, _plan())
    out["before_fully_shard_bytes"] = [step(model), step(model)]
    dims = DataParallelMeshDims(shard=("shard", "replicate"))
    fully_shard(model.mlp, mesh=mesh, dp_mesh_dims=dims)
    out["after_fully_shard_bytes"] = [step(model), step(model)]
    model = dtrec.distribute_module(copy.deepcopy(Net()), _mesh("tables"), _plan())
    step(model)
    model.mlp[2].bias = nn.Parameter(torch.zeros(1))
    out["replaced_after_a_step"] = error_of(lambda: model(_batch(0, 0)[0]))
    return out


def _run_all(rank: int, world: int, configs: dict) -> dict:
    _count_takeover_checks()
    return {"errors": _errors(), **{name: _train(**cfg) for name, cfg in configs.items()}}


@pytest.fixture(scope="module")
def world_results() -> list[dict]:
    return run_world(4, _run_all, CONFIGS, timeout=600)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_trains_like_the_unsharded_model(world_results, name: str) -> None:
    for rank, per_rank in enumerate(world_results):
        r = per_rank[name]
        tol = CONFIGS[name].get("tol", TOL)
        assert r["loss"] < tol, (rank, r)
        if CONFIGS[name].get("clip"):
            assert r["norm"] < tol and r["clipped"], (rank, r)
        for param, err in r["weights"].items():
            assert err < tol, (rank, param, err)
            # moved further than the tolerance: a parameter left untrained fails
            assert r["moved"][param] > max(10 * TOL, tol), (rank, param, "did not train")


@pytest.mark.parametrize("name", [n for n in sorted(CONFIGS) if "bf16" in n])
def test_mixed_precision_computes_in_bf16_and_keeps_fp32_parameters(world_results, name):
    """FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on the MLP beside
    dtrec's tables: the layers compute with bf16 weights, the sharded parameters (what the
    optimizer steps) stay fp32."""
    for rank, per_rank in enumerate(world_results):
        r = per_rank[name]
        assert r["compute_dtypes"] == ["torch.bfloat16"], (rank, r["compute_dtypes"])
        assert r["param_dtypes"] == ["torch.float32"], (rank, r["param_dtypes"])


def test_dtrec_syncs_only_the_dense_parameters_it_kept(world_results) -> None:
    """FSDP after ``distribute_module`` takes the MLP's gradients over: dtrec all-reduces
    the one parameter left to it (``scale``), exactly as when FSDP came first."""
    for rank, per_rank in enumerate(world_results):
        kept = per_rank["fsdp_before_sgd"]["dense_sync_bytes"]
        assert kept > 0, rank
        for name in ("fsdp_after_sgd_clip", "hsdp_after_adam_clip", "hsdp_after_sgd_foreach"):
            assert per_rank[name]["dense_sync_bytes"] == kept, (rank, name)


def test_replacing_a_dense_parameter_after_distribute_is_a_clear_error(world_results) -> None:
    for rank, per_rank in enumerate(world_results):
        err = per_rank["errors"]["replaced"]
        assert err.startswith("TypeError") and "'mlp.0.weight'" in err, (rank, err)
        assert "dp_mesh_dims" in err, (rank, err)
        err = per_rank["errors"]["replaced_after_a_step"]  # the check is cached, not skipped
        assert err.startswith("TypeError") and "'mlp.2.bias'" in err, (rank, err)


def test_the_takeover_check_runs_once_while_the_model_is_unchanged(world_results) -> None:
    """``ReplicatedDense`` checks whether FSDP took dense parameters over at the first
    forward, then only when a parameter was registered or ``fully_shard`` applied
    somewhere (``dense_fsdp.takeover_signature``): once in 3 steps (the process's first
    ``torch.compile`` registers parameters of its own once: one more check then)."""
    for rank, per_rank in enumerate(world_results):
        counts = {name: per_rank[name]["takeover_checks"] for name in CONFIGS}
        eager = {n: c for n, c in counts.items() if not n.startswith("compiled_") and c != 1}
        assert not eager, (rank, eager)
        compiled = [c for n, c in counts.items() if n.startswith("compiled_")]
        assert all(c >= 1 for c in compiled) and sum(compiled) <= len(compiled) + 1, (rank, counts)


def test_fully_shard_after_steps_ran_takes_the_mlp_sync_over(world_results) -> None:
    """``fully_shard`` (SPMD mode) applied after two steps: the next forward notices it and
    dtrec syncs only ``scale``, as when FSDP came before the first step."""
    for rank, per_rank in enumerate(world_results):
        e, kept = per_rank["errors"], per_rank["fsdp_before_sgd"]["dense_sync_bytes"]
        assert all(b > kept for b in e["before_fully_shard_bytes"]), (rank, e, kept)
        assert e["after_fully_shard_bytes"] == [kept, kept], (rank, e, kept)


def test_plain_fully_shard_after_distribute_fails_in_torch(world_results) -> None:
    """Pinned, not endorsed: FSDP's non-SPMD path takes dtrec's replicated dense DTensors
    for TP parameters on an unrelated mesh and fails inside torch (docs/composing.md);
    when a torch upgrade changes this, update the docs."""
    for rank, per_rank in enumerate(world_results):
        err = per_rank["errors"]["plain_fully_shard_after"]
        assert err.startswith("TypeError"), (rank, err)


def test_table_mesh_is_a_view_of_the_world_mesh(world_results) -> None:
    for rank, per_rank in enumerate(world_results):
        e = per_rank["errors"]
        # world [[0, 1], [2, 3]] (dp_replicate, dp_shard): shard groups {0, 1}, {2, 3}
        assert e["table_mesh"] == (("shard", "replicate"), [[0, 2], [1, 3]]), rank
        assert e["table_mesh_dp_tp"] == (("shard", "replicate"), [[0], [1], [2], [3]]), rank
        assert (
            e["table_mesh_unknown"].startswith("ValueError")
            and "'dp_rep'" in e["table_mesh_unknown"]
        ), e
        assert "'dp_shard' is given twice" in e["table_mesh_twice"], e
        assert "['dp_replicate'] are neither" in e["table_mesh_left_out"], e
        assert "at least one shard dim" in e["table_mesh_no_shard"], e
        assert "covers 2 ranks but the world has 4" in e["not_the_world"], e
        # FSDP's mesh not from the world mesh the tables' mesh is a view of: both named
        assert e["other_root"].startswith("ValueError: dense parameter 'mlp.0.weight'"), e
        assert "('rep', 'shard')" in e["other_root"], e
        assert "('dp_replicate', 'dp_shard')" in e["other_root"], e


COMPILED = sorted(name for name in CONFIGS if name.startswith("compiled_"))


@pytest.mark.parametrize("kind", sorted({CONFIGS[name]["kind"] for name in COMPILED}))
def test_the_compiled_blocks_ran_compiled(world_results, kind: str) -> None:
    """The ``compiled_*`` configs trained through dynamo's graphs (``fullgraph=True``: a
    graph break would have raised): each kind traced its block at least once, and no
    config traced on every step (a later config of a kind may reuse its graphs: the
    parameters are graph inputs, so a new model of the same shapes passes the guards)."""
    names = [name for name in COMPILED if CONFIGS[name]["kind"] == kind]
    for rank, per_rank in enumerate(world_results):
        captured = [per_rank[name]["captured"] for name in names]
        assert sum(captured) >= 1 and max(captured) < STEPS, (rank, kind, captured)


@pytest.mark.parametrize("name", sorted(n for n in CONFIGS if not n.startswith("compiled_dense")))
def test_the_mlp_is_sharded(world_results, name: str) -> None:
    for rank, per_rank in enumerate(world_results):
        r = per_rank[name]
        assert r["mlp_local_numel"] < r["mlp_numel"], (rank, r)
