"""What one training step does besides its math: stage times, launches, host syncs, copies.

Probes for ``benchmarks/gpu_step.py``, each usable on CPU (smoke runs) and CUDA:

* ``StageTimer``: wraps named methods (e.g. a sharded module's input dist) and sums, per
  stage, host time and (CUDA) the device time between events recorded around each call,
  which is the stage's share of the step whether the device or the host is the bottleneck;
* ``cuda_activity``: kernels, copies and host-sync API calls per step, from a profile;
* ``SyncSites``: ops that make the host wait for the device (``.item()``, ``nonzero``,
  device-to-host copies, ...), counted by the source line that ran them; on CPU it still
  sees the ops that would sync on CUDA (not ``.tolist()`` of a CPU tensor);
* ``FullTableWatch``: fails on any new tensor shaped like a whole watched table.
"""

from __future__ import annotations

import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

REPO = Path(__file__).resolve().parents[1]


class StageTimer:
    """Per-stage host and device seconds of wrapped calls (nested calls count once)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host_s: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self._events: dict[str, list[tuple]] = defaultdict(list)
        self._active: set[str] = set()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if name in self._active:  # a stage calling itself (e.g. super()): time the outer
            yield
            return
        self._active.add(name)
        cuda = self.device.type == "cuda"
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        if start is not None:
            start.record()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.host_s[name] += time.perf_counter() - t0
            self.calls[name] += 1
            if start is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._events[name].append((start, end))
            self._active.discard(name)

    def device_s(self) -> dict[str, float]:
        """Device seconds per stage (synchronizes; empty on CPU)."""
        if self.device.type != "cuda":
            return {}
        torch.cuda.synchronize()
        return {n: sum(s.elapsed_time(e) for s, e in ev) / 1e3 for n, ev in self._events.items()}

    @contextmanager
    def wrapping(self, targets: Sequence[tuple[str, type, str]]) -> Iterator[list[str]]:
        """Time ``cls.method`` as ``stage`` for each (stage, cls, method) while inside;
        yields the targets that do not exist (the library changed: say so, do not fail)."""
        saved, missing = [], []
        for stage, cls, method in targets:
            original = cls.__dict__.get(method)
            if original is None:
                missing.append(f"{cls.__qualname__}.{method}")
                continue
            saved.append((cls, method, original))
            setattr(cls, method, self._wrap(stage, original))
        try:
            yield missing
        finally:
            for cls, method, original in saved:
                setattr(cls, method, original)

    def _wrap(self, stage: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            with self.stage(stage):
                return fn(*args, **kwargs)

        return timed


SYNC_APIS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cuStreamSynchronize",
    "cuCtxSynchronize",
    "cudaMemcpy",  # the synchronous one (cudaMemcpyAsync is not a sync by itself)
)


def cuda_activity(prof: torch.profiler.profile, steps: int) -> dict[str, float]:
    """Kernels, memcpys, memsets and host-sync API calls per step of a CUDA profile."""
    counts: Counter[str] = Counter()
    for e in prof.events():
        name = e.name
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kind = "memcpy" if "Memcpy" in name else "memset" if "Memset" in name else "kernels"
            counts[kind] += 1
        elif name in SYNC_APIS:
            counts["host_sync_api_calls"] += 1
    out = {k: counts[k] / steps for k in ("kernels", "memcpy", "memset", "host_sync_api_calls")}
    out["launches"] = out["kernels"] + out["memcpy"] + out["memset"]
    return out


# Ops whose result size or value the host must read: on CUDA each waits for the device.
_SYNC_OPS = {
    "aten._local_scalar_dense",  # .item(), int(t), bool(t), float(t)
    "aten.nonzero",
    "aten.masked_select",
    "aten.unique_consecutive",
    "aten._unique2",
    "aten.unique_dim",
    "aten.repeat_interleave",  # without output_size
    "aten.equal",
    "aten.is_nonzero",
}


def call_site(skip: str = "step_probes") -> str:
    """The innermost repository source line (outside this file) on the stack; installed
    packages do not count, even where the virtual environment lives inside the repository
    (``make`` puts ``.venv`` there)."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        installed = "site-packages" in path.parts or (REPO / ".venv") in path.parents
        if skip not in path.name and REPO in path.parents and not installed:
            return f"{path.relative_to(REPO)}:{frame.lineno} ({frame.name})"
    return "outside the repository"


class SyncSites(TorchDispatchMode):
    """Counts ops that make the host wait for the device, by the source line that ran them.

    On a CUDA ``device`` only ops on CUDA tensors count; on CPU every such op counts (it
    would wait if its tensors lived on a GPU, e.g. a host-side step counter would not).
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.sites: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)  # e.g. "aten.nonzero"
        out = func(*args, **kwargs)
        overload = str(func)
        on_device = self.device.type == "cpu" or any(
            isinstance(t, Tensor) and t.device.type == self.device.type
            for t in tree_leaves((args, kwargs))
        )
        syncs = on_device and name in _SYNC_OPS
        if name == "aten.repeat_interleave" and kwargs.get("output_size") is not None:
            syncs = False
        if name in ("aten._to_copy", "aten.copy_") and not syncs:
            syncs = _device_to_host(func, args, kwargs, out)
        if (
            on_device
            and name == "aten.index"
            and any(isinstance(i, Tensor) and i.dtype == torch.bool for i in tree_leaves(args[1:]))
        ):
            syncs = True  # boolean-mask indexing: the result size is data-dependent
        if syncs:
            self.sites[f"{overload} at {call_site()}"] += 1
        return out


def _device_to_host(func, args, kwargs, out) -> bool:
    src = args[1] if str(func).startswith("aten.copy_") else args[0]
    dst = args[0] if str(func).startswith("aten.copy_") else out
    if not (isinstance(src, Tensor) and isinstance(dst, Tensor)):
        return False
    return (
        src.device.type == "cuda"
        and dst.device.type == "cpu"
        and not kwargs.get("non_blocking", False)
    )


@contextmanager
def sync_debug_sites() -> Iterator[Counter[str]]:
    """CUDA's own count of synchronizing calls (``torch.cuda.set_sync_debug_mode``), by
    source line; yields a Counter filled while inside (stays empty on CPU)."""
    import warnings

    sites: Counter[str] = Counter()
    if not torch.cuda.is_available():
        yield sites
        return
    previous = torch.cuda.get_sync_debug_mode()
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            sites[call_site()] += 1
        else:
            original(message, category, filename, lineno, file, line)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            warnings.showwarning = original


class FullTableWatch(TorchDispatchMode):
    """Records every op that creates new memory shaped like a whole watched table.

    ``tables``: name -> (rows, dim) of tables that must never exist whole here: tables this
    rank holds only part of, and tables it holds whole but that are larger than any
    per-step buffer (rows > ids looked up in them per step), so that a second tensor of
    their shape is a copy (a dense gradient, a gathered table), never touched-row data.
    ``device``: only tensors on this device count (None: every device).
    """

    def __init__(self, tables: dict[str, tuple[int, int]], device: torch.device | None = None):
        super().__init__()
        self.device = device
        self.violations: list[str] = []
        self._shapes = {tuple(shape): name for name, shape in tables.items()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t) for t in tree_leaves((args, kwargs))}
        for t in tree_leaves(out):
            if not isinstance(t, Tensor) or t.is_meta or tuple(t.shape) not in self._shapes:
                continue
            if self.device is not None and t.device != self.device:
                continue
            if _storage(t) in inputs:  # a view or in-place: no new memory
                continue
            table = self._shapes[tuple(t.shape)]
            self.violations.append(f"table {table!r}: {func} made a {tuple(t.shape)} tensor "
                                   f"on {t.device} at {call_site()}")  # fmt: skip
        return out


def _storage(t: object) -> int | None:
    """The address of a plain tensor's memory (None for others, e.g. DTensor wrappers)."""
    if not isinstance(t, Tensor) or t.is_meta:
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
