"""Loading DCP directories dtrec did not write: TorchRec's, or any ``dcp.save`` of a
model's state dict.

Such a directory has DCP's ``.metadata`` but no ``COMPLETE.json``: nothing records
the tables, the optimizer or which save finished, so ``dtrec.checkpoint.load`` warns and
loads the model's tensors by key (DCP reshards them: a TorchRec row-wise table loads
into a dtrec column-wise one). Keys may be the model's own (``dcp.save(model.
state_dict())``, TorchRec's habit) or dtrec's ``model.``-prefixed ones. Fused
optimizer state and the dense optimizer are not read from such a directory.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader

from dtrec.checkpoint.agreement import CheckpointError, on_every_rank
from dtrec.checkpoint.model_state import copy_staged, staging_copy

DCP_METADATA = ".metadata"


def is_plain_dcp(path: Path, marker: str) -> bool:
    """A DCP directory (``.metadata``) without dtrec's marker."""
    return (path / DCP_METADATA).is_file() and not (path / marker).is_file()


def load_plain(directory: Path, model: nn.Module, marker: str) -> None:
    """Read ``model``'s tensors from a plain DCP directory, staged: nothing changes unless
    every rank read its part. CheckpointError naming the missing keys or a shape that
    differs. Collective when distributed."""
    warnings.warn(
        f"{directory} has no {marker}: a plain DCP checkpoint (e.g. TorchRec's); loading the "
        "model's tensors by key, without dtrec's checks of tables and optimizer, and without "
        "fused or dense optimizer state",
        UserWarning,
        stacklevel=3,
    )
    saved = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    live = {k: v for k, v in model.state_dict().items() if isinstance(v, Tensor)}
    prefix = "" if all(k in saved for k in live) else "model."
    missing = sorted(k for k in live if prefix + k not in saved)
    if missing:
        raise CheckpointError(
            f"{directory}: the plain DCP checkpoint lacks {len(missing)} of the model's keys, "
            f"e.g. {missing[:5]}; it holds e.g. {sorted(saved)[:5]}"
        )
    for key, value in live.items():
        size = getattr(saved[prefix + key], "size", None)
        if size is not None and tuple(size) != tuple(value.shape):
            raise CheckpointError(
                f"{directory}: {key} has shape {tuple(size)} in the checkpoint, "
                f"{tuple(value.shape)} in the model"
            )
    staging = {prefix + k: staging_copy(v) for k, v in live.items()}
    on_every_rank(lambda: dcp.load(staging, checkpoint_id=directory), "read", directory)
    copy_staged(live, {k: staging[prefix + k] for k in live})
