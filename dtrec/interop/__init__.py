"""TorchRec adapters: TorchRec's modules, configs, plans and constraints as dtrec's.

Nothing here imports torchrec: its objects are recognised by class name and fields.
``modules`` converts TorchRec's ``EmbeddingBagCollection`` (and rejects the sparse
modules dtrec cannot shard); ``plans`` maps a TorchRec ``ShardingPlan`` onto a dtrec
mesh and ``ParameterConstraints`` onto ``TableConstraint``s (a layer higher: it needs
the specs, ``dtrec.placements``; the planner imports it, never the reverse).
"""

from dtrec.interop.modules import (
    from_torchrec_bag_collection,
    is_torchrec_bag_collection,
    unsupported_module,
)

__all__ = ["from_torchrec_bag_collection", "is_torchrec_bag_collection", "unsupported_module"]
