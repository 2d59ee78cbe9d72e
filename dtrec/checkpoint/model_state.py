"""What a checkpoint holds of a model: its tensors under flat keys, and the description
its marker records (tables, fused optimizer, dense optimizer) that ``load`` compares."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from dtrec.modules.config import EmbeddingBagConfig
from dtrec.planning.plan import collection_configs, table_fqn
from dtrec.sharded.tables.tensor import like_dtensor
from dtrec.sharded.update.fused_optimizer import FusedOptimizerView

MODEL, FUSED, OPTIM = "model", "fused_optimizer", "optimizer"
"""Key prefixes: the model's state dict, the fused optimizer's state, the dense optimizer."""


def collections_of(model: nn.Module) -> dict[str, nn.Module]:
    """FQN -> each (sharded or unsharded) embedding-bag or sequence collection of ``model``."""
    from dtrec.modules import EmbeddingBagCollection, EmbeddingCollection
    from dtrec.sharded.collection import ShardedCollection

    kinds = (EmbeddingBagCollection, EmbeddingCollection, ShardedCollection)
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, kinds)}


def tables_of(model: nn.Module) -> dict[str, EmbeddingBagConfig]:
    return {
        table_fqn(fqn, cfg.name): cfg
        for fqn, ebc in collections_of(model).items()
        for cfg in collection_configs(ebc)
    }


def fused_optimizer_of(model: nn.Module) -> FusedOptimizerView | None:
    return getattr(model, "fused_optimizer", None)


def holds(value: Tensor) -> bool:
    """False for a DTensor on a sub-mesh this rank is not in (a table-wise table elsewhere)."""
    return not isinstance(value, DTensor) or value.device_mesh.get_coordinate() is not None


def model_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The live tensors a checkpoint holds, flat keys; loading into them writes the model."""
    state: dict[str, Any] = {f"{MODEL}.{k}": v for k, v in model.state_dict().items() if holds(v)}
    fused = fused_optimizer_of(model)
    if fused is not None:
        blocks = fused.blocks()  # ranks without a block keep an empty, unused state
        for table, entries in fused.state_dict()["state"].items():
            for name, value in entries.items():
                if holds(value) and blocks[table] is not None:
                    state[f"{FUSED}.{table}.{name}"] = value
    if optimizer is not None:
        dense = get_optimizer_state_dict(model, optimizer)
        state.update(flatten(dense, OPTIM))
    return state


def flatten(tree: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def unflatten(flat: Mapping[str, Any], prefix: str, like: Mapping[str, Any]) -> dict:
    """Rebuild the nested structure of ``like`` from ``flat`` keys under ``prefix``."""
    out: dict[str, Any] = {}
    for k, v in like.items():
        key = f"{prefix}.{k}"
        out[k] = unflatten(flat, key, v) if isinstance(v, Mapping) else flat[key]
    return out


def describe(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What the marker records about the saved model, and what ``load`` compares."""
    fused = fused_optimizer_of(model)
    config = None
    if fused is not None:
        opt = fused.optimizer
        config = {
            "type": type(opt).__name__,
            "config": jsonable(vars(opt)),
            "param_groups": [jsonable(group) for group in fused.saved_param_groups()],
        }
    return {
        "tables": {
            fqn: {
                "num_embeddings": cfg.num_embeddings,
                "embedding_dim": cfg.embedding_dim,
                "pooling": getattr(cfg, "pooling", "none"),  # "none": a sequence table
                "feature_names": list(cfg.feature_names),
            }
            for fqn, cfg in tables_of(model).items()
        },
        "fused_optimizer": config,
        "optimizer": None if optimizer is None else type(optimizer).__name__,
    }


def jsonable(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


def staging_copy(value: Any) -> Any:
    """A fresh tensor shaped and placed like ``value`` for DCP to read into."""
    if isinstance(value, DTensor):
        return like_dtensor(torch.empty_like(value.to_local()), value)
    if isinstance(value, Tensor):
        return torch.empty_like(value)
    return value


def copy_staged(targets: Mapping[str, Tensor], sources: Mapping[str, Tensor]) -> None:
    """Copy each staged ``sources[key]`` into the live ``targets[key]`` (local parts of
    DTensors), once every rank has read its part."""
    with torch.no_grad():
        for key, value in targets.items():
            target = value.to_local() if isinstance(value, DTensor) else value
            source = sources[key]
            target.copy_(source.to_local() if isinstance(source, DTensor) else source)
