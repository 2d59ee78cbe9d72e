"""TorchRec 1.8.0 side of the side-by-side benchmarks (distributed, checkpoint, planner,
composed, dynamic_2d): the same model and plans, sharded by TorchRec.

Only the benchmark imports this module (TorchRec is not a dtrec dependency). Plans are built by
hand (``construct_module_sharding_plan``), so TorchRec's planner, which offers row-wise only
on cuda/mtia (ANCHORS.md), is not involved: the stock ``EmbeddingBagCollectionSharder`` runs
row-wise on CPU as is. 2D (``DMPCollection``) needs two patches, both in
:func:`cpu_dmp_collection`:

* its ``__init__`` asserts ``device.type in ("cuda", "mtia")``: a copy of ``__init__`` with that
  one comparison widened to "cpu" (one constant of its code object replaced);
* its plan remap writes shard placements ``rank:r/cpu:k``, which then fail "Local shard tensor
  device does not match with local Shard's placement" (CPU tensors are on "cpu"): they are
  rewritten to ``rank:r/cpu`` after the remap.

Dynamic 2D (``submodule_configs=[DMPCollectionConfig(...)]``, a sharding group size per module
type) needs nothing more: ``__init__`` remaps each config's plan through the same
``_remap_sharding_plan``, so the second patch covers every context, and the
``EmbeddingCollectionSharder`` runs table-, row- and column-wise sequence tables on CPU as is
(measured in benchmarks/dynamic_2d/run.py: pooled 4 x 2 and sequence 8 x 1 on 8 gloo ranks).
``DMPCollection``'s state dict holds DTensors whose local part is a ``LocalShardsWrapper``
(not what their placements say): :func:`load_full_weights` and :func:`full_weights` read the
wrapper's own blocks and offsets.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torch.distributed.remote_device import _remote_device
from torch.nn.parallel import DistributedDataParallel
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DMPCollection
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.optim import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from benchmarks.common.workloads import EPS, LR, Model, Workload

__all__ = [
    "KeyedJaggedTensor",
    "build_torchrec",
    "ddp_estimate",
    "ShardingPlan",
    "cpu_dmp_collection",
    "ddp_modules",
    "full_weights",
    "load_full_weights",
    "shard_torchrec",
    "table_plan_helper",
    "torchrec_ebc",
]

_FUSED = "fused"  # TorchRec's EmbeddingComputeKernel.FUSED: FBGEMM TBE, optimizer in backward


def torchrec_ebc(rows: Sequence[int], dim: int) -> EmbeddingBagCollection:
    """TorchRec's collection of tables ``t<i>`` (feature ``f<i>``, sum pooling), on meta."""
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                name=f"t{i}",
                num_embeddings=r,
                embedding_dim=dim,
                feature_names=[f"f{i}"],
                pooling=PoolingType.SUM,
            )
            for i, r in enumerate(rows)
        ],
        device=torch.device("meta"),
    )


class UniformEBCModel(nn.Module):
    """``torchrec_ebc(rows, dim)`` on CPU, weights uniform in +-0.2 from seed 0: the model
    the TorchRec comparison tests shard with both libraries (forward returns the pooled
    ``KeyedTensor``)."""

    def __init__(self, rows: Sequence[int], dim: int) -> None:
        super().__init__()
        self.ebc = torchrec_ebc(rows, dim).to_empty(device="cpu")
        gen = torch.Generator().manual_seed(0)
        for table in self.ebc.embedding_bags.values():
            with torch.no_grad():
                table.weight.uniform_(-0.2, 0.2, generator=gen)

    def forward(self, kjt: KeyedJaggedTensor):
        return self.ebc(kjt)


def table_plan_helper(kind: str, shard_group_size: int) -> Callable:
    """TorchRec plan helper for one of benchmarks/distributed.py's table kinds ("tw:3", "rw")."""
    name, _, arg = kind.partition(":")
    if name == "tw":
        return table_wise(rank=int(arg), compute_kernel=_FUSED)
    if name == "rw":
        return row_wise(compute_kernel=_FUSED)
    if name == "cw":
        return column_wise(ranks=list(range(shard_group_size)), compute_kernel=_FUSED)
    if name == "dp":
        return data_parallel()
    raise ValueError(f"unknown table kind {kind!r}")


def _plan(
    model: nn.Module,
    kinds: Sequence[str],
    shard_group_size: int,
    sharder: EmbeddingBagCollectionSharder,
) -> ShardingPlan:
    """Manual plan for ``model.ebc`` over ``shard_group_size`` ranks (no planner involved)."""
    module_plan = construct_module_sharding_plan(
        model.ebc,
        {f"t{i}": table_plan_helper(kind, shard_group_size) for i, kind in enumerate(kinds)},
        sharder=sharder,
        local_size=shard_group_size,
        world_size=shard_group_size,
        device_type="cpu",
    )
    return ShardingPlan({"ebc": module_plan})


def cpu_dmp_collection(**kwargs) -> DMPCollection:
    """``DMPCollection(**kwargs)`` on CPU (see the module docstring for the two patches)."""
    init = DMPCollection.__init__
    consts = init.__code__.co_consts
    if consts.count("mtia") != 1:  # the assert's second comparison; nothing else uses "mtia"
        raise RuntimeError("DMPCollection.__init__ changed; the CPU patch no longer applies")
    patched = types.FunctionType(
        init.__code__.replace(co_consts=tuple("cpu" if c == "mtia" else c for c in consts)),
        init.__globals__,
        init.__name__,
        init.__defaults__,
        init.__closure__,  # keeps the __class__ cell: super() still means DMP's base
    )
    patched.__kwdefaults__ = init.__kwdefaults__
    remap = DMPCollection._remap_sharding_plan

    def remap_to_cpu(self, plan: ShardingPlan, *args, **kw) -> None:
        remap(self, plan, *args, **kw)
        for module_plan in plan.plan.values():
            for sharding in module_plan.values():
                for shard in getattr(sharding.sharding_spec, "shards", None) or []:
                    shard.placement = _remote_device(f"rank:{shard.placement.rank()}/cpu")

    cls = type(
        "CpuDMPCollection",
        (DMPCollection,),
        {"__init__": patched, "_remap_sharding_plan": remap_to_cpu},
    )
    return cls(**kwargs)


def _local_blocks(value: object) -> list[tuple[torch.Tensor, tuple[int, ...]]] | None:
    """This rank's blocks of a TorchRec table state: (tensor, offsets into the full table).

    ``DistributedModelParallel`` gives ShardedTensors; ``DMPCollection`` gives DTensors
    whose local tensor is a ``LocalShardsWrapper`` (their placements do not describe the
    blocks: table-wise shows ``Replicate``, empty off its rank). Both local blocks are the
    tables' storage (FBGEMM's TBE weights). None for a plain tensor.
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, ShardedTensor):
        return [(s.tensor, tuple(s.metadata.shard_offsets)) for s in value.local_shards()]
    if isinstance(value, DTensor):
        local = value.to_local()
        if not hasattr(local, "local_offsets"):
            raise TypeError(f"a DTensor whose local part is a {type(local).__name__}")
        return [(t, tuple(o)) for t, o in zip(local.local_shards(), local.local_offsets())]
    return None


def _where(block: torch.Tensor, offsets: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, block.shape))


def load_full_weights(model: nn.Module, full: Mapping[str, torch.Tensor]) -> None:
    """Copy the unsharded model's tensors ``full`` into TorchRec's sharded ``model``, each
    rank its own blocks: ``DistributedModelParallel`` (and ``DMPCollection``) build their
    tables with their own initialisation, so a comparison starts both libraries here.

    Plain tensors (the DDP-wrapped dense part) are copied whole. Keys lose DMP's
    ``module.`` prefix.
    """
    with torch.no_grad():
        for key, value in model.state_dict().items():
            want = full[key.removeprefix("module.")]
            blocks = _local_blocks(value)
            for block, offsets in blocks if blocks is not None else [(value, ())]:
                block.copy_(want[_where(block, offsets)] if offsets else want)


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """TorchRec sharded ``model``'s state as full tensors on every rank (collective).

    Every rank adds its blocks into zeros, the sums and the number of copies of each
    element are all-reduced over the world, and replicas (2D) are averaged: what
    ``sync()`` leaves them at, equal. Keys lose DMP's ``module.`` prefix.
    """
    out = {}
    for key, value in model.state_dict().items():
        blocks = _local_blocks(value)
        if blocks is None:
            out[key.removeprefix("module.")] = value.detach().clone()
            continue
        total = torch.zeros(value.shape, dtype=value.dtype)
        copies = torch.zeros(value.shape, dtype=value.dtype)
        for block, offsets in blocks:
            total[_where(block, offsets)] += block.detach()
            copies[_where(block, offsets)] += 1
        dist.all_reduce(total)
        dist.all_reduce(copies)
        if not bool((copies > 0).all()):
            raise ValueError(f"{key}: some elements are on no rank")
        out[key.removeprefix("module.")] = total / copies
    return out


def _fused_sharder(lr: float, eps: float) -> EmbeddingBagCollectionSharder:
    """TorchRec's sharder with FBGEMM's fused exact row-wise Adagrad."""
    return EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": lr,
            "eps": eps,
        }
    )


def ddp_modules(model: nn.Module) -> list[DistributedDataParallel]:
    """The DDP wrappers inside a sharded model: the dense one and data-parallel tables' lookups.

    TorchRec keeps the lookups in a plain list (``_lookups``), not as submodules.
    """
    found = []
    for module in model.modules():
        for m in [module, *getattr(module, "_lookups", [])]:
            if isinstance(m, DistributedDataParallel) and m not in found:
                found.append(m)
    return found


def ddp_estimate(ddps: Sequence[tuple[dist.ProcessGroup | None, list[nn.Parameter]]]) -> int:
    """Bytes a rank sends in DDP's gradient all-reduces: 2 (g-1)/g x reduced bytes, per DDP."""
    total = 0
    for group, params in ddps:
        size = (group or dist.group.WORLD).size()
        nbytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        total += 2 * (size - 1) * nbytes // size
    return total


def build_torchrec(w: Workload, kinds: list[str], shard_group_size: int):
    """(model, optimizers, per-step hook, DDP bytes estimate, KJT type) for TorchRec, as
    ``run_loop.build_dtrec`` for dtrec."""
    model, optimizers, hook = shard_torchrec(
        Model(torchrec_ebc(w.rows, w.dim), w), kinds, shard_group_size, LR, EPS
    )
    ddp = ddp_estimate([(m.process_group, m._module_parameters) for m in ddp_modules(model)])
    return model, optimizers, hook, ddp, KeyedJaggedTensor


def shard_torchrec(
    model: nn.Module,
    kinds: Sequence[str],
    shard_group_size: int,
    lr: float,
    eps: float,
) -> tuple[nn.Module, list[torch.optim.Optimizer], Callable[[], None] | None]:
    """Shard ``model`` (``.ebc`` a TorchRec collection on meta, ``.dense`` the MLP) with TorchRec.

    ``kinds``: per table "tw:<shard rank>", "rw", "cw" or "dp". A shard group smaller than the
    world gives ``DMPCollection`` (2D), else ``DistributedModelParallel``. Sharded tables get
    FBGEMM's fused exact row-wise Adagrad; data-parallel tables (dense kernel, gradients
    all-reduced by DDP) get TorchRec's ``RowWiseAdagrad``; the MLP ``torch.optim.Adagrad``.
    Returns (model, optimizers, per-step hook): the hook is ``DMPCollection.sync`` for 2D
    (replica weights and optimizer state averaged after every step), else None.
    """
    world = dist.get_world_size()
    sharder = _fused_sharder(lr, eps)
    plan = _plan(model, kinds, shard_group_size, sharder)
    cpu = torch.device("cpu")
    hook = None
    if shard_group_size == world:
        sharded = DistributedModelParallel(model, device=cpu, plan=plan, sharders=[sharder])
    else:
        sharded = cpu_dmp_collection(
            module=model,
            device=cpu,
            plan=plan,
            world_size=world,
            sharding_group_size=shard_group_size,
            global_pg=dist.group.WORLD,
            sharders=[sharder],
        )
        hook = sharded.sync
    named = dict(sharded.named_parameters())
    dense = [p for n, p in named.items() if n.startswith("dense.")]
    dp_tables = [named[f"ebc.embedding_bags.t{i}.weight"] for i, k in enumerate(kinds) if k == "dp"]
    optimizers: list[torch.optim.Optimizer] = [torch.optim.Adagrad(dense, lr=lr)]
    if dp_tables:
        optimizers.append(RowWiseAdagrad(dp_tables, lr=lr, eps=eps))
    return sharded, optimizers, hook


def torchrec_planner_kinds(
    rows: Sequence[int], dim: int, world: int, batch: int, pooling: float, lr: float, eps: float
) -> tuple[list[str], float]:
    """TorchRec's ``EmbeddingShardingPlanner`` on CPU for the tables of ``torchrec_ebc``:
    its plan as benchmarks/distributed.py table kinds ("tw:r", "rw", "cw", "dp"), and the
    seconds ``plan`` took. Runs in one process (no collective)."""
    import time

    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner import Topology as TorchRecTopology
    from torchrec.distributed.planner.types import ParameterConstraints

    sharder = _fused_sharder(lr, eps)
    planner = EmbeddingShardingPlanner(
        topology=TorchRecTopology(world_size=world, compute_device="cpu", local_world_size=world),
        batch_size=batch,
        constraints={
            f"t{i}": ParameterConstraints(pooling_factors=[pooling]) for i in range(len(rows))
        },
    )
    model = nn.Module()
    model.ebc = torchrec_ebc(rows, dim)
    start = time.perf_counter()
    plan = planner.plan(model, [sharder])
    seconds = time.perf_counter() - start
    kinds = []
    for i in range(len(rows)):
        sharding = plan.plan["ebc"][f"t{i}"]
        kind = sharding.sharding_type
        if kind == "table_wise":
            kinds.append(f"tw:{sharding.ranks[0]}")
        elif kind in ("row_wise", "column_wise", "data_parallel"):
            kinds.append({"row_wise": "rw", "column_wise": "cw", "data_parallel": "dp"}[kind])
        else:
            raise ValueError(f"TorchRec chose {kind} for t{i}; no dtrec kind maps to it here")
    return kinds, seconds
