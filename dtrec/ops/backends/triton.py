"""The Triton backend: the op and the fused optimizer steps on the kernels of ``dtrec.kernels``.

Tables that already live in one storage (views of one flat buffer) are read in
place; otherwise they are packed with one copy per call (the unsharded
collection's separate parameters). Optimizer steps need the tables (and each
state kind) packed, since the kernels update them in place. The kernel modules
import triton, so they are imported here only when a method runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dtrec.kernels.update_math import row_sq_sums
from dtrec.ops.backends.base import Capabilities, RowUpdate, StepRule
from dtrec.ops.backends.device_lists import device_list
from dtrec.ops.lookup import Lookup, pack_tables, shared_storage

if TYPE_CHECKING:
    from dtrec.kernels.row_updates import FusedRowUpdate


class TritonBackend:
    """One kernel launch per forward, backward, or optimizer step over all tables."""

    name = "triton"
    capabilities = Capabilities(
        devices=frozenset({"cuda", "cpu"}),  # CPU tensors run in Triton's interpreter
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        per_sample_weights=True,
        mean_pooling=True,
        mixed_pooling=True,
        fused_backward_update=True,
        skips_bad_ids=True,
    )

    def forward(self, lookup: Lookup, check_ids: bool = False) -> Tensor:
        """One kernel launch for every entry; with ``check_ids`` or ``lookup.error`` the
        kernel flags bad ids while it gathers (no extra pass over the ids); only
        ``check_ids`` reads the flag (then raises)."""
        from dtrec.kernels import embedding_bag as k

        weights = lookup.weights
        flat, table_offsets = pack_tables(weights)
        bounds = None
        if check_ids or lookup.error is not None:
            bounds = device_list([w.shape[0] for w in weights], torch.int64, flat.device)
        result = k.embedding_bag_fwd(
            flat, table_offsets, bounds=bounds, error=lookup.error, **_layout(lookup)
        )
        if bounds is None:
            return result
        out, error = result
        if not check_ids:
            return out
        if int(error[0]):  # one small device->host read
            entry = int(error[1])
            table = lookup.entry_table[entry]
            raise IndexError(
                f"table {table} (entry {entry}): an id is outside [0, {weights[table].shape[0]})"
            )
        return out

    def backward_rows(self, lookup: Lookup, grad_out: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per table: (sorted unique rows, fp32 grad rows ``[U_t, D_t]``), deterministic;
        no rows while ``lookup.error`` is set (this path reads sizes on the host anyway)."""
        from dtrec.kernels.embedding_bag_bwd import embedding_bag_bwd_rows

        weights = lookup.weights
        if lookup.error is not None and bool(lookup.error[0]):
            none = lookup.values.new_zeros(0, dtype=torch.int64)
            return [(none, none.new_zeros(0, w.shape[1], dtype=torch.float32)) for w in weights]
        rows = _rows(lookup)
        g = embedding_bag_bwd_rows(grad_out.contiguous(), **rows, **_layout(lookup))
        # Rows come sorted by table (keys row_base[t] + row), so each table's rows and grads
        # are contiguous; the tables' first keys split them (one host read).
        bounds = [*torch.searchsorted(g.unique_keys, rows["row_base"]).tolist(),
                  g.unique_keys.numel()]  # fmt: skip
        counts = [end - first for first, end in zip(bounds, bounds[1:])]
        result, start, grad_start = [], 0, 0
        for w, n in zip(weights, counts, strict=True):
            dim = w.shape[1]
            result.append(
                (
                    g.row_ids[start : start + n],
                    g.grad_rows[grad_start : grad_start + n * dim].view(n, dim),
                )
            )
            start += n
            grad_start += n * dim
        return result

    def backward_update(
        self,
        lookup: Lookup,
        grad_out: Tensor,
        rule: StepRule,
        states: Sequence[dict[str, Tensor]],
        grad_scale: float = 1.0,
    ) -> bool:
        """One pass sums each touched row's gradient and updates the row in place (no
        gradient buffer); needs the tables and states packed."""
        from dtrec.kernels.embedding_bag_bwd import embedding_bag_bwd_rows

        update = _fused_row_update(rule, list(lookup.weights), states, grad_scale)
        if update is None:
            return False
        if lookup.error is not None:
            update = update._replace(error=lookup.error)
        embedding_bag_bwd_rows(
            grad_out.contiguous(), update=update, **_rows(lookup), **_layout(lookup)
        )
        return True

    def update_rows(self, rule: StepRule, updates: Sequence[RowUpdate]) -> bool:
        """One update-kernel launch over every table's touched rows."""
        args = _packed_rows(updates)
        launch = _ROW_KERNELS.get(rule.kind)
        return args is not None and launch is not None and launch(rule, updates, args)


def _layout(lookup: Lookup) -> dict:
    """The kernels' layout arguments shared by forward and backward."""
    weights, device = lookup.weights, lookup.values.device
    cols = lookup.columns()
    return {
        "dims": device_list([w.shape[1] for w in weights], torch.int32, device),
        "entry_table": device_list(lookup.entry_table, torch.int32, device),
        "out_cols": device_list(cols[:-1], torch.int64, device),
        "values": lookup.values,
        "offsets": lookup.offsets.long(),
        "batch_size": lookup.batch,
        "total_dim": cols[-1],
        "mean": device_list(lookup.mean, torch.int8, device),
        "per_sample_weights": None
        if lookup.per_sample_weights is None
        else lookup.per_sample_weights.float(),
        "max_dim": max(w.shape[1] for w in weights),
    }


def _rows(lookup: Lookup) -> dict:
    """The backward's table sizes: rows per table, their exclusive cumsum (device lists)
    and their sum."""
    rows = [w.shape[0] for w in lookup.weights]
    device = lookup.values.device
    return {"num_rows": device_list(rows, torch.int64, device),
            "row_base": device_list(list(itertools.accumulate(rows[:-1], initial=0)),
                                    torch.int64, device),
            "total_rows": sum(rows)}  # fmt: skip


def _packed(tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor] | None:
    """(flat buffer, int64 offsets as a device list) of tensors sharing one storage, else None."""
    shared = shared_storage(tensors)
    if shared is None:
        return None
    flat, offsets = shared
    return flat, device_list(offsets, torch.int64, flat.device)


# ---------------------------------------------------------------- backward fused with the step


def _hyper(
    device: torch.device,
    lr: float,
    grad_scale: float,
    eps: float = 0.0,
    betas: tuple[float, float] = (0.0, 0.0),
    sqrt_bc2: float = 1.0,
    cached: bool = True,
) -> Tensor:
    """``FusedRowUpdate.hyper``: the step's scalars as one small fp32 tensor."""
    values = [lr, eps, *betas, sqrt_bc2, grad_scale]
    return device_list(values, torch.float32, device, cached)


def _fused_row_update(
    rule: StepRule, weights: list[Tensor], states: Sequence[dict[str, Tensor]], grad_scale: float
) -> FusedRowUpdate | None:
    """The fused backward's update arguments, or None where it cannot serve these tables."""
    from dtrec.kernels import row_updates as ru
    from dtrec.kernels.embedding_bag_bwd import MAX_FUSED_ROWWISE_DIM

    packed = _packed(weights) if weights else None
    if packed is None:
        return None
    flat, offsets = packed
    if rule.kind == "sgd":
        hyper = _hyper(flat.device, rule.lr, grad_scale)
        return ru.FusedRowUpdate(ru.SGD, flat, offsets, hyper, flat, offsets, flat, offsets)
    if rule.kind == "rowwise_adagrad":
        state = _packed([st["sum"] for st in states])
        if state is None or max(w.shape[1] for w in weights) > MAX_FUSED_ROWWISE_DIM:
            return None
        dims = device_list([w.shape[1] for w in weights], torch.int32, flat.device)
        hyper = _hyper(flat.device, rule.lr, grad_scale, rule.eps)
        return ru.FusedRowUpdate(ru.ROWWISE_ADAGRAD, flat, offsets, hyper, *state, flat, dims)
    if rule.kind == "adam":
        m = shared_storage([st["exp_avg"] for st in states])
        v = shared_storage([st["exp_avg_sq"] for st in states])
        steps = {float(st["step"]) for st in states}
        weight_offsets = [w.storage_offset() for w in weights]
        if m is None or v is None or m[1] != weight_offsets or v[1] != weight_offsets:
            return None  # the kernel reads m and v at the weights' offsets
        if len(steps) != 1:
            return None  # one bias correction for all tables
        step, (b1, b2) = steps.pop(), rule.betas
        lr = rule.lr / (1 - b1**step)
        sqrt_bc2 = (1 - b2**step) ** 0.5
        hyper = _hyper(flat.device, lr, grad_scale, rule.eps, rule.betas, sqrt_bc2, cached=False)
        return ru.FusedRowUpdate(ru.ADAM, flat, offsets, hyper, m[0], offsets, v[0], offsets)
    return None


# ---------------------------------------------------------------- a step on row gradients


def _packed_rows(updates: Sequence[RowUpdate]) -> dict | None:
    """The update kernels' arguments when the tables are packed, else None."""
    packed = _packed([u.weight for u in updates])
    if packed is None:
        return None
    flat, table_offsets = packed
    device = updates[0].weight.device
    dims = [u.weight.shape[1] for u in updates]
    counts = device_list([u.rows.numel() for u in updates], torch.int64, device, cached=False)
    row_dims = device_list(dims, torch.int64, device).repeat_interleave(counts)
    first_row = torch.cumsum(counts, 0) - counts
    grads = shared_storage([u.grad_rows for u in updates])
    if grads is None:  # pack the gradient rows (one copy)
        grad_flat = torch.cat([u.grad_rows.reshape(-1) for u in updates])
        grad_offsets = torch.cumsum(row_dims, 0) - row_dims
    else:  # backward's rows already live in one buffer: read them in place
        grad_flat, starts = grads
        index_in_table = torch.arange(int(counts.sum()), device=device)
        index_in_table -= first_row.repeat_interleave(counts)
        base = device_list(starts, torch.int64, device, cached=False).repeat_interleave(counts)
        grad_offsets = base + index_in_table * row_dims
    table_ids = torch.arange(len(updates), dtype=torch.int32, device=device)
    return {
        "weights": flat,
        "table_offsets": table_offsets,
        "dims": device_list(dims, torch.int32, device),
        "row_table": table_ids.repeat_interleave(counts),
        "row_ids": torch.cat([u.rows for u in updates]),
        "grad_rows": grad_flat,
        "grad_offsets": grad_offsets,
        "max_dim": max(dims + [u.tile_dim for u in updates if u.tile_dim is not None]),
    }


def _sgd_rows(rule: StepRule, updates: Sequence[RowUpdate], args: dict) -> bool:
    from dtrec.kernels.update_rows import sgd_update_rows

    sgd_update_rows(lr=rule.lr, **args)
    return True


def _rowwise_adagrad_rows(rule: StepRule, updates: Sequence[RowUpdate], args: dict) -> bool:
    from dtrec.kernels.update_rows import rowwise_adagrad_update_rows

    state = _packed([u.state["sum"] for u in updates])
    if state is None:
        return False
    row_sq_sum = None  # the kernel sums squares itself unless a caller reduced them
    if any(u.row_sq_sum is not None for u in updates):
        row_sq_sum = torch.cat(
            [
                u.row_sq_sum if u.row_sq_sum is not None else row_sq_sums(u.grad_rows)
                for u in updates
            ]
        )
    full = [u.full_dim or u.weight.shape[1] for u in updates]
    rowwise_adagrad_update_rows(
        state=state[0],
        state_offsets=state[1],
        lr=rule.lr,
        eps=rule.eps,
        row_sq_sum=row_sq_sum,
        full_dims=device_list(full, torch.int32, state[0].device),
        **args,
    )
    return True


def _adam_rows(rule: StepRule, updates: Sequence[RowUpdate], args: dict) -> bool:
    from dtrec.kernels.update_rows import adam_update_rows

    states = [u.state for u in updates]
    m = _packed([st["exp_avg"] for st in states])
    v = _packed([st["exp_avg_sq"] for st in states])
    steps = {float(st["step"]) for st in states}
    same_layout = m is not None and v is not None and torch.equal(m[1], args["table_offsets"])
    if not same_layout or not torch.equal(v[1], args["table_offsets"]) or len(steps) != 1:
        return False  # the kernel reads m and v at the weights' offsets, with one step
    b1, b2 = rule.betas
    adam_update_rows(
        exp_avg=m[0],
        exp_avg_sq=v[0],
        lr=rule.lr,
        beta1=b1,
        beta2=b2,
        eps=rule.eps,
        step=int(steps.pop()),
        **args,
    )
    return True


_ROW_KERNELS = {"sgd": _sgd_rows, "rowwise_adagrad": _rowwise_adagrad_rows, "adam": _adam_rows}

__all__ = ["TritonBackend"]
