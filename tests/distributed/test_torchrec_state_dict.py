"""State dicts between TorchRec and dtrec, both ways, on 4 gloo ranks.

* TorchRec's sharded model (``DistributedModelParallel``, table-wise / row-wise /
  column-wise / data-parallel tables: ``ShardedTensor`` values) loads into a dtrec
  model distributed under a different plan, and the weights are TorchRec's (checked
  against TorchRec's own ``ShardedTensor.gather``, an independent assembly);
* TorchRec's DCP checkpoint of that model (``dcp.save`` of its state dict: no dtrec
  marker) loads with ``dtrec.checkpoint.load`` into a dtrec model of a third plan;
* ``dtrec.checkpoint.to_full_state_dict`` of either sharded state dict loads into a
  plain, unsharded ``torchrec.EmbeddingBagCollection`` (a DTensor state dict loaded
  directly fails on ``copy_`` of mixed Tensor / DTensor, which is why it exists).

Skipped without torchrec (the ``bench`` extra).
"""

from __future__ import annotations

import pytest

from tests.multiprocess import run_world

pytest.importorskip("torchrec", reason="torchrec (bench extra) not installed")

ROWS, DIM = (40, 23, 64, 30), 8
KINDS = ("tw:1", "rw", "cw", "dp")  # TorchRec's plan, per table t0..t3


def _models():
    import torch
    from torch import nn

    from benchmarks.common.torchrec_side import torchrec_ebc

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = torchrec_ebc(ROWS, DIM)
            self.dense = nn.Linear(len(ROWS) * DIM, 1)

    torch.manual_seed(0)
    return Model()


def _gathered(value):
    """TorchRec's own assembly of a ShardedTensor on rank 0 (None elsewhere)."""
    import torch
    import torch.distributed as dist

    full = torch.zeros(tuple(value.size())) if dist.get_rank() == 0 else None
    value.gather(dst=0, out=full)
    return full


def _check(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    import torchrec

    import dtrec
    from benchmarks.common.torchrec_side import shard_torchrec

    theirs, _, _ = shard_torchrec(_models(), KINDS, world, lr=0.1, eps=1e-8)
    their_state = theirs.state_dict()
    keys = [f"ebc.embedding_bags.t{i}.weight" for i in range(len(ROWS))]
    truth = {}
    for key in keys:
        value = their_state[key]
        if hasattr(value, "local_shards"):
            truth[key] = _gathered(value)
        else:  # data-parallel: a plain tensor, the same on every rank
            truth[key] = value.detach().clone() if rank == 0 else None
    sharded_types = sorted(k for k in keys if hasattr(their_state[k], "local_shards"))

    # dtrec, distributed under another plan (2D mesh), loads TorchRec's sharded state dict
    model = _models()
    model.ebc = dtrec.EmbeddingBagCollection(
        [dtrec.EmbeddingBagConfig(f"t{i}", r, DIM, [f"f{i}"]) for i, r in enumerate(ROWS)]
    )
    specs = dtrec.placements
    plan = {"ebc.t0": specs.RowWise(), "ebc.t1": specs.ColumnWise(),
            "ebc.t2": specs.TableWise(rank=0), "ebc.t3": specs.RowWise()}  # fmt: skip
    mine = dtrec.distribute_module(model, dtrec.init_mesh("cpu", 2), plan)
    ebc_state = {k: v for k, v in their_state.items() if k.startswith("ebc.")}
    missing, unexpected = mine.load_state_dict(ebc_state, strict=False)
    full = dtrec.checkpoint.full_state_dict(mine)
    errors = {}
    if rank == 0:
        errors["dtrec_from_torchrec"] = max((full[k] - truth[k]).abs().max().item() for k in keys)

    # both sharded state dicts -> full tensors -> a plain TorchRec collection
    plain = torchrec.EmbeddingBagCollection(
        [
            torchrec.EmbeddingBagConfig(
                name=f"t{i}", num_embeddings=r, embedding_dim=DIM, feature_names=[f"f{i}"]
            )
            for i, r in enumerate(ROWS)
        ]
    )
    prefix = "ebc."
    for name, state in (
        ("plain_from_torchrec", their_state),
        ("plain_from_dtrec", mine.state_dict()),
    ):
        tables = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        plain.load_state_dict(dtrec.checkpoint.to_full_state_dict(tables))
        if rank == 0:
            errors[name] = max(
                (plain.state_dict()[k[len(prefix) :]] - truth[k]).abs().max().item() for k in keys
            )
    # TorchRec's own DCP checkpoint (a plain directory, no dtrec marker) into dtrec
    import tempfile
    import warnings

    import torch.distributed.checkpoint as dcp

    where = [tempfile.mkdtemp(prefix="torchrec_dcp_") if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    dcp.save({k: v for k, v in their_state.items() if k.startswith("ebc.")}, checkpoint_id=where[0])
    model = _models()
    model.ebc = dtrec.EmbeddingBagCollection(
        [dtrec.EmbeddingBagConfig(f"t{i}", r, DIM, [f"f{i}"]) for i, r in enumerate(ROWS)]
    )
    other = dtrec.distribute_module(model, dtrec.init_mesh("cpu", 4), None)
    ebc_only = torch.nn.Module()
    ebc_only.ebc = other.ebc
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dtrec.checkpoint.load(where[0], ebc_only)
    warned = any("plain DCP checkpoint" in str(w.message) for w in caught)
    full = dtrec.checkpoint.full_state_dict(ebc_only)
    if rank == 0:
        errors["dtrec_from_torchrec_dcp"] = max(
            (full[k] - truth[k]).abs().max().item() for k in keys
        )
    fused_errors = _check_fused_state(rank, world)
    dist.barrier()
    return {
        "fused": fused_errors,
        "warned": warned,
        "errors": errors,
        "sharded_tables": sharded_types,
        "missing": sorted(k for k in missing if k.startswith("ebc.")),
        "unexpected": sorted(unexpected),
    }


def _check_fused_state(rank: int, world: int) -> dict:
    """TorchRec's fused row-wise Adagrad state (after two steps) into dtrec under another
    plan, and dtrec's (changed) state back into TorchRec's optimizer."""
    import torch
    import torchrec

    import dtrec
    from benchmarks.common.torchrec_side import shard_torchrec

    theirs, _, _ = shard_torchrec(_models(), ("tw:1", "rw", "rw", "tw:0"), world, 0.1, 1e-8)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        lengths = torch.randint(0, 3, (len(ROWS) * 4,), generator=gen)
        ids = [torch.randint(0, r, (int(lengths[i * 4 : (i + 1) * 4].sum()),), generator=gen)
               for i, r in enumerate(ROWS)]  # fmt: skip
        kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(len(ROWS))], values=torch.cat(ids), lengths=lengths
        )
        theirs.module.ebc(kjt).values().pow(2).sum().backward()
    keys = [f"ebc.embedding_bags.t{i}.weight" for i in range(len(ROWS))]

    def torchrec_parts() -> list:
        """This rank's pieces of TorchRec's accumulators: (key, index, tensor). A table-wise
        table's state lives on its owner only."""
        state = theirs.fused_optimizer.state_dict()["state"]
        parts = []
        for i, k in enumerate(keys):
            value = state.get(k, {}).get(f"t{i}.momentum1")
            for shard in [] if value is None else value.local_shards():
                meta = shard.metadata
                index = tuple(slice(o, o + n) for o, n in zip(meta.shard_offsets, meta.shard_sizes))
                parts.append((k, index, shard.tensor.detach().clone()))
        return parts

    def dtrec_sums() -> dict:
        state = mine.fused_optimizer.state_dict()["state"]
        return {
            k: dtrec.checkpoint.full_tensor(state[f"ebc.t{i}"]["sum"]) for i, k in enumerate(keys)
        }

    def worst(parts: list, full: dict) -> float:
        return max((full[k][index] - t).abs().max().item() for k, index, t in parts)

    truth = torchrec_parts()
    model = _models()
    model.ebc = dtrec.EmbeddingBagCollection(
        [dtrec.EmbeddingBagConfig(f"t{i}", r, DIM, [f"f{i}"]) for i, r in enumerate(ROWS)]
    )
    specs = dtrec.placements
    plan = {"ebc.t0": specs.ColumnWise(), "ebc.t1": specs.RowWise(),
            "ebc.t2": specs.TableWise(rank=1), "ebc.t3": specs.RowWise()}  # fmt: skip
    mine = dtrec.distribute_module(
        model, dtrec.init_mesh("cpu", 2), plan, optimizer=dtrec.optim.RowWiseAdagrad(lr=0.1)
    )
    mine.fused_optimizer.load_state_dict(
        dtrec.checkpoint.fused_state_from_torchrec(mine, theirs.fused_optimizer.state_dict())
    )
    out = {
        "fused_from_torchrec": worst(truth, dtrec_sums()),
        "fused_state_nonzero": float(min(t.abs().max().item() for _, _, t in truth) > 0),
    }
    with torch.no_grad():  # change dtrec's state, then write it into TorchRec's optimizer
        for entries in mine.fused_optimizer.state_dict()["state"].values():
            entries["sum"].to_local().mul_(3.0).add_(0.5)
    changed = dtrec_sums()
    their_state = theirs.fused_optimizer.state_dict()
    dtrec.checkpoint.fused_state_into_torchrec(mine, their_state)
    theirs.fused_optimizer.load_state_dict(their_state)
    out["fused_into_torchrec"] = worst(torchrec_parts(), changed)
    return out


@pytest.fixture(scope="module")
def world():
    return run_world(4, _check, timeout=300)


def test_torchrec_sharded_tensors_load_into_dtrec_and_plain_models(world):
    for rank, r in enumerate(world):
        assert r["missing"] == [] and r["unexpected"] == [], f"rank {rank}: {r}"
        # the three sharded kinds really are ShardedTensors (data-parallel is a plain tensor)
        assert r["sharded_tables"] == [f"ebc.embedding_bags.t{i}.weight" for i in range(3)]
    errors = world[0]["errors"]
    assert all(r["warned"] for r in world), "loading a plain DCP directory did not warn"
    assert set(errors) == {
        "dtrec_from_torchrec", "plain_from_torchrec", "plain_from_dtrec", "dtrec_from_torchrec_dcp"
    }  # fmt: skip
    for rank, r in enumerate(world):  # each rank checks its own TorchRec shards
        fused = r["fused"]
        assert fused.pop("fused_state_nonzero") == 1.0, f"rank {rank}: TorchRec state stayed 0"
        for name, err in fused.items():
            assert err < 1e-6, f"rank {rank}: {name} differs by {err}"
    for name, err in errors.items():
        assert err == 0.0, f"{name}: weights differ from TorchRec's by {err}"
