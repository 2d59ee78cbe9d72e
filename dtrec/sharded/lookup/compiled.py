"""The fused lookup as ops ``torch.compile`` traces whole (issue 32).

Eager's ``FusedLookup`` (``update/fused_update.py``) is an ``autograd.Function`` whose backward
hands its input to the updater (a Python side effect dynamo cannot put in a graph) and
whose input includes a throwaway leaf made per call (``requires_grad=True`` inside the
forward: a graph break). Under ``torch.compile``, ``fused_lookup`` calls this file's ops
instead:

* ``dtrec::fused_embedding_bag``: forward, the pooled lookup (``check_ids``: ids outside
  their table raise IndexError inside the op, so no host read is traced); its backward
  (``register_autograd``) calls
* ``dtrec::fused_embedding_bag_stash``: opaque to the tracer, it runs at run time inside
  the compiled backward and stashes ``(lookup, grad_out)`` with the updater, exactly as
  eager's backward does (the end-of-backward update then runs as in eager). Its output
  is the trigger's (empty) gradient, so no graph pass can drop it.

The trigger is one persistent leaf per updater (``FusedUpdater.trigger``), a graph input.
The updater reaches the ops as an int key into a weak registry (ops take no Python
objects).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Protocol

import torch
from torch import Tensor

from dtrec.ops.lookup import Lookup
from dtrec.ops.op import embedding_bag_psw_backward_op, empty_pooled, lookup_forward


class _Stasher(Protocol):
    def stash(self, table_ids: list[int], lookup: Lookup, grad_out: Tensor) -> None: ...


_UPDATERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def register_updater(updater: _Stasher) -> int:
    """The key under which the compiled backward finds ``updater`` (kept weakly)."""
    key = next(_KEYS)
    _UPDATERS[key] = updater
    return key


@torch.library.custom_op("dtrec::fused_embedding_bag", mutates_args=())
def fused_embedding_bag_op(
    trigger: Tensor,
    weights: list[Tensor],
    entry_table: list[int],
    values: Tensor,
    offsets: Tensor,
    mean: list[bool],
    per_sample_weights: Tensor | None,
    check_ids: bool,
    table_ids: list[int],
    updater: int,
) -> Tensor:
    """Pooled lookup ``[B, sum D]`` whose backward stashes with updater ``updater``."""
    lookup = Lookup(weights, entry_table, values, offsets, mean, per_sample_weights)
    return lookup_forward(lookup, check_ids)


@fused_embedding_bag_op.register_fake
def _fused_embedding_bag_fake(
    trigger, weights, entry_table, values, offsets, mean, psw, check_ids, table_ids, updater
):
    return empty_pooled(weights, entry_table, offsets)


# cudagraph_unsafe: a CUDA graph replays kernels, not Python; the stash must run every step
# (inductor keeps the op out of its CUDA graphs, ``mode="reduce-overhead"``).
@torch.library.custom_op(
    "dtrec::fused_embedding_bag_stash", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,)
)
def fused_embedding_bag_stash_op(
    trigger: Tensor,
    weights: list[Tensor],
    entry_table: list[int],
    values: Tensor,
    offsets: Tensor,
    mean: list[bool],
    per_sample_weights: Tensor | None,
    grad_out: Tensor,
    table_ids: list[int],
    updater: int,
) -> Tensor:
    """Stash the lookup's backward input with the updater; returns the trigger's gradient."""
    lookup = Lookup(weights, entry_table, values, offsets, mean, per_sample_weights)
    _UPDATERS[updater].stash(table_ids, lookup, grad_out)
    return torch.empty_like(trigger)


@fused_embedding_bag_stash_op.register_fake
def _stash_fake(trigger, weights, entry_table, values, offsets, mean, psw, grad_out, *_):
    return torch.empty_like(trigger)


torch.fx.node.has_side_effect(torch.ops.dtrec.fused_embedding_bag_stash.default)


def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    trigger, weights, entry_table, values, offsets, mean, psw, _, table_ids, updater = inputs
    ctx.save_for_backward(trigger, values, offsets, psw, *weights)
    ctx.entry_table, ctx.mean, ctx.table_ids, ctx.updater = entry_table, mean, table_ids, updater


def _backward(ctx, grad_out):  # type: ignore[no-untyped-def]
    trigger, values, offsets, psw, *weights = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    grad_trigger = fused_embedding_bag_stash_op(
        trigger, weights, ctx.entry_table, values, offsets, ctx.mean, psw, grad_out,
        ctx.table_ids, ctx.updater,
    )  # fmt: skip
    grad_psw = None
    if ctx.needs_input_grad[6]:  # w.r.t. the rows read now, before the update changes them
        grad_psw = embedding_bag_psw_backward_op(
            weights, ctx.entry_table, values, offsets, grad_out
        ).to(psw.dtype)
    grads = [None] * len(weights)
    return grad_trigger, grads, None, None, None, None, grad_psw, None, None, None


fused_embedding_bag_op.register_autograd(_backward, setup_context=_setup_context)


# The sequence lookup of a one-rank world (``ShardedEmbeddingCollection``): rows, not sums.
# Eager's ``_PackedGather`` (``lookup/sequence.py``) is an ``autograd.Function`` with the
# same Python side effect in its backward; these two ops are its traceable twin.


def _feature_ids(values: Tensor, counts: Tensor) -> list[Tensor]:
    """The batch's ids split per feature (``counts``: ids per feature; read on the host
    inside the op, at run time)."""
    return list(values.split(counts.tolist()))


@torch.library.custom_op("dtrec::fused_embedding_rows", mutates_args=())
def fused_embedding_rows_op(
    trigger: Tensor,
    weights: list[Tensor],
    feature_table: list[int],
    values: Tensor,
    counts: Tensor,
    check_ids: bool,
    table_ids: list[int],
    updater: int,
) -> Tensor:
    """``[ids, max D]``: each id's row of its feature's table ``weights[feature_table[k]]``
    (``counts[k]`` ids per feature, feature after feature), zero-padded to the widest
    table; the backward stashes the rows' gradients with updater ``updater``.
    ``check_ids``: IndexError for an id outside its table, before any update."""
    width = max(w.shape[1] for w in weights)
    out = weights[0].new_zeros(values.numel(), width)
    first = 0
    for ids, u in zip(_feature_ids(values, counts), feature_table, strict=True):
        n = ids.numel()
        if n:  # bags of one id: the pooled lookup (and its id check) returns the rows
            lookup = Lookup([weights[u]], [0], ids, torch.arange(n + 1, device=ids.device), [False])
            out[first : first + n, : weights[u].shape[1]] = lookup_forward(lookup, check_ids)
        first += n
    return out


@fused_embedding_rows_op.register_fake
def _fused_embedding_rows_fake(trigger, weights, feature_table, values, counts, *_):
    return weights[0].new_empty(values.shape[0], max(w.shape[1] for w in weights))


@torch.library.custom_op(
    "dtrec::fused_embedding_rows_stash", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,)
)
def fused_embedding_rows_stash_op(
    trigger: Tensor,
    weights: list[Tensor],
    feature_table: list[int],
    values: Tensor,
    counts: Tensor,
    grad: Tensor,
    table_ids: list[int],
    updater: int,
) -> Tensor:
    """Stash each table's ids (bags of one id, its features in order) and their rows'
    gradients with the updater, as eager's sequence lookup does; returns the trigger's
    gradient."""
    ids, grads = [[] for _ in weights], [[] for _ in weights]
    rows = grad.split(counts.tolist())
    for feature_ids, g, u in zip(_feature_ids(values, counts), rows, feature_table, strict=True):
        ids[u].append(feature_ids)
        grads[u].append(g[:, : weights[u].shape[1]])
    for u, weight in enumerate(weights):
        table_ids_u = torch.cat(ids[u]) if ids[u] else values[:0]
        g = torch.cat(grads[u]) if grads[u] else grad.new_zeros(0, weight.shape[1])
        n = table_ids_u.numel()
        offsets = torch.arange(n + 1, device=values.device)
        if n == 0:  # one empty bag: the table still joins its gradient sync
            offsets, g = offsets.new_zeros(2), g.new_zeros(1, weight.shape[1])
        lookup = Lookup([weight], [0], table_ids_u, offsets, [False])
        _UPDATERS[updater].stash([table_ids[u]], lookup, g.contiguous())
    return torch.empty_like(trigger)


@fused_embedding_rows_stash_op.register_fake
def _rows_stash_fake(trigger, *_):
    return torch.empty_like(trigger)


torch.fx.node.has_side_effect(torch.ops.dtrec.fused_embedding_rows_stash.default)


def _rows_setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    trigger, weights, feature_table, values, counts, _, table_ids, updater = inputs
    ctx.save_for_backward(trigger, values, counts, *weights)
    ctx.feature_table, ctx.table_ids, ctx.updater = feature_table, table_ids, updater


def _rows_backward(ctx, grad):  # type: ignore[no-untyped-def]
    trigger, values, counts, *weights = ctx.saved_tensors
    grad_trigger = fused_embedding_rows_stash_op(
        trigger, weights, ctx.feature_table, values, counts, grad.contiguous(),
        ctx.table_ids, ctx.updater,
    )  # fmt: skip
    return grad_trigger, [None] * len(weights), None, None, None, None, None, None


fused_embedding_rows_op.register_autograd(_rows_backward, setup_context=_rows_setup_context)
