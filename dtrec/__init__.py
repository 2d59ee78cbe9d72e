"""dtrec: DTensor-native sharding for recommendation-model embedding tables.

Data flows one way: plan -> placements -> sharded module -> ops -> kernels.

Example (under torchrun)::

    mesh = dtrec.init_mesh("cpu", shard_group_size=2)
    model = dtrec.distribute_module(model, mesh, {"sparse.t0": dtrec.placements.RowWise()})
"""

from dtrec import checkpoint, cost_model, ops, optim, placements
from dtrec.collectives import CollectiveError, CommStats, comm_stats, count_comm
from dtrec.config import EmbeddingBagConfig
from dtrec.cost_model import Topology
from dtrec.distribute import distribute_module
from dtrec.failures import report_failures
from dtrec.mesh import init_mesh
from dtrec.modules import EmbeddingBagCollection
from dtrec.pipeline import TrainPipeline
from dtrec.placements.tensor import distribute_tensor
from dtrec.plan import ShardingPlan, plan
from dtrec.sharded_ebc import ShardedEmbeddingBagCollection
from dtrec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor

__all__ = [
    "CollectiveError",
    "CommStats",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "ShardedEmbeddingBagCollection",
    "ShardingPlan",
    "Topology",
    "TrainPipeline",
    "checkpoint",
    "cost_model",
    "comm_stats",
    "count_comm",
    "distribute_module",
    "distribute_tensor",
    "init_mesh",
    "ops",
    "optim",
    "placements",
    "plan",
    "report_failures",
]
