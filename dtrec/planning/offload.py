"""What an offloaded block costs, and how big its cache can be: the planner's second tier.

An offloaded block (``dtrec.placements.offload``) keeps its rows and their optimizer
state in host memory and ``C`` of them in a device cache. Per step it costs:

* device memory: the cache (``C`` rows with their state), its bookkeeping (an int32 slot
  per block row, 21 bytes per slot) and the step's buffers;
* host memory: the whole block with its state;
* host <-> device bytes: each cache miss copies a row (and its state) in, and, since
  training changes every row it reads, evicts one that is written back: the same bytes
  out (the link is full duplex: the time is the larger direction, ``misses x row``).

Expected misses: LRU under independent requests, by Che's approximation (as FBGEMM's
and TorchRec's planners reason about caches): with ``lambda_k`` the expected requests
of row k per step, the cache's characteristic time ``T`` solves
``sum_k (1 - exp(-lambda_k T)) = C``; row k is cached with probability
``1 - exp(-lambda_k T)``, and a step misses ``sum_k (1 - exp(-lambda_k))
exp(-lambda_k T)`` distinct rows. The row probabilities come from the ids' distribution:
uniform by default (then a cache of a fraction f of the rows hits f of the rows a step
reads), or Zipf(s) (``Topology.zipf_exponent``), hot rows scattered over the blocks as
hashed ids are (each block sees the table's skew).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from dtrec.modules.config import EmbeddingBagConfig
from dtrec.placements import DataParallel, TableSpec
from dtrec.placements.layout import Block
from dtrec.placements.mesh import ShardAxis
from dtrec.planning.topology import OPTIMIZER_STATE, Topology

SLOT_BYTES = 21
"""Device bytes per cache slot besides the row: its row id, step of last use (int64
each), pin count (int32) and changed flag."""
MAP_BYTES = 4
"""Device bytes per block row: its slot (int32, -1 when in host memory only)."""
BATCHES_IN_FLIGHT = 3
"""A cache holds at least this many steps' distinct rows: the current batch's and the
prefetched one's are pinned, and a batch's count varies around its mean."""
_BUCKETS = 64


@dataclass(frozen=True)
class ZipfIds:
    """Ids Zipf(s) over ``rows``: rank k has probability ~ (k + 1)^-s; ranks are scattered
    over the rows (hashed ids), so every row range holds its share of every rank."""

    rows: int
    s: float

    def mass(self, start: int, end: int) -> float:
        return (end - start) / self.rows

    def unique(self, n: float, start: int, end: int) -> float:
        counts, probs = self.buckets(start, end)
        return float(np.sum(counts * -np.expm1(n * np.log1p(-probs))))

    def buckets(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows of [start, end) grouped by rank (log-spaced): (rows in each group, the
        probability of one of them)."""
        edges = np.unique(np.geomspace(1, self.rows + 1, _BUCKETS + 1).astype(np.int64))
        edges[-1] = self.rows + 1
        lo, hi = edges[:-1].astype(np.float64), edges[1:].astype(np.float64)
        if self.s == 1.0:
            mass, total = np.log(hi / lo), math.log(self.rows + 1)
        else:
            mass = (lo ** (1 - self.s) - hi ** (1 - self.s)) / (self.s - 1)
            total = (1 - (self.rows + 1) ** (1 - self.s)) / (self.s - 1)
        share = (end - start) / self.rows
        return (hi - lo) * share, mass / total / (hi - lo)


def row_buckets(ids: object, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, probability of one row) groups of [start, end) under the ids' distribution;
    one uniform group when it does not say more (``buckets``)."""
    if hasattr(ids, "buckets"):
        return ids.buckets(start, end)  # type: ignore[attr-defined]
    rows = end - start
    mass = ids.mass(start, end)  # type: ignore[attr-defined]
    return np.array([float(rows)]), np.array([mass / rows if rows else 0.0])


def expected_misses(
    counts: np.ndarray, probs: np.ndarray, ids_per_step: float, capacity: int
) -> tuple[float, float]:
    """(distinct rows a step reads, of which miss) for an LRU cache of ``capacity`` rows
    over rows grouped as ``row_buckets`` gives, ``ids_per_step`` ids of the table per step
    (Che's approximation, module doc)."""
    rate = ids_per_step * probs
    read = float(np.sum(counts * -np.expm1(-rate)))
    if capacity >= counts.sum():
        return read, 0.0

    def held(t: float) -> float:
        return float(np.sum(counts * -np.expm1(-rate * t)))

    lo, hi = 0.0, 1.0
    while held(hi) < capacity:
        hi *= 2.0
        if hi > 1e30:
            return read, 0.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if held(mid) < capacity else (lo, mid)
    t = 0.5 * (lo + hi)
    return read, float(np.sum(counts * -np.expm1(-rate) * np.exp(-rate * t)))


def block_ids_per_step(cfg: EmbeddingBagConfig, axis: ShardAxis, topology: Topology) -> float:
    """Ids of the table a sharding group looks up per step (every block sees its share)."""
    return axis.size * topology.batch_size_per_rank * topology.pooling(cfg)


def row_bytes(cfg: EmbeddingBagConfig, cols: int, topology: Topology) -> float:
    """Bytes of one row of a block and its optimizer state (what a miss copies)."""
    per_row, per_element = OPTIMIZER_STATE[topology.optimizer]
    return cols * topology.bytes_per_element + per_row + cols * per_element


def min_cache_rows(
    cfg: EmbeddingBagConfig, block: Block, ids: object, axis: ShardAxis, topology: Topology
) -> int:
    """The smallest cache the planner gives a block: ``BATCHES_IN_FLIGHT`` steps' distinct
    rows (so a batch never finds its cache full), at most the block."""
    read = ids.unique(block_ids_per_step(cfg, axis, topology), *block.rows)  # type: ignore[attr-defined]
    return min(block.num_rows, max(1, math.ceil(BATCHES_IN_FLIGHT * read)))


def offloaded_spec(
    spec: TableSpec,
    cfg: EmbeddingBagConfig,
    axis: ShardAxis,
    topology: Topology,
    fraction: float,
    ids: object,
) -> TableSpec | None:
    """``spec`` with its blocks in host memory behind caches of ``fraction`` of their rows
    (at least ``min_cache_rows``; ``ids``: the ids' distribution); None for data parallel
    (a replicated table stays on the device)."""
    if isinstance(spec, DataParallel) or not hasattr(spec, "cache_rows"):
        return None
    layout = replace(spec, cache_rows=None, cache_fraction=None).layout(cfg, axis)  # type: ignore[type-var]
    blocks = list(layout.blocks)
    if layout.replica_sliced and axis.replicas > 1:  # fully sharded: caches of owner slices
        r = axis.replicas  # (the largest, first one of each block)
        blocks = [replace(b, rows=(b.rows[0], b.rows[0] + -(-b.num_rows // r))) for b in blocks]
    rows = max(
        max(math.ceil(fraction * b.num_rows), min_cache_rows(cfg, b, ids, axis, topology))
        for b in blocks
    )
    return replace(spec, cache_rows=rows, cache_fraction=None)  # type: ignore[type-var]


def ids_per_byte(cfg: EmbeddingBagConfig, topology: Topology) -> float:
    """Ids a table receives per step per byte it holds: the order tables are offloaded
    in, coldest first (they lose the least to cache misses per byte of device freed)."""
    held = cfg.num_embeddings * row_bytes(cfg, cfg.embedding_dim, topology)
    return topology.pooling(cfg) / max(held, 1.0)
