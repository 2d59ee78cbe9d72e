"""LR schedules drive the fused optimizer: ``model.fused_optimizer`` is a torch Optimizer.

One spawned world of 2 ranks (shard axis 2) trains a model with two collections (two
param groups) whose tables are row-wise, column-wise and table-wise, with each fused
rule (SGD, RowWiseAdagrad, Adam) under torch's own schedulers, and compares every step's
weights with an unsharded reference trained on the global batch:

* SGD against ``torch.optim.SGD`` under the same scheduler;
* RowWiseAdagrad against the rule's own math on the unsharded tables (torch has no
  row-wise Adagrad), with the lr a torch scheduler gives;
* Adam against the same rule math (exact), and against ``torch.optim.SparseAdam``: both
  update only touched rows with a per-table step count, but SparseAdam adds eps to
  ``sqrt(v)`` before bias correction (torch.optim.Adam and dtrec after it), so the two
  agree only up to that eps term.

Each comparison is shown able to fail: the same reference at a constant lr is far off.
"""

from __future__ import annotations

import math

import pytest

from tests.multiprocess import run_world

WORLD = 2
STEPS = 6
FREEZE_AFTER = 3  # steps at full lr before the schedule sets lr = 0
SAVE_AFTER = 4  # steps before the checkpoint (the decay has halved the lr by then)
RULES = ("sgd", "rowwise_adagrad", "adam")
SCHEDULES = ("warmup_step_decay", "one_cycle", "per_group_lambda")
TOL = 1e-5  # float reassociation (fp32), relative to the weights' scale


def _rule(name: str, lr: float | None = None):
    import dtrec

    return {
        "sgd": lambda: dtrec.optim.SGD(lr=lr or 0.5),
        "rowwise_adagrad": lambda: dtrec.optim.RowWiseAdagrad(lr=lr or 0.1),
        "adam": lambda: dtrec.optim.Adam(lr=lr or 0.05),
        # eps small enough that where it enters no longer matters: SparseAdam then agrees
        "adam_tiny_eps": lambda: dtrec.optim.Adam(lr=lr or 0.05, eps=1e-14),
    }[name]()


def _tables():
    import dtrec

    cfg = dtrec.EmbeddingBagConfig
    first = [
        cfg("t0", 40, 8, ["f0"]),
        cfg("t1", 30, 6, ["f1"], pooling="mean"),
        cfg("t2", 25, 4, ["f2"]),
    ]
    second = [cfg("t3", 20, 4, ["f3"]), cfg("t4", 35, 8, ["f4"])]
    return first, second


def _plan() -> dict:
    from dtrec.placements import ColumnWise, RowWise, TableWise

    return {
        "sparse.t0": RowWise(),
        "sparse.t1": ColumnWise(),
        "sparse.t2": TableWise(rank=0),
        "other.t3": TableWise(rank=1),
        "other.t4": RowWise(),
    }


def _model():
    import torch
    from torch import nn

    import dtrec

    class TwoCollections(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            first, second = _tables()
            self.sparse = dtrec.EmbeddingBagCollection(first)
            self.other = dtrec.EmbeddingBagCollection(second)

        def forward(self, kjt):
            return torch.cat([self.sparse(kjt).values(), self.other(kjt).values()], 1)

    torch.manual_seed(0)
    return TwoCollections()


def _batches(step: int) -> list:
    """Every rank's batch of this step (each feature has ids on every rank)."""
    import torch

    import dtrec

    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(WORLD):
        keys, values, lengths = [], [], []
        for cfg in sum(_tables(), []):
            ls = torch.randint(1, 4, (3,), generator=gen)
            keys.append(cfg.feature_names[0])
            lengths.append(ls)
            values.append(torch.randint(0, cfg.num_embeddings, (int(ls.sum()),), generator=gen))
        kjt = dtrec.KeyedJaggedTensor(keys, torch.cat(values), torch.cat(lengths))
        out.append((kjt, torch.randn(3, generator=gen)))
    return out


def _loss(model, kjt, target):
    import torch

    coef = torch.linspace(-1.0, 1.0, 30)  # every output column weighs differently
    return (((model(kjt) * coef).sum(1) - target) ** 2).mean()


def _schedule(opt, kind: str, rule: str):
    """A torch scheduler of ``kind`` on ``opt`` (None: constant lr)."""
    from torch.optim import lr_scheduler as sched

    if kind == "constant":
        return None
    if kind == "freeze":
        return sched.LambdaLR(opt, lambda s: 1.0 if s < FREEZE_AFTER else 0.0)
    if kind == "warmup_step_decay":
        warmup = sched.LinearLR(opt, start_factor=0.25, total_iters=2)
        decay = sched.StepLR(opt, step_size=2, gamma=0.5)
        return sched.SequentialLR(opt, [warmup, decay], milestones=[2])
    if kind == "one_cycle":  # Adam's beta1 cycles too (its group has betas)
        adam = rule.startswith("adam")
        return sched.OneCycleLR(opt, max_lr=0.2, total_steps=STEPS, cycle_momentum=adam)
    if kind == "per_group_lambda":  # one lambda per group: per-collection lr
        return sched.LambdaLR(opt, [lambda s: 0.5**s, lambda s: 1.0 + s])
    raise AssertionError(kind)


def _weights(model) -> dict:
    """Full table weights (collective for a distributed model)."""
    from dtrec.checkpoint import full_state_dict

    return {k: v.float() for k, v in full_state_dict(model).items() if "embedding_bags" in k}


def _max_rel(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-6)).item() for k in a)


def _train_sharded(mesh, rule: str, kind: str, steps: int = STEPS, manual=None):
    """Per step, the full weights and the groups' lrs (the lr each step ran with)."""
    import warnings

    import dtrec

    rank = mesh.get_rank()
    model = dtrec.distribute_module(_model(), mesh, _plan(), optimizer=_rule(rule))
    opt = model.fused_optimizer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # OneCycleLR's "momentum" notes
        scheduler = _schedule(opt, kind, rule)
    history, lrs = [], []
    for step in range(steps):
        if manual is not None:
            manual(step, opt.param_groups)
        lrs.append([g["lr"] for g in opt.param_groups])
        kjt, target = _batches(step)[rank]
        _loss(model, kjt, target).backward()
        opt.step()  # a no-op: the update ran in backward
        if scheduler is not None:
            scheduler.step()
        history.append(_weights(model))
    return history, lrs, model


def _collection_rows(ebc, kjts) -> dict:
    import torch

    return {
        cfg.name: torch.unique(torch.cat([k[f].values() for k in kjts for f in cfg.feature_names]))
        for cfg in ebc.embedding_bag_configs()
    }


def _train_reference(rule: str, kind: str, reference: str, steps: int = STEPS, manual=None):
    """The unsharded model on the global batch: ``reference`` is "torch" (torch.optim.SGD /
    SparseAdam stepping the tables) or "rule" (the fused rule's math on touched rows, lr
    from a torch SGD the scheduler drives)."""
    import warnings

    import torch

    model = _model()
    groups = [
        {"params": list(model.sparse.parameters())},
        {"params": list(model.other.parameters())},
    ]
    config = _rule(rule)
    hyper = config.hyperparameters()
    if reference == "torch" and rule.startswith("adam"):
        opt = torch.optim.SparseAdam(groups, **hyper)
    elif rule.startswith("adam"):  # only holds the lr and betas the scheduler sets; never steps
        opt = torch.optim.Adam(groups, **hyper)
    else:  # torch SGD: the reference itself, or only the scheduler's lr holder
        opt = torch.optim.SGD(groups, lr=config.lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scheduler = _schedule(opt, kind, rule)
    state = {
        name: config.init_state(table.weight)
        for ebc in (model.sparse, model.other)
        for name, table in ebc.embedding_bags.items()
    }
    history = []
    for step in range(steps):
        if manual is not None:
            manual(step, opt.param_groups)
        batches = _batches(step)
        loss = torch.stack([_loss(model, k, t) for k, t in batches]).mean()
        loss.backward()
        kjts = [k for k, _ in batches]
        for group, ebc in zip(opt.param_groups, (model.sparse, model.other), strict=True):
            rows = _collection_rows(ebc, kjts)
            for name, table in ebc.embedding_bags.items():
                w = table.weight
                if reference == "rule":
                    values = {k: group.get(k, v) for k, v in hyper.items()}
                    with torch.no_grad():
                        config.with_hyperparameters(values).update_rows(
                            w, state[name], rows[name], w.grad[rows[name]]
                        )
                    w.grad = None
                elif rule.startswith("adam"):  # SparseAdam takes the touched rows as a sparse grad
                    r = rows[name]
                    w.grad = torch.sparse_coo_tensor(r[None], w.grad[r], w.shape).coalesce()
        if reference == "torch":
            opt.step()
        opt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the rule reference never steps its SGD
            if scheduler is not None:
                scheduler.step()
        history.append(_weights(model))
    return history


def _run_world(rank: int, world: int) -> dict:
    import shutil
    import tempfile
    from pathlib import Path

    import torch
    import torch.distributed as dist

    import dtrec

    mesh = dtrec.init_mesh("cpu", world)
    out: dict = {}

    def ref_kind(rule: str) -> list[str]:
        return {"sgd": ["torch"], "rowwise_adagrad": ["rule"], "adam": ["rule", "torch"]}[rule]

    # 1. Each rule under each schedule against its unsharded reference, step by step.
    for rule in RULES:
        for kind in SCHEDULES:
            history, lrs, _ = _train_sharded(mesh, rule, kind)
            for ref in ref_kind(rule):
                want = _train_reference(rule, kind, ref)
                out[f"{rule}/{kind}/{ref}"] = max(
                    _max_rel(got, exp) for got, exp in zip(history, want, strict=True)
                )
            out[f"{rule}/{kind}/lrs"] = lrs
        # ... and the same reference at a constant lr is far off (the check can fail)
        history, _, _ = _train_sharded(mesh, rule, "warmup_step_decay")
        constant = _train_reference(rule, "constant", ref_kind(rule)[0])
        out[f"{rule}/constant_differs"] = _max_rel(history[-1], constant[-1])
    history, _, _ = _train_sharded(mesh, "adam_tiny_eps", "one_cycle")
    want = _train_reference("adam_tiny_eps", "one_cycle", "torch")
    out["adam_tiny_eps/sparse_adam"] = max(
        _max_rel(got, exp) for got, exp in zip(history, want, strict=True)
    )

    # 2. lr = 0 after FREEZE_AFTER steps freezes every table bitwise.
    for rule in RULES:
        history, lrs, _ = _train_sharded(mesh, rule, "freeze")
        frozen = history[FREEZE_AFTER - 1]
        out[f"freeze/{rule}"] = {
            "lrs": lrs,
            "moved_before": all(
                not torch.equal(history[FREEZE_AFTER - 2][k], frozen[k]) for k in frozen
            ),
            "frozen_after": all(
                torch.equal(h[k], frozen[k]) for h in history[FREEZE_AFTER:] for k in frozen
            ),
        }

    # 3. lr set by hand on param_groups takes effect on the next step.
    def by_hand(step: int, groups: list) -> None:
        if step == 2:
            groups[0]["lr"] = 0.05
            groups[1]["lr"] = 2.0

    history, lrs, _ = _train_sharded(mesh, "sgd", "constant", manual=by_hand)
    want = _train_reference("sgd", "constant", "torch", manual=by_hand)
    unchanged = _train_reference("sgd", "constant", "torch")
    out["manual"] = {
        "diff": max(_max_rel(g, w) for g, w in zip(history, want, strict=True)),
        "same_before": _max_rel(history[1], unchanged[1]),
        "differs_after": _max_rel(history[2], unchanged[2]),
        "lrs": lrs,
    }

    # 4. Checkpoint: save mid-schedule, resume into a model configured with another lr.
    root = [tempfile.mkdtemp(prefix="dtrec-lr-") if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    path = Path(root[0])
    for rule in ("rowwise_adagrad", "adam"):
        model = dtrec.distribute_module(_model(), mesh, _plan(), optimizer=_rule(rule))
        opt = model.fused_optimizer
        scheduler = _schedule(opt, "warmup_step_decay", rule)

        def run(model, opt, scheduler, steps) -> None:
            for step in steps:
                kjt, target = _batches(step)[rank]
                _loss(model, kjt, target).backward()
                opt.step()
                scheduler.step()

        run(model, opt, scheduler, range(SAVE_AFTER))
        saved = dtrec.checkpoint.save(path / rule, model)
        saved_sched = scheduler.state_dict()
        saved_groups = opt.state_dict()["param_groups"]
        run(model, opt, scheduler, range(SAVE_AFTER, STEPS))
        straight = _weights(model)

        resumed = dtrec.distribute_module(_model(), mesh, _plan(), optimizer=_rule(rule, 7.0))
        ropt = resumed.fused_optimizer
        rsched = _schedule(ropt, "warmup_step_decay", rule)  # overwrites lr, as in torch
        dtrec.checkpoint.load(saved, resumed)
        rsched.load_state_dict(saved_sched)
        groups_after_load = ropt.state_dict()["param_groups"]
        run(resumed, ropt, rsched, range(SAVE_AFTER, STEPS))

        in_memory = dtrec.distribute_module(_model(), mesh, _plan(), optimizer=_rule(rule, 7.0))
        in_memory.fused_optimizer.load_state_dict(model.fused_optimizer.state_dict())
        out[f"checkpoint/{rule}"] = {
            "bitwise": all(
                torch.equal(a, b)
                for a, b in zip(straight.values(), _weights(resumed).values(), strict=True)
            ),
            "groups_restored": groups_after_load == saved_groups,
            "lr_saved": [g["lr"] for g in saved_groups],
            "in_memory_groups": in_memory.fused_optimizer.state_dict()["param_groups"]
            == model.fused_optimizer.state_dict()["param_groups"],
            "final_lrs": [g["lr"] for g in ropt.param_groups]
            == [g["lr"] for g in opt.param_groups],
        }

    dist.barrier()
    if rank == 0:
        shutil.rmtree(path)

    # 5. A bad group fails the next step on every rank, changing nothing; fixed, it trains.
    model = dtrec.distribute_module(_model(), mesh, _plan(), optimizer=_rule("adam"))
    opt = model.fused_optimizer
    kjt, target = _batches(0)[rank]
    before = _weights(model)

    def error_of(fn) -> str | None:
        try:
            fn()
        except ValueError as exc:
            return str(exc)
        return None

    step = lambda: _loss(model, kjt, target).backward()  # noqa: E731
    opt.param_groups[1]["weight_decay"] = 0.01
    out["errors"] = {"weight_decay": error_of(step)}
    del opt.param_groups[1]["weight_decay"]
    opt.param_groups[0]["lr"] = math.nan
    out["errors"]["nan_lr"] = error_of(step)
    opt.param_groups[0]["lr"] = -0.1
    out["errors"]["negative_lr"] = error_of(step)
    opt.param_groups[0]["lr"] = 0.05
    opt.param_groups[0]["betas"] = (0.9, 1.5)
    out["errors"]["betas"] = error_of(step)
    opt.param_groups[0]["betas"] = (0.9, 0.999)
    out["errors"]["unchanged"] = all(torch.equal(before[k], v) for k, v in _weights(model).items())
    # set between forward and backward: the update itself refuses it
    loss = _loss(model, kjt, target)
    opt.param_groups[1]["lr"] = -1.0
    out["errors"]["in_backward"] = error_of(loss.backward)
    opt.param_groups[1]["lr"] = 0.05
    out["errors"]["unchanged_after_backward"] = all(
        torch.equal(before[k], v) for k, v in _weights(model).items()
    )
    out["errors"]["next_step"] = error_of(step)
    # every table moves: no collection kept a stale stash from the failed backward
    out["errors"]["trains"] = not any(torch.equal(before[k], v) for k, v in _weights(model).items())
    out["errors"]["add_param_group"] = error_of(
        lambda: opt.add_param_group({"params": [torch.zeros(1)]})
    )
    out["replaced"] = _replace_rule(mesh, rank)
    return out


def _replace_rule(mesh, rank: int) -> dict:
    """``fused.optimizer = dataclasses.replace(fused.optimizer, lr=0)`` freezes the tables
    (it sets every group's hyperparameters); a rule of another type is a TypeError."""
    import dataclasses

    import torch

    import dtrec
    from tests.multiprocess import error_of

    model = dtrec.distribute_module(_model(), mesh, _plan(), optimizer=_rule("adam"))
    fused = model.fused_optimizer
    kjt, target = _batches(0)[rank]
    _loss(model, kjt, target).backward()
    before = _weights(model)
    fused.optimizer = dataclasses.replace(fused.optimizer, lr=0.0, betas=(0.5, 0.6))
    for step in (1, 2):
        kjt, target = _batches(step)[rank]
        _loss(model, kjt, target).backward()
    after = _weights(model)
    return {
        "frozen": all(torch.equal(before[k], after[k]) for k in before),
        "groups": [(g["lr"], g["betas"]) for g in fused.param_groups],
        "rule": fused.optimizer,
        "other_type": error_of(lambda: setattr(fused, "optimizer", dtrec.optim.SGD(lr=0.1))),
    }


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_world(WORLD, _run_world, timeout=600)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("kind", SCHEDULES)
def test_schedule_matches_unsharded_reference(results, rule: str, kind: str) -> None:
    refs = {"sgd": ["torch"], "rowwise_adagrad": ["rule"], "adam": ["rule"]}[rule]
    for rank, out in enumerate(results):
        for ref in refs:
            assert out[f"{rule}/{kind}/{ref}"] < TOL, (rank, ref, out[f"{rule}/{kind}/{ref}"])
        lrs = out[f"{rule}/{kind}/lrs"]
        assert len({tuple(lr) for lr in lrs}) > 2, lrs  # the schedule did change the lr


@pytest.mark.parametrize("kind", SCHEDULES)
def test_adam_against_torch_sparse_adam(results, kind: str) -> None:
    """Lazy Adam = SparseAdam up to where eps enters: dtrec divides by
    ``sqrt(v / bc2) + eps`` (torch.optim.Adam), SparseAdam by ``(sqrt(v) + eps) / sqrt(bc2)``,
    an eps up to 1 / sqrt(1 - beta2) (~32x) larger early on; with eps -> 0 they agree."""
    for out in results:
        assert out[f"adam/{kind}/torch"] < 1e-3, out[f"adam/{kind}/torch"]
        assert out["adam_tiny_eps/sparse_adam"] < TOL, out["adam_tiny_eps/sparse_adam"]


@pytest.mark.parametrize("rule", RULES)
def test_comparison_can_fail(results, rule: str) -> None:
    for out in results:
        assert out[f"{rule}/constant_differs"] > 1e-3, out[f"{rule}/constant_differs"]


@pytest.mark.parametrize("rule", RULES)
def test_zero_lr_freezes_tables_bitwise(results, rule: str) -> None:
    for out in results:
        got = out[f"freeze/{rule}"]
        assert got["moved_before"] and got["frozen_after"], got
        assert all(lr == [0.0, 0.0] for lr in got["lrs"][FREEZE_AFTER:]), got["lrs"]


def test_lr_set_by_hand_applies_next_step(results) -> None:
    for out in results:
        got = out["manual"]
        assert got["diff"] < TOL and got["same_before"] < TOL, got
        assert got["differs_after"] > 1e-3, got
        assert got["lrs"][2] == [0.05, 2.0], got["lrs"]


@pytest.mark.parametrize("rule", ("rowwise_adagrad", "adam"))
def test_checkpoint_round_trips_lr_and_resumes_exactly(results, rule: str) -> None:
    for out in results:
        got = out[f"checkpoint/{rule}"]
        assert got == {**got, "bitwise": True, "groups_restored": True}, got
        assert got["in_memory_groups"] and got["final_lrs"], got
        assert got["lr_saved"] != [_rule(rule).lr] * 2, got  # mid-schedule, not the config


def test_bad_group_is_a_clear_error_at_the_next_step(results) -> None:
    group = "fused optimizer param group of tables ['other.t3', 'other.t4']"
    for out in results:
        got = out["errors"]
        assert got["weight_decay"].startswith(f"{group}: 'weight_decay' is not a hyperparam")
        assert "['sparse.t0', 'sparse.t1', 'sparse.t2']: Adam: lr must be" in got["nan_lr"]
        assert got["nan_lr"].endswith("got nan") and got["negative_lr"].endswith("got -0.1")
        assert "betas must be a pair" in got["betas"]
        assert got["in_backward"] and got["in_backward"].startswith(group), got["in_backward"]
        assert got["unchanged"] and got["unchanged_after_backward"], got
        assert got["next_step"] is None and got["trains"], got
        assert "groups cannot be added" in got["add_param_group"]


def test_assigning_the_rule_sets_every_group(results) -> None:
    import dtrec

    for out in results:
        got = out["replaced"]
        assert got["frozen"], got  # lr = 0 from the next step on: the tables did not move
        assert got["groups"] == [(0.0, (0.5, 0.6))] * 2, got
        assert got["rule"] == dtrec.optim.Adam(lr=0.0, betas=(0.5, 0.6)), got
        assert got["other_type"].startswith("TypeError: model.fused_optimizer.optimizer is a Adam")
