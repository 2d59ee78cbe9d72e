"""``same_batch`` on a sequence collection (``EmbeddingCollection``), 4 gloo ranks (dp 2 x tp 2).

The two ranks of a tp group feed the same batch; with ``same_batch=world["tp"]`` each looks
up its chunk of the samples and the rows are all-gathered per feature
(``dtrec.sharded.dist.batch_split.gather_sequence_rows``). Every configuration trains 3
steps and must end where the unsharded model ends on the distinct dp batches (1e-5
relative): row-, column- and table-wise tables of mixed dims, a torch optimizer and a
fused one, odd, even and one-sample batches, with and without ``need_indices``. The
tables' all-to-all bytes are about half of those without the split. One forked world.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.multiprocess import run_world

TOL = 1e-5
STEPS = 3


class SeqNet(nn.Module):
    def __init__(self, need_indices: bool = False) -> None:
        import dtrec

        super().__init__()
        self.seq = dtrec.EmbeddingCollection(
            [
                dtrec.EmbeddingConfig("rows", 20, 4, ["f0", "f1"]),
                dtrec.EmbeddingConfig("cols", 10, 8, ["f2"]),
                dtrec.EmbeddingConfig("whole", 12, 4, ["f3"]),
            ],
            need_indices=need_indices,
        )
        self.head = nn.Linear(20, 1)

    def forward(self, kjt):
        pooled = []
        for jt in self.seq(kjt).values():
            lengths = jt.lengths()
            sample = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
            first = torch.cumsum(lengths, 0) - lengths
            position = torch.arange(sample.numel()) - first[sample] + 1.0  # 1, 2, ... per bag
            rows = jt.values() * position[:, None]  # each row's gradient depends on its place
            if jt.weights_or_none() is not None:  # need_indices: the ids ride along
                rows = rows + 0 * jt.weights()[:, None]
            out = rows.new_zeros(lengths.numel(), rows.shape[1]).index_add(0, sample, rows)
            pooled.append(out)
        return self.head(torch.cat(pooled, 1)).squeeze(1)


def _plan() -> dict:
    from dtrec.placements import ColumnWise, RowWise, TableWise

    return {"seq.rows": RowWise(), "seq.cols": ColumnWise(), "seq.whole": TableWise(1)}


def _batch(step: int, group: int, size: int):
    import dtrec

    gen = torch.Generator().manual_seed(1000 * step + group + 7 * size)
    keys, values, lengths = [], [], []
    for key, rows in (("f0", 20), ("f1", 20), ("f2", 10), ("f3", 12)):
        ls = torch.randint(0, 4, (size,), generator=gen)
        keys.append(key)
        lengths.append(ls)
        values.append(torch.randint(0, rows, (int(ls.sum()),), generator=gen))
    kjt = dtrec.KeyedJaggedTensor(keys, torch.cat(values), torch.cat(lengths))
    return kjt, torch.randn(size, generator=gen)


_MESH: list = []


def _meshes():
    from torch.distributed.device_mesh import init_device_mesh

    import dtrec

    if not _MESH:
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        _MESH.extend([world, dtrec.table_mesh(world, shard=("dp", "tp"))])
    return _MESH


def _rel(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def _train(batch: int, split: bool = True, fused: bool = False, need_indices: bool = False):
    import copy

    from torch.distributed.tensor import DTensor

    import dtrec

    world, tables = _meshes()
    torch.manual_seed(0)
    ref = SeqNet(need_indices)
    rule = dtrec.optim.Adam(lr=0.01) if fused else None
    model = dtrec.distribute_module(
        copy.deepcopy(ref), tables, _plan(), optimizer=rule,
        same_batch=world["tp"] if split else None,
    )  # fmt: skip
    group, groups = world["dp"].get_local_rank(), world["dp"].size()
    ref_tables = {id(t.weight): t.weight for t in ref.seq.embeddings.values()}
    state = {k: rule.init_state(w) for k, w in ref_tables.items()} if fused else {}
    dense = [p for p in ref.parameters() if not fused or id(p) not in ref_tables]
    ref_opt = torch.optim.SGD(dense, lr=0.1)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    loss_errs, table_bytes, gather_bytes = [], [], []
    for step in range(STEPS):
        batches = [_batch(step, g, batch) for g in range(groups)]
        kjt, y = batches[group]
        with dtrec.comm_stats() as stats:
            loss = ((model(kjt) - y) ** 2).mean()
            loss.backward()
        table_bytes.append(sum(n for k, n in stats.bytes_sent.items() if "dist" in k))
        gather_bytes.append(stats.bytes_sent.get("same_batch.gather", 0))
        ref_losses = [((ref(k) - t) ** 2).mean() for k, t in batches]
        torch.stack(ref_losses).mean().backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        for cfg in ref.seq.embedding_configs() if fused else ():
            weight = ref.seq.embeddings[cfg.name].weight
            ids = torch.cat([k[f].values() for k, _ in batches for f in cfg.feature_names])
            rows = torch.unique(ids)
            grad = torch.zeros_like(weight) if weight.grad is None else weight.grad
            with torch.no_grad():
                rule.update_rows(weight, state[id(weight)], rows, grad[rows])
            weight.grad = None
        loss_errs.append(_rel(loss.detach(), ref_losses[group].detach()))
    got = dict(model.named_parameters())
    weights = {}
    for name, p in ref.named_parameters():
        mine = got[name]
        full = dtrec.checkpoint.full_tensor(mine) if isinstance(mine, DTensor) else mine
        weights[name] = _rel(full.detach(), p.detach())
    return {
        "loss": max(loss_errs),
        "weights": weights,
        "table_bytes": table_bytes,
        "gather_bytes": gather_bytes,
    }


CONFIGS = {
    "odd": dict(batch=3),
    "even": dict(batch=4),
    "even_whole": dict(batch=4, split=False),
    "one_sample": dict(batch=1),  # tp rank 1 looks up an empty chunk
    "odd_fused_adam_indices": dict(batch=3, fused=True, need_indices=True),
}


def _run_all(rank: int, world: int, configs: dict) -> dict:
    return {name: _train(**cfg) for name, cfg in configs.items()}


@pytest.fixture(scope="module")
def world_results() -> list[dict]:
    return run_world(4, _run_all, CONFIGS, timeout=600)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_split_sequence_lookups_train_like_the_unsharded_model(world_results, name) -> None:
    for rank, per_rank in enumerate(world_results):
        r = per_rank[name]
        assert r["loss"] < TOL, (rank, r)
        for param, err in r["weights"].items():
            assert err < TOL, (rank, name, param, err)
        split = CONFIGS[name].get("split", True)
        assert all((b > 0) == split for b in r["gather_bytes"]), (rank, name, r["gather_bytes"])


def test_a_tp_group_sends_its_sequence_batch_once(world_results) -> None:
    for step in range(STEPS):
        split = sum(r["even"]["table_bytes"][step] for r in world_results)
        whole = sum(r["even_whole"]["table_bytes"][step] for r in world_results)
        assert 0.3 * whole < split < 0.7 * whole, (step, split, whole)
