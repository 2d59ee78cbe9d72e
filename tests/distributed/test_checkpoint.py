"""Checkpoints: round trip, resharding across plans / meshes / world sizes, crash safety.

One 4-rank world saves a model trained 2 steps on a mixed plan (S=2, R=2, fused
row-wise Adagrad + dense Adagrad), keeps training it 2 more steps (the uninterrupted
run), and loads the checkpoint into the same plan and into other types on S=4, R=1.
A 2-rank world loads it on W=2, a 1-rank world on W=1. All continue on the same global
batches and must match the uninterrupted run. Another world kills a rank while it
writes; the unsharded model loads in this process, without a process group.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from tests.multiprocess import error_of, run_world

GLOBAL_BATCH = 12
SAVE_AFTER, CONTINUE = 2, 2
TOL = 1e-5


def _slice(kjt, start: int, end: int):
    """Samples [start, end) of a batch."""
    import dtrec

    batch = kjt.stride()
    lengths = kjt.lengths().view(-1, batch)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), kjt.lengths().cumsum(0)])
    values = [
        kjt.values()[offsets[f * batch + start] : offsets[f * batch + end]]
        for f in range(len(kjt.keys()))
    ]
    return dtrec.KeyedJaggedTensor(kjt.keys(), torch.cat(values), lengths[:, start:end].flatten())


def _batches(steps: int, offset: int):
    """The global batches of steps offset .. offset + steps - 1 (same on every world size)."""
    from tests.distributed.numerics import make_batch, make_tables

    gen = torch.Generator().manual_seed(123)
    out = [make_batch(make_tables(False), GLOBAL_BATCH, False, gen) for _ in range(offset + steps)]
    return out[offset:]


def _build(plan: dict, shards: int, seed: int, fused=None, dense=torch.optim.Adagrad):
    import dtrec
    from tests.distributed.numerics import TinyModel, make_tables

    torch.manual_seed(seed)
    model = TinyModel(make_tables(False))
    mesh = dtrec.init_mesh("cpu", shards)
    fused = fused if fused is not None else dtrec.optim.RowWiseAdagrad(lr=0.3)
    model = dtrec.distribute_module(model, mesh, {f"sparse.{k}": v for k, v in plan.items()}, fused)
    dense_params = [p for n, p in model.named_parameters() if n.startswith("dense")]
    return model, dense(dense_params, lr=0.3)


def _train(model, opt, steps: int, offset: int) -> list[float]:
    """Global-batch losses (mean over ranks' local means) of ``steps`` training steps."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = GLOBAL_BATCH // world
    losses = []
    for kjt, target in _batches(steps, offset):
        local = _slice(kjt, rank * per_rank, (rank + 1) * per_rank)
        want = target[rank * per_rank : (rank + 1) * per_rank]
        loss = ((model(local) - want) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _full_fused(model) -> dict[str, torch.Tensor]:
    from dtrec.checkpoint import to_full_state_dict

    return to_full_state_dict({  # Adam's step is checked through training: non-holders
        f"{table}.{name}": value  # keep their own
        for table, state in model.fused_optimizer.state_dict()["state"].items()
        for name, value in state.items()
        if value.dim()
    })  # fmt: skip


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _mixed_s2():
    from dtrec.placements import ColumnWise, DataParallel, RowWise, TableWise

    return {"t0": RowWise(), "t1": TableWise(rank=0), "t2": ColumnWise(), "t3": DataParallel()}


def _other_s4():
    from dtrec.placements import ColumnWise, RowWise, TableWise

    return {"t0": ColumnWise(), "t1": RowWise(), "t2": TableWise(rank=3), "t3": RowWise()}


def _continue_from(root: Path, plan: dict, shards: int, fused=None, staged=True) -> dict:
    """Load into a differently initialised model, compare, train on."""
    from dtrec.checkpoint import dcp as checkpoint

    model, opt = _build(plan, shards, seed=99, fused=fused)
    read = checkpoint.load(root, model, opt, staged=staged)
    loaded = {"weights": checkpoint.full_state_dict(model), "fused": _full_fused(model)}
    losses = _train(model, opt, CONTINUE, SAVE_AFTER)
    return {
        "read": read.name,
        "loaded": loaded,
        "losses": losses,
        "after": checkpoint.full_state_dict(model),
    }


def _world4(rank: int, world: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    import dtrec
    from dtrec.checkpoint import dcp as checkpoint

    root = Path(root)
    model, opt = _build(_mixed_s2(), 2, seed=0)
    _train(model, opt, SAVE_AFTER, 0)
    saved_dir = checkpoint.save(root, model, opt)
    out: dict = {
        "saved_dir": saved_dir.name,
        "saved": checkpoint.full_state_dict(model),
        "saved_fused": _full_fused(model),
    }
    out["ref_losses"] = _train(model, opt, CONTINUE, SAVE_AFTER)
    out["ref_after"] = checkpoint.full_state_dict(model)

    out["same_plan"] = _continue_from(root, _mixed_s2(), 2)
    out["other_plan"] = _continue_from(root, _other_s4(), 4)

    # Adam (weight-shaped m, v and a step count per table) resharded the same way.
    adam = dtrec.optim.Adam(lr=0.05)
    adam_model, adam_opt = _build(_mixed_s2(), 2, seed=0, fused=adam)
    _train(adam_model, adam_opt, SAVE_AFTER, 0)
    checkpoint.save(root.parent / "adam", adam_model, adam_opt)
    out["adam"] = {
        "saved": checkpoint.full_state_dict(adam_model),
        "saved_fused": _full_fused(adam_model),
        "ref_losses": _train(adam_model, adam_opt, CONTINUE, SAVE_AFTER),
        "ref_after": checkpoint.full_state_dict(adam_model),
    }
    out["adam"]["other_plan"] = _continue_from(root.parent / "adam", _other_s4(), 4, adam)

    # In-memory load_state_dict: full tensors, and DTensors / fused state of another plan.
    from_full, _ = _build(_other_s4(), 4, seed=5)
    from_full.load_state_dict(out["saved"])
    from_dtensors, _ = _build(_other_s4(), 4, seed=6)
    from_dtensors.load_state_dict(model.state_dict())
    from_dtensors.fused_optimizer.load_state_dict(model.fused_optimizer.state_dict())
    now = checkpoint.full_state_dict(model)
    out["load_state_dict"] = {
        "full": _max_diff(out["saved"], checkpoint.full_state_dict(from_full)),
        "dtensors": _max_diff(now, checkpoint.full_state_dict(from_dtensors)),
        "fused": _max_diff(_full_fused(model), _full_fused(from_dtensors)),
    }

    # Each table block is stored once: chunks tile the table, one stored item per chunk.
    meta = dcp.FileSystemReader(root / saved_dir.name).read_metadata()
    stored: dict[str, list] = {}
    for index in meta.storage_data:
        stored.setdefault(index.fqn, []).append(tuple(index.offset or ()))
    out["chunks"] = {
        key: (
            sum(int(torch.Size(c.sizes).numel()) for c in md.chunks),
            int(torch.Size(md.size).numel()),
            len(md.chunks),
            len(stored.get(key, [])),
        )
        for key, md in meta.state_dict_metadata.items()
        if key.startswith(("model.sparse", "fused_optimizer."))
    }

    # Errors: each names what differs; nothing is loaded.
    from tests.distributed.numerics import TinyModel, make_tables

    def variant(**change):
        tables = make_tables(False)
        tables[2] = dtrec.EmbeddingBagConfig(
            **{
                "name": "t2",
                "num_embeddings": 97,
                "embedding_dim": 7,
                "feature_names": ["f3"],
                **change,
            }
        )
        return TinyModel(tables)

    extra = make_tables(False) + [dtrec.EmbeddingBagConfig("t9", 5, 3)]
    adam_model, _ = _build(_mixed_s2(), 2, seed=0, fused=dtrec.optim.Adam(lr=0.1))
    sgd_model, sgd = _build(_mixed_s2(), 2, seed=0, dense=torch.optim.SGD)
    out["errors"] = {
        "dim": error_of(lambda: checkpoint.load(root, variant(embedding_dim=6))),
        "rows": error_of(lambda: checkpoint.load(root, variant(num_embeddings=90))),
        "pooling": error_of(lambda: checkpoint.load(root, variant(pooling="mean"))),
        "missing_table": error_of(lambda: checkpoint.load(root, TinyModel(extra))),
        "fused_type": error_of(lambda: checkpoint.load(root, adam_model)),
        "optimizer_type": error_of(lambda: checkpoint.load(root, sgd_model, sgd)),
        "no_checkpoint": error_of(lambda: checkpoint.load(root / "nothing", model)),
    }

    # A damaged checkpoint: a data file lost, then one cut short (read fails on some ranks).
    damaged = root.parent / "damaged"
    if rank == 0:
        import shutil

        shutil.copytree(root / saved_dir.name, damaged)
        (damaged / "__1_0.distcp").unlink()
    torch.distributed.barrier()
    before = checkpoint.full_state_dict(model)
    out["errors"]["missing_file"] = error_of(lambda: checkpoint.load(damaged, model, opt))
    torch.distributed.barrier()
    if rank == 0:
        (damaged / "__1_0.distcp").write_bytes(b"not a checkpoint")
    torch.distributed.barrier()
    out["errors"]["corrupt_file"] = error_of(lambda: checkpoint.load(damaged, model, opt))
    out["unchanged_after_errors"] = _max_diff(before, checkpoint.full_state_dict(model)) == 0.0

    # Rotation: two more saves with keep_last=2 leave the newest two. The first
    # checkpoint is copied aside first for the W=2 world.
    if rank == 0:
        import shutil

        shutil.copytree(root / saved_dir.name, root.parent / "first" / saved_dir.name)
    checkpoint.save(root, model, opt, keep_last=2)
    checkpoint.save(root, model, opt, keep_last=2)
    torch.distributed.barrier()
    out["kept"] = sorted(p.name for p in root.iterdir())
    out["w2_source"] = str(root.parent / "first" / saved_dir.name)
    out["last"] = str(root)
    return out


def _world2(rank: int, world: int, source: str) -> dict:
    from dtrec.placements import ColumnWise, RowWise, TableWise

    plan = {"t0": TableWise(rank=1), "t1": ColumnWise(), "t2": RowWise(), "t3": TableWise(rank=0)}
    return _continue_from(Path(source), plan, 2, staged=False)  # read in place


def _world1(rank: int, world: int, source: str) -> dict:
    """One process resumes the whole global batch (every table data-parallel or on it)."""
    from dtrec.placements import ColumnWise, DataParallel, RowWise, TableWise

    plan = {"t0": RowWise(), "t1": DataParallel(), "t2": TableWise(rank=0), "t3": ColumnWise()}
    return _continue_from(Path(source), plan, 1)


def _kill_while_writing(rank: int, world: int, root: str) -> dict:
    from torch.distributed.checkpoint import FileSystemWriter

    from dtrec.checkpoint import dcp as checkpoint

    model, opt = _build(_mixed_s2(), 2, seed=0)
    _train(model, opt, 1, 0)
    first = checkpoint.save(root, model, opt)
    saved = checkpoint.full_state_dict(model)
    _train(model, opt, 1, 1)
    if rank == 1:
        real = FileSystemWriter.write_data

        def die(self, plan, planner):  # part-way through the second save
            os.kill(os.getpid(), signal.SIGKILL)
            return real(self, plan, planner)

        FileSystemWriter.write_data = die
    error = error_of(lambda: checkpoint.save(root, model, opt))
    return {"first": first.name, "saved": saved, "error": error}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("ckpt")
    w4 = run_world(4, _world4, str(base / "root"), timeout=600, collective_timeout=60)
    w2 = run_world(2, _world2, w4[0]["w2_source"], timeout=300)
    w1 = run_world(1, _world1, w4[0]["w2_source"], timeout=300)
    kill_root = base / "kill"
    # the survivor raises at the dead link (a wait on the 900 s timeout would time the world
    # out): a short timeout here only made the world's setup fail on a loaded machine
    killed = run_world(
        2, _kill_while_writing, str(kill_root), timeout=300, collective_timeout=900, may_die=[1]
    )
    return {"w4": w4, "w2": w2, "w1": w1[0], "killed": killed[0], "kill_root": kill_root}


def _check_continuation(ref: dict, run: dict, what: str) -> None:
    assert _max_diff(ref["saved"], run["loaded"]["weights"]) == 0.0, what
    assert _max_diff(ref["saved_fused"], run["loaded"]["fused"]) == 0.0, what
    for got, want in zip(run["losses"], ref["ref_losses"], strict=True):
        assert abs(got - want) < TOL, (what, run["losses"], ref["ref_losses"])
    assert _max_diff(ref["ref_after"], run["after"]) < TOL, what


def test_round_trip_same_plan(worlds) -> None:
    for rank, r in enumerate(worlds["w4"]):
        assert r["same_plan"]["read"] == r["saved_dir"] == "ckpt-000001"
        _check_continuation(r, r["same_plan"], f"rank {rank}")


def test_reshard_to_other_types_on_s4(worlds) -> None:
    for rank, r in enumerate(worlds["w4"]):
        _check_continuation(r, r["other_plan"], f"rank {rank}")


def test_reshard_adam_state(worlds) -> None:
    for rank, r in enumerate(worlds["w4"]):
        _check_continuation(r["adam"], r["adam"]["other_plan"], f"Adam, rank {rank}")


def test_reshard_to_two_ranks(worlds) -> None:
    ref = worlds["w4"][0]
    for rank, run in enumerate(worlds["w2"]):
        assert run["read"] == "ckpt-000001"
        _check_continuation(ref, run, f"W=2 rank {rank}")


def test_reshard_to_one_process(worlds) -> None:
    run = worlds["w1"]
    assert run["read"] == "ckpt-000001"
    _check_continuation(worlds["w4"][0], run, "W=1")


def test_load_into_unsharded_model_without_process_group(worlds) -> None:
    from dtrec.checkpoint import dcp as checkpoint
    from tests.distributed.numerics import TinyModel, make_tables

    ref = worlds["w4"][0]
    model = TinyModel(make_tables(False))
    read = checkpoint.load(Path(ref["last"]), model)  # the newest: after 4 steps
    assert read.name == "ckpt-000003"
    assert _max_diff(ref["ref_after"], model.state_dict()) == 0.0


def test_load_state_dict_from_full_tensors_and_other_placements(worlds) -> None:
    for r in worlds["w4"]:
        assert r["load_state_dict"] == {"full": 0.0, "dtensors": 0.0, "fused": 0.0}


def test_each_block_written_once(worlds) -> None:
    chunks = worlds["w4"][0]["chunks"]
    assert any(k.startswith("model.sparse") for k in chunks)
    for key, (chunk_numel, numel, n_chunks, n_stored) in chunks.items():
        assert chunk_numel == numel, (key, chunk_numel, numel)  # no overlap, nothing missing
        assert n_stored == n_chunks, (key, n_stored, n_chunks)  # replicas not written twice


def test_mismatch_errors_name_key_and_values(worlds) -> None:
    for r in worlds["w4"]:
        e = r["errors"]
        assert e["dim"].startswith("CheckpointError") and "'sparse.t2'" in e["dim"], e["dim"]
        assert "embedding_dim is 6 in the model but 7 in the checkpoint" in e["dim"]
        assert "num_embeddings is 90 in the model but 97" in e["rows"]
        assert "pooling is 'mean' in the model but 'sum'" in e["pooling"]
        assert e["missing_table"].startswith("CheckpointError"), e["missing_table"]
        assert "sparse.t9" in e["missing_table"]
        assert "Adam in the model, RowWiseAdagrad in the checkpoint" in e["fused_type"]
        assert "SGD given, Adagrad in the checkpoint" in e["optimizer_type"]
        assert "no complete checkpoint" in e["no_checkpoint"]
        assert "missing files ['__1_0.distcp']" in e["missing_file"], e["missing_file"]
        assert e["corrupt_file"].startswith("CheckpointError"), e["corrupt_file"]
        assert "read of" in e["corrupt_file"] and "UnpicklingError" in e["corrupt_file"]
        assert r["unchanged_after_errors"]


def test_keep_last_rotation(worlds) -> None:
    assert worlds["w4"][0]["kept"] == ["ckpt-000002", "ckpt-000003"]


def test_killed_save_leaves_last_checkpoint_intact(worlds) -> None:
    from dtrec.checkpoint import dcp as checkpoint
    from tests.distributed.numerics import TinyModel, make_tables

    killed, root = worlds["killed"], worlds["kill_root"]
    assert killed["error"].startswith(("CheckpointError", "CollectiveError")), killed["error"]
    names = sorted(p.name for p in root.iterdir())
    assert names == [".ckpt-000002.partial", "ckpt-000001"], names
    with pytest.raises(checkpoint.CheckpointError, match="incomplete: it has no COMPLETE.json"):
        checkpoint.load(root / ".ckpt-000002.partial", TinyModel(make_tables(False)))
    model = TinyModel(make_tables(False))
    assert checkpoint.load(root, model).name == killed["first"] == "ckpt-000001"
    assert _max_diff(killed["saved"], model.state_dict()) == 0.0
