"""dtrec's tables on the first stage of a ``torch.distributed.pipelining`` schedule.

4 gloo ranks, world mesh (pp 2, dp 2). Stage 0 (ranks 0, 1) holds an EBC of row-, column-
and table-wise tables, sharded over its dp dim (``table_mesh(world, shard="dp",
pipeline="pp")``), and a bottom layer; stage 1 (ranks 2, 3) holds the over arch under
FSDP2 on its dp dim. Each dp group feeds its own batch, split into microbatches by the
schedule (GPipe or 1F1B). After 3 steps every loss, table and dense parameter must equal
the unsharded model trained on the concatenated dp batches (1e-5 relative), with fused
SGD / row-wise Adagrad / Adam (one update per step: ``dtrec.accumulate_gradients``) and
with a torch optimizer on the tables. Without ``accumulate_gradients`` a fused Adam
updates once per microbatch and drifts from the unsharded model: the test sees that too.
One forked world runs every configuration.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.multiprocess import run_world

TOL = 1e-5
STEPS = 3
BATCH = 4  # per dp group
MICRO = 2


class Sparse(nn.Module):
    """Stage 0: the tables and a bottom layer on the dense features."""

    def __init__(self) -> None:
        import dtrec

        super().__init__()
        self.ebc = dtrec.EmbeddingBagCollection([
            dtrec.EmbeddingBagConfig("rows", 20, 4, ["f0", "f1"]),
            dtrec.EmbeddingBagConfig("cols", 10, 8, ["f2"], pooling="mean"),
            dtrec.EmbeddingBagConfig("whole", 12, 4, ["f3"]),
        ])  # fmt: skip
        self.bottom = nn.Linear(3, 4)

    def forward(self, samples, dense, kjt):
        import dtrec

        pooled = self.ebc(dtrec.pipelining.microbatch(kjt, samples)).values()
        return torch.cat([pooled, torch.relu(self.bottom(dense))], 1)


class Over(nn.Module):
    """Stage 1: the over arch."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(24, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x):
        return self.mlp(x).squeeze(1)


PLAN_KEYS = {"ebc.rows": "RowWise", "ebc.cols": "ColumnWise", "ebc.whole": "TableWise"}


def _plan() -> dict:
    from dtrec.placements import ColumnWise, RowWise, TableWise

    return {"ebc.rows": RowWise(), "ebc.cols": ColumnWise(), "ebc.whole": TableWise(1)}


def _batch(step: int, group: int):
    """Dp group ``group``'s batch at ``step``: (kjt, dense features, labels)."""
    import dtrec

    gen = torch.Generator().manual_seed(1000 * step + group)
    keys, values, lengths = [], [], []
    for key, rows in (("f0", 20), ("f1", 20), ("f2", 10), ("f3", 12)):
        ls = torch.randint(0, 4, (BATCH,), generator=gen)
        keys.append(key)
        lengths.append(ls)
        values.append(torch.randint(0, rows, (int(ls.sum()),), generator=gen))
    kjt = dtrec.KeyedJaggedTensor(keys, torch.cat(values), torch.cat(lengths))
    return kjt, torch.randn(BATCH, 3, generator=gen), torch.randn(BATCH, generator=gen)


_WORLDS: dict = {}
DP_DIMS = {4: ("dp",), 8: ("dp_rep", "dp_shard")}


def _world():
    """(world mesh, the tables' mesh): (pp 2, dp 2) on 4 ranks, tables S=2 per stage;
    (pp 2, dp_rep 2, dp_shard 2) on 8, tables S=2 x R=2 per stage, HSDP on stage 1."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dtrec

    size = dist.get_world_size()
    if size not in _WORLDS:
        dims = DP_DIMS[size]
        world = init_device_mesh("cpu", (2,) * (1 + len(dims)), mesh_dim_names=("pp", *dims))
        replicate = "dp_rep" if size == 8 else None
        tables = dtrec.table_mesh(world, shard=dims[-1], replicate=replicate, pipeline="pp")
        _WORLDS[size] = (world, tables)
    return _WORLDS[size]


def _dp(world) -> tuple[int, int]:
    """This rank's data-parallel group within its stage, and the number of groups."""
    coordinate, sizes = world.get_coordinate()[1:], world.mesh.shape[1:]
    index = 0
    for c, n in zip(coordinate, sizes, strict=True):
        index = index * n + c
    return index, world.mesh[0].numel()


def _loss(out, target):
    return ((out - target) ** 2).mean()


def _fused(name: str):
    import dtrec

    return {
        "sgd": lambda: dtrec.optim.SGD(lr=0.1),
        "adagrad": lambda: dtrec.optim.RowWiseAdagrad(lr=0.1),
        "adam": lambda: dtrec.optim.Adam(lr=0.01),
        "torch_adam": lambda: None,
    }[name]()


def _torch_opt(name: str, params):
    if name == "torch_adam":
        return torch.optim.Adam(params, lr=0.01, foreach=True)
    return torch.optim.SGD(params, lr=0.1)


class Reference:
    """The unsharded model and its step: the dense part under the torch optimizer the
    distributed dense part uses, the tables under the same rule (a fused one updates the
    rows the global batch touched, as dtrec does)."""

    def __init__(self, opt: str) -> None:
        self.sparse, self.over = Sparse(), Over()
        self.rule = _fused(opt)
        tables = list(self.sparse.ebc.parameters())
        dense = list(self.sparse.bottom.parameters()) + list(self.over.parameters())
        self.optimizers = [_torch_opt(opt, dense)]
        if self.rule is None:
            self.optimizers.append(_torch_opt(opt, tables))
        else:
            self.state = {id(w): self.rule.init_state(w) for w in tables}

    def step(self, batches) -> list:
        losses = [
            _loss(self.over(self.sparse(torch.arange(BATCH), x, k)), t) for k, x, t in batches
        ]
        torch.stack(losses).mean().backward()
        for o in self.optimizers:
            o.step()
            o.zero_grad()
        if self.rule is not None:
            for cfg in self.sparse.ebc.embedding_bag_configs():
                weight = self.sparse.ebc.embedding_bags[cfg.name].weight
                ids = torch.cat([k[f].values() for k, _, _ in batches for f in cfg.feature_names])
                rows = torch.unique(ids.long())
                grad = torch.zeros_like(weight) if weight.grad is None else weight.grad
                with torch.no_grad():
                    self.rule.update_rows(weight, self.state[id(weight)], rows, grad[rows])
                weight.grad = None
        return [loss.detach() for loss in losses]


def _local_error(param, want) -> float:
    """Relative error of this rank's block of ``param`` against the full ``want``."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        got = param.detach()
    elif param.device_mesh.get_coordinate() is None:
        return 0.0  # a table-wise table's other rank holds nothing of it
    else:
        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
        want = want[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]
        got = param.to_local().detach()
    if got.numel() == 0:  # an FSDP shard past the end of a small parameter
        return 0.0
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def _train(schedule: str, opt: str, accumulate: bool = True, fsdp_bottom: bool = False) -> dict:
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import dtrec

    world, tables = _world()
    dp_mesh = world[DP_DIMS[dist.get_world_size()]]  # FSDP's (HSDP's, with two dims)
    stage, (dp, dp_size) = world["pp"].get_local_rank(), _dp(world)
    torch.manual_seed(0)
    reference = Reference(opt)
    ref_sparse, ref_over = reference.sparse, reference.over
    ref = ref_sparse if world["pp"].get_local_rank() == 0 else ref_over
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    if stage == 0:
        module = copy.deepcopy(ref_sparse)
        if fsdp_bottom:
            fully_shard(module.bottom, mesh=dp_mesh)
        module = dtrec.distribute_module(module, tables, _plan(), optimizer=_fused(opt))
        dense = [p for n, p in module.named_parameters() if not n.startswith("ebc.")]
        if opt == "torch_adam":
            dense = list(module.parameters())
    else:
        module = fully_shard(copy.deepcopy(ref_over), mesh=dp_mesh)
        dense = list(module.parameters())
    optimizer = _torch_opt(opt, dense)
    pipe = PipelineStage(module, stage, 2, torch.device("cpu"), group=world["pp"].get_group())
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    runner = kind(pipe, n_microbatches=MICRO, loss_fn=_loss)
    loss_errs = []
    for step in range(STEPS):
        batches = [_batch(step, g) for g in range(dp_size)]
        kjt, dense_x, y = batches[dp]
        losses: list = []
        if stage == 0 and accumulate:
            with dtrec.accumulate_gradients(module, divide_by=MICRO):
                runner.step(torch.arange(BATCH), dense_x, kjt=kjt)
        elif stage == 0:
            runner.step(torch.arange(BATCH), dense_x, kjt=kjt)
        else:
            runner.step(target=y, losses=losses)
        optimizer.step()
        optimizer.zero_grad()
        ref_losses = reference.step(batches)
        if stage == 1:
            got = torch.stack([loss.detach() for loss in losses]).mean()
            want = ref_losses[dp].detach()
            loss_errs.append(((got - want).abs() / want.abs()).item())
    weights = dict(ref.named_parameters())
    got = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in module.named_parameters()}
    assert set(got) == set(weights), (sorted(got), sorted(weights))
    dist.barrier()
    return {
        "stage": stage,
        "dp": dp_size,
        "loss": max(loss_errs, default=0.0),
        "weights": {n: _local_error(got[n], w.detach()) for n, w in weights.items()},
        "moved": {n: _local_error(init[n], w.detach()) for n, w in weights.items()},
    }


CONFIGS = {
    "gpipe_fused_sgd": dict(schedule="gpipe", opt="sgd"),
    "gpipe_fused_adagrad": dict(schedule="gpipe", opt="adagrad"),
    "gpipe_fused_adam": dict(schedule="gpipe", opt="adam"),
    "1f1b_fused_adam": dict(schedule="1f1b", opt="adam"),
    "1f1b_fused_sgd_fsdp_bottom": dict(schedule="1f1b", opt="sgd", fsdp_bottom=True),
    "gpipe_torch_adam": dict(schedule="gpipe", opt="torch_adam"),
    "1f1b_torch_adam": dict(schedule="1f1b", opt="torch_adam"),
}
CONFIGS_8 = {  # tables S=2 x R=2 on each stage (replica sums), HSDP on stage 1
    "gpipe_fused_adam_2d": dict(schedule="gpipe", opt="adam"),
    "1f1b_fused_adagrad_2d": dict(schedule="1f1b", opt="adagrad", fsdp_bottom=True),
    "1f1b_torch_adam_2d": dict(schedule="1f1b", opt="torch_adam"),
}
DRIFTS = {"1f1b_fused_adam_per_microbatch": dict(schedule="1f1b", opt="adam", accumulate=False)}


def _errors() -> dict:
    import dtrec
    from tests.multiprocess import error_of

    world, tables = _world()
    kjt, _, _ = _batch(0, 0)
    out = {
        "not_consecutive": error_of(lambda: dtrec.pipelining.microbatch(kjt, torch.tensor([0, 2]))),
        "outside": error_of(lambda: dtrec.pipelining.microbatch(kjt, torch.tensor([3, 4]))),
        "divide_by": error_of(lambda: dtrec.accumulate_gradients(Sparse(), 0).__enter__()),
        "pipeline_dim": error_of(lambda: dtrec.table_mesh(world, shard="dp", pipeline="dp")),
        "no_pipeline": error_of(lambda: dtrec.table_mesh(world, shard="dp")),
    }
    cut = dtrec.pipelining.microbatch(kjt, torch.tensor([2, 3]))
    out["cut"] = (cut.stride(), cut.lengths().tolist(), cut.values().tolist())
    lengths, values = kjt.lengths().view(4, BATCH), kjt.values().split(kjt.lengths().tolist())
    want_values = [v for i, v in enumerate(values) if i % BATCH >= 2]
    out["want_cut"] = (2, lengths[:, 2:].reshape(-1).tolist(), torch.cat(want_values).tolist())
    return out


def _run_all(rank: int, world: int, configs: dict) -> dict:
    errors = {"errors": _errors()} if world == 4 else {}
    return {**errors, **{name: _train(**cfg) for name, cfg in configs.items()}}


@pytest.fixture(scope="module")
def world_results() -> list[dict]:
    return run_world(4, _run_all, {**CONFIGS, **DRIFTS}, timeout=600)


@pytest.fixture(scope="module")
def world_results_8() -> list[dict]:
    return run_world(8, _run_all, CONFIGS_8, timeout=600)


@pytest.mark.parametrize("name", sorted(CONFIGS) + sorted(CONFIGS_8))
def test_pipeline_stages_train_like_the_unsharded_model(
    request: pytest.FixtureRequest, name: str
) -> None:
    results = request.getfixturevalue("world_results_8" if name in CONFIGS_8 else "world_results")
    for rank, per_rank in enumerate(results):
        r = per_rank[name]
        per_stage = len(results) // 2
        assert r["stage"] == rank // per_stage and r["dp"] == per_stage, (rank, r)
        assert r["loss"] < TOL, (rank, r)
        for param, err in r["weights"].items():
            assert err < TOL, (rank, name, param, err)
            assert r["moved"][param] > 10 * TOL, (rank, name, param, "did not train")


def test_fused_updates_per_microbatch_drift_from_the_unsharded_model(world_results) -> None:
    """The check above can fail: a fused Adam stepping once per microbatch (no
    ``accumulate_gradients``) ends away from the unsharded model's tables."""
    for rank in (0, 1):
        errs = world_results[rank]["1f1b_fused_adam_per_microbatch"]["weights"]
        assert max(e for n, e in errs.items() if n.startswith("ebc.")) > 100 * TOL, (rank, errs)


def test_microbatches_and_meshes_refuse_bad_input(world_results) -> None:
    for rank, per_rank in enumerate(world_results):
        e = per_rank["errors"]
        assert e["cut"] == e["want_cut"], (rank, e)
        assert (
            e["not_consecutive"].startswith("ValueError") and "consecutive" in e["not_consecutive"]
        ), (rank, e)
        assert e["outside"].startswith("ValueError") and "[0, 4)" in e["outside"], (rank, e)
        assert e["divide_by"].startswith("ValueError") and "divide_by" in e["divide_by"], e
        assert "pipeline 'dp'" in e["pipeline_dim"], (rank, e)
        assert "neither shard nor replicate" in e["no_pipeline"], (rank, e)
