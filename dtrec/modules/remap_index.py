"""A hash index over a remapper's kept ids: the hot-path lookup of managed collision.

``searchsorted`` over the sorted kept ids costs about 20 dependent reads per id into an
array of ``zch_size`` int64 (8 MB for a million rows): on CPU it was most of the remap.
This index is built from the same sorted ids and row mapping when they change (at an
eviction, a load) and answers the same question with a fixed number of reads per id,
contiguous in memory:

- ``capacity`` = the power of two >= 2 x ``zch_size``; an id's home slot is the top bits of
  ``id * 0xC4CEB9FE1A85EC53`` (multiplicative hashing: clustered ids spread; not the
  golden ratio, which id generators often use themselves);
- linear probing without wrap-around, built vectorised: with the kept ids ordered by home
  slot, id i sits at ``i + cummax(home - i)`` (the first free slot at or after its home);
- ``probes`` = the largest distance from home + 1 (a host int, known at build). A lookup
  gathers the ``probes`` slots from each id's home, compares, and takes the row of the
  match or ``miss_row``: ``[n, probes]`` reads, no loop, no host sync, the same ops on GPU.

At load factor <= 1/2 the mean distance is well under one slot; ``probes`` is the worst
case (single digits for a million ids). Memory: 16 bytes per slot, 32-64 per row.
Results equal ``remap_ids`` for every id below int64 max (the empty-slot marker, never a
valid id: ids lie in ``[0, input_hash_size)``).

Example::

    index = HashRemapIndex(sorted_raw_ids, rows, miss_row=zch_size - 1)
    assert torch.equal(index.lookup(ids), remap_ids(ids, sorted_raw_ids, rows, zch_size - 1))
"""

from __future__ import annotations

import torch
from torch import Tensor

from dtrec.kernels import cpu as cpu_kernels

_MULT = -4265267296055464877  # 0xC4CEB9FE1A85EC53 as int64 (murmur3's; also in rows.c)
_EMPTY = torch.iinfo(torch.int64).max  # as in the sorted ids: never a valid id


class HashRemapIndex:
    """Kept raw id -> row, for ``lookup``; built once per change of the map."""

    def __init__(self, sorted_raw_ids: Tensor, rows: Tensor, miss_row: int) -> None:
        kept = sorted_raw_ids != _EMPTY
        ids, id_rows = sorted_raw_ids[kept], rows[kept]
        size = sorted_raw_ids.numel()
        self.bits = max(1, (2 * size - 1).bit_length())
        self.miss_row = miss_row
        home, order = torch.sort(self._home(ids))
        at = torch.arange(home.numel(), device=home.device)
        slot = at + torch.cummax(home - at, 0).values if home.numel() else home
        self.probes = int((slot - home).max()) + 1 if home.numel() else 1  # one host sync
        length = (1 << self.bits) + self.probes
        self.slot_ids = torch.full((length,), _EMPTY, dtype=torch.int64, device=ids.device)
        self.slot_rows = torch.full((length,), miss_row, dtype=torch.int64, device=ids.device)
        self.slot_ids[slot] = ids[order]
        self.slot_rows[slot] = id_rows[order]
        # the window of a lookup: its home (signed, see _signed_home) + half + 0..probes-1
        half = 1 << (self.bits - 1)
        self._offsets = torch.arange(half, half + self.probes, device=ids.device)

    def _home(self, ids: Tensor) -> Tensor:
        """Top ``bits`` bits of ``ids * golden`` (mod 2^64), as a slot in ``[0, 2**bits)``."""
        return self._signed_home(ids) + (1 << (self.bits - 1))

    def _signed_home(self, ids: Tensor) -> Tensor:
        """The home slot minus ``2**(bits - 1)``: torch's ``>>`` of int64 is arithmetic, so the
        top bits come out signed; the lookup adds the half back with its offsets (one op
        fewer than masking)."""
        return (ids * _MULT) >> (64 - self.bits)

    def lookup(self, values: Tensor) -> Tensor:
        """Each id's row, or ``miss_row`` (int64, like ``values``): on CPU one C pass
        (``dtrec.kernels.cpu.remap_lookup``) where the C kernels run, else 9 torch ops.

        At most one slot of a window matches; every kept row is below ``miss_row`` (the
        last), so the smallest of (matched row, ``miss_row`` elsewhere) is the answer."""
        done = cpu_kernels.remap_lookup(
            self.slot_ids, self.slot_rows, self.bits, self.probes, values, self.miss_row
        )
        if done is not None:
            return done
        window = self._signed_home(values)[:, None] + self._offsets
        match = self.slot_ids[window] == values[:, None]
        return torch.where(match, self.slot_rows[window], self.miss_row).amin(1)


__all__ = ["HashRemapIndex"]
