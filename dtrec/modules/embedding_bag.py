"""The unsharded collection: what users write and the single-device reference."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from dtrec import ops
from dtrec.modules.config import EmbeddingBagConfig, validate_tables
from dtrec.modules.features import check_bounds_mode, feature_order, prepare_features
from dtrec.sparse import KeyedTensor


class EmbeddingBagCollection(nn.Module):
    """Pooled embedding tables looked up by a ``KeyedJaggedTensor``.

    ``state_dict`` keys are ``embedding_bags.<table>.weight`` (TorchRec's), so
    checkpoints move between this module and its sharded form. Ids are checked
    against their table's rows (IndexError naming table and feature) unless
    ``bounds_check="off"``; the sharded form inherits the setting.

    Example::

        ebc = EmbeddingBagCollection([EmbeddingBagConfig("t0", 100, 8, ["f0"])])
        pooled = ebc(KeyedJaggedTensor(["f0"], ids, lengths))   # KeyedTensor [B, 8]
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        device: torch.device | str | None = None,
        bounds_check: str = "on",
    ) -> None:
        super().__init__()
        if isinstance(tables, EmbeddingBagConfig):
            raise TypeError("tables must be a list of EmbeddingBagConfig; write [config]")
        tables = list(tables)
        validate_tables(tables)
        self._tables = tables
        self.bounds_check = check_bounds_mode(bounds_check)
        self.embedding_bags = nn.ModuleDict(
            {
                cfg.name: nn.EmbeddingBag(
                    cfg.num_embeddings, cfg.embedding_dim, mode=cfg.pooling, device=device
                )
                for cfg in tables
            }
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """TorchRec's default init: uniform in +-sqrt(1 / num_embeddings)."""
        for cfg in self._tables:
            weight = self.embedding_bags[cfg.name].weight
            if weight.device.type != "meta":
                bound = math.sqrt(1.0 / cfg.num_embeddings)
                with torch.no_grad():
                    weight.uniform_(-bound, bound)

    def _device(self) -> torch.device | None:
        """Where the tables live (None without tables): batches must be there too."""
        if not self._tables:
            return None
        return self.embedding_bags[self._tables[0].name].weight.device

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The table configs, in output order."""
        return list(self._tables)

    def forward(self, features: object) -> KeyedTensor:
        kjt = prepare_features(
            features, self._tables, bounds_check=self.bounds_check, device=self._device()
        )
        weights, modes, dims = [], [], []
        for cfg in self._tables:
            for _ in cfg.feature_names:
                weights.append(self.embedding_bags[cfg.name].weight)
                modes.append(cfg.pooling)
                dims.append(cfg.embedding_dim)
        values = ops.embedding_bag(
            weights, kjt.values(), kjt.offsets(), modes, kjt.weights_or_none(), bounds_check="off"
        )
        return KeyedTensor(feature_order(self._tables), dims, values)
