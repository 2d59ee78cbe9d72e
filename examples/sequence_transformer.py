"""A small sequence model on a sharded ``EmbeddingCollection``: a two-layer transformer
over each user's item history, trained 2D-parallel.

    torchrun --standalone --nproc-per-node 4 examples/sequence_transformer.py [--steps 60]

Each sample is a user's history of items (1..MAX_LEN ids, newest last) and a candidate
item; the label says whether the candidate continues the history's "genre" (a hidden
item -> genre map; each item's genre is also given as a side feature). Two sequence
tables of different dims in one collection (dtrec allows it, TorchRec does not):
``item`` (32 columns, read by the ``history`` and ``candidate`` features) and
``genre_hint`` (8 columns, read by ``hint`` and ``candidate_hint``). The history's rows
are padded into ``[B, L, D]``, a two-layer ``nn.TransformerEncoder`` attends over them,
and its masked mean meets the candidate's rows in a small MLP.

The tables are sharded on a 2D mesh (2 shard ranks x 2 replicas): ``item`` row-wise,
``genre_hint`` table-wise; fused row-wise Adagrad updates the touched rows in backward.
Rank 0 shows a tqdm bar with the loss averaged over ranks and, at the end, the accuracy
on held-out batches.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch import Tensor, nn
from tqdm import tqdm

import dtrec
from dtrec.placements import RowWise, TableWise

ITEMS, GENRES, MAX_LEN = 5_000, 16, 12
ITEM_DIM, HINT_DIM, MODEL_DIM = 32, 8, 32
PLAN = {"embeddings.item": RowWise(), "embeddings.genre_hint": TableWise(rank=1)}


def genre_of(items: Tensor) -> Tensor:
    """The hidden genre of each item (fixed, the same on every rank)."""
    return (items * 2654435761) % 2**32 % GENRES


def make_batch(gen: torch.Generator, batch: int) -> tuple[dtrec.KeyedJaggedTensor, Tensor]:
    """Histories of one genre with 20% noise; half the candidates share the genre."""
    lengths = torch.randint(1, MAX_LEN + 1, (batch,), generator=gen)
    genre = torch.randint(0, GENRES, (batch,), generator=gen)
    by_genre = torch.argsort(genre_of(torch.arange(ITEMS)))  # items sorted by genre
    per_genre = ITEMS // GENRES

    def items_of(genres: Tensor) -> Tensor:
        pick = torch.randint(0, per_genre, (genres.numel(),), generator=gen)
        return by_genre[(genres * per_genre + pick).clamp_max(ITEMS - 1)]

    hist_genre = torch.repeat_interleave(genre, lengths)
    noise = torch.rand(hist_genre.numel(), generator=gen) < 0.2
    hist_genre = torch.where(
        noise, torch.randint(0, GENRES, hist_genre.shape, generator=gen), hist_genre
    )
    history = items_of(hist_genre)
    labels = (torch.rand(batch, generator=gen) < 0.5).float()
    cand_genre = torch.where(
        labels > 0,
        genre,
        (genre + 1 + torch.randint(0, GENRES - 1, (batch,), generator=gen)) % GENRES,
    )
    candidate = items_of(cand_genre)
    ones = torch.ones(batch, dtype=torch.long)
    kjt = dtrec.KeyedJaggedTensor.from_lengths_sync(  # hints: each item's genre, a side feature
        keys=["history", "candidate", "hint", "candidate_hint"],
        values=torch.cat([history, candidate, genre_of(history), genre_of(candidate)]),
        lengths=torch.cat([lengths, ones, lengths, ones]),
    )
    return kjt, labels


def padded(rows: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """``[ids, D]`` jagged rows -> ``[B, MAX_LEN, D]`` zero-padded and the padding mask."""
    batch = lengths.numel()
    position = torch.arange(rows.shape[0]) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths
    )
    sample = torch.repeat_interleave(torch.arange(batch), lengths)
    out = rows.new_zeros(batch, MAX_LEN, rows.shape[1])
    out = out.index_put((sample, position), rows)
    mask = torch.arange(MAX_LEN).unsqueeze(0) >= lengths.unsqueeze(1)
    return out, mask


class HistoryModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embeddings = dtrec.EmbeddingCollection(
            [
                dtrec.EmbeddingConfig("item", ITEMS, ITEM_DIM, ["history", "candidate"]),
                dtrec.EmbeddingConfig("genre_hint", GENRES, HINT_DIM, ["hint", "candidate_hint"]),
            ]
        )
        self.project = nn.Linear(ITEM_DIM + HINT_DIM, MODEL_DIM)
        self.position = nn.Parameter(torch.zeros(MAX_LEN, MODEL_DIM))
        layer = nn.TransformerEncoderLayer(
            MODEL_DIM, nhead=4, dim_feedforward=64, batch_first=True, dropout=0.0
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Sequential(
            nn.Linear(MODEL_DIM + ITEM_DIM + HINT_DIM, 32), nn.ReLU(), nn.Linear(32, 1)
        )

    def forward(self, kjt: dtrec.KeyedJaggedTensor) -> Tensor:
        out = self.embeddings(kjt)
        history, hint = out["history"], out["hint"]
        rows = torch.cat([history.values(), hint.values()], dim=1)  # same ids, same order
        seq, mask = padded(self.project(rows), history.lengths())
        encoded = self.encoder(seq + self.position, src_key_padding_mask=mask)
        keep = (~mask).unsqueeze(2).float()
        summary = (encoded * keep).sum(1) / keep.sum(1)
        candidate = [out["candidate"].values(), out["candidate_hint"].values()]
        return self.head(torch.cat([summary, *candidate], dim=1)).squeeze(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--shard-group-size", type=int, default=2)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial model on every rank
    mesh = dtrec.init_mesh("cpu", shard_group_size=args.shard_group_size)
    model = dtrec.distribute_module(
        HistoryModel(), mesh, PLAN, optimizer=dtrec.optim.RowWiseAdagrad(lr=0.1)
    )
    dense = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    opt = torch.optim.Adam(dense, lr=3e-3)
    loss_fn = nn.BCEWithLogitsLoss()
    gen = torch.Generator().manual_seed(1000 + rank)
    bar = tqdm(total=args.steps, disable=rank != 0, desc="train", mininterval=1.0, file=sys.stdout)
    first = last = None
    for _ in range(args.steps):
        kjt, labels = make_batch(gen, args.batch_size)
        loss = loss_fn(model(kjt), labels)
        opt.zero_grad()
        loss.backward()  # the fused embedding update happens here
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean = mean.item() / world
        first = mean if first is None else first
        last = mean
        bar.update(1)
        bar.set_postfix(loss=f"{mean:.4f}")
    bar.close()
    correct = total = 0
    with torch.no_grad():
        held_out = torch.Generator().manual_seed(99 + rank)
        for _ in range(5):
            kjt, labels = make_batch(held_out, args.batch_size)
            correct += int(((model(kjt) > 0).float() == labels).sum())
            total += labels.numel()
    counts = torch.tensor([correct, total])
    dist.all_reduce(counts)
    if rank == 0:
        print(model.sharding_plan)
        print(f"loss {first:.4f} -> {last:.4f}; held-out accuracy {counts[0] / counts[1]:.3f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
