"""The fused optimizer protocol: update touched rows in place, on the backend that serves it.

A fused optimizer never materialises a table-sized gradient: backward yields
(unique rows, summed gradient rows) per table, and ``update_tables`` changes only
those rows of the weight and of the optimizer state. Rows no batch touched keep
their weights and state (FBGEMM's semantics; for Adam this is "lazy" Adam with
a per-table step count for bias correction).

Each rule (``dtrec.optim.rules``) states its step once as pure torch math; the
backend (``dtrec.ops.backends``) runs it in its kernels where it can
(``StepRule``), and that math runs everywhere else.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from dtrec.ops.backends.base import RowUpdate, StepRule
from dtrec.ops.backends.registry import resolve_backend
from dtrec.ops.lookup import Lookup, packed_views


class FusedOptimizer(ABC):
    """An update rule applied to the touched rows of tables (shards) in place."""

    #: True when the update needs each row's sum of squared gradients over the
    #: FULL row: column shards then all-reduce it before calling ``update_tables``.
    needs_row_sq_sum: bool = False

    @abstractmethod
    def init_state(self, weight: Tensor) -> dict[str, Tensor]:
        """Zero state for a local shard ``[rows, cols]``: row-shaped or weight-shaped tensors."""

    @abstractmethod
    def step_rule(self) -> StepRule:
        """This step as the backends' kernels take it."""

    @abstractmethod
    def _update_torch(self, u: RowUpdate) -> None:
        """The pure-torch update of one table's touched rows (any device, any backend)."""

    def hyperparameters(self) -> dict[str, Any]:
        """The rule's hyperparameters by name (its config fields): its param group's keys."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def with_hyperparameters(self, values: Mapping[str, Any]) -> FusedOptimizer:
        """This rule with ``values`` in place of its hyperparameters, checked like the
        constructor's (ValueError naming the key). Rules are frozen: a schedule's new lr
        makes a new rule for that step."""
        return dataclasses.replace(self, **values)  # type: ignore[type-var]

    def state_layout(self) -> dict[str, str]:
        """Per state entry: "weight" (shaped like the shard), "row" (one value per row) or
        "scalar" (one per table); checkpoints place each kind like its table."""
        probe = self.init_state(torch.empty(2, 3))
        kinds = {0: "scalar", 1: "row", 2: "weight"}
        return {k: kinds[v.dim()] for k, v in probe.items()}

    def init_states(self, weights: list[Tensor]) -> list[dict[str, Tensor]]:
        """States for several shards, each state kind packed in one buffer (views per table).

        With the weights packed the same way, the Triton backend updates every
        table in one launch per kind.
        """
        states = [self.init_state(w) for w in weights]
        for key in states[0] if states else []:
            parts = [st[key] for st in states]
            if parts[0].dim() == 0:
                continue
            views = packed_views([p.shape for p in parts], parts[0].dtype, parts[0].device, True)
            for st, view in zip(states, views, strict=True):
                st[key] = view
        return states

    @torch.no_grad()
    def reset_rows(self, weight: Tensor, state: dict[str, Tensor], rows: Tensor) -> None:
        """Per-row state of ``rows`` (local row indices of ``weight``) back to its init, as
        for a row whose id a managed-collision table evicted; per-table scalars (Adam's
        step) stay."""
        if rows.numel() == 0:
            return
        fresh = self.init_state(weight[rows])
        for key, value in fresh.items():
            if value.dim() and key in state:
                state[key][rows] = value.to(state[key].dtype)

    def update_rows(
        self,
        weight: Tensor,
        state: dict[str, Tensor],
        rows: Tensor,
        grad_rows: Tensor,
        row_sq_sum: Tensor | None = None,
        full_dim: int | None = None,
    ) -> None:
        """Apply one step to ``weight[rows]`` given their fp32 gradient rows."""
        self.update_tables([RowUpdate(weight, state, rows, grad_rows, row_sq_sum, full_dim)])

    def update_tables(self, updates: list[RowUpdate]) -> None:
        """One step on several tables: one kernel launch where the backend packs them."""
        self._begin_step([u.state for u in updates])
        self._apply(updates)

    def backward_update(
        self,
        lookup: Lookup,
        grad_out: Tensor,
        states: list[dict[str, Tensor]],
        grad_scale: float = 1.0,
    ) -> None:
        """The lookup's backward and one step on its tables (``states[i]`` for ``weights[i]``).

        For tables whose whole gradient this lookup holds (no other lookup of them, no
        replica or column-shard sync). The backend fuses the two where it can (Triton,
        tables and states packed: one pass sums each touched row's gradient and updates
        it in place; CPU, SGD and row-wise Adagrad: ``dtrec.kernels.cpu``'s C pass or
        fbgemm's C++ backward); otherwise row grads, then ``update_tables``. Every gradient
        is multiplied by ``grad_scale`` first.
        """
        self._begin_step(states)
        backend = resolve_backend(lookup.values.device)
        if backend.backward_update(lookup, grad_out, self.step_rule(), states, grad_scale):
            return
        # scaled before the row sums: grad_out has fewer elements than the summed rows
        rows = backend.backward_rows(
            lookup, grad_out if grad_scale == 1.0 else grad_out * grad_scale
        )
        self._apply(
            [
                RowUpdate(w, st, ids, g)
                for w, st, (ids, g) in zip(lookup.weights, states, rows, strict=True)
            ]
        )

    def _begin_step(self, states: list[dict[str, Tensor]]) -> None:  # noqa: B027
        """Per-step bookkeeping of every table stepped, touched or not (Adam's step count)."""

    def _apply(self, updates: list[RowUpdate]) -> None:
        updates = [u for u in updates if u.rows.numel()]
        if not updates:
            return
        backend = resolve_backend(updates[0].weight.device)
        if backend.update_rows(self.step_rule(), updates):
            return
        for u in updates:
            self._update_torch(u)


def check_hyper(name: str, attr: str, value: object, positive: bool = False) -> None:
    """A finite real hyperparameter, >= 0 (> 0 with ``positive``), else ValueError naming it."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0 or (positive and value == 0):
        want = "> 0" if positive else ">= 0"
        raise ValueError(f"{name}: {attr} must be a finite number {want}, got {value!r}")


__all__ = ["FusedOptimizer", "RowUpdate", "check_hyper"]
