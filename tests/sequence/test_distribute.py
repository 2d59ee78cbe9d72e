"""``distribute_module`` on a model with an EmbeddingBagCollection, an EmbeddingCollection
and a dense part: planned, trained like the unsharded model, fused optimizer, state_dict
keys, DCP checkpoints resharded across plans and meshes, TorchRec's EmbeddingCollection.

One 4-rank world runs every case; the tests assert on its results.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.interop.torchrec_or_skip import torchrec
from tests.multiprocess import run_world

TOL = 1e-5
BATCH, STEPS = 3, 3
SEQ_TABLES = [("s0", 40, 6, ["h0", "h1"]), ("s1", 9, 4, ["h2"])]
BAG_TABLES = [("b0", 30, 5, ["p0"])]


class SeqModel(nn.Module):
    """Pooled features + per-sample sums of the sequence rows -> one linear layer."""

    def __init__(self, sequence: nn.Module | None = None) -> None:
        super().__init__()
        import dtrec

        self.pooled = dtrec.EmbeddingBagCollection(
            [dtrec.EmbeddingBagConfig(*t) for t in BAG_TABLES]
        )
        self.seq = sequence or dtrec.EmbeddingCollection(
            [dtrec.EmbeddingConfig(*t) for t in SEQ_TABLES]
        )
        width = sum(t[2] for t in BAG_TABLES) + sum(t[2] * len(t[3]) for t in SEQ_TABLES)
        self.dense = nn.Linear(width, 1)

    def forward(self, kjt) -> torch.Tensor:
        parts = [self.pooled(kjt).values()]
        for jt in self.seq(kjt).values():
            lengths = jt.lengths()
            sample = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
            rows = jt.values()
            parts.append(rows.new_zeros(lengths.numel(), rows.shape[1]).index_add(0, sample, rows))
        return self.dense(torch.cat(parts, dim=1)).squeeze(1)


def make_batch(gen: torch.Generator):
    import dtrec

    keys, values, lengths = [], [], []
    for _, rows, _, feats in BAG_TABLES + SEQ_TABLES:
        for f in feats:
            ls = torch.randint(0, 5, (BATCH,), generator=gen)
            keys.append(f)
            lengths.append(ls)
            values.append(torch.randint(0, rows, (int(ls.sum()),), generator=gen))
    kjt = dtrec.KeyedJaggedTensor(keys, torch.cat(values), torch.cat(lengths))
    return kjt, torch.randn(BATCH, generator=gen)


def _tables(model: nn.Module) -> dict[str, tuple[torch.Tensor, list[str]]]:
    """Reference table name -> (weight, its features)."""
    out = {}
    for cfg in model.pooled.embedding_bag_configs():
        out[f"pooled.{cfg.name}"] = (
            model.pooled.embedding_bags[cfg.name].weight,
            cfg.feature_names,
        )
    for cfg in model.seq.embedding_configs():
        out[f"seq.{cfg.name}"] = (model.seq.embeddings[cfg.name].weight, cfg.feature_names)
    return out


def _train_side_by_side(
    mesh, plan: dict, fused, seed: int = 0, sync_every=None, meshes=None
) -> dict:
    """Sharded vs unsharded (global batch, mean of per-rank losses); largest differences.

    ``sync_every=1`` with SGD: replicas average weights after every step instead of
    summing gradients, which for SGD is the same step. ``meshes``: per-collection meshes."""
    import torch.distributed as dist

    import dtrec
    from dtrec.checkpoint import full_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    reference = SeqModel()
    sharded = dtrec.distribute_module(
        copy.deepcopy(reference), mesh, plan, optimizer=fused, sync_every=sync_every,
        meshes=meshes,
    )  # fmt: skip
    keys_kept = list(sharded.state_dict()) == list(reference.state_dict())
    dense = [p for n, p in sharded.named_parameters() if n.startswith("dense")]
    opt = torch.optim.SGD(dense if fused is not None else sharded.parameters(), lr=0.1)
    ref_params = reference.dense.parameters() if fused is not None else reference.parameters()
    ref_opt = torch.optim.SGD(ref_params, lr=0.1)
    state = {n: fused.init_state(w) for n, (w, _) in _tables(reference).items()} if fused else {}
    gen = torch.Generator().manual_seed(seed + 1)
    loss_diff = norm_diff = 0.0
    for _ in range(STEPS):
        batches = [make_batch(gen) for _ in range(world)]
        kjt, target = batches[rank]
        loss = ((sharded(kjt) - target) ** 2).mean()
        loss.backward()
        if fused is None:  # the norm over every parameter, tables on their own meshes too
            norm = torch.nn.utils.clip_grad_norm_(sharded.parameters(), 1e9)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        opt.step()
        opt.zero_grad()
        ref_losses = [((reference(k) - t) ** 2).mean() for k, t in batches]
        torch.stack(ref_losses).mean().backward()
        loss_diff = max(loss_diff, abs(loss.item() - ref_losses[rank].item()))
        if fused is None:
            want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
            norm_diff = max(norm_diff, abs(norm.item() - want.item()))
        if fused is not None:
            for name, (weight, feats) in _tables(reference).items():
                rows = torch.unique(torch.cat([k[f].values() for k, _ in batches for f in feats]))
                grad = torch.zeros_like(weight) if weight.grad is None else weight.grad
                with torch.no_grad():
                    fused.update_rows(weight, state[name], rows, grad[rows])
                weight.grad = None
        ref_opt.step()
        ref_opt.zero_grad()
    if sync_every is not None:
        sharded.pooled.sync_replicas()
        sharded.seq.sync_replicas()
    full, want = full_state_dict(sharded), reference.state_dict()
    fused_tables = (
        sorted(sharded.fused_optimizer.state_dict()["state"]) if fused is not None else []
    )
    return {
        "loss_diff": loss_diff,
        "norm_diff": norm_diff,
        "weight_diff": max((full[k] - want[k]).abs().max().item() for k in want),
        "keys_kept": keys_kept,
        "fused_tables": fused_tables,
        "plan": {k: str(v) for k, v in sharded.sharding_plan.items()},
        "reports": sorted(sharded.sharding_plan.reports or {}),
        "explained": str(sharded.sharding_plan),
        "mesh_shapes": {
            name: tuple(getattr(sharded, name).mesh.mesh.shape) for name in ("pooled", "seq")
        },
    }


def _checkpoint_reshard(tmp: str, meshes_first: dict | None = None) -> dict:
    """Train on S=2 x R=2 with fused Adam, save; load into another plan on S=4 (other
    seed): weights and fused state must equal the saved ones, then both train alike.
    ``meshes_first``: collection -> shard group size of its own mesh in the saved model."""
    import torch.distributed as dist

    import dtrec
    from dtrec.checkpoint import full_state_dict, full_tensor, load, save
    from dtrec.placements import ColumnWise, RowWise, TableWise

    def build(shards: int, plan: dict, seed: int, own: dict | None = None):
        torch.manual_seed(seed)
        mesh = dtrec.init_mesh("cpu", shards)
        meshes = {fqn: dtrec.init_mesh("cpu", s) for fqn, s in (own or {}).items()}
        return dtrec.distribute_module(
            SeqModel(), mesh, plan, optimizer=dtrec.optim.Adam(lr=0.05), meshes=meshes
        )

    def fused_state(model) -> dict:
        return {
            f"{t}.{k}": full_tensor(v)
            for t, s in model.fused_optimizer.state_dict()["state"].items()
            for k, v in s.items()
            if v.dim()
        }

    def step(model, gen) -> float:
        batches = [make_batch(gen) for _ in range(dist.get_world_size())]
        kjt, target = batches[dist.get_rank()]
        loss = ((model(kjt) - target) ** 2).mean()
        loss.backward()
        return loss.item()

    first = build(2, {"seq.s0": RowWise(), "seq.s1": ColumnWise()}, seed=0, own=meshes_first)
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        step(first, gen)
    save(tmp, first)
    second = build(4, {"seq.s0": ColumnWise(), "seq.s1": TableWise(rank=3)}, seed=7)
    load(tmp, second)
    saved_w, loaded_w = full_state_dict(first), full_state_dict(second)
    saved_s, loaded_s = fused_state(first), fused_state(second)
    weights = max((saved_w[k] - loaded_w[k]).abs().max().item() for k in saved_w)
    states = max((saved_s[k] - loaded_s[k]).abs().max().item() for k in saved_s)
    after = [step(m, torch.Generator().manual_seed(6)) for m in (first, second)]
    return {
        "weights": weights,
        "states": states,
        "seq_state_keys": sorted(k for k in saved_s if k.startswith("seq.")),
        "loss_after": after,
    }


def _torchrec_collection() -> dict:
    """A TorchRec EmbeddingCollection in the model: sharded like dtrec's, same outputs."""
    import torch.distributed as dist

    import dtrec

    configs = [
        torchrec.EmbeddingConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=f)
        for n, r, d, f in SEQ_TABLES[:1]
    ]
    theirs = torchrec.EmbeddingCollection(tables=configs, need_indices=True)
    model = nn.Module()
    model.seq = copy.deepcopy(theirs)
    sharded = dtrec.distribute_module(model, dtrec.init_mesh("cpu", 4))
    gen = torch.Generator().manual_seed(dist.get_rank())
    kjt, _ = make_batch(gen)
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TrKJT

    want = theirs(TrKJT(kjt.keys(), kjt.values(), lengths=kjt.lengths()))
    got = sharded.seq(kjt)
    return {
        "keys": list(got) == list(want),
        "diff": max((got[f].values() - want[f].values()).abs().max().item() for f in want),
        "indices": all(torch.equal(got[f].weights(), want[f].weights()) for f in want),
        "state_keys": list(sharded.seq.state_dict()) == list(theirs.state_dict()),
    }


def _run_all(rank: int, world: int, tmp: str) -> dict:
    import dtrec
    from dtrec.placements import ColumnWise, RowWise

    out = {}
    mesh = dtrec.init_mesh("cpu", 2)
    pins = {"seq.s0": RowWise(), "seq.s1": ColumnWise()}
    out["2d_plain"] = _train_side_by_side(mesh, pins, None)
    out["2d_fused"] = _train_side_by_side(mesh, {}, dtrec.optim.RowWiseAdagrad(lr=0.1))
    out["1d_fused"] = _train_side_by_side(
        dtrec.init_mesh("cpu", 4), pins, dtrec.optim.Adam(lr=0.05)
    )
    out["2d_sync_every"] = _train_side_by_side(mesh, pins, dtrec.optim.SGD(lr=0.1), sync_every=1)
    out["checkpoint"] = _checkpoint_reshard(tmp)
    # a replication factor per collection (TorchRec's Dynamic 2D)
    mesh4, mesh1 = dtrec.init_mesh("cpu", 4), dtrec.init_mesh("cpu", 1)
    out["meshes_fused"] = _train_side_by_side(
        mesh, {}, dtrec.optim.RowWiseAdagrad(lr=0.1), meshes={"seq": mesh4}
    )
    out["meshes_plain"] = _train_side_by_side(mesh4, pins, None, meshes={"pooled": mesh1})
    out["meshes_sync_every"] = _train_side_by_side(
        mesh, pins, dtrec.optim.SGD(lr=0.1), sync_every=1, meshes={"pooled": mesh4}
    )
    out["checkpoint_meshes"] = _checkpoint_reshard(f"{tmp}/meshes", {"seq": 4, "pooled": 1})
    if torchrec is not None:
        out["torchrec"] = _torchrec_collection()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_world(4, _run_all, str(tmp_path_factory.mktemp("ckpt")))


CASES = ["2d_plain", "2d_fused", "1d_fused", "2d_sync_every"]
MESH_CASES = {  # per-collection meshes: (pooled, seq) shapes
    "meshes_fused": {"pooled": (2, 2), "seq": (4, 1)},
    "meshes_plain": {"pooled": (1, 4), "seq": (4, 1)},
    "meshes_sync_every": {"pooled": (4, 1), "seq": (2, 2)},
}


@pytest.mark.parametrize("case", CASES + list(MESH_CASES))
def test_distribute_module_trains_like_unsharded(results, case: str) -> None:
    for rank, per_rank in enumerate(results):
        r = per_rank[case]
        assert r["keys_kept"], rank
        assert r["loss_diff"] <= TOL and r["weight_diff"] <= TOL, (rank, r)
        assert r["norm_diff"] <= TOL, (rank, r["norm_diff"])  # clip_grad_norm_ across meshes
    r = results[0][case]
    assert {"seq.s0", "seq.s1", "pooled.b0"} <= set(r["plan"])
    if case not in ("2d_plain", "meshes_plain"):
        assert r["fused_tables"] == ["pooled.b0", "seq.s0", "seq.s1"]
    if case in MESH_CASES:  # each collection on its own mesh, planned and explained apart
        assert r["mesh_shapes"] == MESH_CASES[case], r["mesh_shapes"]
        shapes = MESH_CASES[case]
        assert r["reports"] == sorted(
            f"{fqn} on mesh {shape[0]} x {shape[1]}" for fqn, shape in shapes.items()
        ), r["reports"]
        assert all(f"== {name}" in r["explained"] for name in r["reports"])
    else:
        assert r["reports"] == []


@pytest.mark.parametrize("case", ["checkpoint", "checkpoint_meshes"])
def test_checkpoint_reshards_sequence_tables(results, case: str) -> None:
    """Across plans and meshes; ``checkpoint_meshes`` saves from per-collection meshes
    (pooled 1 x 4, sequence 4 x 1) and loads into one 4 x 1 mesh."""
    for per_rank in results:
        r = per_rank[case]
        assert r["weights"] == 0.0 and r["states"] == 0.0, r
        assert {k.rsplit(".", 1)[0] for k in r["seq_state_keys"]} == {"seq.s0", "seq.s1"}, r
        first, second = r["loss_after"]
        assert abs(first - second) <= TOL, r


@pytest.mark.skipif(torchrec is None, reason="torchrec (bench extra) not installed")
def test_torchrec_embedding_collection_is_sharded(results) -> None:
    for per_rank in results:
        r = per_rank["torchrec"]
        assert r["keys"] and r["indices"] and r["state_keys"], r
        assert r["diff"] == 0.0, r
