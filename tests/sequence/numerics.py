"""Sequence numerics harness: a sharded EmbeddingCollection trains like the unsharded one.

Every rank draws every rank's batch (same generator), runs its own through the sharded
collection and all of them through an unsharded reference; the reference's loss is the
mean of the per-rank losses (the numerics contract), so its gradients are the averaged
ones the sharded tables must get.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import dtrec
from dtrec.placements import ColumnWise, DataParallel, Grid, RowWise, TableRowWise, TableWise
from dtrec.placements.mesh import shard_axis
from dtrec.sharded.sequence import ShardedEmbeddingCollection

TABLES = [
    # (name, rows, dim, features): mixed dims; 3 rows < 4 shards gives empty row shards
    ("t0", 50, 8, ["f0", "f1"]),
    ("t1", 3, 5, ["f2"]),
    ("t2", 97, 7, ["f3"]),
    ("t3", 20, 4, ["f4"]),
]
UNIFORM_TABLES = [(name, rows, 8, feats) for name, rows, _, feats in TABLES]
"""One dim everywhere: outputs are placed in whole rows (or column blocks), not columns."""
MAX_LEN = 6


def plans(mesh) -> dict[str, dict[str, dtrec.placements.TableSpec]]:
    """Every sharding type, with positions / nodes resolved (no planner here)."""
    axis = shard_axis(mesh)
    names = [t[0] for t in TABLES]
    nodes = axis.nodes or 1
    return {
        "data_parallel": {n: DataParallel() for n in names},
        "table_wise": {n: TableWise(rank=i % axis.size) for i, n in enumerate(names)},
        "row_wise": {n: RowWise() for n in names},
        "column_wise": {n: ColumnWise() for n in names},
        "table_row_wise": {n: TableRowWise(node=i % nodes) for i, n in enumerate(names)},
        "grid": {n: Grid() for n in names},
        "mixed": {
            "t0": RowWise(),
            "t1": TableWise(rank=axis.size - 1),
            "t2": ColumnWise(),
            "t3": DataParallel(),
        },  # fmt: skip
    }


def make_tables(tables: list[tuple] = TABLES) -> list[dtrec.EmbeddingConfig]:
    return [dtrec.EmbeddingConfig(*t) for t in tables]


def make_batch(
    batch: int, gen: torch.Generator, tables: list[tuple] = TABLES
) -> dtrec.KeyedJaggedTensor:
    """Random jagged ids: empty bags, max-length bags, repeated ids, sometimes a feature
    with no ids at all."""
    keys, values, lengths = [], [], []
    for _, rows, _, feats in tables:
        for f in feats:
            ls = torch.randint(0, MAX_LEN + 1, (batch,), generator=gen)
            if batch and int(torch.randint(0, 4, (1,), generator=gen)) == 0:
                ls.zero_()
            if batch > 1:
                ls[0], ls[1] = 0, MAX_LEN
            keys.append(f)
            lengths.append(ls)
            values.append(torch.randint(0, rows, (int(ls.sum()),), generator=gen))
    return dtrec.KeyedJaggedTensor(keys, torch.cat(values), torch.cat(lengths))


def loss_of(out: dict[str, dtrec.JaggedTensor]) -> torch.Tensor:
    """A non-linear loss of every row (so gradients depend on the weights)."""
    total = torch.zeros(())
    for k, jt in enumerate(out.values()):
        total = total + ((jt.values() - 0.1 * (k + 1)) ** 2).sum()
    return total


@dataclass
class Result:
    max_output_diff: float = 0.0
    max_grad_diff: float = 0.0
    max_weight_diff: float = 0.0
    keys_match: bool = True
    lengths_match: bool = True
    output_dist_calls: int = 0
    """Forward ``sequence_output_dist`` all-to-alls on this rank."""
    output_dist_bytes: int = 0
    """Bytes this rank sent in them."""
    expected_bytes_all_ranks: int = 0
    """Rows x block cols x 4 of every id whose block sits at another shard position."""


def check_sequence_numerics(
    mesh,
    plan: dict[str, dtrec.placements.TableSpec],
    fused: dtrec.optim.FusedOptimizer | None,
    steps: int = 3,
    seed: int = 0,
    lr: float = 0.1,
    tables: list[tuple] = TABLES,
    batch_sizes: list[list[int]] | None = None,
) -> Result:
    """Train sharded and unsharded side by side; return the largest differences.

    ``batch_sizes``: per step, every rank's batch size (uneven, 0 included); default:
    ``1 + 2 * step`` on every rank for ``steps`` steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    reference = dtrec.EmbeddingCollection(make_tables(tables), need_indices=True)
    weights = {n: e.weight.detach().clone() for n, e in reference.embeddings.items()}
    sharded = ShardedEmbeddingCollection(
        make_tables(tables), weights, mesh, plan, optimizer=fused, need_indices=True
    )
    # this rank's stored block (a fully sharded table's: its owner slice)
    blocks = {n: t.block for n, t in sharded.embeddings.items()}
    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    opt = torch.optim.SGD(sharded.parameters(), lr=lr) if fused is None else None
    state = (
        {n: fused.init_state(e.weight) for n, e in reference.embeddings.items()} if fused else {}
    )
    gen = torch.Generator().manual_seed(seed + 1)
    result = Result()

    def block_of(name: str, full: torch.Tensor) -> torch.Tensor:
        b = blocks[name]
        return full[b.rows[0] : b.rows[1], b.cols[0] : b.cols[1]]

    if batch_sizes is None:
        batch_sizes = [[1 + 2 * step] * world for step in range(steps)]
    for sizes in batch_sizes:
        batches = [make_batch(sizes[r], gen, tables) for r in range(world)]
        with dtrec.comm_stats() as stats:
            out = sharded(batches[rank])
        result.output_dist_calls += stats.calls.get("sequence_output_dist", 0)
        result.output_dist_bytes += stats.bytes_sent.get("sequence_output_dist", 0)
        result.expected_bytes_all_ranks += crossing_bytes(sharded, batches, mesh)
        loss_of(out).backward()
        ref_outs = [reference(b) for b in batches]
        torch.stack([loss_of(o) for o in ref_outs]).mean().backward()
        mine = ref_outs[rank]
        result.keys_match &= list(out) == list(mine)
        for f, jt in mine.items():
            result.lengths_match &= torch.equal(out[f].lengths(), jt.lengths())
            result.lengths_match &= torch.equal(out[f].weights(), jt.weights())
            if jt.values().numel():
                diff = (out[f].values() - jt.values()).abs().max().item()
                result.max_output_diff = max(result.max_output_diff, diff)
        for name, table in sharded.embeddings.items():
            if blocks[name] is None or fused is not None:
                continue
            got, want = table.weight.grad, reference.embeddings[name].weight.grad
            got_local = torch.zeros_like(table.weight.to_local()) if got is None else got.to_local()
            want = torch.zeros_like(reference.embeddings[name].weight) if want is None else want
            if got_local.numel():
                diff = (got_local - block_of(name, want)).abs().max().item()
                result.max_grad_diff = max(result.max_grad_diff, diff)
        if opt is not None:
            opt.step()
            opt.zero_grad()
        if fused is not None:
            fused_reference_step(reference, fused, state, batches)
        ref_opt.step()
        ref_opt.zero_grad()

    sharded.flush_offloaded()  # offloaded tables: the host tier is the table
    for name, table in sharded.embeddings.items():
        if blocks[name] is None:
            continue
        want = block_of(name, reference.embeddings[name].weight.detach())
        if want.numel():
            diff = (table.weight.to_local() - want).abs().max().item()
            result.max_weight_diff = max(result.max_weight_diff, diff)
    return result


def crossing_bytes(sharded: ShardedEmbeddingCollection, batches: list, mesh) -> int:
    """Bytes the forward output dist must move, summed over ranks: an id's row block of
    ``cols`` columns travels when it sits at another shard position than the id's rank."""
    replicas = shard_axis(mesh).replicas
    total = 0
    for r, batch in enumerate(batches):
        for cfg in sharded.embedding_configs():
            layout = sharded.embeddings[cfg.name].layout
            if layout.batch_local:
                continue
            ids = torch.cat([batch[f].values() for f in cfg.feature_names])
            for block in layout.blocks:
                if block.position != r // replicas:
                    inside = ((ids >= block.rows[0]) & (ids < block.rows[1])).sum()
                    total += int(inside) * block.num_cols * 4
    return total


def fused_reference_step(
    model: dtrec.EmbeddingCollection,
    fused: dtrec.optim.FusedOptimizer,
    state: dict[str, dict[str, torch.Tensor]],
    batches: list[dtrec.KeyedJaggedTensor],
) -> None:
    """The unsharded fused step: the rule on the rows the global batch touched."""
    for cfg in model.embedding_configs():
        weight = model.embeddings[cfg.name].weight
        ids = torch.cat([b[f].values() for b in batches for f in cfg.feature_names])
        rows = torch.unique(ids.long())
        grad = torch.zeros_like(weight) if weight.grad is None else weight.grad
        with torch.no_grad():  # also without rows: the sharded tables step every time
            fused.update_rows(weight, state[cfg.name], rows, grad[rows].float())
        weight.grad = None
