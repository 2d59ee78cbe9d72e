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

import sys
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

REPO = Path(__file__).resolve().parents[2]


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
    "aten.bincount",  # sizes its output by the largest value
    "aten.equal",
    "aten.is_nonzero",
}


def call_site() -> str:
    """The innermost repository source line (outside this file) on the stack; installed
    packages do not count, even where the virtual environment lives inside the repository
    (``make`` puts ``.venv`` there)."""
    here = Path(__file__).resolve()
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        installed = "site-packages" in path.parts or (REPO / ".venv") in path.parents
        if REPO in path.parents and not installed and path.resolve() != here:
            return f"{path.relative_to(REPO)}:{frame.lineno} ({frame.name})"
    return "outside the repository"


def _on_device(device: torch.device, args, kwargs) -> bool:
    """Whether an op touches ``device``'s tensors (on CPU: every op, as if it were a GPU)."""
    return device.type == "cpu" or any(
        isinstance(t, Tensor) and t.device.type == device.type for t in tree_leaves((args, kwargs))
    )


def host_sync(func, args, kwargs, out, device: torch.device) -> bool:
    """Whether this dispatched op makes the host wait for ``device`` (on CPU: would, were
    its tensors on a GPU): a value or a data-dependent size read on the host, or a
    device-to-host copy. The one rule ``SyncSites`` and ``StepCounter`` share."""
    name = str(func.overloadpacket)  # e.g. "aten.nonzero"
    on_device = _on_device(device, args, kwargs)
    if name == "aten.repeat_interleave" and kwargs.get("output_size") is not None:
        return False
    if on_device and name in _SYNC_OPS:
        return True
    if name in ("aten._to_copy", "aten.copy_"):
        return _device_to_host(func, args, kwargs, out)
    # boolean-mask indexing (read or write): the result size is data-dependent
    return (
        on_device
        and name in ("aten.index", "aten.index_put_", "aten.index_put")
        and any(isinstance(i, Tensor) and i.dtype == torch.bool for i in tree_leaves(args[1:]))
    )


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
        out = func(*args, **kwargs)
        if host_sync(func, args, kwargs, out, self.device):
            self.sites[f"{func} at {call_site()}"] += 1
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


# ---------------------------------------------------------------- launches and host syncs

# Dispatched ops that launch nothing on the device: views, metadata, allocation without a
# fill, and host scalars wrapped for an op (``torch.where(c, x, 0.0)``).
_NO_LAUNCH = {
    "aten.view", "aten._unsafe_view", "aten._reshape_alias", "aten.reshape", "aten.slice",
    "aten.select", "aten.as_strided", "aten.expand", "aten.permute", "aten.t",
    "aten.transpose", "aten.unsqueeze", "aten.squeeze", "aten.detach", "aten.alias",
    "aten.empty", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
    "aten.empty_like", "aten.set_", "aten.split", "aten.split_with_sizes", "aten.unbind",
    "aten.narrow", "aten.resize_", "aten.view_as", "aten.unflatten", "aten.chunk",
    "aten.scalar_tensor", "aten.record_stream", "aten.is_pinned", "aten.sym_size",
    "aten.sym_stride", "aten.sym_numel", "aten.sym_storage_offset",
    "aten.lift_fresh",  # wraps a tensor made on the host from Python data (torch.tensor)
    "profiler._record_function_enter_new", "profiler._record_function_exit",
}  # fmt: skip


class StepCounter(TorchDispatchMode):
    """Device launches and host syncs of the code run inside, counted alike on CPU and CUDA.

    ``launches``, by kernel or op: every Triton kernel launch (counted where Triton runs a
    kernel, so the Triton interpreter on CPU counts what CUDA would launch; ops the
    interpreter runs inside a kernel are not counted), and every dispatched ATen op on the
    device's tensors that moves or computes data (collectives and copies included; views,
    metadata and bare allocations are not). One op is one launch here, so ops that CUDA runs
    as several kernels (``sort``: a radix sort's passes) count once: the profiler's count on
    a GPU (``cuda_activity``) is the upper reference, this one is the same on both devices.

    ``syncs``, by op and source line: the ops of ``host_sync`` plus, on CPU, ``tolist()`` and
    ``numpy()`` of a tensor (no dispatched op, but a device-to-host read on CUDA), except
    ``dtrec.ops.host_flags.HostFlag``'s reads of its host copies: on CUDA they read pinned
    host memory whose copy an event reported done (no wait; ``sync_debug_sites`` checks).

    ``host_tensors``: tensors that stay on the host on a GPU too (torch optimizers keep
    their ``step`` counts there unless ``capturable``): ops on them are neither launches
    nor syncs.

    Example::

        with StepCounter(torch.device("cpu")) as counts:
            model(kjt).values().backward(grad)
        counts.total_launches(), counts.total_syncs()
    """

    def __init__(self, device: torch.device, host_tensors: Sequence[Tensor] = ()) -> None:
        super().__init__()
        self.device = device
        self.launches: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self._in_kernel = 0
        # tensors that live on the host even on a GPU (torch optimizers' ``step`` counts):
        # ops on them alone (and 0-dim host scalars) launch nothing and wait for nothing
        self._host = {id(t) for t in host_tensors}
        self._restore: list[tuple[object, str, object]] = []

    def total_launches(self) -> int:
        return sum(self.launches.values())

    def total_syncs(self) -> int:
        return sum(self.syncs.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._in_kernel:  # the interpreter's own tensor ops inside a Triton kernel
            return out
        name = str(func.overloadpacket)
        if self._host and self._on_host(args, kwargs):
            return out
        if name not in _NO_LAUNCH and _on_device(self.device, args, kwargs):
            self.launches[name] += 1
        if host_sync(func, args, kwargs, out, self.device):
            self.syncs[f"{func} at {call_site()}"] += 1
        return out

    def _on_host(self, args, kwargs) -> bool:
        """Whether an op reads only ``host_tensors`` (at least one) and 0-dim scalars."""
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        return any(id(t) in self._host for t in tensors) and all(
            id(t) in self._host or t.dim() == 0 for t in tensors
        )

    def __enter__(self):
        self._patch_triton()
        if self.device.type == "cpu":
            for method in ("tolist", "numpy"):
                self._patch(torch.Tensor, method, self._host_read(getattr(torch.Tensor, method)))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for owner, attr, original in reversed(self._restore):
                setattr(owner, attr, original)
            self._restore.clear()

    def _patch(self, owner: object, attr: str, replacement: object) -> None:
        self._restore.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, replacement)

    def _patch_triton(self) -> None:
        try:
            from triton.runtime.interpreter import InterpretedFunction
            from triton.runtime.jit import JITFunction
        except ImportError:
            return
        for cls in (JITFunction, InterpretedFunction):
            self._patch(cls, "run", self._launch(cls.run))

    def _launch(self, run: Callable) -> Callable:
        counter = self

        def counted(kernel, *args, **kwargs):
            counter.launches[f"triton:{getattr(kernel.fn, '__name__', kernel)}"] += 1
            counter._in_kernel += 1
            try:
                return run(kernel, *args, **kwargs)
            finally:
                counter._in_kernel -= 1

        return counted

    def _host_read(self, read: Callable) -> Callable:
        counter = self

        def counted(tensor, *args, **kwargs):
            if not counter._in_kernel and not _reading_host_copy():
                counter.syncs[f"Tensor.{read.__name__} at {call_site()}"] += 1
            return read(tensor, *args, **kwargs)

        return counted


def _reading_host_copy() -> bool:
    """Whether ``dtrec.ops.host_flags`` is reading a host copy (not the device)."""
    module = sys.modules.get("dtrec.ops.host_flags")
    return module is not None and module.reading_host_copy()


def count_steady_step(
    step: Callable[[object], None],
    batch: Callable[[], object],
    warmup: int,
    device: torch.device | None = None,
) -> dict:
    """Launches and host syncs of one steady-state ``step(batch())`` after ``warmup`` steps:
    totals and by kernel/op and by sync site (what the budget tests assert on)."""  # fmt: skip
    for _ in range(warmup):
        step(batch())
    inputs = batch()
    with StepCounter(device or torch.device("cpu")) as counts:
        step(inputs)
    return {
        "launches": counts.total_launches(),
        "syncs": counts.total_syncs(),
        "launch_kinds": dict(counts.launches),
        "sync_sites": dict(counts.syncs),
    }
