"""Every private torch API dtrec uses, each behind one small named function.

A torch upgrade that moves or changes one of these breaks here, and
``tests/test_torch_compat.py`` calls each wrapper for real so it fails loudly in
one place. Each wrapper names the torch versions it was checked against.
It is the lowest layer of dtrec (``tests/test_layering.py``): it imports no dtrec module.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

# --------------------------------------------------------------------------- process groups


def init_fake_process_group(rank: int, world_size: int) -> None:
    """Initialise torch's fake process group (no communication) as ``rank`` of ``world_size``.

    For single-process simulation of a large world (planner dry runs, tests). The
    "fake" backend is only registered by importing a module under
    ``torch.testing._internal``; the store is the public in-memory ``HashStore``
    (the fake backend never reads it). Checked: torch 2.13.
    """
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)


def default_store() -> dist.Store:
    """The default process group's key-value store (``_get_default_store``). Checked: torch 2.13."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


# --------------------------------------------------------------------------- device mesh


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced, flattened or concatenated from (itself if none).

    Checked: torch 2.13 (``DeviceMesh._get_root_mesh``).
    """
    return mesh._get_root_mesh()


def flatten_mesh_dims(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh``'s dims merged into one 1-D mesh called ``name`` (``DeviceMesh._flatten``).

    The flattened dim is registered on the root mesh, so its process groups are
    created once. Collective. Checked: torch 2.13.
    """
    return mesh._flatten(name)


def unflatten_mesh_dim(
    mesh: DeviceMesh, dim: str, sizes: Sequence[int], names: Sequence[str]
) -> DeviceMesh:
    """``mesh`` with its dim ``dim`` split into dims of ``sizes`` called ``names``, over the
    same root (``DeviceMesh._unflatten``; creates the new dims' process groups:
    collective). Checked: torch 2.13."""
    return mesh._unflatten(dim, tuple(sizes), tuple(names))


def concatenate_meshes(meshes: Sequence[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dims are those of ``meshes`` (all from one root), reusing their
    process groups (``DeviceMesh._concatenate``; no collective). Checked: torch 2.13."""
    return DeviceMesh._concatenate(list(meshes))


def composable_state_count() -> int:
    """How many modules hold a composable state (``fully_shard`` registers its
    ``FSDPState`` on each module it is applied to: ``_composable_state._insert_module_state``
    into ``_module_state_mapping``, a WeakKeyDictionary): grows when ``fully_shard`` runs.
    O(1). Checked: torch 2.13."""
    from torch.distributed import _composable_state

    return len(_composable_state._module_state_mapping)


def fsdp_managed(module: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` manages ``module``'s parameters (the flag FSDP2 sets on every
    module it manages for Dynamo, ``_is_fsdp_managed_module``). Checked: torch 2.13."""
    return bool(getattr(module, "_is_fsdp_managed_module", False))


# --------------------------------------------------------------------------- autograd


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward pass ends (the autograd engine's
    ``queue_callback``; must be called during backward). Checked: torch 2.13."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def traced_broadcast_(
    tensors: Sequence[Tensor], src: int, group: dist.ProcessGroup | None = None
) -> None:
    """Copy rank ``src``'s ``tensors`` into every rank's over ``group`` (None: the
    default group), as ops
    ``torch.compile`` traces (functional collectives, one per tensor; only under compile:
    eager coalesces them). Checked: torch 2.13
    (``torch.distributed._functional_collectives.broadcast``)."""
    from torch.distributed import _functional_collectives as funcol

    for t in tensors:
        t.copy_(funcol.broadcast(t, src, group if group is not None else dist.group.WORLD))


def current_backward_id() -> int:
    """The id of the autograd graph task running now (-1 outside backward): tells one
    ``backward()`` from the next (``torch._C._current_graph_task_id``). Checked: torch 2.13."""
    return int(torch._C._current_graph_task_id())


# --------------------------------------------------------------------------- DTensor internals


def dtensor_op_handlers() -> MutableMapping[Any, Callable[..., object]]:
    """DTensor's table of ops it hands to a handler instead of a sharding strategy
    (``DTensor._op_dispatcher._custom_op_handlers``; handlers get
    ``(op_call, args, kwargs)``). Checked: torch 2.13."""
    return DTensor._op_dispatcher._custom_op_handlers


def implicit_replication_enabled() -> bool:
    """Whether plain tensors mixed with DTensors count as replicated right now (inside
    ``torch.distributed.tensor.experimental.implicit_replication()``). Checked: torch 2.13."""
    return bool(DTensor._op_dispatcher._allow_implicit_replication)


def op_argument_names(op: torch._ops.OpOverload) -> list[str]:
    """The argument names of an op overload's schema (``OpOverload._schema``). Checked:
    torch 2.13."""
    return [a.name for a in op._schema.arguments]


def contiguous_dtensor(
    local: Tensor, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int]
) -> DTensor:
    """A DTensor of global ``shape`` (contiguous strides) around this rank's ``local``,
    without ``from_local``'s autograd node or checks (DTensor's private constructor,
    ``DTensorSpec``, ``TensorMeta``). For op handlers, which run below autograd.
    Checked: torch 2.13."""
    import torch._prims_common

    size = torch.Size(shape)
    return dtensor_with_layout(
        local, mesh, placements, size, torch._prims_common.make_contiguous_strides_for(size)
    )


def dtensor_with_layout(
    local: Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int],
    stride: Sequence[int],
) -> DTensor:
    """A DTensor of global ``shape`` and ``stride`` around this rank's ``local`` (DTensor's
    private constructor, for op handlers, which run below autograd). Checked: torch 2.11,
    2.13."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=meta)
    return DTensor(local, spec, requires_grad=False)


def local_block(value: DTensor) -> Tensor:
    """This rank's block of ``value``, without ``to_local``'s autograd node and Python
    dispatch (``DTensor._local_tensor``): for gradient bookkeeping under ``no_grad`` and
    for op handlers, which run below autograd. Checked: torch 2.11, 2.13."""
    return value._local_tensor


def grad_hook_count(t: Tensor) -> int:
    """Hooks on ``t``'s gradient: ``register_hook`` ones and post-accumulate-grad ones
    (``Tensor._backward_hooks``, ``Tensor._post_accumulate_grad_hooks``). Checked: torch
    2.11, 2.13."""
    return len(t._backward_hooks or ()) + len(t._post_accumulate_grad_hooks or ())


def dtensor_like(local: Tensor, like: DTensor) -> DTensor:
    """``local`` as a DTensor sharing ``like``'s spec object (mesh, placements, global shape
    and stride): for a gradient or a state with its parameter's layout, where ``local``
    has the shape and strides of ``like``'s block. The cheapest wrapper there is (no new
    spec), and layout checks see the very same spec. Checked: torch 2.11, 2.13."""
    block = like._local_tensor
    if local.shape != block.shape or local.stride() != block.stride():
        raise ValueError(
            f"a block of shape {tuple(local.shape)} and strides {local.stride()} cannot take "
            f"the layout of one of shape {tuple(block.shape)} and strides {block.stride()}"
        )
    return DTensor(local, like._spec, requires_grad=False)


def move_to_mesh(value: DTensor, mesh: DeviceMesh) -> None:
    """Put the replicated ``value`` on ``mesh`` in place: same object, same local tensor,
    a spec with ``mesh`` (``DTensor._spec``), so everything holding it (an optimizer's
    param group and state keys, gradient hooks) goes on. For a value replicated over
    every dim of both meshes, which hold the same whole tensor on every rank. Checked:
    torch 2.13."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    spec = value._spec
    if not all(isinstance(p, Replicate) for p in spec.placements):
        raise ValueError(f"only a replicated DTensor moves meshes in place, got {spec}")
    value._spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tensor_meta=spec.tensor_meta)


def same_dtensor_layout(a: DTensor, b: DTensor) -> bool:
    """Whether ``a`` and ``b`` have one mesh, one placement per mesh dim and one global
    shape, so their blocks line up element by element (``DTensor._spec``). Checked: torch
    2.13."""
    sa, sb = a._spec, b._spec
    return sa is sb or (
        (sa.mesh is sb.mesh or sa.mesh == sb.mesh)
        and sa.placements == sb.placements
        and a.shape == b.shape
    )


def picklable_dtensor(value: DTensor) -> DTensor:
    """``value`` (same local tensor, same spec, no copy) in a wrapper that ``torch.save``
    can pickle.

    DTensor's constructor gives the wrapper its local tensor's storage offset. A local
    tensor that views a packed buffer at a non-zero offset then makes the wrapper's
    ``data_ptr()`` non-zero, so ``Tensor.__reduce_ex__`` takes the plain-tensor path and
    reads the wrapper's storage, which has no data: "Attempted to access the data pointer
    on an invalid python storage". A wrapper built with offset 0
    (``Tensor._make_wrapper_subclass``, as DTensor's own constructor did in earlier
    torch) pickles as any DTensor: its ``_local_tensor`` and ``_spec``; ``torch.load``
    (weights_only too) rebuilds it. Checked: torch 2.13.
    """
    if value.storage_offset() == 0:
        return value
    wrapper = Tensor._make_wrapper_subclass(
        type(value),
        value.shape,
        strides=value.stride(),
        storage_offset=0,
        dtype=value.dtype,
        device=value.device,
        layout=value.layout,
        requires_grad=value.requires_grad,
    )
    wrapper._spec = value._spec
    wrapper._local_tensor = value._local_tensor
    return wrapper


def local_shape_and_offset(
    global_shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's shard shape and its offset in the global tensor under ``placements``
    (``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``).
    Checked: torch 2.13."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(global_shape, mesh, list(placements))
    return tuple(shape), tuple(offset)


# --------------------------------------------------------------------------- ShardedTensor


def is_sharded_tensor(value: object) -> bool:
    """Whether ``value`` is a ``torch.distributed._shard.sharded_tensor.ShardedTensor`` (what
    TorchRec's sharded modules put in their state dicts). Checked: torch 2.13."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(value, ShardedTensor)


def shard_index(shard: Any) -> tuple[slice, ...]:
    """Where a ShardedTensor's local ``Shard`` sits in the full tensor (its metadata's
    offsets and sizes, one slice per dim). Checked: torch 2.13."""
    meta = shard.metadata
    return tuple(slice(o, o + n) for o, n in zip(meta.shard_offsets, meta.shard_sizes, strict=True))


def sharded_tensor_full(value: Tensor) -> Tensor:
    """A ShardedTensor assembled into a full tensor on every rank of its process group.

    Each rank writes its local shards at their offsets into zeros and the group
    all-reduces the sum (shards of one ShardedTensor never overlap). Collective over the
    tensor's own group (``ShardedTensor._process_group``). Checked: torch 2.13.
    """
    shards = value.local_shards()
    dtype = shards[0].tensor.dtype if shards else value.dtype
    full = torch.zeros(tuple(value.size()), dtype=dtype)
    for shard in shards:
        full[shard_index(shard)] = shard.tensor.detach().to("cpu", dtype)
    group = value._process_group
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        device = shards[0].tensor.device if shards else torch.device("cpu")
        moved = full.to(device)
        dist.all_reduce(moved, group=group)
        full = moved.cpu()
    return full


# --------------------------------------------------------------------------- foreach kernels


def foreach_norm(tensors: Sequence[Tensor], ord: float, dtype: torch.dtype | None) -> list[Tensor]:
    """Each tensor's ``ord``-norm in one multi-tensor kernel (``torch._foreach_norm``, what
    ``clip_grad_norm_`` runs). Checked: torch 2.11, 2.13."""
    return list(torch._foreach_norm(list(tensors), ord, dtype=dtype))


def foreach_mul_(tensors: Sequence[Tensor], scalar: Tensor) -> None:
    """Every tensor times one 0-dim ``scalar``, in place, one multi-tensor kernel
    (``torch._foreach_mul_``). Checked: torch 2.11, 2.13."""
    torch._foreach_mul_(list(tensors), scalar)


def foreach_copy_(into: Sequence[Tensor], values: Sequence[Tensor]) -> None:
    """``into[i].copy_(values[i])`` for every i, one multi-tensor kernel where the device
    has one (``torch._foreach_copy_``). Checked: torch 2.11, 2.13."""
    torch._foreach_copy_(list(into), list(values))


# --------------------------------------------------------------------------- tracing


def check_split_sizes(sizes: Sequence[int], total: int) -> None:
    """Tell ``torch.compile`` that ``sizes`` (read on the host, unbacked while tracing) are
    >= 0 and add up to ``total``, so splitting a tensor of ``total`` rows by them traces
    (``torch._check``; a plain assert in eager). Checked: torch 2.11, 2.13."""
    for n in sizes:
        torch._check(n >= 0)
    torch._check(sum(sizes) == total)
