"""``dtrec.reshard``: move a distributed model's tables to a new plan, in place.

The alternative is a checkpoint round trip (save, distribute again, load), where every
byte of every table passes through storage twice. Here each changed collection is built
again aside on the new specs (its blocks left uninitialised), filled from the old
blocks (``moves``: only cells whose owner changes travel; ``exchange``: all-to-all
rounds over the shard axis), and only then swapped in: a failure before the swap
(a refused plan, a collective error) leaves the model as it was. The swap keeps every
object a user holds: the collection module itself (its new state moved into it), the
model's ``fused_optimizer`` and its param group dicts (so LR schedulers keep driving it).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from dtrec._torch_compat import local_block
from dtrec.comm.collectives import all_reduce
from dtrec.placements import Grid, TableLayout, TableRowWise, TableSpec
from dtrec.placements.layout import Block
from dtrec.placements.mesh import SHARD, mesh_device, shard_axis, shard_position, world_group
from dtrec.planning.plan import ShardingPlan, table_fqn
from dtrec.sharded.collection import ShardedCollection
from dtrec.sharded.module import ShardedEmbeddingBagCollection
from dtrec.sharded.reshard.exchange import CHUNK_BYTES, Locals, move
from dtrec.sharded.reshard.moves import Piece, entry_moves

SCALARS_KIND = "reshard.scalars"
"""The ``dtrec.comm_stats`` kind of the per-table scalar state (Adam's step) agreed on."""

_KEPT = (
    "training",
    "_dtrec_state",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_is_full_backward_hook",
)
"""A resharded collection's attributes that stay its own: the user's hooks, mode, and the
distribution state of a model that is the collection itself."""


def reshard(
    model: nn.Module, plan: Mapping[str, TableSpec], chunk_bytes: int = CHUNK_BYTES
) -> nn.Module:
    """Move the tables of a ``distribute_module`` model to the specs of ``plan``, in place.

    ``plan`` maps table FQNs (``"<collection fqn>.<table>"``, as in ``model.sharding_plan``)
    to their new spec; tables it omits keep theirs. Weights and fused optimizer state
    (SGD, RowWiseAdagrad's sums, Adam's moments and step) move to their new owners:
    only rows (of a column block: row parts) whose owner changes are sent, with
    all-to-alls over the "shard" axis in rounds of at most ``chunk_bytes`` per rank,
    counted by ``dtrec.comm_stats`` as ``"reshard.rows"`` (Adam's per-table step: one
    small all-reduce, ``"reshard.scalars"``). Peak extra memory per rank: the new blocks
    and state of the collections that change, plus two round buffers. Training then
    continues exactly as on a model distributed to the new plan with the same weights
    and state; ``model.sharding_plan`` is the new plan and ``model.fused_optimizer``
    keeps its param groups (LR schedulers keep working).

    Supported: data-parallel, table-wise, row-wise and column-wise tables of
    ``EmbeddingBagCollection``s with a fused optimizer, any of them to any other, on 1-D
    and 2-D meshes. Refused with a ValueError naming the table, before anything moves:
    table-row-wise and grid specs, offloaded tables, sequence collections, tables
    trained by a torch optimizer (no fused optimizer), ``same_batch`` collections, a
    prefetched batch not consumed yet, a gradient accumulation in progress; and any spec
    that does not fit the mesh (``TableWise(rank=None)``: give the rank). Collective:
    every rank calls it with the same plan (checked: ranks that disagree all raise).

    Example::

        model = dtrec.distribute_module(model, mesh, {"sparse.t0": TableWise(rank=0)},
                                        optimizer=dtrec.optim.Adam(lr=0.01))
        ...  # train
        dtrec.reshard(model, {"sparse.t0": RowWise()})
        ...  # train on: same weights, same Adam state, new owners
    """
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"reshard: chunk_bytes must be a positive int, got {chunk_bytes!r}")
    collections = _collections(model)
    try:  # a rank that refuses still joins the agreement, so no peer waits on it
        changes = _changes(collections, plan)
        refusal = _refusal(collections, changes)
    except (KeyError, TypeError, ValueError) as exc:
        changes, refusal = {}, exc
    _agree(collections, changes, refusal)
    built = []
    for fqn, specs in changes.items():
        built.append((fqn, _rebuilt(collections[fqn], specs, chunk_bytes)))
    for fqn, new in built:  # nothing below communicates or can fail on one rank alone
        _swap(model, fqn, collections[fqn], new)
    state = model._dtrec_state
    moved = {table_fqn(fqn, n): s for fqn, specs in changes.items() for n, s in specs.items()}
    new_plan = ShardingPlan(
        {key: moved.get(key, spec) for key, spec in state.sharding_plan.items()}
    )
    model._dtrec_state = dataclasses.replace(state, sharding_plan=new_plan)
    return model


def _collections(model: nn.Module) -> dict[str, ShardedCollection]:
    if not hasattr(model, "_dtrec_state"):
        raise TypeError(
            f"reshard takes a model returned by dtrec.distribute_module, got {type(model).__name__}"
        )
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, ShardedCollection)}


def _changes(
    collections: Mapping[str, ShardedCollection], plan: object
) -> dict[str, dict[str, TableSpec]]:
    """Collection FQN -> every table's new spec, for the collections with a changed spec.
    KeyError / TypeError / ValueError for a plan naming unknown tables, a value that is
    not a spec, or a spec that does not fit its collection's mesh (no collective)."""
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"plan must be a mapping {{'<collection fqn>.<table>': spec}}, got "
            f"{type(plan).__name__}"
        )
    where = {
        table_fqn(fqn, cfg.name): (fqn, cfg)
        for fqn, collection in collections.items()
        for cfg in collection._tables
    }
    unknown = sorted(k for k in plan if k not in where)
    if unknown:
        raise KeyError(
            f"reshard: plan names unknown table(s) {unknown}; the model's tables are "
            f"{sorted(where)}"
        )
    changes: dict[str, dict[str, TableSpec]] = {}
    for key, spec in plan.items():
        fqn, cfg = where[key]
        if not isinstance(spec, TableSpec):
            raise TypeError(
                f"reshard: plan entry {key!r}: expected a dtrec.placements spec, got {spec!r}"
            )
        if not spec.resolved:
            raise ValueError(
                f"reshard: plan entry {key!r}: {spec!r} leaves a choice to the planner; "
                "give it resolved (e.g. TableWise(rank=1))"
            )
        try:
            spec.layout(cfg, shard_axis(collections[fqn].mesh))
        except ValueError as exc:
            raise ValueError(f"reshard: plan entry {key!r}: {exc}") from exc
        current = collections[fqn].specs()
        if spec != current[cfg.name]:
            changes.setdefault(fqn, dict(current))[cfg.name] = spec
    return changes


def _refusal(
    collections: Mapping[str, ShardedCollection], changes: Mapping[str, Mapping[str, TableSpec]]
) -> ValueError | None:
    """Why this rank cannot move the changed collections yet (None: it can)."""
    for fqn, specs in changes.items():
        collection = collections[fqn]
        first = table_fqn(fqn, collection._tables[0].name)
        if not isinstance(collection, ShardedEmbeddingBagCollection):
            return ValueError(
                f"reshard: table {first!r} is in a sequence collection "
                f"({type(collection).__name__}), which reshard does not move yet"
            )
        if collection._updater is None:
            return ValueError(
                f"reshard: table {first!r} is trained by a torch optimizer (no fused "
                "optimizer): reshard moves fused optimizer state only so far; save and load "
                "a checkpoint (dtrec.checkpoint) onto a model distributed to the new plan"
            )
        if collection._batch_split is not None:
            return ValueError(
                f"reshard: table {first!r}'s collection looks batches up with same_batch, "
                "which reshard does not support yet"
            )
        if collection._prefetched:
            return ValueError(
                f"reshard: collection {fqn!r} has a prefetched batch in flight (prefetch "
                "without its forward yet, e.g. a dtrec.TrainPipeline's next batch); run its "
                "forward first (drain the pipeline), or reshard before prefetching"
            )
        updater = collection._updater
        if updater._pending or updater.accumulating:
            return ValueError(
                f"reshard: collection {fqn!r} holds gradients not applied yet (inside "
                "dtrec.accumulate_gradients, or a backward in progress); reshard between steps"
            )
        axis = shard_axis(collection.mesh)
        old = collection.specs()
        for cfg in collection._tables:
            for spec in (old[cfg.name], specs[cfg.name]):
                why = _unsupported(spec, spec.layout(cfg, axis))
                if why is not None:
                    return ValueError(
                        f"reshard: table {table_fqn(fqn, cfg.name)!r}: {spec!r} is {why}, "
                        "which reshard does not move yet"
                    )
    return None


def _unsupported(spec: TableSpec, layout: TableLayout) -> str | None:
    if isinstance(spec, (TableRowWise, Grid)):
        return "a node-aware type"
    if layout.offloaded:
        return "offloaded"
    return None


def _agree(
    collections: Mapping[str, ShardedCollection],
    changes: Mapping[str, Mapping[str, TableSpec]],
    refusal: Exception | None,
) -> None:
    """Raise on every rank unless every rank has the same changes and none refuses (one
    small all-gather, before anything is built): a refusing rank raises its own error,
    the others a ValueError naming it."""
    if not collections:
        return
    group = world_group(next(iter(collections.values())).mesh)
    described = repr(sorted((fqn, sorted(s.items())) for fqn, s in changes.items()))
    digest = hashlib.sha256(described.encode()).hexdigest()
    size = dist.get_world_size(group)
    gathered: list[tuple[str, str | None] | None] = [None] * size
    dist.all_gather_object(gathered, (digest, None if refusal is None else str(refusal)), group)
    if refusal is not None:
        raise refusal
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    for rank, item in zip(ranks, gathered, strict=True):
        assert item is not None
        if item[1] is not None:
            raise ValueError(f"reshard refused on rank {rank}: {item[1]}")
    differ = [
        rank for rank, item in zip(ranks, gathered, strict=True) if item and item[0] != digest
    ]
    if differ:
        raise ValueError(
            f"reshard: ranks {differ} were given another plan than rank {dist.get_rank()}; "
            "every rank must reshard to the same plan"
        )


def _rebuilt(
    old: ShardedCollection, specs: Mapping[str, TableSpec], chunk_bytes: int
) -> ShardedCollection:
    """A collection like ``old`` on ``specs``, holding ``old``'s weights and fused state.
    Collective (new sub-meshes, the moves); ``old`` is only read."""
    assert isinstance(old, ShardedEmbeddingBagCollection)
    old._settle()
    meta = {
        cfg.name: torch.empty(
            cfg.num_embeddings, cfg.embedding_dim, dtype=old._dtype, device="meta"
        )
        for cfg in old._tables
    }
    new = ShardedEmbeddingBagCollection(
        old._tables, meta, old.mesh, dict(specs), old.optimizer, old.bounds_check,
        old.sync_every, None, old.is_weighted, old.qcomms,
    )  # fmt: skip
    new._steps, new._averaged_at = old._steps, old._averaged_at
    position = shard_position(old.mesh)
    assert position is not None and old._updater is not None and new._updater is not None
    kinds = {"weight": "weight", **old.optimizer.state_layout()}
    pieces: list[Piece] = []
    for t, cfg in enumerate(old._tables):
        for entry, kind in kinds.items():
            if kind == "scalar":
                continue
            size = (
                old._dtype.itemsize if entry == "weight" else _state(old, t, entry).element_size()
            )
            pieces += entry_moves(
                t, cfg.name, entry, kind, old._layouts[t], new._layouts[t], size
            )  # fmt: skip
    axis = shard_axis(old.mesh)
    move(
        pieces, _locals(old, kinds, position), _locals(new, kinds, position), position,
        old.mesh.get_group(SHARD), axis.size, mesh_device(old.mesh), chunk_bytes,
    )  # fmt: skip
    _agree_scalars(old, new, [k for k, kind in kinds.items() if kind == "scalar"])
    return new


def _state(collection: ShardedCollection, t: int, entry: str) -> torch.Tensor:
    assert collection._updater is not None
    return collection._updater.state[t][entry]


def _locals(collection: ShardedCollection, kinds: Mapping[str, str], position: int) -> Locals:
    """(table, entry) -> this rank's tensor of it and the rectangle it holds."""
    out = {}
    for t, cfg in enumerate(collection._tables):
        block = collection._layouts[t].block_at(position)
        if block is None:
            continue
        for entry, kind in kinds.items():
            if kind == "scalar":
                continue
            if entry == "weight":
                tensor = local_block(collection._stored()[cfg.name].weight)
            else:
                tensor = _state(collection, t, entry)
            if kind == "row":
                out[t, entry] = (tensor.view(-1, 1), Block(position, block.rows, (0, 1)))
            else:
                out[t, entry] = (tensor, block)
    return out


def _agree_scalars(old: ShardedCollection, new: ShardedCollection, entries: list[str]) -> None:
    """Per-table scalar state (Adam's step) of the new owners: the largest over the ranks
    (the old owners all hold the same; ranks without a block of a table hold zero)."""
    if not entries:
        return
    tables = range(len(old._tables))
    values = torch.stack([_state(old, t, e).float() for t in tables for e in entries])
    values = all_reduce(
        values.to(mesh_device(old.mesh)), world_group(old.mesh), SCALARS_KIND, "max"
    )
    with torch.no_grad():
        for value, (t, e) in zip(
            values.cpu(), [(t, e) for t in tables for e in entries], strict=True
        ):
            _state(new, t, e).copy_(value)


def _swap(model: nn.Module, fqn: str, old: ShardedCollection, new: ShardedCollection) -> None:
    """Move ``new``'s state into ``old`` (the module users and the fused optimizer hold)
    and point the fused optimizer's param group at the new tables."""
    kept = {k: v for k, v in vars(old).items() if k in _KEPT or k not in vars(new)}
    vars(old).clear()
    vars(old).update(vars(new))
    vars(old).update(kept)
    vars(new).clear()
    old.train(old.training)  # the new tables take the collection's mode
    updater = old._updater
    assert updater is not None
    updater.after_update = old._after_fused_update  # was bound to ``new``
    view = model._dtrec_state.fused_optimizer
    if view is None:
        return
    group = view.param_groups[list(view._collections).index(fqn)]
    for weight in group["params"]:
        view.state.pop(weight, None)
    weights = [table.weight for table in old._stored().values()]
    group["params"] = weights
    updater.param_group = group
    for weight, state in zip(weights, old.fused_optimizer_state().values(), strict=True):
        view.state[weight] = state
        weight._in_backward_optimizers = [view]
