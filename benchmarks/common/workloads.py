"""The CPU workload of the side-by-side benchmarks: tables, Zipf ids, batches, plans, model.

One definition, so that every benchmark comparing dtrec with TorchRec on gloo ranks trains
the same tables on the same batches (rank r's batch of step s comes from the seed (r, s)).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from dtrec.placements import (
    ColumnWise,
    DataParallel,
    Grid,
    RowWise,
    TableRowWise,
    TableSpec,
    TableWise,
)

TYPES = ("table_wise", "row_wise", "column_wise", "data_parallel", "mixed")
HASH = 2654435761  # Zipf rank -> row scatter (as make_ids')
LR, EPS = 0.01, 1e-8


@dataclass(frozen=True)
class Workload:
    """The model and batch shape both libraries train."""

    rows: tuple[int, ...]
    """Rows of each table ``t<i>`` (read by feature ``f<i>``)."""
    dim: int = 64
    """Embedding dim of every table."""
    batch: int = 512
    """Samples per rank per step."""
    bag_range: tuple[int, int] = (10, 30)
    """Ids per bag, uniform over this inclusive range."""
    zipf: float = 1.1
    """Zipf exponent of the ids."""

    @property
    def mean_bag(self) -> float:
        return sum(self.bag_range) / 2


WORKLOADS = ("large_tables", "mixed_sizes")


def workload(scale: float = 1.0, batch: int = 512, kind: str = "large_tables") -> Workload:
    """``large_tables``: 8 tables of 1e5..1e6 rows (geometric) times ``scale`` (as
    benchmarks/kernels.py), Zipf 1.1. ``mixed_sizes`` (issue 46): 16 tables of 100..1e6
    rows (geometric) times ``scale``, Zipf 1.05: many small tables whose ids repeat
    heavily within a batch, a regime of their own. Both: bags of 10..30 ids (mean 20)."""
    if kind == "large_tables":
        rows = (max(1, int(scale * 1e5 * 10 ** (i / 7))) for i in range(8))
        return Workload(rows=tuple(rows), batch=batch)
    if kind == "mixed_sizes":
        rows = (max(1, int(scale * 100 * 10 ** (4 * i / 15))) for i in range(16))
        return Workload(rows=tuple(rows), batch=batch, zipf=1.05)
    raise ValueError(f"unknown workload {kind!r}; choose from {WORKLOADS}")


def zipf_ids(rows: int, n: int, s: float, gen: torch.Generator) -> Tensor:
    """``n`` ids: Zipf rank k (P ~ (k+1)^-s, truncated to ``rows``) scattered by ``HASH``.

    Inverse CDF of the continuous power law on [1, rows + 1), floored: rank k has probability
    ``zipf_row_probs`` exactly (unlike clamping, which piles the tail's mass on one row).
    """
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    x = (1 - u * (1 - (rows + 1) ** (1 - s))) ** (-1 / (s - 1))
    rank = (x.floor().long() - 1).clamp(0, rows - 1)
    return (rank * HASH) % rows


def zipf_row_probs(rows: int, s: float) -> np.ndarray:
    """Probability of each row (after the hash scatter) under ``zipf_ids``."""
    edge = np.arange(1, rows + 2, dtype=np.float64) ** (1 - s)
    p_rank = (edge[:-1] - edge[1:]) / (1 - (rows + 1) ** (1 - s))
    row = (np.arange(rows, dtype=np.int64) * HASH) % rows
    return np.bincount(row, weights=p_rank, minlength=rows)


def make_batch(w: Workload, rank: int, step: int) -> tuple[list[str], Tensor, Tensor, Tensor]:
    """Rank ``rank``'s batch of step ``step``: (keys, values, key-major lengths, labels)."""
    gen = torch.Generator().manual_seed(1_000_003 * rank + step)
    lo, hi = w.bag_range
    lengths = torch.randint(lo, hi + 1, (len(w.rows) * w.batch,), generator=gen)
    per_key = lengths.view(len(w.rows), w.batch).sum(1).tolist()
    values = torch.cat([zipf_ids(r, n, w.zipf, gen) for r, n in zip(w.rows, per_key)])
    labels = torch.randint(0, 2, (w.batch,), generator=gen).float()
    return [f"f{i}" for i in range(len(w.rows))], values, lengths, labels


def per_feature_batch(
    features: list[tuple[str, int, tuple[int, int]]], batch: int, s: float, rank: int, step: int
) -> tuple[list[str], Tensor, Tensor, Tensor]:
    """Rank ``rank``'s batch of step ``step`` when each feature (key, rows, bag range) draws
    its own bag lengths, then its Zipf(``s``) ids: (keys, values, key-major lengths, labels)."""
    gen = torch.Generator().manual_seed(1_000_003 * rank + step)
    keys, values, lengths = [], [], []
    for key, rows, (lo, hi) in features:
        ls = torch.randint(lo, hi + 1, (batch,), generator=gen)
        keys.append(key)
        lengths.append(ls)
        values.append(zipf_ids(rows, int(ls.sum()), s, gen))
    labels = torch.randint(0, 2, (batch,), generator=gen).float()
    return keys, torch.cat(values), torch.cat(lengths), labels


def config_shards(config: str, world: int) -> int:
    """S of a config: the whole world, or half of it for the ``2d_`` configs (R = 2)."""
    return world // 2 if config.startswith("2d_") else world


def table_kinds(config: str, shard_group_size: int, num_tables: int = 8) -> list[str]:
    """Per table: "tw:<shard rank>", "rw", "cw" or "dp" (``config`` without its ``2d_``)."""
    kind = config.removeprefix("2d_")
    if kind == "mixed":  # quarters of the tables, in order: DP, TW, CW, RW
        if num_tables % 4:
            raise ValueError(f"the mixed plan splits tables in quarters, got {num_tables}")
        per = [("dp", "tw", "cw", "rw")[4 * i // num_tables] for i in range(num_tables)]
    else:
        short = {"table_wise": "tw", "row_wise": "rw", "column_wise": "cw", "data_parallel": "dp"}
        per = [short[kind]] * num_tables
    return [f"tw:{i % shard_group_size}" if k == "tw" else k for i, k in enumerate(per)]


def dtrec_spec(kind: str) -> TableSpec:
    """dtrec spec of a table kind ("tw:3", "rw", "cw", "dp", "trw:1", "grid")."""
    name, _, arg = kind.partition(":")
    specs = {
        "tw": lambda: TableWise(rank=int(arg)),
        "trw": lambda: TableRowWise(node=int(arg)),
        "rw": RowWise,
        "cw": ColumnWise,
        "dp": DataParallel,
        "grid": Grid,
    }
    return specs[name]()


class Model(nn.Module):
    """Embedding collection -> concat pooled -> Linear(T*D, 64) -> ReLU -> Linear(64, 1)."""

    def __init__(self, ebc: nn.Module, w: Workload) -> None:
        super().__init__()
        self.ebc = ebc
        self.dense = nn.Sequential(nn.Linear(len(w.rows) * w.dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, kjt: object) -> Tensor:
        return self.dense(self.ebc(kjt).values()).squeeze(1)


class RowProbs:
    """Row probabilities of one table, with prefix sums for block masses and distinct counts."""

    def __init__(self, rows: int, s: float) -> None:
        p = zipf_row_probs(rows, s)
        self._log1m = np.log1p(-p)
        self._mass = np.concatenate([[0.0], np.cumsum(p)])
        self._unique: dict[float, np.ndarray] = {}

    def mass(self, start: int, end: int) -> float:
        """Probability that an id falls in rows [start, end)."""
        return float(self._mass[end] - self._mass[start])

    def unique(self, n: float, start: int, end: int) -> float:
        """Expected distinct rows of [start, end) among ``n`` ids: sum 1 - (1 - p_r)^n."""
        if n not in self._unique:
            self._unique[n] = np.concatenate([[0.0], np.cumsum(-np.expm1(n * self._log1m))])
        return float(self._unique[n][end] - self._unique[n][start])


@functools.cache
def row_probs(rows: int, s: float) -> RowProbs:
    """``RowProbs`` of a table, computed once per (rows, s)."""
    return RowProbs(rows, s)
