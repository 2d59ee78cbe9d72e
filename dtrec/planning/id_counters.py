"""What a model's tables have seen: opt-in counters of their id traffic, for re-planning.

A plan is chosen from assumed pooling factors and a uniform (or Zipf) id spread. Once a
model trains, its batches say what they are: ``IdCounters(model)`` hooks each embedding
collection's forward (sharded or not) and counts, per feature, ids and bags, and per
table, ids, distinct ids per batch and how ids fall over its rows (per row for tables of
up to ``rows_counted`` rows, else per equal row range). ``stats()`` sums them over the
ranks (one all-reduce); ``topology(base)`` turns them into what the planner takes
(measured pooling factors, batch size and, per table, a ``CountedIds`` distribution),
and ``dtrec.plan(model, mesh, id_counters=counters)`` plans from them.

The cost on the step: after each collection forward, per table a slice of the batch's ids
and an ``index_add_`` of ones into the table's counts, and every ``distinct_every``-th
batch a sort for the distinct count (no host sync: the counts stay on the batch's
device until ``stats()``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from dtrec.comm.collectives import all_reduce
from dtrec.planning.topology import Topology
from dtrec.sparse.keyed_jagged_tensor import as_kjt

ROWS_COUNTED = 1 << 16
"""Default most count slots per table: one per row up to it, else one per row range."""
KIND = "id_counters"
"""The ``dtrec.comm_stats`` kind of ``IdCounters.stats``' all-reduce."""


@dataclass(frozen=True)
class CountedIds:
    """An ``IdDistribution`` (``dtrec.cost_model``) measured by ``IdCounters``: ids fall on
    the rows of each count slot in proportion to its count (slot ``i`` covers rows
    ``[i * rows // slots, (i + 1) * rows // slots)``, spread evenly within it). Rows never
    seen get no ids; a table nothing was counted for is uniform."""

    rows: int
    counts: np.ndarray = field(repr=False)
    """Ids counted per slot (float64)."""

    def _edges(self) -> np.ndarray:
        n = len(self.counts)
        return np.arange(n + 1, dtype=np.int64) * self.rows // n

    def _cumulative(self, row: int) -> float:
        """Share of the ids on rows below ``row``."""
        edges = self._edges()
        total = float(self.counts.sum())
        if total <= 0:
            return row / self.rows
        i = min(int(np.searchsorted(edges, row, side="right")) - 1, len(self.counts) - 1)
        below = float(self.counts[:i].sum())
        width = max(int(edges[i + 1] - edges[i]), 1)
        return (below + float(self.counts[i]) * (row - int(edges[i])) / width) / total

    def mass(self, start: int, end: int) -> float:
        """Probability that an id is in rows [start, end)."""
        if end <= start:
            return 0.0
        return self._cumulative(end) - self._cumulative(start)

    def buckets(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows of [start, end) grouped by slot: (rows of each slot inside, the probability
        of one of its rows); what the offload planner's cache model reads."""
        edges = self._edges()
        total = float(self.counts.sum())
        lo = np.clip(edges[:-1], start, end)
        hi = np.clip(edges[1:], start, end)
        inside = (hi - lo).astype(np.float64)
        width = np.maximum(edges[1:] - edges[:-1], 1).astype(np.float64)
        probs = self.counts / total / width if total > 0 else 1.0 / self.rows + 0 * width
        keep = inside > 0
        return inside[keep], probs[keep]

    def unique(self, n: float, start: int, end: int) -> float:
        """Expected distinct rows of [start, end) among ``n`` ids."""
        if n <= 0 or end <= start:
            return 0.0
        rows, probs = self.buckets(start, end)
        return float(np.sum(rows * -np.expm1(n * np.log1p(-np.minimum(probs, 1.0 - 1e-12)))))


@dataclass(frozen=True)
class TableIdStats:
    """One table's id traffic, per rank and step (means over the ranks and steps counted)."""

    ids_per_step: float
    """Ids one rank's batch looks up in the table."""
    unique_ratio: float
    """Distinct ids of a batch over its ids (1: no id repeats within a batch)."""
    pooling_factor: float
    """Ids per bag, over the table's features."""
    hot_rows: tuple[tuple[tuple[int, int], float], ...]
    """The most looked-up rows, ``((start, end), share of the table's ids)``, most first:
    single rows (``end == start + 1``) for tables of up to ``rows_counted`` rows, else
    row ranges."""
    distribution: CountedIds = field(repr=False)
    """Where its ids fell, as the planner reads it."""


@dataclass
class _Counts:
    rows: int
    slots: Tensor
    """Ids per count slot (int64, on the batch's device)."""
    distinct: Tensor
    """Distinct ids summed over the batches sampled for it (0-dim int64)."""
    ids: int = 0
    sampled: int = 0
    """Ids of the batches whose distinct ids were counted."""


class IdCounters:
    """Opt-in counters of the ids each table of ``model`` looks up (module doc).

    Hooks every embedding collection of ``model`` (a ``distribute_module`` model's sharded
    ones, or unsharded ones) and counts the batches of its training-mode forwards while
    ``enabled`` (after the forward: a batch the forward refused is not counted).
    ``rows_counted``: most count slots per table; ``hot_rows``: how many
    ``TableIdStats.hot_rows`` to report; ``distinct_every``: the distinct ids (a sort)
    are counted in the first of every this many batches. ``remove()`` takes the hooks off.

    Example::

        counters = dtrec.IdCounters(model)
        ...  # train N steps
        new_plan = dtrec.plan(model, mesh, id_counters=counters)  # collective
        dtrec.reshard(model, new_plan)
        counters.remove()
    """

    def __init__(
        self,
        model: nn.Module,
        rows_counted: int = ROWS_COUNTED,
        hot_rows: int = 8,
        distinct_every: int = 4,
    ) -> None:
        from dtrec.planning.plan import collection_configs, model_collections, table_fqn

        for name, value in (("rows_counted", rows_counted), ("distinct_every", distinct_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"IdCounters: {name} must be an int >= 1, got {value!r}")
        self.enabled = True
        """Whether forwards are counted now."""
        self.distinct_every = distinct_every
        """Distinct ids are counted in one batch of this many (a sort per table)."""
        self.hot_rows = hot_rows
        self._tables: dict[str, _Counts] = {}
        self._features: dict[str, list[int]] = {}  # "<fqn>.<feature>" -> [ids, bags]
        self._steps: dict[str, int] = {}  # collection fqn -> batches counted
        self._table_features: dict[str, list[str]] = {}  # table fqn -> its feature keys
        self._collection: dict[str, str] = {}  # table fqn -> its collection's fqn
        self._hooks = []
        for fqn, found in model_collections(model).items():
            module = model.get_submodule(fqn)
            device = _device(module)
            routes: dict[str, tuple[str, int]] = {}  # feature -> (table fqn, rows)
            for cfg in collection_configs(found):
                key = table_fqn(fqn, cfg.name)
                rows = cfg.num_embeddings
                slots = torch.zeros(min(rows, rows_counted), dtype=torch.int64, device=device)
                zero = torch.zeros((), dtype=torch.int64, device=device)
                self._tables[key] = _Counts(rows, slots, zero)
                self._collection[key] = fqn
                self._table_features[key] = []
                for feature in cfg.feature_names:
                    routes[feature] = (key, rows)
                    self._features[table_fqn(fqn, feature)] = [0, 0]
                    self._table_features[key].append(table_fqn(fqn, feature))
            self._steps[fqn] = 0
            self._hooks.append(module.register_forward_hook(self._hook(fqn, routes)))

    def _hook(self, fqn: str, routes: Mapping[str, tuple[str, int]]):
        from dtrec.planning.plan import table_fqn

        def count(module: nn.Module, args: tuple[Any, ...], output: object) -> None:
            if not self.enabled or not module.training or not args:
                return
            kjt = as_kjt(args[0])
            self._steps[fqn] += 1
            sample = (self._steps[fqn] - 1) % self.distinct_every == 0
            values = kjt.values()
            per_table: dict[str, list[Tensor]] = {}
            offset = 0
            for key, n, bags in zip(
                kjt.keys(), kjt.length_per_key(), kjt.stride_per_key(), strict=True
            ):
                if key in routes:
                    counter = self._features[table_fqn(fqn, key)]
                    counter[0] += n
                    counter[1] += bags
                    per_table.setdefault(routes[key][0], []).append(values[offset : offset + n])
                offset += n
            with torch.no_grad():
                for table, parts in per_table.items():
                    self._count(
                        sample,
                        self._tables[table],
                        torch.cat(parts) if len(parts) > 1 else parts[0],
                    )

        return count

    @staticmethod
    def _count(sample: bool, counts: _Counts, ids: Tensor) -> None:
        n = int(ids.numel())
        counts.ids += n
        if not n:
            return
        # the forward took the batch: an id out of range was clamped there (or refused)
        ids = ids.long().clamp(0, counts.rows - 1)
        slots = counts.slots
        slot = ids if len(slots) == counts.rows else ids * len(slots) // counts.rows
        slots.index_add_(0, slot.to(slots.device), torch.ones_like(slot, device=slots.device))
        if sample:
            ordered = ids.sort().values
            counts.distinct += 1 + (ordered[1:] != ordered[:-1]).sum().to(slots.device)
            counts.sampled += n

    def reset(self) -> None:
        """Forget everything counted so far (the hooks stay)."""
        for counts in self._tables.values():
            counts.slots.zero_()
            counts.distinct.zero_()
            counts.ids = counts.sampled = 0
        for counter in self._features.values():
            counter[:] = [0, 0]
        self._steps = dict.fromkeys(self._steps, 0)

    def remove(self) -> None:
        """Take the hooks off the model (what was counted stays readable)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _summed(self) -> tuple[dict[str, Any], dict[str, list[float]], dict[str, float]]:
        """Every rank's counts summed (one all-reduce over the world when distributed):
        table -> (ids, unique ratio, slots), feature -> [ids, bags], collection -> batches."""
        tables = list(self._tables.values())
        scalars = [float(c.ids) for c in tables] + [float(c.sampled) for c in tables]
        scalars += [float(v) for c in self._features.values() for v in c]
        scalars += [float(s) for s in self._steps.values()]
        device = tables[0].slots.device if tables else torch.device("cpu")
        flat = torch.cat(
            [torch.tensor(scalars, dtype=torch.float64, device=device)]
            + [c.distinct.double().view(1) for c in tables]
            + [c.slots.double() for c in tables]
        )
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flat = all_reduce(flat, None, KIND)
        head = len(scalars) + len(tables)
        values = iter(flat[:head].cpu().tolist())
        slots = flat[head:].cpu().numpy()
        ids = [next(values) for _ in tables]
        sampled = [next(values) for _ in tables]
        features = {key: [next(values), next(values)] for key in self._features}
        steps = {key: next(values) for key in self._steps}
        distinct = [next(values) for _ in tables]
        per_table, offset = {}, 0
        for i, (key, c) in enumerate(self._tables.items()):
            per_table[key] = (
                ids[i], distinct[i] / sampled[i] if sampled[i] else 1.0,
                slots[offset : offset + len(c.slots)],
            )  # fmt: skip
            offset += len(c.slots)
        return per_table, features, steps

    def stats(self) -> dict[str, TableIdStats]:
        """Table FQN -> its ``TableIdStats``, over every rank. Collective (one all-reduce):
        every rank calls it."""
        return self._stats(*self._summed())

    def _stats(self, per_table, features, steps) -> dict[str, TableIdStats]:
        out = {}
        for key, (ids, unique, slots) in per_table.items():
            rows = self._tables[key].rows
            batches = max(steps[self._collection[key]], 1.0)
            bags = sum(features[f][1] for f in self._table_features[key])
            order = np.argsort(-slots, kind="stable")[: self.hot_rows]
            edges = np.arange(len(slots) + 1, dtype=np.int64) * rows // len(slots)
            hot = tuple(
                ((int(edges[i]), int(edges[i + 1])), float(slots[i] / ids))
                for i in order
                if ids > 0 and slots[i] > 0
            )
            out[key] = TableIdStats(
                ids_per_step=ids / batches,
                unique_ratio=unique,
                pooling_factor=ids / bags if bags > 0 else 0.0,
                hot_rows=hot,
                distribution=CountedIds(rows, np.asarray(slots, dtype=np.float64)),
            )
        return out

    def topology(self, base: Topology | None = None) -> Topology:
        """``base`` (default ``Topology.cpu()``) with what was counted: each counted
        feature's pooling factor (ids per bag), the batch size per rank (bags per feature
        per batch, the largest over features), and each table's ``CountedIds`` (tables
        nothing was counted for keep ``base``'s assumptions). Collective (``stats``)."""
        base = base if base is not None else Topology.cpu()
        per_table, features, steps = self._summed()
        stats = self._stats(per_table, features, steps)
        pooling = dict(base.pooling_factors)
        batch = 0.0
        for table, keys in self._table_features.items():
            cfg_features = [k[len(self._collection[table]) + 1 :] if self._collection[table]
                            else k for k in keys]  # fmt: skip
            for key, name in zip(keys, cfg_features, strict=True):
                ids, bags = features[key]
                if bags > 0:
                    pooling[name] = ids / bags
                    batch = max(batch, bags / max(steps[self._collection[table]], 1.0))
        distributions = dict(base.id_distributions)
        for key, s in stats.items():
            if per_table[key][0] > 0:
                distributions[key] = s.distribution
        batch_size = max(1, math.ceil(batch)) if batch > 0 else base.batch_size_per_rank
        return replace(
            base,
            pooling_factors=pooling,
            batch_size_per_rank=batch_size,
            id_distributions=distributions,
        )


def _device(module: nn.Module) -> torch.device:
    for param in module.parameters():
        return param.device if param.device.type != "meta" else torch.device("cpu")
    return torch.device("cpu")
