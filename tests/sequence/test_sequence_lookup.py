"""The sequence lookup's one-call paths (``dtrec.sharded.lookup.sequence``) against plain
indexing: rows in the ids' order for runs out of table order, mixed widths, empty tables."""

from __future__ import annotations

import pytest
import torch

from dtrec.ops.lookup import packed_views
from dtrec.sharded.lookup.sequence import IdRuns, PackedRows, RowPool, bags_per_entry

SHAPES = [(7, 4), (5, 8), (9, 4)]  # mixed widths: runs of gcd 4 columns


def _case(counts: list[int], run_table: list[int]):
    gen = torch.Generator().manual_seed(0)
    weights = packed_views(SHAPES, torch.float32, torch.device("cpu"))
    for w in weights:
        w.copy_(torch.randn(w.shape, generator=gen))
    ids = torch.cat(
        [torch.randint(0, SHAPES[u][0], (c,), generator=gen) for c, u in zip(counts, run_table)]
    )
    want = torch.cat(
        [weights[u][part].reshape(-1) for part, u in zip(ids.split(counts), run_table)]
    )
    return weights, IdRuns(ids, run_table, counts, len(SHAPES)), want


@pytest.mark.parametrize(
    "counts,run_table",
    [
        ([3, 0, 5, 2, 4, 1], [0, 1, 2, 0, 1, 2]),  # received order: runs out of table order
        ([4, 6, 2], [0, 1, 2]),  # already table-major
        ([0, 9, 0], [0, 1, 2]),  # tables without ids
        ([0, 0, 0], [2, 1, 0]),  # no ids at all
    ],
)
def test_packed_gather_and_row_pool_give_the_rows_in_order(counts, run_table) -> None:
    weights, runs, want = _case(counts, run_table)
    packed = PackedRows.of(weights)
    assert packed is not None  # views of one buffer
    got = packed.units.index_select(0, packed.gather_index(runs)).reshape(-1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    pool = RowPool(None, [0, 1, 2], weights, runs.per_table, runs.table_major_ids())
    torch.testing.assert_close(pool.rows(runs), want, rtol=0, atol=0)


def test_row_pool_backward_is_the_dense_gradient() -> None:
    weights, runs, _ = _case([3, 4, 5, 2], [1, 0, 2, 1])
    params = [w.detach().clone().requires_grad_() for w in weights]
    rows = RowPool(None, [0, 1, 2], params, runs.per_table, runs.table_major_ids()).rows(runs)
    grad = torch.randn(rows.shape)
    rows.backward(grad)
    for u, p in enumerate(params):
        want = torch.zeros_like(p)
        start = 0
        for part, t in zip(runs.ids.split(runs.counts), runs.run_table):
            width = SHAPES[t][1]
            g = grad[start : start + part.numel() * width].view(-1, width)
            start += part.numel() * width
            if t == u:
                want.index_add_(0, part, g)
        torch.testing.assert_close(p.grad, want)


def test_unpacked_tables_have_no_packed_rows() -> None:
    assert PackedRows.of([torch.zeros(3, 4), torch.zeros(2, 4)]) is None


@pytest.mark.parametrize(
    "counts,want", [([10, 9, 8], 10), ([100, 1, 1], 34), ([0, 0], 1), ([5], 5)]
)
def test_bags_per_entry_pads_at_most_double(counts, want) -> None:
    assert bags_per_entry(counts) == want
