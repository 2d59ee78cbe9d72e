"""Fused optimizers: the batched (one launch) update equals the per-table reference."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

import dtrec
from dtrec.ops.backends.registry import triton_available
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


def _fbgemm_or_skip() -> None:
    from dtrec.ops.backends.fbgemm_loader import fbgemm_available

    if not fbgemm_available():
        pytest.skip("fbgemm_gpu does not load here")


# entry -> table maps: one entry per table, a table read twice, tables out of order, a
# table's entries apart, every table read by two source ranks (segment-major, as
# table-wise tables arrive after input-dist).
ENTRY_TABLES = [[0, 1, 2], [0, 0, 2, 1], [2, 1, 1, 0], [1, 0, 2, 1, 0], [2, 0, 1, 2, 0, 1]]


def _fused_step(backend: str, optimizer, entry_table, psw: bool, mean: bool, empty: bool):
    """Two backward_update steps on packed tables; (weights, states, fbgemm step results)."""
    from dtrec.ops.backends.fbgemm import FbgemmBackend
    from dtrec.ops.lookup import Lookup

    gen = torch.Generator().manual_seed(0)
    weights = _tables(torch.device("cpu"), gen)
    states = optimizer.init_states(weights)
    batch = 5
    lengths = torch.randint(0, 5, (len(entry_table) * batch,), generator=gen)
    if empty:
        lengths.zero_()
    values = torch.cat(
        [
            torch.randint(0, weights[t].shape[0], (int(n),), generator=gen)
            for t, n in zip(entry_table, lengths.view(-1, batch).sum(1))
        ]
    )
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    weight = torch.rand(values.numel(), generator=gen) if psw else None
    lookup = Lookup(weights, entry_table, values, offsets, [mean] * len(entry_table), weight)
    width = sum(weights[t].shape[1] for t in entry_table)
    calls = []
    real = FbgemmBackend._fbgemm_backward_update  # the call into fbgemm itself

    def counted(*args, **kwargs) -> bool:
        calls.append(real(*args, **kwargs))
        return calls[-1]

    dtrec.ops.set_backend(backend)
    try:
        with mock.patch.object(FbgemmBackend, "_fbgemm_backward_update", counted):
            for _ in range(2):
                grad = torch.randn(batch, width, generator=gen)
                optimizer.backward_update(lookup, grad, states, grad_scale=0.5)
    finally:
        dtrec.ops.set_backend("auto")
    return weights, states, calls


@pytest.mark.parametrize("optimizer", OPTIMIZERS[:2], ids=lambda o: type(o).__name__)
@pytest.mark.parametrize("entry_table", ENTRY_TABLES, ids=str)
@pytest.mark.parametrize(
    "psw,mean,empty", [(False, False, False), (True, False, False), (False, True, False),
                       (False, False, True)], ids=["sum", "psw", "mean", "empty"],
)  # fmt: skip
def test_fbgemm_fused_cpu_step_matches_torch(optimizer, entry_table, psw, mean, empty) -> None:
    """fbgemm's fused C++ backward + step gives torch's result. "auto" on CPU runs it for
    SGD, and for row-wise Adagrad where ``dtrec.optim.cpu_choice`` chose it (a
    distribute_module earlier in this process chooses; until then torch's); "fbgemm" for
    both."""
    from dtrec.optim.cpu_choice import cpu_rowwise_adagrad

    _fbgemm_or_skip()
    ref_w, ref_s, ref_calls = _fused_step("torch", optimizer, entry_table, psw, mean, empty)
    _, _, auto_calls = _fused_step("auto", optimizer, entry_table, psw, mean, empty)
    got_w, got_s, calls = _fused_step("fbgemm", optimizer, entry_table, psw, mean, empty)
    assert ref_calls == []  # the torch backend never uses fbgemm
    assert calls == [True, True]  # "fbgemm" on CPU does, every step
    in_fbgemm = isinstance(optimizer, dtrec.optim.SGD) or cpu_rowwise_adagrad() == "fbgemm"
    assert auto_calls == [in_fbgemm, in_fbgemm]
    for a, b in zip(got_w, ref_w):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_s, ref_s):
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


def test_fbgemm_fused_cpu_step_declines_what_it_cannot_serve() -> None:
    """Mixed pooling, unpacked tables, an empty table: the torch path runs. Adam: no rule."""
    from dtrec.ops.backends.base import StepRule
    from dtrec.ops.backends.fbgemm import FbgemmBackend
    from dtrec.ops.lookup import Lookup

    _fbgemm_or_skip()
    gen = torch.Generator().manual_seed(0)
    packed = _tables(torch.device("cpu"), gen)
    apart = [w.clone() for w in packed]
    values = torch.tensor([0, 1, 2])
    offsets = torch.tensor([0, 1, 2, 3])
    grad = torch.randn(1, 3 + 8 + 3)
    cases = {
        "mixed pooling": (packed, [0, 1, 2], [True, False, False]),
        "not packed": (apart, [0, 1, 2], [False] * 3),
        "empty table": ([packed[0], packed[1][:0], packed[2]], [0, 1, 2], [False] * 3),
    }
    fbgemm, sgd, states = FbgemmBackend(), StepRule("sgd", 0.1), [{}] * 3
    for name, (weights, entries, mean) in cases.items():
        lookup = Lookup(weights, entries, values, offsets, mean)
        assert not fbgemm._fbgemm_backward_update(lookup, grad, sgd, states, 1.0), name
    lookup = Lookup(packed, [0, 1, 2], values, offsets, [False] * 3)
    adam = dtrec.optim.Adam(lr=0.1)
    before = [w.clone() for w in packed]
    assert not fbgemm.backward_update(lookup, grad, adam.step_rule(), adam.init_states(packed))
    assert all(torch.equal(a, b) for a, b in zip(packed, before))
    assert fbgemm._fbgemm_backward_update(lookup, grad, sgd, states, 1.0)
