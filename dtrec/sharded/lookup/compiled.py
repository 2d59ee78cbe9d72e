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
