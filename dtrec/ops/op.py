"""``dtrec::embedding_bag``: the lookup registered with PyTorch (eager, autograd, compile).

The op takes the distinct tables plus an entry -> table map, so a table read by
many features (or by many source ranks after input-dist) is passed once and
gets one gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dtrec.ops.backends.registry import resolve_backend
from dtrec.ops.backends.torch import per_sample_weights_grad
from dtrec.ops.lookup import Lookup, check_offsets


def lookup_forward(lookup: Lookup, check_ids: bool = False) -> Tensor:
    """Forward on the selected backend, no autograd.

    ``check_ids``: ValueError for offsets that do not run from 0 to ``values.numel()``
    without decreasing (one vectorized pass, before any kernel reads them), IndexError
    for an id outside its table (the Triton kernel flags them while it gathers; other
    backends check first with one vectorized pass).
    """
    if check_ids:
        check_offsets(lookup.offsets, lookup.values.numel())
    return resolve_backend(lookup.values.device).forward(lookup, check_ids)


def lookup_backward_rows(lookup: Lookup, grad_out: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Per table: (sorted unique rows touched, their summed fp32 gradient rows)."""
    return resolve_backend(lookup.values.device).backward_rows(lookup, grad_out)


@torch.library.custom_op("dtrec::embedding_bag", mutates_args=())
def embedding_bag_op(
    weights: list[Tensor],
    entry_table: list[int],
    values: Tensor,
    offsets: Tensor,
    mean: list[bool],
    per_sample_weights: Tensor | None,
    check_ids: bool,
) -> Tensor:
    """Pooled lookup of E entries over U tables -> ``[B, sum D]`` (see embedding_bag.py).

    ``check_ids`` raises IndexError for an id outside its table (inside the op,
    so it also holds under ``torch.compile``).
    """
    lookup = Lookup(weights, entry_table, values, offsets, mean, per_sample_weights)
    return lookup_forward(lookup, check_ids)


def empty_pooled(weights: list[Tensor], entry_table: list[int], offsets: Tensor) -> Tensor:
    """An uninitialised ``[B, sum D]`` output of a pooled lookup (what fake kernels return)."""
    batch = (offsets.shape[0] - 1) // len(entry_table)
    width = sum(weights[t].shape[1] for t in entry_table)
    return weights[0].new_empty(batch, width)


@embedding_bag_op.register_fake
def _embedding_bag_fake(weights, entry_table, values, offsets, mean, per_sample_weights, check_ids):
    return empty_pooled(weights, entry_table, offsets)


@torch.library.custom_op("dtrec::embedding_bag_backward", mutates_args=())
def embedding_bag_backward_op(
    weights: list[Tensor],
    entry_table: list[int],
    values: Tensor,
    offsets: Tensor,
    mean: list[bool],
    per_sample_weights: Tensor | None,
    grad_out: Tensor,
) -> list[Tensor]:
    """Dense per-table weight gradients (built from the row-sparse ones)."""
    lookup = Lookup(weights, entry_table, values, offsets, mean, per_sample_weights)
    rows = lookup_backward_rows(lookup, grad_out)
    return [
        torch.zeros_like(w).index_copy_(0, ids, grad_rows.to(w.dtype))
        for w, (ids, grad_rows) in zip(weights, rows, strict=True)
    ]


@embedding_bag_backward_op.register_fake
def _embedding_bag_backward_fake(weights, entry_table, values, offsets, mean, psw, grad_out):
    return [torch.empty_like(w) for w in weights]


@torch.library.custom_op("dtrec::embedding_bag_psw_backward", mutates_args=())
def embedding_bag_psw_backward_op(
    weights: list[Tensor],
    entry_table: list[int],
    values: Tensor,
    offsets: Tensor,
    grad_out: Tensor,
) -> Tensor:
    """Gradient w.r.t. per-sample weights (sum pooling): ``<grad_out[bag, cols_e], row>`` per id."""
    mean = [False] * len(entry_table)
    return per_sample_weights_grad(Lookup(weights, entry_table, values, offsets, mean), grad_out)


@embedding_bag_psw_backward_op.register_fake
def _embedding_bag_psw_backward_fake(weights, entry_table, values, offsets, grad_out):
    return grad_out.new_empty(values.shape[0])


class EmbeddingBagFunction(torch.autograd.Function):
    """Autograd for the op: dense weight grads and per-sample-weight grads."""

    @staticmethod
    def forward(ctx, entry_table, mean, check_ids, values, offsets, per_sample_weights, *weights):  # type: ignore[override]
        ctx.entry_table, ctx.mean = entry_table, mean
        ctx.save_for_backward(values, offsets, per_sample_weights, *weights)
        return embedding_bag_op(
            list(weights), entry_table, values, offsets, mean, per_sample_weights, check_ids
        )

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        values, offsets, psw, *weights = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grads: list[Tensor | None] = [None] * len(weights)
        if any(needs[6:]):
            grads = list(
                embedding_bag_backward_op(
                    weights, ctx.entry_table, values, offsets, ctx.mean, psw, grad_out.contiguous()
                )
            )
        grad_psw = None
        if needs[5]:
            grad_psw = embedding_bag_psw_backward_op(
                weights, ctx.entry_table, values, offsets, grad_out.contiguous()
            ).to(psw.dtype)
        return (None, None, None, None, None, grad_psw, *grads)
