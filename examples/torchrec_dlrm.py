"""TorchRec's DLRM, model code unchanged, trained 2D-parallel with dtrec.

    torchrun --standalone --nproc-per-node 4 examples/torchrec_dlrm.py [--steps 60]

What a TorchRec user changes: ``DistributedModelParallel(model, plan=...)`` becomes
``dtrec.distribute_module(model, mesh, plan, optimizer=...)``. Everything else is
TorchRec's: ``torchrec.models.dlrm.DLRM`` over a ``torchrec.EmbeddingBagCollection``
of ``torchrec.EmbeddingBagConfig``s, batches as TorchRec ``KeyedJaggedTensor``s, and a
``torch.optim.lr_scheduler`` (linear warm-up, then exponential decay) driving both the
fused embedding optimizer and the dense one. At the end the model is checkpointed
with ``dtrec.checkpoint``, reloaded into a second distributed model under another
plan, and its full weights loaded into a plain, unsharded TorchRec DLRM: all three
predict the same on the same batch (rank 0 prints the largest differences).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist
import torchrec
from torchrec.models.dlrm import DLRM

import dtrec
from dtrec.placements import ColumnWise, DataParallel, RowWise, TableWise

NUM_DENSE = 8
DIM = 16
# (table, rows, features, pooling)
TABLES = [
    ("user", 20_000, ["user_id"], torchrec.PoolingType.SUM),
    ("item", 10_000, ["item_id", "item_history"], torchrec.PoolingType.MEAN),
    ("query", 5_000, ["query_terms"], torchrec.PoolingType.MEAN),
    ("geo", 1_000, ["geo"], torchrec.PoolingType.SUM),
    ("hour", 100, ["hour"], torchrec.PoolingType.SUM),
]
FEATURES = [f for _, _, features, _ in TABLES for f in features]
# "<collection fqn>.<table>"; TorchRec's DLRM keeps its EBC at sparse_arch.embedding_bag_collection
PLAN = {
    "sparse_arch.embedding_bag_collection.user": RowWise(),
    "sparse_arch.embedding_bag_collection.item": ColumnWise(),
    "sparse_arch.embedding_bag_collection.query": TableWise(rank=1),
    "sparse_arch.embedding_bag_collection.hour": DataParallel(),
}  # "geo" is left to dtrec's planner


def build_dlrm() -> DLRM:
    """TorchRec's model code, as a TorchRec user writes it (same seed on every rank)."""
    torch.manual_seed(0)
    ebc = torchrec.EmbeddingBagCollection(
        tables=[
            torchrec.EmbeddingBagConfig(
                name=name,
                num_embeddings=rows,
                embedding_dim=DIM,
                feature_names=features,
                pooling=pooling,
            )  # fmt: skip
            for name, rows, features, pooling in TABLES
        ]
    )
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[32, DIM],
        over_arch_layer_sizes=[32, 1],
    )


def make_batch(gen: torch.Generator, batch: int):
    """(dense features, TorchRec KJT, labels): Zipf-like ids, 0-4 ids per bag."""
    lengths = torch.randint(0, 5, (len(FEATURES) * batch,), generator=gen)
    rows = [rows for _, rows, features, _ in TABLES for _ in features]
    ids = []
    for f, n in enumerate(rows):
        count = int(lengths[f * batch : (f + 1) * batch].sum())
        ids.append((torch.rand(count, generator=gen) ** 3 * n).long())
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=FEATURES, values=torch.cat(ids), lengths=lengths
    )
    dense = torch.randn(batch, NUM_DENSE, generator=gen)
    labels = (dense[:, 0] + 0.1 * torch.randn(batch, generator=gen) > 0).float()
    return dense, kjt, labels


def warmup_then_decay(warmup: int, decay: float):
    return lambda step: (step + 1) / warmup if step < warmup else decay ** (step - warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--shard-group-size", type=int, default=2)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = dtrec.init_mesh("cpu", shard_group_size=args.shard_group_size)
    model = dtrec.distribute_module(
        build_dlrm(), mesh, PLAN, optimizer=dtrec.optim.RowWiseAdagrad(lr=0.05)
    )
    dense_params = [p for n, p in model.named_parameters() if "embedding_bags" not in n]
    dense_opt = torch.optim.Adagrad(dense_params, lr=0.05)
    schedule = warmup_then_decay(warmup=10, decay=0.98)
    schedulers = [
        torch.optim.lr_scheduler.LambdaLR(model.fused_optimizer, schedule),
        torch.optim.lr_scheduler.LambdaLR(dense_opt, schedule),
    ]
    if rank == 0:
        print(model.sharding_plan)
    gen = torch.Generator().manual_seed(1000 + rank)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for step in range(args.steps):
        dense, kjt, labels = make_batch(gen, args.batch_size)
        loss = loss_fn(model(dense, kjt).squeeze(1), labels)
        dense_opt.zero_grad()
        loss.backward()  # the embedding update happens here, with this step's lr
        dense_opt.step()
        model.fused_optimizer.step()  # a no-op, kept so the schedulers see an optimizer step
        for scheduler in schedulers:
            scheduler.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            lr = model.fused_optimizer.param_groups[0]["lr"]
            print(f"step {step:3d}  loss {loss.item():.4f}  embedding lr {lr:.4f}")

    # checkpoint -> a second distributed model under another plan, and a plain TorchRec DLRM
    probe = make_batch(torch.Generator().manual_seed(7), 32)
    with torch.no_grad():
        before = model(probe[0], probe[1])
    path = [tempfile.mkdtemp(prefix="dtrec_dlrm_") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    dtrec.checkpoint.save(path[0], model)
    reloaded = dtrec.distribute_module(
        build_dlrm(), mesh, None, optimizer=dtrec.optim.RowWiseAdagrad(lr=0.05)
    )
    dtrec.checkpoint.load(path[0], reloaded)
    full = dtrec.checkpoint.to_full_state_dict(model.state_dict())
    with torch.no_grad():
        again = reloaded(probe[0], probe[1])
        plain = build_dlrm()
        plain.load_state_dict(full)
        unsharded = plain(probe[0], probe[1])
    if rank == 0:
        print(
            f"predictions after reload: distributed (other plan) differs by "
            f"{(again - before).abs().max().item():.2e}, unsharded TorchRec DLRM by "
            f"{(unsharded - before).abs().max().item():.2e}"
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
