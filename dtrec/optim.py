"""Optimizers fused into the embedding backward: typed configs that update touched rows.

A fused optimizer never materialises a table-sized gradient: backward yields
(unique rows, summed gradient rows) per table, and ``update_rows`` changes only
those rows of the weight and of the optimizer state. Rows no batch touched keep
their weights and state (FBGEMM's semantics; for Adam this is "lazy" Adam with
a per-table step count for bias correction).

Example::

    model = dtrec.distribute_module(model, mesh, plan, optimizer=dtrec.optim.RowWiseAdagrad(lr=0.1))
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor


class FusedOptimizer(ABC):
    """An update rule applied to the touched rows of one table (shard) in place."""

    #: True when the update needs each row's sum of squared gradients over the
    #: FULL row: column shards then all-reduce it before calling ``update_rows``.
    needs_row_sq_sum: bool = False

    @abstractmethod
    def init_state(self, weight: Tensor) -> dict[str, Tensor]:
        """Zero state for a local shard ``[rows, cols]``: row-shaped or weight-shaped tensors."""

    @abstractmethod
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


def _triton_rows(weight: Tensor, rows: Tensor, grad_rows: Tensor) -> dict | None:
    """Single-table kernel arguments when the Triton backend serves ``weight``'s device."""
    from dtrec.ops.backend import resolve_backend

    if resolve_backend(weight.device) != "triton" or not weight.is_contiguous():
        return None
    dim = weight.shape[1]
    device = weight.device
    return {
        "weights": weight.view(-1),
        "table_offsets": torch.zeros(1, dtype=torch.int64, device=device),
        "dims": torch.tensor([dim], dtype=torch.int32, device=device),
        "row_table": torch.zeros(rows.numel(), dtype=torch.int32, device=device),
        "row_ids": rows,
        "grad_rows": grad_rows.contiguous().view(-1),
        "grad_offsets": torch.arange(rows.numel(), device=device) * dim,
        "max_dim": dim,
    }


def _check_lr(lr: float, name: str) -> None:
    if not isinstance(lr, (int, float)) or lr < 0:
        raise ValueError(f"{name}: lr must be a non-negative number, got {lr!r}")


@dataclass(frozen=True)
class SGD(FusedOptimizer):
    """``w[r] -= lr * g[r]`` on touched rows (identical to torch SGD on the dense grad)."""

    lr: float

    def __post_init__(self) -> None:
        _check_lr(self.lr, "SGD")

    def init_state(self, weight: Tensor) -> dict[str, Tensor]:
        return {}

    def update_rows(self, weight, state, rows, grad_rows, row_sq_sum=None, full_dim=None) -> None:
        if rows.numel() and (args := _triton_rows(weight, rows, grad_rows)) is not None:
            from dtrec.ops.triton_kernels import sgd_update_rows

            sgd_update_rows(lr=self.lr, **args)
            return
        new = weight[rows].float() - self.lr * grad_rows
        weight.index_copy_(0, rows, new.to(weight.dtype))


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

    def init_state(self, weight: Tensor) -> dict[str, Tensor]:
        return {"sum": torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)}

    def update_rows(self, weight, state, rows, grad_rows, row_sq_sum=None, full_dim=None) -> None:
        dim = full_dim if full_dim is not None else grad_rows.shape[1]
        if rows.numel() and (args := _triton_rows(weight, rows, grad_rows)) is not None:
            from dtrec.ops.triton_kernels import rowwise_adagrad_update_rows

            rowwise_adagrad_update_rows(
                state=state["sum"],
                state_offsets=torch.zeros(1, dtype=torch.int64, device=weight.device),
                lr=self.lr,
                eps=self.eps,
                row_sq_sum=row_sq_sum,
                full_dims=torch.tensor([dim], dtype=torch.int32, device=weight.device),
                **args,
            )
            return
        if row_sq_sum is None:
            row_sq_sum = grad_rows.square().sum(1)
        acc = state["sum"][rows] + row_sq_sum / max(dim, 1)
        state["sum"].index_copy_(0, rows, acc)
        step = grad_rows / (acc.sqrt() + self.eps).unsqueeze(1)
        weight.index_copy_(0, rows, (weight[rows].float() - self.lr * step).to(weight.dtype))


@dataclass(frozen=True)
class Adam(FusedOptimizer):
    """Adam on touched rows (m, v per element; bias correction by the table's step count)."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        _check_lr(self.lr, "Adam")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"Adam: betas must be in [0, 1), got {self.betas}")

    def init_state(self, weight: Tensor) -> dict[str, Tensor]:
        zeros = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        return {
            "exp_avg": zeros,
            "exp_avg_sq": zeros.clone(),
            "step": torch.zeros((), dtype=torch.float32, device=weight.device),
        }

    def update_rows(self, weight, state, rows, grad_rows, row_sq_sum=None, full_dim=None) -> None:
        b1, b2 = self.betas
        state["step"] += 1
        step = float(state["step"])
        if rows.numel() and (args := _triton_rows(weight, rows, grad_rows)) is not None:
            from dtrec.ops.triton_kernels import adam_update_rows

            adam_update_rows(
                exp_avg=state["exp_avg"].view(-1),
                exp_avg_sq=state["exp_avg_sq"].view(-1),
                lr=self.lr,
                beta1=b1,
                beta2=b2,
                eps=self.eps,
                step=int(step),
                **args,
            )
            return
        m = state["exp_avg"][rows].mul_(b1).add_(grad_rows, alpha=1 - b1)
        v = state["exp_avg_sq"][rows].mul_(b2).addcmul_(grad_rows, grad_rows, value=1 - b2)
        state["exp_avg"].index_copy_(0, rows, m)
        state["exp_avg_sq"].index_copy_(0, rows, v)
        denom = (v / (1 - b2**step)).sqrt_().add_(self.eps)
        new = weight[rows].float() - (self.lr / (1 - b1**step)) * m / denom
        weight.index_copy_(0, rows, new.to(weight.dtype))


__all__ = ["SGD", "Adam", "FusedOptimizer", "RowWiseAdagrad"]
