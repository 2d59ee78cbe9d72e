"""The fused update rules (SGD, row-wise Adagrad, Adam): each one's math, written once.

Each rule's math on a block of rows is written once, in pure torch, in
``dtrec.kernels.update_math`` as a step (``sgd_step``, ``rowwise_adagrad_step``,
``adam_step``): the optimizers add it to the touched rows in place where no kernel
serves an update, and the Triton update kernels are tested against it.

Example::

    model = dtrec.distribute_module(model, mesh, plan, optimizer=dtrec.optim.RowWiseAdagrad(lr=0.1))
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from dtrec.kernels import cpu as cpu_kernels
from dtrec.kernels.update_math import (
    adam_rows,
    adam_step,
    row_sq_sums,
    rowwise_adagrad_rows,
    rowwise_adagrad_step,
    sgd_rows,
    sgd_step,
)
from dtrec.ops.backends.base import RowUpdate, StepRule
from dtrec.optim.base import FusedOptimizer, check_hyper


def _add_step(u: RowUpdate, change: Tensor) -> None:
    """Add the fp32 ``change`` to the touched rows: in place for fp32 tables (rows are
    unique, so ``index_add_`` is exact and deterministic), else rounded once from fp32."""
    if u.weight.dtype == torch.float32:
        u.weight.index_add_(0, u.rows, change)
    else:
        new = u.weight.index_select(0, u.rows).float().add_(change)
        u.weight.index_copy_(0, u.rows, new.to(u.weight.dtype))


def _check_eps(eps: float, name: str) -> None:
    # eps = 0 divides 0 by 0 on a touched row whose gradient and state are 0: NaN weights.
    check_hyper(name, "eps", eps, positive=True)


@dataclass(frozen=True)
class SGD(FusedOptimizer):
    """``w[r] -= lr * g[r]`` on touched rows (identical to torch SGD on the dense grad)."""

    lr: float

    def __post_init__(self) -> None:
        check_hyper("SGD", "lr", self.lr)

    def init_state(self, weight: Tensor) -> dict[str, Tensor]:
        return {}

    def step_rule(self) -> StepRule:
        return StepRule("sgd", self.lr)

    def _update_torch(self, u: RowUpdate) -> None:
        if cpu_kernels.sgd_(u.weight, u.rows, u.grad_rows, self.lr):  # CPU: one C pass
            return
        _add_step(u, sgd_step(u.grad_rows, self.lr))


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
        check_hyper("RowWiseAdagrad", "lr", self.lr)
        _check_eps(self.eps, "RowWiseAdagrad")

    def init_state(self, weight: Tensor) -> dict[str, Tensor]:
        return {"sum": torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)}

    def step_rule(self) -> StepRule:
        return StepRule("rowwise_adagrad", self.lr, self.eps)

    def _update_torch(self, u: RowUpdate) -> None:
        full_dim = u.full_dim or u.grad_rows.shape[1]
        if cpu_kernels.rowwise_adagrad_(  # CPU: one C pass over the rows, in place
            u.weight, u.state["sum"], u.rows, u.grad_rows, u.row_sq_sum, full_dim,
            self.lr, self.eps,
        ):  # fmt: skip
            return
        row_sq_sum = u.row_sq_sum if u.row_sq_sum is not None else row_sq_sums(u.grad_rows)
        change, acc = rowwise_adagrad_step(
            u.state["sum"].index_select(0, u.rows),
            u.grad_rows,
            row_sq_sum,
            full_dim,
            self.lr,
            self.eps,
        )
        u.state["sum"].index_copy_(0, u.rows, acc)
        _add_step(u, change)


@dataclass(frozen=True)
class Adam(FusedOptimizer):
    """Adam on touched rows (m, v per element; bias correction by the table's step count)."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        check_hyper("Adam", "lr", self.lr)
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

    def step_rule(self) -> StepRule:
        return StepRule("adam", self.lr, self.eps, self.betas)

    def _begin_step(self, states: list[dict[str, Tensor]]) -> None:
        for st in states:
            st["step"] += 1

    def _update_torch(self, u: RowUpdate) -> None:
        change, m, v = adam_step(
            u.state["exp_avg"].index_select(0, u.rows),
            u.state["exp_avg_sq"].index_select(0, u.rows),
            u.grad_rows,
            self.lr,
            self.betas,
            self.eps,
            float(u.state["step"]),
        )
        u.state["exp_avg"].index_copy_(0, u.rows, m)
        u.state["exp_avg_sq"].index_copy_(0, u.rows, v)
        _add_step(u, change)


__all__ = ["SGD", "Adam", "RowWiseAdagrad", "adam_rows", "rowwise_adagrad_rows", "sgd_rows"]
