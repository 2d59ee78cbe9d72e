"""The unsharded collection: what users write and the single-device reference."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dtrec import ops
from dtrec.modules.config import (
    EmbeddingBagConfig,
    as_bag_config,
    is_torchrec_bag_config,
    table_dtype,
    validate_tables,
)
from dtrec.modules.features import (
    check_bounds_mode,
    check_weighted,
    feature_order,
    prepare_features,
)
from dtrec.sparse import KeyedTensor


class EmbeddingBagCollection(nn.Module):
    """Pooled embedding tables looked up by a ``KeyedJaggedTensor``.

    ``state_dict`` keys are ``embedding_bags.<table>.weight`` (TorchRec's), so
    checkpoints move between this module and its sharded form. Ids are checked
    against their table's rows (IndexError naming table and feature) unless
    ``bounds_check="off"``; the sharded form inherits the setting, and ``is_weighted``.

    ``is_weighted``: None (default) pools with the batch's per-sample weights when it
    has them; False ignores them and True requires them, as TorchRec's unweighted and
    weighted collections do. TorchRec ``EmbeddingBagConfig``s are accepted: their
    ``data_type`` sets the weight dtype and their ``init_fn`` initialises the weight.

    Example::

        ebc = EmbeddingBagCollection([EmbeddingBagConfig("t0", 100, 8, ["f0"])])
        pooled = ebc(KeyedJaggedTensor(["f0"], ids, lengths))   # KeyedTensor [B, 8]
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        device: torch.device | str | None = None,
        bounds_check: str = "on",
        is_weighted: bool | None = None,
    ) -> None:
        super().__init__()
        if isinstance(tables, EmbeddingBagConfig) or is_torchrec_bag_config(tables):
            raise TypeError("tables must be a list of EmbeddingBagConfig; write [config]")
        given = list(tables)
        tables = [as_bag_config(cfg) for cfg in given]
        validate_tables(tables)
        self._tables = tables
        self.bounds_check = check_bounds_mode(bounds_check)
        self.is_weighted = check_weighted(is_weighted)
        # TorchRec configs carry a weight dtype and an init function; dtrec's use fp32 and
        # TorchRec's default init.
        pairs = list(zip(tables, given, strict=True))
        dtypes = {cfg.name: table_dtype(original) for cfg, original in pairs}
        if len(set(dtypes.values())) > 1:
            raise ValueError(
                f"tables of one EmbeddingBagCollection must share a dtype (the pooled output "
                f"has it); got {dtypes}: put the tables of each dtype in their own collection"
            )
        self._init_fns = {cfg.name: getattr(original, "init_fn", None) for cfg, original in pairs}
        self.embedding_bags = nn.ModuleDict(
            {
                cfg.name: nn.EmbeddingBag(
                    cfg.num_embeddings,
                    cfg.embedding_dim,
                    mode=cfg.pooling,
                    device=device,
                    dtype=dtypes[cfg.name],
                )
                for cfg, original in pairs
            }
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """TorchRec's default init: uniform in +-sqrt(1 / num_embeddings) (or the
        ``init_fn`` of a TorchRec config)."""
        for cfg in self._tables:
            weight = self.embedding_bags[cfg.name].weight
            if weight.device.type == "meta":
                continue
            with torch.no_grad():
                init_fn = self._init_fns.get(cfg.name)
                if init_fn is not None:
                    init_fn(weight)
                else:
                    bound = math.sqrt(1.0 / cfg.num_embeddings)
                    weight.uniform_(-bound, bound)

    def _device(self) -> torch.device | None:
        """Where the tables live (None without tables): batches must be there too."""
        if not self._tables:
            return None
        return self.embedding_bags[self._tables[0].name].weight.device

    @torch.no_grad()
    def reset_rows(
        self,
        table: str,
        rows: torch.Tensor,
        values: Callable[[torch.Tensor, tuple[int, int]], torch.Tensor],
    ) -> None:
        """Rows ``rows`` of ``table`` to ``values(rows, (0, embedding_dim))`` in place (a
        managed-collision table's evicted rows; the sharded collection has the same method)."""
        weight = self.embedding_bags[table].weight
        weight[rows] = values(rows, (0, weight.shape[1])).to(weight.dtype)

    def table_init_fn(self, table: str) -> Callable[[torch.Tensor], Any] | None:
        """The ``init_fn`` of table ``table``'s TorchRec config (None: the default init)."""
        return self._init_fns.get(table)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The table configs, in output order."""
        return list(self._tables)

    def forward(self, features: object) -> KeyedTensor:
        kjt = prepare_features(
            features,
            self._tables,
            bounds_check=self.bounds_check,
            device=self._device(),
            weighted=self.is_weighted,
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
