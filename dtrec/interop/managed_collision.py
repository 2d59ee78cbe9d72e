"""TorchRec's managed-collision modules as dtrec's (torchrec is never imported).

``torchrec.modules.mc_embedding_modules.ManagedCollisionEmbeddingBagCollection`` (or
``ManagedCollisionEmbeddingCollection``, sequence tables) with its
``ManagedCollisionCollection`` of ``MCHManagedCollisionModule``s becomes dtrec's class of
that name: the same weight ``Parameter``s (no copy),
the remappers' buffers copied (sorted ids, row mapping, counts, last access, step), the
window in progress carried over (ids recorded since the last eviction, the step of
that eviction, rows evicted but not yet consumed), so the converted module continues
exactly where TorchRec's stopped. State-dict keys are the same both ways.

What dtrec does differently, as its own collection does: evicted rows are reset before
their first lookup (TorchRec's sharded module does that, its unsharded one never), to
the table's ``init_fn`` redrawn by a counter-based hash when that is uniform(a, b)
(every TorchRec config's default); and the whole window is recorded (TorchRec keeps
at most 1.25x the first batch's ids per window).

A remapper field dtrec cannot honour (an ``output_global_offset``, TorchRec's own
sharded segments) is a ValueError naming the table and the field.

Example::

    mc_ebc = from_torchrec_mc_collection(torchrec_mc_ebc)   # dtrec's, same weights
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dtrec.interop.modules import (
    from_torchrec_bag_collection,
    from_torchrec_sequence_collection,
    is_torchrec_mc_collection,
)
from dtrec.modules.eviction import as_policy
from dtrec.modules.managed_collision import MCHManagedCollisionModule
from dtrec.modules.mc_collection import (
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    ManagedCollisionLookup,
)

_MCH_MODULE = ("torchrec.modules.mc_modules", "MCHManagedCollisionModule")
_MC_COLLECTION = ("torchrec.modules.mc_modules", "ManagedCollisionCollection")


def _is(module: object, origin: tuple[str, str]) -> bool:
    cls = type(module)
    return (cls.__module__, cls.__qualname__) == origin


def from_torchrec_mch(module: nn.Module, table: str) -> MCHManagedCollisionModule:
    """dtrec's remapper for TorchRec's ``MCHManagedCollisionModule`` of ``table``: same
    policy and knobs, buffers copied, the window in progress carried over."""
    if not _is(module, _MCH_MODULE):
        cls = type(module)
        raise TypeError(
            f"table {table!r}: managed collision module is a {cls.__module__}."
            f"{cls.__qualname__}; dtrec converts torchrec's MCHManagedCollisionModule only"
        )
    given: Any = module
    offset = int(getattr(given, "_output_global_offset", 0))
    if offset != 0:
        raise ValueError(
            f"table {table!r}: TorchRec MCHManagedCollisionModule field output_global_offset="
            f"{offset} is not supported (it is TorchRec's own row-wise shard); give "
            "distribute_module the unsharded module (output_global_offset=0)"
        )
    segments = given._output_segments_tensor
    if segments.numel() < 2 or segments[:2].tolist() != [0, given._zch_size]:
        raise ValueError(
            f"table {table!r}: TorchRec MCHManagedCollisionModule field output_segments="
            f"{[v for v in segments.tolist() if v >= 0]} is not supported (TorchRec's "
            f"sharded segments); give distribute_module the unsharded module"
        )
    device = given._mch_sorted_raw_ids.device
    converted = MCHManagedCollisionModule(
        given._zch_size,
        device,
        eviction_policy=as_policy(given._eviction_policy),
        eviction_interval=given._eviction_interval,
        input_hash_size=given._input_hash_size,
        input_hash_func=given._input_hash_func,
        name=given._name or table,
    )
    state = {k: v for k, v in module.state_dict().items() if k != "_output_segments_tensor"}
    missing = set(converted.state_dict()) - set(state) - {"_output_segments_tensor"}
    if missing:
        raise ValueError(
            f"table {table!r}: TorchRec MCHManagedCollisionModule lacks buffers "
            f"{sorted(missing)} its eviction policy needs"
        )
    converted.load_state_dict(state, strict=False)
    converted.train(module.training)
    if given._current_iter != -1:  # stepped: carry its window over
        converted._resume(
            given._current_iter,
            given._last_eviction_iter,
            _history(given),
            None,
            given._evicted_emb_indices.to(torch.int64).clone() if given._evicted else None,
        )
    return converted


def _history(module: Any) -> list[tuple[Tensor, int]]:
    """TorchRec's window buffer as dtrec's (ids, step) entries."""
    used = int(module._current_history_buffer_offset)
    if used == 0:
        return []
    ids = module._history_accumulator[:used].clone()
    steps = getattr(module, "_history_last_access_iter", None)
    if steps is None:  # LFU keeps no steps, and needs none
        return [(ids, int(module._current_iter))]
    steps = steps[:used]
    return [(ids[steps == s], int(s)) for s in torch.unique(steps).tolist()]


def from_torchrec_mc_collection(module: nn.Module) -> ManagedCollisionLookup:
    """dtrec's ``ManagedCollisionEmbeddingBagCollection`` (``...EmbeddingCollection``) for
    TorchRec's: the weight ``Parameter``s shared, each table's remapper converted
    (``from_torchrec_mch``).

    Example::

        mc_ebc = from_torchrec_mc_collection(torchrec_mc_ebc)
        pooled, remapped = mc_ebc(kjt)
    """
    if not is_torchrec_mc_collection(module):
        cls = type(module)
        raise TypeError(
            "expected a torchrec ManagedCollisionEmbeddingBagCollection or "
            f"ManagedCollisionEmbeddingCollection, got {cls.__module__}.{cls.__qualname__}"
        )
    given: Any = module
    collection = given._managed_collision_collection
    if not _is(collection, _MC_COLLECTION):
        cls = type(collection)
        raise TypeError(
            f"its _managed_collision_collection is a {cls.__module__}.{cls.__qualname__}; "
            "dtrec converts torchrec's ManagedCollisionCollection only"
        )
    configs = list(collection.embedding_configs())
    remappers = {
        name: from_torchrec_mch(mc, name)
        for name, mc in collection._managed_collision_modules.items()
    }
    pooled = type(module).__qualname__ == "ManagedCollisionEmbeddingBagCollection"
    kind = ManagedCollisionEmbeddingBagCollection if pooled else ManagedCollisionEmbeddingCollection
    convert = from_torchrec_bag_collection if pooled else from_torchrec_sequence_collection
    converted = kind(
        convert(given._embedding_module),
        ManagedCollisionCollection(remappers, configs),
        return_remapped_features=bool(given._return_remapped_features),
    )
    converted.train(module.training)
    return converted


__all__ = [
    "from_torchrec_mc_collection",
    "from_torchrec_mch",
]
