"""``dtrec.sharded.reshard.moves``: which cells travel when a table's spec changes (no world)."""

from __future__ import annotations

import pytest

import dtrec
from dtrec.placements import ColumnWise, DataParallel, RowWise, TableWise
from dtrec.placements.mesh import ShardAxis
from dtrec.sharded.reshard.moves import entry_moves, rounds

AXIS = ShardAxis(4, 1, None)
TABLE = dtrec.EmbeddingBagConfig("t", 10, 8, ["f"])  # 8 columns: every CW position has 2


def _moves(old, new, kind="weight"):
    return entry_moves(0, "t", "w", kind, old.layout(TABLE, AXIS), new.layout(TABLE, AXIS), 4)


def test_same_spec_moves_nothing():
    for spec in (TableWise(rank=2), RowWise(), ColumnWise(), DataParallel()):
        assert all(p.src == p.dst for p in _moves(spec, spec)), spec


def test_table_wise_to_row_wise_sends_three_quarters():
    pieces = _moves(TableWise(rank=1), RowWise())
    sent = [p for p in pieces if p.src != p.dst]
    assert {p.src for p in pieces} == {1}
    assert sum(p.nbytes for p in sent) == (10 - 3) * 8 * 4  # position 1 keeps rows 3..5


def test_data_parallel_to_anything_is_local():
    for spec in (TableWise(rank=3), RowWise(), ColumnWise()):
        assert all(p.src == p.dst for p in _moves(DataParallel(), spec)), spec


def test_row_state_of_column_shards_is_local_to_row_wise():
    """Every column shard holds all rows of a row state: moving it to row-wise is local."""
    assert all(p.src == p.dst for p in _moves(ColumnWise(), RowWise(), kind="row"))


def test_copies_to_data_parallel_are_spread_over_holders():
    pieces = [p for p in _moves(ColumnWise(), DataParallel(), kind="row") if p.src != p.dst]
    assert not pieces  # every position already holds every row
    sent = [p for p in _moves(ColumnWise(), DataParallel()) if p.src != p.dst]
    assert sum(p.nbytes for p in sent) == 3 * 10 * 8 * 4  # each position lacks 3/4 of it


@pytest.mark.parametrize("chunk", [1, 24, 100, 1 << 20])
def test_rounds_keep_every_byte_and_the_bound(chunk):
    pieces = _moves(TableWise(rank=0), RowWise())
    sent = [p for p in pieces if p.src != p.dst]
    cut = rounds(pieces, 4, chunk)
    assert sum(p.nbytes for r in cut for p in r) == sum(p.nbytes for p in sent)
    row = 8 * 4
    for r in cut:
        for pair in {(p.src, p.dst) for p in r}:
            size = sum(p.nbytes for p in r if (p.src, p.dst) == pair)
            assert size <= max(chunk // 4, row)


def test_round_buffers_count_send_and_receive():
    """TW(0) -> RW on 4 positions: position 0 sends rows 3..9 (3 + 3 + 1 rows of 32 bytes).
    In one round it holds its packed pieces and send buffer at once (2 x 224 bytes); each
    receiver its buffer and one received piece (2 x its rows). Cut in rounds of at most
    one row per pair, the sender holds 2 x 3 rows, a receiver 2 rows."""
    from dtrec.sharded.reshard.exchange import round_buffers

    pieces = _moves(TableWise(rank=0), RowWise())
    row = 8 * 4
    assert round_buffers(pieces, 4, 1 << 20) == {0: 2 * 7 * row, 1: 6 * row, 2: 6 * row, 3: 2 * row}
    assert round_buffers(pieces, 4, 4 * row) == {0: 2 * 3 * row, 1: 2 * row, 2: 2 * row, 3: 2 * row}
