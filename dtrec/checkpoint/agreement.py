"""Every rank agrees on a checkpoint step's outcome: one rank's failure is raised on all.

DCP's reads and writes, the marker and the directory renames can fail on one rank
only; left alone the others would wait in the next collective. These helpers turn
such a failure into the same ``CheckpointError`` (or ``CollectiveError``) everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from dtrec.comm.failures import CollectiveError


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: incomplete, missing files, or not this model's."""


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (an exception there is re-raised everywhere)."""
    if world_size() == 1:
        if isinstance(value, BaseException):
            raise value
        return value
    box = [value]
    try:
        dist.broadcast_object_list(box, src=0)
    except Exception as exc:  # noqa: BLE001 - a dead peer surfaces here
        raise CollectiveError(f"rank {rank()}: checkpoint broadcast failed: {exc}") from exc
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def all_ok(error: BaseException | None, what: str) -> None:
    """Raise on every rank if any rank failed ``what`` (so none waits on the others)."""
    if world_size() == 1:
        if error is not None:
            raise error
        return
    flags = torch.tensor([0 if error is None else 1])
    try:
        dist.all_reduce(flags)
    except Exception as exc:  # noqa: BLE001
        raise CollectiveError(f"rank {rank()}: checkpoint {what} failed: {exc}") from exc
    if error is not None:
        raise error
    if int(flags) != 0:
        raise CheckpointError(f"checkpoint {what} failed on another rank (see its error)")


def on_every_rank(io: Callable[[], object], what: str, path: Path) -> None:
    """Run DCP's ``io``; if it fails on any rank, every rank raises CheckpointError.

    DCP gathers the errors of its own steps (planning, reading, writing) into a
    ``CheckpointException`` on every rank; those are agreed on like any other. A
    ``RuntimeError`` that escapes DCP raw came from one of its collectives (a peer died
    mid-save): then no agreement is attempted. The survivors are in different
    collectives by now (one still in DCP's gather, another past it), so one more
    collective would leave them all waiting for the process group's timeout; this rank
    raises ``CollectiveError`` at once, and its exit frees the peers it talked to.
    """
    error = None
    try:
        io()
    except CheckpointException as exc:
        error = CheckpointError(f"rank {rank()}: {what} of {path} failed: {failure_reason(exc)}")
    except RuntimeError as exc:
        raise CollectiveError(
            f"rank {rank()}: checkpoint {what} of {path} failed in a collective (a peer died "
            f"or stopped calling collectives; no rank published anything): {exc}"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - reported on every rank
        error = CheckpointError(f"rank {rank()}: {what} of {path} failed: {failure_reason(exc)}")
    all_ok(error, what)


def failure_reason(exc: BaseException) -> str:
    """One line per failing rank (DCP's exception carries every rank's traceback)."""

    def line(e: BaseException) -> str:
        text = str(e).strip().splitlines()
        return f"{type(e).__name__}: {text[0] if text else ''}"

    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {r}: {line(e)}" for r, (e, _) in sorted(exc.failures.items()))
    return line(exc)
