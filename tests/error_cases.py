"""One way to trigger every error listed in docs/errors.md, keyed by the row's id.

``LOCAL``: cases run in the test process, each a function of a fresh temporary directory
(a fake process group stands in for the world where a mesh is needed). ``WORLD``: cases
that need real peers; ``run_world_cases`` runs them all in one gloo world and returns each
rank's outcome. ``tests/test_errors.py`` checks both against the doc.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import dtrec
from dtrec import ops
from dtrec.checkpoint import dcp as checkpoint
from dtrec.ops.backends import registry as backend
from dtrec.optim import SGD, Adam, RowWiseAdagrad
from dtrec.placements import ColumnWise, DataParallel, Grid, RowWise, TableRowWise, TableWise
from dtrec.planning.dry_run import load_config
from dtrec.planning.mesh_choice import rank_shard_group_sizes
from dtrec.planning.plan import ShardingPlan
from dtrec.planning.planner import TableConstraint
from tests.fake_world import fake_world

KJT, JT, KT = dtrec.KeyedJaggedTensor, dtrec.JaggedTensor, dtrec.KeyedTensor
Cfg, EBC = dtrec.EmbeddingBagConfig, dtrec.EmbeddingBagCollection
Case = Callable[[Path], object]


def ids(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def one_table() -> dict[str, dtrec.EmbeddingBagConfig]:
    return {"t0": dtrec.EmbeddingBagConfig("t0", 100, 8, ["f0"], "sum")}


def tables() -> list[dtrec.EmbeddingBagConfig]:
    return [Cfg("t0", 10, 4, ["f0"]), Cfg("t1", 5, 3, ["f1"], pooling="mean")]


class Model(nn.Module):
    """Two small tables and a linear layer."""

    def __init__(self, configs: list[dtrec.EmbeddingBagConfig] | None = None) -> None:
        super().__init__()
        self.sparse = EBC(configs or tables())
        self.dense = nn.Linear(7, 1)

    def forward(self, kjt: dtrec.KeyedJaggedTensor) -> torch.Tensor:
        return self.dense(self.sparse(kjt).values()).squeeze(1)


class TwoCollections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = EBC([Cfg("t0", 10, 4, ["f0"])])
        self.b = EBC([Cfg("t1", 5, 3, ["f1"])])


def in_backward(model: nn.Module, **tables: list[tuple[type, dict]]) -> nn.Module:
    """``model`` with its tables marked as torch's ``_apply_optimizer_in_backward`` marks
    them (table name -> [(class, kwargs)]; only the marker lists, no optimizer built)."""
    for module in model.modules():
        for name, table in getattr(module, "embedding_bags", {}).items():
            if name in tables:
                table.weight._in_backward_optimizers = [None] * len(tables[name])
                table.weight._optimizer_classes = [cls for cls, _ in tables[name]]
                table.weight._optimizer_kwargs = [kwargs for _, kwargs in tables[name]]
    return model


def sgd(**kwargs: object) -> list[tuple[type, dict]]:
    return [(torch.optim.SGD, {"lr": 0.1, **kwargs})]


def batch(f0: tuple[int, ...] = (1, 2), f1: tuple[int, ...] = (3,)) -> dtrec.KeyedJaggedTensor:
    """Batch of 2: f0 = [[f0...], []], f1 = [[], [f1...]]."""
    return KJT(["f0", "f1"], ids(*f0, *f1), ids(len(f0), 0, 0, len(f1)))


def fake(size: int, fn: Callable[[], object]) -> Case:
    """A case that runs ``fn()`` as rank 0 of a fake world of ``size`` ranks."""

    def run(tmp: Path) -> None:
        with fake_world(0, size):
            fn()

    return run


def on_mesh(size: int, shards: int, fn: Callable[[DeviceMesh], object], nodes=None) -> Case:
    """A case that runs ``fn(mesh)`` on a (shards, size / shards) mesh of a fake world."""
    return fake(size, lambda: fn(dtrec.init_mesh("cpu", shards, nodes)))


_DIMS = ("shard", "replicate")


def distributed(mesh, plan=None, optimizer=None, model: nn.Module | None = None) -> nn.Module:
    torch.manual_seed(0)
    return dtrec.distribute_module(model or Model(), mesh, plan, optimizer)


def _reshard_torch_state_offloaded(mesh: DeviceMesh) -> None:
    """A table with torch Adam state (set by hand: a step needs real peers) to an offloaded
    spec, which trains only with a fused optimizer."""
    model = distributed(mesh, {"sparse.t0": RowWise(), "sparse.t1": RowWise()})
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    weight = model.sparse.embedding_bags["t0"].weight
    optimizer.state[weight] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(weight)}
    dtrec.reshard(model, {"sparse.t0": RowWise(cache_rows=2)}, optimizers=[optimizer])


def _reshard_tensor_parallel(mesh: DeviceMesh) -> None:
    """A dense layer TP distributed before distribute_module, to a new mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = Model()
    tp = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    parallelize_module(model, tp, {"dense": ColwiseParallel()})
    model = dtrec.distribute_module(model, mesh, None, SGD(0.1))
    dtrec.reshard(model, {}, mesh=dtrec.init_mesh("cpu", 4), optimizers=[])


def all_dp(mesh: DeviceMesh) -> nn.Module:
    """A distributed model whose input-dist needs no collective (all tables data parallel)."""
    return distributed(mesh, {"sparse.t0": DataParallel(), "sparse.t1": DataParallel()})


def _reported_later(mesh: DeviceMesh) -> None:
    """A one-rank world, Triton backend, fused optimizer: the bad batch's ids are checked on
    the device and the next forward reports them."""
    backend.set_backend("triton")
    try:
        sparse = distributed(mesh, optimizer=SGD(lr=0.1), model=EBC(tables()))
        sparse(batch(f0=(1, 10))).values().sum().backward()  # t0 has 10 rows: flagged only
        sparse(batch())
    finally:
        backend.set_backend("auto")


def _refused_later(mesh: DeviceMesh) -> None:
    """A one-rank world, Triton backend, fused optimizer, t0 offloaded behind 2 slots: a
    batch of 3 distinct rows is flagged on the device and the next forward refuses it."""
    backend.set_backend("triton")
    try:
        sparse = distributed(
            mesh, {"t0": RowWise(cache_rows=2)}, optimizer=SGD(lr=0.1), model=EBC(tables())
        )
        sparse(batch(f0=(6, 7, 8))).values().sum().backward()
        sparse(batch())
    finally:
        backend.set_backend("auto")


def loss(model: nn.Module, kjt: dtrec.KeyedJaggedTensor) -> torch.Tensor:
    return model(kjt).sum()


def copy(kjt: dtrec.KeyedJaggedTensor) -> dtrec.KeyedJaggedTensor:
    """The same batch in a new object (what a pipeline cannot have prefetched)."""
    return KJT(kjt.keys(), kjt.values(), kjt.lengths())


def run_pipeline(mesh: DeviceMesh, model=None, loss_fn=loss, **kw) -> None:
    list(dtrec.TrainPipeline(model or all_dp(mesh), None, loss_fn, **kw).run([batch()]))


def load_fused(mesh: DeviceMesh, t0_state: dict | None) -> None:
    """Load a fused row-wise Adagrad state whose "sparse.t0" entry is ``t0_state``
    (None: leave the table out)."""
    model = distributed(mesh, optimizer=RowWiseAdagrad(lr=0.1))
    state = model.fused_optimizer.state_dict()["state"]
    if t0_state is None:
        del state["sparse.t1"]
    else:
        state["sparse.t0"] = t0_state
    model.fused_optimizer.load_state_dict(model.fused_optimizer.state_dict() | {"state": state})


def load_fused_groups(mesh: DeviceMesh, change: Callable[[dict], object]) -> None:
    """Load a fused row-wise Adagrad ``state_dict()`` after ``change(state_dict)``."""
    model = distributed(mesh, optimizer=RowWiseAdagrad(lr=0.1))
    state = model.fused_optimizer.state_dict()
    change(state)
    model.fused_optimizer.load_state_dict(state)


def fused_step_with_group(mesh: DeviceMesh, **change: object) -> None:
    """A step of an all-data-parallel fused SGD model after ``change`` to its param group."""
    model = distributed(
        mesh, {"sparse.t0": DataParallel(), "sparse.t1": DataParallel()}, SGD(lr=0.1)
    )
    model.fused_optimizer.param_groups[0].update(change)
    loss(model, batch()).backward()


def load_shape(mesh: DeviceMesh) -> None:
    model = distributed(mesh)
    state = model.state_dict()
    state["sparse.embedding_bags.t0.weight"] = torch.zeros(11, 4)
    model.load_state_dict(state)


def _w(rows: int = 10, dim: int = 4, **kw) -> torch.Tensor:
    return torch.zeros(rows, dim, **kw)


def eb(*args, **kw) -> Case:
    """A case calling ``dtrec.ops.embedding_bag(*args, **kw)``."""
    return lambda tmp: ops.embedding_bag(*args, **kw)


def triton_on_cpu_without_interpreter(tmp: Path) -> None:
    with (
        mock.patch.object(backend, "_backend", "triton"),
        mock.patch.object(backend, "triton_available", lambda: True),
        mock.patch.dict(os.environ),
    ):
        os.environ.pop("TRITON_INTERPRET", None)
        ops.embedding_bag([_w()], ids(1), ids(0, 1))


def planner_config(tmp: Path, data: object) -> None:
    path = tmp / "model.json"
    path.write_text(json.dumps(data))
    load_config(str(path))


def saved(tmp: Path) -> Path:
    """A checkpoint root of ``Model`` (unsharded, no process group) with torch SGD state."""
    model = Model()
    checkpoint.save(tmp / "ckpt", model, torch.optim.SGD(model.parameters(), lr=0.1))
    return tmp / "ckpt"


def load_into(
    change: Callable[[Path], object] = lambda root: None,
    model: Callable[[], nn.Module] = Model,
    optimizer: Callable[[object], torch.optim.Optimizer] | None = None,
) -> Case:
    """A case: save a checkpoint, ``change(root)``, load it into ``model()``."""

    def run(tmp: Path) -> None:
        root = saved(tmp)
        change(root)
        target = model()
        checkpoint.load(root, target, optimizer(target.parameters()) if optimizer else None)

    return run


def unpublish(root: Path) -> Path:
    directory = next(root.iterdir())
    (directory / checkpoint.MARKER).unlink()
    return directory


def with_layer(name: str, layer: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        model = Model()
        setattr(model, name, layer())
        return model

    return make


def a_file(tmp: Path) -> Path:
    (tmp / "file").write_text("not a directory")
    return tmp / "file"


def fused_model_loads_unfused_checkpoint(tmp: Path) -> None:
    root = saved(tmp)
    with fake_world(0, 2):
        model = distributed(dtrec.init_mesh("cpu", 2), optimizer=Adam(lr=0.1))
        checkpoint.load(root, model)


def checkpoint_with_bad_param_group(tmp: Path) -> None:
    """A checkpoint whose marker records a fused SGD group with lr -1, into a fused model."""
    root = saved(tmp)
    directory = next(root.iterdir())
    marker = json.loads((directory / checkpoint.MARKER).read_text())
    group = {"lr": -1.0, "params": ["sparse.t0", "sparse.t1"]}
    marker["fused_optimizer"] = {"type": "SGD", "config": {"lr": 0.1}, "param_groups": [group]}
    (directory / checkpoint.MARKER).write_text(json.dumps(marker))
    with fake_world(0, 2):
        checkpoint.load(root, distributed(dtrec.init_mesh("cpu", 2), optimizer=SGD(lr=0.1)))


def fused_optimizer_given_as_dense(tmp: Path) -> None:
    with fake_world(0, 2):
        model = distributed(dtrec.init_mesh("cpu", 2), optimizer=SGD(lr=0.1))
        checkpoint.save(tmp, model, model.fused_optimizer)


def unknown_backend_from_env(tmp: Path) -> None:
    with mock.patch.object(backend, "_backend", "cudnn"):  # as if DTREC_BACKEND=cudnn
        ops.get_backend()


# ------------------------------------------------------------------- TorchRec look-alikes
# dtrec recognises TorchRec objects by class name and fields (it never imports torchrec),
# so these stand-ins trigger the same errors without torchrec installed.

PoolingType = enum.Enum("PoolingType", {"SUM": "SUM", "MEAN": "MEAN", "NONE": "NONE"})


DataType = enum.Enum("DataType", {"FP32": "FP32", "FP16": "FP16", "INT8": "INT8"})


@dataclass
class EmbeddingBagConfig:  # TorchRec's field names
    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: list[str] = field(default_factory=list)
    pooling: object = PoolingType.SUM
    data_type: object = DataType.FP32
    use_virtual_table: bool = False


def torchrec_like(module: str, name: str) -> nn.Module:
    return type(name, (nn.Module,), {"__module__": module})()


def with_managed_collision_tower() -> nn.Module:
    model = Model()
    model.towers = nn.ModuleDict(
        {"user": torchrec_like("torchrec.modules.hash_mc_modules", "HashZchManagedCollisionModule")}
    )
    return model


def torchrec_mch_with_offset() -> None:
    """TorchRec's MCHManagedCollisionModule as its own row-wise shard (a global offset)."""
    from dtrec.interop.managed_collision import from_torchrec_mch

    mch = torchrec_like("torchrec.modules.mc_modules", "MCHManagedCollisionModule")
    mch._output_global_offset = 5
    from_torchrec_mch(mch, "user")


def managed_collision_model() -> nn.Module:
    """A model whose ``sparse`` is a managed-collision collection of one table ``item``."""
    from dtrec.modules.eviction import LFU

    cfgs = [dtrec.EmbeddingBagConfig("item", 10, 4, ["i0"])]
    remap = dtrec.MCHManagedCollisionModule(10, eviction_policy=LFU(), eviction_interval=1)
    model = nn.Module()
    model.sparse = dtrec.ManagedCollisionEmbeddingBagCollection(
        dtrec.EmbeddingBagCollection(cfgs), dtrec.ManagedCollisionCollection({"item": remap}, cfgs)
    )
    return model


def distributed_managed_collision(mesh: DeviceMesh, **kwargs) -> nn.Module:
    kwargs.setdefault("optimizer", SGD(lr=0.1))
    return dtrec.distribute_module(managed_collision_model(), mesh, **kwargs)


def mixed_dtype_sequence() -> nn.Module:
    """An EmbeddingCollection whose tables have two dtypes."""
    seq = dtrec.EmbeddingCollection(
        [dtrec.EmbeddingConfig("t0", 10, 4, ["f0"]), dtrec.EmbeddingConfig("t1", 10, 4, ["f1"])]
    )
    seq.embeddings["t0"].half()
    return seq


class ShardingPlanTR:
    """TorchRec's ShardingPlan: ``plan`` maps module path -> {table: ParameterSharding}."""

    def __init__(self, plan: dict) -> None:
        self.plan = plan


ShardingPlanTR.__name__ = "ShardingPlan"


@dataclass
class ParameterSharding:
    sharding_type: str
    compute_kernel: str = "dense"
    ranks: list[int] | None = None
    sharding_spec: object = None
    cache_params: object = None


@dataclass
class CacheParams:
    load_factor: float | None = None


@dataclass
class _Shard:
    shard_offsets: list[int]
    shard_sizes: list[int]


@dataclass
class _Spec:
    shards: list[_Shard]


@dataclass
class ParameterConstraints:
    sharding_types: list[str] | None = None
    compute_kernels: list[str] | None = None
    min_partition: int | None = None
    pooling_factors: list[float] = field(default_factory=lambda: [1.0])
    cache_params: object = None
    key_value_params: object = None


def tr_plan(mesh: DeviceMesh, **t0: object) -> object:
    """dtrec.plan of ``Model()`` under a TorchRec plan giving t0 ``ParameterSharding(**t0)``."""
    entries = {"t0": ParameterSharding(**t0), "t1": ParameterSharding("data_parallel")}
    return dtrec.plan(Model(), mesh, ShardingPlanTR({"sparse": entries}))


def cw_blocks(ranks: list[int], width: int) -> dict:
    shards = [_Shard([0, width * i], [10, width]) for i in range(len(ranks))]
    return {"sharding_type": "column_wise", "ranks": ranks, "sharding_spec": _Spec(shards)}


CommType = enum.Enum("CommType", {"FP32": "fp32", "FP16": "fp16", "FP8": "fp8"})


@dataclass
class QCommsConfigTR:  # TorchRec's fbgemm_qcomm_codec.QCommsConfig
    forward_precision: object = CommType.FP32
    backward_precision: object = CommType.FP32
    forward_loss_scale: float | None = None
    backward_loss_scale: float | None = None


QCommsConfigTR.__name__ = "QCommsConfig"


def summary_of_no_steps(tmp: Path) -> None:
    with dtrec.comm_stats() as stats:
        pass
    stats.summary(steps=0)


def position_weighted(max_lengths: dict[str, int], features: object = None) -> nn.Module:
    """A feature-processed collection over two sum-pooled tables (f0, f1)."""
    ebc = EBC([Cfg("t0", 10, 4, ["f0"]), Cfg("t1", 5, 3, ["f1"])], is_weighted=True)
    if features is None:
        features = {f: dtrec.PositionWeightedModule(n) for f, n in max_lengths.items()}
    return dtrec.FeatureProcessedEmbeddingBagCollection(ebc, features)


LOCAL: dict[str, Case] = {
    # KeyedJaggedTensor, JaggedTensor, KeyedTensor
    "E001": lambda tmp: KJT("f0", ids(1), ids(1)),
    "E002": lambda tmp: KJT(["f0", 3], ids(1), ids(1, 0)),
    "E003": lambda tmp: KJT(["f0", "f0"], ids(1), ids(1, 0)),
    "E004": lambda tmp: KJT(["f0"], torch.tensor([1.0]), ids(1)),
    "E005": lambda tmp: KJT(["f0"], ids(1), ids(1).view(1, 1)),
    "E006": lambda tmp: KJT(["f0"], ids(1, 2, 3), ids(3), weights=ids(1, 1, 1)),
    "E007": lambda tmp: KJT(["f0"], ids(1, 2, 3), ids(3), weights=torch.ones(2)),
    "E008": lambda tmp: KJT(["f0"], ids(1), torch.ones(1, dtype=torch.int64, device="meta")),
    "E009": lambda tmp: KJT(["f0", "f1"], ids(1, 2, 3), ids(1, 1, 1)),
    "E010": lambda tmp: KJT(["f0", "f1"], ids(1), ids(1, 0, -1, 1)),
    "E011": lambda tmp: KJT(["f0", "f1"], ids(1, 2, 3), ids(1, 0, 2, 1)),
    "E012": lambda tmp: KJT.from_dict({"f0": ids(1, 2)}),
    "E013": lambda tmp: KJT.from_dict(
        {"f0": JT(ids(1), ids(1, 0)), "f1": JT(ids(2), ids(1, 0, 0))}
    ),
    "E014": lambda tmp: KJT.from_dict(
        {"f0": JT(ids(1), ids(1), torch.ones(1)), "f1": JT(ids(2), ids(1))}
    ),
    "E015": lambda tmp: batch()["f9"],
    "E016": lambda tmp: batch().permute([0, 5]),
    "E017": lambda tmp: batch().permute([1.0]),
    "E018": lambda tmp: batch().split([1]),
    "E019": lambda tmp: batch().weights(),
    "E020": lambda tmp: JT(ids(1, 2), ids(1, 2)),
    "E021": lambda tmp: JT(ids(1, 2), ids(3, -1)),
    "E022": lambda tmp: KT(["f0", "f1"], [4], torch.zeros(2, 4)),
    "E023": lambda tmp: KT(["f0", "f1"], [4, 4], torch.zeros(2, 7)),
    "E024": lambda tmp: KT(["f0"], [4], torch.zeros(2, 4))["f9"],
    # EmbeddingBagConfig, EmbeddingBagCollection
    "E025": lambda tmp: Cfg("", 10, 4),
    "E026": lambda tmp: Cfg("t0", 0, 4),
    "E027": lambda tmp: Cfg("t0", 10, 4, pooling="max"),
    "E028": lambda tmp: Cfg("t0", 10, 4, "user_id"),
    "E029": lambda tmp: Cfg("t0", 10, 4, ["f0", ""]),
    "E030": lambda tmp: Cfg("t0", 10, 4, ["f0", "f0"]),
    "E031": lambda tmp: EBC(Cfg("t0", 10, 4)),
    "E032": lambda tmp: EBC([{"name": "t0"}]),
    "E033": lambda tmp: EBC([*tables(), Cfg("t0", 3, 2, ["f9"])]),
    "E034": lambda tmp: EBC([*tables(), Cfg("t2", 3, 2, ["f0"])]),
    "E035": lambda tmp: EBC(tables(), bounds_check="warn"),
    # forward
    "E036": lambda tmp: EBC(tables())({"f0": ids(1)}),
    "E037": lambda tmp: EBC(tables())(batch().permute(["f0"])),
    "E038": lambda tmp: EBC(tables())(
        KJT(["f0", "f1"], ids(1, 2, 3), ids(1, 1, 1), stride_per_key_per_rank=[[1], [2]])
    ),
    "E039": lambda tmp: EBC(tables())(KJT(["f0", "f1"], ids(1, 2), ids(1, 0, 0, 1), torch.ones(2))),
    "E040": lambda tmp: EBC(tables())(batch(f0=(1, 10))),
    "E041": lambda tmp: EBC(tables())(batch(f1=(-1,))),
    "E042": lambda tmp: EBC(tables(), device="meta")(batch()),
    "E300": fake(1, lambda: _reported_later(dtrec.init_mesh("cpu", 1))),
    # init_mesh
    "E046": lambda tmp: dtrec.init_mesh("cpu", 1),
    "E047": fake(4, lambda: dtrec.init_mesh("cpu", "2")),
    "E048": fake(4, lambda: dtrec.init_mesh("cpu", 0)),
    "E049": fake(4, lambda: dtrec.init_mesh("cpu", 3)),
    "E050": fake(4, lambda: dtrec.init_mesh("cpu", 2, node_size="2")),
    "E051": fake(4, lambda: dtrec.init_mesh("cpu", 2, node_size=0)),
    "E052": fake(4, lambda: dtrec.init_mesh("cpu", 2, node_size=3)),
    "E053": fake(12, lambda: dtrec.init_mesh("cpu", 2, node_size=4)),
    # specs that do not fit the mesh
    "E054": on_mesh(2, 2, lambda m: distributed(m, {"sparse.t0": TableWise(rank=2)})),
    "E055": on_mesh(2, 2, lambda m: dtrec.distribute_tensor(_w(), m, TableWise(), "t0")),
    "E056": on_mesh(8, 8, lambda m: distributed(m, {"sparse.t0": ColumnWise()})),
    "E281": on_mesh(4, 4, lambda m: distributed(m, {"sparse.t0": ColumnWise(positions=(0, 4))})),
    "E282": on_mesh(
        8, 8, lambda m: distributed(m, {"sparse.t1": ColumnWise(positions=(0, 1, 2, 3, 4))})
    ),
    "E057": on_mesh(4, 2, lambda m: distributed(m, {"sparse.t0": TableRowWise()})),
    "E058": on_mesh(4, 4, lambda m: distributed(m, {"sparse.t0": TableRowWise(node=2)}), 2),
    "E059": on_mesh(8, 8, lambda m: distributed(m, {"sparse.t1": Grid()}), 1),
    # distribute_tensor
    "E060": on_mesh(2, 2, lambda m: dtrec.distribute_tensor([[0.0]], m, RowWise(), "t0")),
    "E061": on_mesh(2, 2, lambda m: dtrec.distribute_tensor(torch.zeros(10), m, RowWise(), "t0")),
    "E062": on_mesh(
        2, 2, lambda m: dtrec.distribute_tensor(_w(dtype=torch.int64), m, RowWise(), "t0")
    ),
    "E063": on_mesh(2, 2, lambda m: dtrec.distribute_tensor(_w(0), m, RowWise(), "t0")),
    "E064": on_mesh(2, 2, lambda m: dtrec.distribute_tensor(_w(), m, "RW", "t0")),
    "E065": lambda tmp: dtrec.distribute_tensor(_w(), "cpu", RowWise(), "t0"),
    "E066": fake(2, lambda: dtrec.distribute_tensor(_w(), DeviceMesh("cpu", [0, 1]), RowWise())),
    # distribute_module and the distributed model
    # TorchRec's in-backward optimizer recipe (apply_optimizer_in_backward)
    "E270": on_mesh(
        2, 2, lambda m: distributed(m, model=in_backward(Model(), t0=[(torch.optim.Adagrad, {})]))
    ),
    "E271": on_mesh(
        2, 2, lambda m: distributed(m, model=in_backward(Model(), t0=sgd(momentum=0.9)))
    ),
    "E272": on_mesh(2, 2, lambda m: distributed(m, model=in_backward(Model(), t0=sgd(eps=0.1)))),
    "E273": on_mesh(
        2,
        2,
        lambda m: distributed(
            m,
            model=in_backward(
                Model(), t0=[(torch.optim.Adam, {"betas": (0.9, 0.9), "beta1": 0.8})]
            ),
        ),
    ),
    "E274": on_mesh(2, 2, lambda m: distributed(m, model=in_backward(Model(), t0=sgd(lr=-1.0)))),
    "E275": on_mesh(
        2, 2, lambda m: distributed(m, model=in_backward(Model(), t0=sgd() + sgd(), t1=sgd()))
    ),
    "E276": on_mesh(2, 2, lambda m: distributed(m, model=in_backward(Model(), t0=sgd()))),
    "E277": on_mesh(
        2, 2, lambda m: distributed(m, model=in_backward(Model(), t0=sgd(), t1=sgd(lr=0.2)))
    ),
    "E278": on_mesh(
        2,
        2,
        lambda m: distributed(
            m, model=in_backward(TwoCollections(), t0=sgd(), t1=[(torch.optim.Adam, {})])
        ),
    ),
    "E280": on_mesh(
        2,
        2,
        lambda m: setattr(
            distributed(m, optimizer=SGD(lr=0.1)).fused_optimizer, "optimizer", Adam(lr=0.1)
        ),
    ),
    "E279": on_mesh(
        2,
        2,
        lambda m: distributed(m, None, Adam(lr=0.1), in_backward(Model(), t0=sgd(), t1=sgd())),
    ),
    "E067": on_mesh(2, 2, lambda m: dtrec.distribute_module(Model().state_dict(), m)),
    "E068": on_mesh(2, 2, lambda m: distributed(m, [RowWise(), RowWise()])),
    "E069": on_mesh(2, 2, lambda m: distributed(m, {"t0": RowWise()})),
    "E070": on_mesh(2, 2, lambda m: distributed(m, {"sparse.t0": "RowWise"})),
    "E071": on_mesh(2, 2, lambda m: distributed(m, optimizer=torch.optim.SGD)),
    "E072": on_mesh(2, 2, lambda m: dtrec.distribute_module(Model(), m, sync_every=0)),
    "E073": on_mesh(2, 2, lambda m: distributed(m, model=nn.Linear(2, 2))),
    "E074": on_mesh(2, 2, lambda m: distributed(m, model=distributed(m))),
    "E075": on_mesh(2, 2, lambda m: distributed(m, model=Model().to("meta"))),
    "E076": fake(
        4,
        lambda: distributed(
            DeviceMesh("cpu", torch.arange(2).view(2, 1), mesh_dim_names=("shard", "replicate"))
        ),
    ),
    "E078": on_mesh(2, 2, load_shape),
    "E079": on_mesh(2, 2, lambda m: load_fused(m, None)),
    "E080": on_mesh(2, 2, lambda m: load_fused(m, {"exp_avg": torch.zeros(10, 4)})),
    "E081": on_mesh(2, 2, lambda m: load_fused(m, {"sum": torch.zeros(11)})),
    # model.fused_optimizer: param groups read at every step, their state_dict
    "E171": on_mesh(2, 2, lambda m: fused_step_with_group(m, weight_decay=0.01)),
    "E172": on_mesh(2, 2, lambda m: fused_step_with_group(m, lr=float("nan"))),
    "E173": on_mesh(2, 2, lambda m: load_fused_groups(m, lambda s: s.pop("param_groups"))),
    "E174": on_mesh(
        2, 2, lambda m: load_fused_groups(m, lambda s: s["param_groups"].append({"lr": 0.1}))
    ),
    "E175": on_mesh(
        2, 2, lambda m: load_fused_groups(m, lambda s: s["param_groups"][0]["params"].reverse())
    ),
    "E176": on_mesh(
        2, 2, lambda m: load_fused_groups(m, lambda s: s["param_groups"][0].pop("eps"))
    ),
    "E177": on_mesh(
        2,
        2,
        lambda m: distributed(m, optimizer=SGD(lr=0.1)).fused_optimizer.add_param_group(
            {"params": [torch.zeros(1)]}
        ),
    ),
    "E082": on_mesh(
        2, 2, lambda m: dtrec.ShardedEmbeddingBagCollection(tables(), {}, m, {"t0": RowWise()})
    ),
    # plan, TableConstraint, ShardingPlan.from_json, Topology, the planner CLI
    "E083": on_mesh(2, 2, lambda m: dtrec.plan(Model(), m, [("sparse.t0", RowWise())])),
    "E084": on_mesh(2, 2, lambda m: dtrec.plan(Model(), m, topology="h100")),
    "E085": on_mesh(
        4, 4, lambda m: dtrec.plan(Model(), m, {"sparse.t1": TableConstraint(types=(ColumnWise,))})
    ),
    "E086": on_mesh(
        2, 2, lambda m: dtrec.plan(Model(), m, topology=dtrec.Topology.cpu(memory_per_rank=100.0))
    ),
    "E087": lambda tmp: TableConstraint(types=("RowWise",)),
    "E088": lambda tmp: TableConstraint(min_shards=0),
    "E089": lambda tmp: TableConstraint(min_shards=4, max_shards=2),
    "E090": lambda tmp: TableConstraint(pooling_factor=-1.0),
    "E091": lambda tmp: ShardingPlan.from_json('["RowWise"]'),
    "E092": lambda tmp: ShardingPlan.from_json('{"sparse.t0": "RowWise"}'),
    "E093": lambda tmp: ShardingPlan.from_json('{"sparse.t0": {"type": "Rowwise"}}'),
    "E094": lambda tmp: ShardingPlan.from_json('{"sparse.t0": {"type": "TableWise", "rnak": 1}}'),
    "E095": lambda tmp: ShardingPlan.from_json('{"sparse.t0": '),
    "E096": lambda tmp: dtrec.Topology(optimizer="adagrad"),
    "E097": lambda tmp: dtrec.Topology(hbm_bandwidth=0),
    "E098": lambda tmp: dtrec.Topology(hbm_bandwidth="3e12"),
    "E099": lambda tmp: dtrec.Topology(memory_headroom=1.0),
    "E100": lambda tmp: dtrec.Topology(pooling_factors={"f0": -2.0}),
    "E239": lambda tmp: dtrec.Topology(qcomms="bf16"),
    "E254": lambda tmp: dtrec.Topology(qcomms={"sparse": None}).output_dist_bytes(),
    "E101": lambda tmp: planner_config(tmp, [{"name": "t0"}]),
    "E102": lambda tmp: planner_config(tmp, {"tables": [{"name": "t0", "rows": 10}]}),
    "E235": lambda tmp: planner_config(tmp, {"tables": [{"name": "t0", "kind": "seq"}]}),
    "E236": lambda tmp: planner_config(
        tmp, {"tables": [{"name": "t0", "kind": "sequence", "pooling": "sum"}]}
    ),
    "E237": lambda tmp: planner_config(
        tmp,
        {
            "tables": [
                {"name": "t0", "num_embeddings": 10, "embedding_dim": 4},
                {"name": "t0", "kind": "sequence", "num_embeddings": 10, "embedding_dim": 4},
            ]
        },
    ),  # fmt: skip
    "E238": lambda tmp: planner_config(tmp, {"tables": ["t0"]}),
    "E253": lambda tmp: planner_config(tmp, {"tables": [], "qcoms": {}}),
    "E250": lambda tmp: planner_config(tmp, {"tables": [], "qcomms": "bf16"}),
    "E251": lambda tmp: planner_config(tmp, {"tables": [], "qcomms": {"forward": "bf16"}}),
    "E252": lambda tmp: planner_config(
        tmp, {"tables": [], "qcomms": {"forward_precision": "int8"}}
    ),
    # the mesh choice
    "E341": lambda tmp: dtrec.choose_shard_group_size(one_table(), 0),
    "E342": lambda tmp: dtrec.choose_shard_group_size(one_table(), 8, node_size=3),
    "E343": lambda tmp: rank_shard_group_sizes(one_table(), 8, shard_group_sizes=[3, 5]),
    # fused optimizers
    "E103": lambda tmp: SGD(lr=-0.1),
    "E104": lambda tmp: SGD(lr=float("nan")),
    "E105": lambda tmp: RowWiseAdagrad(lr=0.1, eps=0.0),
    "E106": lambda tmp: Adam(lr=0.1, betas=0.9),
    # quantized communication
    "E180": lambda tmp: dtrec.QCommsConfig(forward_precision="int8"),
    "E181": lambda tmp: dtrec.QCommsConfig(backward_precision="fp16", backward_loss_scale=0.0),
    "E182": lambda tmp: dtrec.QCommsConfig(forward_precision="bf16", backward_loss_scale=8.0),
    "E183": on_mesh(2, 2, lambda m: dtrec.distribute_module(Model(), m, qcomms="bf16")),
    "E344": on_mesh(2, 2, lambda m: dtrec.distribute_module(Model(), m, same_batch=m)),
    "E184": on_mesh(
        2, 2, lambda m: dtrec.distribute_module(Model(), m, qcomms={"spars": dtrec.QCommsConfig()})
    ),
    "E185": on_mesh(
        2, 2, lambda m: dtrec.distribute_module(Model(), m, qcomms=QCommsConfigTR(CommType.FP8))
    ),
    # the op
    "E107": eb(_w(), ids(1), ids(0, 1)),
    "E108": eb([_w()], torch.tensor([1.0]), ids(0, 1)),
    "E109": eb([_w()], ids(1), torch.tensor([0.0, 1.0])),
    "E110": eb([_w(), _w()], ids(1), ids(0, 1)),
    "E111": eb([_w()], ids(1, 2), ids(1, 2)),
    "E112": eb([_w()], ids(1, 2, 3), ids(0, 2, 1, 3)),
    "E113": eb([_w()], ids(1), torch.tensor([0, 1], device="meta")),
    "E114": eb([_w(device="meta")], ids(1), ids(0, 1)),
    "E115": eb([_w(dtype=torch.int64)], ids(1), ids(0, 1)),
    "E116": eb([_w(), _w(dtype=torch.float16)], ids(1), ids(0, 1, 1)),
    "E117": eb([torch.zeros(10)], ids(1), ids(0, 1)),
    "E118": eb([_w()], ids(1), ids(0, 1), pooling="max"),
    "E119": eb([_w(), _w()], ids(1), ids(0, 1, 1), pooling=["sum"]),
    "E120": eb([_w()], ids(1), ids(0, 1), per_sample_weights=torch.ones(2)),
    "E121": eb([_w()], ids(1), ids(0, 1), per_sample_weights=ids(1)),
    "E122": eb([_w()], ids(1), ids(0, 1), "mean", per_sample_weights=torch.ones(1)),
    "E123": eb([_w(), _w(3)], ids(1, 3), ids(0, 1, 2)),
    "E124": eb([_w()], ids(1), ids(0, 1), bounds_check="warn"),
    "E125": lambda tmp: ops.set_backend("cudnn"),
    "E126": unknown_backend_from_env,
    "E127": triton_on_cpu_without_interpreter,
    # checkpoints
    "E128": lambda tmp: checkpoint.save(tmp, Model(), keep_last=0),
    "E129": lambda tmp: checkpoint.save(tmp, Model(), optimizer=RowWiseAdagrad(lr=0.1)),
    "E130": lambda tmp: checkpoint.save(a_file(tmp), Model()),
    "E131": lambda tmp: checkpoint.load(tmp / "nothing", Model()),
    "E132": lambda tmp: checkpoint.load(unpublish(saved(tmp)), Model()),
    "E133": load_into(lambda root: next(root.glob("*/*.distcp")).unlink()),
    "E134": load_into(model=lambda: Model([*tables(), Cfg("t9", 3, 2)])),
    "E135": load_into(model=lambda: Model(tables()[:1])),
    "E136": load_into(model=lambda: Model([Cfg("t0", 10, 5, ["f0"]), tables()[1]])),
    "E137": fused_model_loads_unfused_checkpoint,
    "E138": load_into(optimizer=lambda ps: torch.optim.Adagrad(ps, lr=0.1)),
    "E139": load_into(model=with_layer("dense", lambda: nn.Linear(7, 2))),
    "E140": load_into(model=with_layer("extra", lambda: nn.Linear(2, 2))),
    "E178": checkpoint_with_bad_param_group,
    "E179": fused_optimizer_given_as_dense,
    "E141": load_into(lambda root: next(root.glob("*/*.distcp")).write_bytes(b"not a checkpoint")),
    # position-weighted features
    "E220": lambda tmp: position_weighted({"f0": 2, "f1": 2})(batch(f0=(1, 2, 3))),
    "E221": lambda tmp: position_weighted({"f0": 2}),
    "E222": lambda tmp: dtrec.FeatureProcessedEmbeddingBagCollection(
        EBC(tables(), is_weighted=False), {}
    ),
    "E223": lambda tmp: dtrec.PositionWeightedModuleCollection({"f0": 3, "f1": 0}),
    "E224": lambda tmp: dtrec.EmbeddingCollection([dtrec.EmbeddingConfig("items", 5, 4)]),
    # TrainPipeline
    "E142": lambda tmp: dtrec.TrainPipeline(Model(), None, loss),
    "E143": on_mesh(2, 2, lambda m: dtrec.TrainPipeline(all_dp(m), None, "mse")),
    "E144": on_mesh(2, 2, lambda m: dtrec.TrainPipeline(all_dp(m), SGD(lr=0.1), loss)),
    "E145": on_mesh(2, 2, lambda m: run_pipeline(m, loss_fn=lambda model, b: loss(model, copy(b)))),
    "E146": on_mesh(
        2,
        2,
        lambda m: run_pipeline(
            m, model=distributed(m, model=TwoCollections()), sparse_features=lambda b: b
        ),
    ),
    "E147": on_mesh(2, 2, lambda m: run_pipeline(m, sparse_features=lambda b: {"sprase": b})),
    "E148": on_mesh(
        2,
        2,
        lambda m: run_pipeline(
            m, loss_fn=lambda model, b: torch.zeros(()), sparse_features=lambda b: b
        ),
    ),
    "E283": on_mesh(2, 2, lambda m: run_pipeline(m, loss_fn=lambda model, b: torch.zeros(()))),
    "E284": on_mesh(2, 2, lambda m: torch.fx.symbolic_trace(all_dp(m))),
    "E285": on_mesh(2, 2, lambda m: run_pipeline(m, loss_fn=lambda model, b: 1.0)),
    # comm stats
    "E149": summary_of_no_steps,
    # TorchRec modules, configs, plans and constraints
    "E151": on_mesh(2, 2, lambda m: distributed(m, model=with_managed_collision_tower())),
    "E351": lambda tmp: torchrec_mch_with_offset(),
    "E355": on_mesh(
        4,
        2,
        lambda m: dtrec.reshard(
            distributed(m, {"sparse.t0": RowWise(), "sparse.t1": RowWise()}, SGD(0.1)),
            {"sparse.t0": TableWise(rank=0), "sparse.t1": TableWise(rank=0)},
            topology=dtrec.Topology.cpu(memory_per_rank=100.0),
        ),
    ),
    "E356": on_mesh(
        4,
        2,
        lambda m: dtrec.reshard(
            distributed(m, None, SGD(0.1)),
            {},
            mesh=DeviceMesh("cpu", [[0, 1]], mesh_dim_names=_DIMS),
        ),
    ),
    "E357": on_mesh(
        4,
        2,
        lambda m: dtrec.reshard(distributed(m, None, SGD(0.1)), {}, mesh=dtrec.init_mesh("cpu", 4)),
    ),
    "E370": on_mesh(
        4,
        2,
        lambda m: dtrec.reshard(
            dtrec.distribute_module(Model(), m, None, SGD(0.1), sync_every=2),
            {"sparse.t0": RowWise(cache_rows=2)},
        ),
    ),
    "E371": on_mesh(4, 2, lambda m: _reshard_torch_state_offloaded(m)),
    "E372": on_mesh(
        4,
        2,
        lambda m: dtrec.reshard(
            distributed(m, {"sparse.t0": RowWise(), "sparse.t1": RowWise()}, SGD(0.1)),
            {"sparse.t0": RowWise(cache_rows=2)},
            topology=dtrec.Topology.cpu(memory_per_rank=1e6, host_memory_per_rank=50.0),
        ),
    ),
    "E373": on_mesh(
        4,
        2,
        lambda m: dtrec.reshard(
            distributed(m, {"sparse.t0": RowWise(), "sparse.t1": RowWise()}, SGD(0.1)),
            {"sparse.t0": TableWise(rank=0), "sparse.t1": TableWise(rank=0)},
            topology=dtrec.Topology.cpu(memory_per_rank=300.0),
        ),
    ),
    "E374": on_mesh(4, 2, lambda m: _reshard_tensor_parallel(m)),
    "E375": on_mesh(
        4,
        2,
        lambda m: dtrec.reshard(
            distributed(m, None, SGD(0.1)),
            {},
            mesh=dtrec.init_mesh("cpu", 4),
            optimizers=[torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)],
        ),
    ),
    # managed-collision collections in distribute_module
    "E358": on_mesh(
        2,
        2,
        lambda m: distributed_managed_collision(
            m, plan={"sparse._embedding_module.item": RowWise(cache_rows=4)}
        ),
    ),
    "E359": on_mesh(2, 2, lambda m: distributed_managed_collision(m, plan=ShardingPlanTR({}))),
    "E360": on_mesh(2, 2, lambda m: distributed_managed_collision(m, same_batch=m["shard"])),
    "E152": lambda tmp: Cfg("t0", 10, 4, pooling=PoolingType.NONE),
    "E153": lambda tmp: EBC([EmbeddingBagConfig("t0", 10, 4, ["f0"], data_type=DataType.INT8)]),
    "E154": lambda tmp: EBC([EmbeddingBagConfig("t0", 10, 4, ["f0"], use_virtual_table=True)]),
    "E155": lambda tmp: EBC(tables(), is_weighted="yes"),
    "E156": lambda tmp: EBC(tables(), is_weighted=True)(batch()),
    "E157": on_mesh(2, 2, lambda m: tr_plan(m, sharding_type="bucket_wise", ranks=[0])),
    "E158": on_mesh(
        2, 2, lambda m: tr_plan(m, sharding_type="table_wise", compute_kernel="key_value")
    ),
    "E159": on_mesh(
        2,
        2,
        lambda m: dtrec.plan(
            Model(), m, ShardingPlanTR({"sparse": {"t9": ParameterSharding("data_parallel")}})
        ),
    ),
    "E160": on_mesh(2, 2, lambda m: tr_plan(m, **cw_blocks([0], 2))),
    "E161": on_mesh(4, 2, lambda m: tr_plan(m, **cw_blocks([0, 2, 3, 1], 1))),
    "E162": on_mesh(2, 2, lambda m: tr_plan(m, sharding_type="table_row_wise", ranks=[0, 1])),
    "E163": on_mesh(2, 2, lambda m: tr_plan(m, sharding_type="table_wise", ranks=[5])),
    "E164": on_mesh(
        2, 2, lambda m: dtrec.plan(Model(), m, {"t0": ParameterSharding("data_parallel")})
    ),
    "E165": on_mesh(2, 2, lambda m: dtrec.plan(Model(), m, {"t9": ParameterConstraints()})),
    "E166": on_mesh(
        2, 2, lambda m: dtrec.plan(Model(), m, {"t0": ParameterConstraints(key_value_params=1)})
    ),
    "E167": on_mesh(
        2,
        2,
        lambda m: dtrec.plan(Model(), m, {"t0": ParameterConstraints(compute_kernels=["quant"])}),
    ),
    "E168": on_mesh(
        2,
        2,
        lambda m: dtrec.plan(
            Model(), m, {"t0": ParameterConstraints(["column_wise"], min_partition=4)}
        ),
    ),
    "E169": on_mesh(
        2,
        2,
        lambda m: tr_plan(
            m,
            sharding_type="row_wise",
            ranks=[0, 1],
            sharding_spec=_Spec([_Shard([0, 0], [10, 4])]),
        ),
    ),
    "E170": lambda tmp: EBC(
        [EmbeddingBagConfig("t0", 10, 4, ["f0"], data_type=DataType.FP16), *tables()[1:]]
    ),
    # sequence embeddings
    "E190": lambda tmp: dtrec.EmbeddingCollection([dtrec.EmbeddingConfig("t0", 10, 4, ["f0"])])(
        KJT(
            ["f0"],
            ids(1, 2),
            ids(1, 1),
            stride_per_key_per_rank=[[2]],
            inverse_indices=(["f0"], torch.tensor([[0, 1]])),
        )
    ),  # fmt: skip
    "E191": lambda tmp: dtrec.EmbeddingCollection([Cfg("t0", 10, 4)]),
    "E192": lambda tmp: JT(torch.zeros(2, 2, dtype=torch.long), ids(2)),
    "E193": on_mesh(2, 2, lambda m: distributed(m, model=mixed_dtype_sequence())),
    # offloaded tables
    "E320": lambda tmp: RowWise(cache_rows=10, cache_fraction=0.1),
    "E321": lambda tmp: RowWise(cache_rows=0),
    "E322": lambda tmp: TableWise(rank=0, cache_fraction=1.5),
    "E325": on_mesh(2, 2, lambda m: distributed(m, {"sparse.t0": RowWise(cache_rows=2)})(batch())),
    "E326": on_mesh(
        4,
        2,
        lambda m: dtrec.distribute_module(
            Model(), m, {"sparse.t0": RowWise(cache_rows=2)}, SGD(lr=0.1), sync_every=2
        ),
    ),
    "E327": on_mesh(
        2,
        2,
        lambda m: dtrec.plan(
            Model(),
            m,
            ShardingPlanTR(
                {
                    "sparse": {
                        "t0": ParameterSharding("table_wise", ranks=[0]),
                        "t1": ParameterSharding("data_parallel", "fused_uvm_caching"),
                    }
                }
            ),  # fmt: skip
        ),
    ),
    "E328": on_mesh(
        2,
        2,
        lambda m: tr_plan(
            m,
            sharding_type="table_wise",
            ranks=[0],
            compute_kernel="fused_uvm_caching",
            cache_params=CacheParams(1.5),
        ),
    ),
    "E329": on_mesh(
        4,
        4,
        lambda m: dtrec.plan(
            Model(),
            m,
            topology=dtrec.Topology.cpu(memory_per_rank=100.0, host_memory_per_rank=50.0),
        ),
    ),
    "E345": lambda tmp: RowWise(fully_sharded=1),
    "E349": on_mesh(
        4,
        2,
        lambda m: dtrec.distribute_module(
            Model(), m, {"sparse.t0": RowWise(fully_sharded=True)}, SGD(0.1), sync_every=2
        ),
    ),
    "E330": lambda tmp: dtrec.Topology(host_memory_per_rank=-1.0),
    "E331": lambda tmp: TableConstraint(cache_fraction=0),
    "E332": on_mesh(
        2,
        2,
        lambda m: dtrec.plan(
            Model(),
            m,
            {"t0": ParameterConstraints(["data_parallel"], compute_kernels=["fused_uvm_caching"])},
        ),
    ),
    "E333": fake(24, lambda: dtrec.init_mesh("cpu", 4, node_size=6, replicas_within_node=False)),
    "E334": fake(4, lambda: dtrec.init_mesh("cpu", 2, replicas_within_node="no")),
    "E340": fake(1, lambda: _refused_later(dtrec.init_mesh("cpu", 1))),
    "E335": on_mesh(4, 2, lambda m: dtrec.distribute_module(Model(), m, meshes={"nope": m})),
    "E336": on_mesh(4, 2, lambda m: dtrec.distribute_module(Model(), m, meshes={"sparse": "m"})),
    "E337": on_mesh(
        4,
        2,
        lambda m: dtrec.distribute_module(
            Model(), m, meshes={"sparse": DeviceMesh("cpu", [[0, 1]], mesh_dim_names=_DIMS)}
        ),
    ),
    "E338": on_mesh(
        4,
        2,
        lambda m: dtrec.distribute_module(
            Model(),
            m,
            meshes={"sparse": DeviceMesh("cpu", [[0, 1, 2, 3]], mesh_dim_names=("a", "b"))},
        ),
    ),
    "E339": on_mesh(
        4,
        4,
        lambda m: dtrec.distribute_module(
            Model(),
            m,
            {"sparse.t0": TableWise(rank=2)},
            meshes={"sparse": dtrec.init_mesh("cpu", 2)},
        ),
    ),
    "E240": lambda tmp: KJT.from_jt_dict(
        {"f0": JT(torch.zeros(1, 4), ids(1)), "f1": JT(torch.zeros(1, 8), ids(1))}
    ),
    "E241": lambda tmp: dtrec.EmbeddingCollection([dtrec.EmbeddingConfig("t0", 10, 4, ["f0"])])(
        KJT(["f0"], torch.zeros(2, 4), ids(1, 1))
    ),
}


# --------------------------------------------------------------------------- real peers

WORLD_SIZE = 2
WORLD: dict[str, tuple[int, ...]] = {
    # error id -> the ranks that raise it
    "E043": (1,),
    "E044": (0,),
    "E150": (0,),
    "E077": (0, 1),
    "E323": (1,),
    "E324": (0,),
    "E260": (0, 1),
}


def outcome(fn: Callable[[], object]) -> tuple[str, str] | None:
    """(exception type, message) of ``fn``, or None if it returned."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type is what the caller checks
        return type(exc).__name__, message(exc)
    return None


def message(exc: BaseException) -> str:
    """The text the user reads (a KeyError's str() is its message in quotes)."""
    if isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        return exc.args[0]
    return str(exc)


def run_world_cases(rank: int, world_size: int) -> dict:
    """Every WORLD case on every rank (each fails on all ranks alike, so they stay in step),
    plus what a rejected batch leaves behind: weights unchanged, the next step works."""
    mesh = dtrec.init_mesh("cpu", world_size)
    plan = {"sparse.t0": RowWise(), "sparse.t1": TableWise(rank=1)}
    model = distributed(mesh, plan, optimizer=SGD(lr=0.5))
    before = {n: t.weight.to_local().clone() for n, t in model.sparse.embedding_bags.items()}

    def unchanged() -> bool:
        weights = model.sparse.embedding_bags.items()
        return all(torch.equal(t.weight.to_local(), before[n]) for n, t in weights)

    out: dict[str, object] = {}
    bad_ids = batch(f0=(1, 10_000) if rank == 1 else (1, 2))
    out["E043"] = out["E044"] = outcome(lambda: model(bad_ids).sum().backward())
    out["unchanged"] = unchanged()
    # S=1, R=2: each rank is its own sharding group; the verdict crosses the replicate axis
    one_shard = {"sparse.t0": RowWise(), "sparse.t1": TableWise(rank=0)}
    other_group = distributed(dtrec.init_mesh("cpu", 1), one_shard, optimizer=SGD(lr=0.5))
    out["E150"] = outcome(lambda: other_group(bad_ids).sum().backward())
    out["next_step"] = outcome(lambda: model(batch()).sum().backward())
    out["updated"] = not unchanged()
    configs = tables()
    if rank == 1:
        configs[0] = Cfg("t0", 11, 4, ["f0"])
    out["E077"] = outcome(lambda: distributed(mesh, plan, model=Model(configs)))
    # an offloaded block's cache of 2 rows: rank 1 sends 3 distinct rows of t0's second
    # block (rows 5..9, held by rank 1); every rank refuses the step, nothing changes
    offloaded = distributed(mesh, {"sparse.t0": RowWise(cache_rows=2)}, optimizer=SGD(lr=0.5))
    weights = dtrec.checkpoint.full_state_dict(offloaded)
    too_many = batch(f0=(6, 7, 8) if rank == 1 else (1,))
    out["E323"] = out["E324"] = outcome(lambda: offloaded(too_many).sum().backward())
    after = dtrec.checkpoint.full_state_dict(offloaded)
    out["offloaded_unchanged"] = all(torch.equal(weights[k], after[k]) for k in weights)
    out["offloaded_next_step"] = outcome(lambda: offloaded(batch()).sum().backward())
    # clip_grad_norm_'s stack across meshes with different parameter lists per rank
    with torch.no_grad():
        norms = [torch.linalg.vector_norm(t.weight) for t in model.sparse.embedding_bags.values()]
        out["E260"] = outcome(lambda: torch.stack(norms + norms[:rank]))
    return out
