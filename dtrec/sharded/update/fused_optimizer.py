"""``model.fused_optimizer``: a ``torch.optim.Optimizer`` over the fused update's state.

The update itself runs inside backward (``fused_update.py``): the touched rows are
known only there, and a table-sized gradient is never built. This class is what
torch code around the training loop expects of an optimizer:

* ``param_groups``: one group per distributed collection (its tables are the group's
  ``params``, named by ``param_names``), holding the rule's hyperparameters (``lr``,
  ``eps``, ``betas``). The collection's updater reads its group at every update, so
  ``torch.optim.lr_scheduler.*`` and a hand-set ``group["lr"]`` change the next step.
  One group per collection because a collection's tables are updated together, in
  one kernel launch with one set of hyperparameters.
* ``step()`` and ``zero_grad()`` do nothing: backward already stepped, and the tables
  get no ``.grad``. Calling ``step()`` each iteration keeps an LR scheduler's
  "scheduler.step() before optimizer.step()" check quiet.
* ``state_dict()`` in TorchRec's ``KeyedOptimizer`` layout: ``{"state": {table FQN:
  {entry: DTensor placed like the table}}, "param_groups": [{hyperparameters,
  "params": [table FQNs]}]}``; ``load_state_dict`` checks all of it before copying.

Example::

    model = dtrec.distribute_module(model, mesh, optimizer=dtrec.optim.RowWiseAdagrad(lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(model.fused_optimizer, step_size=100, gamma=0.5)
    for batch in batches:
        loss_fn(model(batch)).backward()  # the embedding update happens here
        dense_opt.step(); model.fused_optimizer.step(); sched.step()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from dtrec.optim import FusedOptimizer
from dtrec.optim.param_groups import (
    PARAM_KEYS,
    check_loaded_group,
    describe_group,
    hyperparameters_of,
)
from dtrec.placements.layout import Block
from dtrec.planning.plan import collection_tables, table_fqn
from dtrec.sharded.collection import ShardedCollection
from dtrec.sharded.tables.tensor import load_block


class FusedOptimizerView(torch.optim.Optimizer):
    """The fused optimizer of a distributed model (see the module docstring)."""

    def __init__(
        self,
        collections: dict[str, ShardedCollection],
        optimizer: FusedOptimizer,
    ) -> None:
        self._collections = collections
        self._optimizer = optimizer
        groups = [
            {
                "params": [
                    (table_fqn(fqn, name), table.weight)
                    for name, table in collection_tables(ebc).items()
                ],
                # a collection's own rule (TorchRec's recipe may give collections their own lr)
                **(ebc.optimizer or optimizer).hyperparameters(),
            }
            for fqn, ebc in collections.items()
        ]
        super().__init__(groups, optimizer.hyperparameters())
        for group, ebc in zip(self.param_groups, collections.values(), strict=True):
            ebc._updater.param_group = group  # the updater reads it at every update
            for weight, state in zip(
                group["params"], ebc.fused_optimizer_state().values(), strict=True
            ):
                self.state[weight] = state  # the live local state, torch-style
                # TorchRec's marker of a fused table: in_backward_optimizer_filter (and
                # torch's _get_in_backward_optimizers) keep it out of the dense optimizer
                weight._in_backward_optimizers = [self]

    def __getstate__(self) -> dict[str, Any]:
        """torch's ``Optimizer.__getstate__`` keeps only defaults, state and param groups:
        also keep the collections and the rule, so that ``copy.deepcopy`` of a distributed
        model gives its copy a working view over the copied collections (the memo links
        each copied updater to the copied param group it reads)."""
        state = super().__getstate__()
        state.update(_collections=self._collections, _optimizer=self._optimizer)
        return state

    @property
    def optimizer(self) -> FusedOptimizer:
        """The update rule as configured (``dtrec.optim``), e.g. ``RowWiseAdagrad(lr=0.1)``;
        the live hyperparameters are in ``param_groups``. Assigning a rule of the same type
        sets every group's hyperparameters to its values (the next update uses them);
        another type is a TypeError (its state would differ)."""
        return self._optimizer

    @optimizer.setter
    def optimizer(self, rule: FusedOptimizer) -> None:
        if type(rule) is not type(self._optimizer):
            raise TypeError(
                f"model.fused_optimizer.optimizer is a {type(self._optimizer).__name__}; it can "
                f"only be replaced by another {type(self._optimizer).__name__} (new "
                f"hyperparameters), got {type(rule).__name__}: the optimizer state is made for "
                "the first; distribute the model again to change the optimizer type"
            )
        values = rule.hyperparameters()
        for group in self.param_groups:
            group.update(values)
        self.defaults.update(values)
        self._optimizer = rule

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Nothing to do: the update ran in backward. Returns ``closure()`` if given."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: fused tables never get a ``.grad``."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only at construction: groups are the model's collections, fixed once distributed."""
        if len(self.param_groups) == len(self._collections):
            raise ValueError(
                "model.fused_optimizer has one param group per distributed collection; "
                "groups cannot be added (put other parameters in a dense torch optimizer)"
            )
        super().add_param_group(param_group)

    def blocks(self) -> dict[str, Block | None]:
        """Table FQN -> this rank's block of it (None: the table has none here)."""
        return {
            table_fqn(fqn, name): table.block
            for fqn, ebc in self._collections.items()
            for name, table in collection_tables(ebc).items()
        }

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {table FQN: {entry: DTensor}}, "param_groups": [...]}``; the DTensors
        wrap the live state (``ShardedCollection.fused_optimizer_dtensors``)."""
        state = {
            table_fqn(fqn, name): entries
            for fqn, ebc in self._collections.items()
            for name, entries in ebc.fused_optimizer_dtensors().items()
        }
        return {"state": state, "param_groups": self.saved_param_groups()}

    def saved_param_groups(self) -> list[dict[str, Any]]:
        """Each group's hyperparameters (and schedulers' keys), ``params`` = its table FQNs."""
        return [
            {**hyperparameters_of(group), "params": list(group["param_names"])}
            for group in self.param_groups
        ]

    def check_param_groups(self, groups: object) -> None:
        """ValueError / KeyError unless ``groups`` (from ``saved_param_groups``) fit this
        optimizer: one group per collection, the same tables, every hyperparameter valid."""
        if not isinstance(groups, (list, tuple)) or len(groups) != len(self.param_groups):
            count = len(groups) if isinstance(groups, (list, tuple)) else type(groups).__name__
            raise ValueError(
                f"fused optimizer: expected {len(self.param_groups)} param group(s), one per "
                f"distributed collection, got {count}"
            )
        for i, (mine, saved) in enumerate(zip(self.param_groups, groups, strict=True)):
            if not isinstance(saved, Mapping):
                raise TypeError(
                    f"fused optimizer: param group {i} must be a dict, got {type(saved).__name__}"
                )
            tables = list(saved.get("params", ()))
            if tables != list(mine["param_names"]):
                raise KeyError(
                    f"{describe_group(mine)}: the saved group has tables {tables} (a different "
                    "model or collection order?)"
                )
            check_loaded_group(self.optimizer, {**saved, "param_names": tables})

    def load_param_groups(self, groups: list[Mapping[str, Any]]) -> None:
        """Replace every group's hyperparameters in place (the updaters hold the dicts)."""
        self.check_param_groups(groups)
        for mine, saved in zip(self.param_groups, groups, strict=True):
            for key in [k for k in mine if k not in PARAM_KEYS]:
                del mine[key]
            mine.update({k: v for k, v in saved.items() if k not in PARAM_KEYS})
            if "betas" in mine:
                mine["betas"] = tuple(mine["betas"])  # a list after a JSON round trip

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load ``state_dict()``'s layout (state DTensors of any placement, or full
        tensors); everything is checked before anything is copied."""
        if not isinstance(state_dict, Mapping) or set(state_dict) != {"state", "param_groups"}:
            got = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict)
            raise KeyError(
                "fused optimizer state_dict must be {'state': ..., 'param_groups': ...} as "
                f"returned by model.fused_optimizer.state_dict(), got {got}"
            )
        saved = state_dict["state"]
        current = self.state_dict()["state"]
        missing = sorted(set(current) - set(saved))
        unknown = sorted(set(saved) - set(current))
        if missing or unknown:
            raise KeyError(f"fused optimizer state: missing tables {missing}, unknown {unknown}")
        for key, state in current.items():
            if sorted(saved[key]) != sorted(state):
                raise KeyError(
                    f"fused optimizer state {key}: expected entries {sorted(state)}, got "
                    f"{sorted(saved[key])} (a different optimizer?)"
                )
            for name, tensor in state.items():
                got = tuple(saved[key][name].shape)
                if got != tuple(tensor.shape):
                    raise ValueError(
                        f"fused optimizer state {key}.{name}: expected shape "
                        f"{tuple(tensor.shape)}, got {got}"
                    )
        self.check_param_groups(state_dict["param_groups"])
        blocks = self.blocks()
        for key, state in current.items():
            for name, tensor in state.items():
                value = saved[key][name]
                if isinstance(tensor, DTensor):
                    load_block(tensor, value, blocks[key], f"{key}.{name}")
                else:
                    with torch.no_grad():
                        tensor.copy_(value)
        self.load_param_groups(state_dict["param_groups"])


__all__ = ["FusedOptimizerView"]
