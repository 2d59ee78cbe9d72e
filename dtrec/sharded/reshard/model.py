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
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtrec._torch_compat import local_block
from dtrec.comm.collectives import all_reduce
from dtrec.placements import TableSpec
from dtrec.placements.layout import Block
from dtrec.placements.mesh import mesh_device, shard_position, world_group
from dtrec.planning.topology import Topology
from dtrec.sharded.collection import ShardedCollection
from dtrec.sharded.module import ShardedEmbeddingBagCollection
from dtrec.sharded.reshard.checks import (
    agree,
    as_specs,
    offloaded_torch_state,
    plan_changes,
    refusal_of,
    torch_entries,
)
from dtrec.sharded.reshard.exchange import CHUNK_BYTES, Locals, exchange_ranks, move
from dtrec.sharded.reshard.memory import check_topology, default_topology, memory_refusal
from dtrec.sharded.reshard.meshes import dense_refusal, model_mesh, move_dense, target_meshes
from dtrec.sharded.reshard.moves import Piece, entry_moves
from dtrec.sharded.reshard.plan_after import plan_after
from dtrec.sharded.reshard.torch_state import (
    TorchStates,
    check_optimizers,
    old_local,
    state_of,
    weights_of,
)
from dtrec.sharded.sequence import ShardedEmbeddingCollection

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
    model: nn.Module,
    plan: Mapping[str, TableSpec],
    chunk_bytes: int = CHUNK_BYTES,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    mesh: DeviceMesh | None = None,
    meshes: Mapping[str, DeviceMesh] | None = None,
    topology: Topology | None = None,
) -> nn.Module:
    """Move the tables of a ``distribute_module`` model to the specs of ``plan``, in place.

    ``plan`` maps table FQNs (``"<collection fqn>.<table>"``, as in ``model.sharding_plan``)
    to their new spec; tables it omits keep theirs. A TorchRec ``ShardingPlan`` (or its
    ``.plan`` dict) is taken too, mapped onto the mesh as ``distribute_module`` maps it.
    Weights and fused optimizer state (SGD, RowWiseAdagrad's sums, Adam's moments and
    step) move to their new owners:
    only cells a rank did not hold are sent to it, with all-to-alls over the world (on
    one mesh: within each replica group) in rounds of at most ``chunk_bytes`` per rank,
    counted by ``dtrec.comm_stats`` as ``"reshard.rows"`` (Adam's per-table step: one
    small all-reduce, ``"reshard.scalars"``). Peak extra memory per rank: the new blocks
    and state of the collections that change, plus one round's buffers. Training then
    continues exactly as on a model distributed to the new plan with the same weights
    and state; ``model.sharding_plan`` is the new plan (its planner reports those of the
    new layout) and ``model.fused_optimizer`` keeps its param groups (LR schedulers keep
    working).

    Tables trained by a ``torch.optim`` optimizer (``distribute_module(...,
    optimizer=None)``): pass the optimizer(s) holding them as ``optimizers``. Each is
    updated in place, still the same object: its param groups and ``state`` keys name
    the new table parameters, and state placed like a table (Adam's ``exp_avg`` and
    ``exp_avg_sq``, Adagrad's ``sum``, SGD's ``momentum_buffer``) moves with its rows;
    scalars (``step``) are kept. Gradients are not carried (call it between steps).
    Without ``optimizers`` such a table is refused (``optimizers=[]``: none holds them).

    ``mesh``: a new mesh from ``dtrec.init_mesh`` over the same world (another shard group
    size, 1-D <-> 2-D, another rank layout) for the dense part and every collection
    ``meshes`` does not name; ``meshes``: collection FQN -> its own new mesh (as
    ``distribute_module``'s). Every replica of a block on the new mesh receives its
    copy; tables the plan omits keep their spec (a ValueError if it does not fit the new
    mesh). The dense parameters stay the same objects on the new mesh (nothing sent:
    each rank holds them whole); pass the optimizer(s) holding them as ``optimizers``
    so their state follows (ValueError without, or with a trained one none of them
    holds). Dense layers distributed by ``fully_shard`` or ``parallelize_module`` do not
    follow ``mesh``: ValueError (move the tables with ``meshes=``).

    ``topology``: the memory budget the target must fit (``Topology.memory_budget`` per
    rank, for the tables and optimizer state each rank holds after the move, and for the
    move's peak: old and new collections and a round's buffers together; offloaded
    blocks' host memory against ``Topology.host_memory_per_rank`` when set; default what
    ``dtrec.plan`` assumes): a target that does not fit is a ValueError on every rank
    before anything moves.

    Offloaded tables (host tier behind a device cache) move onto, off and between host
    tiers: caches are flushed first, the host blocks and their host-tier optimizer state
    move like device blocks, and the new caches start empty.

    Supported: data-parallel, table-wise, row-wise, column-wise, table-row-wise and grid
    tables of ``EmbeddingBagCollection``s and ``EmbeddingCollection``s (the last two types
    on a mesh built with ``node_size``), any of them to any other, on 1-D and 2-D meshes.
    Refused with a ValueError naming the table, before anything moves: fully sharded 2D
    tables, offloaded targets in ``sync_every`` collections or holding torch optimizer
    state, ``same_batch`` collections, a prefetched batch not consumed
    yet, a gradient accumulation in progress; and any spec that does not fit the mesh
    (``TableWise(rank=None)``: give the rank). Collective: every rank calls it with the
    same plan and meshes (checked: ranks that disagree all raise).

    Example::

        model = dtrec.distribute_module(model, mesh, {"sparse.t0": TableWise(rank=0)},
                                        optimizer=dtrec.optim.Adam(lr=0.01))
        ...  # train
        dtrec.reshard(model, {"sparse.t0": RowWise()})
        ...  # train on: same weights, same Adam state, new owners

        plain = dtrec.distribute_module(model, mesh)  # tables trained by torch.optim
        opt = torch.optim.Adam(plain.parameters(), lr=0.01)
        ...  # train
        dtrec.reshard(plain, {"sparse.t0": RowWise()}, optimizers=[opt])
        ...  # opt.step() goes on with the moved exp_avg / exp_avg_sq

        # S = 4 (4 x 1) -> S = 2 (2 x 2); the dense optimizer's state follows
        dtrec.reshard(model, {"sparse.t0": TableWise(rank=1)},
                      mesh=dtrec.init_mesh("cpu", 2), optimizers=[dense_opt])
    """
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"reshard: chunk_bytes must be a positive int, got {chunk_bytes!r}")
    collections = _collections(model)
    held: list[torch.optim.Optimizer] | None = None
    targets: dict[str, DeviceMesh] = {}
    new_plan = model._dtrec_state.sharding_plan  # no change: it stays, reports and all
    try:  # a rank that refuses still joins the agreement, so no peer waits on it
        held = check_optimizers(optimizers)
        budget = check_topology(topology)
        targets = target_meshes(model, collections, mesh, meshes)
        changes = plan_changes(collections, as_specs(model, collections, plan, targets), targets)
        refusal = refusal_of(collections, changes, held, targets)
        if refusal is None:
            refusal = dense_refusal(model, collections, mesh, held)
        if refusal is None and changes:
            budget = budget or default_topology(model_mesh(model, collections))
            refusal = memory_refusal(collections, changes, targets, held, budget, chunk_bytes)
        entries = {} if refusal is not None else torch_entries(collections, changes, held)
        if refusal is None:
            refusal = offloaded_torch_state(collections, changes, entries, targets)
        if refusal is None and changes:
            new_plan = plan_after(model, collections, changes, targets, mesh, topology, plan)
    except (KeyError, TypeError, ValueError) as exc:
        changes, refusal, entries = {}, exc, {}
    agree(collections, changes, refusal, entries, targets)
    built = []
    for fqn, specs in changes.items():
        rebuilt = _rebuilt(
            collections[fqn], specs, targets[fqn], chunk_bytes, held, entries.get(fqn, {})
        )
        built.append((fqn, *rebuilt))
    for fqn, new, states in built:  # nothing below communicates or can fail on one rank alone
        _swap(model, fqn, collections[fqn], new)
        if states is not None:
            states.repoint()
    move_dense(model, collections, mesh, held)
    model._dtrec_state = dataclasses.replace(model._dtrec_state, sharding_plan=new_plan)
    return model


def _collections(model: nn.Module) -> dict[str, ShardedCollection]:
    if not hasattr(model, "_dtrec_state"):
        raise TypeError(
            f"reshard takes a model returned by dtrec.distribute_module, got {type(model).__name__}"
        )
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, ShardedCollection)}


def _rebuilt(
    old: ShardedCollection,
    specs: Mapping[str, TableSpec],
    mesh: DeviceMesh,
    chunk_bytes: int,
    optimizers: Sequence[torch.optim.Optimizer] | None,
    torch_entries: Mapping[int, list[str]],
) -> tuple[ShardedCollection, TorchStates | None]:
    """A collection like ``old`` on ``specs`` over ``mesh``, holding ``old``'s weights and
    fused state, and (without a fused optimizer) the torch optimizers' state of its new
    tables, to swap in. Collective (new sub-meshes, the moves); ``old`` is only read."""
    old._settle()
    meta = {
        cfg.name: torch.empty(
            cfg.num_embeddings, cfg.embedding_dim, dtype=old._dtype, device="meta"
        )
        for cfg in old._tables
    }
    if isinstance(old, ShardedEmbeddingCollection):
        new: ShardedCollection = ShardedEmbeddingCollection(
            old._tables, meta, mesh, dict(specs), old.optimizer, old.bounds_check,
            old.sync_every, None, old.need_indices, old.qcomms,
        )  # fmt: skip
    else:
        assert isinstance(old, ShardedEmbeddingBagCollection)
        new = ShardedEmbeddingBagCollection(
            old._tables, meta, mesh, dict(specs), old.optimizer, old.bounds_check,
            old.sync_every, None, old.is_weighted, old.qcomms,
        )  # fmt: skip
    new._steps, new._averaged_at = old._steps, old._averaged_at
    old_position, new_position = shard_position(old.mesh), shard_position(mesh)
    assert old_position is not None and new_position is not None
    group, index, old_ranks, new_ranks = exchange_ranks(old.mesh, mesh)
    old_weights, new_weights = weights_of(old._stored()), weights_of(new._stored())
    fused = {} if old.optimizer is None else old.optimizer.state_layout()
    states = None
    if old._updater is None:
        states = TorchStates(optimizers or [])
        for t, entries in torch_entries.items():
            states.allocate(t, entries, old_weights[t], new_weights[t])
    kinds = {  # table -> its moved entries and their kinds
        t: {"weight": "weight"}
        | {e: k for e, k in fused.items() if k != "scalar"}
        | dict.fromkeys(torch_entries.get(t, []), "weight")
        for t in range(len(old._tables))
    }

    def old_tensor(t: int, entry: str) -> torch.Tensor:
        if entry == "weight":
            return local_block(old_weights[t])
        if entry in fused:
            return _state(old, t, entry)
        return old_local(optimizers or [], old_weights[t], entry)

    def new_tensor(t: int, entry: str) -> torch.Tensor:
        if entry == "weight":
            return local_block(new_weights[t])
        if entry in fused:
            return _state(new, t, entry)
        assert states is not None
        return states.new_local[t, entry]

    def element_size(t: int, entry: str) -> int:
        if entry == "weight":
            return old._dtype.itemsize
        if entry in fused:
            return _state(old, t, entry).element_size()
        return state_of(optimizers or [], old_weights[t], entry).element_size()

    pieces: list[Piece] = []
    for t, cfg in enumerate(old._tables):
        for entry, kind in kinds[t].items():
            pieces += entry_moves(
                t, cfg.name, entry, kind, old._layouts[t], new._layouts[t],
                element_size(t, entry), old_ranks, new_ranks,
            )  # fmt: skip
    move(
        pieces, _locals(old, kinds, old_position, old_tensor),
        _locals(new, kinds, new_position, new_tensor), index[dist.get_rank()],
        group if group is not None else dist.group.WORLD, len(index),
        mesh_device(old.mesh), chunk_bytes,
    )  # fmt: skip
    _agree_scalars(old, new, [k for k, kind in fused.items() if kind == "scalar"])
    for before, after in zip(old_weights, new_weights, strict=True):  # a frozen table stays so
        after.requires_grad_(before.requires_grad)
    return new, states


def _state(collection: ShardedCollection, t: int, entry: str) -> torch.Tensor:
    """Fused state ``entry`` of table ``t``'s block here: an offloaded table's per-row
    entries from its host tier (every row's, current after ``_settle``), its scalars
    and every other table's state from the updater."""
    assert collection._updater is not None
    offload = collection._offload
    if offload is not None and t in offload.caches:
        host = offload.caches[t].host_state
        if entry in host:
            return host[entry]
    return collection._updater.state[t][entry]


def _locals(
    collection: ShardedCollection,
    kinds: Mapping[int, Mapping[str, str]],
    position: int,
    tensor_of: Callable[[int, str], torch.Tensor],
) -> Locals:
    """(table, entry) -> this rank's tensor of it and the rectangle it holds."""
    out = {}
    for t in range(len(collection._tables)):
        block = collection._layouts[t].block_at(position)
        if block is None:
            continue
        for entry, kind in kinds[t].items():
            tensor = tensor_of(t, entry)
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
    if updater is None:
        return
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
