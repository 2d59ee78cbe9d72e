"""Output dist: send served partials back to their batch's rank, assemble the output.

One all-to-all over the sharding group (``output_dist``, differentiable: its
backward sends the output's gradient columns back to the blocks) carries each
served segment's ``[B, block cols]`` partial to the rank whose batch it pooled, B
that rank's own batch size (they may differ in a group, 0 included: a rank with an
empty batch still joins the exchange and gets a ``[0, total dim]`` output).
The requester adds every received partial into its output columns: row blocks of
one feature add up (a Partial sum), column blocks tile the row. Data-parallel
features are added in their own columns, then mean-pooled features are scaled
by 1 / bag length (the epilogue: only the whole bag's length is known here).

With a ``QCommsConfig`` the partials travel in its forward precision and their
gradients in its backward one (``dtrec.comm.quantized``); both are cast back to the
tables' dtype before they are added into the output (or handed to the lookup's backward).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from dtrec.comm.collectives import all_to_all_autograd
from dtrec.comm.qcomms import QCommsConfig
from dtrec.comm.quantized import quantized_all_to_all
from dtrec.modules.config import EmbeddingBagConfig
from dtrec.modules.features import bag_lengths, feature_order
from dtrec.ops.row_blocks import bag_scale
from dtrec.sharded.dist.routing import Routing
from dtrec.sharded.lookup.pooled import table_runs
from dtrec.sparse import KeyedJaggedTensor, KeyedTensor


class OutputDist:
    """Turns pooled partials into a collection's ``[B, sum of dims]`` output."""

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        routing: Routing,
        shard_group: ProcessGroup,
        dtype: torch.dtype,
        qcomms: QCommsConfig | None = None,
    ) -> None:
        self._tables = tables
        self._qcomms = qcomms  # None: the partials and their gradients travel as they are
        self._routing = routing
        self._shard_group = shard_group
        self._dtype = dtype  # of the tables, hence of an output no lookup produced
        self._adds = _source_adds(routing)
        self._first = _first_writes(self._adds, routing.total_dim)  # once, not per forward
        # The served partials' table-major column runs: (first column in served order, width).
        cols = [0]
        for seg in routing.served:
            cols.append(cols[-1] + seg.block.num_cols)
        self._served_runs = [(cols[a], cols[b] - cols[a]) for a, b in table_runs(routing)]
        # Per source, then served column: its table-major column (unequal run widths).
        shards = routing.shard_size
        self._gather_cols = torch.tensor(
            [
                shards * col + src * width + c
                for src in range(shards)
                for col, width in self._served_runs
                for c in range(width)
            ],
            dtype=torch.long,
        )
        self._local_cols = routing.local_columns(torch.device("cpu"))
        # Mean pooling's scale, fixed per feature: none at all when every table sums.
        is_mean = [tables[s.table].pooling == "mean" for s in routing.slots]
        self._is_mean = torch.tensor(is_mean).unsqueeze(1) if any(is_mean) else None
        self._dims = torch.tensor([s.dim for s in routing.slots], dtype=torch.long)

    def __call__(
        self, served: Tensor | None, batch: int, peer_batches: list[int], device: torch.device
    ) -> Tensor:
        """Exchange the partials (``LocalLookup.served``: ``[max(peer_batches), ...]``) and
        add the received ones into this rank's ``[batch, total dim]`` output.
        ``peer_batches``: every shard position's batch size, whose rows it gets back."""
        routing = self._routing
        shards = routing.shard_size
        if served is not None:  # columns table-major -> the send buffer destination-major
            send_back = self._destination_major(served, peer_batches, shards)
        else:
            send_back = torch.zeros(0, dtype=self._dtype, device=device)
        output_splits = [batch * w for w in routing.widths]
        input_splits = [b * routing.served_width for b in peer_batches]
        if self._qcomms is None:
            partials = all_to_all_autograd(
                send_back, output_splits, input_splits, self._shard_group, "output_dist"
            )
        else:
            partials = quantized_all_to_all(
                send_back,
                output_splits,
                input_splits,
                self._shard_group,
                "output_dist",
                self._qcomms.forward_codec,
                self._qcomms.backward_codec,
            )
        return _AddPartials.apply(
            partials, batch, routing.widths, self._adds, routing.total_dim, self._first
        )

    def _destination_major(self, served: Tensor, peer_batches: list[int], shards: int) -> Tensor:
        """The flat send buffer, per destination p its ``[B_p, served width]`` rows
        (segments in served order), from the table-major ``[B, S * served width]``
        partials (B the largest B_p): one permuted copy when every table run is as wide
        (its backward one copy too; slices of a cat would each backward into a zeroed
        full-size gradient), else one column gather first; with uneven batches, one row
        gather of each destination's own rows."""
        runs = self._served_runs
        batch, width = served.shape[0], self._routing.served_width  # explicit: B may be 0
        if not runs:  # [B, 0]: no segment served (the trained weights' empty view)
            return served.reshape(-1)
        widths = {width for _, width in runs}
        if len(widths) == 1:
            blocks = served.view(batch, len(runs), shards, widths.pop()).permute(2, 0, 1, 3)
        else:
            columns = self._gather_cols.to(served.device)
            blocks = served.index_select(1, columns).view(batch, shards, width).transpose(0, 1)
        if all(b == batch for b in peer_batches):
            return blocks.reshape(-1)
        rows = blocks.reshape(shards * batch, width)
        keep = torch.cat(
            [torch.arange(p * batch, p * batch + b) for p, b in enumerate(peer_batches)]
        )
        return rows.index_select(0, keep.to(served.device)).reshape(-1)

    def zeros(self, batch: int, device: torch.device) -> Tensor:
        """The output of a collection without routed tables, before its data-parallel part."""
        return torch.zeros(batch, self._routing.total_dim, dtype=self._dtype, device=device)

    def add_data_parallel(self, out: Tensor, pooled: Tensor) -> Tensor:
        """``out`` plus the data-parallel features' pooled values in their columns."""
        return out.index_add(1, self._local_cols.to(out.device), pooled)

    def keyed(self, out: Tensor, kjt: KeyedJaggedTensor) -> KeyedTensor:
        """The epilogue: mean-pooled features scaled, columns keyed by feature."""
        if self._is_mean is not None:
            out = out * self._pooling_scale(kjt)
        dims = [slot.dim for slot in self._routing.slots]
        return KeyedTensor(feature_order(self._tables), dims, out)

    def _pooling_scale(self, kjt: KeyedJaggedTensor) -> Tensor:
        """``[B, total_dim]`` factors: 1 / bag length on mean-pooled features, 1 elsewhere."""
        assert self._is_mean is not None
        lengths = bag_lengths(kjt)
        factor = bag_scale(lengths, self._is_mean.to(lengths.device), self._dtype)
        dims = self._dims.to(lengths.device)  # output_size: no host read of the dims
        return factor.t().repeat_interleave(dims, dim=1, output_size=self._routing.total_dim)


# How one source's ``[B, width]`` partials add into the output: runs (partial column, output
# column, width) of contiguous columns, or, when they are many, every column's output column.
_Adds = list[tuple[int, int, int]] | Tensor
_MAX_RUNS = 4  # per source: more runs than this add with one index_add instead of slices


def _source_adds(routing: Routing) -> list[_Adds]:
    """Per source position, how its partials add into the output (``_Adds``)."""
    adds: list[_Adds] = []
    for segs in routing.segments_to:
        runs: list[tuple[int, int, int]] = []
        col = 0
        for seg in segs:
            dst = routing.slots[seg.feature].col + seg.block.cols[0]
            width = seg.block.num_cols
            if runs and runs[-1][0] + runs[-1][2] == col and runs[-1][1] + runs[-1][2] == dst:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + width)
            else:
                runs.append((col, dst, width))
            col += width
        if len(runs) > _MAX_RUNS:
            adds.append(torch.cat([torch.arange(d, d + w) for _, d, w in runs]))
        else:
            adds.append(runs)
    return adds


class _AddPartials(torch.autograd.Function):
    """The ``[B, total dim]`` output from the received partials (flat, source-major blocks of
    ``[B, width]``): every source's columns added in source order, exactly the sums one
    ``index_add`` over their concatenation makes, without building that concatenation.
    Backward copies each source's gradient columns into one flat buffer (the exchange's).
    ``first``: ``_first_writes(adds, total_dim)``, computed once per routing."""

    @staticmethod
    def forward(ctx, partials, batch, widths, adds, total_dim, first):  # type: ignore[override]
        ctx.batch, ctx.widths, ctx.adds = batch, widths, adds
        if first is None:  # a column permutation (index_add): from zeros
            out = partials.new_zeros(batch, total_dim)
        else:  # each column's first source is copied (0 + x is x), later ones added
            out = partials.new_empty(batch, total_dim)
            for dst, width in first[1]:  # columns no source writes
                out[:, dst : dst + width] = 0
        for i, (block, add) in enumerate(zip(_blocks(partials, batch, widths), adds, strict=True)):
            if isinstance(add, Tensor):
                out.index_add_(1, add.to(out.device), block)
                continue
            for j, (src, dst, width) in enumerate(add):
                if first is not None and first[0][i][j]:
                    out[:, dst : dst + width] = block[:, src : src + width]
                else:
                    out[:, dst : dst + width] += block[:, src : src + width]
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        grad_in = grad.new_empty(ctx.batch * sum(ctx.widths))
        for block, add in zip(_blocks(grad_in, ctx.batch, ctx.widths), ctx.adds, strict=True):
            if isinstance(add, Tensor):
                torch.index_select(grad, 1, add.to(grad.device), out=block)
                continue
            for src, dst, width in add:
                block[:, src : src + width] = grad[:, dst : dst + width]
        return grad_in, None, None, None, None, None


def _first_writes(
    adds: list, total_dim: int
) -> tuple[tuple[tuple[bool, ...], ...], tuple[tuple[int, int], ...]] | None:
    """Which column ranges of ``_AddPartials`` are each column's first write (per source,
    per range: a flag; nested tuples, constants to a compiler), and the (start, width)
    spans no range writes; None when a source adds through an index tensor. Ranges that
    overlap only in part: None as well (then every range adds into zeros, as before)."""
    written: dict[tuple[int, int], tuple[int, int]] = {}
    for i, add in enumerate(adds):
        if isinstance(add, Tensor):
            return None
        for j, (_, dst, width) in enumerate(add):
            written.setdefault((dst, width), (i, j))
    spans = sorted(written)
    end = 0
    gaps = []
    for dst, width in spans:
        if dst < end:  # overlaps a different range in part
            return None
        if dst > end:
            gaps.append((end, dst - end))
        end = dst + width
    if end < total_dim:
        gaps.append((end, total_dim - end))
    firsts = set(written.values())
    flags = tuple(tuple((i, j) in firsts for j in range(len(add))) for i, add in enumerate(adds))
    return flags, tuple(gaps)


def _blocks(flat: Tensor, batch: int, widths: list[int]) -> list[Tensor]:
    """The source-major ``[B, width]`` blocks of a flat buffer, as views."""
    pieces = torch.split(flat, [batch * w for w in widths])
    return [piece.view(batch, w) for piece, w in zip(pieces, widths, strict=True)]
