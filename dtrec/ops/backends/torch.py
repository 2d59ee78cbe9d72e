"""The torch backend: ``F.embedding_bag`` forward and a sort-based, deterministic backward.

Runs on any device and serves every call; other backends fall back to it for the
calls their kernels do not take. On CPU, where ``dtrec.kernels.cpu`` is built, its
backward sums in C and its fused step (SGD, row-wise Adagrad) is one C pass; elsewhere
optimizers apply their own pure-torch math (``dtrec.optim``) to the row gradients.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from dtrec.kernels import cpu as cpu_kernels
from dtrec.ops.backends.base import Capabilities, RowUpdate, StepRule
from dtrec.ops.lookup import Lookup, check_bounds


class TorchBackend:
    """torch ops only (deterministic on CPU; on CUDA ``index_add_`` uses atomics)."""

    name = "torch"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16}),
        per_sample_weights=True,
        mean_pooling=True,
        mixed_pooling=True,
        fused_backward_update=True,  # on CPU, with dtrec.kernels.cpu built
    )

    def forward(self, lookup: Lookup, check_ids: bool = False) -> Tensor:
        """``pooled_lookup``, after one vectorized bounds check of the ids."""
        if check_ids:
            check_bounds(lookup.weights, lookup.entry_table, lookup.values, lookup.offsets)
        return self._pooled(lookup)

    def _pooled(self, lookup: Lookup) -> Tensor:
        return pooled_lookup(lookup)

    def backward_rows(self, lookup: Lookup, grad_out: Tensor) -> list[tuple[Tensor, Tensor]]:
        return row_grads(lookup, grad_out)

    def backward_update(
        self,
        lookup: Lookup,
        grad_out: Tensor,
        rule: StepRule,
        states: Sequence[dict[str, Tensor]],
        grad_scale: float = 1.0,
    ) -> bool:
        """``dtrec.kernels.cpu.backward_update`` where it serves the call (CPU, SGD or
        row-wise Adagrad, no bad-id flag); False otherwise (row grads + update then)."""
        if rule.kind not in cpu_kernels.RULES or lookup.error is not None:
            return False
        sums = [st["sum"] for st in states] if rule.kind == "rowwise_adagrad" else None
        return cpu_kernels.backward_update(
            lookup.weights, sums, lookup.entry_table, lookup.values, lookup.offsets,
            lookup.mean, lookup.per_sample_weights, grad_out, grad_scale, rule.kind,
            rule.lr, rule.eps,
        )  # fmt: skip

    def update_rows(self, rule: StepRule, updates: Sequence[RowUpdate]) -> bool:
        return False


def _entries_by_table(
    entry_table: Sequence[int], mean: Sequence[bool]
) -> dict[tuple[int, bool], list[int]]:
    groups: dict[tuple[int, bool], list[int]] = {}
    for e, t in enumerate(entry_table):
        groups.setdefault((t, bool(mean[e])), []).append(e)
    return groups


def _gather_entries(
    entries: list[int],
    values: Tensor,
    offsets: Tensor,
    batch: int,
    psw: Tensor | None,
    starts: list[int],
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The ids, bag offsets and weights of some entries, concatenated in entry order.

    ``starts``: every entry's first id offset (and the end last), read once per lookup.
    Consecutive entries (a table-major layout) are one slice, no copy.
    """
    first, last = entries[0], entries[-1]
    if entries == list(range(first, last + 1)):
        lo, hi = starts[first], starts[last + 1]
        local_offsets = offsets[first * batch : (last + 1) * batch + 1] - lo
        return values[lo:hi], local_offsets, None if psw is None else psw[lo:hi]
    spans = [(starts[e], starts[e + 1]) for e in entries]
    ids = torch.cat([values[s:e] for s, e in spans])
    weights = None if psw is None else torch.cat([psw[s:e] for s, e in spans])
    lengths = torch.cat([torch.diff(offsets[e * batch : (e + 1) * batch + 1]) for e in entries])
    local_offsets = torch.zeros(lengths.numel() + 1, dtype=offsets.dtype, device=offsets.device)
    torch.cumsum(lengths, 0, out=local_offsets[1:])
    return ids, local_offsets, weights


def pooled_lookup(lookup: Lookup) -> Tensor:
    """One ``F.embedding_bag`` call per (table, pooling); no autograd of its own."""
    weights, entry_table, values, mean = (
        lookup.weights,
        lookup.entry_table,
        lookup.values,
        lookup.mean,
    )
    per_sample_weights, batch = lookup.per_sample_weights, lookup.batch
    offsets = lookup.offsets.to(values.dtype)
    pooled: list[Tensor | None] = [None] * len(entry_table)
    starts = offsets[::batch].tolist() if batch else [0] * (len(entry_table) + 1)
    for (t, is_mean), entries in _entries_by_table(entry_table, mean).items():
        w = weights[t]
        if w.shape[1] == 0:  # an empty column shard
            for e in entries:
                pooled[e] = w.new_zeros(batch, 0)
            continue
        ids, local_offsets, psw = _gather_entries(
            entries, values, offsets, batch, per_sample_weights, starts
        )
        out = F.embedding_bag(
            ids,
            w,
            local_offsets,
            mode="mean" if is_mean else "sum",
            per_sample_weights=None if psw is None else psw.to(w.dtype),
            include_last_offset=True,
        )
        for k, e in enumerate(entries):
            pooled[e] = out[k * batch : (k + 1) * batch]
    return torch.cat(pooled, dim=1)  # type: ignore[arg-type]


def occurrence_scale(
    offsets: Tensor, mean: Sequence[bool], per_sample_weights: Tensor | None, num_values: int
) -> tuple[Tensor, Tensor | None]:
    """Per bag (global, e*B+b) its length, and per id the factor its row is pooled with
    (None when every factor is 1: sum pooling, no per-sample weights). No per-id bag
    index is built: callers that need one per id repeat their per-bag values instead."""
    lengths = torch.diff(offsets.long())
    if not any(mean):
        return lengths, None if per_sample_weights is None else per_sample_weights.float()
    num_entries = len(mean)
    batch = lengths.numel() // num_entries
    mean_t = torch.tensor(list(mean), device=offsets.device).repeat_interleave(batch)
    inv_len = torch.where(mean_t, 1.0 / lengths.clamp(min=1).float(), torch.ones(()))
    scale = torch.repeat_interleave(inv_len, lengths, output_size=num_values)
    if per_sample_weights is not None:
        scale = scale * per_sample_weights.float()
    return lengths, scale


def sum_rows_by_key(
    keys: Tensor,
    rows: Tensor,
    index: Tensor | None = None,
    scale: Tensor | None = None,
    key_bound: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Sorted unique keys, and per key the sum of ``rows[index[i]] * scale[i]`` over its i.

    ``index`` defaults to ``arange`` (row i belongs to key i), ``scale`` to 1. One stable
    sort groups the occurrences by key; each key's rows are then one bag that
    ``F.embedding_bag`` sums in order: deterministic, no ``[N, dim]`` gathered copy.
    ``key_bound`` (keys lie in ``[0, key_bound)``) lets keys below 2**31 sort as int32,
    about 2.5x faster on CPU. On CPU with ``key_bound``, ``dtrec.kernels.cpu`` does the
    same in C (a radix sort and one summing pass) where it is built.
    """
    if keys.device.type == "cpu":
        native = cpu_kernels.sum_rows_by_key(
            keys, rows, index, None if scale is None else scale.to(rows.dtype), key_bound
        )
        if native is not None:
            return native
    small = key_bound is not None and key_bound < 2**31
    sorted_keys, perm = torch.sort(keys.int() if small else keys, stable=True)
    unique, counts = torch.unique_consecutive(sorted_keys, return_counts=True)
    sums = F.embedding_bag(
        perm if index is None else index.index_select(0, perm),
        rows,
        torch.cumsum(counts, 0) - counts,
        mode="sum",
        per_sample_weights=None if scale is None else scale.index_select(0, perm).to(rows.dtype),
    )
    return unique.long(), sums


def row_grads(lookup: Lookup, grad_out: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Row-sparse gradients: per table, (sorted unique row ids, summed fp32 grad rows).

    Vectorized over all tables of one embedding dim at once: each id occurrence
    gets the key ``row_base[table] + id``, and ``sum_rows_by_key`` sums each
    key's ``grad_out`` rows (times the occurrence's scale) in a fixed order:
    deterministic (on CUDA prefer the Triton backend). On CPU without scales
    (sum pooling, no per-sample weights), ``dtrec.kernels.cpu.sum_bag_rows`` builds
    the keys and bag rows from the offsets in C (no per-id tensors): the same sums.
    """
    weights, entry_table, values, offsets = (
        lookup.weights,
        lookup.entry_table,
        lookup.values,
        lookup.offsets,
    )
    num_entries, batch, device = len(entry_table), lookup.batch, values.device
    num_values = values.numel()
    lengths, scale = occurrence_scale(offsets, lookup.mean, lookup.per_sample_weights, num_values)
    per_entry = offsets[::batch].diff() if batch else offsets.new_zeros(num_entries)
    rows = [w.shape[0] for w in weights]
    bounds = [0, *itertools.accumulate(rows)]
    row_base = torch.tensor(bounds, device=device)
    grad_out = grad_out.float()
    entry_cols = lookup.columns()
    result: list[tuple[Tensor, Tensor] | None] = [None] * len(weights)
    empty_ids = torch.zeros(0, dtype=torch.long, device=device)
    for t, w in enumerate(weights):
        if w.shape[1] == 0:  # an empty column shard has no gradient
            result[t] = (empty_ids, grad_out.new_zeros(0, 0))
    keys = bag = entry = None  # per-id tensors, built once for all dims where needed
    for dim in sorted({w.shape[1] for w in weights} - {0}):
        dim_entries = [e for e, t in enumerate(entry_table) if weights[t].shape[1] == dim]
        if len(dim_entries) == num_entries:  # one dim: every occurrence, grad_out as is
            blocks = grad_out.reshape(-1, dim)  # bag e * B + b is row b * E + e
            row_start, row_stride = dim_entries, [num_entries] * num_entries
        else:  # this dim's entries' blocks, in order: entry e's bags move to slot[e]
            blocks = torch.stack(
                [grad_out[:, entry_cols[e] : entry_cols[e] + dim] for e in dim_entries]
            )
            row_start, row_stride = (
                [j * batch for j in range(len(dim_entries))],
                [1] * len(dim_entries),
            )
        blocks = blocks.reshape(-1, dim)
        summed = None
        if scale is None and device.type == "cpu":
            summed = cpu_kernels.sum_bag_rows(
                values, offsets, batch, dim_entries, [bounds[t] for t in entry_table],
                row_start, row_stride, blocks, bounds[-1],
            )  # fmt: skip
        if summed is None:
            if keys is None:
                entry_base = row_base[:-1].index_select(
                    0, torch.tensor(list(entry_table), device=device)
                )
                keys = torch.repeat_interleave(entry_base, per_entry, output_size=num_values)
                keys = keys + values
            if len(dim_entries) == num_entries:
                row_of_bag = torch.arange(batch * num_entries, device=device)
                row_of_bag = row_of_bag.view(batch, num_entries).t().reshape(-1)
                s_bag = torch.repeat_interleave(row_of_bag, lengths, output_size=num_values)
                s_keys, s_scale = keys, scale
            else:
                slot = torch.full((num_entries,), -1, dtype=torch.long, device=device)
                slot[dim_entries] = torch.arange(len(dim_entries), device=device)
                if bag is None:
                    bag = torch.repeat_interleave(
                        torch.arange(lengths.numel(), device=device),
                        lengths,
                        output_size=num_values,
                    )
                    entry = torch.repeat_interleave(
                        torch.arange(num_entries, device=device), per_entry, output_size=num_values
                    )
                assert entry is not None
                sel = torch.nonzero(slot.index_select(0, entry) >= 0).squeeze(1)
                s_entry = entry.index_select(0, sel)
                s_bag = bag.index_select(0, sel) + (slot.index_select(0, s_entry) - s_entry) * batch
                s_keys = keys.index_select(0, sel)
                s_scale = None if scale is None else scale.index_select(0, sel)
            summed = sum_rows_by_key(s_keys, blocks, s_bag, s_scale, key_bound=bounds[-1])
        unique, grad_rows = summed
        # each table's keys are one run of the sorted unique keys
        edges = torch.searchsorted(unique, row_base).tolist()
        for t in range(len(weights)):
            if weights[t].shape[1] == dim:
                lo, hi = edges[t], edges[t + 1]
                result[t] = (unique[lo:hi] - bounds[t], grad_rows[lo:hi])
    return result  # type: ignore[return-value]


def per_sample_weights_grad(lookup: Lookup, grad_out: Tensor) -> Tensor:
    """d out / d psw: for each id, <grad_out[bag, cols_e], weight row>."""
    weights, values, offsets, batch = lookup.weights, lookup.values, lookup.offsets, lookup.batch
    entry_table = lookup.entry_table
    cols = lookup.columns()
    grads = []
    for e, t in enumerate(entry_table):
        lo, hi = int(offsets[e * batch]), int(offsets[(e + 1) * batch])
        lengths = torch.diff(offsets[e * batch : (e + 1) * batch + 1].long())
        bag = torch.repeat_interleave(torch.arange(batch, device=values.device), lengths)
        g = grad_out[bag, cols[e] : cols[e + 1]]
        grads.append((g * weights[t][values[lo:hi].long()]).sum(1))
    return torch.cat(grads) if grads else grad_out.new_zeros(0)


__all__ = [
    "TorchBackend",
    "occurrence_scale",
    "per_sample_weights_grad",
    "pooled_lookup",
    "row_grads",
    "sum_rows_by_key",
]
