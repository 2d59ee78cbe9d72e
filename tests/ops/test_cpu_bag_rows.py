"""``dtrec.kernels.cpu.sum_bag_rows``: the row-sparse backward's keys and bag rows built in C.

It must give ``row_grads`` bitwise the sums of the per-id path it replaces (repeated keys
and bag rows, then ``sum_rows_by_key``), for one embedding dim and for several, and build
no per-id tensor in torch (no ``repeat_interleave``: the many-small-tables step's cost).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dtrec.kernels import cpu
from dtrec.ops.backends import torch as torch_backend
from dtrec.ops.lookup import Lookup

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler: torch paths only")


def _lookup(
    dims: list[int], rows: list[int], entry_table: list[int], batch: int = 33, max_len: int = 4
):
    gen = torch.Generator().manual_seed(sum(rows))
    weights = [torch.randn(r, d, generator=gen) for r, d in zip(rows, dims, strict=True)]
    lengths = torch.randint(0, max_len + 1, (len(entry_table) * batch,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    values = torch.cat(
        [
            # skewed ids: long runs of one row, as on small tables
            (torch.rand(int(lengths[e * batch : (e + 1) * batch].sum()), generator=gen) ** 3
             * rows[t]).long()
            for e, t in enumerate(entry_table)
        ]
    )  # fmt: skip
    grad_out = torch.randn(batch, sum(dims[t] for t in entry_table), generator=gen)
    mean = [False] * len(entry_table)
    return Lookup(weights, entry_table, values, offsets, mean, None, None), grad_out


CASES = [
    ([16, 16, 16], [5, 100, 7], [0, 1, 2, 1]),  # one dim, a table read by two entries
    ([64, 16, 0, 64], [50, 9, 3, 100], [3, 0, 1, 2, 0]),  # two dims and an empty shard
]


@pytest.mark.parametrize(("dims", "rows", "entry_table"), CASES)
def test_row_grads_match_the_per_id_path_bitwise(monkeypatch, dims, rows, entry_table) -> None:
    lookup, grad_out = _lookup(dims, rows, entry_table)
    got = torch_backend.row_grads(lookup, grad_out)
    monkeypatch.setattr(cpu, "sum_bag_rows", lambda *args: None)  # the per-id path
    want = torch_backend.row_grads(lookup, grad_out)
    for (got_ids, got_rows), (want_ids, want_rows) in zip(got, want, strict=True):
        assert torch.equal(got_ids, want_ids) and torch.equal(got_rows, want_rows)


class _PerIdTensors(TorchDispatchMode):
    """Records the ops whose output is an integer tensor with at least ``n`` elements."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.names = n, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        long = isinstance(out, torch.Tensor) and out.numel() >= self.n
        if long and not out.is_floating_point() and not func.__name__.startswith("empty"):
            self.names.append(func.__name__)  # empty: the C kernel's buffers
        return out


@pytest.mark.parametrize(("dims", "rows", "entry_table"), CASES)
def test_row_grads_build_no_per_id_tensors(dims, rows, entry_table) -> None:
    lookup, grad_out = _lookup(dims, rows, entry_table, batch=100, max_len=12)
    # distinct rows and bags are far fewer than ids here: only per-id tensors are this long
    assert lookup.values.numel() > 2 * lookup.offsets.numel()
    with _PerIdTensors(lookup.values.numel() // 2) as per_id:
        torch_backend.row_grads(lookup, grad_out)
    assert per_id.names == []


def test_bad_ids_and_offsets_raise() -> None:
    lookup, grad_out = _lookup([16, 16], [5, 7], [0, 1])
    rows = grad_out.reshape(-1, 16)
    args = (lookup.batch, [0, 1], [0, 5], [0, 1], [2, 2], rows)
    values = lookup.values.clone()
    values[-1] = 12  # past both tables' 12 rows
    with pytest.raises(IndexError, match="key outside"):
        cpu.sum_bag_rows(values, lookup.offsets, *args, 12)
    offsets = lookup.offsets.clone()
    offsets[-1] = values.numel() + 3
    with pytest.raises(IndexError, match="offsets"):
        cpu.sum_bag_rows(lookup.values, offsets, *args, 12)
    with pytest.raises(IndexError, match="gradient row"):
        cpu.sum_bag_rows(lookup.values, lookup.offsets, *args[:4], [3, 3], rows, 12)
    assert cpu.sum_bag_rows(lookup.values, lookup.offsets, *args[:5], rows.double(), 12) is None
