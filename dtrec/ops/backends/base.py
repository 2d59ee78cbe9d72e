"""What every lookup backend provides: the ``Backend`` protocol and the types it exchanges.

A backend runs the batched lookup (``dtrec.ops.lookup.Lookup``) forward, its row-sparse
backward, and optionally the backward fused with an optimizer step or a batched step on
row gradients. Optimizers describe their step backend-neutrally (``StepRule``) and keep
their pure-torch math (``dtrec.optim``); a backend answers False where it does not
serve a step, and the caller then runs that math.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from dtrec.ops.lookup import Lookup


@dataclass(frozen=True)
class Capabilities:
    """What a backend's kernels take; calls outside it run on torch's implementation."""

    devices: frozenset[str]
    """Device types it runs on ("cpu", "cuda")."""
    dtypes: frozenset[torch.dtype]
    """Table dtypes its lookups take."""
    per_sample_weights: bool
    """Weighted (sum-pooled) lookups."""
    mean_pooling: bool
    """Mean-pooled entries."""
    mixed_pooling: bool
    """Sum and mean entries in one call."""
    fused_backward_update: bool
    """Whether ``backward_update`` can serve some optimizer step at all."""
    skips_bad_ids: bool = False
    """Whether it takes ``Lookup.error``: flags ids outside their table on the device (no
    host read) and skips them, and changes no table while the flag is set."""

    def serves(self, lookup: Lookup) -> bool:
        """Whether this lookup's device, dtype and pooling are all within these capabilities."""
        mean = set(map(bool, lookup.mean))
        return (
            lookup.values.device.type in self.devices
            and all(w.dtype in self.dtypes for w in lookup.weights)
            and (self.per_sample_weights or lookup.per_sample_weights is None)
            and (self.mean_pooling or True not in mean)
            and (self.mixed_pooling or len(mean) == 1)
        )


@dataclass(frozen=True)
class StepRule:
    """One fused optimizer step as backends take it: the update's name and hyperparameters.

    ``kind`` also fixes the state each table carries (``states[i][key]``): "sgd" none;
    "rowwise_adagrad" "sum" (fp32, one per row); "adam" "exp_avg" and "exp_avg_sq" (fp32,
    shaped like the weight) and "step" (the table's step count, already incremented).
    """

    kind: str
    """"sgd", "rowwise_adagrad" or "adam"."""
    lr: float
    """Learning rate."""
    eps: float = 0.0
    """Added to the denominator (row-wise Adagrad, Adam)."""
    betas: tuple[float, float] = (0.0, 0.0)
    """Adam's decay rates of the first and second moments."""


@dataclass
class RowUpdate:
    """One table's share of a fused step: its touched rows and their gradients."""

    weight: Tensor
    """The local shard ``[rows, cols]``, updated in place."""
    state: dict[str, Tensor]
    """Its optimizer state (from ``init_states``)."""
    rows: Tensor
    """Sorted unique local row ids touched."""
    grad_rows: Tensor
    """fp32 ``[len(rows), cols]``: their summed gradients."""
    row_sq_sum: Tensor | None = None
    """Per row, the sum of squared gradients over the FULL row (column shards all-reduce it)."""
    full_dim: int | None = None
    """The table's full embedding dim (the shard's cols when None)."""
    tile_dim: int | None = None
    """The widest table of the step this update is part of, when the step's rows are
    updated in more than one call (an offloaded table's cached rows and, in a call of
    their own, its rows staged from host memory): kernels whose column tiles follow the
    widest table of a call tile by it, so every row rounds as in one call."""


class Backend(Protocol):
    """An implementation of the lookup op, chosen per device by ``registry.resolve_backend``."""

    name: str
    """The name ``dtrec.ops.set_backend`` selects it by."""
    capabilities: Capabilities

    def forward(self, lookup: Lookup, check_ids: bool = False) -> Tensor:
        """Pooled output ``[B, sum D]``; with ``check_ids``, IndexError for an id outside
        its table (offsets are checked by the caller); with ``lookup.error`` (backends that
        skip bad ids) such ids are flagged there instead."""
        ...

    def backward_rows(self, lookup: Lookup, grad_out: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per table: (sorted unique rows touched, their summed fp32 gradient rows)."""
        ...

    def backward_update(
        self,
        lookup: Lookup,
        grad_out: Tensor,
        rule: StepRule,
        states: Sequence[dict[str, Tensor]],
        grad_scale: float = 1.0,
    ) -> bool:
        """The backward and one ``rule`` step on the lookup's tables in place, gradients
        times ``grad_scale``; False (nothing changed) where this backend does not serve it."""
        ...

    def update_rows(self, rule: StepRule, updates: Sequence[RowUpdate]) -> bool:
        """One ``rule`` step on several tables' touched rows (all non-empty); False
        (nothing changed) where this backend does not serve it."""
        ...


__all__ = ["Backend", "Capabilities", "RowUpdate", "StepRule"]
