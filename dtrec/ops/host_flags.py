"""A device flag the host reads only once the device has written it: no wait in the step.

A bounds check on the device (``Lookup.error``) leaves its verdict in a small device
tensor. Reading it right away would make the host wait for every kernel queued before
it; instead each step copies the flag into a host buffer (pinned, asynchronously, on
CUDA) and records an event, and a later step reads the copies whose events have
completed: by then the copy is done, the read waits for nothing. On CPU the copy is
done when it returns.

``StepCounter`` (``benchmarks/probes/step.py``) counts host reads of tensors as syncs on
CPU, where it cannot tell a host buffer from a device tensor; ``reading_host_copy``
tells it that these reads are of host copies (the GPU run's sync count checks it).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

_READING = [0]
_MAX_PENDING = 4  # copies kept unread (each holds its batch) before the oldest is waited for


def reading_host_copy() -> bool:
    """Whether a ``HostFlag`` is reading one of its host copies right now."""
    return _READING[0] > 0


@contextlib.contextmanager
def _reading() -> Iterator[None]:
    _READING[0] += 1
    try:
        yield
    finally:
        _READING[0] -= 1


class HostFlag:
    """An int32 ``[2]`` device flag (zero: nothing to report), snapshotted after each step
    and read by a later one without waiting.

    Example::

        flag = HostFlag(device)
        kernel(..., error=flag.flag)  # sets flag.flag[0] on a bad input
        flag.snapshot(tag=batch)
        for tag, (bad, detail) in flag.ready():  # copies the device has written by now
            ...
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.flag = torch.zeros(2, dtype=torch.int32, device=self.device)
        self._copies: deque[tuple[Tensor, Any, object]] = deque()

    def snapshot(self, tag: object) -> None:
        """Copy the flag as it will be once the queued work is done; ``tag`` comes back
        with it from ``ready``."""
        cuda = self.device.type == "cuda"
        host = torch.empty(2, dtype=torch.int32, pin_memory=cuda)
        host.copy_(self.flag, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        self._copies.append((host, event, tag))
        if len(self._copies) > _MAX_PENDING:  # the host ran far ahead: wait for the oldest
            oldest = self._copies[0][1]
            if oldest is not None:
                oldest.synchronize()

    def ready(self, wait: bool = False) -> list[tuple[object, list[int]]]:
        """(tag, flag values) of the snapshots the device has written, oldest first, and
        forgets them; ``wait``: every snapshot (waits for the device)."""
        done = []
        with _reading():
            while self._copies:
                host, event, tag = self._copies[0]
                if event is not None and not wait and not event.query():
                    break
                if event is not None and wait:
                    event.synchronize()
                self._copies.popleft()
                done.append((tag, host.tolist()))
        return done

    def clear(self) -> None:
        """Zero the flag and forget unread snapshots (after their error was reported)."""
        self.flag.zero_()
        self._copies.clear()


__all__ = ["HostFlag", "reading_host_copy"]
