"""Numerics contract harness: sharded training == unsharded training on the global batch.

Shared by the numerics tests (and later property tests): builds a small model,
trains it sharded on W ranks and unsharded on the concatenated batch, and
reports the largest differences.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

import dtrec
from dtrec.placements import ColumnWise, DataParallel, Grid, RowWise, TableRowWise, TableWise

TABLES = [
    # (name, rows, dim, features, pooling); rows 3 < S exercises empty row shards.
    ("t0", 50, 8, ["f0", "f1"], "sum"),
    ("t1", 3, 5, ["f2"], "mean"),
    ("t2", 97, 7, ["f3"], "sum"),
    ("t3", 20, 4, ["f4"], "mean"),
]

PLANS = {
    "data_parallel": {t[0]: DataParallel() for t in TABLES},
    "table_wise": {t[0]: TableWise(rank=None) for t in TABLES},
    "row_wise": {t[0]: RowWise() for t in TABLES},
    "column_wise": {t[0]: ColumnWise() for t in TABLES},
    "table_row_wise": {t[0]: TableRowWise() for t in TABLES},
    "grid": {t[0]: Grid() for t in TABLES},
    "mixed": {"t0": RowWise(), "t1": TableWise(rank=0), "t2": ColumnWise(), "t3": DataParallel()},
}


def make_tables(weighted: bool) -> list[dtrec.EmbeddingBagConfig]:
    return [
        dtrec.EmbeddingBagConfig(n, rows, dim, feats, "sum" if weighted else pooling)
        for n, rows, dim, feats, pooling in TABLES
    ]


class TinyModel(nn.Module):
    """Embeddings -> one linear layer: enough to exercise sparse and dense grads."""

    def __init__(self, tables: list[dtrec.EmbeddingBagConfig]) -> None:
        super().__init__()
        self.sparse = dtrec.EmbeddingBagCollection(tables)
        self.dense = nn.Linear(sum(t.embedding_dim * len(t.feature_names) for t in tables), 1)

    def forward(self, kjt: dtrec.KeyedJaggedTensor) -> torch.Tensor:
        return self.dense(self.sparse(kjt).values()).squeeze(1)


def make_batch(
    tables: list[dtrec.EmbeddingBagConfig], batch: int, weighted: bool, gen: torch.Generator
) -> tuple[dtrec.KeyedJaggedTensor, torch.Tensor]:
    keys, values, lengths, weights = [], [], [], []
    for cfg in tables:
        for f in cfg.feature_names:
            ls = torch.randint(0, 5, (batch,), generator=gen)
            keys.append(f)
            lengths.append(ls)
            values.append(torch.randint(0, cfg.num_embeddings, (int(ls.sum()),), generator=gen))
            weights.append(torch.rand(int(ls.sum()), generator=gen))
    kjt = dtrec.KeyedJaggedTensor(
        keys, torch.cat(values), torch.cat(lengths), torch.cat(weights) if weighted else None
    )
    return kjt, torch.randn(batch, generator=gen)


@dataclass
class Result:
    max_weight_diff: float = 0.0
    max_loss_diff: float = 0.0
    grads_sharded_like_weights: bool = True
    notes: list[str] = field(default_factory=list)


def check_numerics(
    mesh: torch.distributed.device_mesh.DeviceMesh,
    plan: dict[str, dtrec.placements.TableSpec],
    weighted: bool,
    steps: int = 5,
    batch: int = 3,
    lr: float = 0.5,
    seed: int = 0,
    optimizer: str = "sgd",
    fused: dtrec.optim.FusedOptimizer | None = None,
    tables: list[dtrec.EmbeddingBagConfig] | None = None,
) -> Result:
    """Train sharded and unsharded side by side; return the largest differences.

    ``tables``: the model's tables (default: ``make_tables(weighted)``).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    tables = tables if tables is not None else make_tables(weighted)
    torch.manual_seed(seed)
    reference = TinyModel(tables)
    sharded = dtrec.distribute_module(
        copy.deepcopy(reference),
        mesh,
        {f"sparse.{k}": v for k, v in plan.items()},
        optimizer=fused,
    )
    fused_state = (
        {
            name: fused.init_state(table.weight)
            for name, table in reference.sparse.embedding_bags.items()
        }
        if fused is not None
        else {}
    )
    make_opt = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=lr),
        "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=lr),
        "adam": lambda ps: torch.optim.Adam(ps, lr=lr / 10),
    }[optimizer]
    ref_opt, opt = make_opt(reference.parameters()), make_opt(sharded.parameters())
    result = Result()
    gen = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        batches = [make_batch(tables, batch, weighted, gen) for _ in range(world)]
        kjt, target = batches[rank]
        loss = ((sharded(kjt) - target) ** 2).mean()
        loss.backward()
        if step == 0:
            for name, table in sharded.sparse.embedding_bags.items():
                w, g = table.weight, table.weight.grad
                if fused is not None and g is not None:
                    result.grads_sharded_like_weights = False
                    result.notes.append(f"{name}: fused optimizer left a .grad")
                same = g is None or (
                    g.placements == w.placements and g.to_local().shape == w.to_local().shape
                )
                if not same:
                    result.grads_sharded_like_weights = False
                    result.notes.append(f"{name}: grad {g.placements} vs weight {w.placements}")
        opt.step()
        opt.zero_grad()

        ref_losses = [((reference(k) - t) ** 2).mean() for k, t in batches]
        torch.stack(ref_losses).mean().backward()
        if fused is not None:
            fused_reference_update(reference, tables, fused, fused_state, [k for k, _ in batches])
        ref_opt.step()
        ref_opt.zero_grad()
        result.max_loss_diff = max(result.max_loss_diff, abs(loss.item() - ref_losses[rank].item()))

    ref_tables = reference.sparse.embedding_bags
    for name, table in sharded.sparse.embedding_bags.items():
        block = table.layout.block_at(dtrec.mesh.shard_position(mesh))
        if block is None:
            continue
        want = ref_tables[name].weight.detach()[
            block.rows[0] : block.rows[1], block.cols[0] : block.cols[1]
        ]
        diff = (table.weight.to_local() - want).abs().max().item()
        result.max_weight_diff = max(result.max_weight_diff, diff)
    dense_diff = (sharded.dense.weight - reference.dense.weight).abs().max().item()
    result.max_weight_diff = max(result.max_weight_diff, dense_diff)
    return result


def fused_reference_update(
    model: TinyModel,
    tables: list[dtrec.EmbeddingBagConfig],
    fused: dtrec.optim.FusedOptimizer,
    state: dict[str, dict[str, torch.Tensor]],
    batches: list[dtrec.KeyedJaggedTensor],
) -> None:
    """The unsharded model's fused step: the update rule on rows the global batch touched."""
    for cfg in tables:
        weight = model.sparse.embedding_bags[cfg.name].weight
        ids = torch.cat([b[f].values() for b in batches for f in cfg.feature_names])
        rows = torch.unique(ids.long())
        with torch.no_grad():
            fused.update_rows(weight, state[cfg.name], rows, weight.grad[rows].float())
        weight.grad = None
