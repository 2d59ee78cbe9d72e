"""An HSTU-like sequence recommender with dtrec's tables composed with FSDP2/HSDP and TP.

    torchrun --standalone --nproc-per-node 8 examples/hstu_composed.py [--steps 20] [--check]

One 3-D world mesh of 8 ranks, ``(dp_replicate 2, dp_shard 2, tp 2)``, carries every
parallelism (torchtitan's layout):

- the transformer blocks are tensor parallel over "tp" (``parallelize_module``: Colwise
  on the q/k/v/u and MLP-in projections, Rowwise on the output projections), then
  HSDP over ("dp_replicate", "dp_shard") (``fully_shard`` per block, then the dense root);
- the embedding tables are sharded over the whole world by dtrec, on
  ``dtrec.table_mesh(world, shard=("dp_shard", "tp"), replicate="dp_replicate")``
  (4 shard ranks x 2 replicas), with ``same_batch=world["tp"]``: the two tp ranks of a
  dp group feed the same batch, so the item history and the pooled user features are
  looked up once per group (each tp rank half of the batch, then all-gathered).

The model (HSTU, Zhai et al. 2024, simplified): each sample is a user's item history
(a sequence feature of a sharded ``dtrec.EmbeddingCollection``, unpooled; each item's
row plus its genre's row, a side feature) followed by a candidate item; two causal
blocks with HSTU's pointwise attention (SiLU of q.k instead of a softmax, gated by a
SiLU "u" projection) read the sequence; the last position meets
the user's pooled features (``dtrec.EmbeddingBagCollection``: user id and multi-hot
interests) in a small head that predicts the click. Synthetic data: a hidden item ->
genre map; the user clicks when the candidate's genre is their history's genre or one
of their interests. Batches are deterministic per dp group (the tp ranks of a group
generate the same one).

Rank 0 prints the loss (averaged over the world) every ``--log-every`` steps and global
samples/s at the end. ``--check`` also trains an unsharded copy on rank 0 on all the dp
groups' batches and prints how far each rank's loss is from it, and how far the weights
of a second composed copy trained with SGD are from the unsharded model's (the last
section).
Runs on CUDA with nccl, else on CPU with gloo.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dtrec
from dtrec.placements import ColumnWise, RowWise, TableWise

ITEMS, USERS, INTERESTS, GENRES = 4_000, 1_000, 64, 16
MAX_LEN, DIM, HEADS, LAYERS = 16, 64, 4, 2  # HEADS divisible by the tp size
PLAN = {  # RowWise for the big tables, the small ones whole or split by columns
    "items.item": RowWise(),
    "items.genre": TableWise(rank=0),
    "users.user_id": RowWise(),
    "users.interest": TableWise(rank=1),
    "users.interest_genre": ColumnWise(),
}


# ---- the model (written for one device; nothing distributed in it) -------------------


class HSTUBlock(nn.Module):
    """Pre-norm HSTU layer: u, q, k, v = SiLU(W x); y = x + W_o(norm(A v) * u) with
    A = SiLU(q k^T / sqrt(d)) / L under a causal, padding-aware mask; then a SiLU MLP.
    Heads are counted from the projections' local width, so the same code runs whole
    or with the projections column-split over tp (each tp rank owns HEADS / tp heads)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.q, self.k, self.v, self.u = (nn.Linear(DIM, DIM) for _ in range(4))
        self.out = nn.Linear(DIM, DIM)
        self.mlp_norm = nn.LayerNorm(DIM)
        self.mlp_in = nn.Linear(DIM, 2 * DIM)
        self.mlp_out = nn.Linear(2 * DIM, DIM)

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        batch, length, _ = x.shape
        head_dim = DIM // HEADS
        h = self.norm(x)
        q, k, v, u = (
            F.silu(p(h)).view(batch, length, -1, head_dim) for p in (self.q, self.k, self.v, self.u)
        )
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / head_dim**0.5
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        mask = causal & keep[:, None, None, :]  # [B, 1, L, L]: past, real positions only
        attn = F.silu(scores) * mask / length
        mixed = torch.einsum("bhqk,bkhd->bqhd", attn, v)
        mixed = F.layer_norm(mixed, (head_dim,)) * u  # per-head norm: local under TP
        x = x + self.out(mixed.reshape(batch, length, -1))
        return x + self.mlp_out(F.silu(self.mlp_in(self.mlp_norm(x))))


class DenseTower(nn.Module):
    """Everything dense: positions, the blocks and the click head."""

    def __init__(self, user_dim: int) -> None:
        super().__init__()
        self.position = nn.Parameter(torch.randn(MAX_LEN + 1, DIM) * 0.02)
        self.blocks = nn.ModuleList(HSTUBlock() for _ in range(LAYERS))
        self.final_norm = nn.LayerNorm(DIM)
        self.head = nn.Sequential(nn.Linear(DIM + user_dim, 64), nn.SiLU(), nn.Linear(64, 1))

    def forward(self, seq: Tensor, keep: Tensor, user: Tensor) -> Tensor:
        x = seq + self.position
        for block in self.blocks:
            x = block(x, keep)
        last = self.final_norm(x[:, -1])  # the candidate's position: it saw the history
        return self.head(torch.cat([last, user], dim=1))  # [B, 1]: FSDP warns on a view out


class HSTURecommender(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.items = dtrec.EmbeddingCollection(  # sequence (unpooled) lookups
            [
                dtrec.EmbeddingConfig("item", ITEMS, DIM, ["history", "candidate"]),
                dtrec.EmbeddingConfig("genre", GENRES, DIM, ["history_genre", "candidate_genre"]),
            ]
        )
        self.users = dtrec.EmbeddingBagCollection(  # pooled user features
            [
                dtrec.EmbeddingBagConfig("user_id", USERS, 16, ["user_id"]),
                dtrec.EmbeddingBagConfig("interest", INTERESTS, 16, ["interest"], pooling="mean"),
                dtrec.EmbeddingBagConfig("interest_genre", GENRES, 16, ["interest_genre"]),
            ]
        )
        self.dense = DenseTower(user_dim=48)

    def forward(
        self, seq_kjt: dtrec.KeyedJaggedTensor, user_kjt: dtrec.KeyedJaggedTensor
    ) -> Tensor:
        rows = self.items(seq_kjt)
        history = rows["history"]  # each item's row plus its genre's row (a side feature)
        tokens = history.values() + rows["history_genre"].values()
        candidate = rows["candidate"].values() + rows["candidate_genre"].values()
        seq, keep = left_padded(tokens, history.lengths(), candidate)
        return self.dense(seq, keep, self.users(user_kjt).values()).squeeze(1)


def left_padded(rows: Tensor, lengths: Tensor, last: Tensor) -> tuple[Tensor, Tensor]:
    """Jagged history rows ``[ids, D]`` + one row per sample -> ``[B, MAX_LEN + 1, D]``,
    the history right-aligned before the candidate, and the mask of real positions."""
    batch = lengths.numel()
    offsets = torch.cumsum(lengths, 0) - lengths
    index = torch.arange(rows.shape[0], device=rows.device)
    position = (
        MAX_LEN - lengths.repeat_interleave(lengths) + index - offsets.repeat_interleave(lengths)
    )
    sample = torch.arange(batch, device=rows.device).repeat_interleave(lengths)
    seq = rows.new_zeros(batch, MAX_LEN + 1, rows.shape[1]).index_put((sample, position), rows)
    seq[:, MAX_LEN] = last
    slots = torch.arange(MAX_LEN + 1, device=rows.device)
    return seq, slots.unsqueeze(0) >= (MAX_LEN - lengths).unsqueeze(1)


# ---- synthetic data, deterministic per (step, dp group) ------------------------------


def genre_of(items: Tensor) -> Tensor:
    return (items * 2654435761) % 2**32 % GENRES


def make_batch(step: int, dp_group: int, batch: int, device: torch.device):
    """The batch of one dp group at one step: every tp rank of the group gets this one."""
    gen = torch.Generator().manual_seed(10_000 * dp_group + step)
    by_genre = torch.argsort(genre_of(torch.arange(ITEMS)))
    per_genre = ITEMS // GENRES

    def items_of(genres: Tensor) -> Tensor:
        return by_genre[
            genres * per_genre + torch.randint(0, per_genre, genres.shape, generator=gen)
        ]

    lengths = torch.randint(1, MAX_LEN + 1, (batch,), generator=gen)
    genre = torch.randint(0, GENRES, (batch,), generator=gen)
    hist_genre = genre.repeat_interleave(lengths)
    noise = torch.rand(hist_genre.shape, generator=gen) < 0.3
    hist_genre = torch.where(
        noise, torch.randint(0, GENRES, hist_genre.shape, generator=gen), hist_genre
    )
    cand_genre = torch.where(
        torch.rand(batch, generator=gen) < 0.4,
        genre,
        torch.randint(0, GENRES, (batch,), generator=gen),
    )
    n_interest = torch.randint(0, 4, (batch,), generator=gen)  # some users have none
    interest = torch.randint(0, INTERESTS, (int(n_interest.sum()),), generator=gen)
    interest_genre = interest % GENRES
    liked = cand_genre == genre
    sample = torch.arange(batch).repeat_interleave(n_interest)
    liked[sample[interest_genre == cand_genre.repeat_interleave(n_interest)]] = True
    labels = torch.where(torch.rand(batch, generator=gen) < 0.9, liked, ~liked).float()
    ones = torch.ones(batch, dtype=torch.long)
    history, candidate = items_of(hist_genre), items_of(cand_genre)
    seq = dtrec.KeyedJaggedTensor.from_lengths_sync(
        keys=["history", "candidate", "history_genre", "candidate_genre"],
        values=torch.cat([history, candidate, genre_of(history), genre_of(candidate)]),
        lengths=torch.cat([lengths, ones, lengths, ones]),
    )
    user = dtrec.KeyedJaggedTensor.from_lengths_sync(
        keys=["user_id", "interest", "interest_genre"],
        values=torch.cat(
            [torch.randint(0, USERS, (batch,), generator=gen), interest, interest_genre]
        ),
        lengths=torch.cat([ones, n_interest, n_interest]),
    )
    return seq.to(device), user.to(device), labels.to(device)


# ---- parallelizing: TP, then FSDP/HSDP, then the tables ------------------------------


def parallelize(
    model: HSTURecommender, world: DeviceMesh, optimizer: dtrec.optim.FusedOptimizer | None = None
) -> HSTURecommender:
    """TP + HSDP on the dense tower, the tables on ``world`` (``optimizer``: a fused table
    update, as ``dtrec.distribute_module`` takes it; None leaves the tables to a torch
    optimizer). ``benchmarks/composed.py`` times this composition."""
    for block in model.dense.blocks:
        # 1. TP first: fully_shard then shards the TP DTensors over dp (torchtitan's order).
        #    Colwise on the projections into the heads/MLP, Rowwise on those out of them:
        #    one all-reduce per attention and per MLP.
        plan = {name: ColwiseParallel() for name in ("q", "k", "v", "u", "mlp_in")}
        plan |= {"out": RowwiseParallel(), "mlp_out": RowwiseParallel()}
        parallelize_module(block, world["tp"], plan)
        # 2. FSDP per block: each block's parameters are gathered only around its own
        #    forward/backward; HSDP: sharded over dp_shard, replicated over dp_replicate.
        fully_shard(block, mesh=world["dp_replicate", "dp_shard"])
    # 3. The dense root last: it takes what the blocks left (positions, norms, head).
    #    Not the model's root: the tables are DTensors of dtrec's, on their own mesh.
    fully_shard(model.dense, mesh=world["dp_replicate", "dp_shard"])
    # 4. The tables over the whole world (after FSDP/TP: dtrec leaves their DTensors
    #    alone); a tp group's lookups are split between its ranks (same_batch).
    tables = dtrec.table_mesh(world, shard=("dp_shard", "tp"), replicate="dp_replicate")
    return dtrec.distribute_module(model, tables, PLAN, optimizer=optimizer, same_batch=world["tp"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per dp group")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--check", action="store_true", help="compare with an unsharded copy")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda" if cuda else "cpu")
    rank = dist.get_rank()
    world = init_device_mesh(  # 8 ranks; torchtitan's dim names
        device.type, (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp")
    )
    dp_groups = world["dp_replicate"].size() * world["dp_shard"].size()
    dp_group = (
        world["dp_replicate"].get_local_rank() * world["dp_shard"].size()
        + world["dp_shard"].get_local_rank()
    )

    torch.manual_seed(0)  # the same initial model on every rank
    model = HSTURecommender().to(device)
    reference = copy.deepcopy(model) if args.check and rank == 0 else None
    model = parallelize(model, world)
    # One torch optimizer over every parameter: the tables' DTensors (dtrec) and the
    # blocks' (FSDP x TP). For big tables, distribute_module(..., optimizer=
    # dtrec.optim.RowWiseAdagrad(lr)) instead updates the touched rows inside backward.
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.BCEWithLogitsLoss()

    losses, start = [], None
    for step in range(args.steps):
        if step == 1:  # the first step builds process groups and caches
            start = time.perf_counter()
        seq, user, labels = make_batch(step, dp_group, args.batch_size, device)
        loss = loss_fn(model(seq, user), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # every dp group counted tp times: the mean over dp groups
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {mean.item() / dist.get_world_size():.4f}", flush=True)
    if args.steps > 1:
        elapsed = time.perf_counter() - start
        samples = (args.steps - 1) * args.batch_size * dp_groups  # distinct samples
        if rank == 0:
            print(f"{samples / elapsed:.1f} samples/s ({samples} samples in {elapsed:.2f} s)")

    if args.check:
        check(reference, torch.stack(losses), dp_group, dp_groups, args, world)
    dist.barrier()
    dist.destroy_process_group()


# ---- --check: the same steps on one unsharded copy -----------------------------------

CHECK_STEPS = 3


def check(reference, losses: Tensor, dp_group: int, groups: int, args, world) -> None:
    """Rank 0 trains ``reference`` (the model before parallelizing) on every dp group's
    batch, loss = the mean of the groups' losses (what the composed model optimizes),
    and prints the largest relative difference of any rank's loss from the reference's
    on that rank's dp group, over the first ``CHECK_STEPS`` steps. Then a second composed
    copy of the initial model and an unsharded one train ``CHECK_STEPS`` steps with SGD,
    and rank 0 prints the largest difference of their weights, relative to each
    parameter's largest value. (Not with Adam: its normalised step turns float noise in
    gradients near its eps, ~1e-8 here, into whole steps.)"""
    steps, device = min(CHECK_STEPS, args.steps), losses.device
    mine = torch.cat([torch.tensor([float(dp_group)], device=device), losses[:steps]])
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)  # each rank's (dp group, losses)
    torch.manual_seed(0)  # the initial model again, on every rank
    composed = parallelize(HSTURecommender().to(device), world)
    sgd = torch.optim.SGD(composed.parameters(), lr=args.lr)
    for step in range(steps):
        seq, user, labels = make_batch(step, dp_group, args.batch_size, device)
        sgd.zero_grad()
        F.binary_cross_entropy_with_logits(composed(seq, user), labels).backward()
        sgd.step()
    trained = dtrec.checkpoint.full_state_dict(composed)  # collective: full CPU tensors
    if dist.get_rank() != 0:
        return
    torch.manual_seed(0)
    unsharded = HSTURecommender().to(device)
    runs = ((reference, torch.optim.Adam(reference.parameters(), lr=args.lr)),
            (unsharded, torch.optim.SGD(unsharded.parameters(), lr=args.lr)))  # fmt: skip
    worst = 0.0
    for step in range(steps):
        batches = [make_batch(step, g, args.batch_size, device) for g in range(groups)]
        for model, opt in runs:
            want = [F.binary_cross_entropy_with_logits(model(s, u), y) for s, u, y in batches]
            opt.zero_grad()
            torch.stack(want).mean().backward()
            opt.step()
            for got in gathered if model is reference else ():
                ref = want[int(got[0])].detach()
                worst = max(worst, ((got[1 + step] - ref).abs() / ref.abs()).item())
    print(f"check: max relative loss difference vs the unsharded model, {steps} steps: {worst:.2e}")
    errors = {
        key: ((trained[key] - want.cpu()).abs().max() / want.abs().max()).item()
        for key, want in unsharded.state_dict().items()
    }
    key = max(errors, key=errors.__getitem__)
    print(
        f"check: max relative weight difference vs the unsharded model, sgd, {steps} steps: "
        f"{errors[key]:.2e} ({key})"
    )


if __name__ == "__main__":
    main()
