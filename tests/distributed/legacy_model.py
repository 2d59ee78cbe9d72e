"""The model of the committed legacy checkpoint (``make_legacy_checkpoint.py``) and its
training steps: shared by the script that wrote it and the test that loads it."""

from __future__ import annotations

import torch
from torch import nn

import dtrec
from dtrec.placements import DataParallel, RowWise, TableWise

TABLES = [("a", 20, 4, RowWise()), ("b", 9, 3, TableWise(rank=1)), ("c", 6, 2, DataParallel())]
BATCH = 3


class LegacyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sparse = dtrec.EmbeddingBagCollection(
            [dtrec.EmbeddingBagConfig(n, rows, dim, [f"f_{n}"]) for n, rows, dim, _ in TABLES]
        )
        width = sum(dim for _, _, dim, _ in TABLES)
        self.dense = nn.Sequential(nn.Linear(width, 5), nn.ReLU(), nn.Linear(5, 1))

    def forward(self, kjt: dtrec.KeyedJaggedTensor) -> torch.Tensor:
        return self.dense(self.sparse(kjt).values()).squeeze(1)


def build(mesh, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    plan = {f"sparse.{n}": spec for n, _, _, spec in TABLES}
    return dtrec.distribute_module(LegacyModel(), mesh, plan)


def batch(rank: int, step: int) -> tuple[dtrec.KeyedJaggedTensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(1, 3, (len(TABLES) * BATCH,), generator=gen)
    values = []
    for t, (_, rows, _, _) in enumerate(TABLES):
        n = int(lengths[t * BATCH : (t + 1) * BATCH].sum())
        values.append(torch.randint(0, rows, (n,), generator=gen))
    kjt = dtrec.KeyedJaggedTensor([f"f_{n}" for n, *_ in TABLES], torch.cat(values), lengths)
    return kjt, torch.randn(BATCH, generator=gen)


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int, first: int = 0):
    """``steps`` steps from step ``first``; returns the losses."""
    losses = []
    for step in range(first, first + steps):
        kjt, target = batch(rank, step)
        loss = ((model(kjt) - target) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
