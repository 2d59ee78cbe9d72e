"""DTensor op handlers dtrec installs for torch's own ops, each for a case DTensor gets
wrong or refuses on dtrec's tables. Installed by ``distribute_module`` (idempotent).

* ``new_empty_strided`` keeps an unevenly sharded input's placements. Autograd's
  gradient accumulation calls it (``clone_obey_contract``) whenever it cannot take the
  incoming gradient as is (it is referenced elsewhere, as on CUDA's device threads, or
  by a user's hook); torch 2.11 answers ``Replicate()`` for uneven shards (most tables:
  rows or columns rarely divide by the shard count), so the next ``copy_`` all-gathers
  every uneven table's gradient in backward: a functional all-gather, which gloo does
  not run on CUDA tensors (the segfault of the one-GPU gloo worlds), and a gradient
  no longer sharded like its weight. torch 2.13 already keeps the placements.
* every ``_foreach_*`` op (what torch's optimizers run by default on CUDA): DTensor
  computes a foreach op only on the ranks of its *first* tensor's mesh, so on a rank
  outside a table-wise table's sub-mesh, a parameter list that starts with that table
  updates nothing at all, the dense parameters included (silently). Here the lists are
  rotated so that a tensor on one of this rank's meshes comes first; a rank holds an
  empty block of every other tensor, where the op does nothing.
  When every DTensor of the op shares one layout (the common case: a dense parameter
  group, its gradients and its state, all replicated on the model's mesh) and the op is
  elementwise, the op runs once on the local blocks (``_foreach_on_blocks``), without
  DTensor's sharding propagation: an optimizer step then costs what it costs on plain
  tensors (the host time of a step is the bottleneck on a GPU, issue 30).
* ``_foreach_norm`` of DTensors on several meshes: DTensor computes them all on the first
  tensor's mesh, so a rank outside it gets zeros for every tensor (silently wrong
  norms). Here: per (mesh, placements) group, DTensor's own rule on the first tensor
  gives the output placements, the others are the local foreach norm with those.
* ``stack`` of 0-dim DTensors on different meshes (a table-wise table's sub-mesh, the
  node-aware meshes of table-row-wise and grid, the model's mesh) gives their global
  values, the same on every rank, as a plain tensor, where DTensor raises "must have the
  same mesh". That is the one step of ``torch.nn.utils.clip_grad_norm_`` /
  ``get_total_norm`` that mixes the parameters' meshes (they stack per-parameter norms);
  with a plain total norm its clipping ``mul_`` works on every mesh, and
  ``_foreach_mul_`` of blocks on several meshes by one replicated scalar multiplies each
  rank's blocks (DTensor would put the scalar on the first tensor's mesh and refuse the
  others). Each scalar is
  reduced over its own mesh's partial dims and counted once per replica set, with one
  world all-reduce (two for max/min partials), so ranks outside a sub-mesh (where DTensor
  computes nothing) get the right value too. Every rank must stack the same list (every
  rank has every parameter's ``.grad``: ``ShardedCollection`` gives a table this rank
  holds no block of an empty one).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from dtrec._torch_compat import (
    contiguous_dtensor,
    dtensor_like,
    dtensor_op_handlers,
    dtensor_with_layout,
    foreach_mul_,
    foreach_norm,
    local_block,
    same_dtensor_layout,
)
from dtrec.comm.collectives import all_reduce

aten = torch.ops.aten


def register_dtensor_handlers() -> None:
    """Install the handlers above (idempotent)."""
    handlers = dtensor_op_handlers()
    for op in _foreach_ops():
        handlers.setdefault(op, _foreach_on_own_mesh)
    for name in ("_fused_sgd_", "_fused_adam_", "_fused_adamw_", "_fused_adagrad_"):
        packet = getattr(aten, name, None)
        for overload in packet.overloads() if packet is not None else ():
            handlers[getattr(packet, overload)] = _fused_step_locally
    handlers[aten.new_empty_strided.default] = _new_empty_strided
    handlers[aten.stack.default] = _stack
    handlers[aten._foreach_mul_.Tensor] = _foreach_mul_
    handlers[aten._foreach_norm.Scalar] = _foreach_norm


def _new_empty_strided(op_call: Any, args: tuple, kwargs: dict) -> DTensor:
    self, size, stride = args[0], tuple(args[1]), tuple(args[2])
    options = {k: v for k, v in kwargs.items() if v is not None}
    local = self.to_local()
    if size == tuple(self.shape) and all(
        isinstance(p, (Shard, Replicate)) for p in self.placements
    ):  # same global tensor: same placements, this rank's block shape
        out = local.new_empty_strided(local.shape, local.stride(), **options)
        return dtensor_with_layout(out, self.device_mesh, self.placements, size, stride)
    out = local.new_empty_strided(size, stride, **options)  # DTensor's own answer
    replicate = [Replicate()] * self.device_mesh.ndim
    return dtensor_with_layout(out, self.device_mesh, replicate, size, stride)


def _stack(op_call: Any, args: tuple, kwargs: dict) -> Tensor:
    tensors = list(args[0])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    meshes = {t.device_mesh for t in tensors if isinstance(t, DTensor)}
    if len(meshes) > 1 and all(t.dim() == 0 for t in tensors):
        return global_scalars(tensors)
    return torch.cat([t.unsqueeze(dim) for t in tensors], dim)  # stack, as DTensor does it


def _foreach_ops() -> list[Any]:
    """Every overload of every ``aten._foreach_*`` op."""
    ops = []
    for name in dir(aten):
        if name.startswith("_foreach_"):
            packet = getattr(aten, name)
            ops += [getattr(packet, overload) for overload in packet.overloads()]
    return ops


_default_lock = threading.RLock()


@contextmanager
def _default_dispatch(op: Any) -> Iterator[None]:
    """DTensor's own dispatch of ``op`` inside the block (its handler taken out meanwhile;
    other threads that dispatch ``op`` on DTensors then get DTensor's rule too)."""
    handlers = dtensor_op_handlers()
    with _default_lock:
        handler = handlers.pop(op, None)
        try:
            yield
        finally:
            if handler is not None:
                handlers[op] = handler


_REDUCTIONS = frozenset({"_foreach_norm", "_foreach_max"})
"""Foreach ops that are not elementwise: DTensor's rules (or the handlers below) decide."""


def _foreach_on_blocks(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """``op_call`` on this rank's blocks, or ``NotImplemented`` where that would not be the
    op on the global tensors. It is when the op is elementwise and every tensor argument
    sits in a list of DTensors, the i-th tensors of all lists of one layout (mesh,
    placements, global shape: their blocks line up element by element), none partial
    (``sqrt`` of a partial sum is not the sum of square roots), all contiguous. A rank
    outside a tensor's mesh holds an empty block of it, where the op does nothing, as
    DTensor's own rule does nothing there."""
    if op_call._opname in _REDUCTIONS or any(isinstance(v, Tensor) for v in kwargs.values()):
        return NotImplemented
    layouts: list[DTensor] | None = None  # the first tensor list: outputs take its layouts
    blocks: list[Any] = []
    for a in args:
        if isinstance(a, Tensor):
            return NotImplemented  # a tensor scalar (``_foreach_mul_.Tensor``): DTensor's rule
        if not isinstance(a, (list, tuple)) or not a or not isinstance(a[0], Tensor):
            blocks.append(a)
            continue
        if layouts is None:
            if not all(
                isinstance(t, DTensor)
                and t.is_contiguous()
                and all(isinstance(p, (Shard, Replicate)) for p in t.placements)
                for t in a
            ):
                return NotImplemented
            layouts = list(a)
        elif len(a) != len(layouts) or not all(
            isinstance(t, DTensor) and same_dtensor_layout(t, like)
            for t, like in zip(a, layouts, strict=True)
        ):
            return NotImplemented
        blocks.append([local_block(t) for t in a])
    if layouts is None:
        return NotImplemented
    out = op_call(*blocks, **kwargs)
    if out is None:  # in place (``_foreach_add_``: returns nothing)
        return None
    return [_block_as(o, t) for o, t in zip(out, layouts, strict=True)]


def _block_as(out: Tensor, like: DTensor) -> DTensor:
    """An elementwise op's output block as a DTensor laid out like its input ``like``
    (``like``'s very spec when dtype and strides agree: no new spec)."""
    block = local_block(like)
    if out.shape != block.shape:
        raise AssertionError(f"an elementwise op changed a block's shape {block.shape}")
    if out.dtype == block.dtype and out.stride() == block.stride():
        return dtensor_like(out, like)
    return contiguous_dtensor(out.contiguous(), like.device_mesh, like.placements, like.shape)


def _foreach_on_own_mesh(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """A foreach op on the local blocks where that is the op (``_foreach_on_blocks``); else
    with the tensors' order rotated so that the first DTensor is on a mesh this rank
    belongs to; results in the caller's order."""
    out = _foreach_on_blocks(op_call, args, kwargs)
    if out is not NotImplemented:
        return out
    tensors = next(a for a in args if isinstance(a, (list, tuple)) and a)
    n = len(tensors)
    shift = next(
        (
            i
            for i, t in enumerate(tensors)
            if not isinstance(t, DTensor) or t.device_mesh.get_coordinate() is not None
        ),
        0,
    )
    if shift:
        args = tuple(
            list(a[shift:]) + list(a[:shift]) if isinstance(a, (list, tuple)) and len(a) == n else a
            for a in args
        )
    with _default_dispatch(op_call):
        out = op_call(*args, **kwargs)
    if shift and isinstance(out, (list, tuple)) and len(out) == n:
        out = list(out[n - shift :]) + list(out[: n - shift])
    return out


def _fused_step_locally(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """A fused optimizer step (``fused=True``) on each rank's blocks. The step is
    elementwise per tensor and a parameter, its gradient and its state share one layout,
    so the blocks are all there is to update; DTensor has no rule for ``_fused_sgd_`` and
    ``_fused_adagrad_`` and would update only on the first tensor's mesh."""
    for lists in (a for a in args if isinstance(a, (list, tuple))):
        for t in lists:
            if isinstance(t, DTensor) and any(p.is_partial() for p in t.placements):
                raise NotImplementedError(f"{op_call}: a partial tensor {t.placements}")

    def local(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return [local(x) for x in a]
        return local_block(a) if isinstance(a, DTensor) else a

    return op_call(*[local(a) for a in args], **{k: local(v) for k, v in kwargs.items()})


def _foreach_norm(op_call: Any, args: tuple, kwargs: dict) -> list[Tensor]:
    tensors = list(args[0])
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    out: list[Tensor | None] = [None] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device_mesh, t.placements, t.dtype), []).append(i)
    for (mesh, _, _), members in groups.items():
        first = torch.linalg.vector_norm(tensors[members[0]], ord_, dtype=dtype)  # DTensor's rule
        out[members[0]] = first
        rest = members[1:]
        if not rest:
            continue
        norms = foreach_norm([tensors[i].to_local() for i in rest], ord_, dtype)
        for i, norm in zip(rest, norms, strict=True):  # same layout in, same layout out
            out[i] = dtensor_with_layout(norm, mesh, first.placements, (), ())
    return out  # type: ignore[return-value]


def _foreach_mul_(op_call: Any, args: tuple, kwargs: dict) -> None:
    tensors, scalar = list(args[0]), args[1]
    meshes = {t.device_mesh for t in tensors if isinstance(t, DTensor)}
    if isinstance(scalar, DTensor):
        plain = all(isinstance(p, Replicate) for p in scalar.placements) and meshes == {
            scalar.device_mesh
        }
        value = scalar.to_local() if plain else None
    else:
        value = scalar
    if (
        value is not None
        and value.dim() == 0
        and all(isinstance(t, DTensor) for t in tensors)
        and not any(p.is_partial() for t in tensors for p in t.placements)
    ):  # every rank's block times the same scalar, whatever mesh (or _StridedShard of
        # FSDP + TP) the block is on
        foreach_mul_([t.to_local() for t in tensors], value)
        return
    _foreach_on_own_mesh(op_call, args, kwargs)


def global_scalars(tensors: list[Tensor]) -> Tensor:
    """The global values of 0-dim tensors (DTensors on any meshes, plain tensors taken as
    equal on every rank), as one plain 1-D tensor, the same on every rank. Collective
    over the world: every rank passes the same list (a ValueError on every rank if the
    lengths differ)."""
    n = len(tensors)
    device = next(t for t in tensors if isinstance(t, DTensor)).to_local().device
    header = torch.tensor([n, -n], dtype=torch.float64, device=device)
    all_reduce(header, None, "clip_grad_norm.check", "max")
    if header.tolist() != [n, -n]:
        raise ValueError(
            f"stacking scalars from different meshes (clip_grad_norm_): rank "
            f"{dist.get_rank()} has {n} of them, the ranks have {int(-header[1])} to "
            f"{int(header[0])}; every rank must pass the same parameters, each with a .grad"
        )
    sums = torch.zeros(n, dtype=torch.float64, device=device)
    maxes = torch.full((n,), -math.inf, dtype=torch.float64, device=device)
    post: list[tuple[str, float]] = []
    for i, t in enumerate(tensors):
        kind, power, value = _contribution(t)
        post.append((kind, power))
        if value is None:
            continue
        if kind == "sum":
            sums[i] = value.double().abs() ** power if power != 1.0 else value.double()
        else:
            maxes[i] = value.double() if kind == "max" else -value.double()
    all_reduce(sums, None, "clip_grad_norm.sum")
    if any(kind != "sum" for kind, _ in post):
        all_reduce(maxes, None, "clip_grad_norm.max", "max")
    out = torch.empty(n, dtype=torch.float64, device=device)
    for i, (kind, power) in enumerate(post):
        if kind == "sum":
            out[i] = sums[i] ** (1.0 / power) if power != 1.0 else sums[i]
        else:
            out[i] = maxes[i] if kind == "max" else -maxes[i]
    return out.to(functools.reduce(torch.promote_types, [t.dtype for t in tensors]))


def _contribution(t: Tensor) -> tuple[str, float, Tensor | None]:
    """(how its values combine: "sum" / "max" / "min", the power its sum is taken in
    (p-norm partials: sum of x^p), this rank's share or None)."""
    if not isinstance(t, DTensor):
        return "sum", 1.0, t.detach() if dist.get_rank() == 0 else None
    partial = {d: p for d, p in enumerate(t.placements) if p.is_partial()}
    kinds = {(p.reduce_op, getattr(p, "norm_type", None)) for p in partial.values()}
    if len(kinds) > 1:
        raise NotImplementedError(f"stacking a scalar with mixed partial placements {t.placements}")
    op, norm = kinds.pop() if kinds else ("sum", None)
    if op not in ("sum", "max", "min"):
        raise NotImplementedError(f"stacking a scalar with a {op!r} partial placement")
    power = 1.0
    if op == "sum" and norm is not None and math.isfinite(norm) and norm != 0:
        power = float(norm)
    coord = t.device_mesh.get_coordinate()
    holds = coord is not None and all(c == 0 for d, c in enumerate(coord) if d not in partial)
    return op, power, t.to_local() if holds else None
