"""HostFlag: snapshots of a device flag come back in order once written, and reading them
is not counted as a host sync (on CUDA it reads pinned memory an event reported done)."""

from __future__ import annotations

import torch

from benchmarks.probes.step import StepCounter
from dtrec.ops.host_flags import HostFlag


def test_snapshots_come_back_in_order_and_are_forgotten() -> None:
    flag = HostFlag(torch.device("cpu"))
    flag.snapshot("a")
    flag.flag[0] = 1  # what a kernel does for a bad batch: set, never cleared by it
    flag.snapshot("b")
    with StepCounter(torch.device("cpu")) as counts:
        done = flag.ready()
    assert done == [("a", [0, 0]), ("b", [1, 0])]
    assert counts.total_syncs() == 0, counts.syncs  # reads of the host copies
    assert flag.ready() == []
    flag.snapshot("c")
    flag.clear()
    assert flag.ready(wait=True) == [] and flag.flag.tolist() == [0, 0]


def test_the_copy_is_taken_when_snapshot_runs() -> None:
    flag = HostFlag(torch.device("cpu"))
    flag.snapshot("before")
    flag.flag[0] = 1
    assert flag.ready() == [("before", [0, 0])]
