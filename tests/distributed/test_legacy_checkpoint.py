"""A checkpoint written before dense parameters became DTensors still loads.

``data/dense_ddp_checkpoint`` was written by ``make_legacy_checkpoint.py`` on main at
57977ad, when the dense part ran under torch's composable DDP: its dense weights and
dense Adam state are plain tensors. Today's model (dense parameters replicated DTensors)
loads it, model and optimizer, and its next 2 steps, with Adam on its CUDA default
(``foreach=True``), give the weights and losses the old code recorded after those steps
(``data/dense_ddp_checkpoint_expected.pt``). A plain-tensor state dict (the unsharded
model's, or ``torch.load`` of an old ``model.state_dict()``) loads too.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.multiprocess import run_world

DATA = Path(__file__).parent / "data"
CHECKPOINT = DATA / "dense_ddp_checkpoint"


def _resume(rank: int, world: int, root: str) -> dict:
    import torch

    import dtrec
    from tests.distributed.legacy_model import LegacyModel, build, train

    mesh = dtrec.init_mesh("cpu", 2)
    model = build(mesh, seed=7)  # other init: everything must come from the checkpoint
    opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=True)
    dtrec.checkpoint.load(root, model, opt)
    losses = train(model, opt, rank, steps=2, first=2)
    full = dtrec.checkpoint.full_state_dict(model)
    expected = torch.load(f"{CHECKPOINT}_expected.pt")
    diffs = {k: (full[k] - v).abs().max().item() for k, v in expected["state"].items()}

    torch.manual_seed(3)
    plain = LegacyModel().state_dict()  # plain tensors, the unsharded model's keys
    fresh = build(mesh, seed=5)
    fresh.load_state_dict(plain)
    loaded = dtrec.checkpoint.full_state_dict(fresh)
    plain_diffs = {k: (loaded[k] - v).abs().max().item() for k, v in plain.items()}
    return {
        "losses": losses,
        "expected_losses": expected["losses"],
        "diffs": diffs,
        "plain_diffs": plain_diffs,
        "keys": sorted(model.state_dict()),
    }


def test_checkpoint_of_the_ddp_dense_part_loads_and_trains_on(tmp_path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(CHECKPOINT, root)  # load never writes, but keep the fixture pristine
    results = run_world(2, _resume, str(root), timeout=300)
    r0 = results[0]
    assert r0["keys"] == sorted(r0["diffs"]), "state_dict keys changed"
    for rank, r in enumerate(results):
        assert max(r["diffs"].values()) < 1e-6, (rank, r["diffs"])
        assert max(r["plain_diffs"].values()) == 0.0, (rank, r["plain_diffs"])
    assert abs(r0["losses"][0] - r0["expected_losses"][0]) < 1e-6
    assert abs(r0["losses"][1] - r0["expected_losses"][1]) < 1e-6
