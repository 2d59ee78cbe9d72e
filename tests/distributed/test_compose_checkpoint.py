"""Checkpoints of a model composed with torch's parallelisms (issue 47, item 5).

A model trained under TP + FSDP (dp 2 x tp 2) with its tables row-, column- and
table-wise on S=4 is saved, model and optimizer state, and loaded into the same model
under another layout: FSDP over all 4 ranks with the tables on S=2 x R=2 under another
plan. Two ways, on 4 gloo ranks in one world:

* torch's own: ``get_model_state_dict`` / ``get_optimizer_state_dict`` into
  ``torch.distributed.checkpoint.save``, ``dcp.load`` then ``set_model_state_dict`` /
  ``set_optimizer_state_dict``;
* dtrec's: ``dtrec.checkpoint.save(path, model, optimizer)`` / ``load``.

After loading, every parameter's full tensor equals the saved model's, and the next
training step (the same global batch split 2 ways before and 4 ways after, Adam, so the
optimizer state matters) gives the same loss and the same weights as the saved model
taking that step.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_compose import Net, _full, _mesh, _rel, tp_then_fsdp
from tests.multiprocess import run_world

TOL = 1e-5
PER_SPLIT = 2  # samples per quarter of the global batch


def _global_batch(step: int, parts: int, part: int):
    """Part ``part`` of ``parts`` of step ``step``'s global batch of 4 quarters: the
    concatenation of its quarters, key-major as a KJT wants."""
    import dtrec

    quarters = 4 // parts
    keys = ("f0", "f1", "f2", "f3")
    rows = {"f0": 20, "f1": 20, "f2": 10, "f3": 12}
    lengths = {k: [] for k in keys}
    values = {k: [] for k in keys}
    targets = []
    for q in range(part * quarters, (part + 1) * quarters):
        gen = torch.Generator().manual_seed(100 * step + q)
        for key in keys:
            ls = torch.randint(1, 4, (PER_SPLIT,), generator=gen)
            lengths[key].append(ls)
            values[key].append(torch.randint(0, rows[key], (int(ls.sum()),), generator=gen))
        targets.append(torch.randn(PER_SPLIT, generator=gen))
    kjt = dtrec.KeyedJaggedTensor(
        list(keys),
        torch.cat([torch.cat(values[k]) for k in keys]),
        torch.cat([torch.cat(lengths[k]) for k in keys]),
    )
    return kjt, torch.cat(targets)


def _tp_fsdp_s4(model):
    """Saved layout: TP on the MLP over tp, FSDP over dp, tables on S=4; (model, dp
    group, dp groups)."""
    import dtrec
    from dtrec.placements import ColumnWise, RowWise, TableWise

    mesh = tp_then_fsdp(model)
    plan = {"sparse.rows": RowWise(), "sparse.cols": ColumnWise(), "sparse.whole": TableWise(1)}
    model = dtrec.distribute_module(model, _mesh("tables"), plan)
    return model, mesh["dp"].get_local_rank(), mesh["dp"].size()


def _fsdp_s2r2(model):
    """Loaded layout: FSDP over the 4 ranks, tables on S=2 x R=2 under another plan."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import dtrec
    from dtrec.placements import ColumnWise, RowWise, TableWise

    fully_shard(model.mlp)
    plan = {"sparse.rows": ColumnWise(), "sparse.cols": RowWise(), "sparse.whole": TableWise(0)}
    model = dtrec.distribute_module(model, _mesh("tables_2x2"), plan)
    return model, dist.get_rank(), dist.get_world_size()


def _step(model, opt, step: int, group: int, groups: int) -> float:
    kjt, y = _global_batch(step, groups, group)
    loss = ((model(kjt) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _fulls(model) -> dict[str, torch.Tensor]:
    """Copies: a replicated DTensor's full tensor may be its own local block."""
    return {name: _full(p).clone() for name, p in model.named_parameters()}


def _torch_state(model, opt) -> dict:
    """torch's distributed state dicts of the model and its optimizer, as DCP takes them."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _next_step(model, opt, group: int, groups: int) -> tuple[dict, float, dict]:
    """The full weights now, the loss of step 2 over the global batch (the mean of the dp
    groups' means) and the full weights after it."""
    import torch.distributed as dist

    before = _fulls(model)
    loss = _step(model, opt, 2, group, groups)
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, (group, loss))
    return before, sum(dict(losses).values()) / groups, _fulls(model)


def _round_trip(root: str, how: str) -> dict:
    """Train 2 steps under the saved layout, save, take a third step; load into a fresh
    model under the other layout, take the same third step; compare."""
    import copy

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    import dtrec

    path = f"{root}/{how}"
    torch.manual_seed(0)
    saved, group, groups = _tp_fsdp_s4(copy.deepcopy(Net()))
    opt = torch.optim.Adam(saved.parameters(), lr=0.01)
    for step in range(2):
        _step(saved, opt, step, group, groups)
    if how == "torch":
        dcp.save(_torch_state(saved, opt), checkpoint_id=path)
    else:
        dtrec.checkpoint.save(path, saved, opt)
    at_save, saved_global, after_saved = _next_step(saved, opt, group, groups)

    torch.manual_seed(1)  # another init: every loaded value must come from the checkpoint
    loaded, group, groups = _fsdp_s2r2(copy.deepcopy(Net()))
    opt = torch.optim.Adam(loaded.parameters(), lr=0.01)
    if how == "torch":
        state = _torch_state(loaded, opt)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(loaded, state["model"])
        set_optimizer_state_dict(loaded, opt, state["optim"])
    else:
        dtrec.checkpoint.load(path, loaded, opt)
    at_load, loaded_global, after_loaded = _next_step(loaded, opt, group, groups)
    return {
        "loaded": {n: _rel(at_load[n], at_save[n]) for n in at_save},
        "next_step": {n: _rel(after_loaded[n], after_saved[n]) for n in after_saved},
        "moved": {n: _rel(after_saved[n], at_save[n]) for n in at_save},
        "loss": abs(loaded_global - saved_global) / abs(saved_global),
    }


def _run(rank: int, world: int, root: str) -> dict:
    return {how: _round_trip(root, how) for how in ("torch", "dtrec")}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_world(4, _run, str(tmp_path_factory.mktemp("compose_ckpt")), timeout=600)


@pytest.mark.parametrize("how", ["torch", "dtrec"])
def test_composed_checkpoint_reloads_onto_another_layout(results, how: str) -> None:
    for rank, per_rank in enumerate(results):
        r = per_rank[how]
        for name, err in r["loaded"].items():
            assert err < TOL, (rank, name, "loaded", err)
        for name, err in r["next_step"].items():
            assert err < TOL, (rank, name, "next step", err)
            assert r["moved"][name] > 10 * TOL, (rank, name, "the step did not move it")
        assert r["loss"] < TOL, (rank, r["loss"])
