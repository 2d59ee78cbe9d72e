"""TorchRec ``ShardingPlan`` / ``ParameterConstraints`` as dtrec plans and constraints.

Plans are real TorchRec objects, built with ``construct_module_sharding_plan`` and its
per-table helpers (no GPU, no process group needed); meshes come from a fake world.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dtrec
from dtrec.interop.plans import from_torchrec
from dtrec.placements import ColumnWise, DataParallel, Grid, RowWise, TableRowWise, TableWise
from dtrec.planning.plan import model_tables
from dtrec.planning.planner import TableConstraint
from tests.fake_world import fake_world
from tests.interop.torchrec_or_skip import needs_torchrec, torchrec

pytestmark = needs_torchrec


def _model(dim: int = 16) -> nn.Module:
    """Four tables on the meta device (TorchRec's grid helper needs dim >= 256: it cuts
    columns into blocks of at least 128)."""
    configs = [
        torchrec.EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=rows, embedding_dim=dim, feature_names=[f"f{i}"]
        )
        for i, rows in enumerate([40, 10, 23, 8])
    ]
    model = nn.Module()
    model.sparse = torchrec.EmbeddingBagCollection(configs, device=torch.device("meta"))
    return model


def _plan(model: nn.Module, world: int, per_table: dict, local_size: int | None = None):
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    module_plan = construct_module_sharding_plan(
        model.sparse, per_table, world_size=world, local_size=local_size or world,
        device_type="cpu",
    )  # fmt: skip
    return ShardingPlan({"sparse": module_plan})


def _helpers():
    from torchrec.distributed import sharding_plan as sp

    return sp


def _mapped(world: int, shards: int, per_table: dict, node_size: int | None = None, dim=16):
    model = _model(dim)
    plan = _plan(model, world, per_table, local_size=node_size)
    with fake_world(0, world):
        mesh = dtrec.init_mesh("cpu", shards, node_size=node_size)
        return from_torchrec(plan, model_tables(model), mesh)


def test_dmp_plan_maps_every_type() -> None:
    sp = _helpers()
    specs = _mapped(4, 4, {
        "t0": sp.row_wise(compute_kernel="dense"),
        "t1": sp.table_wise(rank=3, compute_kernel="fused"),
        "t2": sp.column_wise(ranks=[0, 1, 2, 3], compute_kernel="dense"),
        "t3": sp.data_parallel(),
    })  # fmt: skip
    assert specs == {
        "sparse.t0": RowWise(),
        "sparse.t1": TableWise(rank=3),
        "sparse.t2": ColumnWise(),
        "sparse.t3": DataParallel(),
    }


def test_node_aware_types() -> None:
    sp = _helpers()
    specs = _mapped(4, 4, {
        "t0": sp.table_row_wise(host_index=1),
        "t1": sp.grid_shard(host_indexes=[0, 1]),
        "t2": sp.table_wise(rank=0, compute_kernel="dense"),
        "t3": sp.table_wise(rank=2, compute_kernel="dense"),
    }, node_size=2, dim=256)  # fmt: skip
    assert specs["sparse.t0"] == TableRowWise(node=1)
    assert specs["sparse.t1"] == Grid()
    model = _model()
    plan = _plan(model, 4, {
        "t0": sp.table_row_wise(host_index=1), "t1": sp.data_parallel(),
        "t2": sp.data_parallel(), "t3": sp.data_parallel(),
    }, local_size=2)  # fmt: skip
    with fake_world(0, 4):
        mesh = dtrec.init_mesh("cpu", 4)  # no node_size
        with pytest.raises(ValueError, match="'sparse.t0': table_row_wise needs a node-aware"):
            from_torchrec(plan, model_tables(model), mesh)


def test_2d_plans_per_sharding_group_and_world() -> None:
    """A DMPCollection plan names ranks of one sharding group (positions); a plan for
    the whole world names global ranks, mapped to their positions."""
    sp = _helpers()
    group_plan = {
        "t0": sp.row_wise(compute_kernel="dense"),
        "t1": sp.table_wise(rank=1, compute_kernel="dense"),
        "t2": sp.column_wise(ranks=[0, 1], compute_kernel="dense"),
        "t3": sp.data_parallel(),
    }
    model = _model()
    plan = _plan(model, 2, group_plan)
    with fake_world(3, 4):
        mesh = dtrec.init_mesh("cpu", 2)  # sharding groups [0, 2], [1, 3]
        specs = from_torchrec(plan, model_tables(model), mesh)
        assert specs == {
            "sparse.t0": RowWise(), "sparse.t1": TableWise(rank=1),
            "sparse.t2": ColumnWise(), "sparse.t3": DataParallel(),
        }  # fmt: skip
        world_plan = _plan(model, 4, {
            "t0": sp.data_parallel(), "t1": sp.table_wise(rank=3, compute_kernel="dense"),
            "t2": sp.column_wise(ranks=[0, 1, 2, 3], size_per_rank=[8, 8, 0, 0],
                                 compute_kernel="dense"),
            "t3": sp.data_parallel(),
        })  # fmt: skip
        with pytest.raises(ValueError, match="'sparse.t2': ranks \\[0, 1, 2, 3\\] place"):
            from_torchrec(world_plan, model_tables(model), mesh)
        world_plan.plan["sparse"]["t2"] = world_plan.plan["sparse"]["t0"]
        specs = from_torchrec(world_plan, model_tables(model), mesh)
        assert specs["sparse.t1"] == TableWise(rank=1)  # rank 3 is shard position 1


def test_unmappable_plans_are_errors_naming_the_table() -> None:
    sp = _helpers()
    dp = {"t1": sp.data_parallel(), "t2": sp.data_parallel(), "t3": sp.data_parallel()}
    with pytest.raises(
        ValueError,
        match="'sparse.t0' .column_wise, ranks \\[0, 1\\]. has blocks.*"
        "torch.chunk widths over increasing positions.*widths \\[12, 4\\]",
    ):
        _mapped(4, 4, {"t0": sp.column_wise(ranks=[0, 1], size_per_rank=[12, 4]), **dp})
    with pytest.raises(ValueError, match="'sparse.t0': compute kernel 'fused_uvm'"):
        _mapped(4, 4, {"t0": sp.table_wise(rank=0, compute_kernel="fused_uvm"), **dp})
    model = _model()
    plan = _plan(model, 4, {"t0": sp.table_wise(rank=0, compute_kernel="dense"), **dp})
    plan.plan["sparse"]["t0"].sharding_type = "bucket_wise"
    with fake_world(0, 4):
        mesh = dtrec.init_mesh("cpu", 4)
        with pytest.raises(ValueError, match="sharding type 'bucket_wise' has no dtrec"):
            from_torchrec(plan, model_tables(model), mesh)
        plan.plan["sparse"]["t9"] = plan.plan["sparse"].pop("t0")
        with pytest.raises(KeyError, match="names table 't9' of module 'sparse'"):
            from_torchrec(plan, model_tables(model), mesh)
        with pytest.raises(TypeError, match="got a TorchRec module plan"):
            from_torchrec(dict(plan.plan["sparse"]), model_tables(model), mesh)


def test_distribute_module_and_plan_take_a_torchrec_plan() -> None:
    sp = _helpers()
    model = _model()
    plan = _plan(model, 2, {
        "t0": sp.row_wise(compute_kernel="dense"), "t1": sp.table_wise(rank=1),
        "t2": sp.data_parallel(), "t3": sp.column_wise(ranks=[0, 1]),
    })  # fmt: skip
    with fake_world(0, 2):
        mesh = dtrec.init_mesh("cpu", 2)
        chosen = dtrec.plan(model, mesh, constraints=plan)
        assert dict(chosen) == {
            "sparse.t0": RowWise(), "sparse.t1": TableWise(rank=1),
            "sparse.t2": DataParallel(), "sparse.t3": ColumnWise(),
        }  # fmt: skip


def test_parameter_constraints() -> None:
    from torchrec.distributed.planner.types import ParameterConstraints

    model = _model()
    constraints = {
        "t0": ParameterConstraints(sharding_types=["row_wise", "column_wise"], min_partition=8,
                                   pooling_factors=[3.0]),
        "t1": ParameterConstraints(sharding_types=["table_wise"]),
        "sparse.t2": TableWise(rank=0),
    }  # fmt: skip
    with fake_world(0, 4):
        mesh = dtrec.init_mesh("cpu", 4)
        mapped = from_torchrec(constraints, model_tables(model), mesh)
        # 16 columns over 4 positions are 4 wide < min_partition 8: no ColumnWise
        assert mapped["sparse.t0"] == TableConstraint(types=(RowWise,), pooling_factor=3.0)
        assert mapped["sparse.t1"] == TableConstraint(types=(TableWise,), pooling_factor=1.0)
        assert mapped["sparse.t2"] == TableWise(rank=0)
        chosen = dtrec.plan(model, mesh, constraints=constraints)
        assert chosen["sparse.t0"] == RowWise()
        assert isinstance(chosen["sparse.t1"], TableWise)
        for bad, match in [
            ({"t9": ParameterConstraints()}, "ParameterConstraints for unknown table 't9'"),
            ({"t0": ParameterConstraints(compute_kernels=["key_value"])}, "'t0': TorchRec comp"),
            ({"t0": ParameterConstraints(sharding_types=["bucket_wise"])}, "'t0': TorchRec "
             "sharding type 'bucket_wise'"),
            ({"t0": ParameterConstraints(sharding_types=["column_wise"], min_partition=8)},
             "allow only column_wise"),
        ]:  # fmt: skip
            with pytest.raises((KeyError, ValueError), match=match):
                dtrec.plan(model, mesh, constraints=bad)


def test_plan_of_a_feature_processed_collection_names_its_inner_tables() -> None:
    """TorchRec plans a FeatureProcessedEmbeddingBagCollection at its own path; dtrec
    shards the tables of the collection inside it."""
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    sp = _helpers()
    model = _model()
    features = [f"f{i}" for i in range(4)]
    model.sparse = FeatureProcessedEmbeddingBagCollection(
        torchrec.EmbeddingBagCollection(
            model.sparse.embedding_bag_configs(), is_weighted=True, device=torch.device("meta")
        ),
        PositionWeightedModuleCollection(dict.fromkeys(features, 4)),
    )
    plan = _plan(_model(), 2, {
        "t0": sp.row_wise(compute_kernel="dense"), "t1": sp.table_wise(rank=1),
        "t2": sp.data_parallel(), "t3": sp.column_wise(ranks=[0, 1]),
    })  # fmt: skip
    with fake_world(0, 2):
        mesh = dtrec.init_mesh("cpu", 2)
        chosen = dtrec.plan(model, mesh, constraints=plan)
    inner = "sparse._embedding_bag_collection"
    assert dict(chosen) == {
        f"{inner}.t0": RowWise(), f"{inner}.t1": TableWise(rank=1),
        f"{inner}.t2": DataParallel(), f"{inner}.t3": ColumnWise(),
    }  # fmt: skip


def test_uvm_caching_kernel_is_an_offloaded_spec_with_its_load_factor() -> None:
    """TorchRec's FUSED_UVM_CACHING kernel: the table in host memory behind a device cache
    of ``cache_params.load_factor`` of its rows (TorchRec's default 0.2 without one)."""
    from torchrec.distributed.types import CacheParams

    sp = _helpers()
    model = _model()
    caching = "fused_uvm_caching"
    plan = _plan(model, 4, {
        "t0": sp.table_wise(rank=2, compute_kernel=caching),
        "t1": sp.row_wise(compute_kernel=caching),
        "t2": sp.column_wise(ranks=[0, 1, 2, 3], compute_kernel=caching),
        "t3": sp.data_parallel(),
    })  # fmt: skip
    plan.plan["sparse"]["t1"].cache_params = CacheParams(load_factor=0.05)
    with fake_world(0, 4):
        mesh = dtrec.init_mesh("cpu", 4)
        specs = from_torchrec(plan, model_tables(model), mesh)
        assert specs["sparse.t0"] == TableWise(rank=2, cache_fraction=0.2)
        assert specs["sparse.t1"] == RowWise(cache_fraction=0.05)
        assert specs["sparse.t2"] == ColumnWise(cache_fraction=0.2)
        assert specs["sparse.t3"] == DataParallel()
        # a TorchRec planner's column blocks on some ranks, and a single full block
        columns = _plan(model, 4, {
            "t0": sp.data_parallel(),
            "t1": sp.column_wise(ranks=[2], compute_kernel=caching),
            "t2": sp.column_wise(ranks=[1, 3], compute_kernel=caching),
            "t3": sp.data_parallel(),
        })  # fmt: skip
        specs = from_torchrec(columns, model_tables(model), mesh)
        assert specs["sparse.t2"] == ColumnWise(positions=(1, 3), cache_fraction=0.2)
        assert specs["sparse.t1"] == TableWise(rank=2, cache_fraction=0.2)
        assert str(specs["sparse.t2"]) == "CW(1,3)+cache(20%)"
        plan.plan["sparse"]["t3"].compute_kernel = caching
        with pytest.raises(ValueError, match="'sparse.t3': data_parallel with compute kernel"):
            from_torchrec(plan, model_tables(model), mesh)


def test_uvm_caching_constraint_offloads_the_table() -> None:
    """``ParameterConstraints`` allowing only FUSED_UVM_CACHING: the table is offloaded
    behind a cache of its load factor (TorchRec's 0.2 without one), never data parallel."""
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import CacheParams

    model = _model()
    caching, quarter = ["fused_uvm_caching"], CacheParams(load_factor=0.25)
    constraints = {
        "t0": ParameterConstraints(compute_kernels=caching, cache_params=quarter),
        "t1": ParameterConstraints(compute_kernels=caching, sharding_types=["row_wise"]),
        "t2": ParameterConstraints(compute_kernels=["fused", *caching]),  # dtrec's choice
    }
    with fake_world(0, 4):
        mesh = dtrec.init_mesh("cpu", 4)
        mapped = from_torchrec(constraints, model_tables(model), mesh)
        assert mapped["sparse.t0"].cache_fraction == 0.25
        assert DataParallel not in mapped["sparse.t0"].types
        assert mapped["sparse.t1"] == TableConstraint(
            types=(RowWise,), pooling_factor=1.0, cache_fraction=0.2
        )
        assert mapped["sparse.t2"].cache_fraction is None
        chosen = dtrec.plan(model, mesh, constraints=constraints)
        assert chosen["sparse.t0"].cache_fraction == 0.25
        assert chosen["sparse.t1"] == RowWise(cache_fraction=0.2)
        assert not chosen["sparse.t2"].offloaded


def test_column_blocks_map_to_the_spec_laying_them_out() -> None:
    """A single full column block is table-wise; blocks in chunk widths one per position
    are ColumnWise over those positions, in column order (whole axis: ColumnWise())."""
    sp = _helpers()
    dp = {"t2": sp.data_parallel(), "t3": sp.data_parallel()}
    specs = _mapped(4, 4, {
        "t0": sp.column_wise(ranks=[2]),
        "t1": sp.column_wise(ranks=[1, 3]),
        **dp,
    })  # fmt: skip
    assert specs["sparse.t0"] == TableWise(rank=2)
    assert specs["sparse.t1"] == ColumnWise(positions=(1, 3))
    assert str(specs["sparse.t1"]) == "CW(1,3)"
    # first columns on the higher rank: a sub-mesh's process group orders ranks ascending
    with pytest.raises(ValueError, match="widths \\[8, 8\\] at positions \\[3, 1\\]"):
        _mapped(4, 4, {"t0": sp.column_wise(ranks=[3, 1]), "t1": sp.data_parallel(), **dp})
    model = _model()
    plan = _plan(
        model, 4, {"t0": sp.column_wise(ranks=[0, 1]), "t1": sp.column_wise(ranks=[1]), **dp}
    )
    plan.plan["sparse"]["t0"].sharding_type = "table_column_wise"
    plan.plan["sparse"]["t1"].sharding_type = "table_column_wise"
    with fake_world(0, 4):
        mesh = dtrec.init_mesh("cpu", 4)
        specs = from_torchrec(plan, model_tables(model), mesh)
    assert specs["sparse.t0"] == ColumnWise(positions=(0, 1))
    assert specs["sparse.t1"] == TableWise(rank=1)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["column_wise", "table_column_wise"])
def test_torchrec_planner_column_plans_are_taken_exactly(world: int, kind: str) -> None:
    """TorchRec's EmbeddingShardingPlanner (CPU topology) cuts columns into blocks of 128
    and puts them on some ranks: every block lands where TorchRec put it."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    from dtrec.placements.mesh import shard_axis

    model = nn.Module()
    configs = [
        torchrec.EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=100, embedding_dim=dim, feature_names=[f"f{i}"]
        )
        for i, dim in enumerate([16, 64, 256, 160])
    ]
    model.sparse = torchrec.EmbeddingBagCollection(configs, device=torch.device("meta"))
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"),
        constraints={f"t{i}": ParameterConstraints(sharding_types=[kind]) for i in range(4)},
    )
    plan = planner.plan(model, [EmbeddingBagCollectionSharder()])
    tables = model_tables(model)
    with fake_world(0, world):
        mesh = dtrec.init_mesh("cpu", world)
        specs = from_torchrec(plan, tables, mesh)
        axis = shard_axis(mesh)
    for name, sharding in plan.plan["sparse"].items():
        theirs = sorted(
            (rank, (s.shard_offsets[0], s.shard_offsets[0] + s.shard_sizes[0]),
             (s.shard_offsets[1], s.shard_offsets[1] + s.shard_sizes[1]))
            for rank, s in zip(sharding.ranks, sharding.sharding_spec.shards, strict=True)
        )  # fmt: skip
        layout = specs[f"sparse.{name}"].layout(tables[f"sparse.{name}"], axis)
        assert sorted((b.position, b.rows, b.cols) for b in layout.blocks) == theirs, name
        if len(theirs) == 1:
            assert isinstance(specs[f"sparse.{name}"], TableWise), specs


def test_plan_dict_is_a_plan() -> None:
    """``ShardingPlan.plan`` (module path -> module plan) is taken like the ShardingPlan."""
    sp = _helpers()
    model = _model()
    plan = _plan(model, 2, {
        "t0": sp.row_wise(compute_kernel="dense"), "t1": sp.table_wise(rank=1),
        "t2": sp.data_parallel(), "t3": sp.column_wise(ranks=[0, 1]),
    })  # fmt: skip
    with fake_world(0, 2):
        mesh = dtrec.init_mesh("cpu", 2)
        assert from_torchrec(plan.plan, model_tables(model), mesh) == from_torchrec(
            plan, model_tables(model), mesh
        )
        assert dtrec.plan(model, mesh, constraints=plan.plan) == dtrec.plan(
            model, mesh, constraints=plan
        )


def test_dmp_collection_configs_give_each_module_type_its_mesh_and_plan() -> None:
    """TorchRec's Dynamic 2D: a ``DMPCollectionConfig`` per module type (its sharding group
    size, plan and replica layout) -> a mesh per collection and one plan on them."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import DMPCollectionConfig, ShardingPlan

    from dtrec.interop.dmp_collection import dmp_collection_meshes

    sp = _helpers()
    model = _model()
    model.seq = torchrec.EmbeddingCollection(
        [torchrec.EmbeddingConfig(name="s0", num_embeddings=30, embedding_dim=8,
                                  feature_names=["h0"])],
        device=torch.device("meta"),
    )  # fmt: skip
    pooled_plan = _plan(model, 2, {
        "t0": sp.row_wise(compute_kernel="dense"),
        "t1": sp.table_wise(rank=1, compute_kernel="dense"),
        "t2": sp.column_wise(ranks=[0, 1], compute_kernel="dense"),
        "t3": sp.data_parallel(),
    })  # fmt: skip
    seq_plan = ShardingPlan({"seq": construct_module_sharding_plan(
        model.seq, {"s0": sp.table_wise(rank=3, compute_kernel="dense")}, world_size=4,
        local_size=4, device_type="cpu",
    )})  # fmt: skip
    configs = [
        DMPCollectionConfig(torchrec.EmbeddingBagCollection, pooled_plan, sharding_group_size=2),
        DMPCollectionConfig(
            torchrec.EmbeddingCollection, seq_plan, sharding_group_size=4,
            use_inter_host_allreduce=True,
        ),
    ]  # fmt: skip
    with fake_world(5, 8):
        meshes, plan = dmp_collection_meshes(model, configs, "cpu")
        assert sorted(meshes) == ["seq", "sparse"]
        # replicas within a node (the default): contiguous replica groups
        assert meshes["sparse"].mesh.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
        # use_inter_host_allreduce: contiguous sharding groups, strided replicas
        assert meshes["seq"].mesh.tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
        specs = dtrec.plan(model, dtrec.init_mesh("cpu", 8), plan, meshes=meshes)
    assert dict(specs) == {
        "sparse.t0": RowWise(), "sparse.t1": TableWise(rank=1),
        "sparse.t2": ColumnWise(), "sparse.t3": DataParallel(), "seq.s0": TableWise(rank=3),
    }  # fmt: skip
    assert sorted(specs.reports) == ["seq on mesh 4 x 2", "sparse on mesh 2 x 4"]
    with fake_world(0, 8), pytest.raises(ValueError, match="does not have"):
        dmp_collection_meshes(
            model, [DMPCollectionConfig(nn.Linear, pooled_plan, sharding_group_size=2)], "cpu"
        )
