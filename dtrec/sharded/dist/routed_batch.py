"""What the input dist's ids all-to-all delivers (``RoutedBatch``) and its wire format.

The ids buffer holds, per source rank, ``[bag lengths of the served segments | ids |
packed per-sample weights]``, in ``wire_dtype`` (int32 when every table has fewer than
2**31 rows); per-sample weights that are not trained ride in it as fp32 bit patterns
(``pack_weights``). ``RoutedBatch.wait_served`` unpacks it for the lookup, every size
known from the header (no host read).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dtrec.comm.collectives import PendingTensor
from dtrec.modules.config import EmbeddingBagConfig
from dtrec.sparse import KeyedJaggedTensor


@dataclass
class RoutedBatch:
    """A batch after input-dist: its validated features and the ids this rank serves.

    ``ids`` holds, per source rank, ``[lengths of the served segments | ids]``, followed
    by the ids' per-sample weights (fp32 bit patterns, one per int32 slot or two per
    int64 one) when ``packed_weights``; it and
    ``psw`` (per-sample weights that are trained, so they travel in a differentiable
    exchange of their own) may still be in flight until waited on. ``error``: why the
    batch was refused, here or on another rank (``forward`` raises it; no ids sent).
    ``peer_batches``: each shard position's local batch size (they may differ);
    ``peer_segment_counts``: per source, the ids of each served segment (from the header).
    """

    kjt: KeyedJaggedTensor | None
    batch: int
    peer_counts: list[int]
    ids: PendingTensor | None
    psw: PendingTensor | None
    error: Exception | None = None
    packed_weights: bool = False
    peer_batches: list[int] = field(default_factory=list)
    peer_segment_counts: list[list[int]] = field(default_factory=list)

    @property
    def served_batch(self) -> int:
        """Bags per served block: the largest batch of the group (smaller ones padded)."""
        return max(self.peer_batches, default=0)

    def wait_served(
        self, num_segments: int, block_runs: list[tuple[int, int]] | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Wait for the ids; return (bag lengths, ids, per-sample weights or None).

        Bags come in blocks of ``served_batch``, one per (source, served segment),
        numbered source-major (``Routing.served`` order within a source); a source with a
        smaller batch has its blocks padded with empty bags. ``num_segments`` is the
        number of segments this rank serves. ``block_runs`` (runs ``[a, b)`` of block
        numbers, none across sources) returns the blocks in that order instead, sliced
        straight out of the received buffer: one copy of the ids, the block sizes known
        from the header (no host read).
        """
        assert self.ids is not None
        received = self.ids.wait()
        psw = None if self.psw is None else self.psw.wait()
        batch = self.served_batch
        heads, id_starts, weight_starts, start = [], [], [], 0
        for count, own_batch in zip(self.peer_counts, self.peer_batches, strict=True):
            bags = num_segments * own_batch
            head = received[start : start + bags].view(num_segments, own_batch)
            if own_batch < batch:  # pad every block of this source with empty bags
                head = torch.nn.functional.pad(head, (0, batch - own_batch))
            heads.append(head)
            id_starts.append(start + bags)
            start += bags + count
            if self.packed_weights:
                weight_starts.append(start)
                start += packed_size(count, received.dtype)
        if block_runs is None:  # as received: each source's ids whole
            spans = [(p, 0, count) for p, count in enumerate(self.peer_counts)]
            blocks = heads
        else:
            sizes = [c for counts in self.peer_segment_counts for c in counts]
            spans = _id_spans(block_runs, sizes, num_segments)
            blocks = [heads[a // num_segments][a % num_segments : a % num_segments + b - a]
                      for a, b in block_runs if b > a]  # fmt: skip
        # One cat and one cast for ids and lengths (ids first: the kernels get an aligned
        # start); both are views of it.
        id_pieces = [received[id_starts[p] + lo : id_starts[p] + hi] for p, lo, hi in spans]
        pieces = [*id_pieces, *(block.reshape(-1) for block in blocks)]
        both = (torch.cat(pieces) if pieces else received[:0]).long()
        num_ids = sum(piece.numel() for piece in id_pieces)
        ids, lengths = both[:num_ids], both[num_ids:]
        if self.packed_weights:
            packed = [
                received[at : at + packed_size(count, received.dtype)].view(torch.float32)
                for at, count in zip(weight_starts, self.peer_counts, strict=True)
            ]
            psw = _cat_spans(packed, spans)
        elif psw is not None and block_runs is not None:  # trained: a differentiable cat
            firsts = itertools.accumulate(self.peer_counts, initial=0)
            psw = _cat_spans([psw[first:] for first in firsts], spans)
        return lengths, ids, psw


def _id_spans(
    block_runs: list[tuple[int, int]], sizes: list[int], num_segments: int
) -> list[tuple[int, int, int]]:
    """(source, first id, end) of each run of blocks, ids counted within the source's."""
    first = []  # each block's first id within its source's ids
    for p in range(len(sizes) // num_segments if num_segments else 0):
        own = sizes[p * num_segments : (p + 1) * num_segments]
        first += itertools.accumulate(own[:-1], initial=0)
    return [
        (a // num_segments, first[a], first[b - 1] + sizes[b - 1]) for a, b in block_runs if b > a
    ]


def _cat_spans(per_source: list[Tensor], spans: list[tuple[int, int, int]]) -> Tensor:
    """``per_source[p][lo:hi]`` of every span, concatenated (empty when there is none)."""
    if not spans:
        return per_source[0][:0]
    return torch.cat([per_source[p][lo:hi] for p, lo, hi in spans])


def wire_dtype(tables: list[EmbeddingBagConfig]) -> torch.dtype:
    """The ids buffer's dtype: int32 when every id (and bag length) fits, else int64."""
    rows = max((t.num_embeddings for t in tables), default=0)
    return torch.int32 if rows < 2**31 else torch.int64


def packed_size(count: int, wire: torch.dtype) -> int:
    """Slots of a ``wire`` buffer that carry ``count`` fp32 weights (one per int32 slot,
    two per int64 one)."""
    return count if wire == torch.int32 else (count + 1) // 2


def pack_weights(weights: Tensor, wire: torch.dtype) -> Tensor:
    """fp32 weights as ``wire`` slots (bit patterns, zero-padded), so they travel in the
    ids buffer instead of a collective of their own."""
    weights = weights.float()
    if wire == torch.int64 and weights.numel() % 2:
        weights = torch.cat([weights, weights.new_zeros(1)])
    return weights.view(wire)
