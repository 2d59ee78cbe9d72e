"""The soak's model, plans, batches and unsharded reference (``benchmarks/soak/run.py``).

A DLRM-shaped model with every kind of collection dtrec shards: a pooled
``EmbeddingBagCollection`` (one table per sharding type, a shared table, a table with
fewer rows than shards), a weighted one (per-sample weights), and a sequence
``EmbeddingCollection`` whose rows are summed per sample; a bottom MLP on dense features
and a top MLP on everything. The plans put every sharding type in one plan on the 1D
mesh (twice, with the types rotated over the tables) and on a 2D (2 x 2) mesh.

Batches are a pure function of (seed, step, rank, variant): the unsharded reference
regenerates exactly what every rank fed, so it can replay a run from its log alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import dtrec
from dtrec.placements import ColumnWise, DataParallel, Grid, RowWise, TableRowWise, TableWise
from dtrec.sparse.variable_batch import expand_variable_batch

WORLD = 4
NUM_DENSE = 8
BATCH = 16  # per rank

# (name, rows, dim, features, pooling)
POOLED = [
    ("dp", 64, 8, ["f_dp"], "sum"),
    ("tw", 300, 8, ["f_tw_a", "f_tw_b"], "mean"),  # two features share the table
    ("rw", 1000, 8, ["f_rw"], "sum"),
    ("cw", 200, 12, ["f_cw"], "mean"),
    ("trw", 400, 8, ["f_trw"], "sum"),
    ("grid", 500, 10, ["f_grid"], "sum"),
    ("tiny", 3, 4, ["f_tiny"], "sum"),  # fewer rows than shards: empty row blocks
]
WEIGHTED = [("w_rw", 150, 6, ["w_a"]), ("w_tw", 80, 6, ["w_b"])]
SEQUENCE = [("s_rw", 300, 8, ["s_hist"]), ("s_cw", 120, 8, ["s_tags"]), ("s_tw", 60, 4, ["s_ctx"])]

COLLECTIONS = {
    "sparse": [f for *_, fs, _ in POOLED for f in fs],
    "weighted": [f for *_, fs in WEIGHTED for f in fs],
    "seq": [f for *_, fs in SEQUENCE for f in fs],
}
ROWS = {f: rows for _, rows, _, fs, *_ in POOLED + WEIGHTED + SEQUENCE for f in fs}


@dataclass(frozen=True)
class PlanSpec:
    """A plan and the mesh it runs on (``dtrec.init_mesh(device, shard_group_size,
    node_size)``)."""

    shard_group_size: int
    node_size: int
    specs: Mapping[str, object]


def _plan(sparse: dict, weighted: dict, seq: dict) -> dict:
    return {
        **{f"sparse.{k}": v for k, v in sparse.items()},
        **{f"weighted.{k}": v for k, v in weighted.items()},
        **{f"seq.{k}": v for k, v in seq.items()},
    }


PLANS = {
    # every type in one plan, 1D mesh of 4 (2 nodes of 2 shard positions)
    "mixed_1d": PlanSpec(4, 2, _plan(
        {"dp": DataParallel(), "tw": TableWise(rank=1), "rw": RowWise(), "cw": ColumnWise(),
         "trw": TableRowWise(node=1), "grid": Grid(), "tiny": RowWise()},
        {"w_rw": RowWise(), "w_tw": TableWise(rank=3)},
        {"s_rw": RowWise(), "s_cw": ColumnWise(), "s_tw": TableWise(rank=2)},
    )),
    # the same types rotated over the tables: a restore moves every table's blocks
    "rotated_1d": PlanSpec(4, 2, _plan(
        {"dp": RowWise(), "tw": Grid(), "rw": ColumnWise(), "cw": TableRowWise(node=0),
         "trw": DataParallel(), "grid": TableWise(rank=0), "tiny": TableWise(rank=3)},
        {"w_rw": ColumnWise(), "w_tw": RowWise()},
        {"s_rw": TableWise(rank=1), "s_cw": RowWise(), "s_tw": ColumnWise()},
    )),
    # 2 x 2 mesh: sharding groups [0, 2] and [1, 3], replica groups [0, 1] and [2, 3]
    "mesh_2d": PlanSpec(2, 4, _plan(
        {"dp": DataParallel(), "tw": TableWise(rank=1), "rw": RowWise(), "cw": ColumnWise(),
         "trw": TableRowWise(node=0), "grid": Grid(), "tiny": RowWise()},
        {"w_rw": TableWise(rank=0), "w_tw": ColumnWise()},
        {"s_rw": ColumnWise(), "s_cw": TableWise(rank=1), "s_tw": RowWise()},
    )),
}  # fmt: skip

# A world of one rank (``--world 1``: NCCL on one GPU): every type degenerates to the whole
# table on the rank, but each still runs its own input dist, lookup and output dist.
PLANS_W1 = {
    "single_mixed": PlanSpec(1, 1, _plan(
        {"dp": DataParallel(), "tw": TableWise(rank=0), "rw": RowWise(), "cw": ColumnWise(),
         "trw": TableRowWise(node=0), "grid": Grid(), "tiny": RowWise()},
        {"w_rw": RowWise(), "w_tw": TableWise(rank=0)},
        {"s_rw": RowWise(), "s_cw": ColumnWise(), "s_tw": TableWise(rank=0)},
    )),
    "single_rotated": PlanSpec(1, 1, _plan(
        {"dp": RowWise(), "tw": Grid(), "rw": ColumnWise(), "cw": TableRowWise(node=0),
         "trw": DataParallel(), "grid": TableWise(rank=0), "tiny": TableWise(rank=0)},
        {"w_rw": ColumnWise(), "w_tw": RowWise()},
        {"s_rw": TableWise(rank=0), "s_cw": RowWise(), "s_tw": ColumnWise()},
    )),
}  # fmt: skip
WORLDS = {WORLD: PLANS, 1: PLANS_W1}
"""The plans of each world size the soak runs (the first plan is the one it starts with)."""


def plans_for(world: int) -> dict[str, PlanSpec]:
    """The soak's plans for a world of ``world`` ranks (1 or 4)."""
    if world not in WORLDS:
        raise ValueError(f"the soak runs worlds of {sorted(WORLDS)} ranks, not {world}")
    return WORLDS[world]


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def sum_rows(jt: dtrec.JaggedTensor, batch: int) -> Tensor:
    """A sequence feature's rows summed per sample: ``[batch, dim]``."""
    rows = jt.values()
    sample = torch.repeat_interleave(torch.arange(batch), jt.lengths(), output_size=len(rows))
    return rows.new_zeros(batch, rows.shape[1]).index_add(0, sample, rows)


class SoakModel(nn.Module):
    """Bottom MLP, pooled + weighted + sequence embeddings, concat, top MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.sparse = dtrec.EmbeddingBagCollection(
            [dtrec.EmbeddingBagConfig(n, r, d, f, p) for n, r, d, f, p in POOLED]
        )
        self.weighted = dtrec.EmbeddingBagCollection(
            [dtrec.EmbeddingBagConfig(n, r, d, f) for n, r, d, f in WEIGHTED], is_weighted=True
        )
        self.seq = dtrec.EmbeddingCollection(
            [dtrec.EmbeddingConfig(n, r, d, f) for n, r, d, f in SEQUENCE]
        )
        width = (
            8
            + sum(d * len(f) for _, _, d, f, _ in POOLED)
            + sum(d * len(f) for _, _, d, f in WEIGHTED)
            + sum(d * len(f) for _, _, d, f in SEQUENCE)
        )
        self.bottom = mlp([NUM_DENSE, 16, 8])
        self.top = mlp([width, 32, 1])

    def forward(self, batch: Mapping[str, object]) -> Tensor:
        dense = batch["dense"]
        size = dense.shape[0]
        seq = self.seq(batch["seq"])
        parts = [
            self.bottom(dense),
            self.sparse(batch["sparse"]).values(),
            self.weighted(batch["weighted"]).values(),
            *(sum_rows(seq[f], size) for f in COLLECTIONS["seq"]),
        ]
        return self.top(torch.cat(parts, dim=1)).squeeze(1)


def rank_loss(model: nn.Module, batch: Mapping[str, object]) -> Tensor:
    """This rank's loss: mean BCE over its samples (0 for an empty batch, not NaN)."""
    logits = model(batch)
    total = F.binary_cross_entropy_with_logits(logits, batch["label"], reduction="sum")
    return total / max(logits.shape[0], 1)


# --------------------------------------------------------------------------- batches


@dataclass(frozen=True)
class BatchSpec:
    """What one rank fed at one step: the reference regenerates it from this alone."""

    step: int
    rank: int
    size: int = BATCH
    vbe: bool = False
    salt: int = 0  # a fault step's batches differ from the good step's


def _gen(seed: int, *key: int) -> torch.Generator:
    mixed = seed
    for k in key:
        mixed = (mixed * 1_000_003 + k + 7) % (2**61 - 1)
    return torch.Generator().manual_seed(mixed)


def _teacher(seed: int) -> dict[str, Tensor]:
    """Fixed per-row scores and dense weights: labels depend on the ids, so loss falls."""
    gen = _gen(seed, 999)
    scores = {f: torch.randn(rows, generator=gen) for f, rows in ROWS.items()}
    scores["dense"] = torch.randn(NUM_DENSE, generator=gen) * 0.5
    return scores


_TEACHERS: dict[int, dict[str, Tensor]] = {}


def _bags(
    gen: torch.Generator, features: list[str], bags: int, mean_len: float
) -> tuple[list[Tensor], list[Tensor]]:
    lengths = [torch.poisson(torch.full((bags,), mean_len), generator=gen).long().clamp_(max=6)
               for _ in features]  # fmt: skip
    ids = []
    for f, ls in zip(features, lengths, strict=True):
        hot = torch.randint(0, max(ROWS[f] // 10, 1), (int(ls.sum()),), generator=gen)
        cold = torch.randint(0, ROWS[f], (int(ls.sum()),), generator=gen)
        pick = torch.rand(int(ls.sum()), generator=gen) < 0.5
        ids.append(torch.where(pick, hot, cold))
    return lengths, ids


def make_batch(seed: int, spec: BatchSpec) -> dict[str, object]:
    """One rank's batch: dense features, three KJTs (the pooled one VBE when
    ``spec.vbe``), labels drawn from a fixed teacher."""
    teacher = _TEACHERS.setdefault(seed, _teacher(seed))
    gen = _gen(seed, spec.step, spec.rank, spec.salt)
    b = spec.size
    dense = torch.randn(b, NUM_DENSE, generator=gen)
    score = dense @ teacher["dense"]
    out: dict[str, object] = {"dense": dense}

    feats = COLLECTIONS["sparse"]
    if spec.vbe and b > 0:  # distinct bags per feature, every one used by some sample
        counts = [int(torch.randint(1, b + 1, (1,), generator=gen)) for _ in feats]
        lengths, ids = [], []
        for f, n in zip(feats, counts, strict=True):
            ls, vs = _bags(gen, [f], n, 2.0)
            lengths += ls
            ids += vs
        inverse = torch.stack([_cover(gen, n, b) for n in counts])
        kjt = dtrec.KeyedJaggedTensor(
            feats, torch.cat(ids), torch.cat(lengths),
            stride_per_key_per_rank=[[n] for n in counts], inverse_indices=(feats, inverse),
        )  # fmt: skip
        expanded = expand_variable_batch(kjt, feats)
    else:
        lengths, ids = _bags(gen, feats, b, 2.0)
        kjt = expanded = dtrec.KeyedJaggedTensor(feats, torch.cat(ids), torch.cat(lengths))
    out["sparse"] = kjt
    for f in ("f_rw", "f_tw_a", "f_grid"):
        jt = expanded[f]
        sample = torch.repeat_interleave(
            torch.arange(b), jt.lengths(), output_size=len(jt.values())
        )
        score = score + torch.zeros(b).index_add(0, sample, teacher[f][jt.values()])

    feats = COLLECTIONS["weighted"]
    lengths, ids = _bags(gen, feats, b, 2.0)
    values = torch.cat(ids)
    weights = torch.rand(len(values), generator=gen) * 0.9 + 0.1
    out["weighted"] = dtrec.KeyedJaggedTensor(feats, values, torch.cat(lengths), weights)

    feats = COLLECTIONS["seq"]
    lengths, ids = _bags(gen, feats, b, 3.0)
    out["seq"] = dtrec.KeyedJaggedTensor(feats, torch.cat(ids), torch.cat(lengths))
    sample = torch.repeat_interleave(torch.arange(b), lengths[0], output_size=len(ids[0]))
    score = score + 0.5 * torch.zeros(b).index_add(0, sample, teacher["s_hist"][ids[0]])

    prob = torch.sigmoid(score - 0.5)
    out["label"] = (torch.rand(b, generator=gen) < prob).float()
    return out


def to_device(batch: Mapping[str, object], device: torch.device | str) -> dict[str, object]:
    """``batch`` (``make_batch``'s or ``bad_batch``'s) with every tensor on ``device``."""
    return {k: v.to(device) for k, v in batch.items()}


def _cover(gen: torch.Generator, bags: int, batch: int) -> Tensor:
    """Inverse indices ``[batch]`` into ``bags`` bags that use every bag at least once."""
    picks = torch.cat([torch.arange(bags), torch.randint(0, bags, (batch - bags,), generator=gen)])
    return picks[torch.randperm(batch, generator=gen)]


# --------------------------------------------------------------------------- faults


class RawBatch:
    """A data loader's KJT that was never validated (TorchRec's does not check lengths):
    dtrec converts it, and rejects it, inside the step on the rank that fed it."""

    def __init__(self, keys: list[str], values: Tensor, lengths: Tensor, like: object) -> None:
        self._keys, self._values, self._lengths = keys, values, lengths
        self._vbe = like.variable_stride_per_key()
        self._per_rank = like.stride_per_key_per_rank() if self._vbe else None
        self._inverse = like.inverse_indices_or_none()

    def variable_stride_per_key(self) -> bool:
        return self._vbe

    def stride_per_key_per_rank(self) -> list[list[int]] | None:
        return self._per_rank

    def inverse_indices_or_none(self) -> tuple | None:
        return self._inverse

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> Tensor:
        return self._values

    def lengths(self) -> Tensor:
        return self._lengths

    def weights_or_none(self) -> None:
        return None

    def to(self, device: torch.device | str) -> RawBatch:
        moved = RawBatch.__new__(RawBatch)
        moved.__dict__.update(self.__dict__)
        moved._values, moved._lengths = self._values.to(device), self._lengths.to(device)
        if self._inverse is not None:
            moved._inverse = (self._inverse[0], self._inverse[1].to(device))
        return moved


BAD_BATCHES = ("bad_ids", "negative_lengths", "missing_feature")


def bad_batch(seed: int, spec: BatchSpec, kind: str, variant: int) -> dict[str, object]:
    """``spec``'s batch broken one way, in the collection ``variant`` picks:
    ``bad_ids`` (an id past its table), ``negative_lengths`` (an unvalidated KJT with a
    negative bag length), ``missing_feature`` (a feature left out)."""
    batch = make_batch(seed, spec)
    name = ("sparse", "weighted", "seq")[variant % 3]
    kjt = batch[name]
    keys, values, lengths = kjt.keys(), kjt.values().clone(), kjt.lengths().clone()
    if kind == "bad_ids":
        if values.numel() == 0:
            raise AssertionError(f"batch {spec} has no ids in {name}")
        f = kjt.keys()[-1]
        values[-1] = ROWS[f] + variant  # the last id belongs to the last feature
        vbe = {}
        if kjt.variable_stride_per_key():
            vbe = {"stride_per_key_per_rank": kjt.stride_per_key_per_rank(),
                   "inverse_indices": kjt.inverse_indices()}  # fmt: skip
        batch[name] = dtrec.KeyedJaggedTensor(keys, values, lengths, kjt.weights_or_none(), **vbe)
    elif kind == "negative_lengths":
        lengths[variant % len(lengths)] = -1 - variant
        batch[name] = RawBatch(keys, values, lengths, kjt)
    elif kind == "missing_feature":
        drop = keys[variant % len(keys)]
        batch[name] = _without(kjt, drop)
    else:
        raise ValueError(f"unknown bad batch kind {kind!r}; choose from {BAD_BATCHES}")
    return batch


def _without(kjt: dtrec.KeyedJaggedTensor, drop: str) -> dtrec.KeyedJaggedTensor:
    """``kjt`` less the feature ``drop`` (a VBE KJT stays VBE)."""
    keep = [k for k in kjt.keys() if k != drop]
    parts = [kjt[k] for k in keep]
    values = torch.cat([jt.values() for jt in parts])
    lengths = torch.cat([jt.lengths() for jt in parts])
    weights = kjt.weights_or_none()
    weights = None if weights is None else torch.cat([jt.weights() for jt in parts])
    if not kjt.variable_stride_per_key():
        return dtrec.KeyedJaggedTensor(keep, values, lengths, weights)
    per_rank = dict(zip(kjt.keys(), kjt.stride_per_key_per_rank(), strict=True))
    inverse_keys, inverse = kjt.inverse_indices()
    rows = [list(inverse_keys).index(k) for k in keep]
    return dtrec.KeyedJaggedTensor(
        keep, values, lengths, weights, stride_per_key_per_rank=[per_rank[k] for k in keep],
        inverse_indices=(keep, inverse[rows]),
    )  # fmt: skip


# --------------------------------------------------------------------------- training recipe


class Schedule:
    """The LR factor: linear warmup, then cosine decay to ``floor`` at ``total`` steps.
    A callable object (not a lambda) so LambdaLR's state dict carries it."""

    def __init__(self, warmup: int, total: int, floor: float = 0.1) -> None:
        self.warmup, self.total, self.floor = warmup, total, floor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.floor + (1 - self.floor) * step / self.warmup
        done = min(1.0, (step - self.warmup) / max(self.total - self.warmup, 1))
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * done))


FUSED_LR = 0.05
DENSE_LR = 3e-3


def fused_rule() -> dtrec.optim.RowWiseAdagrad:
    return dtrec.optim.RowWiseAdagrad(lr=FUSED_LR)


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The MLPs' parameters (tables are trained by the fused optimizer)."""
    return [p for n, p in model.named_parameters() if n.split(".")[0] in ("bottom", "top")]


DENSE_EPS = 1e-4
"""Adam's eps for the MLPs. With torch's 1e-8 this run is chaotic: Adam normalizes
gradients that nearly cancel, so float reassociation (1e-7 relative: 4 ranks' sums vs
one process') picks their direction, and a 1e-7 change of one dense weight at step 300
grew to a 4e-2 weight difference by step 420 (measured on the reference alone); the
final weights could not be compared with anything. With 1e-4 the same change stays at
1e-7."""


def dense_optimizer(model: nn.Module, foreach: bool) -> torch.optim.Optimizer:
    return torch.optim.Adam(dense_parameters(model), lr=DENSE_LR, eps=DENSE_EPS, foreach=foreach)
