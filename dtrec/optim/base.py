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
        it in place; CPU: fbgemm's C++ backward + SGD / row-wise Adagrad); otherwise row
        grads, then ``update_tables``. Every gradient is multiplied by ``grad_scale`` first.
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
        for u in merged_row_updates(updates):
            self._update_torch(u)


def merged_row_updates(updates: list[RowUpdate]) -> list[RowUpdate]:
    """``updates`` with those of tables packed in one buffer merged into one update each,
    so that the pure-torch step runs its ops once for all of them, not once per table
    (the CPU step of 8 column shards: 8x fewer index ops). Tables merge when their
    weights share one storage, dtype, device, column count and full dim, their state
    entries are row- or weight-shaped (no per-table scalar: Adam's step count keeps its
    tables apart) and packed in the same table order, and no tiling is asked for. The
    merged update addresses rows of one view over the packed buffer (each table's rows
    shifted by its first row there): rows stay unique, so the in-place adds stay exact,
    and every row's math is the per-table math, element for element."""
    groups: dict[tuple, list[RowUpdate]] = {}
    out: list[RowUpdate] = []
    for u in updates:
        key = _merge_key(u)
        if key is None:
            out.append(u)
        else:
            groups.setdefault(key, []).append(u)
    for group in groups.values():
        merged = _merged(group) if len(group) > 1 else None
        out.extend(group if merged is None else [merged])
    return out


def _merge_key(u: RowUpdate) -> tuple | None:
    w = u.weight
    if w.dim() != 2 or not w.is_contiguous() or u.tile_dim is not None:
        return None
    if any(v.dim() == 0 or not v.is_contiguous() for v in u.state.values()):
        return None
    states = tuple(
        sorted((k, v.untyped_storage().data_ptr(), v.dim(), v.dtype) for k, v in u.state.items())
    )
    return (w.untyped_storage().data_ptr(), w.device, w.dtype, w.shape[1], u.full_dim,
            u.row_sq_sum is None, states)  # fmt: skip


def _merged(group: list[RowUpdate]) -> RowUpdate | None:
    """One update over a view of the packed buffer, or None where the tables do not sit
    in it as whole rows of one width, their states alike."""
    cols = group[0].weight.shape[1]
    if cols == 0:
        return None
    base = min(u.weight.storage_offset() for u in group)
    shifts = []
    for u in group:
        gap = u.weight.storage_offset() - base
        if gap % cols:
            return None
        shifts.append(gap // cols)
    num_rows = max(s + u.weight.shape[0] for s, u in zip(shifts, group, strict=True))
    weight = group[0].weight.as_strided((num_rows, cols), (cols, 1), base)
    state: dict[str, Tensor] = {}
    for key, first in group[0].state.items():
        per_row = cols if first.dim() == 2 else 1
        start = first.storage_offset() - shifts[0] * per_row
        if start < 0 or any(
            u.state[key].storage_offset() != start + s * per_row
            for s, u in zip(shifts, group, strict=True)
        ):
            return None
        shape = (num_rows, cols) if first.dim() == 2 else (num_rows,)
        stride = (cols, 1) if first.dim() == 2 else (1,)
        state[key] = first.as_strided(shape, stride, start)
    rows = torch.cat([u.rows + s for s, u in zip(shifts, group, strict=True)])
    sq = None if group[0].row_sq_sum is None else torch.cat([u.row_sq_sum for u in group])
    grads = torch.cat([u.grad_rows for u in group])
    return RowUpdate(weight, state, rows, grads, sq, group[0].full_dim)


def check_hyper(name: str, attr: str, value: object, positive: bool = False) -> None:
    """A finite real hyperparameter, >= 0 (> 0 with ``positive``), else ValueError naming it."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0 or (positive and value == 0):
        want = "> 0" if positive else ">= 0"
        raise ValueError(f"{name}: {attr} must be a finite number {want}, got {value!r}")


__all__ = ["FusedOptimizer", "RowUpdate", "check_hyper", "merged_row_updates"]
