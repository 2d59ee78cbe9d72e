"""Dense parameters as DTensors replicated over the mesh, gradients averaged like DDP.

Why: torch's optimizers default to their ``foreach`` kernels on CUDA (and take
``fused=True``), and those refuse a parameter list that mixes DTensors (the tables)
with plain tensors. So every parameter ``distribute_module`` leaves outside the sharded
collections becomes a DTensor with ``Replicate()`` on every dim of the model's mesh
(the mesh of the row-, column-wise and data-parallel tables: ``clip_grad_norm_`` and
the optimizers then see one mesh in the common case), the way torch's composable APIs
make every parameter a DTensor. State-dict keys do not change; a plain tensor loads
into them (checkpoints from before, the unsharded model's state dict).

* **Forward.** The module code keeps seeing plain tensors: before the model's forward,
  each parameter's *leaf* is put in its module's ``__dict__``, where attribute lookup
  finds it before nn.Module's ``_parameters``; after the forward it is removed again. A
  leaf is a plain tensor that requires grad and shares the parameter's local storage, so
  backward accumulates a plain gradient into it with no DTensor in the way (DTensor's
  ``to_local`` backward and gradient accumulation cost more host time than the dense
  math of a DLRM step, issue 30); one hook before the accumulation hands it the
  parameter's current ``.grad`` (so ``zero_grad`` and gradient accumulation behave as
  on the parameter), one after wraps the sum as the parameter's ``.grad`` (a DTensor with
  the parameter's layout, no copy). A parameter with hooks of its own on its gradient
  (``register_hook``, ``register_post_accumulate_grad_hook``, torch's in-backward
  optimizers) is read through its differentiable ``to_local()`` instead, so those hooks
  run. A module called on its own
  (or re-run by activation checkpointing in backward) installs views of its own
  parameters the same way. Buffers stay plain tensors and are broadcast from rank 0
  before every forward, as DDP does.
* **Backward.** Once a parameter's gradient is accumulated, a hook marks it ready;
  parameters are bucketed (DDP's 25 MiB cap, 1 MiB first bucket, reverse registration
  order, which is roughly the order backward produces them), and a bucket whose
  parameters are all ready starts one asynchronous all-reduce over the world, in bucket
  order on every rank, so the exchange overlaps the rest of backward. A bucket is one
  flat buffer: its gradients concatenated, divided by W once (as DDP divides before the
  sum), and one count per parameter of the ranks that had a gradient; when backward
  ends, the remaining buckets are sent and one foreach copy per bucket writes the
  averages back (a handful of launches per bucket, not a few per parameter). A
  parameter no rank used keeps ``grad None`` (as in the unsharded model), one that some
  rank used gets the average on every rank. In a world of one rank there is nothing to
  average: no hook, no bucket, no collective.

Every rank's backward must reach at least one dense parameter (as with DDP without
``find_unused_parameters``); the all-reduces are plain c10d ones through ``dtrec.comm``
(``comm_stats`` kind ``dense.grad_sync``), which every backend supports on every device.
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from dtrec._torch_compat import (
    current_backward_id,
    dtensor_like,
    dtensor_with_layout,
    foreach_copy_,
    grad_hook_count,
    local_block,
    queue_backward_callback,
    traced_broadcast_,
)
from dtrec.comm.collectives import all_reduce_start, broadcast_coalesced, first_rank
from dtrec.sharded.dense_buckets import Bucket, make_buckets
from dtrec.sharded.dense_fsdp import bridge_fsdp_modules, taken_over, takeover_signature

KIND = "dense.grad_sync"


class ReplicatedDense:
    """The dense parameters of one distributed model: their views, hooks and buckets.

    Built by ``dense_setup.replicate_dense``; kept in the model's ``DistributedState``.
    """

    def __init__(
        self,
        root: nn.Module,
        mesh: DeviceMesh,
        owners: dict[int, list[tuple[nn.Module, str]]],
        params: list[nn.Parameter],
        buffers: list[tuple[nn.Module, str]],
        aliases: dict[int, list[tuple[nn.Module, Any, Any]]] | None = None,
        group: ProcessGroup | None = None,
    ) -> None:
        self.mesh = mesh
        self.group = group  # the ranks gradients are averaged over (None: the world)
        # id(param) -> [(module, container, key)]: a dict / list attribute of a module that
        # holds the parameter too (TorchRec's PositionWeightedModuleCollection keeps
        # position_weights_dict beside its ParameterDict); it gets the views as well
        self._aliases = aliases or {}
        self._root = root
        self._owners = owners  # id(param) -> [(module, attribute)], shared params listed twice
        self._params = params
        self._buffers = buffers
        self._in_root = False
        self._backward: int | None = None
        self._next = 0
        self._bridged: set[int] = set()  # ids of the FSDP modules ``dense_fsdp`` hooked
        self._hook_params()
        root.register_forward_pre_hook(self._root_pre_forward, prepend=True)
        root.register_forward_hook(self._root_post_forward, always_call=True)
        root._register_load_state_dict_pre_hook(self._load_pre_hook, with_module=True)
        holders = [m for places in owners.values() for m, _ in places]
        holders += [m for places in self._aliases.values() for m, _, _ in places]
        for module in {id(m): m for m in holders}.values():
            if module is not root:
                module.register_forward_pre_hook(self._module_pre_forward, prepend=True)
                module.register_forward_hook(self._module_post_forward, always_call=True)

    def _hook_params(self) -> None:
        """Buckets of the parameters that train (none in a world of one rank: its gradients
        are the averages); leaves and their hooks are made at the first forward, the
        parameters' bucket hooks now."""
        self._rebucket()
        self._leaves: dict[int, Tensor] = {}  # id(param) -> its plain leaf
        self._hooked: set[int] = set()  # id(param) of those dtrec put its one hook on
        self._checked: tuple[int, int] | None = None  # takeover_signature() at the last check
        # Hooked now, not at a first forward: a compiled forward reads ``to_local()`` (its
        # gradient then arrives on the parameter) and cannot register hooks in the graph;
        # an eager forward reads the leaf, which never fires the parameter's own hooks.
        for p in self._params:
            if id(p) in self._slot:
                p.register_post_accumulate_grad_hook(self._grad_ready)
                self._hooked.add(id(p))

    def _rebucket(self) -> None:
        trained = [p for p in self._params if p.requires_grad]
        self._buckets = make_buckets(trained) if dist.get_world_size(self.group) > 1 else []
        self._slot = {id(p): b for b, bucket in enumerate(self._buckets) for p in bucket.params}

    def _release_taken_over(self) -> None:
        """Leave the parameters FSDP took over to it (``dtrec.sharded.dense_fsdp``); checked
        again only when ``takeover_signature`` says a parameter may have changed hands."""
        signature = takeover_signature()
        if signature == self._checked:
            return
        gone = taken_over(self._root, self._params, self._owners)
        self._checked = signature
        if not gone:
            return
        holders = [m for i in gone for m, _ in self._owners[i]]
        bridge_fsdp_modules(self._root, holders, self.mesh, self._bridged)
        self._params = [p for p in self._params if id(p) not in gone]
        for i in gone:
            del self._owners[i]
            self._aliases.pop(i, None)
            self._leaves.pop(i, None)
        self._rebucket()

    # ------------------------------------------------------------------ forward

    def _input(self, p: nn.Parameter) -> Tensor:
        """What the module code reads for ``p``: its plain leaf, or ``to_local()`` when the
        parameter has gradient hooks of its own, or under ``torch.compile`` (which traces
        ``to_local`` and cannot trace the leaf's storage check: ``docs/compile.md``)."""
        if torch.compiler.is_compiling():
            return p.to_local()
        if grad_hook_count(p) > (id(p) in self._hooked):
            return p.to_local()  # its gradient arrives on p (``_hook_params``)
        local = local_block(p)
        leaf = self._leaves.get(id(p))
        if (
            leaf is None
            or leaf.data_ptr() != local.data_ptr()
            or leaf.shape != local.shape
            or leaf.dtype != local.dtype
            or leaf.requires_grad != p.requires_grad
        ):  # first forward, or the parameter's storage was replaced
            leaf = local.detach().requires_grad_(p.requires_grad)
            if p.requires_grad:
                leaf.register_hook(functools.partial(_take_param_grad, p, leaf))
                leaf.register_post_accumulate_grad_hook(functools.partial(self._leaf_ready, p))
            self._leaves[id(p)] = leaf
        return leaf

    def _leaf_ready(self, p: nn.Parameter, leaf: Tensor) -> None:
        """A leaf's gradient is accumulated: it becomes ``p.grad`` (no copy)."""
        grad = leaf.grad
        if grad is not None and (p.grad is None or local_block(p.grad) is not grad):
            p.grad = _grad_like(grad, p)
        if self._slot:
            self._grad_ready(p)

    def _views(self, only: nn.Module | None = None) -> None:
        """Put each parameter's plain input where its module's code reads it."""
        if not torch.compiler.is_compiling():
            self._release_taken_over()
        for p in self._params:
            local = self._input(p)
            for module, name in self._owners[id(p)]:
                if only is None or module is only:
                    module.__dict__[name] = local
            for module, container, key in self._aliases.get(id(p), ()):
                if only is None or module is only:
                    container[key] = local

    def _unviews(self, only: nn.Module | None = None) -> None:
        for places in self._owners.values():
            for module, name in places:
                if only is None or module is only:
                    module.__dict__.pop(name, None)
        for p in self._params:
            for module, container, key in self._aliases.get(id(p), ()):
                if only is None or module is only:
                    container[key] = p

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        self._sync_buffers()
        self._views()
        self._in_root = True

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._in_root = False
        self._unviews()

    def _module_pre_forward(self, module: nn.Module, args: Any) -> None:
        if not self._in_root:  # called on its own, or re-run by activation checkpointing
            self._views(module)

    def _module_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._in_root:
            self._unviews(module)

    def _sync_buffers(self) -> None:
        """Rank 0's buffers on every rank (DDP's ``broadcast_buffers``); one broadcast."""
        tensors = [getattr(m, n) for m, n in self._buffers]
        tensors = [t for t in tensors if isinstance(t, Tensor)]
        if tensors and dist.get_world_size(self.group) > 1:
            first = first_rank(self.group)
            if torch.compiler.is_compiling():  # traced: no graph break (docs/compile.md)
                traced_broadcast_(tensors, first, self.group)
            else:
                broadcast_coalesced(tensors, first, self.group, "dense.buffers")

    # ------------------------------------------------------------------ backward

    def _grad_ready(self, param: Tensor) -> None:
        backward = current_backward_id()
        if backward != self._backward:
            self._start_backward(backward)
        bucket_id = self._slot.get(id(param))
        if bucket_id is None:  # released to FSDP (``_release_taken_over``)
            return
        bucket = self._buckets[bucket_id]
        bucket.ready.add(id(param))
        while self._next < len(self._buckets):
            nxt = self._buckets[self._next]
            if len(nxt.ready) < sum(p.requires_grad for p in nxt.params):
                break
            self._launch(nxt)
            self._next += 1

    def _start_backward(self, backward: int) -> None:
        if any(b.pending is not None or b.ready for b in self._buckets):
            warnings.warn(
                "dtrec: a backward raised before it ended; the dense gradients of that "
                "backward were not averaged and are dropped from the sync",
                stacklevel=3,
            )
            for b in self._buckets:
                if b.pending is not None:
                    b.pending.wait()
                b.pending, b.ready = None, set()
        self._backward, self._next = backward, 0
        queue_backward_callback(self._finish)

    def _launch(self, bucket: Bucket) -> None:
        with torch.no_grad():
            flat = bucket.flat_gradients(dist.get_world_size(self.group))
        bucket.pending = all_reduce_start(flat, self.group, KIND)

    def _finish(self) -> None:
        """End of backward: send the buckets not yet sent, then write the averages."""
        while self._next < len(self._buckets):
            self._launch(self._buckets[self._next])
            self._next += 1
        with torch.no_grad():
            for bucket in self._buckets:
                assert bucket.pending is not None
                flat = bucket.pending.wait()
                bucket.pending, bucket.ready = None, set()
                means = flat[: bucket.numel].split(bucket.sizes)
                # counts are read (a host sync) only if this rank lacked some gradient
                counts = flat[bucket.numel :].tolist() if bucket.missing else None
                into, values = [], []
                for i, (p, mean) in enumerate(zip(bucket.params, means, strict=True)):
                    if p.grad is not None:
                        into.append(local_block(p.grad))
                        values.append(mean.view(p.shape))
                    elif counts is not None and counts[i] > 0:  # used elsewhere: the average
                        p.grad = _grad_like(mean.to(p.dtype), p)
                    # else no rank used it: grad stays None everywhere
                if into:
                    foreach_copy_(into, values)
        self._backward = None

    # ------------------------------------------------------------------ copies

    def __deepcopy__(self, memo: dict[int, Any]) -> ReplicatedDense:
        """The copy of a model gets its own gradient hooks on its own parameters (a
        Parameter's deepcopy carries none); its module hooks are this object's bound
        methods, copied with the modules; the mesh is shared."""
        new = ReplicatedDense.__new__(ReplicatedDense)
        memo[id(self)] = new  # first: copying the modules copies their hooks, bound to new
        new.mesh, new.group = self.mesh, self.group
        new._root = copy.deepcopy(self._root, memo)
        new._params = [copy.deepcopy(p, memo) for p in self._params]
        new._owners = {
            id(p): [(copy.deepcopy(m, memo), n) for m, n in self._owners[id(old)]]
            for old, p in zip(self._params, new._params, strict=True)
        }
        new._buffers = [(copy.deepcopy(m, memo), n) for m, n in self._buffers]
        new._aliases = {
            id(p): [(copy.deepcopy(m, memo), copy.deepcopy(c, memo), k)
                    for m, c, k in self._aliases.get(id(old), ())]
            for old, p in zip(self._params, new._params, strict=True)
        }  # fmt: skip
        new._in_root, new._backward, new._next, new._bridged = False, None, 0, set()
        new._hook_params()
        return new

    # ------------------------------------------------------------------ loading

    def _load_pre_hook(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        """A plain tensor (or a replicated DTensor of another mesh) for a dense parameter
        is wrapped as this mesh's replicated DTensor, so the module's ``copy_`` sees one
        mesh (DTensor refuses to copy a plain tensor into a DTensor): checkpoints from
        before dense parameters were DTensors and the unsharded model's state dict load."""
        dense = {id(p) for p in self._params}
        for name, target in module.named_parameters(
            prefix=prefix.rstrip("."), remove_duplicate=False
        ):
            value = state_dict.get(name)
            if id(target) not in dense or not isinstance(value, Tensor):
                continue
            if isinstance(value, DTensor):
                if not all(isinstance(p, Replicate) for p in value.placements):
                    continue  # another layout: DTensor's copy_ redistributes it
                value = value.to_local()
            state_dict[name] = as_replicated_dtensor(value.detach().to(target.device), self.mesh)


def _grad_like(local: Tensor, like: DTensor) -> DTensor:
    """``local`` (this rank's whole gradient of the replicated ``like``) as a DTensor with
    ``like``'s layout, no copy and no autograd node."""
    local = local.view(like.shape)
    if local.stride() == local_block(like).stride():
        return dtensor_like(local, like)
    return dtensor_with_layout(local, like.device_mesh, like.placements, like.shape, local.stride())


def _take_param_grad(p: nn.Parameter, leaf: Tensor, grad: Tensor) -> None:
    """Before a leaf's gradient is accumulated: the leaf holds ``p.grad``'s block (None
    after ``zero_grad()``, the running sum when gradients accumulate over backward calls,
    whatever a user put there)."""
    current = local_block(p.grad) if p.grad is not None else None
    if leaf.grad is not current:
        leaf.grad = current


def as_replicated_dtensor(value: Tensor, mesh: DeviceMesh) -> DTensor:
    """A tensor the same on every rank as a DTensor replicated over ``mesh`` (no copy)."""
    return DTensor.from_local(
        value, mesh, [Replicate()] * mesh.ndim, shape=value.shape, stride=value.stride(),
        run_check=False,
    )  # fmt: skip
