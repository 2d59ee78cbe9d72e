"""Fused optimizers: the batched (one launch) update equals the per-table reference."""

from __future__ import annotations

import os

import pytest
import torch

import dtrec
from dtrec.ops.backend import triton_available
from dtrec.optim import RowUpdate

CASES = [("torch", "cpu")]
if torch.cuda.is_available() and triton_available():
    CASES.append(("triton", "cuda"))
elif triton_available() and os.environ.get("TRITON_INTERPRET") == "1":
    CASES.append(("triton", "cpu"))

OPTIMIZERS = [
    dtrec.optim.SGD(lr=0.1),
    dtrec.optim.RowWiseAdagrad(lr=0.1),
    dtrec.optim.Adam(lr=0.01),
]


def _tables(device: torch.device, gen: torch.Generator) -> list[torch.Tensor]:
    shapes = [(7, 3), (5, 8), (9, 3)]
    flat = torch.randn(sum(r * d for r, d in shapes), generator=gen).to(device)
    parts = torch.split(flat, [r * d for r, d in shapes])
    return [p.view(r, d) for p, (r, d) in zip(parts, shapes)]


@pytest.mark.parametrize("backend_device", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: type(o).__name__)
def test_batched_update_matches_per_table_reference(backend_device, optimizer) -> None:
    backend, device = backend_device
    gen = torch.Generator().manual_seed(0)
    weights = _tables(torch.device(device), gen)
    reference = [w.clone() for w in weights]
    states = optimizer.init_states(weights)
    ref_states = [optimizer.init_state(w) for w in reference]
    dtrec.ops.set_backend(backend)
    try:
        for _ in range(3):
            updates, ref_updates = [], []
            all_rows = [
                torch.unique(torch.randint(0, w.shape[0], (4,), generator=gen)) for w in weights
            ]
            sizes = [r.numel() * w.shape[1] for r, w in zip(all_rows, weights)]
            grad_buffer = torch.randn(sum(sizes), generator=gen).to(
                device
            )  # like backward's output
            grad_views = [
                g.view(r.numel(), -1) for g, r in zip(torch.split(grad_buffer, sizes), all_rows)
            ]
            for w, st, rw, rst, rows, grads in zip(
                weights, states, reference, ref_states, all_rows, grad_views
            ):
                rows = rows.to(device)
                updates.append(RowUpdate(w, st, rows, grads, full_dim=w.shape[1]))
                ref_updates.append(RowUpdate(rw, rst, rows, grads, full_dim=w.shape[1]))
            optimizer.update_tables(updates)
            if isinstance(optimizer, dtrec.optim.Adam):
                for u in ref_updates:
                    u.state["step"] += 1
            for u in ref_updates:
                optimizer._update_torch(u)
    finally:
        dtrec.ops.set_backend("auto")
    for w, rw in zip(weights, reference):
        torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)
    # init_states packs each state kind in one buffer.
    for key, value in states[0].items():
        if value.dim():
            ptrs = {st[key].untyped_storage().data_ptr() for st in states}
            assert len(ptrs) == 1, key
