"""Autograd-aware collectives used by the sharded step, with byte accounting.

Every collective dtrec issues goes through here, so ``count_comm`` sees all of
them (the dense part's gradient all-reduce included: ``dense.grad_sync``). Only plain
c10d collectives are used (all-reduce, broadcast, all-to-all, all-gather into a tensor),
never the functional ones DTensor's redistribute uses, which gloo does not run on CUDA
tensors (``tests/distributed/test_collectives_used.py``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from dtrec.comm.failures import CollectiveError, failed_peers


@dataclass
class CommStats:
    """Per collective kind: calls, bytes this rank sent, and host seconds spent in the call;
    and the bytes per mesh dim they travelled over (``bytes_per_axis``).

    Seconds are wall time around the call: the whole exchange on gloo (which blocks),
    only the launch for NCCL (which runs asynchronously on its stream).
    """

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes_sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    bytes_per_axis: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Mesh dim name (the group's DeviceMesh dim: "shard", "replicate", "tp", ...; "world"
    for the default group) -> bytes this rank sent over it."""

    def record(
        self, kind: str, nbytes: int, seconds: float = 0.0, calls: int = 1, axis: str = "world"
    ) -> None:
        self.calls[kind] += calls
        self.bytes_sent[kind] += nbytes
        self.seconds[kind] += seconds
        if nbytes:
            self.bytes_per_axis[axis] += nbytes

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_sent.values())

    def per_step(self, steps: int = 1) -> dict[str, dict[str, float]]:
        """Kind -> {"calls", "bytes", "seconds"} per step (for JSON reports)."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        return {
            kind: {
                "calls": self.calls[kind] / steps,
                "bytes": self.bytes_sent[kind] / steps,
                "seconds": self.seconds[kind] / steps,
            }
            for kind in sorted(self.calls)
        }

    def summary(self, steps: int = 1) -> str:
        """One line per collective: calls, bytes and milliseconds per step."""
        return ", ".join(
            f"{kind}: {v['calls']:g} calls {v['bytes']:,.0f} B {v['seconds'] * 1e3:.2f} ms"
            for kind, v in self.per_step(steps).items()
        )


_active: list[CommStats] = []


@contextmanager
def comm_stats() -> Iterator[CommStats]:
    """Record the collectives dtrec issues inside the block (forward and backward).

    Example::

        with dtrec.comm_stats() as stats:
            for batch in batches:
                model(batch).sum().backward()
        print(stats.summary(steps=len(batches)))
    """
    stats = CommStats()
    _active.append(stats)
    try:
        yield stats
    finally:
        _active.remove(stats)


count_comm = comm_stats  # the earlier name


def sync_bytes(size: int, most: float, dim: int, num_rows: int) -> tuple[float, float]:
    """(sparse all-gather, dense all-reduce) bytes one member sends for one table: an
    all-gather of (row id, grad row) for ``most`` rows, or a ring all-reduce of
    ``[num_rows, dim + 1]`` fp32 (the extra column counts touches).

    The replicate-axis gradient sync (``dtrec.sharded.update.grad_sync``) picks the cheaper one
    with it, and the cost model (``dtrec.planning.cost_model``) predicts that choice.
    """
    if size <= 1:
        return 0.0, 0.0
    sparse = (size - 1) * most * (8 + 4 * dim)
    dense = 2 * (size - 1) * num_rows * (dim + 1) * 4 / size
    return sparse, dense


@contextmanager
def collective(
    kind: str, nbytes: int, group: ProcessGroup | None = None, calls: int = 1
) -> Iterator[None]:
    """Wrap one collective call: record its kind, the bytes this rank sends and its time.

    A failure (a peer's connection closed, the process group's timeout passed) is
    re-raised as :class:`CollectiveError` naming this rank, the collective and its group.
    ``calls=0`` adds time to a collective already counted (waiting on an async one).
    """
    start = time.perf_counter()
    try:
        yield
    except RuntimeError as exc:
        if group is None:
            peers, ranks = list(range(dist.get_world_size())), "the default group"
        else:
            peers = ranks = dist.get_process_group_ranks(group)
        reports = failed_peers(peers)
        blame = "".join(f"; rank {r} failed first: {why}" for r, why in sorted(reports.items()))
        raise CollectiveError(
            f"rank {dist.get_rank()}: collective {kind!r} over ranks {ranks} failed{blame}; a "
            f"peer may have died or stopped calling collectives (the process group's timeout "
            f"bounds the wait): {exc}"
        ) from exc
    elapsed = time.perf_counter() - start
    if _active:
        axis = axis_name(group)
        for stats in _active:
            stats.record(kind, nbytes, elapsed, calls, axis)


def axis_name(group: ProcessGroup | None) -> str:
    """The mesh dim a group is (DeviceMesh names its groups ``mesh_<dim>``), "world" for
    the default group, else its ranks."""
    desc = "default_pg" if group is None else getattr(group, "group_desc", "")
    if desc == "default_pg" or (group is not None and group == dist.group.WORLD):
        return "world"
    if desc.startswith("mesh_"):
        return desc[len("mesh_") :]
    return f"ranks {dist.get_process_group_ranks(group)}"


def all_to_all(
    input: Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    group: ProcessGroup,
    kind: str,
    output: Tensor | None = None,
) -> Tensor:
    """``all_to_all_single`` with uneven splits (no autograd); returns when it is done."""
    return all_to_all_start(input, output_splits, input_splits, group, kind, output).wait()


class PendingTensor:
    """The result of a collective still in flight; ``wait()`` returns it (once complete)."""

    def __init__(self, output: Tensor, work: dist.Work | None, kind: str, group: ProcessGroup):
        self._output, self._work, self._kind, self._group = output, work, kind, group

    def wait(self) -> Tensor:
        if self._work is not None:
            with collective(self._kind, 0, self._group, calls=0):
                self._work.wait()
            self._work = None
        return self._output


class PendingTensors:
    """Several results of one coalesced collective still in flight (``wait()``: the list)."""

    def __init__(self, flat: PendingTensor, shapes: Sequence[torch.Size]) -> None:
        self._flat, self._shapes = flat, list(shapes)

    def wait(self) -> list[Tensor]:
        parts = torch.split(self._flat.wait(), [s.numel() for s in self._shapes])
        return [part.view(shape) for part, shape in zip(parts, self._shapes, strict=True)]


def all_reduce_start(flat: Tensor, group: ProcessGroup | None, kind: str) -> PendingTensor:
    """Start the sum of ``flat`` over ``group`` in place; return at once (``wait()`` gives
    ``flat`` once summed), so local work overlaps the exchange."""
    size = dist.get_world_size(group)
    sent = 2 * (size - 1) * flat.numel() * flat.element_size() // size
    with collective(kind, sent, group):
        work = dist.all_reduce(flat, group=group, async_op=True)
    return PendingTensor(flat, work, kind, group)


def all_reduce_coalesced_start(
    tensors: Sequence[Tensor], group: ProcessGroup, kind: str
) -> PendingTensors:
    """Start the sums of ``tensors`` over ``group`` as one fp32 all-reduce; return at once
    (``wait()`` gives new tensors, same shapes), so local work overlaps the exchange."""
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    size = dist.get_world_size(group)
    with collective(kind, 2 * (size - 1) * flat.numel() * 4 // size, group):
        work = dist.all_reduce(flat, group=group, async_op=True)
    return PendingTensors(PendingTensor(flat, work, kind, group), [t.shape for t in tensors])


def all_reduce_coalesced(tensors: Sequence[Tensor], group: ProcessGroup, kind: str) -> list[Tensor]:
    """Sums of ``tensors`` over ``group`` in one fp32 all-reduce (new tensors, same shapes)."""
    return all_reduce_coalesced_start(tensors, group, kind).wait()


def first_rank(group: ProcessGroup | None) -> int:
    """The lowest global rank of ``group`` (None: the world, so 0): the source of its
    broadcasts of what one rank decides."""
    return 0 if group is None else min(dist.get_process_group_ranks(group))


def broadcast_coalesced(
    tensors: Sequence[Tensor], src: int, group: ProcessGroup | None, kind: str
) -> None:
    """``src``'s values of ``tensors`` on every member, in place: one broadcast per dtype
    (and device) of one flat buffer."""
    by_type: dict[tuple[torch.dtype, torch.device], list[Tensor]] = defaultdict(list)
    for t in tensors:
        by_type[t.dtype, t.device].append(t)
    size = dist.get_world_size(group)
    me = dist.get_rank(group) if group is not None else dist.get_rank()
    for same in by_type.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        sent = flat.numel() * flat.element_size() * (size - 1) if me == src else 0
        with collective(kind, sent, group):
            dist.broadcast(flat, src=src, group=group)
        with torch.no_grad():
            for t, part in zip(same, torch.split(flat, [t.numel() for t in same]), strict=True):
                t.copy_(part.view_as(t))


def all_gather_flat(output: Tensor, input: Tensor, group: ProcessGroup) -> None:
    """Every member's ``input`` concatenated into ``output`` (rank order). torch 2.13 renamed
    ``all_gather_into_tensor`` to ``all_gather_single`` (looked up per call, so wrappers
    installed later, like the benchmark's counters, see it)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, input, group=group)


def all_reduce(tensor: Tensor, group: ProcessGroup | None, kind: str, op: str = "sum") -> Tensor:
    """Elementwise ``op`` ("sum" or "max") of ``tensor`` over ``group``, in place; returns it."""
    size = dist.get_world_size(group)
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    with collective(kind, 2 * (size - 1) * tensor.numel() * tensor.element_size() // size, group):
        dist.all_reduce(tensor, op=reduce_op, group=group)
    return tensor


def all_gather_varied(tensor: Tensor, group: ProcessGroup | None, kind: str) -> list[Tensor]:
    """Every member's 1-D ``tensor`` (sizes may differ), by rank: two all-gathers into a
    tensor (the sizes, then the data padded to the largest), which every backend runs on
    every device (gloo included on CUDA, unlike the functional all-gather)."""
    size = dist.get_world_size(group)
    count = torch.tensor([tensor.numel()], dtype=torch.long, device=tensor.device)
    counts = torch.empty(size, dtype=torch.long, device=tensor.device)
    with collective(kind + ".sizes", (size - 1) * 8, group):
        all_gather_flat(counts, count, group)
    return all_gather_sized(tensor, counts.tolist(), group, kind)


def all_gather_sized(
    tensor: Tensor, sizes: Sequence[int], group: ProcessGroup | None, kind: str
) -> list[Tensor]:
    """Every member's 1-D ``tensor`` by rank, where every member already knows each one's
    size (``sizes``, by rank): one all-gather of the data padded to the largest."""
    size = dist.get_world_size(group)
    most = max(sizes)
    padded = tensor.new_zeros(most)
    padded[: tensor.numel()] = tensor
    out = tensor.new_empty(size * most)
    with collective(kind, (size - 1) * most * tensor.element_size(), group):
        all_gather_flat(out, padded, group)
    return [out[r * most : r * most + n] for r, n in enumerate(sizes)]


def all_reduce_min(tensor: Tensor, group: ProcessGroup, kind: str) -> Tensor:
    """Elementwise MIN of ``tensor`` over ``group``, in place; returns it when done."""
    size = dist.get_world_size(group)
    with collective(kind, 2 * (size - 1) * tensor.numel() * tensor.element_size() // size, group):
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return tensor


def all_to_all_start(
    input: Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    group: ProcessGroup,
    kind: str,
    output: Tensor | None = None,
) -> PendingTensor:
    """Start an uneven ``all_to_all_single`` and return at once (no autograd); ``output``:
    where the result goes (contiguous, ``sum(output_splits)`` elements), else a new tensor.

    Collectives on a group run in the order ranks issue them, so later calls on
    ``group`` may be issued while this one is in flight.
    """
    if output is None:
        output = input.new_empty(sum(output_splits))
    me = dist.get_rank(group)
    nbytes = (sum(input_splits) - input_splits[me]) * input.element_size()
    with collective(kind, nbytes, group):
        work = dist.all_to_all_single(
            output,
            input.contiguous(),
            list(output_splits),
            list(input_splits),
            group=group,
            async_op=True,
        )
    return PendingTensor(output, work, kind, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, output_splits, input_splits, group, kind):  # type: ignore[override]
        ctx.splits = (output_splits, input_splits)
        ctx.group, ctx.kind = group, kind
        return all_to_all(input, output_splits, input_splits, group, kind)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        output_splits, input_splits = ctx.splits
        grad_in = all_to_all(grad, input_splits, output_splits, ctx.group, ctx.kind + ".backward")
        return grad_in, None, None, None, None


def all_to_all_autograd(
    input: Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    group: ProcessGroup,
    kind: str,
) -> Tensor:
    """Differentiable all-to-all whose backward always runs on every rank.

    A rank that sends nothing still takes part in the backward exchange: an
    input that needs no grad is promoted to a (throwaway) leaf that does.
    """
    if torch.is_grad_enabled() and not input.requires_grad:
        input = input.detach().requires_grad_()
    return _AllToAll.apply(input, list(output_splits), list(input_splits), group, kind)
