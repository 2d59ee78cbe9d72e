"""Table initialisation that does not depend on the sharding: any block of a table can be
made on its own, with the values it would have in the full table.

Used for tables on the meta device: each rank creates only its blocks, directly on its
device, so no rank ever holds a full table. Values are TorchRec's default init (uniform
in +-sqrt(1 / rows)) drawn in chunks of ``CHUNK_ROWS`` rows, each chunk from a generator
seeded by (seed, table name, chunk index): the same table under any plan, mesh or world
size gets the same values.
"""

from __future__ import annotations

import functools
import hashlib
import math

import torch
from torch import Tensor

CHUNK_ROWS = 1 << 14


def _chunk_seed(seed: int, table: str, chunk: int) -> int:
    digest = hashlib.sha256(f"{seed}/{table}/{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def table_block(
    table: str,
    num_embeddings: int,
    embedding_dim: int,
    rows: tuple[int, int],
    cols: tuple[int, int],
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    out: Tensor | None = None,
) -> Tensor:
    """Rows ``[rows)`` and columns ``[cols)`` of table ``table``'s default init (written
    into ``out`` when given). Memory: the block plus one chunk of full-width rows."""
    (r0, r1), (c0, c1) = rows, cols
    bound = math.sqrt(1.0 / num_embeddings)
    if out is None:
        out = torch.empty(r1 - r0, c1 - c0, dtype=dtype, device=device)
    elif tuple(out.shape) != (r1 - r0, c1 - c0):
        raise ValueError(f"table {table!r}: out has shape {tuple(out.shape)}, block is "
                         f"{(r1 - r0, c1 - c0)}")  # fmt: skip
    for chunk in range(r0 // CHUNK_ROWS, -(-r1 // CHUNK_ROWS)):
        lo, hi = chunk * CHUNK_ROWS, min((chunk + 1) * CHUNK_ROWS, num_embeddings)
        gen = torch.Generator().manual_seed(_chunk_seed(seed, table, chunk))
        values = torch.empty(hi - lo, embedding_dim).uniform_(-bound, bound, generator=gen)
        a, b = max(lo, r0), min(hi, r1)
        out[a - r0 : b - r0] = values[a - lo : b - lo, c0:c1]
    return out


_MIX1 = 0xFF51AFD7ED558CCD - (1 << 64)  # murmur3's 64-bit finaliser constants, as int64
_MIX2 = 0xC4CEB9FE1A85EC53 - (1 << 64)


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: Tensor) -> Tensor:
    """murmur3 fmix64 on int64 tensors (multiplication wraps)."""
    x = x ^ _shift_right(x, 33)
    x = x * _MIX1
    x = x ^ _shift_right(x, 33)
    x = x * _MIX2
    return x ^ _shift_right(x, 33)


def reset_rows_init(
    table: str,
    num_embeddings: int,
    embedding_dim: int,
    rows: Tensor,
    iteration: int,
    seed: int,
    cols: tuple[int, int] | None = None,
    dtype: torch.dtype = torch.float32,
    bounds: tuple[float, float] | None = None,
) -> Tensor:
    """Fresh default-init values (uniform in +-sqrt(1 / rows), or in ``bounds`` = (low,
    high) when given) for ``rows`` of ``table``, reset at step ``iteration``:
    ``[len(rows), cols]`` on ``rows``' device.

    A counter-based hash of (seed, table, iteration, row, column), not a generator: any
    subset of rows or columns, on any rank, in any order, gets the values the whole table
    would, so a sharded table's owners reset their rows exactly as the unsharded table.
    """
    c0, c1 = (0, embedding_dim) if cols is None else cols
    digest = hashlib.sha256(f"{seed}/{table}/reset/{iteration}".encode()).digest()
    base = int.from_bytes(digest[:8], "little") - (1 << 63)
    row_keys = _mix(rows.to(torch.int64) * embedding_dim + base)
    col = torch.arange(c0, c1, dtype=torch.int64, device=rows.device)
    bits = _shift_right(_mix(row_keys[:, None] + col[None, :]), 11)  # 53 random bits
    unit = bits.to(torch.float64) * (1.0 / (1 << 53))
    if bounds is not None:
        low, high = bounds
        return (low + unit * (high - low)).to(dtype)
    bound = math.sqrt(1.0 / num_embeddings)
    return ((2.0 * unit - 1.0) * bound).to(dtype)


def uniform_init_bounds(init_fn: object) -> tuple[float, float] | None:
    """(low, high) when ``init_fn`` is ``functools.partial(torch.nn.init.uniform_, a=...,
    b=...)`` (what every TorchRec config gets by default, from its ``weight_init_min`` /
    ``weight_init_max``), else None: such an init can be redrawn by ``reset_rows_init``."""
    if not isinstance(init_fn, functools.partial) or init_fn.func is not torch.nn.init.uniform_:
        return None
    if init_fn.args or set(init_fn.keywords) - {"a", "b"}:
        return None
    low, high = init_fn.keywords.get("a", 0.0), init_fn.keywords.get("b", 1.0)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)):
        return None
    return float(low), float(high)
