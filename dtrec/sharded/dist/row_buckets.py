"""A batch's ids laid out in *runs* on the device, for ``Routing.bucketize``: no host read.

A run is the ids of one feature that fall in one row range of its table (a row block), in
batch order, each made local to the block's first row. Every segment (feature, block)
sends one run whole: the column blocks of one row range send the same run. Runs are
numbered feature by feature, row block by row block; a feature whose blocks hold all its
table's rows (table-wise, column-wise, data-parallel) is one run, its ids as they came.

``lay_out_runs`` lays the ids out run after run and counts them per (run, bag) on the
device; the host learns the run sizes from the input dist's one read (the header) and
only slices then (``Routing.send_layout``). Three ways, same runs:

* no feature is split by rows: the batch as it is, one run per feature;
* fbgemm's ``block_bucketize_sparse_features`` (TorchRec's row-wise input dist, one C++
  pass) on CPU, where every feature's row blocks are equal chunks ``[i c, (i + 1) c)``;
  its runs are its ``[S * F, B]`` buckets (bucket-major);
* a stable sort of each id's run number (any layout, any device, differentiable in the
  weights).

Ids outside their table (a batch the input dist will refuse once the header is read)
must not break the layout: they land in some run, and no index goes out of range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dtrec.ops.backends.device_lists import device_list
from dtrec.placements import Block

FeatureSegment = tuple[int, Block]  # (feature, block) of one segment, in send order


@dataclass
class Runs:
    """A batch's ids run after run (``lay_out_runs``), on the device."""

    lengths: Tensor
    """``[runs, B]``: each run's ids per bag."""
    ids: Tensor
    """Every run's ids, run after run, local to the run's first row."""
    weights: Tensor | None
    """The ids' per-sample weights, in the same order (None when the batch has none)."""
    segment_run: tuple[int, ...]
    """Per segment (send order): the run it sends."""


class RunMaps:
    """Static tables for ``lay_out_runs`` (built once per routing, kept per device).

    Over every feature of the collection (output order): ``first_run[f]`` is feature f's
    first run, its runs follow in row order (one run for a feature no block splits by
    rows, data-parallel ones included).
    """

    def __init__(self, sizes: list[int], segments: list[FeatureSegment], shard_size: int) -> None:
        """``sizes``: rows of each feature's table; ``segments`` in send order."""
        self.sizes = sizes
        self.shard_size = shard_size
        starts_of: list[set[int]] = [set() for _ in sizes]
        for f, block in segments:
            starts_of[f].add(block.rows[0])
        row_starts = [sorted(s) or [0] for s in starts_of]
        self.whole_features = all(s == [0] for s in row_starts) and all(
            block.rows == (0, sizes[f]) for f, block in segments
        )
        """No block splits a feature by rows: the runs are the features, as they came."""
        self.first_run = [0]
        for starts in row_starts:
            self.first_run.append(self.first_run[-1] + len(starts))
        self.num_runs = self.first_run.pop()
        self.segment_run = tuple(
            self.first_run[f] + row_starts[f].index(block.rows[0]) for f, block in segments
        )
        self.run_row_start = [row for starts in row_starts for row in starts]
        bases = [sum(sizes[:f]) for f in range(len(sizes))]
        self.run_key = [bases[f] + row for f, starts in enumerate(row_starts) for row in starts]
        """Each run's first key in one key space (feature f's ids at ``bases[f] + id``),
        sorted: an id's run is the last key not above its own."""
        self.feature_base = bases
        self.chunk_rows = chunk_rows_of(sizes, segments)
        """Per feature, the rows c of its row blocks when they are ``[i c, (i + 1) c)``
        (empty ones after the last row allowed): an id's run is ``first_run + id // c``."""
        self.sort_dtype = next(
            dtype
            for dtype in (torch.uint8, torch.int16, torch.int32, torch.int64)
            if self.num_runs - 1 <= torch.iinfo(dtype).max
        )
        self.fbgemm_segment_run = fbgemm_runs_of(sizes, segments, self.chunk_rows, shard_size)
        """Per segment, its fbgemm bucket ``b * F + f``, or None when fbgemm's buckets
        are not the row blocks."""
        wide = max(sizes, default=0) > torch.iinfo(torch.int32).max  # int32 ids: ~1.5x faster
        self.index_dtype = torch.long if wide else torch.int32
        self._tensors: dict[torch.device, dict[str, Tensor]] = {}

    def tensors(self, device: torch.device) -> dict[str, Tensor]:
        """The device copies the layout indexes with (built once per device: read-only)."""
        if device not in self._tensors:
            self._tensors[device] = self._build_tensors(device)
        return self._tensors[device]

    def _build_tensors(self, device: torch.device) -> dict[str, Tensor]:
        long = torch.long
        out = {
            "run_key": device_list(self.run_key, long, device),
            "run_row_start": device_list(self.run_row_start, long, device),
            "feature_base": device_list(self.feature_base, long, device),
            "first_run": device_list(self.first_run, long, device),
        }
        if self.chunk_rows is not None:
            out["chunk"] = device_list(self.chunk_rows, long, device)
            out["block_sizes"] = device_list(self.chunk_rows, self.index_dtype, device)
        return out


def chunk_rows_of(sizes: list[int], segments: list[FeatureSegment]) -> list[int] | None:
    """Per feature, the rows c of its row blocks when they are ``[i c, min((i + 1) c, n))``
    for i = 0, 1, ... (row-wise chunks; empty blocks after the last row allowed; a feature
    with one block of all rows, or none, has c = n); None when some feature's are not."""
    blocks_of: list[set[tuple[int, int]]] = [set() for _ in sizes]
    for f, block in segments:
        blocks_of[f].add(block.rows)
    out = []
    for n, blocks in zip(sizes, blocks_of, strict=True):
        blocks = blocks or {(0, n)}
        starts = sorted({lo for lo, hi in blocks if hi > lo})
        size = starts[1] - starts[0] if len(starts) > 1 else n
        want = {(lo, min(lo + size, n)) for lo in range(0, n, max(size, 1))}
        nonempty = {(lo, hi) for lo, hi in blocks if hi > lo}
        empty_at_end = all(lo >= n for lo, hi in blocks if hi == lo)
        if size < 1 or nonempty != want or not empty_at_end:
            return None
        out.append(size)
    return out


SPARSE_BUCKETS = 8
"""fbgemm's op writes a ``[S * F, B]`` lengths buffer; past this many of its rows per
segment served (tables each split over a few positions of a large shard axis: table-row-wise
over 1024 ranks, 26 features: 128 per segment, 1.7 GB at B = 16384) the sort path's
``[runs, B]`` is taken instead."""


def fbgemm_runs_of(
    sizes: list[int], segments: list[FeatureSegment], chunk_rows: list[int] | None, shards: int
) -> tuple[int, ...] | None:
    """Per segment, the row ``b * F + f`` of fbgemm's bucketized ``[S * F, B]`` lengths that
    holds its ids: fbgemm sends feature f's id to bucket ``id // c`` (S buckets), so this
    holds for chunked row blocks of at most S chunks; an empty block takes an empty
    bucket. None otherwise (the sort path), and when most of those ``S * F`` rows would
    be no segment's (``SPARSE_BUCKETS``)."""
    if chunk_rows is None or not segments:
        return None
    num_features, out = len(sizes), []
    if shards * num_features > SPARSE_BUCKETS * len(segments):
        return None
    for f, block in segments:
        c, n = chunk_rows[f], sizes[f]
        if n > shards * c:  # ids past S chunks would wrap around in fbgemm
            return None
        bucket = block.rows[0] // c
        if block.num_rows == 0:  # no id: any bucket no id reaches
            bucket = shards - 1
            if bucket * c < n:
                return None
        out.append(bucket * num_features + f)
    return tuple(out)


def lay_out_runs(
    maps: RunMaps, values: Tensor, lengths: Tensor, weights: Tensor | None, ops: Any | None
) -> Runs:
    """The batch's runs (``values`` ids, ``lengths`` ``[F, B]``, ``weights`` per id or None):
    as they came when no feature is split by rows, else through fbgemm's op (``ops``, not
    None where it fits) or the sort."""
    if maps.whole_features:
        return Runs(lengths, values, weights, maps.segment_run)
    if ops is not None:
        return _fbgemm_runs(ops, maps, values, lengths, weights)
    return _sorted_runs(maps, values, lengths, weights)


def _fbgemm_runs(
    ops: Any, maps: RunMaps, values: Tensor, lengths: Tensor, weights: Tensor | None
) -> Runs:
    """fbgemm's ``block_bucketize_sparse_features`` lays ids out bucket-major, then
    feature, then sample, each bag's ids in batch order: its buckets are the runs. Weights
    fbgemm cannot carry (not fp32 / fp64: the sequence path's positions) follow its
    permutation. Negative ids (a bad batch) are clamped: fbgemm would index with them."""
    assert maps.fbgemm_segment_run is not None
    index_dtype = maps.index_dtype
    carried = weights is not None and weights.dtype in (torch.float32, torch.float64)
    permuted = weights is not None and not carried
    ids = values.to(index_dtype)
    ids = ids.clamp_(min=0) if ids is not values else ids.clamp(min=0)
    new_lengths, local_ids, new_weights, _, permute = ops.block_bucketize_sparse_features(
        lengths.reshape(-1).to(index_dtype),
        ids,
        False,
        permuted,  # "sequence": also return where each id went
        maps.tensors(values.device)["block_sizes"],
        maps.shard_size,
        weights if carried else None,
    )
    if permuted:
        assert weights is not None
        new_weights = torch.empty_like(weights).index_copy_(0, permute.long(), weights)
    rows = maps.shard_size * lengths.shape[0]  # explicit: the batch may be empty
    return Runs(
        new_lengths.view(rows, lengths.shape[1]), local_ids, new_weights, maps.fbgemm_segment_run
    )


def _sorted_runs(maps: RunMaps, values: Tensor, lengths: Tensor, weights: Tensor | None) -> Runs:
    """Each id's run (a division for chunked row blocks, else a ``searchsorted`` over the
    runs' first keys), then a stable sort of the run numbers (in ``maps.sort_dtype``: a
    uint8 key sorts ~4x faster than int32 on CPU) lays the ids out; the per-(run, bag)
    counts are summed into a fixed ``[runs, B]`` (no ``bincount``: it sizes its output by
    reading the largest value)."""
    device = values.device
    n = values.numel()
    num_features, batch = lengths.shape
    t = maps.tensors(device)
    bag = torch.repeat_interleave(  # each id's bag, feature-major
        torch.arange(num_features * batch, device=device), lengths.reshape(-1), output_size=n
    )
    feature = torch.div(bag, max(batch, 1), rounding_mode="floor")
    values = values.long()
    if maps.chunk_rows is not None:  # equal row blocks: a division per feature
        run = torch.div(values, t["chunk"].index_select(0, feature), rounding_mode="floor")
        run += t["first_run"].index_select(0, feature)
    else:
        key = values + t["feature_base"].index_select(0, feature)
        run = torch.searchsorted(t["run_key"], key, right=True)
        run -= 1
    run.clamp_(0, maps.num_runs - 1)  # ids outside their table: some run, never past the end
    local_ids = values - t["run_row_start"].index_select(0, run)
    run_bag = torch.add(bag, run - feature, alpha=batch)  # run * B + bag's sample
    run_lengths = torch.zeros(maps.num_runs * batch, dtype=torch.long, device=device)
    run_lengths.index_add_(0, run_bag, device_list([1], torch.long, device).expand(n))
    order = torch.sort(run.to(maps.sort_dtype), stable=True).indices
    # index_select: ~4x faster than advanced indexing for 1-D gathers on CPU
    local_ids = local_ids.index_select(0, order)
    weights = None if weights is None else weights.index_select(0, order)
    return Runs(run_lengths.view(maps.num_runs, batch), local_ids, weights, maps.segment_run)
