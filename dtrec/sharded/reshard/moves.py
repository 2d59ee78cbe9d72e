"""Which parts of a table move when its spec changes, and in which rounds they travel.

Pure bookkeeping over ``TableLayout`` blocks (no tensors, no process groups), so every
rank computes the same moves and no metadata is exchanged. A table's entries are its
weight and its fused optimizer state: "weight" state (Adam's moments) has the weight's
blocks, "row" state (row-wise Adagrad's sum) only their row ranges, so column shards of
one row range all hold the same rows of it (copies, like a data-parallel table's blocks).

Positions become ranks through each mesh's rows (``old_ranks`` / ``new_ranks``: the
ranks holding each shard position, replicas in order), so the old and new layouts may
sit on different meshes of the same world (another shard group size, 1-D <-> 2-D): a
cell of the new layout is copied locally when its new holder rank already holds it,
else sent by one of its old holder ranks (preferably one of the destination's replica
index, so that on one mesh nothing crosses replica groups; copies are spread over them
by destination). So only cells whose holder ranks grow travel, each once to each new
holder rank (every replica of a new block receives its copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dtrec.placements.layout import TableLayout

Rect = tuple[tuple[int, int], tuple[int, int]]
"""(rows [start, end), cols [start, end)) in the table's global coordinates."""


@dataclass(frozen=True)
class Piece:
    """A rectangle of one table entry going from rank ``src`` to rank ``dst`` (ranks of the
    exchange's group; the shard positions themselves when no ranks are given)."""

    table: int
    """Index of the table in its collection."""
    entry: str
    """``"weight"`` or the optimizer state entry (``"exp_avg"``, ``"sum"``, ...)."""
    src: int
    dst: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    row_bytes: int
    """Bytes of one row of the piece (its columns times the entry's element size)."""

    @property
    def nbytes(self) -> int:
        return (self.rows[1] - self.rows[0]) * self.row_bytes

    def split_rows(self, most_bytes: int) -> list[Piece]:
        """This piece cut into row ranges of at most ``most_bytes`` (at least one row)."""
        step = max(1, most_bytes // max(self.row_bytes, 1))
        start, end = self.rows
        return [
            Piece(
                self.table,
                self.entry,
                self.src,
                self.dst,
                (r, min(r + step, end)),
                self.cols,
                self.row_bytes,
            )  # fmt: skip
            for r in range(start, end, step)
        ]


def entry_rects(layout: TableLayout, kind: str) -> list[tuple[int, Rect]]:
    """(position, rectangle) of each block of an entry of ``kind`` ("weight" or "row")."""
    if kind == "weight":
        return [(b.position, (b.rows, b.cols)) for b in layout.blocks]
    return [(b.position, (b.rows, (0, 1))) for b in layout.blocks]


def _intersect(a: Rect, b: Rect) -> Rect | None:
    rows = (max(a[0][0], b[0][0]), min(a[0][1], b[0][1]))
    cols = (max(a[1][0], b[1][0]), min(a[1][1], b[1][1]))
    if rows[0] >= rows[1] or cols[0] >= cols[1]:
        return None
    return rows, cols


def _area(rect: Rect) -> int:
    return (rect[0][1] - rect[0][0]) * (rect[1][1] - rect[1][0])


def entry_moves(
    table: int,
    name: str,
    entry: str,
    kind: str,
    old: TableLayout,
    new: TableLayout,
    element_size: int,
    old_ranks: Sequence[Sequence[int]] | None = None,
    new_ranks: Sequence[Sequence[int]] | None = None,
) -> list[Piece]:
    """Every piece of one entry of a table, local copies (``src == dst``) included.

    ``old_ranks[p]`` / ``new_ranks[p]``: the ranks holding shard position ``p`` of the old
    / new mesh, one per replica (None: position ``p`` is rank ``p``, one replica). Old
    blocks are either disjoint or identical copies (replicated: data parallel, a row
    state over column shards); ValueError for a layout with partly overlapping blocks.
    """

    def ranks_of(table: Sequence[Sequence[int]] | None, position: int) -> Sequence[int]:
        return (position,) if table is None else table[position]

    holders: dict[Rect, list[int]] = {}
    for position, rect in entry_rects(old, kind):
        holders.setdefault(rect, []).append(position)
    distinct = list(holders)
    for i, a in enumerate(distinct):
        for b in distinct[i + 1 :]:
            if _intersect(a, b) is not None:
                raise ValueError(
                    f"table {name!r}: its current blocks overlap without being copies of each "
                    f"other ({a} and {b}); reshard cannot plan the move"
                )
    pieces = []
    for position, target in entry_rects(new, kind):
        covered = 0
        for rect, where in holders.items():
            part = _intersect(rect, target)
            if part is None:
                continue
            width = part[1][1] - part[1][0]
            for replica, dst in enumerate(ranks_of(new_ranks, position)):
                held = [ranks_of(old_ranks, q) for q in where]
                same = [rs[replica] for rs in held if replica < len(rs)]
                if any(dst in rs for rs in held):
                    src = dst
                elif same:  # the destination's replica index: within its replica group
                    src = same[position % len(same)]
                else:  # another mesh shape: spread over every holder
                    flat = sorted(r for rs in held for r in rs)
                    src = flat[dst % len(flat)]
                pieces.append(Piece(table, entry, src, dst, *part, width * element_size))
            covered += _area(part)
        if covered != _area(target):
            raise ValueError(
                f"table {name!r}: the current blocks do not cover the new block at position "
                f"{position} ({target}); reshard cannot plan the move"
            )
    return pieces


def rounds(pieces: list[Piece], size: int, chunk_bytes: int) -> list[list[Piece]]:
    """The sent pieces (``src != dst``) in all-to-all rounds: per round, each (src, dst)
    pair carries at most ``chunk_bytes // size`` bytes (or one row, if a row is larger), so
    a rank sends and receives at most about ``chunk_bytes`` per round. Pieces keep their
    order within a pair; every rank computes the same rounds."""
    per_pair = max(1, chunk_bytes // max(size, 1))
    by_pair: dict[tuple[int, int], list[list[Piece]]] = {}
    for piece in pieces:
        if piece.src == piece.dst or piece.nbytes == 0:
            continue
        queue = by_pair.setdefault((piece.src, piece.dst), [[]])
        for part in piece.split_rows(per_pair):
            filled = sum(p.nbytes for p in queue[-1])
            if queue[-1] and filled + part.nbytes > per_pair:
                queue.append([])
            queue[-1].append(part)
    count = max((len(q) for q in by_pair.values()), default=0)
    return [[p for q in by_pair.values() if i < len(q) for p in q[i]] for i in range(count)]
