"""``distribute_module``: shard a model's embedding tables, replicate the rest."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dtrec.comm.collectives import broadcast_coalesced, first_rank
from dtrec.comm.failures import install_excepthook
from dtrec.comm.qcomms import QCommsConfig
from dtrec.interop.in_backward import fused_rules
from dtrec.interop.plans import from_torchrec, is_torchrec_plan
from dtrec.interop.qcomms import qcomms_per_collection
from dtrec.optim import FusedOptimizer
from dtrec.optim.cpu_choice import (
    CHOICES,
    preferred_cpu_rowwise_adagrad,
    use_cpu_rowwise_adagrad,
)
from dtrec.placements import TableSpec
from dtrec.placements.mesh import check_one_mesh_family, shard_axis, world_group
from dtrec.planning.plan import (
    ShardingPlan,
    check_plan_keys,
    collection_configs,
    collection_tables,
    find_collections,
    model_tables,
    table_fqn,
)
from dtrec.planning.plan import plan as make_plan
from dtrec.sharded.collection import (
    ShardedCollection,
    check_sync_every,
    fully_sharded_sync_every_error,
)
from dtrec.sharded.copies import deepcopy_module
from dtrec.sharded.dense import ReplicatedDense
from dtrec.sharded.dense_setup import replicate_dense
from dtrec.sharded.dist.batch_split import (
    check_same_batch_mesh,
    describe_same_batch,
    inconsistent_groups,
    same_batch_ranks,
)
from dtrec.sharded.managed_collision import (
    adopt_torchrec_collections,
    pin_row_wise,
    remapped_collections,
    share_windows,
)
from dtrec.sharded.module import ShardedEmbeddingBagCollection
from dtrec.sharded.sequence import ShardedEmbeddingCollection
from dtrec.sharded.tables.dtensor_handlers import register_dtensor_handlers
from dtrec.sharded.update.fused_optimizer import FusedOptimizerView


def distribute_module(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: Mapping[str, TableSpec] | object | None = None,
    optimizer: FusedOptimizer | None = None,
    sync_every: int | None = None,
    qcomms: QCommsConfig | Mapping[str, QCommsConfig | None] | object | None = None,
    meshes: Mapping[str, DeviceMesh] | None = None,
    same_batch: DeviceMesh | None = None,
) -> nn.Module:
    """Shard every ``EmbeddingBagCollection`` of ``model`` per ``plan``; replicate the rest.

    ``plan`` maps ``"<collection fqn>.<table>"`` to a spec; tables it omits, and open
    choices like ``TableWise(rank=None)``, are planned by ``dtrec.plan``. A TorchRec
    ``ShardingPlan`` works too (``dtrec.interop.plans``). TorchRec's
    ``EmbeddingBagCollection``s are sharded like dtrec's (same weights, same
    ``is_weighted``), its ``ManagedCollisionEmbeddingBagCollection``s like dtrec's (converted
    first: same weights, remapper state and state-dict keys, ``dtrec.interop.managed_collision``);
    any other TorchRec sparse module is a TypeError naming it. Dense
    parameters become DTensors replicated over ``mesh``, their gradients averaged over
    all W ranks during backward (``dtrec.sharded.dense``), so every parameter is a DTensor
    and any torch optimizer (``foreach``, ``fused``) steps ``model.parameters()``. Dense
    parameters that already are DTensors (``fully_shard`` / ``parallelize_module`` applied
    first) are left to them, and ``fully_shard(..., mesh=mesh, dp_mesh_dims=...)`` applied
    after takes over those it wraps (``docs/composing.md``). With
    ``optimizer`` (a ``dtrec.optim`` config) the table update is fused into backward: table
    weights get no ``.grad`` and ``model.fused_optimizer`` holds the state. TorchRec's recipe
    works the same way: tables marked by ``apply_optimizer_in_backward`` (torchrec's or
    torch's) get that optimizer fused (``dtrec.interop.in_backward``: RowWiseAdagrad, SGD,
    Adam and their kwargs; anything else is a ValueError naming the table), and fused
    tables carry TorchRec's ``_in_backward_optimizers`` marker, so
    ``in_backward_optimizer_filter`` leaves them out of the dense optimizer.
    ``sync_every=k``: replicas of a sharded table stop summing gradients every step and
    instead average weights (and fused optimizer state) every k steps, like TorchRec's 2D
    ``DMPCollection``: less replicate-axis traffic, but each replica group takes its own
    steps in between, so results differ from the unsharded model unless k=1 with SGD (see
    ``ShardedEmbeddingBagCollection.sync_replicas``). Returns ``model`` itself, changed in
    place (or the sharded collection when ``model`` is one), as a ``DistributedModule``: its
    class becomes a subclass of ``DistributedModule`` and its own class (as torch's
    ``fully_shard`` does), so ``isinstance`` checks and ``state_dict`` keys stay the same
    and ``model.sharding_plan`` / ``model.fused_optimizer`` read the distribution's state.
    Collective: every rank calls it with the same model config and plan.

    ``qcomms``: a ``dtrec.QCommsConfig`` (or TorchRec's), or a dict of them by collection
    FQN, sends a collection's pooled embeddings, their gradients and its replica gradient
    sums in fp16 / bf16, added up in fp32 (error bound in ``QCommsConfig``'s doc); None
    (the default) sends everything in fp32, as before.

    ``meshes``: collection FQN -> the mesh its tables are sharded on, each collection
    with a replication factor of its own (TorchRec's Dynamic 2D, ``DMPCollectionConfig``
    per module; ``dtrec.interop.dmp_collection.dmp_collection_meshes`` maps those). Every
    mesh comes from ``dtrec.init_mesh`` over the same world as ``mesh``, which shards the
    collections not named and replicates the dense part over the whole world. Each
    collection syncs its replicas over its own replicate dim; the plan is made per mesh
    (``model.sharding_plan.reports``).

    ``same_batch``: a 1-D mesh of ranks that feed the same batch, this rank's group of them
    (``world_mesh["tp"]``: under tensor parallelism a tp group's ranks see one batch, as in
    torchtitan). Each collection then looks that batch up once per group instead of
    once per rank: rank i of the group takes samples ``chunk i`` of it
    (``torch.tensor_split``, uneven allowed) through the input dist, lookup and output dist,
    and the pooled rows (a sequence collection's rows, per feature) are all-gathered over
    the group (``dtrec.sharded.dist.batch_split``;
    its backward scales this rank's rows of the gradient by the group size, so the tables
    train exactly as without it). Costs one all-gather of the ``[B, sum D]`` pooled rows per
    collection and step; saves ``(n - 1) / n`` of the ids and pooled rows the all-to-alls
    carry. A variable batch per feature (VBE) is a ValueError. A group whose ranks
    feed batches of different sizes fails the step on every rank (a ValueError naming the
    ranks and sizes): the sizes ride the input dist's header where it reaches the world,
    else one 8-byte all-gather over the group per step (``same_batch.sizes``). With env
    ``DTREC_CHECK_SAME_BATCH=1`` each forward checks that the group's batches are equal.

    Example::

        mesh = dtrec.init_mesh("cpu", shard_group_size=2)
        model = dtrec.distribute_module(model, mesh, {"sparse.t0": RowWise()})
        # W=8: the pooled collection 4 x 2, the sequence one 8 x 1
        model = dtrec.distribute_module(model, dtrec.init_mesh("cuda", 4), meshes={
            "sparse.ec": dtrec.init_mesh("cuda", 8)})
        # (dp 2, tp 2): a tp group's two ranks split the batch they share
        model = dtrec.distribute_module(model, dtrec.table_mesh(world, shard=("dp", "tp")),
                                        same_batch=world["tp"])
    """
    shard_axis(mesh)
    check_same_batch_mesh(same_batch)
    if plan is not None and not isinstance(plan, Mapping) and not is_torchrec_plan(plan):
        raise TypeError(
            f"plan must be a mapping {{'<collection fqn>.<table>': spec}}, a TorchRec "
            f"ShardingPlan or None, got {type(plan).__name__}"
        )
    check_sync_every(sync_every)
    world = world_group(mesh)  # None, or a pipeline stage's ranks (table_mesh(pipeline=))
    if optimizer is not None and not isinstance(optimizer, FusedOptimizer):
        raise TypeError(
            f"optimizer must be a dtrec.optim fused optimizer (SGD, RowWiseAdagrad, Adam) or "
            f"None, got {type(optimizer).__name__}; pass torch optimizers to the model params"
        )
    model = adopt_torchrec_collections(model)  # TorchRec's managed-collision collections
    collections = find_collections(model)
    if not collections:
        if any(isinstance(m, ShardedCollection) for m in model.modules()):
            raise ValueError(
                "model is already distributed (it holds sharded collections); "
                "distribute the unsharded model once"
            )
        raise ValueError(
            "model has no dtrec.EmbeddingBagCollection (or torchrec.EmbeddingBagCollection) "
            "to distribute"
        )
    in_tables = {id(p) for ebc in collections.values() for p in ebc.parameters()}
    check_one_mesh_family(mesh, {
        n: p for n, p in model.named_parameters()
        if isinstance(p, DTensor) and id(p) not in in_tables
    })  # fmt: skip
    rules = collection_rules(collections, optimizer)
    optimizer = next(iter(rules.values()), None)
    remapped = remapped_collections(model)  # managed collision: dtrec.sharded.managed_collision
    if remapped:
        plan = pin_row_wise(plan, remapped, same_batch)  # type: ignore[arg-type]
    tables = model_tables(model)
    if not meshes:  # per-collection meshes: each mesh's part is mapped onto it by plan()
        plan = from_torchrec(plan, tables, mesh)
        check_plan_keys(dict(plan or {}), tables)
    full_plan = make_plan(model, mesh, constraints=plan, meshes=meshes)
    if sync_every is not None:
        _check_planned_fully_sharded(full_plan, plan, sync_every)
    mesh_of = {fqn: (meshes or {}).get(fqn, mesh) for fqn in collections}  # checked by plan
    on_meta = any(
        collection_tables(ebc)[cfg.name].weight.is_meta
        for ebc in collections.values()
        for cfg in collection_configs(ebc)
    )
    seed = torch.initial_seed() if on_meta else 0  # meta tables: every rank inits its blocks
    qcomms_of = qcomms_per_collection(qcomms, collections)
    check_same_on_every_rank(
        tables, full_plan, rules or None, sync_every, seed, qcomms_of,
        {fqn: own.mesh.tolist() for fqn, own in mesh_of.items()}, same_batch, world,
    )  # fmt: skip
    if mesh.device_type == "cpu" and any(
        r.step_rule().kind == "rowwise_adagrad" for r in rules.values()
    ):
        choose_cpu_rowwise_adagrad(world)
    install_excepthook()  # an uncaught exception on a rank names it in its peers' errors

    sharded: dict[str, ShardedCollection] = {}
    for fqn, ebc in collections.items():
        tables = collection_configs(ebc)
        specs = {cfg.name: full_plan[table_fqn(fqn, cfg.name)] for cfg in tables}
        weights = {cfg.name: collection_tables(ebc)[cfg.name].weight for cfg in tables}
        if not hasattr(ebc, "embedding_bags"):  # a sequence collection (EmbeddingCollection)
            sharded[fqn] = ShardedEmbeddingCollection(
                tables, weights, mesh_of[fqn], specs, rules.get(fqn), ebc.bounds_check,
                sync_every, seed, ebc.need_indices, qcomms_of[fqn], same_batch,
            )  # fmt: skip
            continue
        sharded[fqn] = ShardedEmbeddingBagCollection(
            tables, weights, mesh_of[fqn], specs, rules.get(fqn), ebc.bounds_check,
            sync_every, seed, ebc.is_weighted, qcomms_of[fqn], same_batch,
        )  # fmt: skip
    fused = FusedOptimizerView(sharded, optimizer) if optimizer is not None else None
    register_dtensor_handlers()  # uneven-shard grads, clip_grad_norm_ across meshes
    if "" in sharded:
        return as_distributed(sharded[""], DistributedState(full_plan, fused))
    for fqn, module in sharded.items():
        parent_name, _, attr = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, module)

    sharded_params = {id(p) for m in sharded.values() for p in m.parameters()}
    dense_meta = [
        n for n, p in model.named_parameters() if p.is_meta and id(p) not in sharded_params
    ]
    if dense_meta:
        raise ValueError(
            f"parameters {dense_meta[:5]} are on the meta device: only embedding tables may "
            "be (each rank then creates its own blocks); build the dense part on cpu or cuda"
        )
    share_windows(remapped, world)
    # a remapper's buffers are the same on every rank by construction: not broadcast
    ignored = [*sharded.values(), *remapped.values()]
    dense = replicate_dense(model, mesh, ignored=ignored, group=world)
    return as_distributed(model, DistributedState(full_plan, fused, dense))


_CPU_CHOICE_MADE = False


def choose_cpu_rowwise_adagrad(group: ProcessGroup | None = None) -> None:
    """The first rank's choice of the CPU fused row-wise Adagrad
    (``dtrec.ops.backends.cpu_choice``: timed once per process) on every rank of ``group``
    (None: the world): replicas must step rows with the same code. Collective (one small
    broadcast), the first time only."""
    global _CPU_CHOICE_MADE
    if _CPU_CHOICE_MADE:
        return
    first = first_rank(group)
    choice = preferred_cpu_rowwise_adagrad() if dist.get_rank() == first else CHOICES[0]
    code = torch.tensor([CHOICES.index(choice)], dtype=torch.int64)
    if dist.get_world_size(group) > 1:
        broadcast_coalesced([code], first, group, "setup.cpu_choice")
    use_cpu_rowwise_adagrad(CHOICES[int(code)])
    _CPU_CHOICE_MADE = True


def collection_rules(
    collections: Mapping[str, nn.Module], optimizer: FusedOptimizer | None
) -> dict[str, FusedOptimizer]:
    """Collection FQN -> its fused rule: ``optimizer``, or the one TorchRec's recipe marked
    its tables with (``apply_optimizer_in_backward``, ``dtrec.interop.in_backward``); {}
    without either. ValueError when both are given and differ."""
    marked = fused_rules(
        {
            fqn: {
                table_fqn(fqn, cfg.name): collection_tables(ebc)[cfg.name].weight
                for cfg in collection_configs(ebc)
            }
            for fqn, ebc in collections.items()
        }
    )
    if marked is None:
        return {} if optimizer is None else dict.fromkeys(collections, optimizer)
    if optimizer is not None:
        differ = {fqn: rule for fqn, rule in marked.items() if rule != optimizer}
        if differ:
            fqn, rule = next(iter(differ.items()))
            raise ValueError(
                f"distribute_module got optimizer={optimizer!r}, but the tables of {fqn!r} "
                f"have the in-backward optimizer {rule!r} (apply_optimizer_in_backward); "
                "give one of the two"
            )
    return marked


@dataclass(frozen=True)
class DistributedState:
    """What ``distribute_module`` decided for a model: read through ``DistributedModule``."""

    sharding_plan: ShardingPlan
    """The full plan, every table's spec (the user's pins and the planner's choices)."""
    fused_optimizer: FusedOptimizerView | None
    """The fused optimizer's state per table, or None without a fused optimizer."""
    dense: ReplicatedDense | None = None
    """The replicated dense parameters' gradient averaging (None: no dense parameters)."""


class DistributedModule:
    """The class a model gets from ``distribute_module``, in front of its own class.

    Torch's composable pattern (``fully_shard``, ``replicate``): the module's class is
    swapped for a generated subclass of this mixin and the original class, instead of
    setting attributes on the user's object; the only state is one ``DistributedState``.

    Example::

        model = dtrec.distribute_module(model, mesh, optimizer=dtrec.optim.SGD(lr=0.1))
        print(model.sharding_plan)
        model.fused_optimizer.state_dict()
    """

    _dtrec_state: DistributedState

    def __new__(cls, *args, **kwargs):  # type: ignore[no-untyped-def]
        # Rebuilding the class (e.g. nn.Sequential slicing calls type(self)(...)) builds
        # the original class: index 0 is the generated class, 1 this mixin.
        original = cls.__mro__[2]
        return original.__new__(original, *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        """An independent copy (own weights, optimizer state, hooks), sharing the process
        groups and meshes (``dtrec.sharded.copies``). Collective in effect: every rank
        copies, so that both models keep issuing the same collectives."""
        own = getattr(type(self).__mro__[2], "__deepcopy__", None)  # a sharded collection's
        return own(self, memo) if own is not None else deepcopy_module(self, memo)

    @property
    def sharding_plan(self) -> ShardingPlan:
        """Every table FQN's spec (``print`` it to see the planner's reasons)."""
        return self._dtrec_state.sharding_plan

    @property
    def fused_optimizer(self) -> FusedOptimizerView | None:
        """The fused optimizer (a torch Optimizer: param groups for LR schedulers, per-table
        state for checkpoints), None without one."""
        return self._dtrec_state.fused_optimizer


@functools.cache
def _distributed_class(cls: type[nn.Module]) -> type[nn.Module]:
    return type(f"Distributed{cls.__name__}", (DistributedModule, cls), {})


def as_distributed(module: nn.Module, state: DistributedState) -> nn.Module:
    """``module`` with its class swapped for the ``DistributedModule`` subclass of it."""
    module.__class__ = _distributed_class(type(module))
    module._dtrec_state = state
    return module


def check_same_on_every_rank(
    tables: Mapping[str, object],
    plan: Mapping[str, TableSpec],
    optimizer: FusedOptimizer | Mapping[str, FusedOptimizer] | None,
    sync_every: int | None,
    init_seed: int = 0,
    qcomms: Mapping[str, object] | None = None,
    meshes: Mapping[str, object] | None = None,
    same_batch: DeviceMesh | None = None,
    group: ProcessGroup | None = None,
) -> None:
    """ValueError on every rank of ``group`` (None: the world) if ranks disagree on the
    tables, the plan, the optimizer, (meta-device tables) the init seed, the collections'
    ``qcomms``, their meshes' ranks or the ``same_batch`` mesh (given or not, its dim names
    and size, and whether the members of each group name the same group: their ranks ride
    the digest's gather).

    Ranks that shard different models would otherwise exchange mismatched buffers (or
    hang) at the first step. One small all-gather of a digest; the full descriptions
    only travel when the digests differ, to say what differs.
    """
    described = {
        "tables": {k: repr(v) for k, v in sorted(tables.items())},
        "plan": {k: repr(v) for k, v in sorted(plan.items())},
        "fused optimizer": repr(optimizer),
        "sync_every": repr(sync_every),
        "meta-device init seed (torch.initial_seed(); seed every rank alike)": repr(init_seed),
        "qcomms": {k: repr(v) for k, v in sorted((qcomms or {}).items())},
        "meshes": {k: repr(v) for k, v in sorted((meshes or {}).items())},
        "same_batch": describe_same_batch(same_batch),
    }
    text = json.dumps(described, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()
    size = dist.get_world_size(group)
    gathered: list[tuple[str, list[int] | None] | None] = [None] * size
    dist.all_gather_object(gathered, (digest, same_batch_ranks(same_batch)), group=group)
    digests = [g[0] for g in gathered if g is not None]
    if len(set(digests)) == 1:
        why = inconsistent_groups([g[1] for g in gathered if g is not None])
        if why is not None:
            raise ValueError(f"distribute_module: {why}")
        return
    everyone: list[dict | None] = [None] * size
    dist.all_gather_object(everyone, described, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    positions = [i for i, d in enumerate(digests) if d != digests[0]]
    differ = [ranks[i] for i in positions]
    first = everyone[positions[0]]
    assert first is not None and everyone[0] is not None
    detail = ""
    for part, mine in everyone[0].items():
        theirs = first[part]
        if mine == theirs:
            continue
        if isinstance(mine, dict):
            keys = sorted(set(mine) | set(theirs))
            key = next(k for k in keys if mine.get(k) != theirs.get(k))
            part, mine, theirs = f"{part} {key!r}", mine.get(key), theirs.get(key)
        detail = f"{part}: rank {ranks[0]} has {mine}, rank {differ[0]} has {theirs}"
        break
    raise ValueError(
        f"distribute_module: ranks {differ} disagree with rank {ranks[0]} on the model or plan "
        f"({detail}); "
        "every rank must distribute the same model config with the same plan and optimizer"
    )


def _check_planned_fully_sharded(
    full_plan: Mapping[str, TableSpec], given: object, sync_every: int
) -> None:
    """E349 before anything is built, where the planner (not the user's plan) made tables
    fully sharded 2D and ``sync_every=k`` asks their replicas to average whole shards."""
    pinned = given if isinstance(given, Mapping) else {}
    planned = [
        key
        for key, spec in full_plan.items()
        if getattr(spec, "fully_sharded", False)
        and not getattr(pinned.get(key), "fully_sharded", False)
    ]
    if planned:
        raise fully_sharded_sync_every_error(sorted(planned), sync_every, planned=True)
