"""A batch shared by a group of ranks, looked up once: split by sample, pooled rows gathered.

Under tensor parallelism the ranks of a tp group feed the same batch (torchtitan's
convention). Looked up as it is, every id of that batch would travel through a pooled
collection's input all-to-all, lookup and output all-to-all once per rank of the group.
With ``distribute_module(..., same_batch=world["tp"])`` the group splits it instead:

1. ``local_part``: rank i of the group keeps samples ``chunk i`` of the batch
   (``torch.tensor_split`` of the samples, uneven allowed; every key's lengths, ids and
   per-sample weights sliced alike) and runs the collection's ordinary sharded forward
   on that slice, so each id travels once per group;
2. ``gather``: the slice's pooled rows ``[B_i, sum D]`` are all-gathered over the group
   (padded to the largest chunk, trimmed) back into the whole batch ``[B, sum D]``;
   its backward takes this rank's rows of the output gradient, with no communication,
   and multiplies them by the group size n.

Why the factor n: the dense part computes the same loss on the same batch on every rank
of the group, so the pooled output's gradient g is the same on all of them (TP's input
redistribution all-reduces it), and dtrec averages table gradients over all W ranks.
Rank i hands its tables ``n * g[chunk i]``; over the group that is ``n * g``, and over
the world ``sum_d n * g_d / W = mean over the W / n distinct batches of g_d``: each
distinct sample counted once, as the unsharded model on the distinct batches counts it.

The ranks must really feed the same batch. Batches of different sizes are always
refused, a ValueError naming the ranks and their sizes, on every rank of the world in
the same step (never a hang, never a split of mismatched chunks):

* where the input dist's header reaches the whole world (the tables' sharding group is
  the world: no replicas), each rank's size before the split and its group ride in the
  header (``InputDist.carry_full_batch``): no collective of its own, 16 bytes more per
  peer in the header;
* elsewhere (replicas, one shard position, data-parallel tables only), one tiny
  all-gather of the size over the group before the input dist (``same_batch.sizes``: 8
  bytes from each rank; the one collective this check adds to a step), and the refusal
  travels in the input dist.

Batches of one size but different ids are silently wrong unless checked:
``DTREC_CHECK_SAME_BATCH=1`` makes each forward compare a digest of the batch across the
group (one all-gather of 40 bytes, the size with it: ``same_batch.check``) and refuse
mismatched batches with a ValueError naming the ranks; the refusal travels in the input
dist, so every rank of the world fails that step together.
"""

from __future__ import annotations

import hashlib
import itertools
import os

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from dtrec.comm.collectives import all_gather_flat, collective
from dtrec.modules.features import RefusedBatch
from dtrec.placements.mesh import mesh_device
from dtrec.sparse import KeyedJaggedTensor, KeyedTensor, as_kjt

SPLIT_STEP = (
    "dtrec: a collection whose same_batch group splits the batch runs eagerly (its rows "
    "are all-gathered over the group with a c10d collective; docs/composing.md)"
)
CHECK_ENV = "DTREC_CHECK_SAME_BATCH"
"""Set to 1: every split forward checks that the group's ranks feed the same batch."""


def chunk_sizes(batch: int, parts: int) -> list[int]:
    """Samples per chunk of ``torch.tensor_split(range(batch), parts)``: the first
    ``batch % parts`` chunks one larger."""
    return [batch // parts + (1 if i < batch % parts else 0) for i in range(parts)]


def slice_samples(kjt: KeyedJaggedTensor, start: int, stop: int) -> KeyedJaggedTensor:
    """Samples ``[start, stop)`` of every key of ``kjt`` (lengths, ids, weights), one mask
    over the ids on the device (no host read). ValueError naming the features for a
    variable batch per feature (VBE), whose keys have batches of their own."""
    if kjt.variable_stride_per_key() or kjt.inverse_indices_or_none() is not None:
        keys = kjt.keys()
        if kjt.variable_stride_per_key():
            strides = kjt.stride_per_key()
            keys = [k for k, s in zip(keys, strides, strict=True) if s != max(strides)] or keys
        raise ValueError(
            f"same_batch: the batch has a variable batch per feature (VBE: features {keys}); "
            "splitting it over the same_batch group is not supported yet: feed a KJT with "
            "one batch size for every feature, or distribute without same_batch"
        )
    batch, lengths = kjt.stride(), kjt.lengths()
    num_keys = len(kjt.keys())
    by_key = lengths.view(num_keys, batch)
    sample = torch.arange(batch, device=lengths.device).repeat(num_keys)
    keep = (sample >= start) & (sample < stop)
    per_id = torch.repeat_interleave(keep, lengths, output_size=kjt.values().shape[0])
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(
        kjt.keys(),
        kjt.values()[per_id],
        by_key[:, start:stop].reshape(-1),
        None if weights is None else weights[per_id],
        stride=stop - start,
    )


def check_same_batch_mesh(same_batch: object) -> None:
    """``same_batch``: None or a 1-D DeviceMesh holding this rank (TypeError / ValueError)."""
    if same_batch is None:
        return
    if not isinstance(same_batch, DeviceMesh) or same_batch.ndim != 1:
        raise TypeError(
            "same_batch must be None or a 1-D DeviceMesh of the ranks that feed the same "
            f"batch (e.g. world_mesh['tp']), got {same_batch!r}"
        )
    if same_batch.get_coordinate() is None:
        raise ValueError(
            f"same_batch: rank {dist.get_rank()} is not in the same_batch mesh {same_batch}"
        )


def describe_same_batch(same_batch: DeviceMesh | None) -> str:
    """What every rank must agree on about its ``same_batch`` mesh (the same text on every
    rank of a consistent world): its dim names and its group size ("None": no mesh).
    Which ranks form the groups differs per group: ``inconsistent_groups`` compares them."""
    if same_batch is None:
        return "None"
    return f"dims {same_batch.mesh_dim_names} of {same_batch.size()} ranks"


def same_batch_ranks(same_batch: DeviceMesh | None) -> list[int] | None:
    """This rank's ``same_batch`` group, as world ranks (None: no mesh)."""
    return None if same_batch is None else same_batch.mesh.flatten().tolist()


def inconsistent_groups(groups: list[list[int] | None]) -> str | None:
    """Why the ranks' ``same_batch`` groups (``groups[r]``: rank r's, from
    ``same_batch_ranks``) do not partition the world into groups every member agrees on
    (None: they do); ranks whose groups differ would wait in each other's gathers."""
    for rank, group in enumerate(groups):
        if group is None:
            continue
        for member in group:
            if groups[member] != group:
                return (
                    f"same_batch: rank {rank}'s group is ranks {group} but rank {member}'s "
                    f"is {groups[member]}; every rank of a same_batch group must pass a mesh "
                    "of that same group (e.g. world_mesh['tp'] of one world mesh on every rank)"
                )
    return None


def different_sizes(ranks: list[int], sizes: list[int]) -> ValueError:
    """The refusal of a same_batch group whose ranks feed batches of different sizes."""
    return ValueError(
        f"same_batch: the ranks {ranks} of a same_batch group (e.g. a tp group) feed "
        f"batches of different sizes {sizes} (rank: size "
        + ", ".join(f"{r}: {n}" for r, n in zip(ranks, sizes, strict=True))
        + "); the ranks of a same_batch group must feed the same batch (each looks up its "
        "part of it), so this step is refused on every rank"
    )


def batch_digest(kjt: KeyedJaggedTensor) -> bytes:
    """32 bytes that differ (but for a sha256 collision) when two batches differ: keys,
    batch size, lengths, ids and per-sample weights."""
    h = hashlib.sha256(repr((kjt.keys(), kjt.stride())).encode())
    tensors = [kjt.lengths(), kjt.values()]
    if kjt.weights_or_none() is not None:
        tensors.append(kjt.weights())
    for t in tensors:
        h.update(str(t.dtype).encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.digest()


class BatchSplit:
    """How the ranks of one ``same_batch`` group split the batch they share (module doc).

    ``check``: compare the group's batches at every forward (default: env
    ``DTREC_CHECK_SAME_BATCH=1``, read when the collection is built; settable after).
    """

    def __init__(self, group_mesh: DeviceMesh, check: bool | None = None) -> None:
        check_same_batch_mesh(group_mesh)
        self.group = group_mesh.get_group()
        self.ranks: list[int] = dist.get_process_group_ranks(self.group)
        self.size = len(self.ranks)
        self.index = group_mesh.get_local_rank()
        self.check = os.environ.get(CHECK_ENV, "0") == "1" if check is None else check
        self._device = mesh_device(group_mesh)
        self.sizes_in_header = False
        """True: the input dist's header compares the group's batch sizes
        (``InputDist.carry_full_batch``); else ``local_part`` all-gathers them."""

    def local_part(self, features: object) -> object:
        """This rank's chunk of ``features`` (a KJT, or a ``RefusedBatch`` carrying why it
        cannot be split, so the input dist refuses it on every rank together). First one
        all-gather over the group of the batch sizes (unless ``sizes_in_header``) and with
        ``check`` of the batches' digests (module doc)."""
        if isinstance(features, RefusedBatch):
            error: Exception | None = features.error
            kjt = None
        else:
            try:
                kjt, error = as_kjt(features), None
            except Exception as exc:  # noqa: BLE001 - refused in the input dist
                kjt, error = None, exc
        if self.check or not self.sizes_in_header:
            error = error or self._different_batches(kjt)
        if error is None:
            assert kjt is not None
            try:
                sizes = chunk_sizes(kjt.stride(), self.size)
                start = sum(sizes[: self.index])
                return slice_samples(kjt, start, start + sizes[self.index])
            except Exception as exc:  # noqa: BLE001 - refused in the input dist
                error = exc
        return RefusedBatch(error)

    def _different_batches(self, kjt: KeyedJaggedTensor | None) -> ValueError | None:
        """The ValueError for a group whose ranks feed batches of different sizes or, with
        ``check``, different batches (None: the same). Collective over the group: every
        rank joins, with a batch or without one (size -1)."""
        digest = b""
        if self.check:
            try:
                digest = batch_digest(kjt) if kjt is not None else bytes(32)
            except Exception:  # noqa: BLE001 - a batch that cannot be read differs from any
                digest = bytes(32)
        words = [kjt.stride() if kjt is not None else -1]
        if digest:
            words += torch.frombuffer(bytearray(digest), dtype=torch.int64).tolist()
        mine = torch.tensor(words, dtype=torch.int64).to(self._device)
        every = torch.empty(self.size * mine.numel(), dtype=torch.int64, device=self._device)
        kind = "same_batch.check" if self.check else "same_batch.sizes"
        with collective(kind, (self.size - 1) * mine.numel() * 8, self.group):
            all_gather_flat(every, mine, self.group)
        rows = every.view(self.size, -1).tolist()
        sizes = [row[0] for row in rows]
        if len(set(sizes)) > 1 and -1 not in sizes:  # -1: refused, said in the input dist
            return different_sizes(self.ranks, sizes)
        differ = [self.ranks[j] for j, row in enumerate(rows) if row != rows[0]]
        if not differ:
            return None
        return ValueError(
            f"same_batch: the ranks {self.ranks} of a same_batch group (e.g. a tp group) "
            f"feed different batches: rank(s) {differ} differ from rank {self.ranks[0]}; "
            "the ranks of a same_batch group must feed the same batch (splitting different "
            "batches would train on neither), so this step is refused on every rank"
        )

    def gather(self, pooled: KeyedTensor, batch: int) -> KeyedTensor:
        """The whole batch's pooled rows from every rank's chunk (``batch``: the whole
        batch's size, which every rank of the group knows from its own copy)."""
        values = _GatherChunks.apply(
            pooled.values(), chunk_sizes(batch, self.size), self.index, self.group
        )
        return KeyedTensor(pooled.keys(), pooled.length_per_key(), values)


def full_batch_size(features: object) -> int:
    """The batch size of ``features`` (0 for what is no batch: its forward raises anyway)."""
    try:
        return as_kjt(features).stride()
    except Exception:  # noqa: BLE001 - refused in the input dist, raised in forward
        return 0


class _GatherChunks(torch.autograd.Function):
    """``[B_i, D]`` per rank -> ``[B, D]`` on every rank (one padded all-gather);
    backward: this rank's rows of the gradient times the group size (module doc)."""

    @staticmethod
    def forward(ctx, local, sizes, index, group):  # type: ignore[override]
        ctx.start, ctx.sizes, ctx.index = sum(sizes[:index]), sizes, index
        parts, most = len(sizes), max(sizes)
        width = local.shape[1]
        padded = local.new_zeros(most, width)
        padded[: local.shape[0]] = local
        out = local.new_empty(parts * most * width)
        if out.numel():
            sent = (parts - 1) * most * width * local.element_size()
            with collective("same_batch.gather", sent, group):
                all_gather_flat(out, padded.reshape(-1), group)
        rows = out.view(parts * most, width)
        if all(s == most for s in sizes):
            return rows
        return torch.cat([rows[r * most : r * most + n] for r, n in enumerate(sizes)])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        mine = grad[ctx.start : ctx.start + ctx.sizes[ctx.index]]
        return mine * len(ctx.sizes), None, None, None


def gather_sequence_rows(
    split: BatchSplit, lengths: list[Tensor], rows: list[Tensor]
) -> list[Tensor]:
    """A sequence collection's rows of the whole batch, per feature, from every rank's
    rows of its chunk (``rows[k]``: ``[ids of feature k in this chunk, D_k]``; ``lengths[k]``:
    feature k's lengths over the whole batch).

    Each chunk's id count per feature is read from the whole batch's lengths, which
    every rank of the group holds (one host read), so one padded all-gather of every
    feature's rows, flattened, is the only exchange."""
    if not lengths:
        return []
    batch = lengths[0].shape[0]
    bounds = [0, *itertools.accumulate(chunk_sizes(batch, split.size))]
    ends = torch.stack(lengths).cumsum(1)
    ends = torch.cat([ends.new_zeros(len(lengths), 1), ends], 1)[:, bounds]
    counts = (ends[:, 1:] - ends[:, :-1]).t().tolist()  # [rank][feature]
    return list(_GatherSequenceRows.apply(counts, split.index, split.group, *rows))


class _GatherSequenceRows(torch.autograd.Function):
    """Per feature ``[n_k_i, D_k]`` on rank i -> ``[sum_i n_k_i, D_k]`` on every rank, chunks
    in rank order (one padded all-gather of the flattened rows); backward: this rank's
    rows of each feature's gradient times the group size (module doc)."""

    @staticmethod
    def forward(ctx, counts, index, group, *rows):  # type: ignore[override]
        dims = [r.shape[1] for r in rows]
        sizes = [sum(n * d for n, d in zip(c, dims, strict=True)) for c in counts]
        ctx.counts, ctx.index = counts, index
        most, parts = max(sizes), len(sizes)
        like = rows[0] if rows else torch.empty(0)
        flat = like.new_zeros(most)
        if rows:
            mine = torch.cat([r.reshape(-1) for r in rows])
            flat[: mine.numel()] = mine
        out = like.new_empty(parts * most)
        if out.numel():
            sent = (parts - 1) * most * like.element_size()
            with collective("same_batch.gather", sent, group):
                all_gather_flat(out, flat, group)
        per_rank = [
            out[r * most : r * most + sizes[r]].split(
                [n * d for n, d in zip(counts[r], dims, strict=True)]
            )
            for r in range(parts)
        ]
        return tuple(
            torch.cat([per_rank[r][k].view(-1, d) for r in range(parts)])
            for k, d in enumerate(dims)
        )

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        counts, index = ctx.counts, ctx.index
        parts = len(counts)
        mine = []
        for k, grad in enumerate(grads):
            start = sum(counts[r][k] for r in range(index))
            mine.append(grad[start : start + counts[index][k]] * parts)
        return (None, None, None, *mine)
