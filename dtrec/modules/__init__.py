"""Unsharded modules and their configs: what a user builds before distributing.

``EmbeddingBagCollection`` is also the reference every sharded result is checked
against; ``features`` turns a batch into the collection's feature order.
"""

from dtrec.modules.config import EmbeddingBagConfig
from dtrec.modules.embedding_bag import EmbeddingBagCollection
from dtrec.modules.feature_processor import (
    FeatureProcessedEmbeddingBagCollection,
    PositionWeightedModule,
    PositionWeightedModuleCollection,
)

__all__ = [
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "FeatureProcessedEmbeddingBagCollection",
    "PositionWeightedModule",
    "PositionWeightedModuleCollection",
]
