"""The host tier and the copies between it and the device.

On CUDA an offloaded block lives in pinned (page-locked) host memory, so row copies to
and from the device are DMA transfers that run on a stream of their own
(``CopyStream``) while the compute stream works: a copy job waits for the compute
stream's work issued before it (``begin``), and the compute stream waits for the copies
(``join``) before it reads or writes the cache again. A job may run on a worker thread
(``CopyJobs``), so the host-side gathers and scatters of rows (CPU work) overlap the
compute as well.

On the CPU both tiers are CPU memory and every copy is immediate: the same code runs
(only the stream calls are skipped), so CI exercises the whole path. There jobs run
inline by default (``worker_thread``); the tests set ``DTREC_OFFLOAD_WORKER=1`` so the
worker thread's path runs in CI too.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised host buffer for copies to and from ``device``: pinned on CUDA (from
    torch's caching host allocator, which reuses it)."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


_REGISTERED: list[Tensor] = []
"""Host-tier blocks pinned in place: registered memory must outlive every copy from it,
so they stay for the process's life (a model's tables usually do)."""


def host_block(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised host-tier block (an offloaded table's rows or their optimizer state).

    On CUDA it is ordinary memory pinned in place (``cudaHostRegister``): torch's caching
    host allocator rounds each buffer up to a power of two, so a 100 GB block would take
    128 GB of pinned memory. Where registering fails, a pinned copy from that allocator.
    """
    block = torch.empty(shape, dtype=dtype)
    if device.type != "cuda" or not block.numel():
        return block
    nbytes = block.numel() * block.element_size()
    if int(torch.cuda.cudart().cudaHostRegister(block.data_ptr(), nbytes, 0)) != 0:
        return host_empty(shape, dtype, device)
    _REGISTERED.append(block)
    return block


class CopyStream:
    """The stream the cache's row copies run on (None on the CPU: copies are immediate)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._after: torch.cuda.Event | None = None  # the compute work a job waits for
        self._done: torch.cuda.Event | None = None  # the last job's copies

    def __deepcopy__(self, memo: dict[int, object]) -> CopyStream:
        """A copied model's copies run on a stream of their own (a CUDA stream cannot be
        copied; the original's copies have landed: ``ShardedCollection.__deepcopy__``)."""
        return CopyStream(self.device)

    def begin(self, *handed: Tensor) -> None:
        """Before a job: it will wait for the compute stream's work issued so far.

        ``handed``: tensors made on the compute stream that the job reads on the copy
        stream (kept from the allocator until the copy stream is done with them).
        """
        if self.stream is None:
            return
        self._after = torch.cuda.current_stream(self.device).record_event()
        for tensor in handed:
            tensor.record_stream(self.stream)

    def run(self, job: Callable[[], None]) -> None:
        """Run ``job``'s copies on the copy stream (on the calling thread)."""
        if self.stream is None:
            job()
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if self._after is not None:
                self.stream.wait_event(self._after)
            job()
            self._done = self.stream.record_event()

    def join(self) -> None:
        """The compute stream waits for every copy issued so far (no host wait)."""
        if self.stream is not None and self._done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._done)

    def to_device(self, host_rows: Tensor) -> Tensor:
        """Host rows on the device (async from pinned memory on the copy stream)."""
        return host_rows.to(self.device, non_blocking=True)

    def to_host(self, rows: Tensor) -> Tensor:
        """Device rows in host memory, complete when this returns (it waits for the
        current stream: the copy stream inside ``run``, else the compute stream)."""
        if self.stream is None:
            return rows
        staged = host_empty(tuple(rows.shape), rows.dtype, self.device)
        staged.copy_(rows, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return staged


def worker_thread(device: torch.device) -> bool:
    """Whether a background copy job runs on the worker thread: on CUDA, yes (its host-side
    gathers and scatters overlap the device's compute); on the CPU, only with
    ``DTREC_OFFLOAD_WORKER=1``: there the job's gathers compete with the step's compute for
    the same cores, and the thread's hand-offs cost more than they hide (a pipelined
    offloaded step 20.5 ms with it, 15.1 ms without, against 15.2 ms plain, on 2 cores)."""
    return device.type == "cuda" or os.environ.get("DTREC_OFFLOAD_WORKER") == "1"


class CopyJobs:
    """Runs a collection's copy jobs one at a time, on a worker thread or inline.

    ``start(job, background=True)`` returns at once (a prefetched batch's fill overlaps
    the current batch's compute); ``wait()`` returns when the job is done and re-raises
    its error; every reader of the cache or of the host tier calls it first.
    """

    _pool: ThreadPoolExecutor | None = None

    def __init__(self, copies: CopyStream) -> None:
        self.copies = copies
        self._running: Future[None] | None = None

    def start(self, job: Callable[[], None], background: bool) -> None:
        self.wait()
        if not background or not worker_thread(self.copies.device):
            self.copies.run(job)
            self.copies.join()
            return
        if CopyJobs._pool is None:  # one worker for the process: jobs never run at once
            CopyJobs._pool = ThreadPoolExecutor(1, thread_name_prefix="dtrec-offload")
        self._running = CopyJobs._pool.submit(self.copies.run, job)

    def wait(self) -> None:
        running, self._running = self._running, None
        if running is not None:
            running.result()
        self.copies.join()
