"""dtrec: DTensor-native sharding for recommendation-model embedding tables.

Data flows one way: plan -> placements -> sharded module -> ops -> kernels.

Example (under torchrun)::

    mesh = dtrec.init_mesh("cpu", shard_group_size=2)
    model = dtrec.distribute_module(model, mesh, {"sparse.t0": dtrec.placements.RowWise()})
"""

from dtrec import checkpoint, ops, optim, pipelining, placements
from dtrec.comm.collectives import CommStats, comm_stats, count_comm
from dtrec.comm.failures import CollectiveError, report_failures
from dtrec.comm.qcomms import QCommsConfig
from dtrec.modules import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FeatureProcessedEmbeddingBagCollection,
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    MCHManagedCollisionModule,
    PositionWeightedModule,
    PositionWeightedModuleCollection,
    eviction,
)
from dtrec.placements.mesh import init_mesh, table_mesh
from dtrec.planning import cost_model
from dtrec.planning.id_counters import IdCounters
from dtrec.planning.mesh_choice import choose_shard_group_size
from dtrec.planning.plan import ShardingPlan, plan
from dtrec.planning.topology import Topology
from dtrec.sharded.distribute import distribute_module
from dtrec.sharded.module import ShardedEmbeddingBagCollection
from dtrec.sharded.pipeline import TrainPipeline
from dtrec.sharded.reshard import reshard
from dtrec.sharded.sequence import ShardedEmbeddingCollection
from dtrec.sharded.tables.tensor import distribute_tensor
from dtrec.sharded.update.accumulate import accumulate_gradients
from dtrec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor

__all__ = [
    "CollectiveError",
    "CommStats",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "FeatureProcessedEmbeddingBagCollection",
    "IdCounters",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "MCHManagedCollisionModule",
    "ManagedCollisionCollection",
    "ManagedCollisionEmbeddingBagCollection",
    "ManagedCollisionEmbeddingCollection",
    "PositionWeightedModule",
    "PositionWeightedModuleCollection",
    "QCommsConfig",
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "ShardingPlan",
    "Topology",
    "TrainPipeline",
    "accumulate_gradients",
    "checkpoint",
    "choose_shard_group_size",
    "cost_model",
    "comm_stats",
    "count_comm",
    "distribute_module",
    "distribute_tensor",
    "eviction",
    "init_mesh",
    "ops",
    "optim",
    "pipelining",
    "placements",
    "plan",
    "report_failures",
    "reshard",
    "table_mesh",
]
