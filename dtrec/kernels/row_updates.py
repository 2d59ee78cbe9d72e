"""The fused optimizers' math on a tile of rows, shared by the Triton kernels that apply it.

``sgd_step``, ``rowwise_adagrad_step``, ``adam_moments`` and ``adam_step`` are each
rule's arithmetic on loaded values (the Triton twin of ``dtrec.optim.rules``), inlined
by both the standalone update kernels (``update_rows.py``) and ``apply_row_update``.
``apply_row_update`` is inlined by the backward's segment kernels, which then
update a row where they would have stored its gradient (the one-pass backward +
optimizer of ``embedding_bag_bwd_rows(update=...)``: no gradient buffer is written or
read back). ``FusedRowUpdate`` carries its arguments. Layouts as in
``embedding_bag.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl
from torch import Tensor

SGD, ROWWISE_ADAGRAD, ADAM = 1, 2, 3
"""Values of ``FusedRowUpdate.kind`` (0 means: store the gradient, no update)."""


class FusedRowUpdate(NamedTuple):
    """One optimizer step applied to each touched row by the kernel that sums its gradient.

    ``hyper`` fp32 ``[6]``: lr (Adam: lr / bias correction 1), eps, beta1, beta2, sqrt of
    bias correction 2, and the factor every summed gradient is multiplied by first.
    ``state`` is row-wise Adagrad's per-row sum (``state_offsets[t] + r``) or Adam's
    ``exp_avg``; ``state2`` Adam's ``exp_avg_sq`` (both packed like the weights). Unused
    buffers may be any tensor. ``full_dims`` int32 ``[U]``: the dim row-wise Adagrad
    averages squares over. ``error`` int32 (its first element read): while nonzero no row is
    written (a device flag set by a bounds check whose batch must change nothing; None: a
    zero the launcher supplies).
    """

    kind: int
    weights: Tensor
    table_offsets: Tensor
    hyper: Tensor
    state: Tensor
    state_offsets: Tensor
    state2: Tensor
    full_dims: Tensor
    error: Tensor | None = None


@triton.jit
def sgd_step(w, g, lr):
    """``w - lr g``: SGD, and row-wise Adagrad's weight step with its per-row factor as ``lr``."""
    return w - lr * g


@triton.jit
def rowwise_adagrad_step(s, sq, full_dim, lr, eps):
    """Row-wise Adagrad's accumulator ``s`` of a row whose gradient's ``sum_d g^2`` is ``sq``:
    ``(s + sq / full_dim, lr / (sqrt(s_new) + eps))``, the new accumulator and the factor
    the row's gradient is scaled by (``sgd_step(w, g, factor)``)."""
    s = s + sq / full_dim
    return s, lr / (tl.sqrt_rn(s) + eps)


@triton.jit
def adam_moments(m, v, g, beta1, beta2):
    """Adam's new ``(m, v)``: ``m = lerp(m, g, 1 - beta1)`` (torch's form), ``v = beta2 v +
    (1 - beta2) g^2``."""
    return m + (1.0 - beta1) * (g - m), beta2 * v + (1.0 - beta2) * g * g


@triton.jit
def adam_step(w, m, v, lr, sqrt_bc2, eps):
    """``w - lr m / (sqrt(v) / sqrt_bc2 + eps)`` (``lr`` already divided by bias correction 1)."""
    return w - lr * m / (tl.sqrt_rn(v) / sqrt_bc2 + eps)


@triton.jit
def apply_row_update(
    g,
    mask,
    live,
    table,
    row,
    cols,
    dim,
    weights_ptr,
    table_offsets_ptr,
    hyper_ptr,
    state_ptr,
    state_offsets_ptr,
    state2_ptr,
    full_dims_ptr,
    error_ptr,
    KIND: tl.constexpr,
):
    """Update rows ``W_t[row, cols]`` (tile ``[R, BLOCK_D]``) with their fp32 gradient ``g``.

    ``mask`` ``[R, BLOCK_D]`` marks real elements, ``live`` ``[R]`` real rows; ``table``,
    ``row``, ``dim`` are ``[R]``. Nothing is written while ``error[0] != 0``. SGD: ``W -=
    lr g``. Row-wise Adagrad (the tile must hold whole rows): ``s += sum_d g^2 /
    full_dim``, ``W -= lr g / (sqrt(s) + eps)``. Adam (torch's, weight_decay=0): ``m =
    lerp(m, g, 1 - b1)``, ``v = b2 v + (1 - b2) g^2``, ``W -= lr' m / (sqrt(v) / sqrt_bc2
    + eps)``. Math in fp32, stored in the weights dtype.
    """
    # Vector masks from a vector load (the interpreter mishandles tensor & scalar-bool masks).
    ok = tl.load(error_ptr + row * 0, mask=live, other=1) == 0
    live = live & ok
    mask = mask & ok[:, None]
    g = g * tl.load(hyper_ptr + 5)
    lr = tl.load(hyper_ptr)
    w_off = tl.load(table_offsets_ptr + table, mask=live, other=0) + row * dim
    w_ptrs = weights_ptr + w_off[:, None] + cols[None, :]
    w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    if KIND == 1:
        w = sgd_step(w, g, lr)
    elif KIND == 2:
        s_ptrs = state_ptr + tl.load(state_offsets_ptr + table, mask=live, other=0) + row
        s = tl.load(s_ptrs, mask=live, other=0.0)
        full = tl.load(full_dims_ptr + table, mask=live, other=1).to(tl.float32)
        s, factor = rowwise_adagrad_step(s, tl.sum(g * g, axis=1), full, lr, tl.load(hyper_ptr + 1))
        tl.store(s_ptrs, s, mask=live)
        w = sgd_step(w, g, factor[:, None])
    else:
        m_ptrs = state_ptr + w_off[:, None] + cols[None, :]
        v_ptrs = state2_ptr + w_off[:, None] + cols[None, :]
        m = tl.load(m_ptrs, mask=mask, other=0.0)
        v = tl.load(v_ptrs, mask=mask, other=0.0)
        m, v = adam_moments(m, v, g, tl.load(hyper_ptr + 2), tl.load(hyper_ptr + 3))
        tl.store(m_ptrs, m, mask=mask)
        tl.store(v_ptrs, v, mask=mask)
        w = adam_step(w, m, v, lr, tl.load(hyper_ptr + 4), tl.load(hyper_ptr + 1))
    tl.store(w_ptrs, w.to(weights_ptr.dtype.element_ty), mask=mask)


__all__ = [
    "ADAM",
    "ROWWISE_ADAGRAD",
    "SGD",
    "FusedRowUpdate",
    "adam_moments",
    "adam_step",
    "apply_row_update",
    "rowwise_adagrad_step",
    "sgd_step",
]
