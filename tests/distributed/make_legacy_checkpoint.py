"""Writes ``tests/distributed/data/dense_ddp_checkpoint`` (and ``..._expected.pt``: the
full weights and rank 0's losses after 2 more steps): a checkpoint of the code before
dense parameters became DTensors (main at 57977ad, dense part under torch's composable
DDP, so its dense weights and Adam state are plain tensors).

``test_legacy_checkpoint.py`` loads it with today's code. Kept so the fixture can be
rebuilt from that commit (``git worktree add /tmp/old 57977ad``, copy this file there,
then ``PYTHONPATH=/tmp/old python -m tests.distributed.make_legacy_checkpoint OUT``); with
today's code it would write DTensor dense state instead, which is not the point.

The model: ``tests.distributed.legacy_model`` (W=2, S=2: a row-wise, a table-wise and a
data-parallel table, a two-layer dense head), trained 2 steps with torch Adam over
``model.parameters()`` (foreach off, the only way the old code could).
"""

from __future__ import annotations

import sys

from tests.multiprocess import run_world


def _write(rank: int, world: int, out: str) -> None:
    import torch

    import dtrec
    from tests.distributed.legacy_model import build, train

    mesh = dtrec.init_mesh("cpu", 2)
    model = build(mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=False)
    train(model, opt, rank, steps=2)
    dtrec.checkpoint.save(out, model, opt)
    losses = train(model, opt, rank, steps=2, first=2)
    full = dtrec.checkpoint.full_state_dict(model)
    if rank == 0:
        torch.save({"state": full, "losses": losses}, f"{out}_expected.pt")


if __name__ == "__main__":
    run_world(2, _write, sys.argv[1], timeout=300)
