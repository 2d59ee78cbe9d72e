"""The DLRM-shaped one-device workload (MLPerf DLRM-DCNv2-like tables): batches, the model
and each library's side (dtrec's sharded step, plain PyTorch's ``nn.EmbeddingBag``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import dtrec
from benchmarks.common.dense_arch import ARCHS, NUM_DENSE, make_dense_arch
from benchmarks.probes.step import FullTableWatch

MLPERF_ROWS = (40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956,
               405282, 10, 2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152,
               12973, 108, 36)  # fmt: skip
MLPERF_HOTNESS = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3,
                  1, 1)  # fmt: skip
LR = 0.01


def dlrm_rows(num_tables: int, lo: float, hi: float, scale: float) -> list[int]:
    """Table sizes spread geometrically between lo and hi rows."""
    return [
        max(1, int(scale * lo * (hi / lo) ** (i / max(num_tables - 1, 1))))
        for i in range(num_tables)
    ]


def make_ids(
    rows: int, n: int, dist: str, device: torch.device, gen: torch.Generator
) -> torch.Tensor:
    """``n`` ids of a table of ``rows`` rows on ``device``: uniform, or Zipf(1.1) ("zipf")."""
    if dist == "uniform":
        return torch.randint(0, rows, (n,), device=device, generator=gen)
    # Zipf(1.1): inverse-CDF of a continuous power law, then a fixed scatter over the rows.
    u = torch.rand(n, device=device, generator=gen, dtype=torch.float64)
    rank = torch.floor((1 - u) ** (-1 / 0.1)).clamp(max=rows) - 1
    return (rank.long() * 2654435761) % rows


@dataclass(frozen=True)
class Workload:
    """The DLRM tables: their rows, dim and multi-hot sizes."""

    rows: tuple[int, ...]
    """Rows of table ``t<i>`` (read by feature ``f<i>``)."""
    dim: int
    """Embedding dim of every table."""
    hotness: tuple[int, ...] = MLPERF_HOTNESS
    """Mean ids per bag of each feature in the multi-hot batch."""


@dataclass
class Batch:
    dense: Tensor
    sparse_features: dtrec.KeyedJaggedTensor
    labels: Tensor
    per_table: list[tuple[Tensor, Tensor]]
    """(ids, bag start offsets) per table: plain PyTorch's input, made ahead of time."""
    unique_rows: int
    """Distinct (table, row) pairs the batch touches (for the bytes model)."""

    def again(self) -> Batch:
        """The same data under a new KJT object (the pipeline matches batches by identity)."""
        kjt = self.sparse_features
        new = dtrec.KeyedJaggedTensor(kjt.keys(), kjt.values(), kjt.lengths())
        return Batch(self.dense, new, self.labels, self.per_table, self.unique_rows)


def make_batch(w: Workload, size: int, one_hot: bool, ids: str, device, gen) -> Batch:
    lengths, values, per_table, unique = [], [], [], 0
    for rows, hot in zip(w.rows, w.hotness):
        if one_hot:
            ls = torch.ones(size, dtype=torch.long, device=device)
        else:
            ls = torch.randint(1, 2 * hot, (size,), device=device, generator=gen)
        v = make_ids(rows, int(ls.sum()), ids, device, gen)
        lengths.append(ls)
        values.append(v)
        per_table.append((v, torch.cumsum(ls, 0) - ls))
        unique += int(torch.unique(v).numel())
    keys = [f"f{i}" for i in range(len(w.rows))]
    kjt = dtrec.KeyedJaggedTensor(keys, torch.cat(values), torch.cat(lengths))
    dense = torch.randn(size, NUM_DENSE, device=device, generator=gen)
    labels = torch.randint(0, 2, (size,), device=device, generator=gen).float()
    return Batch(dense, kjt, labels, per_table, unique)


class TorchTables(nn.Module):
    """Plain PyTorch: one ``nn.EmbeddingBag(sparse=True)`` per table."""

    def __init__(self, w: Workload, device: torch.device) -> None:
        super().__init__()
        self.bags = nn.ModuleList(
            nn.EmbeddingBag(r, w.dim, mode="sum", sparse=True, device=device) for r in w.rows
        )

    def forward(self, per_table: list[tuple[Tensor, Tensor]]) -> Tensor:
        return torch.cat([bag(v, o) for bag, (v, o) in zip(self.bags, per_table)], dim=1)


class DLRM(nn.Module):
    def __init__(self, sparse: nn.Module, dense_arch: nn.Module) -> None:
        super().__init__()
        self.sparse, self.dense_arch = sparse, dense_arch

    def forward(self, dense: Tensor, features) -> Tensor:
        pooled = self.sparse(features)
        return self.dense_arch(dense, pooled if isinstance(pooled, Tensor) else pooled.values())


@dataclass
class Library:
    """One library's model and how to run its steps."""

    name: str
    model: DLRM
    optimizers: list[torch.optim.Optimizer]
    features: str  # the Batch attribute its sparse arch reads
    table_bytes: int
    table_state_bytes: int  # after the first step (torch's Adagrad state is lazy)

    def loss(self, model: nn.Module, b: Batch) -> Tensor:
        logits = model(b.dense, getattr(b, self.features))
        return F.binary_cross_entropy_with_logits(logits, b.labels)

    def step(self, b: Batch) -> None:
        self.loss(self.model, b).backward()
        self.opt_step()

    def opt_step(self) -> None:
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)

    def embedding_step(self, b: Batch, grad: Tensor) -> None:
        """Forward + backward + table update of the embedding part alone."""
        pooled = self.model.sparse(getattr(b, self.features))
        (pooled if isinstance(pooled, Tensor) else pooled.values()).backward(grad)
        if self.name == "pytorch":
            self.optimizers[1].step()
            self.optimizers[1].zero_grad(set_to_none=True)


def dtrec_dlrm(
    w: Workload, device: torch.device, arch: str = "small", dtype: str = "fp32"
) -> tuple[list, DLRM]:
    """The workload's tables (``t<i>``, feature ``f<i>``, sum) and the unsharded DLRM over
    them: tables on meta, the dense arch (``benchmarks.common.dense_arch``) on ``device``, from
    seed 0."""
    tables = [
        dtrec.EmbeddingBagConfig(f"t{i}", r, w.dim, [f"f{i}"], "sum") for i, r in enumerate(w.rows)
    ]
    torch.manual_seed(0)
    model = DLRM(
        dtrec.EmbeddingBagCollection(tables, device="meta"),
        make_dense_arch(arch, len(tables) * w.dim, w.dim, dtype).to(device),
    )
    return tables, model


def build_dtrec(
    w: Workload, device: torch.device, plan: str, watch: FullTableWatch | None,
    arch: str = "small", dtype: str = "fp32",
):  # fmt: skip
    spec = {"table_wise": dtrec.placements.TableWise(rank=0),
            "row_wise": dtrec.placements.RowWise(),
            "data_parallel": dtrec.placements.DataParallel()}[plan]  # fmt: skip
    tables, model = dtrec_dlrm(w, device, arch, dtype)
    mesh = dtrec.init_mesh(device.type, 1)
    fused = dtrec.optim.RowWiseAdagrad(lr=LR)
    plan_map = {f"sparse.{t.name}": spec for t in tables}
    if watch is None:
        model = dtrec.distribute_module(model, mesh, plan_map, optimizer=fused)
    else:
        with watch:
            model = dtrec.distribute_module(model, mesh, plan_map, optimizer=fused)
    weights = [t.weight.to_local() for t in model.sparse.embedding_bags.values()]
    state = [v for s in model.sparse.fused_optimizer_state().values() for v in s.values()]
    dense = [p for p in model.parameters() if p.requires_grad]
    return Library(
        "dtrec", model, [torch.optim.Adagrad(dense, lr=LR)], "sparse_features",
        nbytes(weights), nbytes(state),
    )  # fmt: skip


def plain_state(module: nn.Module) -> dict[str, Tensor]:
    """``module``'s state as full plain tensors (dtrec's dense parameters are replicated
    DTensors, which a plain module's ``load_state_dict`` refuses)."""
    return dtrec.checkpoint.to_full_state_dict(module.state_dict())


def build_pytorch(w: Workload, device: torch.device, like: DLRM) -> Library:
    """Plain PyTorch with dtrec's weights (1 rank: each local shard is the whole table)."""
    dense_arch = make_dense_arch(
        arch_name(like.dense_arch), len(w.rows) * w.dim, w.dim, like.dense_arch.dtype
    )
    model = DLRM(TorchTables(w, device), dense_arch.to(device))
    with torch.no_grad():
        for bag, table in zip(model.sparse.bags, like.sparse.embedding_bags.values()):
            bag.weight.copy_(table.weight.to_local())
        model.dense_arch.load_state_dict(plain_state(like.dense_arch))
    tables = list(model.sparse.parameters())
    opts = [torch.optim.Adagrad(model.dense_arch.parameters(), lr=LR),
            torch.optim.Adagrad(tables, lr=LR, foreach=False)]  # fmt: skip
    state = sum(w.numel() for w in tables) * 4  # Adagrad's dense state_sum, made at step 1
    return Library("pytorch", model, opts, "per_table", nbytes(tables), state)


def arch_name(arch: nn.Module) -> str:
    """The ``--dense`` name of a dense arch."""
    return next(name for name, cls in ARCHS.items() if type(arch) is cls)


def nbytes(tensors) -> int:
    """Bytes of ``tensors``' elements."""
    return sum(t.numel() * t.element_size() for t in tensors)
