"""Where a distributed training step's time goes, for dtrec and TorchRec alike.

``benchmarks/distributed.py`` times every step under an ``ExclusiveStageTimer``: the
methods that run each stage of the sparse module are wrapped (``dtrec_targets``,
``torchrec_targets``), and each wrapped call's time is charged to its stage *minus* the
time of wrapped calls nested in it, so the stages add up to the step:

* ``input_dist``: validation, bucketizing and the id exchange, waits on it included;
* ``lookup_fwd``: the pooled lookups on local shards;
* ``output_dist``: the pooled exchange and assembling the output (TorchRec's awaitable
  waits included, wherever the dense part first reads them);
* ``output_dist_bwd``: the output exchange's backward (gradients back to the shards);
* ``backward_update``: the rest of ``loss.backward()``: the embedding backward and fused
  update (TorchRec's is inside FBGEMM's backward), the dense backward and DDP's all-reduce;
  dtrec's fused update alone is also reported as ``fused_update`` (part of it);
* ``dense``: the rest of the step: dense forward, loss, optimizer steps, replica sync.

``HostReads`` counts, in one untimed step, the points where the host reads tensor data
(``.item()``, ``.tolist()``, data-dependent shapes like ``nonzero``): each one waits for
the device on a GPU. On CPU tensors it counts every such read, including ones of tensors
built on the host (which would not sync on a GPU).
"""

from __future__ import annotations

import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.probes.step import REPO, SyncSites

STAGES = ("input_dist", "lookup_fwd", "output_dist", "output_dist_bwd", "backward_update", "dense")
Target = tuple[str, type | ModuleType, str]  # (stage, owner, attribute)


class ExclusiveStageTimer:
    """Seconds per stage, each call charged its own time minus its nested stages' time.

    Wall seconds (``seconds``) include waiting for peers; CPU seconds of the process
    (``cpu_seconds``, gloo's threads included) are the work itself, which is what a loaded
    machine shares out, so they compare libraries more steadily than wall time does.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu_seconds: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [name, wall start, cpu start, nested wall, nested cpu]

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self._stack.append([name, time.perf_counter(), time.process_time(), 0.0, 0.0])
        try:
            yield
        finally:
            name, start, cpu_start, nested, nested_cpu = self._stack.pop()
            elapsed = time.perf_counter() - start
            cpu = time.process_time() - cpu_start
            self.seconds[name] += elapsed - nested
            self.cpu_seconds[name] += cpu - nested_cpu
            if self._stack:
                self._stack[-1][3] += elapsed
                self._stack[-1][4] += cpu

    def clear(self) -> None:
        self.seconds.clear()
        self.cpu_seconds.clear()

    @contextmanager
    def wrapping(self, targets: Sequence[Target]) -> Iterator[list[str]]:
        """Time ``owner.attribute`` as ``stage`` for each target while inside; yields those
        that do not exist (the library changed: say so, do not fail)."""
        saved, missing, seen = [], [], set()
        for stage, owner, attr in targets:
            original = owner.__dict__.get(attr)
            if original is None:
                missing.append(f"{getattr(owner, '__qualname__', owner.__name__)}.{attr}")
                continue
            if (id(owner), attr) in seen:
                continue
            seen.add((id(owner), attr))
            saved.append((owner, attr, original))
            wrapped = self._wrap(stage, original)
            setattr(
                owner,
                attr,
                staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped,
            )
        try:
            yield missing
        finally:
            for owner, attr, original in saved:
                setattr(owner, attr, original)

    def _wrap(self, stage: str, fn: Callable) -> Callable:
        call = fn.__func__ if isinstance(fn, staticmethod) else fn

        def timed(*args, **kwargs):
            with self.stage(stage):
                return call(*args, **kwargs)

        return timed

    def per_step(
        self, steps: int, part_of: dict[str, str] | None = None, cpu: bool = False
    ) -> dict[str, float]:
        """Milliseconds per step of every stage (``STAGES`` first, then any other), wall or
        ``cpu``; a stage in ``part_of`` (part -> whole) is also added to its whole."""
        seconds = self.cpu_seconds if cpu else self.seconds
        names = [*STAGES, *sorted(set(seconds) - set(STAGES))]
        ms = {n: 1e3 * seconds.get(n, 0.0) / steps for n in names}
        for part, whole in (part_of or {}).items():
            if part in ms:
                ms[whole] += ms[part]
        return ms


def train_step(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    timer: ExclusiveStageTimer,
    kjt: object,
    labels: torch.Tensor,
    hook: Callable[[], None] | None = None,
) -> float:
    """One BCE training step, its backward timed as "backward_update" and the rest as
    "dense" (what the sparse stages nested in it leave); ``hook`` runs after the
    optimizers (TorchRec's replica sync). Returns the loss."""
    with timer.stage("dense"):
        loss = F.binary_cross_entropy_with_logits(model(kjt), labels)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        with timer.stage("backward_update"):
            loss.backward()
        for opt in optimizers:
            opt.step()
        if hook is not None:
            hook()
        return loss.item()


def dtrec_targets(model: nn.Module) -> list[Target]:
    """dtrec's stages by the classes and functions that run them."""
    from dtrec.comm import collectives
    from dtrec.sharded.dist.input_dist import RoutedBatch
    from dtrec.sharded.dist.output_dist import OutputDist
    from dtrec.sharded.lookup.pooled import LocalLookup
    from dtrec.sharded.module import ShardedEmbeddingBagCollection
    from dtrec.sharded.update import fused_update

    del model  # dtrec's stages are its classes'
    return [
        ("input_dist", ShardedEmbeddingBagCollection, "input_dist"),
        ("input_dist", RoutedBatch, "wait_served"),
        ("lookup_fwd", LocalLookup, "served"),
        ("lookup_fwd", LocalLookup, "data_parallel"),
        ("output_dist", OutputDist, "__call__"),
        ("output_dist", OutputDist, "zeros"),
        ("output_dist", OutputDist, "add_data_parallel"),
        ("output_dist", OutputDist, "keyed"),
        ("output_dist_bwd", collectives._AllToAll, "backward"),
        ("fused_update", fused_update, "update_waiting"),
    ]


def torchrec_targets(model: nn.Module) -> list[Target]:
    """TorchRec's stages: the sharded EBC's input dist and its awaitables, the lookup and
    output-dist modules it holds, the pooled collectives' autograd functions."""
    from torchrec.distributed import comm_ops, dist_data, embedding_sharding, embeddingbag

    targets: list[Target] = [
        ("input_dist", embeddingbag.ShardedEmbeddingBagCollection, "input_dist"),
        ("input_dist", dist_data.KJTAllToAllSplitsAwaitable, "_wait_impl"),
        ("input_dist", dist_data.KJTAllToAllTensorsAwaitable, "_wait_impl"),
        ("input_dist", embedding_sharding.KJTListSplitsAwaitable, "_wait_impl"),
        ("input_dist", embedding_sharding.KJTListAwaitable, "_wait_impl"),
        ("output_dist", dist_data.PooledEmbeddingsAwaitable, "_wait_impl"),
        ("output_dist", embeddingbag.EmbeddingBagCollectionAwaitable, "_wait_impl"),
    ]
    for name in ("All2All_Pooled_Req", "All2All_Pooled_Wait", "ReduceScatter_Req",
                 "ReduceScatter_Wait", "ReduceScatterBase_Req", "ReduceScatterBase_Wait",
                 "ReduceScatterV_Req", "ReduceScatterV_Wait"):  # fmt: skip
        targets.append(("output_dist_bwd", getattr(comm_ops, name), "backward"))
    for module in model.modules():
        if isinstance(module, embeddingbag.ShardedEmbeddingBagCollection):
            targets += [("lookup_fwd", type(m), "forward") for m in module._lookups]
            targets += [("output_dist", type(m), "forward") for m in module._output_dists]
    return targets


class HostReads(SyncSites):
    """``SyncSites`` plus ``Tensor.tolist`` (not a dispatched op), by source line."""

    @contextmanager
    def counting(self) -> Iterator[Counter[str]]:
        original = torch.Tensor.tolist

        def tolist(tensor, *args, **kwargs):
            self.sites[f"tolist at {_caller()}"] += 1
            return original(tensor, *args, **kwargs)

        torch.Tensor.tolist = tolist
        try:
            with self:
                yield self.sites
        finally:
            torch.Tensor.tolist = original


def print_stage_table(results: dict[str, dict[str, dict]], key: str = "stage_ms") -> None:
    """Per config and library: ms per stage (medians over ranks; ``key`` "stage_ms" wall,
    "stage_cpu_ms" CPU), collectives and host reads."""
    cols = [*STAGES, "fused_update"]
    head = f"{'config':<16}{'lib':<9}{'step':>7}" + "".join(f"{c[:11]:>12}" for c in cols)
    head += f"{'colls':>7}{'reads':>7}"
    what = "CPU ms" if key == "stage_cpu_ms" else "wall ms"
    print(
        f"\n{what} per step by stage (exclusive; dtrec's fused_update is part of backward_update)"
    )
    print(head)
    print("-" * len(head))
    for config, runs in results.items():
        for lib, run in runs.items():
            if run["status"] != "ok" or key not in run["median"]:
                continue
            m = run["median"]
            ms = m[key]
            cells = "".join(f"{ms[c]:>12.1f}" if c in ms else f"{'-':>12}" for c in cols)
            step = m["step_ms"] if key == "stage_ms" else sum(ms[c] for c in STAGES)
            print(
                f"{config:<16}{lib:<9}{step:>7.1f}{cells}"
                f"{m['collectives_per_step']:>7.0f}{m['host_reads_per_step']:>7.0f}"
            )
    print(
        "colls: c10d collectives per step (DDP's included); reads: host reads of tensor data "
        "per step (each a device sync on a GPU)"
    )


def _caller() -> str:
    """The innermost repository line on the stack outside this file (installed packages
    do not count)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = Path(frame.filename)
        if REPO in path.parents and "site-packages" not in path.parts:
            return f"{path.relative_to(REPO)}:{frame.lineno} ({frame.name})"
    return "outside the repository"
