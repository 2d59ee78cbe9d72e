"""Dense parameters that torch's ``fully_shard`` took over after ``distribute_module``.

``distribute_module`` makes every dense parameter a DTensor ``Replicate()``d over its
mesh (``dtrec.sharded.dense``): exactly what FSDP2's SPMD-mesh mode takes,
``fully_shard(module, mesh=<that mesh>, dp_mesh_dims=DataParallelMeshDims(...))``. FSDP
then puts DTensor parameters of its own in the modules' ``_parameters``; dtrec notices
at the next forward (``taken_over``) and leaves those parameters to FSDP: no forward
view (which would shadow FSDP's unsharded parameter), no gradient bucket (FSDP's
reduce-scatter averages them over the data-parallel dims). In SPMD mode FSDP's
parameters stay DTensors during forward, so the module computes in DTensors: the
outermost FSDP modules holding such parameters take their floating-point inputs as
DTensors ``Replicate()``d over the mesh, each rank's own batch (the same convention as
dtrec's dense part: per-rank values, gradients averaged by the data-parallel sync), and
hand their DTensor outputs back as plain local tensors (``bridge_fsdp_modules``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate

from dtrec._torch_compat import composable_state_count, fsdp_managed

_registered = [0]  # parameters registered on any module since the hook below was installed
_HOOK: list[Any] = []  # that hook's handle, once installed


def _count_registration(module: nn.Module, name: str, param: Tensor) -> None:
    _registered[0] += 1


def takeover_signature() -> tuple[int, int]:
    """What changes when a dense parameter may have been taken over or replaced since the
    last ``taken_over`` check: parameters registered on any module (``setattr`` of a
    Parameter, ``register_parameter``, ``load_state_dict(assign=True)``: torch's global
    registration hook, installed at the first call) and modules ``fully_shard`` was
    applied to (FSDP writes ``_parameters`` directly, no hook fires). Two reads, so the
    per-forward check (``ReplicatedDense._release_taken_over``) costs nothing while the
    model is unchanged. Not seen: a parameter set to None, deleted or written into
    ``_parameters`` by hand (checked at the next change of the signature)."""
    if not _HOOK:
        _HOOK.append(nn.modules.module.register_module_parameter_registration_hook(
            _count_registration
        ))  # fmt: skip
    return _registered[0], composable_state_count()


def taken_over(
    root: nn.Module,
    params: Iterable[nn.Parameter],
    owners: Mapping[int, list[tuple[nn.Module, str]]],
) -> list[int]:
    """``id``s of the ``params`` whose every owning module now holds a DTensor parameter of
    FSDP's in their place. TypeError naming the parameter when anything else replaced one
    (a plain tensor, None, or a DTensor in a module FSDP does not manage): dtrec's views
    would shadow it and train the old parameter.

    Example::

        gone = taken_over(model, dense_params, owners)  # [] until fully_shard runs
    """
    gone = []
    for p in params:
        held = [(m, n, m._parameters.get(n)) for m, n in owners[id(p)]]
        if all(new is p for _, _, new in held):
            continue
        if not all(isinstance(new, DTensor) and fsdp_managed(m) for m, _, new in held):
            names = {id(m): n for n, m in root.named_modules()}
            m, n, new = next((m, n, new) for m, n, new in held if new is not p)
            fqn = ".".join(filter(None, (names.get(id(m)), n)))
            raise TypeError(
                f"dense parameter {fqn!r}, replicated by dtrec.distribute_module, was "
                f"replaced by {type(new).__name__} outside fully_shard; apply torch's "
                "parallelisms before distribute_module, or call fully_shard after it with "
                "mesh=<distribute_module's mesh> and dp_mesh_dims (docs/composing.md)"
            )
        gone.append(id(p))
    return gone


def bridge_fsdp_modules(
    root: nn.Module, holders: Iterable[nn.Module], mesh: DeviceMesh, done: set[int]
) -> None:
    """Hook the outermost FSDP modules of ``root`` that contain one of ``holders`` (and are
    not in ``done``, the ids of those hooked before): inputs in as DTensors replicated over
    ``mesh``, outputs out as local tensors (module docstring)."""
    holding = {id(m) for m in holders}
    inside: set[int] = set()
    for module in root.modules():  # parents before children
        if id(module) in inside or not isinstance(module, FSDPModule):
            continue
        subtree = {id(m) for m in module.modules()}
        if not subtree & holding:
            continue
        inside |= subtree
        if id(module) not in done:
            done.add(id(module))
            module.register_forward_pre_hook(
                functools.partial(_inputs_as_dtensors, mesh), with_kwargs=True
            )
            module.register_forward_hook(_outputs_as_local)


def _map(fn: Callable[[Any], Any], value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value)(_map(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: _map(fn, v) for k, v in value.items()}
    return fn(value)


def _replicated(mesh: DeviceMesh, value: Any) -> Any:
    if not isinstance(value, Tensor) or isinstance(value, DTensor):
        return value
    if not value.is_floating_point():
        return value
    return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def _inputs_as_dtensors(
    mesh: DeviceMesh, module: nn.Module, args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    wrap = functools.partial(_replicated, mesh)
    return _map(wrap, args), _map(wrap, kwargs)


def _outputs_as_local(module: nn.Module, args: Any, output: Any) -> Any:
    return _map(_local, output)
