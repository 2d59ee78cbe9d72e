"""``TableConstraint``: a user's limits on one table's spec, for the planner.

It sits with the placements (it names spec classes and counts a layout's blocks) so that
both the planner and the TorchRec plan translation (``dtrec.interop.plans``) can use it
without the translation importing the planner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from dtrec.modules.config import EmbeddingBagConfig
from dtrec.placements.mesh import ShardAxis
from dtrec.placements.specs import TableSpec

T = TypeVar("T", bound=Any)


@dataclass(frozen=True)
class TableConstraint:
    """Limits on one table's spec, for ``dtrec.plan`` (a spec there pins it instead).

    Example::

        dtrec.plan(model, mesh, {"sparse.big": TableConstraint(types=(RowWise, ColumnWise),
                                                               min_shards=4)})
    """

    types: tuple[type[TableSpec], ...] | None = None
    """Spec classes allowed (None: any)."""
    min_shards: int = 1
    """Fewest distinct blocks the table is cut into (data-parallel and table-wise: 1)."""
    max_shards: int | None = None
    pooling_factor: float | None = None
    """Ids per bag of the table's features, overriding ``Topology.pooling_factors``."""
    cache_fraction: float | None = None
    """Offload the table: its blocks in host memory behind device caches of this fraction
    of their rows (TorchRec's ``cache_load_factor``). None: the planner decides."""

    def __post_init__(self) -> None:
        if self.types is not None and (
            not isinstance(self.types, tuple)
            or not all(isinstance(t, type) and issubclass(t, TableSpec) for t in self.types)
        ):
            raise TypeError(
                "TableConstraint.types must be a tuple of dtrec.placements spec classes "
                f"(e.g. (RowWise, ColumnWise)) or None, got {self.types!r}"
            )
        for name in ("min_shards", "max_shards"):
            value = getattr(self, name)
            if value is None and name == "max_shards":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TableConstraint.{name} must be an int >= 1, got {value!r}")
        if self.max_shards is not None and self.max_shards < self.min_shards:
            raise ValueError(
                f"TableConstraint.max_shards={self.max_shards} < min_shards={self.min_shards}"
            )
        if self.pooling_factor is not None and not (
            isinstance(self.pooling_factor, (int, float))
            and math.isfinite(self.pooling_factor)
            and self.pooling_factor >= 0
        ):
            raise ValueError(
                f"TableConstraint.pooling_factor must be a number >= 0 or None, got "
                f"{self.pooling_factor!r}"
            )
        if self.cache_fraction is not None and not (
            isinstance(self.cache_fraction, (int, float))
            and not isinstance(self.cache_fraction, bool)
            and 0 < self.cache_fraction <= 1
        ):
            raise ValueError(
                f"TableConstraint.cache_fraction must be a number in (0, 1] or None, got "
                f"{self.cache_fraction!r}"
            )

    def __str__(self) -> str:
        """Like the repr, with class names for types and defaults left out (for errors)."""
        names = None if self.types is None else [t.__name__ for t in self.types]
        shown = {
            "types": None if names is None else f"({', '.join(names)}{',' * (len(names) == 1)})",
            "min_shards": self.min_shards if self.min_shards != 1 else None,
            "max_shards": self.max_shards,
            "pooling_factor": self.pooling_factor,
            "cache_fraction": self.cache_fraction,
        }
        args = ", ".join(f"{k}={v}" for k, v in shown.items() if v is not None)
        return f"TableConstraint({args})"

    def allows(self, spec: TableSpec, cfg: EmbeddingBagConfig, axis: ShardAxis) -> bool:
        if self.types is not None and not isinstance(spec, self.types):
            return False
        shards = len({(b.rows, b.cols) for b in spec.layout(cfg, axis).blocks})
        return self.min_shards <= shards and (self.max_shards is None or shards <= self.max_shards)

    def topology(self, cfg: EmbeddingBagConfig, topology: T) -> T:
        """``topology`` (the planner's ``Topology``) with this table's pooling factor."""
        if self.pooling_factor is None:
            return topology
        ours = {f: self.pooling_factor for f in cfg.feature_names}
        return replace(topology, pooling_factors={**topology.pooling_factors, **ours})
