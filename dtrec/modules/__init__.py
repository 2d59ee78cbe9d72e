"""Unsharded modules and their configs: what a user builds before distributing.

``EmbeddingBagCollection`` is also the reference every sharded result is checked
against; ``features`` turns a batch into the collection's feature order; ``managed_collision``,
``eviction`` and ``mc_collection`` remap unbounded ids into a table's rows.
"""

from dtrec.modules.config import EmbeddingBagConfig
from dtrec.modules.embedding import EmbeddingCollection, EmbeddingConfig
from dtrec.modules.embedding_bag import EmbeddingBagCollection
from dtrec.modules.feature_processor import (
    FeatureProcessedEmbeddingBagCollection,
    PositionWeightedModule,
    PositionWeightedModuleCollection,
)
from dtrec.modules.managed_collision import MCHManagedCollisionModule
from dtrec.modules.mc_collection import (
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
    reset_torch_optimizer_rows,
)

__all__ = [
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "FeatureProcessedEmbeddingBagCollection",
    "MCHManagedCollisionModule",
    "ManagedCollisionCollection",
    "ManagedCollisionEmbeddingBagCollection",
    "ManagedCollisionEmbeddingCollection",
    "PositionWeightedModule",
    "PositionWeightedModuleCollection",
    "reset_torch_optimizer_rows",
]
