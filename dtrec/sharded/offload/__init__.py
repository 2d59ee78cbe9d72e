"""Offloaded tables: blocks in host memory behind an exact device cache of rows.

``host.py`` the host tier and its copies, ``row_cache.py`` one block's cache (its slots,
write-back, the fused update's row mapping), ``group.py`` every block's bookkeeping as one
(a batch's fill for all tables in a fixed set of ops, LRU eviction, the row copies),
``tables.py`` a collection's caches and the fills of its batches, ``build.py`` how a
collection sets them up (the host blocks packed in one buffer). The
spec option that asks for it is ``dtrec.placements.offload``.
"""

from dtrec.sharded.offload.build import offload_tables
from dtrec.sharded.offload.row_cache import RowCache
from dtrec.sharded.offload.tables import OffloadedTables

__all__ = ["OffloadedTables", "RowCache", "offload_tables"]
