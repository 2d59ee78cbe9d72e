"""Carry out a collection's moves: local copies, then all-to-all rounds over the world.

Pieces name ranks of the exchange's group (the model's world), so the old and new blocks
may sit on different meshes. On one mesh every replica group holds the same blocks and
each one moves its own copy (``moves.entry_moves`` picks senders of the destination's
replica index): no traffic crosses replica groups. Tensors travel as bytes (weights and
state may differ in dtype), in the rounds ``moves.rounds`` cut, so the extra memory per
rank is one round's send and receive buffers (about ``chunk_bytes`` each) on top of the
new blocks.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from dtrec.comm.collectives import all_to_all
from dtrec.placements.layout import Block
from dtrec.placements.mesh import world_group
from dtrec.sharded.reshard.moves import Piece, rounds

ROWS_KIND = "reshard.rows"
"""The ``dtrec.comm_stats`` kind of the rows (weights and state) sent to new owners."""

CHUNK_BYTES = 64 << 20
"""Default bound of the bytes one rank sends (and receives) per all-to-all round."""

Locals = Mapping[tuple[int, str], tuple[Tensor, Block]]
"""(table, entry) -> this rank's local tensor of it and the rectangle it holds (a row state:
viewed ``[n, 1]``, its block's rows and columns ``(0, 1)``, like ``moves.entry_rects``);
tables without a block here are absent."""


def _view(tensors: Locals, piece: Piece) -> Tensor:
    """The piece's rectangle of this rank's local tensor of its entry."""
    tensor, block = tensors[piece.table, piece.entry]
    (r0, _), (c0, _) = block.rows, block.cols
    return tensor[piece.rows[0] - r0 : piece.rows[1] - r0, piece.cols[0] - c0 : piece.cols[1] - c0]


def exchange_ranks(
    old: DeviceMesh, new: DeviceMesh
) -> tuple[ProcessGroup | None, dict[int, int], list[list[int]], list[list[int]]]:
    """The group a move from mesh ``old`` to mesh ``new`` runs over (the model's world;
    None: the default group), global rank -> its index in it, and each mesh's ranks per
    shard position as those indices (what ``moves.entry_moves`` takes)."""
    group = world_group(old)
    members = dist.get_process_group_ranks(group) if group is not None else None
    index = {g: i for i, g in enumerate(members or range(dist.get_world_size()))}
    old_ranks = [[index[g] for g in row] for row in old.mesh.tolist()]
    new_ranks = [[index[g] for g in row] for row in new.mesh.tolist()]
    return group, index, old_ranks, new_ranks


def round_buffers(pieces: list[Piece], size: int, chunk_bytes: int) -> dict[int, int]:
    """Per member of the exchange: the most bytes of buffers one round of ``move`` holds on
    it at once: its send buffer and either the pieces it is cut from (while they are
    packed) or the receive buffer and one received piece (while it is unpacked)."""
    most: dict[int, int] = {}
    for round_pieces in rounds(pieces, size, chunk_bytes):
        send: dict[int, int] = {}
        receive: dict[int, int] = {}
        piece: dict[int, int] = {}
        for p in round_pieces:
            send[p.src] = send.get(p.src, 0) + p.nbytes
            receive[p.dst] = receive.get(p.dst, 0) + p.nbytes
            piece[p.dst] = max(piece.get(p.dst, 0), p.nbytes)
        for rank in send.keys() | receive.keys():
            out = send.get(rank, 0)
            held = max(2 * out, out + receive.get(rank, 0) + piece.get(rank, 0))
            most[rank] = max(most.get(rank, 0), held)
    return most


def _as_bytes(t: Tensor) -> Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def move(
    pieces: list[Piece],
    old: Locals,
    new: Locals,
    rank: int,
    group: ProcessGroup | None,
    size: int,
    device: torch.device,
    chunk_bytes: int = CHUNK_BYTES,
) -> int:
    """Copy the pieces this rank (``rank`` in ``group``) receives into ``new``: its own
    locally, the others from their ``src`` over ``group`` (of ``size`` members, None: the
    default group; buffers on ``device``, where the group's collectives run).

    Collective over ``group`` (every member passes the same ``pieces``). Returns the bytes
    this rank sent.
    """
    with torch.no_grad():
        for piece in pieces:
            if piece.src == piece.dst == rank:
                _view(new, piece).copy_(_view(old, piece))
    sent = 0
    for round_pieces in rounds(pieces, size, chunk_bytes):
        outgoing = [[p for p in round_pieces if p.src == rank and p.dst == d] for d in range(size)]
        incoming = [[p for p in round_pieces if p.dst == rank and p.src == s] for s in range(size)]
        in_splits = [sum(p.nbytes for p in ps) for ps in outgoing]
        out_splits = [sum(p.nbytes for p in ps) for ps in incoming]
        parts = [_as_bytes(_view(old, p)) for ps in outgoing for p in ps]
        empty = torch.empty(0, dtype=torch.uint8, device=device)
        send = torch.cat(parts).to(device) if parts else empty
        del parts  # the round's buffers: ``round_buffers`` counts them
        received = all_to_all(send, out_splits, in_splits, group, ROWS_KIND)
        sent += sum(in_splits)
        offset = 0
        with torch.no_grad():
            for ps in incoming:
                for p in ps:
                    target = _view(new, p)
                    chunk = received[offset : offset + p.nbytes]
                    # a copy: the byte offset of a piece need not be aligned to its dtype
                    target.copy_(chunk.clone().view(target.dtype).view(target.shape))
                    offset += p.nbytes
    return sent
