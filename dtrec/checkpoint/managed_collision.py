"""Managed-collision remappers in checkpoints: their buffers, and the window in progress.

A remapper's buffers (sorted kept ids, row mapping, counts, last access, step) are in
the model's state dict under TorchRec's keys; they are the same on every rank, so DCP
writes them once and every rank of any world reads them whole. What the state dict
lacks is the eviction window in progress: the ids seen since the last eviction and
that eviction's step. Without it a resumed run starts a new window (TorchRec's
behaviour after a load) and evicts at other steps, over other ids, than an
uninterrupted one. ``save`` therefore adds one entry per remapper,
``managed_collision.<remapper fqn>.window`` (``MCHManagedCollisionModule.window_state``:
the window merged over every rank, so it does not depend on the world that saved it),
and ``load`` hands it back (``load_window``) after the buffers are in: the run then
continues exactly, under any plan, mesh or world size. A checkpoint without these
entries (written before them, or by TorchRec) loads as TorchRec would.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn

from dtrec.modules.managed_collision import MCHManagedCollisionModule

PREFIX = "managed_collision"


def remappers_of(model: nn.Module) -> dict[str, MCHManagedCollisionModule]:
    """FQN -> every managed-collision remapper of ``model``."""
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, MCHManagedCollisionModule)}


def _key(fqn: str) -> str:
    return f"{PREFIX}.{fqn}.window"


def window_state(model: nn.Module) -> dict[str, Tensor]:
    """Checkpoint key -> each remapper's window (``window_state``). Collective when the
    windows are shared (a distributed model): every rank calls it in the same order."""
    return {_key(fqn): mc.window_state() for fqn, mc in remappers_of(model).items()}


def window_targets(model: nn.Module, directory: Path) -> dict[str, Tensor]:
    """Empty tensors, sized as saved, for the windows the checkpoint at ``directory``
    holds of ``model``'s remappers (none for a checkpoint without them)."""
    remappers = remappers_of(model)
    if not remappers:
        return {}
    saved = dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    out = {}
    for fqn in remappers:
        size = getattr(saved.get(_key(fqn)), "size", None)
        if size is not None:
            out[_key(fqn)] = torch.empty(tuple(size), dtype=torch.int64)
    return out


def load_windows(model: nn.Module, read: dict[str, Tensor]) -> None:
    """Resume each remapper's window from what ``window_targets`` read (after the
    remappers' buffers were loaded)."""
    for fqn, mc in remappers_of(model).items():
        if _key(fqn) in read:
            mc.load_window(read[_key(fqn)])


__all__ = ["load_windows", "remappers_of", "window_state", "window_targets"]
