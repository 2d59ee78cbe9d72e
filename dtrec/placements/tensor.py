"""Turning a spec into a real DTensor: the one place tables meet DeviceMesh."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import distribute_tensor as _torch_distribute_tensor

from dtrec.config import EmbeddingBagConfig
from dtrec.mesh import positions_mesh, shard_axis
from dtrec.ops.sharding_rules import register_dtensor_rules
from dtrec.placements.layout import TableLayout
from dtrec.placements.specs import TableSpec


def table_mesh(mesh: DeviceMesh, layout: TableLayout) -> DeviceMesh:
    """The (sub-)mesh a table's DTensor lives on. Collective: call on every rank."""
    return positions_mesh(mesh, layout.positions, layout.mesh_shape, layout.mesh_dim_names)


def distribute_tensor(
    weight: Tensor, mesh: DeviceMesh, spec: TableSpec, name: str = "table"
) -> DTensor:
    """Shard one ``[rows, dim]`` table over a ``dtrec.init_mesh`` mesh per ``spec``.

    The result's ``full_tensor()`` is ``weight`` on every rank that holds part
    of the table; ranks outside a table-wise table's sub-mesh hold an empty
    local tensor. Data comes from each sub-mesh's first rank (like torch's
    ``distribute_tensor``). Collective: call on every rank in the same order.

    Example::

        w = dtrec.distribute_tensor(torch.randn(1000, 64), mesh, dtrec.placements.RowWise())
    """
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(
            f"table {name!r}: expected a 2-D weight, got {getattr(weight, 'shape', weight)}"
        )
    if not isinstance(spec, TableSpec):
        raise TypeError(f"table {name!r}: expected a dtrec.placements spec, got {spec!r}")
    rows, dim = weight.shape
    layout = spec.layout(EmbeddingBagConfig(name, max(rows, 1), dim), shard_axis(mesh))
    if rows == 0:
        raise ValueError(f"table {name!r}: has no rows")
    sub = table_mesh(mesh, layout)
    register_dtensor_rules()  # so dtrec's ops run on the result through DTensor dispatch
    with torch.no_grad():
        return _torch_distribute_tensor(weight.detach(), sub, list(layout.placements))
