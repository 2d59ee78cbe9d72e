"""Table sharding specs and the shard metadata they produce.

Example::

    plan = {"sparse.t_user": RowWise(), "sparse.t_item": TableWise(rank=1)}
"""

from dtrec.placements.layout import Block, TableLayout, chunk_bounds
from dtrec.placements.specs import (
    ColumnWise,
    DataParallel,
    Grid,
    RowWise,
    TableRowWise,
    TableSpec,
    TableWise,
)

SPEC_TYPES = {
    cls.__name__: cls for cls in (DataParallel, TableWise, RowWise, ColumnWise, TableRowWise, Grid)
}
"""Every spec class by name (plans in JSON name their specs this way)."""

__all__ = [
    "SPEC_TYPES",
    "Block",
    "ColumnWise",
    "DataParallel",
    "Grid",
    "RowWise",
    "TableLayout",
    "TableRowWise",
    "TableSpec",
    "TableWise",
    "chunk_bounds",
]
