"""The sequence lookup: rows of ids on this rank's local shards, every table in one call.

Ids come in *runs* of one table each (``IdRuns``: the served ids per (source, segment),
or the own batch's data-parallel features per table) and their rows must come back in
the same order, each id's row as ``[block cols]``.

* With a fused optimizer and the local shards packed in one buffer (as the sharded
  collection keeps them, ``pack_local_shards``), the forward is one ``index_select`` of
  the packed buffer in the ids' own order, and the backward hands each table's row
  gradients to the fused updater as the pooled op would (its ids as bags of one id):
  the same update, exactly (``_PackedGather``).
* Otherwise (autograd weight gradients, or unpacked shards) the rows come from one call
  of the pooled op with bags of one id over every table (``RowPool``), whose backward
  is the op's own.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
from torch import Tensor

from dtrec.ops.lookup import Lookup, shared_storage
from dtrec.ops.op import EmbeddingBagFunction
from dtrec.sharded.update.fused_update import FusedUpdater, fused_lookup


def expand_runs(starts: Tensor, widths: Tensor, total: int | None = None) -> Tensor:
    """``cat(arange(s, s + w) for s, w in zip(starts, widths))``, vectorized; ``total``
    (``widths.sum()``, when the caller knows it) spares a host read."""
    if total is None:
        total = int(widths.sum()) if widths.numel() else 0
    first = torch.cumsum(widths, 0) - widths
    step = torch.arange(total, device=starts.device)
    step -= torch.repeat_interleave(first, widths, output_size=total)
    return torch.repeat_interleave(starts, widths, output_size=total) + step


class IdRuns:
    """Ids in runs of one table each: run r is ``counts[r]`` ids of table ``run_table[r]``
    (an index into the lookup's tables), runs one after another."""

    def __init__(
        self, ids: Tensor, run_table: list[int], counts: list[int], num_tables: int
    ) -> None:
        self.ids = ids
        self.run_table = run_table
        self.counts = counts
        self.run_counts = torch.tensor(counts, dtype=torch.long, device=ids.device)
        self.per_table = [0] * num_tables
        """Ids per table."""
        self.run_place: list[int] = []
        """Each run's first id among its table's ids (a table's runs kept in order)."""
        for c, u in zip(counts, run_table, strict=True):
            self.run_place.append(self.per_table[u])
            self.per_table[u] += c
        self.table_major = run_table == sorted(run_table)
        """Whether the ids already come table after table."""

    def table_major_ids(self) -> Tensor:
        """The ids table after table (each table's runs in order): one gather."""
        if self.table_major:
            return self.ids
        run_first = list(itertools.accumulate(self.counts, initial=0))[:-1]
        by_table = sorted(range(len(self.counts)), key=self.run_table.__getitem__)  # stable
        device = self.ids.device
        order = torch.tensor(by_table, dtype=torch.long, device=device)
        gather = expand_runs(
            torch.tensor([run_first[r] for r in by_table], dtype=torch.long, device=device),
            self.run_counts.index_select(0, order),
            self.ids.numel(),
        )
        return self.ids.index_select(0, gather)


def bags_per_entry(counts: list[int]) -> int:
    """Bags (of one id) per entry of a grouped lookup over tables with ``counts`` ids.

    The op gives every entry the same number of bags, so each table's ids are cut into
    entries of that many and the last one is padded with empty bags: the largest count
    (one entry per table), unless padding every table to it would more than double the
    rows; then the mean count (at most two entries per table on average, padding at most
    one entry per table)."""
    total = sum(counts)
    most = max(counts, default=0)
    if most * len(counts) > 2 * total:
        most = -(-total // len(counts))
    return max(most, 1)


class RowPool:
    """The rows of several tables' ids from one call of the pooled op, bags of one id.

    The ids go in table-major; table u's ids fill entries from ``first[u] // batch`` on,
    ``batch`` bags per entry (``bags_per_entry``), so the op's ``[batch, width]`` output
    holds table u's k-th id's row at bag ``(first[u] + k) % batch`` of entry
    ``(first[u] + k) // batch``. Every table gets at least one entry, even without ids
    (empty bags then), so replicas and column peers always join its gradient sync.
    """

    def __init__(
        self,
        updater: FusedUpdater | None,
        tables: list[int],
        weights: list[Tensor],
        counts: list[int],
        ids: Tensor,
    ) -> None:
        self.batch = batch = bags_per_entry(counts)
        per_entry, entry_table, self.first = [], [], []
        for u, n in enumerate(counts):
            chunks = max(1, -(-n // batch))
            self.first.append(len(per_entry) * batch)
            per_entry += [batch] * (chunks - 1) + [n - (chunks - 1) * batch]
            entry_table += [u] * chunks
        device = ids.device
        entry_ids = torch.tensor(per_entry, dtype=torch.long, device=device)
        entry_first = torch.cumsum(entry_ids, 0) - entry_ids
        offsets = torch.empty(len(per_entry) * batch + 1, dtype=torch.long, device=device)
        offsets[-1] = ids.numel()
        bags = offsets[:-1].view(-1, batch)
        torch.minimum(
            torch.arange(batch, device=device).unsqueeze(0), entry_ids.unsqueeze(1), out=bags
        )
        bags.add_(entry_first.unsqueeze(1))
        mean = [False] * len(entry_table)
        if updater is not None:
            self.out = fused_lookup(updater, tables, weights, entry_table, mean, ids, offsets, None)
        else:
            self.out = EmbeddingBagFunction.apply(
                entry_table, mean, False, ids, offsets, None, *weights
            )
        widths = [weights[u].shape[1] for u in entry_table]
        self.unit = max(functools.reduce(math.gcd, widths, 0), 1)
        units = torch.tensor(widths, dtype=torch.long, device=device) // self.unit
        self._entry_units = units
        self._entry_start = torch.cumsum(units, 0) - units
        self._row_units = sum(widths) // self.unit
        self._whole_rows = all(w == self.unit for w in widths)

    def rows(self, runs: IdRuns) -> Tensor:
        """The flat rows of ``runs`` (whose table-major ids this pool looked up), in the
        runs' order."""
        n = runs.ids.numel()
        if self._entry_units.numel() == 1:  # one entry: the rows are its first n bags
            return self.out[:n].reshape(-1)
        starts = [self.first[u] + p for u, p in zip(runs.run_table, runs.run_place, strict=True)]
        position = expand_runs(
            torch.tensor(starts, dtype=torch.long, device=self.out.device), runs.run_counts, n
        )
        entry = torch.div(position, self.batch, rounding_mode="floor")
        first_unit = (position - entry * self.batch) * self._row_units
        first_unit += self._entry_start.index_select(0, entry)
        if not self._whole_rows:
            first_unit = expand_runs(first_unit, self._entry_units.index_select(0, entry))
        return self.out.view(-1, self.unit).index_select(0, first_unit).reshape(-1)


class PackedRows:
    """Where each local table's rows sit in the buffer the tables share (None from
    ``of`` when they do not share one): the buffer as runs of ``unit`` elements, each
    table's first run and runs per row."""

    def __init__(self, flat: Tensor, offsets: list[int], widths: list[int]) -> None:
        self.unit = max(functools.reduce(math.gcd, [*widths, *offsets], 0), 1)
        self.units = flat[: flat.numel() // self.unit * self.unit].view(-1, self.unit)
        self.first = [o // self.unit for o in offsets]
        self.per_row = [w // self.unit for w in widths]

    @staticmethod
    def of(weights: list[Tensor]) -> PackedRows | None:
        shared = shared_storage(weights) if weights else None
        if shared is None:
            return None
        return PackedRows(shared[0], shared[1], [w.shape[1] for w in weights])

    def gather_index(self, runs: IdRuns) -> Tensor:
        """The runs of ``unit`` elements holding ``runs``' rows, in the ids' order."""
        device, n = runs.ids.device, runs.ids.numel()

        def per_id(values: list[int]) -> Tensor:
            per_run = torch.tensor([values[u] for u in runs.run_table], device=device)
            return torch.repeat_interleave(per_run, runs.run_counts, output_size=n)

        if len(set(self.per_row)) == 1:
            start = runs.ids * self.per_row[0] + per_id(self.first)
        else:
            start = runs.ids * per_id(self.per_row) + per_id(self.first)
        if all(k == 1 for k in self.per_row):
            return start
        return expand_runs(start, per_id(self.per_row))


class _PackedGather(torch.autograd.Function):
    """Forward: ``packed.units[index]``, the rows in the ids' order. Backward: per table,
    its ids (bags of one id, table-major) and their rows' gradients to the updater, as the
    pooled op's fused backward stashes them (``trigger``: a throwaway leaf that requires
    grad, so backward reaches this node although the tables do not require grad)."""

    @staticmethod
    def forward(ctx, trigger, updater, tables, weights, runs, units, index):  # type: ignore[override]
        ctx.updater, ctx.tables, ctx.weights, ctx.runs = updater, tables, weights, runs
        return units.index_select(0, index).reshape(-1)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        runs: IdRuns = ctx.runs
        widths = [w.shape[1] for w in ctx.weights]
        unit = max(functools.reduce(math.gcd, widths, 0), 1)
        grad = grad.view(-1, unit)
        if not runs.table_major:  # received order -> table-major order (a permutation)
            table_start = list(itertools.accumulate(
                (n * w // unit for n, w in zip(runs.per_table, widths, strict=True)), initial=0
            ))  # fmt: skip
            starts, sizes = [], []
            for c, u, place in zip(runs.counts, runs.run_table, runs.run_place, strict=True):
                starts.append(table_start[u] + place * widths[u] // unit)
                sizes.append(c * widths[u] // unit)
            device = grad.device
            dest = expand_runs(
                torch.tensor(starts, dtype=torch.long, device=device),
                torch.tensor(sizes, dtype=torch.long, device=device),
                grad.shape[0],
            )
            grad = torch.empty_like(grad).index_copy_(0, dest, grad)
        ids = runs.table_major_ids()
        grads = grad.reshape(-1).split([n * w for n, w in zip(runs.per_table, widths, strict=True)])
        id_runs = ids.split(runs.per_table)
        for t, weight, table_ids, g in zip(ctx.tables, ctx.weights, id_runs, grads, strict=True):
            n = table_ids.numel()
            offsets = torch.arange(n + 1, device=ids.device)
            g = g.view(n, weight.shape[1])
            if n == 0:  # one empty bag: the table still joins its gradient sync
                offsets, g = offsets.new_zeros(2), g.new_zeros(1, weight.shape[1])
            lookup = Lookup([weight], [0], table_ids, offsets, [False])
            ctx.updater.stash([t], lookup, g.contiguous())
        return (None,) * 7


def lookup_rows(
    updater: FusedUpdater | None, tables: list[int], weights: list[Tensor], runs: IdRuns
) -> Tensor:
    """The flat rows of ``runs``' ids in their order (each id's ``[cols]`` of its table
    ``weights[u]``, collection index ``tables[u]``), every table in one call."""
    packed = PackedRows.of(weights) if updater is not None else None
    if packed is None:
        return RowPool(updater, tables, weights, runs.per_table, runs.table_major_ids()).rows(runs)
    if torch.is_grad_enabled():
        updater.current_rule()  # a bad param group fails here, before any stash
    trigger = torch.empty(0, requires_grad=torch.is_grad_enabled())
    index = packed.gather_index(runs)
    return _PackedGather.apply(trigger, updater, tables, weights, runs, packed.units, index)
