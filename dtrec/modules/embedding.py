"""Sequence (unpooled) tables: ``EmbeddingConfig`` and the unsharded ``EmbeddingCollection``.

A sequence lookup returns one row per id instead of one pooled row per sample. It is
the pooled op with bags of length 1 (``offsets = arange(n + 1)``), so every backend and
fused optimizer of the pooled path applies unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from dtrec import ops
from dtrec.modules.config import (
    check_table_fields,
    check_table_names,
    check_torchrec_table,
    table_dtype,
)
from dtrec.modules.features import check_bounds_mode, feature_order, prepare_features
from dtrec.sparse import JaggedTensor, KeyedJaggedTensor, as_kjt


@dataclass(frozen=True)
class EmbeddingConfig:
    """One sequence (unpooled) table and the features that look it up.

    Example::

        cfg = EmbeddingConfig("t_item", num_embeddings=10_000, embedding_dim=64,
                              feature_names=["item_history"])
    """

    name: str
    """Table name; unique within a collection, used in plans and state_dict keys."""
    num_embeddings: int
    """Number of rows (valid ids are 0 .. num_embeddings - 1)."""
    embedding_dim: int
    """Number of columns of each looked-up row; may differ between tables of a collection."""
    feature_names: list[str] = field(default_factory=list)
    """Features (KeyedJaggedTensor keys) looked up in this table; default: [name]."""

    def __post_init__(self) -> None:
        check_table_fields(self)

    def __hash__(self) -> int:
        return hash((self.name, self.num_embeddings, self.embedding_dim, tuple(self.feature_names)))


def is_torchrec_sequence_config(obj: object) -> bool:
    """Whether ``obj`` is a TorchRec ``EmbeddingConfig`` (duck-typed: class name and fields)."""
    fields = ("name", "num_embeddings", "embedding_dim", "feature_names", "data_type")
    return type(obj).__name__ == "EmbeddingConfig" and all(hasattr(obj, a) for a in fields)


def as_sequence_config(cfg: object) -> EmbeddingConfig:
    """``cfg`` itself, or dtrec's config for a TorchRec ``EmbeddingConfig``."""
    if isinstance(cfg, EmbeddingConfig):
        return cfg
    if not is_torchrec_sequence_config(cfg):
        hint = ""
        if type(cfg).__name__ == "EmbeddingBagConfig":
            hint = " (a pooled table: put it in an EmbeddingBagCollection)"
        raise TypeError(f"expected EmbeddingConfig, got {type(cfg).__name__}{hint}")
    check_torchrec_table(cfg)
    table_dtype(cfg)
    return EmbeddingConfig(
        cfg.name,  # type: ignore[attr-defined]
        cfg.num_embeddings,  # type: ignore[attr-defined]
        cfg.embedding_dim,  # type: ignore[attr-defined]
        list(cfg.feature_names),  # type: ignore[attr-defined]
    )


def sequence_table_dtype(cfg: object) -> torch.dtype:
    """torch's default dtype for dtrec's configs, the ``data_type``'s for TorchRec's."""
    return torch.get_default_dtype() if isinstance(cfg, EmbeddingConfig) else table_dtype(cfg)


def check_fixed_batch(
    kjt: KeyedJaggedTensor, tables: Sequence[EmbeddingConfig], rank: int | None = None
) -> None:
    """ValueError for a variable batch per feature (VBE): an unpooled output has one row
    per id, so there are no per-sample rows to expand through ``inverse_indices``."""
    if kjt.variable_stride_per_key() or kjt.inverse_indices_or_none() is not None:
        where = "" if rank is None else f" on rank {rank}"
        raise ValueError(
            f"batch{where} is a variable-batch KJT (stride_per_key_per_rank / "
            f"inverse_indices): sequence tables {[c.name for c in tables]} return one row "
            "per id and do not expand variable batches; give every feature the same "
            "batch size"
        )


def prepare_sequence_features(
    features: object,
    tables: Sequence[EmbeddingConfig],
    bounds_check: str = "on",
    device: torch.device | None = None,
) -> KeyedJaggedTensor:
    """``prepare_features`` for sequence tables: no variable batch (``check_fixed_batch``);
    per-sample weights are dropped (a sequence lookup does not use them, as in TorchRec)."""
    kjt = as_kjt(features)
    check_fixed_batch(kjt, tables)
    return prepare_features(kjt, tables, None, bounds_check, device, weighted=False)


def sequence_outputs(
    kjt: KeyedJaggedTensor,
    rows: Sequence[Tensor],
    need_indices: bool,
    length_per_key: Sequence[int] | None = None,
) -> dict[str, JaggedTensor]:
    """Feature -> JaggedTensor of its rows (``rows[k]``: ``[ids of feature k, D]``);
    ``length_per_key``: ``kjt.length_per_key()`` when the caller has read it (a traced
    forward: the KJT's cache is not written)."""
    lengths = kjt.lengths().view(len(kjt.keys()), kjt.stride())
    if need_indices and length_per_key is None:
        length_per_key = kjt.length_per_key()
    ids = kjt.values().split(list(length_per_key)) if need_indices else None
    return {
        f: JaggedTensor._trusted(rows[k], lengths[k], None if ids is None else ids[k])
        for k, f in enumerate(kjt.keys())
    }


class EmbeddingCollection(nn.Module):
    """Sequence (unpooled) embedding tables looked up by a ``KeyedJaggedTensor``.

    ``forward`` returns ``{feature: JaggedTensor}`` whose values are ``[ids, D]`` (one row
    per id, D the feature's table's dim: mixed dims are allowed, unlike TorchRec) and whose
    lengths are the feature's; with ``need_indices`` the ids are the JaggedTensor's
    weights (TorchRec's convention). ``state_dict`` keys are ``embeddings.<table>.weight``
    (TorchRec's). TorchRec ``EmbeddingConfig``s are accepted (``data_type``, ``init_fn``).

    Example::

        ec = EmbeddingCollection([EmbeddingConfig("t0", 100, 8, ["f0"])])
        rows = ec(KeyedJaggedTensor(["f0"], ids, lengths))["f0"].values()  # [ids, 8]
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        device: torch.device | str | None = None,
        need_indices: bool = False,
        bounds_check: str = "on",
    ) -> None:
        super().__init__()
        if isinstance(tables, EmbeddingConfig) or is_torchrec_sequence_config(tables):
            raise TypeError("tables must be a list of EmbeddingConfig; write [config]")
        given = list(tables)
        self._tables = [as_sequence_config(cfg) for cfg in given]
        check_table_names(self._tables)
        self.need_indices = bool(need_indices)
        self.bounds_check = check_bounds_mode(bounds_check)
        self._init_fns = {
            cfg.name: getattr(o, "init_fn", None) for cfg, o in zip(self._tables, given)
        }
        self.embeddings = nn.ModuleDict(
            {
                cfg.name: nn.Embedding(
                    cfg.num_embeddings,
                    cfg.embedding_dim,
                    device=device,
                    dtype=sequence_table_dtype(original),
                )
                for cfg, original in zip(self._tables, given, strict=True)
            }
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """TorchRec's default init: uniform in +-sqrt(1 / num_embeddings) (or the
        ``init_fn`` of a TorchRec config)."""
        for cfg in self._tables:
            weight = self.embeddings[cfg.name].weight
            if weight.device.type == "meta":
                continue
            with torch.no_grad():
                init_fn = self._init_fns.get(cfg.name)
                if init_fn is not None:
                    init_fn(weight)
                else:
                    bound = math.sqrt(1.0 / cfg.num_embeddings)
                    weight.uniform_(-bound, bound)

    @torch.no_grad()
    def reset_rows(
        self, table: str, rows: Tensor, values: Callable[[Tensor, tuple[int, int]], Tensor]
    ) -> None:
        """Rows ``rows`` of ``table`` to ``values(rows, (0, embedding_dim))`` in place (a
        managed-collision table's evicted rows; the sharded collection has the same method)."""
        weight = self.embeddings[table].weight
        weight[rows] = values(rows, (0, weight.shape[1])).to(weight.dtype)

    def table_init_fn(self, table: str) -> Callable[[Tensor], Any] | None:
        """The ``init_fn`` of table ``table``'s TorchRec config (None: the default init)."""
        return self._init_fns.get(table)

    def embedding_configs(self) -> list[EmbeddingConfig]:
        """The table configs, in output order."""
        return list(self._tables)

    def feature_names(self) -> list[str]:
        """Output keys, in order: tables in config order, features in table order."""
        return feature_order(self._tables)

    def forward(self, features: object) -> dict[str, JaggedTensor]:
        device = self.embeddings[self._tables[0].name].weight.device if self._tables else None
        kjt = prepare_sequence_features(features, self._tables, self.bounds_check, device)
        per_feature = kjt.length_per_key()
        rows: list[Tensor] = []
        start = 0
        for cfg in self._tables:  # features of a table are adjacent: one lookup per table
            counts = per_feature[len(rows) : len(rows) + len(cfg.feature_names)]
            ids = kjt.values()[start : start + sum(counts)]
            start += sum(counts)
            rows.extend(lookup_rows(self.embeddings[cfg.name].weight, ids).split(counts))
        return sequence_outputs(kjt, rows, self.need_indices)


def lookup_rows(weight: Tensor, ids: Tensor) -> Tensor:
    """``weight[ids]`` through the pooled op (bags of one id): ``[ids, D]``, differentiable
    (also without ids, as TorchRec's ``nn.Embedding`` lookup is)."""
    if ids.numel() == 0:
        return weight.index_select(0, ids.long())
    offsets = torch.arange(ids.numel() + 1, device=ids.device)
    return ops.embedding_bag([weight], ids, offsets, "sum", bounds_check="off")
