"""Which of a model's parameters dtrec replicates, and making them replicated DTensors.

Once, at ``distribute_module``: every parameter outside the sharded collections that is
not already a DTensor (FSDP's, TP's) gets the first rank's values (DDP's start) and is
swapped, in every module and module-held dict or list that holds it, for a DTensor
replicated over the mesh; ``dense.ReplicatedDense`` then runs its forward views and
gradient averaging.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dtrec.comm.collectives import broadcast_coalesced, first_rank
from dtrec.sharded.dense import ReplicatedDense, as_replicated_dtensor


def replicate_dense(
    model: nn.Module,
    mesh: DeviceMesh,
    ignored: Iterable[nn.Module],
    group: ProcessGroup | None = None,
) -> ReplicatedDense | None:
    """Make every parameter of ``model`` outside ``ignored`` (and not already a DTensor)
    a DTensor replicated over ``mesh``, the first rank's values on every rank; install the
    forward views and the gradient averaging over ``group`` (None: the world; a pipeline
    stage's ranks under pipeline parallelism) (module docstring). None when there is no
    such parameter. Collective: every rank of ``group`` calls it with the same model.

    Example::

        dense = replicate_dense(model, mesh, ignored=sharded_collections)
        torch.optim.Adam(model.parameters(), foreach=True)  # every parameter a DTensor
    """
    skip = {id(m) for root in ignored for m in root.modules()}
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    buffers: list[tuple[nn.Module, str]] = []
    for module in model.modules():
        if id(module) in skip:
            continue
        for name, p in module._parameters.items():
            if p is None or isinstance(p, DTensor):
                continue
            params.setdefault(id(p), p)
            owners.setdefault(id(p), []).append((module, name))
        buffers += [(module, n) for n, b in module._buffers.items() if b is not None]
    if not params:
        return None
    originals = list(params.values())
    with torch.no_grad():
        if dist.get_world_size(group) > 1:  # DDP's start: every rank takes rank 0's values
            first = first_rank(group)
            broadcast_coalesced([p.detach() for p in originals], first, group, "dense.init")
            if buffers:
                bufs = [getattr(m, n) for m, n in buffers]
                broadcast_coalesced(bufs, first, group, "dense.init")
    aliases = _aliases(model, skip, params)
    replaced = []
    for p in originals:
        new = nn.Parameter(as_replicated_dtensor(p.detach(), mesh), requires_grad=p.requires_grad)
        for module, name in owners[id(p)]:
            module._parameters[name] = new
        owners[id(new)] = owners.pop(id(p))
        for _, container, key in aliases.get(id(p), ()):
            container[key] = new
        if id(p) in aliases:
            aliases[id(new)] = aliases.pop(id(p))
        replaced.append(new)
    return ReplicatedDense(model, mesh, owners, replaced, buffers, aliases, group)


def _aliases(
    model: nn.Module, skip: set[int], params: dict[int, nn.Parameter]
) -> dict[int, list[tuple[nn.Module, Any, Any]]]:
    """Where a module's own dict or list attribute holds one of ``params`` too."""
    found: dict[int, list[tuple[nn.Module, Any, Any]]] = {}
    bookkeeping = set(vars(nn.Module()))  # _parameters, _buffers, hooks, ...
    for module in model.modules():
        if id(module) in skip:
            continue
        for name, value in vars(module).items():
            if name in bookkeeping:
                continue
            items = (
                value.items()
                if isinstance(value, dict)
                else (enumerate(value) if isinstance(value, list) else ())
            )
            for key, x in items:
                if isinstance(x, nn.Parameter) and id(x) in params:
                    found.setdefault(id(x), []).append((module, value, key))
    return found
