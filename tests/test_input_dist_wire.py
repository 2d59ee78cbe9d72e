"""The input dist's ids buffer: int32 on the wire unless a table has 2**31 rows or more."""

from __future__ import annotations

import pytest
import torch

from dtrec.modules.config import EmbeddingBagConfig
from dtrec.sharded.dist.input_dist import pack_weights, packed_size, wire_dtype


def _table(rows: int) -> EmbeddingBagConfig:
    return EmbeddingBagConfig("t", rows, 4, ["f"])


def test_wire_dtype_is_int32_below_two_to_the_31_rows() -> None:
    assert wire_dtype([_table(10), _table(2**31 - 1)]) == torch.int32
    assert wire_dtype([_table(10), _table(2**31)]) == torch.int64  # one large table: all int64


@pytest.mark.parametrize("wire", [torch.int32, torch.int64])
@pytest.mark.parametrize("count", [0, 1, 5, 6])
def test_packed_weights_round_trip_bit_exactly(wire: torch.dtype, count: int) -> None:
    weights = torch.randn(count, generator=torch.Generator().manual_seed(count))
    weights[:1] = float("-inf") if count else weights[:1]  # any bit pattern survives
    packed = pack_weights(weights, wire)
    assert packed.dtype == wire and packed.numel() == packed_size(count, wire)
    assert torch.equal(packed.view(torch.float32)[:count], weights)
