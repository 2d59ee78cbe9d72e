"""Checkpoints: save and load a distributed model on ``torch.distributed.checkpoint``.

What is saved: the model's state dict (tables as DTensors, so each rank writes only
its blocks, and blocks its replicas also hold are written once), each managed-collision
remapper's eviction window in progress (``dtrec.checkpoint.managed_collision``), the fused
optimizer's state (DTensors placed like their tables) and its param groups' current
hyperparameters (the marker records them: lr, eps, betas and any LR scheduler's keys,
so a resumed run takes the same steps), and optionally a dense torch optimizer.
DCP reshards on load: a checkpoint saved under one plan and mesh loads
under any other plan, world size or into the unsharded model.

Crash safety: ``save(root, ...)`` writes ``root/.ckpt-NNNNNN.partial``, then rank 0
writes ``COMPLETE.json`` (table configs, optimizer, the data files) into it and
renames it to ``root/ckpt-NNNNNN``. A save that dies part-way leaves a ``.partial``
directory that ``load`` never reads; the last complete checkpoint is untouched.
``load`` checks everything (marker, files, tables, shapes, optimizer) before it
reads, reads into staging tensors, and only then copies into the model: on any
error nothing is changed. ``root`` must be on a filesystem all ranks share.

Example::

    dtrec.checkpoint.save("/ckpt", model, optimizer, keep_last=2)
    ...
    dtrec.checkpoint.load("/ckpt", model, optimizer)   # the newest complete one
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from dtrec.checkpoint.agreement import (
    CheckpointError,
    from_rank0,
    on_every_rank,
    rank,
    world_size,
)
from dtrec.checkpoint.managed_collision import load_windows, window_state, window_targets
from dtrec.checkpoint.model_state import (
    OPTIM,
    copy_staged,
    describe,
    fused_optimizer_of,
    model_state,
    staging_copy,
    unflatten,
)
from dtrec.checkpoint.plain import is_plain_dcp, load_plain
from dtrec.sharded.tables.tensor import full_tensor, full_tensors
from dtrec.sharded.update.fused_optimizer import FusedOptimizerView

MARKER = "COMPLETE.json"
FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d{6,})$")


def _check_args(model: object, optimizer: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(optimizer, FusedOptimizerView):
        raise TypeError(
            "optimizer is a model's fused_optimizer: its state and param groups are saved "
            "with the model; pass the dense torch optimizer or None"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be the dense torch.optim.Optimizer or None, got "
            f"{type(optimizer).__name__} (a fused optimizer's state is part of the model's)"
        )


# --------------------------------------------------------------------------- save


def _complete(root: Path) -> list[Path]:
    """Published checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    keep_last: int | None = None,
) -> Path:
    """Write a new checkpoint under the directory ``path``; returns its directory.

    Collective: every rank calls it. Each rank writes only its own blocks (replicas
    along "replicate" are written once). ``optimizer`` is the dense torch optimizer;
    the fused optimizer's state is part of the model's checkpoint. ``keep_last=N``
    deletes all but the newest N complete checkpoints after publishing this one.
    """
    _check_args(model, optimizer)
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
    root = Path(path)
    fused = fused_optimizer_of(model)
    if fused is not None:  # a group a step would reject is not saved either
        fused.check_param_groups(fused.saved_param_groups())
    state = model_state(model, optimizer)
    state.update(window_state(model))  # managed collision: the windows in progress
    described = describe(model, optimizer)

    def prepare() -> tuple[str, str] | BaseException:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".ckpt-*.partial"):  # left by saves that died
                shutil.rmtree(stale, ignore_errors=True)
            done = _complete(root)
            number = int(_NAME.match(done[-1].name).group(1)) + 1 if done else 1
            name = f"ckpt-{number:06d}"
            (root / f".{name}.partial").mkdir()
            return name, f".{name}.partial"
        except Exception as exc:  # noqa: BLE001 - sent to every rank, raised there
            return CheckpointError(f"cannot prepare checkpoint directory {root}: {exc}")

    name, partial = from_rank0(prepare() if rank() == 0 else None)
    staging = root / partial
    on_every_rank(lambda: dcp.save(state, checkpoint_id=staging), "write", staging)

    def publish() -> Path | BaseException:
        try:
            marker = {
                "format": FORMAT,
                "name": name,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "world_size": world_size(),
                "files": sorted(p.name for p in staging.iterdir()),
                **described,
            }
            with open(staging / MARKER, "w") as f:
                json.dump(marker, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(staging)
            final = root / name
            os.rename(staging, final)  # atomic: the checkpoint appears complete or not at all
            _fsync_dir(root)
            if keep_last is not None:
                for old in _complete(root)[:-keep_last]:
                    shutil.rmtree(old)
            return final
        except Exception as exc:  # noqa: BLE001 - sent to every rank, raised there
            return CheckpointError(f"publishing checkpoint {staging} failed: {exc}")

    return from_rank0(publish() if rank() == 0 else None)


# --------------------------------------------------------------------------- load


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory ``path`` names: itself if it is one, else the newest
    complete ``ckpt-*`` under it. CheckpointError saying what is missing otherwise."""
    path = Path(path)
    if (path / MARKER).is_file():
        return path
    if _NAME.match(path.name) or path.name.endswith(".partial"):
        raise CheckpointError(
            f"checkpoint {path} is incomplete: it has no {MARKER} (its save did not finish)"
        )
    done = _complete(path)
    if not done:
        partial = sorted(p.name for p in path.glob(".ckpt-*.partial")) if path.is_dir() else []
        hint = f"; only unfinished saves: {partial}" if partial else ""
        raise CheckpointError(f"no complete checkpoint under {path}{hint}")
    return done[-1]


def read_marker(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's ``COMPLETE.json``, after checking every data file it lists exists."""
    directory = resolve(path)
    with open(directory / MARKER) as f:
        marker = json.load(f)
    missing = [name for name in marker.get("files", []) if not (directory / name).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {directory} is damaged: missing files {missing}")
    return marker


def _check_compatible(
    marker: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    """CheckpointError naming the key and both values for every way the checkpoint does not
    fit the model."""
    saved, mine = marker["tables"], describe(model, optimizer)
    missing = sorted(set(mine["tables"]) - set(saved))
    if missing:
        raise CheckpointError(f"tables {missing} of the model are not in the checkpoint")
    unknown = sorted(set(saved) - set(mine["tables"]))
    if unknown:
        raise CheckpointError(f"checkpoint has tables {unknown} the model does not have")
    for fqn, cfg in mine["tables"].items():
        for field in ("num_embeddings", "embedding_dim", "pooling"):
            if saved[fqn][field] != cfg[field]:
                raise CheckpointError(
                    f"table {fqn!r}: {field} is {cfg[field]!r} in the model but "
                    f"{saved[fqn][field]!r} in the checkpoint"
                )
    want, have = mine["fused_optimizer"], marker["fused_optimizer"]
    if want is not None:
        if have is None:
            raise CheckpointError(
                f"the model's fused optimizer is {want['type']} but the checkpoint has no "
                "fused optimizer state"
            )
        if have["type"] != want["type"]:
            raise CheckpointError(
                f"fused optimizer type: {want['type']} in the model, {have['type']} in the "
                "checkpoint"
            )
        _check_param_groups(model, have)
    if optimizer is not None and marker["optimizer"] != type(optimizer).__name__:
        raise CheckpointError(
            f"optimizer type: {type(optimizer).__name__} given, {marker['optimizer']} in the "
            "checkpoint"
        )


def _check_param_groups(model: nn.Module, saved: dict[str, Any]) -> None:
    """The saved param groups fit the model's fused optimizer (checkpoints written before
    groups were saved have none: the model keeps its own)."""
    fused = fused_optimizer_of(model)
    if fused is None or saved.get("param_groups") is None:
        return
    try:
        fused.check_param_groups(saved["param_groups"])
    except (KeyError, TypeError, ValueError) as exc:
        text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        raise CheckpointError(f"checkpoint's {text}") from None


def _check_shapes(state: dict[str, Any], directory: Path) -> None:
    saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    missing = sorted(k for k, v in state.items() if isinstance(v, Tensor) and k not in saved)
    if missing:
        raise CheckpointError(f"checkpoint {directory} lacks entries {missing[:8]}")
    for key, value in state.items():
        if not isinstance(value, Tensor):
            continue  # DCP stores other objects (param_groups) flattened under other keys
        size = getattr(saved[key], "size", None)
        if size is not None and tuple(size) != tuple(value.shape):
            raise CheckpointError(
                f"{key}: shape {tuple(value.shape)} in the model, {tuple(size)} in the checkpoint"
            )


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    staged: bool = True,
) -> Path:
    """Load a checkpoint into ``model`` (and ``optimizer``), resharding as needed.

    ``path``: a checkpoint directory or a root written by ``save`` (its newest complete
    checkpoint), or a plain DCP directory without dtrec's marker (TorchRec's, or any
    ``dcp.save`` of a model state dict: loaded by key with a warning, model tensors
    only; see ``dtrec.checkpoint.plain``). Works under any plan, mesh or world size,
    and into the unsharded model without a process group. A model without a fused
    optimizer loads the weights only. Collective when distributed. Returns the directory read.

    Everything that can be checked is checked before reading: a checkpoint that is
    missing, incomplete, damaged or not this model's raises CheckpointError naming what
    differs. ``staged=True`` then reads into fresh tensors and copies them in only when
    every rank read its part, so a read error (a corrupt or unreadable file) changes
    nothing; ``staged=False`` reads in place (faster, no extra memory), and such an error
    can leave the model half loaded.
    """
    _check_args(model, optimizer)
    name = Path(path).name
    dtrec_dir = bool(_NAME.match(name)) or name.endswith(".partial")  # ours: never "plain"
    if not dtrec_dir and is_plain_dcp(Path(path), MARKER):  # TorchRec's or a bare dcp.save
        load_plain(Path(path), model, MARKER)
        return Path(path)
    directory = resolve(path)
    marker = read_marker(directory)
    _check_compatible(marker, model, optimizer)
    live = model_state(model, optimizer)
    _check_shapes(live, directory)
    read = {k: staging_copy(v) for k, v in live.items()} if staged else dict(live)
    read.update(window_targets(model, directory))  # managed collision, sized as saved
    on_every_rank(lambda: dcp.load(read, checkpoint_id=directory), "read", directory)
    if staged:  # the dense optimizer's state is set below, from ``read``
        copy_staged({k: v for k, v in live.items() if not k.startswith(f"{OPTIM}.")}, read)
    load_windows(model, read)  # after the remappers' buffers
    fused, saved = fused_optimizer_of(model), marker["fused_optimizer"]
    if fused is not None and saved.get("param_groups") is not None:
        fused.load_param_groups(saved["param_groups"])
    if optimizer is not None:
        like = get_optimizer_state_dict(model, optimizer)
        set_optimizer_state_dict(model, optimizer, unflatten(read, OPTIM, like))
    return directory


# --------------------------------------------------------------------------- export


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The model's state dict as full CPU tensors (tables assembled), on every rank.

    For single-device use: ``unsharded.load_state_dict(full_state_dict(model))``.
    Collective when distributed.
    """
    return to_full_state_dict(model.state_dict())


def to_full_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Any state dict with its DTensors (dtrec) and ShardedTensors (TorchRec's sharded
    modules) assembled into full CPU tensors; other tensors copied to CPU, other values kept.

    What a plain (unsharded) torch or TorchRec model loads: a DTensor state dict loaded
    into one directly fails on ``copy_`` of mixed Tensor / DTensor. Collective: every
    rank calls it with the same keys in the same order.

    Example::

        plain.load_state_dict(dtrec.checkpoint.to_full_state_dict(model.state_dict()))
    """
    keys = [key for key, value in state_dict.items() if isinstance(value, Tensor)]
    fulls = dict(zip(keys, full_tensors([state_dict[k] for k in keys]), strict=True))
    return {key: fulls.get(key, value) for key, value in state_dict.items()}


__all__ = [
    "CheckpointError",
    "full_state_dict",
    "full_tensor",
    "full_tensors",
    "load",
    "read_marker",
    "resolve",
    "save",
    "to_full_state_dict",
]
