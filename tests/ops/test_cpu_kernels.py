"""dtrec's C kernels (``dtrec.kernels.cpu``) against the pure-torch paths they replace.

Each wrapper is compared with torch's math on the same inputs: bitwise where the C code
does the same roundings in the same order (sums without per-occurrence scales, SGD, the
Adagrad step for given row sums), within an ulp where torch rounds differently (its
vectorised ``sqrt`` and ``vector_norm``, ``embedding_bag``'s fused multiply-add).
"""

from __future__ import annotations

import pytest
import torch

from dtrec.kernels import cpu
from dtrec.kernels.update_math import rowwise_adagrad_step, sgd_step
from dtrec.ops.backends import torch as torch_backend
from dtrec.ops.backends.base import StepRule
from dtrec.ops.backends.torch import TorchBackend
from dtrec.ops.lookup import Lookup
from dtrec.optim import RowWiseAdagrad

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler: torch paths only")


@pytest.fixture
def torch_only(monkeypatch):
    """Within the test: the C kernels off (``$DTREC_CPU_KERNELS=0``), torch's paths run."""

    def off() -> None:
        monkeypatch.setenv(cpu.ENV, "0")

    return off


def _keys_and_rows(n: int = 3000, key_bound: int = 5000, dim: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    keys = (torch.rand(n, generator=gen) ** 3 * key_bound).long()  # skewed: long runs
    rows = torch.randn(200, dim, generator=gen)
    index = torch.randint(0, 200, (n,), generator=gen)
    scale = torch.rand(n, generator=gen)
    return keys, rows, index, scale


@pytest.mark.parametrize("with_index", [False, True])
def test_sum_rows_by_key_is_torch_bitwise_without_scales(with_index: bool) -> None:
    keys, rows, index, _ = _keys_and_rows()
    if not with_index:
        rows = torch.randn(keys.numel(), 16)
    index = index if with_index else None
    got = cpu.sum_rows_by_key(keys, rows, index, None, key_bound=5000)
    assert got is not None
    torch.manual_seed(0)
    # torch's: the same stable order of occurrences per key
    sorted_keys, perm = torch.sort(keys, stable=True)
    unique, counts = torch.unique_consecutive(sorted_keys, return_counts=True)
    want = torch.nn.functional.embedding_bag(
        perm if index is None else index[perm], rows, torch.cumsum(counts, 0) - counts, mode="sum"
    )
    assert torch.equal(got[0], unique) and torch.equal(got[1], want)


def test_sum_rows_by_key_with_scales_and_int32_keys(torch_only) -> None:
    keys, rows, index, scale = _keys_and_rows(seed=1)
    got = cpu.sum_rows_by_key(keys.int(), rows, index, scale, key_bound=5000)
    torch_only()
    want = torch_backend.sum_rows_by_key(keys, rows, index, scale, key_bound=5000)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)


def test_sum_rows_by_key_declines_what_it_does_not_serve() -> None:
    keys, rows, index, _ = _keys_and_rows()
    assert cpu.sum_rows_by_key(keys, rows, index, key_bound=None) is None
    assert cpu.sum_rows_by_key(keys, rows.double(), index, key_bound=5000) is None
    assert cpu.sum_rows_by_key(keys, rows, index.int(), key_bound=5000) is None
    with pytest.raises(IndexError, match="outside"):
        cpu.sum_rows_by_key(keys, rows, index, key_bound=10)


def test_row_sq_sums_and_the_updates_match_torch(torch_only) -> None:
    gen = torch.Generator().manual_seed(2)
    weight, acc = torch.randn(300, 8, generator=gen), torch.rand(300, generator=gen)
    rows = torch.randperm(300, generator=gen)[:100]
    grads = torch.randn(100, 8, generator=gen)
    sq = cpu.row_sq_sums(grads)
    torch.testing.assert_close(sq, grads.square().sum(1), rtol=1e-6, atol=0)

    # row-wise Adagrad for given row sums: torch's step added by index_add_
    w_c, acc_c = weight.clone(), acc.clone()
    assert cpu.rowwise_adagrad_(w_c, acc_c, rows, grads, sq, 32, 0.1, 1e-8)
    change, new_acc = rowwise_adagrad_step(acc[rows], grads, sq, 32, 0.1, 1e-8)
    w_t, acc_t = weight.clone(), acc.clone()
    acc_t.index_copy_(0, rows, new_acc)
    w_t.index_add_(0, rows, change)
    assert torch.equal(acc_c, acc_t)
    # torch's vectorised sqrt is not always correctly rounded: an ulp apart at most
    torch.testing.assert_close(w_c, w_t, rtol=2.5e-7, atol=1e-7)
    untouched = torch.ones(300, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(w_c[untouched], weight[untouched])

    w_s = weight.clone()
    assert cpu.sgd_(w_s, rows, grads, 0.1)
    assert torch.equal(w_s, weight.index_add(0, rows, sgd_step(grads, 0.1)))
    assert not cpu.sgd_(weight.double(), rows, grads.double(), 0.1)  # declined: not fp32

    # a row past the table: IndexError before any write, as index_add_ raises
    past, before = rows.clone(), w_c.clone()
    past[-1] = 300
    with pytest.raises(IndexError, match="outside"):
        cpu.rowwise_adagrad_(w_c, acc_c, past, grads, sq, 32, 0.1, 1e-8)
    with pytest.raises(IndexError, match="outside"):
        cpu.sgd_(w_c, past, grads, 0.1)
    assert torch.equal(w_c, before)
    # sizes that do not match: declined (torch's path reports them)
    assert not cpu.sgd_(w_c, rows[:-1], grads, 0.1)
    assert not cpu.rowwise_adagrad_(w_c, acc_c[:-1], rows, grads, sq, 32, 0.1, 1e-8)
    assert not cpu.rowwise_adagrad_(w_c, acc_c, rows, grads, sq[:-1], 32, 0.1, 1e-8)

    torch_only()
    assert not cpu.available() and cpu.row_sq_sums(grads) is None
    assert not cpu.rowwise_adagrad_(w_c, acc_c, rows, grads, sq, 32, 0.1, 1e-8)


def _lookup(dims=(8, 4, 8), mean=False, psw=False, seed=3) -> Lookup:
    """3 tables, 5 entries (tables read twice, as after a table-wise input dist), B=6."""
    gen = torch.Generator().manual_seed(seed)
    rows = (50, 7, 200)
    weights = [torch.randn(r, d, generator=gen) for r, d in zip(rows, dims)]
    entry_table, batch = [0, 2, 1, 0, 2], 6
    lengths = torch.randint(0, 5, (len(entry_table) * batch,), generator=gen)
    values = torch.cat(
        [torch.randint(0, rows[t], (int(n),), generator=gen)
         for t, n in zip(entry_table, lengths.view(len(entry_table), batch).sum(1))]
    )  # fmt: skip
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    weights_per_id = torch.rand(values.numel(), generator=gen) if psw else None
    means = [mean and e % 2 == 0 for e in range(len(entry_table))]
    return Lookup(weights, entry_table, values, offsets, means, weights_per_id)


@pytest.mark.parametrize(
    "kind,mean,psw,scale",
    [("rowwise_adagrad", False, False, 0.5), ("rowwise_adagrad", True, True, 0.5),
     ("sgd", False, False, 0.5), ("sgd", True, False, 0.5), ("rowwise_adagrad", False, True, 0.5),
     ("rowwise_adagrad", False, False, 1.0), ("sgd", False, False, 1.0)],
)  # fmt: skip
def test_fused_backward_update_matches_row_grads_then_update(
    torch_only, kind, mean, psw, scale
) -> None:
    """The one C pass equals torch's row grads + the rule's torch update (bitwise for
    sum pooling's gradients; the step within an ulp), on mixed dims, repeated tables,
    empty bags, mean and weighted entries, with a grad scale (1: the pass that skips the
    multiply)."""
    lookup = _lookup(mean=mean, psw=psw)
    grad_out = torch.randn(lookup.batch, lookup.columns()[-1])
    rule = StepRule(kind, 0.05, 1e-8)
    states = [{"sum": torch.rand(w.shape[0])} for w in lookup.weights]
    before = [w.clone() for w in lookup.weights], [st["sum"].clone() for st in states]

    assert TorchBackend().backward_update(lookup, grad_out, rule, states, scale)
    fused = [w.clone() for w in lookup.weights], [st["sum"].clone() for st in states]

    for w, b in zip(lookup.weights, before[0]):
        w.copy_(b)
    for st, b in zip(states, before[1]):
        st["sum"].copy_(b)
    torch_only()
    assert not TorchBackend().backward_update(lookup, grad_out, rule, states, scale)
    optimizer = RowWiseAdagrad(0.05) if kind == "rowwise_adagrad" else None
    for w, st, (ids, g) in zip(
        lookup.weights, states, TorchBackend().backward_rows(lookup, grad_out * scale)
    ):
        if optimizer is not None:
            optimizer.update_rows(w, st, ids, g)
        else:
            w.index_add_(0, ids, sgd_step(g, 0.05))
    for got, want in zip(fused[0], lookup.weights):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for got, want in zip(fused[1], [st["sum"] for st in states]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert any(not torch.equal(a, b) for a, b in zip(fused[0], before[0]))  # it stepped


def test_fused_backward_update_changes_nothing_for_a_bad_id() -> None:
    lookup = _lookup()
    values = lookup.values.clone()
    values[-1] = lookup.weights[lookup.entry_table[-1]].shape[0]  # one past its table
    bad = Lookup(lookup.weights, lookup.entry_table, values, lookup.offsets, lookup.mean)
    before = [w.clone() for w in lookup.weights]
    grad_out = torch.randn(bad.batch, bad.columns()[-1])
    assert not TorchBackend().backward_update(bad, grad_out, StepRule("sgd", 0.1), [{}] * 3)
    assert all(torch.equal(w, b) for w, b in zip(lookup.weights, before))


def test_malformed_arguments_are_declined_or_refused_never_read_past() -> None:
    """Sizes that do not match, offsets past the ids, row indices past the rows: the C
    code never reads or writes outside its buffers (torch's path then reports them)."""
    lookup = _lookup()
    grad_out = torch.randn(lookup.batch, lookup.columns()[-1])
    before = [w.clone() for w in lookup.weights]
    sgd = StepRule("sgd", 0.1)
    past = lookup.offsets.clone()
    past[-1] = lookup.values.numel() + 5
    backwards = past.clone()
    backwards[3] = backwards[4] + 1
    for offsets in (past, backwards):
        bad = Lookup(lookup.weights, lookup.entry_table, lookup.values, offsets, lookup.mean)
        assert not TorchBackend().backward_update(bad, grad_out, sgd, [{}] * 3)
    assert not TorchBackend().backward_update(lookup, grad_out[:, 1:], sgd, [{}] * 3)
    assert all(torch.equal(w, b) for w, b in zip(lookup.weights, before))

    keys, rows, index, scale = _keys_and_rows()
    assert cpu.sum_rows_by_key(keys, rows, index[:-1], key_bound=5000) is None
    assert cpu.sum_rows_by_key(keys, rows, index, scale[:-1], key_bound=5000) is None
    index[7] = rows.shape[0]
    with pytest.raises(IndexError, match="row index"):
        cpu.sum_rows_by_key(keys, rows, index, key_bound=5000)


def test_without_a_compiler_torch_runs_and_says_so(monkeypatch) -> None:
    monkeypatch.setattr(cpu, "_compiler", lambda: None)
    cpu._library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no C compiler"):
            assert not cpu.available()
        keys, rows, index, _ = _keys_and_rows()
        assert cpu.sum_rows_by_key(keys, rows, index, key_bound=5000) is None
    finally:
        monkeypatch.undo()
        cpu._library.cache_clear()
    assert cpu.available()
