"""The fused optimizers' update math on a block of rows, in pure torch: written once.

``dtrec.optim``'s rules run these where no kernel serves a step; the Triton update
kernels (``update_rows.py``, ``row_updates.py``) are tested against them through
``reference.py``. Inputs are fp32 gradient rows of the touched rows only; outputs
are new fp32 rows (and state), which the caller writes back.
"""

from __future__ import annotations

from torch import Tensor


def sgd_rows(weight_rows: Tensor, grad_rows: Tensor, lr: float) -> Tensor:
    """New fp32 rows ``w - lr g``."""
    return weight_rows.float() - lr * grad_rows


def rowwise_adagrad_rows(
    weight_rows: Tensor,
    acc: Tensor,
    grad_rows: Tensor,
    row_sq_sum: Tensor,
    full_dim: int,
    lr: float,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """(new fp32 rows, new accumulators): ``acc += row_sq_sum / full_dim``, then
    ``w -= lr g / (sqrt(acc) + eps)``; ``row_sq_sum`` is each row's ``sum_d g^2`` over
    the table's full dim (FBGEMM's EXACT_ROWWISE_ADAGRAD)."""
    acc = acc + row_sq_sum / max(full_dim, 1)
    step = grad_rows / (acc.sqrt() + eps).unsqueeze(1)
    return weight_rows.float() - lr * step, acc


def adam_rows(
    weight_rows: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    grad_rows: Tensor,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    step: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(new fp32 rows, exp_avg, exp_avg_sq): torch.optim.Adam's step (weight_decay=0),
    bias-corrected by ``step`` (1 on the first update). Inputs are not modified."""
    b1, b2 = betas
    m = exp_avg.mul(b1).add_(grad_rows, alpha=1 - b1)
    v = exp_avg_sq.mul(b2).addcmul_(grad_rows, grad_rows, value=1 - b2)
    denom = (v / (1 - b2**step)).sqrt_().add_(eps)
    return weight_rows.float() - (lr / (1 - b1**step)) * m / denom, m, v
