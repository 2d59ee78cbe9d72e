"""fbgemm's table-batched CPU kernels as a backend: forward, and the fused backward + step.

``FbgemmBackend`` is the torch backend with fbgemm's kernels where they serve the
call. Forward (``dense_embedding_codegen_lookup_function``) runs where the
``"fbgemm"`` backend is chosen. The fused CPU backward
(``split_embedding_backward_codegen_{sgd,rowwise_adagrad}_cpu``: sort, sum each
touched row's gradient, update it in place, all in C++) serves fused SGD and
row-wise Adagrad steps on CPU under ``"fbgemm"``, and fused SGD only under
``"auto"``: for SGD it is ~1.8x faster than torch's row grads + in-place step, but
its row-wise Adagrad is ~1.8x slower than torch's (2 tables, 82k Zipf ids, D=64,
one thread: 12.5 vs 6.8 ms; SGD 2.8 vs 5.0 ms). Calls fbgemm does
not serve run on torch's implementation: when fbgemm does not load (warned once
by ``dtrec.ops.backends.fbgemm_loader``), for mixed sum/mean pooling in one call
(fbgemm pools a whole call one way), for non-fp32 tables, and (backward) for
tables or states not packed in one buffer or empty tables.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import torch
from torch import Tensor

from dtrec.ops.backends.base import Capabilities, StepRule
from dtrec.ops.backends.fbgemm_loader import fbgemm_ops
from dtrec.ops.backends.torch import TorchBackend
from dtrec.ops.lookup import Lookup, pack_tables, shared_storage

_SUM, _MEAN = 0, 1  # fbgemm PoolingMode values
_HOST = 3  # fbgemm EmbeddingLocation.HOST


def _layout(lookup: Lookup) -> dict:
    """The table-batched layout arguments (per entry) shared by forward and backward."""
    weights, entry_table, device = lookup.weights, lookup.entry_table, lookup.values.device
    dims = [weights[t].shape[1] for t in entry_table]
    # fbgemm's row space: tables in the order their entries come (it must increase).
    order = list(dict.fromkeys(entry_table))
    starts = [0, *accumulate(weights[t].shape[0] for t in order)]
    row_starts = dict(zip(order, starts, strict=False))
    total_rows = starts[-1]
    return {
        "D_offsets": torch.tensor([0, *accumulate(dims)], dtype=torch.int32, device=device),
        "max_D": max(dims),
        "hash_size_cumsum": torch.tensor(
            [row_starts[t] for t in entry_table] + [total_rows], dtype=torch.int64, device=device
        ),
        "total_hash_size_bits": int(math.log2(total_rows) + 1) if total_rows else 0,
        "indices": lookup.values,
        "offsets": lookup.offsets.to(lookup.values.dtype),
        "pooling_mode": _MEAN if lookup.mean[0] else _SUM,
    }


def _indice_weights(lookup: Lookup) -> Tensor | None:
    psw = lookup.per_sample_weights
    return None if psw is None else psw.float()


def _pooled_in_fbgemm(ops: Any, lookup: Lookup) -> Tensor:
    """Pooled lookup via fbgemm's ``ops`` (the call must be one fbgemm serves)."""
    flat, table_offsets = pack_tables(lookup.weights)
    layout = _layout(lookup)
    return ops.dense_embedding_codegen_lookup_function(
        dev_weights=flat,
        weights_offsets=table_offsets[list(lookup.entry_table)].long(),
        total_D=int(layout["D_offsets"][-1]),
        indice_weights=_indice_weights(lookup),
        feature_requires_grad=None,
        **layout,
    )


def _grouped_by_table(lookup: Lookup, grad_out: Tensor) -> tuple[Lookup, Tensor]:
    """The same lookup laid out the way fbgemm's CPU backward is fast at: each table's
    entries consecutive, and, when every table has the same number k of entries, merged
    into one entry of k * B bags; ``grad_out``'s rows and columns follow.

    A table-wise table read by k source ranks comes as k entries (consecutive when the
    sharded lookup lays them out table-major: then no bag moves). fbgemm's backward
    groups features by table, and is 2x slower with k features per table than with one
    feature of k * B bags (measured: 8.9 vs 4.0 ms, 4 tables, k=2).
    """
    entries = list(lookup.entry_table)
    tables = list(dict.fromkeys(entries))  # in order of first appearance
    rank = {t: i for i, t in enumerate(tables)}
    order = sorted(range(len(entries)), key=lambda e: (rank[entries[e]], e))
    counts = {entries.count(t) for t in tables}
    if order == list(range(len(entries))) and counts == {1}:
        return lookup, grad_out
    cols, values, offsets, psw = (
        lookup.columns(),
        lookup.values,
        lookup.offsets,
        lookup.per_sample_weights,
    )
    if order != list(range(len(entries))):  # bags move; already table-major: only merged
        values, offsets, psw = _bags_in_order(lookup, order)
    # k entries per table: one entry of k * B bags each (k = 1: just reordered)
    uniform = len(counts) == 1
    k = counts.pop() if uniform else 1
    kept = order[::k]
    grouped = Lookup(
        lookup.weights,
        [entries[e] for e in kept],
        values,
        offsets,
        [lookup.mean[e] for e in kept],
        psw,
    )
    dims = {cols[e + 1] - cols[e] for e in order}
    if uniform and order == list(range(len(entries))) and len(dims) == 1:  # one copy
        batch, dim = lookup.batch, dims.pop()
        merged = grad_out.view(batch, len(tables), k, dim).permute(2, 0, 1, 3)
        return grouped, merged.reshape(k * batch, len(tables) * dim)
    blocks = [grad_out[:, cols[e] : cols[e + 1]] for e in order]
    columns = [torch.cat(blocks[i : i + k]) for i in range(0, len(blocks), k)]
    return grouped, torch.cat(columns, dim=1)


def _bags_in_order(lookup: Lookup, order: list[int]) -> tuple[Tensor, Tensor, Tensor | None]:
    """The lookup's ids, offsets and weights with its entries' bags in ``order``."""
    batch, offsets = lookup.batch, lookup.offsets
    starts = offsets[::batch].tolist() if batch else [0] * (len(order) + 1)
    index = torch.cat(
        [torch.arange(starts[e], starts[e + 1], device=offsets.device) for e in order]
    )
    lengths = offsets.diff().view(len(order), batch)[order].reshape(-1)
    new_offsets = torch.cat([offsets[:1], offsets[0] + lengths.cumsum(0)])
    psw = lookup.per_sample_weights
    psw = None if psw is None else psw.index_select(0, index)
    return lookup.values.index_select(0, index), new_offsets, psw


class FbgemmBackend(TorchBackend):
    """The torch backend with fbgemm's kernels where they serve the call.

    ``lookups``: run forward in fbgemm too (the ``"fbgemm"`` backend); without it only
    the fused CPU backward + step does (what ``"auto"`` picks on CPU, named "torch" since
    its lookups are torch's). ``fused_rules``: the step rules whose fused CPU backward
    fbgemm runs (the others get torch's row grads and step).
    """

    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda"}),  # the fused backward + step: CPU only
        dtypes=frozenset({torch.float32}),
        per_sample_weights=True,
        mean_pooling=True,
        mixed_pooling=False,
        fused_backward_update=True,
    )

    def __init__(
        self,
        name: str = "fbgemm",
        lookups: bool = True,
        fused_rules: tuple[str, ...] = ("sgd", "rowwise_adagrad"),
    ) -> None:
        self.name = name
        self.lookups = lookups
        self.fused_rules = fused_rules

    def _pooled(self, lookup: Lookup) -> Tensor:
        ops = fbgemm_ops() if self.lookups else None
        if ops is not None and self.capabilities.serves(lookup):
            return _pooled_in_fbgemm(ops, lookup)
        return super()._pooled(lookup)

    def backward_update(
        self,
        lookup: Lookup,
        grad_out: Tensor,
        rule: StepRule,
        states: Sequence[dict[str, Tensor]],
        grad_scale: float = 1.0,
    ) -> bool:
        """fbgemm's C++ backward + one SGD / row-wise Adagrad step, in place; the torch
        backend's (``dtrec.kernels.cpu``) where fbgemm does not serve the call: other
        rules, fbgemm not loading, tensors not on the CPU, tables or row-wise Adagrad's
        accumulators not packed in one buffer, an empty table. False: nothing changed."""
        if not self._fbgemm_backward_update(lookup, grad_out, rule, states, grad_scale):
            return super().backward_update(lookup, grad_out, rule, states, grad_scale)
        return True

    def _fbgemm_backward_update(
        self,
        lookup: Lookup,
        grad_out: Tensor,
        rule: StepRule,
        states: Sequence[dict[str, Tensor]],
        grad_scale: float,
    ) -> bool:
        weights = lookup.weights
        if (
            rule.kind not in self.fused_rules
            or lookup.values.device.type != "cpu"
            or grad_out.dtype != torch.float32
            or not self.capabilities.serves(lookup)
            or any(w.shape[0] == 0 for w in weights)
        ):
            return False
        packed = shared_storage(weights)
        adagrad = rule.kind == "rowwise_adagrad"
        sums = shared_storage([st["sum"] for st in states]) if adagrad else None
        if packed is None or (adagrad and sums is None):
            return False
        ops = fbgemm_ops()
        if ops is None:
            return False
        flat, offsets = packed
        given = grad_out
        lookup, grad_out = _grouped_by_table(lookup, grad_out)
        if grad_scale != 1.0:  # scale in place when grouping made a copy
            grad_out = grad_out * grad_scale if grad_out is given else grad_out.mul_(grad_scale)
        entries = list(lookup.entry_table)
        num = len(entries)
        psw = _indice_weights(lookup)
        args = {
            "grad_output": grad_out,
            "host_weights": flat,
            "weights_placements": torch.full((num,), _HOST, dtype=torch.int32),
            "weights_offsets": torch.tensor([offsets[t] for t in entries], dtype=torch.int64),
            "indice_weights": torch.empty(0) if psw is None else psw,
            "stochastic_rounding": False,
            "learning_rate_tensor": torch.tensor(rule.lr, dtype=torch.float32),
            **_layout(lookup),
        }
        if rule.kind == "sgd":
            ops.split_embedding_backward_codegen_sgd_cpu(**args)
            return True
        sum_flat, sum_offsets = sums
        ops.split_embedding_backward_codegen_rowwise_adagrad_cpu(
            momentum1_host=sum_flat,
            momentum1_placements=torch.full((num,), _HOST, dtype=torch.int32),
            momentum1_offsets=torch.tensor([sum_offsets[t] for t in entries], dtype=torch.int64),
            eps=rule.eps,
            **args,
        )
        return True


__all__ = ["FbgemmBackend"]
