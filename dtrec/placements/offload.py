"""The host-offload option of a table spec: its blocks in host memory, a device cache of rows.

A table larger than its ranks' device memory is trained from host memory (pinned on
CUDA) through a device-resident cache of some of its rows (``dtrec.sharded.offload``):
each block of the table (a row block, a column block, the whole table) keeps its rows
and their optimizer state in host memory, and a cache of ``cache_rows`` of them on the
device. Every sharding type but ``DataParallel`` takes the option, as keyword fields
of the spec::

    RowWise(cache_rows=100_000)        # each row block: 100k rows cached on the device
    TableWise(rank=1, cache_fraction=0.1)  # a tenth of the table's rows cached

``cache_fraction`` is TorchRec's ``cache_load_factor`` (``dtrec.interop.plans`` maps it
from a TorchRec plan's ``FUSED_UVM_CACHING`` kernel). Training is exact: the same
weights and optimizer state as without the cache.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dtrec.placements.layout import TableLayout


@dataclass(frozen=True, repr=False)
class Offloadable:
    """Keyword fields every spec but ``DataParallel`` has: where its blocks live.

    Neither given (the default): on the device. One of them: in host memory, with a
    device cache of that many of each block's rows.
    """

    cache_rows: int | None = field(default=None, kw_only=True)
    """Rows of each block kept in a device cache (at most the block's rows); the block
    itself lives in host memory. None: the block lives on the device."""
    cache_fraction: float | None = field(default=None, kw_only=True)
    """The device cache as a fraction in (0, 1] of each block's rows, rounded up
    (TorchRec's ``cache_load_factor``). None: see ``cache_rows``."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        rows, fraction = self.cache_rows, self.cache_fraction
        if rows is not None and fraction is not None:
            raise ValueError(
                f"{name}: give cache_rows ({rows}) or cache_fraction ({fraction}), not both"
            )
        if rows is not None and (
            isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or rows < 1
        ):
            raise ValueError(f"{name}: cache_rows must be a positive int, got {rows!r}")
        if fraction is not None and (
            isinstance(fraction, bool)
            or not isinstance(fraction, numbers.Real)
            or not math.isfinite(fraction)
            or not 0 < fraction <= 1
        ):
            raise ValueError(f"{name}: cache_fraction must be a number in (0, 1], got {fraction!r}")

    @property
    def offloaded(self) -> bool:
        """Whether the table's blocks live in host memory behind a device cache."""
        return self.cache_rows is not None or self.cache_fraction is not None

    def cache_capacity(self, block_rows: int) -> int | None:
        """Device cache rows of a block of ``block_rows`` rows (None: not offloaded)."""
        if self.cache_rows is not None:
            return min(int(self.cache_rows), block_rows)
        if self.cache_fraction is not None:
            return min(math.ceil(self.cache_fraction * block_rows), block_rows)
        return None

    def _with_cache(self, layout: TableLayout) -> TableLayout:
        """``layout`` with each block's cache rows when the table is offloaded."""
        if not self.offloaded:
            return layout
        rows = tuple(self.cache_capacity(b.num_rows) or 0 for b in layout.blocks)
        return replace(layout, cache_rows=rows)

    def cache_text(self) -> str:
        """``"+cache(1000)"`` / ``"+cache(5%)"``: what ``str(spec)`` appends ("" on device)."""
        if self.cache_rows is not None:
            return f"+cache({self.cache_rows})"
        if self.cache_fraction is not None:
            return f"+cache({100 * self.cache_fraction:g}%)"
        return ""

    def __str__(self) -> str:
        return f"{self.short}{self.cache_text()}"  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        """``RowWise()``, ``TableWise(rank=3)``, ``RowWise(cache_rows=10)``: the spec's own
        fields first, the keyword options only when set."""
        own = [f.name for f in fields(self) if not f.kw_only]
        shown = [f"{n}={getattr(self, n)!r}" for n in own]
        shown += [  # keyword options (cache fields, ``fully_sharded``): only when set
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if f.kw_only and getattr(self, f.name) != f.default
        ]
        return f"{type(self).__name__}({', '.join(shown)})"


_CACHE_FIELDS = ("cache_rows", "cache_fraction")
