"""Fused optimizer state between TorchRec and dtrec, both ways.

TorchRec keeps a sharded model's fused (FBGEMM) optimizer state as
``{"state": {"<collection>.embedding_bags.<table>.weight": {"<table>.momentum1": ...}}}``:
``momentum1`` is row-wise Adagrad's per-row accumulator (dtrec's ``sum``: the same
EXACT_ROWWISE_ADAGRAD mean of squared gradients) or Adam's first moment
(``exp_avg``), ``momentum2`` Adam's second (``exp_avg_sq``); values are
``ShardedTensor``s (or plain tensors). dtrec keeps ``{"state": {"<collection>.<table>":
{entry: DTensor}}, "param_groups": [...]}``. Both functions are collective (the
shards of every table are assembled); nothing imports torchrec.

Example::

    model.fused_optimizer.load_state_dict(
        dtrec.checkpoint.fused_state_from_torchrec(model, dmp.fused_optimizer.state_dict()))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dtrec._torch_compat import is_sharded_tensor, shard_index
from dtrec.checkpoint.agreement import CheckpointError
from dtrec.sharded.tables.tensor import full_tensor

# dtrec state entry -> TorchRec's suffix, per fused rule
TORCHREC_ENTRIES: dict[str, dict[str, str]] = {
    "SGD": {},
    "RowWiseAdagrad": {"sum": "momentum1"},
    "Adam": {"exp_avg": "momentum1", "exp_avg_sq": "momentum2"},
}


def _entries(model: nn.Module) -> tuple[Any, dict[str, str]]:
    fused = getattr(model, "fused_optimizer", None)
    if fused is None:
        raise TypeError("the model has no fused optimizer (distribute it with optimizer=...)")
    rule = type(fused.optimizer).__name__
    if rule not in TORCHREC_ENTRIES:
        raise TypeError(f"no TorchRec layout known for the fused optimizer {rule}")
    return fused, TORCHREC_ENTRIES[rule]


def _torchrec_key(table_fqn: str) -> tuple[str, str]:
    """dtrec's table FQN -> (TorchRec's parameter key, the table name)."""
    collection, _, table = table_fqn.rpartition(".")
    prefix = f"{collection}." if collection else ""
    return f"{prefix}embedding_bags.{table}.weight", table


def fused_state_from_torchrec(model: nn.Module, torchrec_state: Mapping[str, Any]) -> dict:
    """TorchRec's fused optimizer ``state_dict()`` as the input of
    ``model.fused_optimizer.load_state_dict`` (dtrec's current param groups kept).

    CheckpointError naming the table and entry TorchRec's state lacks. Entries dtrec has
    and TorchRec does not store (Adam's step count) keep their current value.
    """
    fused, names = _entries(model)
    theirs = torchrec_state.get("state", torchrec_state)
    mine = fused.state_dict()
    held = {(k, e) for k, entries in theirs.items() for e in entries}
    everywhere = [held]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everywhere = [None] * dist.get_world_size()
        dist.all_gather_object(everywhere, held)  # TorchRec keeps a table-wise state on its owner
    anywhere = set().union(*everywhere)
    state: dict[str, dict[str, Any]] = {}
    for table_fqn, entries in mine["state"].items():
        key, table = _torchrec_key(table_fqn)
        state[table_fqn] = {}
        for entry, current in entries.items():
            if entry not in names:
                state[table_fqn][entry] = current
                continue
            wanted = f"{table}.{names[entry]}"
            if (key, wanted) not in anywhere:
                raise CheckpointError(
                    f"TorchRec optimizer state has no {key!r}: {wanted!r} on any rank (dtrec's "
                    f"{table_fqn!r} {entry!r}); it holds e.g. {sorted(anywhere)[:4]}"
                )
            local = theirs.get(key, {}).get(wanted)
            shape = tuple(current.shape)
            if local is not None and tuple(local.size()) != shape:
                raise CheckpointError(
                    f"{key!r} {wanted!r}: TorchRec's state has shape {tuple(local.size())}, "
                    f"dtrec's {table_fqn!r} {entry!r} {shape} (TorchRec's column-wise row-wise "
                    "Adagrad keeps an accumulator per column shard; dtrec's is exact over the "
                    "whole row: not convertible)"
                )
            state[table_fqn][entry] = _assemble(local, shape)
    return {"state": state, "param_groups": mine["param_groups"]}


def _assemble(value: Tensor | None, shape: tuple[int, ...]) -> Tensor:
    """A TorchRec state tensor as a full CPU tensor on every rank, whichever ranks hold
    parts of it (a table-wise state lives on its owner only; a 2D model's replicas hold
    the same parts: their sum is divided by how many held each element). Collective
    over the world: every rank calls it for every (table, entry) in the same order."""
    total = torch.zeros(shape, dtype=torch.float32)
    count = torch.zeros(shape, dtype=torch.float32)
    shards = value.local_shards() if value is not None and is_sharded_tensor(value) else None
    if shards is not None:
        for shard in shards:
            index = shard_index(shard)
            total[index] += shard.tensor.detach().cpu().float()
            count[index] += 1
    elif value is not None:
        total += value.detach().cpu().float()
        count += 1
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
        dist.all_reduce(count)
    return total / count.clamp(min=1)


def fused_state_into_torchrec(model: nn.Module, torchrec_state: Mapping[str, Any]) -> None:
    """Write dtrec's fused optimizer state into TorchRec's ``state_dict()`` in place (each
    ShardedTensor's local shards, or plain tensors), ready for TorchRec's
    ``fused_optimizer.load_state_dict``. A table whose state TorchRec keeps on other ranks
    only is skipped here (its owner writes it); CheckpointError for a shape that differs."""
    fused, names = _entries(model)
    theirs = torchrec_state.get("state", torchrec_state)
    for table_fqn, entries in fused.state_dict()["state"].items():
        key, table = _torchrec_key(table_fqn)
        for entry, value in entries.items():
            if entry not in names:
                continue
            wanted = f"{table}.{names[entry]}"
            full = full_tensor(value)  # collective: every rank, every table, in order
            target = theirs.get(key, {}).get(wanted)
            if target is None:  # TorchRec keeps this table's state on other ranks only
                continue
            if tuple(full.shape) != tuple(target.size()):
                raise CheckpointError(
                    f"{table_fqn}.{entry}: dtrec's shape {tuple(full.shape)} vs TorchRec's "
                    f"{wanted} {tuple(target.size())}"
                )
            _fill(target, full)


def _fill(target: Tensor, full: Tensor) -> None:
    """Copy ``full``'s parts into ``target`` (a ShardedTensor's local shards, or itself)."""
    with torch.no_grad():
        if not is_sharded_tensor(target):
            target.copy_(full)
            return
        for shard in target.local_shards():
            shard.tensor.copy_(full[shard_index(shard)])
