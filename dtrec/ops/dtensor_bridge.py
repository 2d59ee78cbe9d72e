"""The bridge from DTensor dispatch to the dtrec ops: rebuild each rank's local call.

Why a DTensor custom op handler and not ``register_sharding``: a placement
strategy lets DTensor call the local kernel with the *global* ids, and the
kernel cannot shift them. Under Shard(0) an out-of-shard id must leave its bag
(masking the pooled row, as DTensor's embedding ``_MaskPartial`` does, is wrong
once rows are pooled), every table of the ``Tensor[]`` argument has its own row
offset, a mean is a sum over 1 / global bag length, and jagged batch-sharded
inputs have no global shape DTensor could redistribute. So the handlers below
read the specs, decide placements with ``<op>_strategy``, rebuild the local
inputs and call the local op (which picks the Triton/torch backend itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from dtrec._torch_compat import (
    contiguous_dtensor,
    dtensor_op_handlers,
    implicit_replication_enabled,
    local_shape_and_offset,
    op_argument_names,
)
from dtrec.ops import op as _op  # noqa: F401  (registers torch.ops.dtrec.*)
from dtrec.ops.lookup import check_bounds
from dtrec.ops.row_blocks import bag_scale, ids_in_rows
from dtrec.ops.sharding_rules import (
    Placements,
    embedding_bag_backward_strategy,
    embedding_bag_psw_backward_strategy,
    embedding_bag_strategy,
    is_shard,
)

__all__ = ["register_dtensor_rules"]


# --------------------------------------------------------------------------- layouts


def _bind(op_call: object, args: tuple, kwargs: dict) -> dict[str, object]:
    """The op's arguments by name (``op_call`` is the ``torch.ops.dtrec.*`` overload)."""
    names = op_argument_names(op_call)
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def _tables(bound: dict[str, object]) -> tuple[list[DTensor], list[int]]:
    entry_table = [int(t) for t in bound["entry_table"]]  # type: ignore[union-attr]
    if not entry_table:
        raise ValueError("dtrec.embedding_bag: a DTensor lookup needs at least one table entry")
    return list(bound["weights"]), entry_table  # type: ignore[call-overload]


def _weights_layout(weights: Sequence[object]) -> tuple[DeviceMesh, Placements]:
    if not weights or not all(isinstance(w, DTensor) for w in weights):
        raise TypeError("dtrec.embedding_bag: mixes DTensor and plain-tensor weights")
    mesh, placements = weights[0].device_mesh, weights[0].placements
    for t, w in enumerate(weights):
        if w.device_mesh != mesh or w.placements != placements:
            raise ValueError(
                f"dtrec.embedding_bag: all tables of one call must share mesh and placements; "
                f"table 0 has {placements} on {mesh}, table {t} has {w.placements} on "
                f"{w.device_mesh}"
            )
    return mesh, placements


def _inputs_layout(mesh: DeviceMesh, bound: dict[str, object]) -> Placements:
    """The common placements of values / offsets / per-sample weights."""
    implicit = implicit_replication_enabled()
    found: dict[str, Placements] = {}
    for name in ("values", "offsets", "per_sample_weights"):
        t = bound.get(name)
        if t is None:
            continue
        if isinstance(t, DTensor):
            if t.device_mesh != mesh:
                raise ValueError(
                    f"dtrec.embedding_bag: {name} is on {t.device_mesh}, the weights on {mesh}"
                )
            found[name] = t.placements
        elif implicit:
            found[name] = (Replicate(),) * mesh.ndim
        else:
            raise TypeError(
                f"dtrec.embedding_bag: {name} is a plain tensor but the weights are DTensors; "
                "distribute it (Replicate, or Shard(0) via DTensor.from_local for a local batch)"
            )
    placements = set(found.values())
    if len(placements) != 1:
        raise ValueError(f"dtrec.embedding_bag: inputs disagree on placements: {found}")
    return placements.pop()


def _local(t: object) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t  # type: ignore[return-value]


@dataclass
class _LocalCall:
    """The local op's arguments on this rank, after shifting/masking ids."""

    weights: list[Tensor]
    values: Tensor
    offsets: Tensor
    mean: list[bool]
    per_sample_weights: Tensor | None
    global_batch: int
    check_ids: bool


def _local_call(
    mesh: DeviceMesh,
    weights: Sequence[DTensor],
    entry_table: Sequence[int],
    bound: dict[str, object],
    input_placements: Placements,
    check_ids: bool,
) -> _LocalCall:
    values, offsets = _local(bound["values"]), _local(bound["offsets"])
    psw = _local(bound["per_sample_weights"]) if bound["per_sample_weights"] is not None else None
    mean = [bool(m) for m in bound["mean"]]  # type: ignore[union-attr]
    if psw is not None and any(mean):
        raise ValueError("per_sample_weights need sum pooling; some entries use mean pooling")
    num_entries = len(entry_table)
    batch = (offsets.numel() - 1) // num_entries
    batch_shards = 1
    for axis, p in enumerate(input_placements):
        if is_shard(p, 0):
            batch_shards *= mesh.size(axis)
    local_weights = [w.to_local() for w in weights]
    call = _LocalCall(local_weights, values, offsets, mean, psw, batch * batch_shards, check_ids)
    if not any(is_shard(p, 0) for p in weights[0].placements):
        return call
    if check_ids:  # against the global tables: masking would hide a bad id
        global_tables = [torch.empty(w.shape, device="meta") for w in weights]
        check_bounds(global_tables, entry_table, values, offsets)
        call.check_ids = False  # every id left after masking is in its shard
    starts, sizes = [], []
    for w in weights:
        shape, offset = local_shape_and_offset(w.shape, mesh, w.placements)
        starts.append(offset[0])
        sizes.append(shape[0])
    call.values, call.offsets, call.per_sample_weights = _rows_of_shard(
        values, offsets, entry_table, mean, psw, starts, sizes, local_weights[0].dtype
    )
    call.mean = [False] * num_entries
    return call


def _rows_of_shard(
    values: Tensor,
    offsets: Tensor,
    entry_table: Sequence[int],
    mean: Sequence[bool],
    psw: Tensor | None,
    starts: Sequence[int],
    sizes: Sequence[int],
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Ids shifted into this shard's rows, the others dropped from their bags.

    Means become per-sample weights ``1 / global bag length`` so the partial
    sums over row shards add up to the exact mean.
    """
    device = values.device
    num_bags = offsets.numel() - 1
    batch = num_bags // len(entry_table)
    lengths = torch.diff(offsets.long())
    bag = torch.repeat_interleave(
        torch.arange(num_bags, device=device), lengths, output_size=values.numel()
    )
    entry = bag // max(batch, 1)
    entry_start = torch.tensor([starts[t] for t in entry_table], device=device)
    entry_size = torch.tensor([sizes[t] for t in entry_table], device=device)
    shifted, keep = ids_in_rows(values, entry, entry_start, entry_size)
    local_values = shifted[keep].to(values.dtype)
    local_offsets = torch.zeros(num_bags + 1, dtype=offsets.dtype, device=device)
    torch.cumsum(torch.bincount(bag[keep], minlength=num_bags), 0, out=local_offsets[1:])
    if not any(mean):
        return local_values, local_offsets, None if psw is None else psw[keep]
    is_mean = torch.tensor(list(mean), device=device).repeat_interleave(batch)
    scale = bag_scale(lengths, is_mean, torch.float64).index_select(0, bag)
    return local_values, local_offsets, scale[keep].to(dtype)


def _dtensor(local: Tensor, mesh: DeviceMesh, placements: Placements, shape) -> DTensor:
    return contiguous_dtensor(local, mesh, placements, shape)


def _entry_widths(weights: Sequence[Tensor], entry_table: Sequence[int]) -> list[int]:
    return [weights[t].shape[1] for t in entry_table]


def _gather_columns(
    local_out: Tensor,
    call: _LocalCall,
    mesh: DeviceMesh,
    weights: Sequence[DTensor],
    entry_table: Sequence[int],
    out_placements: Placements,
) -> Tensor:
    """All-gather each entry's column block over the Shard(1) axes (several entries)."""
    split = tuple(
        Shard(1) if is_shard(w, 1) else o
        for w, o in zip(weights[0].placements, out_placements, strict=True)
    )
    blocks = local_out.split(_entry_widths(call.weights, entry_table), dim=1)
    full_widths = _entry_widths(weights, entry_table)
    gathered = [
        _dtensor(b.contiguous(), mesh, split, (call.global_batch, d))
        .redistribute(mesh, out_placements)
        .to_local()
        for b, d in zip(blocks, full_widths, strict=True)
    ]
    return torch.cat(gathered, dim=1)


def _nothing(like: Tensor) -> Tensor:
    """The local tensor of a rank outside the tables' (sub-)mesh (as DTensor's own ops do)."""
    return torch.empty(0, dtype=like.dtype, device=like.device)


# --------------------------------------------------------------------------- handlers


def _embedding_bag_handler(op_call, args, kwargs):
    bound = _bind(op_call, args, kwargs)
    weights, entry_table = _tables(bound)
    mesh, weight_placements = _weights_layout(weights)
    input_placements = _inputs_layout(mesh, bound)
    out_placements = embedding_bag_strategy(weight_placements, input_placements, len(entry_table))
    width = sum(_entry_widths(weights, entry_table))
    if mesh.get_coordinate() is None:
        batch = (bound["offsets"].shape[0] - 1) // len(entry_table)  # type: ignore[union-attr]
        return _dtensor(_nothing(weights[0]), mesh, out_placements, (batch, width))
    check_ids = bool(bound["check_ids"])
    call = _local_call(mesh, weights, entry_table, bound, input_placements, check_ids)
    if call.offsets.numel() <= 1:  # no bags on this rank
        local = call.weights[0].new_zeros(0, sum(_entry_widths(call.weights, entry_table)))
    else:
        local = op_call(
            call.weights,
            entry_table,
            call.values,
            call.offsets,
            call.mean,
            call.per_sample_weights,
            call.check_ids,
        )
    if len(entry_table) > 1 and any(is_shard(p, 1) for p in weight_placements):
        local = _gather_columns(local, call, mesh, weights, entry_table, out_placements)
    return _dtensor(local, mesh, out_placements, (call.global_batch, width))


def _embedding_bag_backward_handler(op_call, args, kwargs):
    bound = _bind(op_call, args, kwargs)
    weights, entry_table = _tables(bound)
    mesh, weight_placements = _weights_layout(weights)
    input_placements = _inputs_layout(mesh, bound)
    grad_out = bound["grad_out"]
    if not isinstance(grad_out, DTensor):
        raise TypeError("dtrec.embedding_bag_backward: grad_out must be a DTensor")
    need, grad_placements = embedding_bag_backward_strategy(
        weight_placements, input_placements, len(entry_table), grad_out.placements
    )
    if mesh.get_coordinate() is None:
        return [_dtensor(_nothing(w), mesh, grad_placements, w.shape) for w in weights]
    if grad_out.placements != need:
        grad_out = grad_out.redistribute(mesh, need)
    call = _local_call(mesh, weights, entry_table, bound, input_placements, check_ids=False)
    local_grad_out = grad_out.to_local()
    if len(entry_table) > 1 and any(is_shard(p, 1) for p in weight_placements):
        local_grad_out = _local_columns(local_grad_out, weights, entry_table, mesh)
    if call.offsets.numel() <= 1:
        local_grads = [torch.zeros_like(w) for w in call.weights]
    else:
        local_grads = op_call(
            call.weights,
            entry_table,
            call.values,
            call.offsets,
            call.mean,
            call.per_sample_weights,
            local_grad_out.contiguous(),
        )
    return [
        _dtensor(g, mesh, grad_placements, w.shape)
        for g, w in zip(local_grads, weights, strict=True)
    ]


def _local_columns(
    grad_out: Tensor, weights: Sequence[DTensor], entry_table: Sequence[int], mesh: DeviceMesh
) -> Tensor:
    """This rank's columns of each entry from a column-replicated grad_out."""
    pieces, first = [], 0
    for t in entry_table:
        w = weights[t]
        shape, offset = local_shape_and_offset(w.shape, mesh, w.placements)
        pieces.append(grad_out[:, first + offset[1] : first + offset[1] + shape[1]])
        first += w.shape[1]
    return torch.cat(pieces, dim=1)


def _embedding_bag_psw_backward_handler(op_call, args, kwargs):
    bound = _bind(op_call, args, kwargs)
    weights, entry_table = _tables(bound)
    mesh, weight_placements = _weights_layout(weights)
    input_placements = _inputs_layout(mesh, bound)
    values, offsets, grad_out = bound["values"], bound["offsets"], bound["grad_out"]
    if not isinstance(grad_out, DTensor):
        raise TypeError("dtrec.embedding_bag_psw_backward: grad_out must be a DTensor")
    need, out_placements = embedding_bag_psw_backward_strategy(
        weight_placements, input_placements, len(entry_table)
    )
    if mesh.get_coordinate() is None:
        return _dtensor(
            _nothing(weights[0]).view(-1)[:0].float(), mesh, out_placements, values.shape
        )
    if grad_out.placements != need:
        grad_out = grad_out.redistribute(mesh, need)
    local_grad_out = grad_out.to_local()
    if len(entry_table) > 1 and any(is_shard(p, 1) for p in weight_placements):
        local_grad_out = _local_columns(local_grad_out, weights, entry_table, mesh)
    local_values, local_offsets = _local(values), _local(offsets)
    local_weights = [w.to_local() for w in weights]
    if any(is_shard(p, 0) for p in weight_placements):
        # Ids outside this rank's rows contribute 0 here (another shard has them).
        row_start = []
        for w in weights:
            _, offset = local_shape_and_offset(w.shape, mesh, w.placements)
            row_start.append(offset[0])
        batch = (local_offsets.numel() - 1) // len(entry_table)
        lengths = torch.diff(local_offsets.long()).view(len(entry_table), batch).sum(1)
        device = local_values.device
        table_of_id = torch.tensor(entry_table, device=device).repeat_interleave(lengths)
        rows = torch.tensor([w.shape[0] for w in local_weights], device=device)
        shifted, inside = ids_in_rows(
            local_values, table_of_id, torch.tensor(row_start, device=device), rows
        )
        local_values = torch.where(inside, shifted, torch.zeros_like(shifted))
        # A shard without rows still needs a row 0 to index (its ids are all masked).
        safe = [w if w.shape[0] else w.new_zeros(1, w.shape[1]) for w in local_weights]
        local = op_call(safe, entry_table, local_values, local_offsets, local_grad_out)
        local = local * inside
    else:
        local = op_call(local_weights, entry_table, local_values, local_offsets, local_grad_out)
    return _dtensor(local, mesh, out_placements, values.shape)


def register_dtensor_rules() -> None:
    """Teach DTensor the dtrec ops; idempotent, call once before using DTensor tables.

    Example::

        dtrec.ops.register_dtensor_rules()
        w = dtrec.distribute_tensor(torch.randn(100, 8), mesh, dtrec.placements.RowWise())
        out = dtrec.ops.embedding_bag([w], ids, offsets)  # ids/offsets: replicated DTensors
        out.full_tensor()  # one all-reduce (out is Partial over "shard")
    """
    handlers = dtensor_op_handlers()
    handlers[torch.ops.dtrec.embedding_bag.default] = _embedding_bag_handler
    handlers[torch.ops.dtrec.embedding_bag_backward.default] = _embedding_bag_backward_handler
    handlers[torch.ops.dtrec.embedding_bag_psw_backward.default] = (
        _embedding_bag_psw_backward_handler
    )
