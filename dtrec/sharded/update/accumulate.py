"""Gradient accumulation for fused tables: several backwards, one update.

A fused table has no ``.grad`` to accumulate into: its update runs at the end of each
``backward()`` (``fused_update``). Microbatches (torch's pipeline schedules, or a user's
own accumulation loop) run several backwards per optimizer step, and must update a
table once, from the sum of their gradients, after every microbatch's forward read the
same weights: updating per microbatch would let a later forward read updated rows (1F1B
interleaves them), and step row-wise Adagrad's and Adam's state once per microbatch.
Inside :func:`accumulate_gradients` each backward only stashes its row gradients; the
block's end merges them per table and runs the ordinary sync and update once.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

from torch import nn

from dtrec.sharded.collection import ShardedCollection
from dtrec.sharded.update.fused_update import FusedUpdater


def _updaters(model: nn.Module) -> list[tuple[str, FusedUpdater]]:
    return [
        (name or "<model>", m._updater)
        for name, m in model.named_modules()
        if isinstance(m, ShardedCollection) and m._updater is not None
    ]


@contextlib.contextmanager
def accumulate_gradients(model: nn.Module, divide_by: int = 1) -> Iterator[None]:
    """Every backward inside the block stashes the fused tables' gradients; the block's
    end applies their sum, divided by ``divide_by``, as one update of each table.

    The result equals one backward of the summed losses (``divide_by=1``) or of their
    mean over ``divide_by`` equal microbatches, up to float reassociation. Under a
    ``torch.distributed.pipelining`` schedule pass its ``n_microbatches`` while its
    ``scale_grads`` is True (the default: it divides the other parameters' ``.grad`` by
    that number after the step); parameters with a ``.grad`` (dense ones, tables under a
    torch optimizer) accumulate as autograd always does and are not touched here. With
    microbatches of unequal size (a last uneven batch) that is the mean of the
    microbatches' mean losses, as the schedule's ``scale_grads`` makes it for the other
    parameters, not the mean over every sample.

    An exception inside the block drops the stashed gradients: no table changes (all or
    nothing, as for a failed backward). Offloaded collections are refused (their device
    cache may evict a row an earlier microbatch read before the update). Collective at
    the end, like the updates it runs. ``model``: a ``dtrec.distribute_module`` result.

    Example (a pipeline stage holding dtrec tables)::

        with dtrec.accumulate_gradients(stage_module, divide_by=n_microbatches):
            schedule.step(torch.arange(batch), dense, kjt=kjt)
        dense_optimizer.step()
    """
    if isinstance(divide_by, bool) or not isinstance(divide_by, int) or divide_by < 1:
        raise ValueError(f"accumulate_gradients: divide_by must be an int >= 1, got {divide_by!r}")
    updaters = _updaters(model)
    for name, updater in updaters:
        if updater.offload is not None:
            raise ValueError(
                f"accumulate_gradients: collection {name!r} has offloaded tables, whose "
                "device cache may drop rows between microbatches; not supported"
            )
        if updater.accumulating:
            raise ValueError(f"accumulate_gradients: collection {name!r} already accumulates")
        if updater._pending:
            raise ValueError(
                f"accumulate_gradients: collection {name!r} has a backward whose update has "
                "not run yet; enter the block before the first microbatch's forward"
            )
    for _, updater in updaters:
        updater.accumulating = True
    try:
        yield
    except BaseException:
        for _, updater in updaters:
            updater._pending = []
        raise
    finally:
        for _, updater in updaters:
            updater.accumulating = False
    waiting = [u for _, u in updaters if u._pending]
    if not waiting and updaters:
        warnings.warn(
            "accumulate_gradients: no backward reached the fused tables inside the block; "
            "no table was updated",
            RuntimeWarning,
            stacklevel=3,
        )
    try:
        rules = [u.current_rule() for u in waiting]  # no collective yet: ranks raise alike
        for updater, rule in zip(waiting, rules, strict=True):
            updater.apply_pending(rule, 1.0 / divide_by)
    finally:
        for updater in waiting:
            updater._pending = []
