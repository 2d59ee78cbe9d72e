"""Distributing managed-collision collections: where the remap runs, and why.

Each rank remaps its own batch with a full copy of every table's remapper (one
``searchsorted`` on the raw ids, no communication), then the remapped ids take
the table's input dist once, as any batch does. Eviction decisions must be the
ones the unsharded module makes on the global batch, the same on every shard and
replica rank: at an eviction step (every ``eviction_interval`` steps, off the hot
path) each rank all-gathers its window summary (unique ids, counts, last access)
over the world, decides for the raw ids of its range, and the ranks exchange their
decisions (``dtrec.modules.split_eviction``), so every rank applies the same
eviction. Every rank then knows the global list of evicted rows and resets those
it holds (weights and fused optimizer state), as the unsharded table would.

Remapping after the input dist on the owner of a raw-id range (TorchRec's way)
makes each shard a remapper of ``zch_size / S`` rows with its own competition: a
different model for every shard count, and ``zch_size`` must divide (TorchRec
#1591). The cost here: every rank holds each remapper (about 24-32 bytes per row,
next to a row-wise shard's ``4 * dim / S``), and an eviction step gathers the
window's unique ids from every rank.

TorchRec's ``ManagedCollisionEmbeddingBagCollection`` is converted to dtrec's first
(``adopt_torchrec_collections``): same weights, remapper state and state-dict keys.

A managed-collision table may be ``RowWise`` (unnamed tables are pinned to it),
``TableWise``, ``ColumnWise``, ``DataParallel``, ``TableRowWise`` or ``Grid``. What is
not supported raises: another (user-defined) type, an offloaded or fully sharded spec,
``same_batch``, a TorchRec ``ShardingPlan``, and TorchRec ``init_fn`` tables (their
reset draws from each rank's own generator). Tables trained by a torch optimizer (no
fused one) reset their evicted rows' state in an eviction hook:
``reset_torch_optimizer_rows`` zeroes the rows each rank's block holds.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed import ProcessGroup

from dtrec.interop.managed_collision import from_torchrec_mc_collection
from dtrec.interop.modules import is_torchrec_mc_collection
from dtrec.modules.mc_collection import ManagedCollisionLookup
from dtrec.placements import (
    ColumnWise,
    DataParallel,
    Grid,
    RowWise,
    TableRowWise,
    TableSpec,
    TableWise,
)
from dtrec.planning.plan import collection_configs

INNER = "_embedding_module"
"""Where a managed-collision collection keeps its EmbeddingBagCollection (TorchRec's
attribute): its tables' plan keys are ``<fqn>._embedding_module.<table>``."""


def adopt_torchrec_collections(model: nn.Module) -> nn.Module:
    """``model`` with every TorchRec ``ManagedCollisionEmbeddingBagCollection`` replaced, in
    place, by dtrec's over the same weights and remapper state
    (``dtrec.interop.managed_collision``); the converted module itself when ``model`` is
    one. State-dict keys do not change."""
    if not isinstance(model, nn.Module):
        return model  # find_collections says what is wrong
    targets = [fqn for fqn, m in model.named_modules() if is_torchrec_mc_collection(m)]
    for fqn in targets:
        converted = from_torchrec_mc_collection(model.get_submodule(fqn))
        if not fqn:
            return converted
        parent, _, attr = fqn.rpartition(".")
        setattr(model.get_submodule(parent), attr, converted)
    return model


def remapped_collections(model: nn.Module) -> dict[str, ManagedCollisionLookup]:
    """FQN -> every managed-collision collection (pooled or sequence) in ``model``."""
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, ManagedCollisionLookup)}


def inner_fqn(fqn: str) -> str:
    """The FQN of the EmbeddingBagCollection inside the collection at ``fqn``."""
    return f"{fqn}.{INNER}" if fqn else INNER


MC_SPECS = (RowWise, TableWise, ColumnWise, DataParallel, TableRowWise, Grid)
"""The types a managed-collision table may take: each rank remaps its own batch, so the
remapped ids take any of their input dists (or none: a data-parallel table looks its own
batch up), and every rank resets the evicted rows of the block it holds (rows, columns or
both; the whole table on every rank when replicated; ``reset_rows_init`` hashes each
element alone, so every holder of an element draws the same value)."""


def _mc_spec_unsupported(spec: TableSpec) -> str | None:
    """Why ``spec`` cannot hold a managed-collision table (None: it can)."""
    if not isinstance(spec, MC_SPECS):
        names = ", ".join(f"{t.__name__}()" for t in MC_SPECS)
        return f"only {names} are supported"
    if getattr(spec, "cache_rows", None) is not None or getattr(spec, "cache_fraction", None):
        return (
            "offloaded tables (cache_rows / cache_fraction) are not supported: evicted rows "
            "would have to be reset in the host block and in the device cache"
        )
    if getattr(spec, "fully_sharded", False):
        return (
            "fully sharded 2D (fully_sharded=True) is not supported: evicted rows would have "
            "to be reset in each replica's owner slice"
        )
    return None


def pin_row_wise(
    plan: Mapping[str, TableSpec] | None,
    collections: Mapping[str, ManagedCollisionLookup],
    same_batch: object,
) -> dict[str, TableSpec] | None:
    """``plan`` with every managed-collision table the plan omits row-wise; ValueError for
    what is not supported (module docstring), naming the table or collection."""
    if not collections:
        return None if plan is None else dict(plan)
    if plan is not None and not isinstance(plan, Mapping):
        raise ValueError(
            "a TorchRec ShardingPlan for a model with managed-collision collections is not "
            "supported; give a dtrec plan {'<fqn>._embedding_module.<table>': RowWise()}"
        )
    if same_batch is not None:
        raise ValueError(
            f"managed-collision collections {sorted(collections)} do not support same_batch yet"
        )
    pinned = dict(plan or {})
    for fqn, mc in collections.items():
        inner = inner_fqn(fqn)
        drawn = mc.tables_with_init_fn()
        if drawn:
            raise ValueError(
                f"managed-collision tables {drawn} of {fqn!r} have a TorchRec init_fn: evicted "
                "rows would be reset from each rank's own generator; use dtrec configs"
            )
        for cfg in collection_configs(mc._embedding_module):
            key = f"{inner}.{cfg.name}"
            spec = pinned.setdefault(key, RowWise())
            why = _mc_spec_unsupported(spec)
            if why is not None:
                raise ValueError(f"managed-collision table {key!r}: {why}, got {spec!r}")
    return pinned


def share_windows(
    collections: Mapping[str, ManagedCollisionLookup], group: ProcessGroup | None
) -> None:
    """Every remapper evicts over the whole world's window (``group``: the world, or a
    pipeline stage's ranks)."""
    for mc in collections.values():
        mc.share_windows(group)


__all__ = [
    "adopt_torchrec_collections",
    "inner_fqn",
    "pin_row_wise",
    "remapped_collections",
    "share_windows",
]
