"""Train a small DLRM-like model 2D-parallel with dtrec.

    torchrun --standalone --nproc-per-node 4 examples/demo.py [--steps 200] [--batch-size 256]

Every rank builds the same unsharded model; ``dtrec.distribute_module`` shards
its embedding tables over a ("shard", "replicate") mesh (S = --shard-group-size,
R = W / S) per a mixed plan and makes the dense MLPs data parallel. Each rank
trains on its own synthetic batches (Zipf ids, variable bag lengths, labels
from a fixed random "teacher", so the loss can fall). Rank 0 prints the plan,
the loss curve, throughput and the bytes dtrec communicated per step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

import dtrec
from dtrec.placements import ColumnWise, DataParallel, RowWise, TableWise

NUM_DENSE = 13

# (table, rows, dim, features, pooling, mean bag length per feature)
TABLES = [
    ("user", 50_000, 16, ["user_id"], "sum", [1.0]),
    ("item", 20_000, 32, ["item_id", "item_history"], "mean", [1.0, 6.0]),
    ("query", 30_000, 32, ["query_terms"], "mean", [4.0]),
    ("ad", 10_000, 16, ["ad_id"], "sum", [1.5]),
    ("brand", 5_000, 16, ["brand_id"], "sum", [2.0]),
    ("geo", 2_000, 8, ["geo_home", "geo_now"], "mean", [1.0, 1.0]),
    ("category", 1_000, 16, ["category_ids"], "sum", [3.0]),
    ("language", 500, 8, ["language"], "sum", [1.0]),
    ("hour", 200, 8, ["hour"], "sum", [1.0]),
    ("device", 100, 8, ["device_type"], "sum", [1.0]),
]
MAX_BAG = 10

# Mixed plan over "<collection fqn>.<table>"; "sparse.geo" is left out on purpose
# (dtrec.plan fills it in), TableWise(rank=None) lets the planner pick a position.
PLAN = {
    "sparse.user": RowWise(),
    "sparse.ad": RowWise(),
    "sparse.item": ColumnWise(),
    "sparse.query": ColumnWise(),
    "sparse.brand": TableWise(rank=0),
    "sparse.category": TableWise(rank=None),
    "sparse.language": TableWise(rank=None),
    "sparse.hour": DataParallel(),
    "sparse.device": DataParallel(),
}

# name -> (torch optimizer, default dense lr, default embedding lr)
OPTIMIZERS = {
    "adagrad": (torch.optim.Adagrad, 0.02, 0.1),
    "sgd": (torch.optim.SGD, 1.0, 50.0),
}


def mlp(sizes: list[int], last_act: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_act or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Bottom MLP on dense features, pooled embeddings, concat interaction, top MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.sparse = dtrec.EmbeddingBagCollection(
            [dtrec.EmbeddingBagConfig(n, r, d, f, p) for n, r, d, f, p, _ in TABLES]
        )
        sparse_dim = sum(d * len(f) for _, _, d, f, _, _ in TABLES)
        self.bottom = mlp([NUM_DENSE, 64, 32], last_act=True)
        self.top = mlp([32 + sparse_dim, 128, 64, 1], last_act=False)

    def forward(self, dense: torch.Tensor, kjt: dtrec.KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.sparse(kjt).values()  # [B, sum of feature dims]
        return self.top(torch.cat([self.bottom(dense), pooled], dim=1)).squeeze(1)


class Teacher:
    """Fixed random scorer (same on every rank): the labels' ground truth."""

    def __init__(self, seed: int = 1234) -> None:
        rng = np.random.default_rng(seed)
        # Zipf rank -> row: a fixed permutation, so hot rows spread over row shards.
        self.perm = {n: rng.permutation(r) for n, r, *_ in TABLES}
        self.row_score = {n: rng.normal(0.0, 1.0, r).astype(np.float32) for n, r, *_ in TABLES}
        self.dense_w = rng.normal(0.0, 0.5, NUM_DENSE).astype(np.float32)

    def batch(self, batch_size: int, seed: tuple[int, ...]):
        """One rank's batch: (dense [B, 13], KJT, labels [B], teacher probabilities [B])."""
        rng = np.random.default_rng(seed)
        dense = rng.standard_normal((batch_size, NUM_DENSE), dtype=np.float32)
        score = dense @ self.dense_w
        keys, values, lengths = [], [], []
        for name, rows, _, features, pooling, mean_lengths in TABLES:
            for feature, mean_len in zip(features, mean_lengths):
                lens = np.minimum(rng.poisson(mean_len, batch_size), MAX_BAG)  # 0..10, some empty
                ids = self.perm[name][(rng.zipf(1.1, int(lens.sum())) - 1) % rows]
                bag = np.repeat(np.arange(batch_size), lens)
                pooled = np.bincount(bag, self.row_score[name][ids], minlength=batch_size)
                if pooling == "mean":
                    pooled = pooled / np.maximum(lens, 1)
                score = score + 0.6 * pooled
                keys.append(feature)
                values.append(ids)
                lengths.append(lens)
        prob = 1.0 / (1.0 + np.exp(-(score - 0.5)))
        labels = (rng.random(batch_size) < prob).astype(np.float32)
        kjt = dtrec.KeyedJaggedTensor(
            keys=keys,
            values=torch.from_numpy(np.concatenate(values).astype(np.int64)),
            lengths=torch.from_numpy(np.concatenate(lengths).astype(np.int64)),  # key-major
        )
        return torch.from_numpy(dense), kjt, torch.from_numpy(labels), prob


def bce(prob: np.ndarray, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy of probabilities ``prob`` (the teacher's own loss)."""
    y = labels.numpy()
    p = np.clip(prob, 1e-7, 1 - 1e-7)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=256, help="per rank")
    parser.add_argument("--shard-group-size", type=int, default=2)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adagrad")
    parser.add_argument("--lr", type=float, help="dense (MLP) learning rate")
    parser.add_argument("--emb-lr", type=float, help="embedding learning rate")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of samples/s")
    parser.add_argument("--pipeline", action="store_true", help="train through dtrec.TrainPipeline")
    parser.add_argument(
        "--fused",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fuse RowWiseAdagrad into the embedding backward (default); --no-fused trains the "
        "DTensor table parameters with the torch optimizer instead",
    )
    args = parser.parse_args()
    default_lr, default_emb_lr = OPTIMIZERS[args.optimizer][1:]
    args.lr = default_lr if args.lr is None else args.lr
    args.emb_lr = default_emb_lr if args.emb_lr is None else args.emb_lr

    torch.set_num_threads(1)  # several ranks share few cores
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    lead = rank == 0
    try:
        run(args, rank, world, lead)
    except BaseException:
        sys.stdout.flush()
        print(f"[rank {rank}] demo failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        os._exit(1)  # torchrun sees the failure and stops the other ranks
    dist.barrier()
    dist.destroy_process_group()


def run(args: argparse.Namespace, rank: int, world: int, lead: bool) -> None:
    if args.steps < 20 or args.warmup >= args.steps:
        raise ValueError("need --steps >= 20 and --warmup < --steps")
    mesh = dtrec.init_mesh("cpu", shard_group_size=args.shard_group_size)
    torch.manual_seed(0)  # same initial weights on every rank
    fused = dtrec.optim.RowWiseAdagrad(lr=args.emb_lr) if args.fused else None
    model = dtrec.distribute_module(DLRM(), mesh, PLAN, optimizer=fused)

    # every parameter is a DTensor (tables sharded, the dense part replicated): split by name
    emb_params = [p for n, p in model.named_parameters() if "embedding_bags." in n]
    dense_params = [p for n, p in model.named_parameters() if "embedding_bags." not in n]
    groups = [{"params": dense_params, "lr": args.lr}]
    if not args.fused:  # embedding weights are DTensor parameters: any torch optimizer works
        groups.append({"params": emb_params, "lr": args.emb_lr})
    opt = OPTIMIZERS[args.optimizer][0](groups)
    loss_fn = nn.BCEWithLogitsLoss()
    teacher = Teacher()

    dense_bytes = sum(p.numel() * p.element_size() for p in dense_params)
    emb_rows = sum(r for _, r, *_ in TABLES)
    if lead:
        print(
            f"dtrec demo: W={world} ranks, mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}, "
            f"batch {args.batch_size}/rank ({args.batch_size * world} global), {args.steps} steps"
        )
        print(
            f"{len(TABLES)} tables ({emb_rows:,} rows), "
            f"{sum(len(t[3]) for t in TABLES)} sparse features, {NUM_DENSE} dense; "
            f"dense MLP params {dense_bytes // 4:,}"
        )
        if args.fused:
            print(
                f"optimizer: dense torch.optim.{type(opt).__name__} (lr {args.lr}); tables: "
                f"{fused} fused into backward (row-sparse, sparse replica sync)"
            )
        else:
            print(
                f"optimizer: torch.optim.{type(opt).__name__} (dense lr {args.lr}, embedding lr "
                f"{args.emb_lr}) over model.parameters()"
            )
        print("sharding plan (model.sharding_plan):")
        print(model.sharding_plan)

    losses = torch.zeros(args.steps)
    teacher_loss = 0.0
    window = 10
    bar = tqdm(total=args.steps, disable=not lead, desc="train", mininterval=1.0, file=sys.stdout)

    def batches():
        nonlocal teacher_loss
        for step in range(args.steps):
            dense, kjt, labels, prob = teacher.batch(args.batch_size, (rank, step))
            teacher_loss += bce(prob, labels)
            yield dense, kjt, labels

    def batch_loss(m: nn.Module, batch) -> torch.Tensor:
        dense, kjt, labels = batch
        return loss_fn(m(dense, kjt), labels)

    def plain_loop():
        for batch in batches():
            loss = batch_loss(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            yield loss.detach()

    if args.pipeline:  # next batch's input-dist in flight during this one
        pipeline = dtrec.TrainPipeline(model, opt, batch_loss, sparse_features=lambda b: b[1])
        steps = pipeline.run(batches())
    else:
        steps = plain_loop()
    dist.barrier()
    start = time.perf_counter()
    with dtrec.comm_stats() as stats:
        for step, loss in enumerate(steps):
            if step + 1 == args.warmup:
                dist.barrier()
                start = time.perf_counter()
            losses[step] = loss
            if (step + 1) % window == 0:
                recent = losses[step + 1 - window : step + 1].mean().reshape(1)
                dist.all_reduce(recent)  # cheap: one float
                bar.set_postfix(loss=f"{recent.item() / world:.4f}", refresh=False)
            bar.update(1)
    dist.barrier()
    elapsed = time.perf_counter() - start
    bar.close()

    # Mean over ranks of every step's loss (one small all-reduce, after timing).
    summed = torch.cat([losses, torch.tensor([teacher_loss])])
    dist.all_reduce(summed)
    losses, teacher_loss = summed[:-1] / world, summed[-1].item() / (world * args.steps)
    if lead:
        timed = args.steps - args.warmup
        total = stats.total_bytes / args.steps
        first, last = losses[:10].mean().item(), losses[-10:].mean().item()
        print(
            f"loss: first 10 steps {first:.4f} -> last 10 steps {last:.4f} "
            f"(teacher's own loss {teacher_loss:.4f})"
        )
        print(
            f"throughput: {world * args.batch_size * timed / elapsed:,.0f} samples/s global "
            f"({timed} steps in {elapsed:.1f} s after {args.warmup} warmup steps, "
            f"{1000 * elapsed / timed:.0f} ms/step)"
        )
        print(f"dtrec comm per step, rank 0 (comm_stats): {stats.summary(args.steps)}")
        print(f"dtrec comm total per step, rank 0: {fmt_bytes(total)}")
        print(
            f"of which the dense gradient all-reduce (dense.grad_sync): about 2*(W-1)/W * "
            f"{fmt_bytes(dense_bytes)} of dense params"
        )
        if not last < first:
            raise RuntimeError(f"loss did not fall: {first:.4f} -> {last:.4f}")


if __name__ == "__main__":
    main()
