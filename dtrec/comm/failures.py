"""Failure reports: a rank that fails says so in the process group's store, so peers
left waiting in a collective with it can name it instead of only seeing a dead link.

``dtrec.report_failures()`` wraps a training loop; ``distribute_module`` also chains
``sys.excepthook`` so an uncaught exception in a script reports itself before the
process exits. Reports are best effort (a rank killed by a signal cannot write one).

Example::

    with dtrec.report_failures():
        for batch in batches:
            train_step(batch)
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress

import torch.distributed as dist

from dtrec._torch_compat import default_store

_KEY = "dtrec/failed/{rank}"
_hook_installed = False


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, or it did not join within the group's timeout.

    Defined here, beside the failure reports, because a report is never written for
    one (it is a consequence of another rank's failure, which reports itself).
    """


def _store() -> object | None:
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return default_store()
    except Exception:  # noqa: BLE001 - no store, no reports
        return None


def _summary(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def report_failure(exc: BaseException) -> None:
    """Record in the default store that this rank failed, and why (best effort).

    Not for ``CollectiveError``: that is a consequence of another rank's failure.
    """
    store = _store()
    if store is None or isinstance(exc, CollectiveError):
        return
    with suppress(Exception):  # the store may be gone too
        store.set(_KEY.format(rank=dist.get_rank()), _summary(exc))


def failed_peers(ranks: Sequence[int]) -> dict[int, str]:
    """Failure reports of ``ranks`` (this one excluded), without waiting for any."""
    store = _store()
    if store is None:
        return {}
    out = {}
    me = dist.get_rank()
    for rank in ranks:
        key = _KEY.format(rank=rank)
        try:
            if rank != me and store.check([key]):
                out[rank] = store.get(key).decode()
        except Exception:  # noqa: BLE001
            continue
    return out


@contextmanager
def report_failures() -> Iterator[None]:
    """Run the block; if it raises on this rank, record that for the peers, then re-raise."""
    try:
        yield
    except BaseException as exc:
        report_failure(exc)
        raise


def install_excepthook() -> None:
    """Chain ``sys.excepthook`` once: an uncaught exception reports itself, then prints."""
    global _hook_installed
    if _hook_installed:
        return
    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:  # type: ignore[no-untyped-def]
        report_failure(value)
        previous(kind, value, traceback)

    sys.excepthook = hook
    _hook_installed = True
