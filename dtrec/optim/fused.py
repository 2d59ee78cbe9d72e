"""Optimizers fused into the embedding backward: typed configs that update touched rows.

A fused optimizer never materialises a table-sized gradient: backward yields
(unique rows, summed gradient rows) per table, and ``update_tables`` changes only
those rows of the weight and of the optimizer state. Rows no batch touched keep
their weights and state (FBGEMM's semantics; for Adam this is "lazy" Adam with
a per-table step count for bias correction).

Example::

    model = dtrec.distribute_module(model, mesh, plan, optimizer=dtrec.optim.RowWiseAdagrad(lr=0.1))
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dtrec.ops.backends.device_lists import device_list
from dtrec.ops.lookup import Lookup, packed_views, shared_storage

if TYPE_CHECKING:  # the Triton modules load only when the Triton backend runs
    from dtrec.kernels.row_updates import FusedRowUpdate


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


class FusedOptimizer(ABC):
    """An update rule applied to the touched rows of tables (shards) in place."""

    #: True when the update needs each row's sum of squared gradients over the
    #: FULL row: column shards then all-reduce it before calling ``update_tables``.
    needs_row_sq_sum: bool = False

    @abstractmethod
    def init_state(self, weight: Tensor) -> dict[str, Tensor]:
        """Zero state for a local shard ``[rows, cols]``: row-shaped or weight-shaped tensors."""

    def state_layout(self) -> dict[str, str]:
        """Per state entry: "weight" (shaped like the shard), "row" (one value per row) or
        "scalar" (one per table); checkpoints place each kind like its table."""
        probe = self.init_state(torch.empty(2, 3))
        kinds = {0: "scalar", 1: "row", 2: "weight"}
        return {k: kinds[v.dim()] for k, v in probe.items()}

    def init_states(self, weights: list[Tensor]) -> list[dict[str, Tensor]]:
        """States for several shards, each state kind packed in one buffer (views per table).

        With the weights packed the same way, the Triton path updates every
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
        """One step on several tables: one Triton launch when they share storage."""
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
        replica or column-shard sync). On the Triton backend, with tables and states
        packed, one pass sums each touched row's gradient and updates the row in place
        (no gradient buffer); on CPU, fbgemm's fused C++ backward + step where it
        serves the optimizer (SGD, row-wise Adagrad); otherwise row grads, then
        ``update_tables``. Every gradient
        is multiplied by ``grad_scale`` first.
        """
        from dtrec.ops.op import lookup_backward_rows

        self._begin_step(states)
        fused = self._fused_row_update(lookup.weights, states, grad_scale)
        if fused is not None:
            from dtrec.ops.backends import triton as triton_backend

            triton_backend.backward_update(lookup, grad_out, fused)
            return
        if self._fbgemm_backward_update(lookup, grad_out, states, grad_scale):
            return
        rows = lookup_backward_rows(lookup, grad_out)
        self._apply(
            [
                RowUpdate(w, st, ids, g if grad_scale == 1.0 else g * grad_scale)
                for w, st, (ids, g) in zip(lookup.weights, states, rows, strict=True)
            ]
        )

    def _begin_step(self, states: list[dict[str, Tensor]]) -> None:  # noqa: B027
        """Per-step bookkeeping of every table stepped, touched or not (Adam's step count)."""

    def _apply(self, updates: list[RowUpdate]) -> None:
        updates = [u for u in updates if u.rows.numel()]
        if not updates:
            return
        args = _triton_tables(updates)
        if args is not None and self._update_triton(updates, args):
            return
        for u in updates:
            self._update_torch(u)

    def _fused_row_update(
        self, weights: list[Tensor], states: list[dict[str, Tensor]], grad_scale: float
    ) -> FusedRowUpdate | None:
        """The fused backward's update arguments, or None where it cannot serve these tables."""
        packed = _packed_for_triton(weights)
        if packed is None:
            return None
        return self._row_update(packed, weights, states, grad_scale)

    def _fbgemm_backward_update(
        self, lookup: Lookup, grad_out: Tensor, states: list[dict[str, Tensor]], grad_scale: float
    ) -> bool:
        """fbgemm's fused CPU backward + step (``fbgemm_backend.backward_update``); False if
        it does not serve this optimizer or call."""
        return False

    def _row_update(
        self,
        packed: tuple[Tensor, Tensor],
        weights: list[Tensor],
        states: list[dict[str, Tensor]],
        grad_scale: float,
    ) -> FusedRowUpdate | None:
        """This optimizer's ``FusedRowUpdate`` over packed weights (None: not fusable)."""
        return None

    @abstractmethod
    def _update_torch(self, u: RowUpdate) -> None:
        """Reference update of one table with torch index ops (any device)."""

    @abstractmethod
    def _update_triton(self, updates: list[RowUpdate], args: dict) -> bool:
        """Update all tables with one kernel launch; False if their state is not packed."""


def _packed_for_triton(weights: list[Tensor]) -> tuple[Tensor, Tensor] | None:
    """(flat buffer, int64 table offsets) when the Triton backend serves these packed shards."""
    from dtrec.ops.backends.registry import resolve_backend

    if not weights or resolve_backend(weights[0].device) != "triton":
        return None
    shared = shared_storage(weights)
    if shared is None:
        return None
    flat, offsets = shared
    return flat, device_list(offsets, torch.int64, flat.device)


def _hyper(
    device: torch.device,
    lr: float,
    grad_scale: float,
    eps: float = 0.0,
    betas: tuple[float, float] = (0.0, 0.0),
    sqrt_bc2: float = 1.0,
    cached: bool = True,
) -> Tensor:
    """``FusedRowUpdate.hyper``: the step's scalars as one small fp32 tensor."""
    values = [lr, eps, *betas, sqrt_bc2, grad_scale]
    return device_list(values, torch.float32, device, cached)


def _row_update_args(kind: str, *buffers: Tensor) -> FusedRowUpdate:
    from dtrec.kernels import row_updates as triton_row_updates

    return triton_row_updates.FusedRowUpdate(getattr(triton_row_updates, kind), *buffers)


def _triton_tables(updates: list[RowUpdate]) -> dict | None:
    """Packed kernel arguments when the Triton backend serves these shards, else None."""
    packed = _packed_for_triton([u.weight for u in updates])
    if packed is None:
        return None
    flat, table_offsets = packed
    weight = updates[0].weight
    device = weight.device
    dims = [u.weight.shape[1] for u in updates]
    counts = device_list([u.rows.numel() for u in updates], torch.int64, device, cached=False)
    row_dims = device_list(dims, torch.int64, device).repeat_interleave(counts)
    first_row = torch.cumsum(counts, 0) - counts
    grads = shared_storage([u.grad_rows for u in updates])
    if grads is None:  # pack the gradient rows (one copy)
        grad_flat = torch.cat([u.grad_rows.reshape(-1) for u in updates])
        grad_offsets = torch.cumsum(row_dims, 0) - row_dims
    else:  # backward's rows already live in one buffer: read them in place
        grad_flat, starts = grads
        index_in_table = torch.arange(int(counts.sum()), device=device)
        index_in_table -= first_row.repeat_interleave(counts)
        base = device_list(starts, torch.int64, device, cached=False).repeat_interleave(counts)
        grad_offsets = base + index_in_table * row_dims
    table_ids = torch.arange(len(updates), dtype=torch.int32, device=device)
    return {
        "weights": flat,
        "table_offsets": table_offsets,
        "dims": device_list(dims, torch.int32, device),
        "row_table": table_ids.repeat_interleave(counts),
        "row_ids": torch.cat([u.rows for u in updates]),
        "grad_rows": grad_flat,
        "grad_offsets": grad_offsets,
        "max_dim": max(dims),
    }


def _state_offsets(states: list[dict[str, Tensor]], key: str) -> tuple[Tensor, Tensor] | None:
    """A packed state kind: (flat buffer, per-table offsets), or None if not packed."""
    shared = shared_storage([st[key] for st in states])
    if shared is None:
        return None
    flat, offsets = shared
    return flat, device_list(offsets, torch.int64, flat.device)


def _check_hyper(name: str, attr: str, value: object, positive: bool = False) -> None:
    """A finite real hyperparameter, >= 0 (> 0 with ``positive``), else ValueError naming it."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0 or (positive and value == 0):
        want = "> 0" if positive else ">= 0"
        raise ValueError(f"{name}: {attr} must be a finite number {want}, got {value!r}")


def _check_lr(lr: float, name: str) -> None:
    _check_hyper(name, "lr", lr)


def _check_eps(eps: float, name: str) -> None:
    # eps = 0 divides 0 by 0 on a touched row whose gradient and state are 0: NaN weights.
    _check_hyper(name, "eps", eps, positive=True)


@dataclass(frozen=True)
class SGD(FusedOptimizer):
    """``w[r] -= lr * g[r]`` on touched rows (identical to torch SGD on the dense grad)."""

    lr: float

    def __post_init__(self) -> None:
        _check_lr(self.lr, "SGD")

    def init_state(self, weight: Tensor) -> dict[str, Tensor]:
        return {}

    def _update_triton(self, updates: list[RowUpdate], args: dict) -> bool:
        from dtrec.kernels.update_rows import sgd_update_rows

        sgd_update_rows(lr=self.lr, **args)
        return True

    def _row_update(self, packed, weights, states, grad_scale):  # type: ignore[override]
        flat, offsets = packed
        hyper = _hyper(flat.device, self.lr, grad_scale)
        return _row_update_args("SGD", flat, offsets, hyper, flat, offsets, flat, offsets)

    def _fbgemm_backward_update(self, lookup, grad_out, states, grad_scale):  # type: ignore[override]
        from dtrec.ops.backends import fbgemm as fbgemm_backend

        return fbgemm_backend.backward_update(lookup, grad_out, "sgd", self.lr, grad_scale)

    def _update_torch(self, u: RowUpdate) -> None:
        new = u.weight.index_select(0, u.rows).float() - self.lr * u.grad_rows
        u.weight.index_copy_(0, u.rows, new.to(u.weight.dtype))


@dataclass(frozen=True)
class RowWiseAdagrad(FusedOptimizer):
    """FBGEMM's exact row-wise Adagrad: one accumulator per row.

    ``acc[r] += mean_d g[r, d]^2``;  ``w[r] -= lr * g[r] / (sqrt(acc[r]) + eps)``.
    The mean is over the table's full embedding dim, so column shards first
    all-reduce their partial sums of squares (exact, unlike TorchRec's CW).
    """

    lr: float
    eps: float = 1e-8
    needs_row_sq_sum = True

    def __post_init__(self) -> None:
        _check_lr(self.lr, "RowWiseAdagrad")
        _check_eps(self.eps, "RowWiseAdagrad")

    def init_state(self, weight: Tensor) -> dict[str, Tensor]:
        return {"sum": torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)}

    def _update_triton(self, updates: list[RowUpdate], args: dict) -> bool:
        from dtrec.kernels.update_rows import rowwise_adagrad_update_rows

        state = _state_offsets([u.state for u in updates], "sum")
        if state is None:
            return False
        row_sq_sum = None  # the kernel sums squares itself unless a caller reduced them
        if any(u.row_sq_sum is not None for u in updates):
            row_sq_sum = torch.cat(
                [
                    u.row_sq_sum if u.row_sq_sum is not None else u.grad_rows.square().sum(1)
                    for u in updates
                ]
            )
        full = [u.full_dim or u.weight.shape[1] for u in updates]
        rowwise_adagrad_update_rows(
            state=state[0],
            state_offsets=state[1],
            lr=self.lr,
            eps=self.eps,
            row_sq_sum=row_sq_sum,
            full_dims=device_list(full, torch.int32, state[0].device),
            **args,
        )
        return True

    def _row_update(self, packed, weights, states, grad_scale):  # type: ignore[override]
        from dtrec.kernels.embedding_bag import MAX_FUSED_ROWWISE_DIM

        state = _state_offsets(states, "sum")
        if state is None or max(w.shape[1] for w in weights) > MAX_FUSED_ROWWISE_DIM:
            return None
        flat, offsets = packed
        device = flat.device
        dims = device_list([w.shape[1] for w in weights], torch.int32, device)
        hyper = _hyper(device, self.lr, grad_scale, self.eps)
        return _row_update_args("ROWWISE_ADAGRAD", flat, offsets, hyper, *state, flat, dims)

    def _fbgemm_backward_update(self, lookup, grad_out, states, grad_scale):  # type: ignore[override]
        from dtrec.ops.backends import fbgemm as fbgemm_backend

        sums = [st["sum"] for st in states]
        return fbgemm_backend.backward_update(
            lookup, grad_out, "rowwise_adagrad", self.lr, grad_scale, self.eps, sums
        )

    def _update_torch(self, u: RowUpdate) -> None:
        dim = u.full_dim or u.grad_rows.shape[1]
        row_sq_sum = u.row_sq_sum if u.row_sq_sum is not None else u.grad_rows.square().sum(1)
        acc = u.state["sum"].index_select(0, u.rows) + row_sq_sum / max(dim, 1)
        u.state["sum"].index_copy_(0, u.rows, acc)
        step = u.grad_rows / (acc.sqrt() + self.eps).unsqueeze(1)
        new = u.weight.index_select(0, u.rows).float() - self.lr * step
        u.weight.index_copy_(0, u.rows, new.to(u.weight.dtype))


@dataclass(frozen=True)
class Adam(FusedOptimizer):
    """Adam on touched rows (m, v per element; bias correction by the table's step count)."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        _check_lr(self.lr, "Adam")
        _check_eps(self.eps, "Adam")
        betas = self.betas
        if (
            not isinstance(betas, (tuple, list))
            or len(betas) != 2
            or not all(isinstance(b, numbers.Real) and 0.0 <= b < 1.0 for b in betas)
        ):
            raise ValueError(f"Adam: betas must be a pair of numbers in [0, 1), got {betas!r}")
        object.__setattr__(self, "betas", tuple(betas))  # hashable, and saved alike

    def init_state(self, weight: Tensor) -> dict[str, Tensor]:
        zeros = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        return {
            "exp_avg": zeros,
            "exp_avg_sq": zeros.clone(),
            # on the host, like torch.optim.Adam's: reading it needs no device sync
            "step": torch.zeros((), dtype=torch.float32),
        }

    def _begin_step(self, states: list[dict[str, Tensor]]) -> None:
        for st in states:
            st["step"] += 1

    def _row_update(self, packed, weights, states, grad_scale):  # type: ignore[override]
        flat, offsets = packed
        m = shared_storage([st["exp_avg"] for st in states])
        v = shared_storage([st["exp_avg_sq"] for st in states])
        steps = {float(st["step"]) for st in states}
        weight_offsets = [w.storage_offset() for w in weights]
        if m is None or v is None or m[1] != weight_offsets or v[1] != weight_offsets:
            return None  # the kernel reads m and v at the weights' offsets
        if len(steps) != 1:
            return None  # one bias correction for all tables
        step, (b1, b2) = float(steps.pop()), self.betas
        lr = self.lr / (1 - b1**step)
        sqrt_bc2 = (1 - b2**step) ** 0.5
        hyper = _hyper(flat.device, lr, grad_scale, self.eps, self.betas, sqrt_bc2, cached=False)
        return _row_update_args("ADAM", flat, offsets, hyper, m[0], offsets, v[0], offsets)

    def _update_triton(self, updates: list[RowUpdate], args: dict) -> bool:
        from dtrec.kernels.update_rows import adam_update_rows

        states = [u.state for u in updates]
        m, v = _state_offsets(states, "exp_avg"), _state_offsets(states, "exp_avg_sq")
        steps = {float(u.state["step"]) for u in updates}
        same_layout = m is not None and v is not None and torch.equal(m[1], args["table_offsets"])
        if not same_layout or not torch.equal(v[1], args["table_offsets"]) or len(steps) != 1:
            return False  # the kernel reads m and v at the weights' offsets, with one step
        b1, b2 = self.betas
        adam_update_rows(
            exp_avg=m[0],
            exp_avg_sq=v[0],
            lr=self.lr,
            beta1=b1,
            beta2=b2,
            eps=self.eps,
            step=int(steps.pop()),
            **args,
        )
        return True

    def _update_torch(self, u: RowUpdate) -> None:
        if not u.rows.numel():
            return
        b1, b2 = self.betas
        step = float(u.state["step"])
        m = u.state["exp_avg"].index_select(0, u.rows).mul_(b1).add_(u.grad_rows, alpha=1 - b1)
        v = (
            u.state["exp_avg_sq"]
            .index_select(0, u.rows)
            .mul_(b2)
            .addcmul_(u.grad_rows, u.grad_rows, value=1 - b2)
        )
        u.state["exp_avg"].index_copy_(0, u.rows, m)
        u.state["exp_avg_sq"].index_copy_(0, u.rows, v)
        denom = (v / (1 - b2**step)).sqrt_().add_(self.eps)
        new = u.weight.index_select(0, u.rows).float() - (self.lr / (1 - b1**step)) * m / denom
        u.weight.index_copy_(0, u.rows, new.to(u.weight.dtype))


__all__ = ["SGD", "Adam", "FusedOptimizer", "RowUpdate", "RowWiseAdagrad"]
