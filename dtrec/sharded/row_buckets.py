"""Laying out the ids of row-split features by segment, for ``Routing.bucketize``.

Every segment's ids keep their batch order. Two ways, same result: fbgemm's
``block_bucketize_sparse_features`` (TorchRec's row-wise input dist, one C++ pass) where
the blocks are row-wise chunks, or a stable sort of each id's segment number (any
layout, any device, differentiable in the weights).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dtrec.ops.row_blocks import ids_in_rows
from dtrec.placements import Block

SplitSegment = tuple[int, Block]  # (index of its feature among the row-split ones, block)


@dataclass
class BucketMaps:
    """Static lookup tables for ``Routing._split_segments`` (built once, kept per device).

    Over the row-split features only (numbered in their output order) and their segments
    (numbered in send order). A *row block* is one distinct row range of one feature's
    blocks; its segments are its column blocks. Every feature gets a disjoint key range
    ``feature_base[k] + id``; ``starts`` holds every row block's first key, sorted.
    """

    starts: Tensor  # [row blocks] first key of each row block
    feature_base: Tensor  # [F split] key offset of each feature
    row_block_first: Tensor  # [row blocks] first entry in row_block_segments
    row_block_count: Tensor  # [row blocks] number of segments (column blocks)
    row_block_segments: Tensor  # segments of each row block, concatenated
    segment_row_start: Tensor  # [segments] first row of the segment's block
    num_segments: int
    one_segment_per_row_block: bool
    uniform_block_rows: list[int] | None  # per feature: rows of every row block but its last
    feature_first_row_block: list[int]  # per feature: its first row block's number
    sort_dtype: torch.dtype  # narrowest dtype of segment numbers: fewer radix-sort passes
    shard_size: int
    fbgemm_rows: Tensor | None  # [segments] row of [S * F split, B] bucketized lengths
    fbgemm_block_sizes: Tensor | None  # [F split] rows per block, fbgemm's index dtype

    def __init__(self, sizes: list[int], segments: list[SplitSegment], shard_size: int) -> None:
        """``sizes``: rows of each row-split feature's table; ``segments`` in send order."""
        self.num_segments = len(segments)
        self.shard_size = shard_size
        bases = [sum(sizes[:k]) for k in range(len(sizes))]
        by_row_block: dict[tuple[int, int], list[int]] = {}
        for g, (f, block) in enumerate(segments):
            by_row_block.setdefault((f, block.rows[0]), []).append(g)
        keys = sorted(by_row_block)
        lists = [by_row_block[k] for k in keys]
        counts = [len(x) for x in lists]
        self.starts = torch.tensor([bases[k] + row for k, row in keys], dtype=torch.long)
        self.feature_base = torch.tensor(bases, dtype=torch.long)
        self.row_block_count = torch.tensor(counts, dtype=torch.long)
        self.row_block_first = torch.tensor([sum(counts[:i]) for i in range(len(counts))],
                                            dtype=torch.long)  # fmt: skip
        self.row_block_segments = torch.tensor([g for x in lists for g in x], dtype=torch.long)
        self.one_segment_per_row_block = all(c == 1 for c in counts)
        self.feature_first_row_block = [
            next(i for i, (f, _) in enumerate(keys) if f == k) for k in range(len(sizes))
        ]
        self.uniform_block_rows = uniform_block_rows_of(sizes, segments)
        self.segment_row_start = torch.tensor(
            [block.rows[0] for _, block in segments], dtype=torch.long
        )
        self.sort_dtype = next(
            dtype
            for dtype in (torch.uint8, torch.int16, torch.int32, torch.int64)
            if len(segments) - 1 <= torch.iinfo(dtype).max
        )
        rows = fbgemm_rows_of(segments, self.uniform_block_rows, counts)
        self.fbgemm_rows = None if rows is None else torch.tensor(rows, dtype=torch.long)
        self.fbgemm_block_sizes = None
        if rows is not None:
            assert self.uniform_block_rows is not None
            wide = max(sizes) > torch.iinfo(torch.int32).max  # int32 ids: ~1.5x faster
            dtype = torch.long if wide else torch.int32
            self.fbgemm_block_sizes = torch.tensor(self.uniform_block_rows, dtype=dtype)

    def to(self, device: torch.device) -> BucketMaps:
        moved = object.__new__(BucketMaps)
        for name, value in vars(self).items():
            setattr(moved, name, value.to(device) if isinstance(value, Tensor) else value)
        return moved


def uniform_block_rows_of(sizes: list[int], segments: list[SplitSegment]) -> list[int] | None:
    """Per feature, the rows c of its row blocks when they are ``[i c, min((i + 1) c, n))``
    for i = 0, 1, ... (row-wise's chunks; empty blocks after the last row allowed), so an
    id's row block is ``id // c``; None when some feature's blocks are not like that."""
    rows_by_feature: list[set[tuple[int, int]]] = [set() for _ in sizes]
    for f, block in segments:
        rows_by_feature[f].add(block.rows)
    out = []
    for n, blocks in zip(sizes, rows_by_feature, strict=True):
        starts = sorted({lo for lo, hi in blocks if hi > lo})
        size = starts[1] - starts[0] if len(starts) > 1 else n
        want = {(lo, min(lo + size, n)) for lo in range(0, n, max(size, 1))}
        nonempty = {(lo, hi) for lo, hi in blocks if hi > lo}
        empty_at_end = all(lo >= n for lo, hi in blocks if hi == lo)
        if size < 1 or nonempty != want or not empty_at_end:
            return None
        out.append(size)
    return out


def fbgemm_rows_of(
    segments: list[SplitSegment],
    uniform_block_rows: list[int] | None,
    segments_per_row_block: list[int],
) -> list[int] | None:
    """Per segment, its row in fbgemm's bucketized ``[S * F, B]`` lengths (bucket-major):
    fbgemm sends feature f's id to bucket ``id // rows per block``, so this holds only when
    row block i of every feature sits at shard position i, whole-width (row-wise); None
    otherwise (table-row-wise, grid: the sort path)."""
    if not segments or uniform_block_rows is None or any(c != 1 for c in segments_per_row_block):
        return None
    rows = []
    for f, block in segments:
        if block.position != block.rows[0] // uniform_block_rows[f]:
            return None
        rows.append(block.position * len(uniform_block_rows) + f)
    return rows if rows == sorted(rows) else None  # fbgemm's order must be the send order


def fbgemm_bucketize(
    ops: Any, maps: BucketMaps, values: Tensor, lengths: Tensor, weights: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``sort_by_segment``'s result from fbgemm's ``block_bucketize_sparse_features``: it
    lays ids out bucket-major, then feature, then sample, each bag's ids in batch order,
    which is the send order of row-wise segments. Weights fbgemm cannot carry (not fp32 /
    fp64: the sequence path's positions) follow its permutation."""
    assert maps.fbgemm_rows is not None and maps.fbgemm_block_sizes is not None
    index_dtype = maps.fbgemm_block_sizes.dtype
    carried = weights is not None and weights.dtype in (torch.float32, torch.float64)
    permuted = weights is not None and not carried
    new_lengths, local_ids, new_weights, _, permute = ops.block_bucketize_sparse_features(
        lengths.reshape(-1).to(index_dtype),
        values.to(index_dtype),
        False,
        permuted,  # "sequence": also return where each id went
        maps.fbgemm_block_sizes,
        maps.shard_size,
        weights if carried else None,
    )
    if permuted:
        assert weights is not None
        new_weights = torch.empty_like(weights).index_copy_(0, permute.long(), weights)
    batch = lengths.shape[1]
    rows = maps.shard_size * lengths.shape[0]  # explicit: the batch may be empty
    seg_lengths = new_lengths.view(rows, batch).index_select(0, maps.fbgemm_rows).long()
    return seg_lengths, local_ids.long(), new_weights


def sort_by_segment(
    maps: BucketMaps, values: Tensor, lengths: Tensor, weights: Tensor | None, counts: list[int]
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(bag lengths ``[segments, B]``, local ids, weights) of the row-split features, ids in
    segment order, each segment's in batch order; ``counts``: ids per feature.

    Each id finds its row block (a division per feature for row-wise chunks, else one
    ``searchsorted`` over the block boundaries), is copied once per column block of that
    row block, and a stable sort of the segment numbers (in ``maps.sort_dtype``: a uint8
    key sorts ~4x faster than int32 on CPU) lays the ids out.
    """
    n = values.numel()
    num_features, batch = lengths.shape
    sample = torch.repeat_interleave(  # each id's sample in the batch (no modulo later)
        torch.arange(batch, device=values.device).repeat(num_features),
        lengths.reshape(-1),
        output_size=n,
    )
    if maps.uniform_block_rows is not None:  # equal row blocks: a division per feature
        row_block = torch.cat([
            torch.div(values[a:b], size, rounding_mode="floor") + first
            for a, b, size, first in zip(
                [0, *itertools.accumulate(counts)], itertools.accumulate(counts),
                maps.uniform_block_rows, maps.feature_first_row_block,
            )
        ])  # fmt: skip
    else:
        base = torch.repeat_interleave(  # each id's feature's first key in the row space
            maps.feature_base, torch.tensor(counts, device=values.device), output_size=n
        )
        row_block = torch.searchsorted(maps.starts, base + values, right=True)
        row_block -= 1
    if maps.one_segment_per_row_block:
        segment = maps.row_block_segments.index_select(
            0, maps.row_block_first.index_select(0, row_block)
        )
    else:  # column blocks: one copy of the id per column block of its row block
        copies = maps.row_block_count.index_select(0, row_block)
        source = torch.repeat_interleave(torch.arange(n, device=values.device), copies)
        first = torch.cumsum(copies, 0) - copies
        within = torch.arange(source.numel(), device=values.device)
        within -= first.index_select(0, source)
        block_first = maps.row_block_first.index_select(0, row_block.index_select(0, source))
        segment = maps.row_block_segments.index_select(0, block_first + within)
        values, sample = values.index_select(0, source), sample.index_select(0, source)
        weights = None if weights is None else weights.index_select(0, source)
    local_ids, _ = ids_in_rows(values, segment, maps.segment_row_start)
    seg_lengths = torch.bincount(
        segment * batch + sample, minlength=maps.num_segments * batch
    ).view(maps.num_segments, batch)
    order = torch.sort(segment.to(maps.sort_dtype), stable=True).indices
    # index_select: ~4x faster than advanced indexing for 1-D gathers on CPU
    local_ids = local_ids.index_select(0, order)
    weights = None if weights is None else weights.index_select(0, order)
    return seg_lengths, local_ids, weights
