"""Checkpoints of distributed (and unsharded) models: DCP save / load with resharding.

Example::

    dtrec.checkpoint.save("ckpt/step_100", model, optimizer)
    dtrec.checkpoint.load("ckpt/step_100", model, optimizer)  # any plan, any world size
"""

from dtrec.checkpoint.dcp import (
    CheckpointError,
    full_state_dict,
    full_tensor,
    full_tensors,
    load,
    read_marker,
    resolve,
    save,
    to_full_state_dict,
)
from dtrec.checkpoint.torchrec_state import fused_state_from_torchrec, fused_state_into_torchrec

__all__ = [
    "CheckpointError",
    "full_state_dict",
    "fused_state_from_torchrec",
    "fused_state_into_torchrec",
    "full_tensor",
    "full_tensors",
    "load",
    "read_marker",
    "resolve",
    "save",
    "to_full_state_dict",
]
