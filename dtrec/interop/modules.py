"""TorchRec's sparse modules, recognised by their class (torchrec is never imported).

``torchrec.EmbeddingBagCollection`` (weighted or not) becomes dtrec's
``EmbeddingBagCollection`` over the same weight tensors (inside a
``FeatureProcessedEmbeddingBagCollection`` too: its position weights stay dense),
``torchrec.EmbeddingCollection`` dtrec's ``EmbeddingCollection``, TorchRec's
``ManagedCollisionEmbedding(Bag)Collection`` dtrec's (``dtrec.interop.managed_collision``,
which also reports its unsupported remapper fields); every other module
whose class comes from TorchRec's sparse code (managed-collision,
quantized or fused collections, modules TorchRec already sharded) is an error naming
its FQN, its type and what to do, so no table is ever left silently replicated.
"""

from __future__ import annotations

from torch import nn

from dtrec.modules import EmbeddingBagCollection, EmbeddingCollection

_DENSE_TORCHREC_MODULES = (
    "torchrec.modules.activation",
    "torchrec.modules.crossnet",
    "torchrec.modules.deepfm",
    "torchrec.modules.feature_processor_",
    "torchrec.modules.fp_embedding_modules",
    "torchrec.modules.lazy_extension",
    "torchrec.modules.mlp",
    "torchrec.modules.regroup",
    "torchrec.modules.utils",
    "torchrec.types",
    "torchrec.models",
)
"""TorchRec modules without tables (dense layers, models composing others, feature
processors and the feature-processed collection around an ``EmbeddingBagCollection``):
left as they are; their children are looked at one by one."""

_BAG_COLLECTION = ("torchrec.modules.embedding_modules", "EmbeddingBagCollection")
_MC_COLLECTIONS = (
    ("torchrec.modules.mc_embedding_modules", "ManagedCollisionEmbeddingBagCollection"),
    ("torchrec.modules.mc_embedding_modules", "ManagedCollisionEmbeddingCollection"),
)
_SEQUENCE_COLLECTION = ("torchrec.modules.embedding_modules", "EmbeddingCollection")

_ADVICE = {
    "ManagedCollisionCollection": (
        "distribute_module takes TorchRec's managed-collision remappers only inside a "
        "ManagedCollisionEmbedding(Bag)Collection (converted, its remap run on every rank)"
    ),
    "MCHManagedCollisionModule": (
        "distribute_module takes TorchRec's managed-collision remappers only inside a "
        "ManagedCollisionEmbedding(Bag)Collection (converted, its remap run on every rank)"
    ),
    "torchrec.modules.mc_": (
        "of TorchRec's managed-collision modules dtrec converts ManagedCollisionEmbedding"
        "(Bag)Collection with MCHManagedCollisionModule remappers only"
    ),
    "torchrec.modules.hash_mc_": (
        "TorchRec's hash-probing ZCH modules are not supported; use MCHManagedCollisionModule "
        "remappers in a ManagedCollisionEmbedding(Bag)Collection, or remap ids before the model"
    ),
    "torchrec.quant": "dtrec trains float tables; distribute the float model, quantize after",
    "torchrec.modules.fused_embedding_modules": (
        "use torchrec.EmbeddingBagCollection and pass the optimizer to distribute_module "
        "(e.g. optimizer=dtrec.optim.RowWiseAdagrad(lr=...)): dtrec fuses it into backward"
    ),
    "torchrec.distributed": (
        "the module is already sharded by TorchRec; give distribute_module the unsharded model"
    ),
}
"""Class name or module prefix -> what to do instead."""


def _origin(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _torchrec_sparse_class(module: nn.Module) -> type | None:
    """The first class in ``module``'s MRO that is TorchRec sparse code, or None."""
    for cls in type(module).__mro__:
        name = cls.__module__
        if name.split(".")[0] != "torchrec":
            continue
        if any(name == d or name.startswith(d + ".") for d in _DENSE_TORCHREC_MODULES):
            continue
        return cls
    return None


def is_torchrec_bag_collection(module: nn.Module) -> bool:
    """Exactly TorchRec's ``EmbeddingBagCollection`` (a subclass may change its forward,
    so it is not converted: ``unsupported_module`` reports it)."""
    cls = type(module)
    return (cls.__module__, cls.__qualname__) == _BAG_COLLECTION


def is_torchrec_sequence_collection(module: nn.Module) -> bool:
    """Exactly TorchRec's ``EmbeddingCollection`` (not a subclass, as for bags)."""
    cls = type(module)
    return (cls.__module__, cls.__qualname__) == _SEQUENCE_COLLECTION


def is_torchrec_mc_collection(module: nn.Module) -> bool:
    """Exactly TorchRec's ``ManagedCollisionEmbeddingBagCollection`` or
    ``ManagedCollisionEmbeddingCollection`` (not a subclass): converted by
    ``dtrec.interop.managed_collision``."""
    cls = type(module)
    return (cls.__module__, cls.__qualname__) in _MC_COLLECTIONS


def unsupported_module(fqn: str, module: nn.Module) -> TypeError | None:
    """The error for a TorchRec sparse module dtrec cannot shard; None for any other
    module (dtrec's own, TorchRec's ``EmbeddingBagCollection``, ``EmbeddingCollection``
    and ``ManagedCollisionEmbeddingBagCollection``, dense layers)."""
    if (
        is_torchrec_bag_collection(module)
        or is_torchrec_sequence_collection(module)
        or is_torchrec_mc_collection(module)
    ):
        return None
    found = _torchrec_sparse_class(module)
    if found is None:
        return None
    advice = _ADVICE.get(found.__qualname__)
    if advice is None:
        advice = next(
            (text for prefix, text in _ADVICE.items() if found.__module__.startswith(prefix)),
            None,
        )
    if advice is None and (found.__module__, found.__qualname__) == _BAG_COLLECTION:
        advice = (
            "it subclasses torchrec.EmbeddingBagCollection, whose forward dtrec cannot know; "
            "use torchrec.EmbeddingBagCollection itself or dtrec.EmbeddingBagCollection"
        )
    if advice is None and (found.__module__, found.__qualname__) == _SEQUENCE_COLLECTION:
        advice = (
            "it subclasses torchrec.EmbeddingCollection, whose forward dtrec cannot know; "
            "use torchrec.EmbeddingCollection itself or dtrec.EmbeddingCollection"
        )
    if advice is None:
        advice = (
            "dtrec shards torchrec.EmbeddingBagCollection and dtrec.EmbeddingBagCollection "
            "only; keep this module out of the model given to distribute_module"
        )
    where = repr(fqn) if fqn else "the model itself"
    kind = _origin(type(module))
    via = "" if found is type(module) else f" (a subclass of {_origin(found)})"
    return TypeError(
        f"module {where} is a {kind}{via}, a TorchRec sparse module dtrec cannot shard and "
        f"will not leave silently replicated: {advice}"
    )


def from_torchrec_bag_collection(module: nn.Module) -> EmbeddingBagCollection:
    """dtrec's ``EmbeddingBagCollection`` for a TorchRec one, holding the same weight
    ``Parameter``s (no copy): same tables, features, pooling, dtype and ``is_weighted``.

    Example::

        ebc = from_torchrec_bag_collection(torchrec.EmbeddingBagCollection(tables))
    """
    if not is_torchrec_bag_collection(module):
        raise TypeError(f"expected a torchrec.EmbeddingBagCollection, got {_origin(type(module))}")
    configs = module.embedding_bag_configs()
    converted = EmbeddingBagCollection(
        configs, device="meta", is_weighted=bool(module.is_weighted())
    )
    for cfg in converted.embedding_bag_configs():
        source = module.embedding_bags[cfg.name]
        if tuple(source.weight.shape) != (cfg.num_embeddings, cfg.embedding_dim):
            raise ValueError(
                f"table {cfg.name!r}: weight has shape {tuple(source.weight.shape)}, its "
                f"config says ({cfg.num_embeddings}, {cfg.embedding_dim})"
            )
        converted.embedding_bags[cfg.name].weight = source.weight
    converted.train(module.training)
    return converted


def from_torchrec_sequence_collection(module: nn.Module) -> EmbeddingCollection:
    """dtrec's ``EmbeddingCollection`` for a TorchRec one, holding the same weight
    ``Parameter``s (no copy): same tables, features, dtype and ``need_indices``."""
    if not is_torchrec_sequence_collection(module):
        raise TypeError(f"expected a torchrec.EmbeddingCollection, got {_origin(type(module))}")
    converted = EmbeddingCollection(
        module.embedding_configs(), device="meta", need_indices=bool(module.need_indices())
    )
    for cfg in converted.embedding_configs():
        source = module.embeddings[cfg.name]
        if tuple(source.weight.shape) != (cfg.num_embeddings, cfg.embedding_dim):
            raise ValueError(
                f"table {cfg.name!r}: weight has shape {tuple(source.weight.shape)}, its "
                f"config says ({cfg.num_embeddings}, {cfg.embedding_dim})"
            )
        converted.embeddings[cfg.name].weight = source.weight
    converted.train(module.training)
    return converted
