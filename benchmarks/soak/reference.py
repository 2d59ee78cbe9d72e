"""The soak's unsharded reference (``benchmarks/soak/run.py``): the model trained on one
process on every rank's batch, replaying a run's log, restarts included.

The numerics contract (DESIGN.md): loss = mean of the per-rank losses, the fused rule
applied to the rows the step touched (with the scheduled lr), the dense Adam on the
same schedule. ``snapshot`` / ``restore`` mirror the run's checkpoints and restarts.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from benchmarks.soak.model import (
    COLLECTIONS,
    FUSED_LR,
    Schedule,
    SoakModel,
    dense_optimizer,
    fused_rule,
    rank_loss,
)
from dtrec.sparse.variable_batch import expand_variable_batch


def touched_rows(batches: Iterable[Mapping[str, object]], features: list[str]) -> Tensor:
    """Unique ids of ``features`` over every rank's batch (VBE KJTs expanded, as the
    collections do): the rows a fused step updates."""
    ids = []
    for batch in batches:
        for name in ("sparse", "weighted", "seq"):
            kjt = batch[name]
            if kjt.variable_stride_per_key():
                kjt = expand_variable_batch(kjt, COLLECTIONS[name])
            ids += [kjt[f].values() for f in features if f in kjt.keys()]
    return torch.unique(torch.cat(ids)) if ids else torch.zeros(0, dtype=torch.long)


class Reference:
    """The unsharded model trained on every rank's batch of a step (loss = mean of the
    per-rank losses), the fused rule applied to the touched rows with the scheduled lr,
    the dense Adam under the same schedule. ``snapshot``/``restore`` replay restarts."""

    def __init__(self, total_steps: int, warmup: int) -> None:
        torch.manual_seed(0)
        self.model = SoakModel()
        self.rule = fused_rule()
        self.schedule = Schedule(warmup, total_steps)
        self.tables = [  # (collection, table, its features, the rule's state)
            (ebc, cfg.name, list(cfg.feature_names), self.rule.init_state(_table(ebc, cfg.name)))
            for ebc in (self.model.sparse, self.model.weighted, self.model.seq)
            for cfg in _configs(ebc)
        ]
        self.dense = dense_optimizer(self.model, foreach=False)
        self.dense_schedule = torch.optim.lr_scheduler.LambdaLR(self.dense, self.schedule)
        self.steps = 0

    def step(self, batches: list[dict[str, object]]) -> list[float]:
        losses = [rank_loss(self.model, b) for b in batches]
        torch.stack(losses).mean().backward()
        rule = self.rule.with_hyperparameters({"lr": FUSED_LR * self.schedule(self.steps)})
        with torch.no_grad():
            for ebc, name, features, state in self.tables:
                weight = _table(ebc, name)
                rows = touched_rows(batches, features)
                if rows.numel():
                    rule.update_rows(weight, state, rows, weight.grad[rows])
                weight.grad = None
        self.dense.step()
        self.dense.zero_grad()
        self.dense_schedule.step()
        self.steps += 1
        return [float(x.detach()) for x in losses]

    def snapshot(self) -> dict:
        return copy.deepcopy({
            "model": self.model.state_dict(),
            "fused": [state for *_, state in self.tables],
            "dense": self.dense.state_dict(),
            "schedule": self.dense_schedule.state_dict(),
            "steps": self.steps,
        })  # fmt: skip

    def restore(self, snap: dict) -> None:
        snap = copy.deepcopy(snap)
        self.model.load_state_dict(snap["model"])
        for (*_, state), saved in zip(self.tables, snap["fused"], strict=True):
            for k, v in saved.items():
                state[k].copy_(v)
        self.dense.load_state_dict(snap["dense"])
        self.dense_schedule.load_state_dict(snap["schedule"])
        self.steps = snap["steps"]

    def full_state(self) -> dict[str, Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def _configs(ebc: nn.Module) -> list:
    if hasattr(ebc, "embedding_bags"):
        return ebc.embedding_bag_configs()
    return ebc.embedding_configs()


def _table(ebc: nn.Module, name: str) -> Tensor:
    bags = ebc.embedding_bags if hasattr(ebc, "embedding_bags") else ebc.embeddings
    return bags[name].weight
