"""Position-weighted features, sharded: the position weights train as on one device.

The weights a feature processor computes travel with the ids to the ranks holding the
rows and their gradients travel back, so under every sharding type (1D and 2D meshes,
fused or torch optimizers) the tables, the position weights and the dense layer after
a few steps equal the unsharded model's trained on the global batch. TorchRec's own
``FeatureProcessedEmbeddingBagCollection``, distributed by dtrec, is checked against
itself unsharded.
"""

from __future__ import annotations

import copy
import importlib.util
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.multiprocess import run_world

TOLERANCE = 1e-5
TABLES = [("t0", 50, 8, ["f0", "f1"]), ("t1", 3, 5, ["f2"]), ("t2", 97, 7, ["f3"])]
MAX_LENGTH = 6
STEPS = 3
MESHES = {"1d": 4, "2d": 2}  # shard group size on 4 ranks
PLANS = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel", "mixed")
FUSED = {"none": None, "sgd": ("SGD", 0.5), "rowwise_adagrad": ("RowWiseAdagrad", 0.1)}
FUSED_PLANS = ("column_wise", "mixed")
HAS_TORCHREC = importlib.util.find_spec("torchrec") is not None


def _plan(name: str) -> dict:
    from dtrec.placements import ColumnWise, DataParallel, RowWise, TableRowWise, TableWise

    specs = {
        "table_wise": dict.fromkeys(("t0", "t1", "t2"), TableWise(rank=None)),
        "row_wise": dict.fromkeys(("t0", "t1", "t2"), RowWise()),
        "column_wise": dict.fromkeys(("t0", "t1", "t2"), ColumnWise()),
        "table_row_wise": dict.fromkeys(("t0", "t1", "t2"), TableRowWise()),
        "data_parallel": dict.fromkeys(("t0", "t1", "t2"), DataParallel()),
        "mixed": {"t0": RowWise(), "t1": TableWise(rank=0), "t2": ColumnWise()},
    }[name]
    return {f"sparse._embedding_bag_collection.{t}": spec for t, spec in specs.items()}


class FPModel(nn.Module):
    """Position-weighted embeddings -> one linear layer."""

    def __init__(self, sparse: nn.Module) -> None:
        super().__init__()
        self.sparse = sparse
        dims = sum(dim * len(feats) for _, _, dim, feats in TABLES)
        self.dense = nn.Linear(dims, 1)

    def forward(self, kjt: object) -> torch.Tensor:
        return self.dense(self.sparse(kjt).values()).squeeze(1)


def dtrec_model(processors: str) -> FPModel:
    import dtrec

    tables = [dtrec.EmbeddingBagConfig(n, rows, dim, feats) for n, rows, dim, feats in TABLES]
    ebc = dtrec.EmbeddingBagCollection(tables, is_weighted=True)
    features = [f for *_, feats in TABLES for f in feats]
    if processors == "modules":
        fps: object = {f: dtrec.PositionWeightedModule(MAX_LENGTH) for f in features}
    else:
        fps = dtrec.PositionWeightedModuleCollection(dict.fromkeys(features, MAX_LENGTH))
    model = FPModel(dtrec.FeatureProcessedEmbeddingBagCollection(ebc, fps))
    _randomize_position_weights(model)
    return model


def torchrec_model(processors: str) -> FPModel:
    import torchrec
    from torchrec.modules.feature_processor_ import (
        PositionWeightedModule,
        PositionWeightedModuleCollection,
    )
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    tables = [
        torchrec.EmbeddingBagConfig(
            name=n, num_embeddings=rows, embedding_dim=dim, feature_names=feats
        )
        for n, rows, dim, feats in TABLES
    ]
    ebc = torchrec.EmbeddingBagCollection(tables, is_weighted=True)
    features = [f for *_, feats in TABLES for f in feats]
    if processors == "modules":
        fps: object = {f: PositionWeightedModule(MAX_LENGTH) for f in features}
    else:
        fps = PositionWeightedModuleCollection(dict.fromkeys(features, MAX_LENGTH))
    model = FPModel(FeatureProcessedEmbeddingBagCollection(ebc, fps))
    _randomize_position_weights(model)
    return model


def _randomize_position_weights(model: nn.Module) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "position_weight" in name:
                param.uniform_(0.5, 1.5)


def make_batch(gen: torch.Generator, batch: int = 3, kjt_type: object = None) -> tuple:
    """A random weighted-less batch: empty bags, repeated ids, bags of MAX_LENGTH ids."""
    import dtrec

    keys, values, lengths = [], [], []
    for _, rows, _, feats in TABLES:
        for f in feats:
            ls = torch.randint(0, MAX_LENGTH + 1, (batch,), generator=gen)
            keys.append(f)
            lengths.append(ls)
            values.append(torch.randint(0, rows, (int(ls.sum()),), generator=gen))
    cls = kjt_type or dtrec.KeyedJaggedTensor
    kjt = cls.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
    return kjt, torch.randn(batch, generator=gen)


def _fused_rule(name: str):
    import dtrec

    if FUSED[name] is None:
        return None
    rule, lr = FUSED[name]
    return getattr(dtrec.optim, rule)(lr=lr)


def check_training(
    mesh, reference: FPModel, plan: str, fused_name: str, kjt_type=None, batch_sizes=None
) -> dict:
    """Train ``reference`` unsharded on the global batch and a sharded copy on each rank's
    part; the largest differences of loss, table blocks, position weights and dense.
    ``batch_sizes``: per step, every rank's batch size (default: 3 everywhere, ``STEPS``
    steps); each rank's loss is over its own batch (``rank_loss``)."""
    from torch.distributed.tensor import DTensor

    import dtrec
    from dtrec.placements.mesh import shard_position
    from tests.distributed.numerics import rank_loss

    rank, world = dist.get_rank(), dist.get_world_size()
    fused = _fused_rule(fused_name)
    sharded = dtrec.distribute_module(copy.deepcopy(reference), mesh, _plan(plan), optimizer=fused)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.3)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.3)
    ref_ebc = reference.sparse._embedding_bag_collection
    state = (
        {n: fused.init_state(t.weight) for n, t in ref_ebc.embedding_bags.items()} if fused else {}
    )
    initial = {n: p.detach().clone() for n, p in reference.named_parameters() if "position" in n}
    gen = torch.Generator().manual_seed(7)
    loss_diff = 0.0
    for sizes in batch_sizes or [[3] * world] * STEPS:
        batches = [make_batch(gen, sizes[r], kjt_type=kjt_type) for r in range(world)]
        kjt, target = batches[rank]
        loss = rank_loss(sharded(kjt), target)
        loss.backward()
        ref_losses = [rank_loss(reference(k), t) for k, t in batches]
        torch.stack(ref_losses).mean().backward()
        loss_diff = max(loss_diff, abs(loss.item() - ref_losses[rank].item()))
        opt.step()
        opt.zero_grad()
        if fused is not None:
            from tests.distributed.numerics import fused_reference_update

            cfgs = ref_ebc.embedding_bag_configs()
            shim = types.SimpleNamespace(sparse=ref_ebc)
            fused_reference_update(
                shim, cfgs, fused, state, [dtrec.sparse.as_kjt(k) for k, _ in batches]
            )
        ref_opt.step()
        ref_opt.zero_grad()
    position = shard_position(mesh)
    table_diff = 0.0
    for name, table in sharded.sparse._embedding_bag_collection.embedding_bags.items():
        block = table.layout.block_at(position)
        if block is None:
            continue
        want = ref_ebc.embedding_bags[name].weight.detach()
        want = want[block.rows[0] : block.rows[1], block.cols[0] : block.cols[1]]
        got = table.weight.to_local()
        if got.numel():
            table_diff = max(table_diff, (got - want).abs().max().item())
    dense = dict(reference.named_parameters())
    position_diff, position_moved = 0.0, 0.0
    for name, param in sharded.named_parameters():
        if "position_weight" in name:
            param = param.to_local() if isinstance(param, DTensor) else param  # replicated
            position_diff = max(position_diff, (param - dense[name]).abs().max().item())
            moved = (dense[name] - initial[name]).abs().max().item()  # trained, not just kept
            position_moved = max(position_moved, moved)
    weight = sharded.dense.weight
    weight = weight.to_local() if isinstance(weight, DTensor) else weight
    dense_diff = (weight - reference.dense.weight).abs().max().item()
    return {
        "loss": loss_diff,
        "tables": table_diff,
        "position_weights": position_diff,
        "dense": dense_diff,
        "position_weight_grad_seen": position_moved,
    }


def check_checkpoint_reshards(mesh, root: str) -> dict:
    """Save a trained model under the mixed plan (fused row-wise Adagrad), load it under
    row-wise: same outputs, same position weights."""
    import dtrec

    gen = torch.Generator().manual_seed(dist.get_rank())
    kjt, target = make_batch(gen)
    fused = _fused_rule("rowwise_adagrad")
    torch.manual_seed(0)
    model = dtrec.distribute_module(dtrec_model("modules"), mesh, _plan("mixed"), optimizer=fused)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    ((model(kjt) - target) ** 2).mean().backward()
    opt.step()
    dtrec.checkpoint.save(root, model)
    torch.manual_seed(1)  # other initial weights: the load must replace them all
    other = dtrec.distribute_module(
        dtrec_model("modules"), mesh, _plan("row_wise"), optimizer=fused
    )
    dtrec.checkpoint.load(root, other)
    with torch.no_grad():
        out_diff = (model(kjt) - other(kjt)).abs().max().item()
    theirs = dict(other.named_parameters())
    position_diff = max(
        (p - theirs[n]).abs().max().item()
        for n, p in model.named_parameters()
        if "position_weight" in n
    )
    return {"outputs": out_diff, "position_weights": position_diff}


def _run_cases(rank: int, world: int, root: str) -> dict[str, dict]:
    import dtrec

    out = {}
    for mesh_name, shards in MESHES.items():
        mesh = dtrec.init_mesh("cpu", shards, node_size=2)
        for plan in PLANS:
            for processors in ("modules", "collection"):
                torch.manual_seed(0)
                out[f"{mesh_name}-{plan}-{processors}"] = check_training(
                    mesh, dtrec_model(processors), plan, "none"
                )
        out[f"{mesh_name}-checkpoint"] = check_checkpoint_reshards(mesh, f"{root}/{mesh_name}")
        for plan in FUSED_PLANS:
            for fused_name in ("sgd", "rowwise_adagrad"):
                torch.manual_seed(0)
                out[f"{mesh_name}-{plan}-fused_{fused_name}"] = check_training(
                    mesh, dtrec_model("modules"), plan, fused_name
                )
        if HAS_TORCHREC:
            import torchrec

            for processors in ("modules", "collection"):
                torch.manual_seed(0)
                out[f"{mesh_name}-torchrec-{processors}"] = check_training(
                    mesh, torchrec_model(processors), "mixed", "rowwise_adagrad",
                    kjt_type=torchrec.KeyedJaggedTensor,
                )  # fmt: skip
    return out


CASES = (
    [f"{m}-{p}-{fp}" for m in MESHES for p in PLANS for fp in ("modules", "collection")]
    + [
        f"{m}-{p}-fused_{f}"
        for m in MESHES
        for p in FUSED_PLANS
        for f in ("sgd", "rowwise_adagrad")
    ]
    + [f"{m}-torchrec-{fp}" for m in MESHES for fp in ("modules", "collection")]
)


@pytest.fixture(scope="module")
def world_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_world(4, _run_cases, str(tmp_path_factory.mktemp("fp_ckpt")), timeout=900)


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_checkpoint_reshards_position_weighted_model(world_results, mesh: str) -> None:
    for rank, results in enumerate(world_results):
        got = results[f"{mesh}-checkpoint"]
        assert got["outputs"] < TOLERANCE and got["position_weights"] == 0.0, (rank, got)


@pytest.mark.parametrize("case", CASES)
def test_position_weighted_sharded_matches_unsharded(world_results, case: str) -> None:
    if "torchrec" in case and not HAS_TORCHREC:
        pytest.skip("torchrec (the bench extra) is not installed")
    for rank, results in enumerate(world_results):
        got = results[case]
        assert got["position_weight_grad_seen"] > 1e-3, (rank, got)
        for what in ("loss", "tables", "position_weights", "dense"):
            assert got[what] < TOLERANCE, (rank, what, got)
