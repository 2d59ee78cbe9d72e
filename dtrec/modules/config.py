"""Table configuration: the one description of a table every layer shares."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from dtrec.ops.lookup import POOLING_MODES


@dataclass(frozen=True)
class EmbeddingBagConfig:
    """One embedding table and the features that look it up.

    Example::

        cfg = EmbeddingBagConfig("t_user", num_embeddings=10_000, embedding_dim=64,
                                 feature_names=["user_id"], pooling="sum")
    """

    name: str
    """Table name; unique within a collection, used in plans and state_dict keys."""
    num_embeddings: int
    """Number of rows (valid ids are 0 .. num_embeddings - 1)."""
    embedding_dim: int
    """Number of columns (width of each pooled output)."""
    feature_names: list[str] = field(default_factory=list)
    """Features (KeyedJaggedTensor keys) pooled from this table; default: [name]."""
    pooling: str = "sum"
    """How a bag's rows are combined: "sum" or "mean" (TorchRec's ``PoolingType`` is accepted)."""

    def __post_init__(self) -> None:
        check_table_fields(self)
        object.__setattr__(self, "pooling", pooling_mode(self.pooling, self.name))
        if self.pooling not in POOLING_MODES:
            raise ValueError(
                f"table {self.name!r}: pooling must be one of {POOLING_MODES}, got {self.pooling!r}"
            )

    def __hash__(self) -> int:
        return hash(
            (
                self.name,
                self.num_embeddings,
                self.embedding_dim,
                tuple(self.feature_names),
                self.pooling,
            )
        )


def check_table_fields(cfg: object) -> None:
    """A table config's name, sizes and features (pooled or sequence alike): a non-empty
    name, positive int rows and dim, distinct non-empty feature names (default: the
    table's name, written back into the frozen config)."""
    name = cfg.name  # type: ignore[attr-defined]
    if not isinstance(name, str) or not name:
        raise TypeError(f"{type(cfg).__name__}.name must be a non-empty str, got {name!r}")
    for attr in ("num_embeddings", "embedding_dim"):
        value = getattr(cfg, attr)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"table {name!r}: {attr} must be a positive int, got {value!r}")
    features = cfg.feature_names  # type: ignore[attr-defined]
    if isinstance(features, str):
        raise TypeError(
            f"table {name!r}: feature_names must be a list of str, got the str "
            f"{features!r}; write [{features!r}]"
        )
    names = list(features) or [name]
    if any(not isinstance(f, str) or not f for f in names):
        raise TypeError(f"table {name!r}: feature_names must be non-empty strings")
    if len(set(names)) != len(names):
        raise ValueError(f"table {name!r}: duplicate feature names {names}")
    object.__setattr__(cfg, "feature_names", names)


def check_torchrec_table(cfg: object) -> None:
    """TorchRec config fields dtrec cannot honour (virtual / pruned tables) are a
    ValueError naming the table, never dropped silently."""
    unsupported = {
        "use_virtual_table": bool(getattr(cfg, "use_virtual_table", False)),
        "num_embeddings_post_pruning": getattr(cfg, "num_embeddings_post_pruning", None)
        is not None,
    }
    for field_name, is_set in unsupported.items():
        if is_set:
            raise ValueError(
                f"table {cfg.name!r}: TorchRec's {field_name} is not supported by dtrec; "  # type: ignore[attr-defined]
                "build the table without it"
            )


def pooling_mode(pooling: object, table: str) -> object:
    """``"sum"`` / ``"mean"`` for TorchRec's ``PoolingType.SUM`` / ``MEAN`` (an enum whose
    value is the upper-case name); anything else is returned for the caller to check."""
    value = getattr(pooling, "value", None)
    if type(pooling).__name__ != "PoolingType" or not isinstance(value, str):
        return pooling
    if value == "NONE":
        raise ValueError(
            f"table {table!r}: PoolingType.NONE is an unpooled (sequence) table; an "
            "EmbeddingBagConfig pools, so use PoolingType.SUM or MEAN"
        )
    return value.lower()


_TORCHREC_DTYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}
"""TorchRec ``DataType`` value -> the weight dtype of a table with that ``data_type``."""


def is_torchrec_bag_config(obj: object) -> bool:
    """Whether ``obj`` is a TorchRec ``EmbeddingBagConfig`` (duck-typed: its class name and
    fields; torchrec is never imported here)."""
    fields = ("name", "num_embeddings", "embedding_dim", "feature_names", "pooling", "data_type")
    return type(obj).__name__ == "EmbeddingBagConfig" and all(hasattr(obj, a) for a in fields)


def table_dtype(cfg: object) -> torch.dtype:
    """The weight dtype of a table: torch's default (float32) for dtrec's configs, the
    ``data_type``'s (FP32, FP16, BF16) for TorchRec's."""
    if isinstance(cfg, EmbeddingBagConfig):
        return torch.get_default_dtype()
    data_type = getattr(cfg, "data_type", None)
    key = getattr(data_type, "value", data_type)
    if key not in _TORCHREC_DTYPES:
        shown = f"DataType.{getattr(data_type, 'name', data_type)}"
        raise ValueError(
            f"table {getattr(cfg, 'name', '?')!r}: data_type {shown} is not a float type "
            f"dtrec trains; use one of {[f'DataType.{k}' for k in _TORCHREC_DTYPES]}"
        )
    return _TORCHREC_DTYPES[key]


def as_bag_config(cfg: object) -> EmbeddingBagConfig:
    """``cfg`` itself, or dtrec's config for a TorchRec ``EmbeddingBagConfig`` (same name,
    rows, dim, features and pooling). TorchRec fields dtrec cannot honour (virtual /
    pruned tables) are a ValueError naming the table, never dropped silently."""
    if isinstance(cfg, EmbeddingBagConfig):
        return cfg
    if not is_torchrec_bag_config(cfg):
        hint = ""
        if type(cfg).__name__ == "EmbeddingConfig":
            hint = " (an unpooled sequence table: put it in an EmbeddingCollection)"
        raise TypeError(f"expected EmbeddingBagConfig, got {type(cfg).__name__}{hint}")
    check_torchrec_table(cfg)
    table_dtype(cfg)
    return EmbeddingBagConfig(
        cfg.name,  # type: ignore[attr-defined]
        cfg.num_embeddings,  # type: ignore[attr-defined]
        cfg.embedding_dim,  # type: ignore[attr-defined]
        list(cfg.feature_names),  # type: ignore[attr-defined]
        cfg.pooling,  # type: ignore[attr-defined]
    )


def validate_tables(tables: list[EmbeddingBagConfig]) -> None:
    """Every table an ``EmbeddingBagConfig``; names and features as ``check_table_names``."""
    for cfg in tables:
        if not isinstance(cfg, EmbeddingBagConfig):
            raise TypeError(f"expected EmbeddingBagConfig, got {type(cfg).__name__}")
    check_table_names(tables)


def check_table_names(tables: Sequence[object]) -> None:
    """Table names unique and usable as module names, every feature read by one table.

    Tables live in an ``nn.ModuleDict`` keyed by name (TorchRec's state_dict keys), so
    a name that is one of its attributes (``items``, ``keys``, ...) cannot be a table's.
    """
    seen_tables: set[str] = set()
    feature_owner: dict[str, str] = {}
    for cfg in tables:
        name = cfg.name  # type: ignore[attr-defined]
        if hasattr(nn.ModuleDict, name):
            raise ValueError(
                f"table name {name!r} is the name of an nn.ModuleDict attribute, which holds "
                "the tables; rename the table"
            )
        if name in seen_tables:
            raise ValueError(f"duplicate table name {name!r}")
        seen_tables.add(name)
        for f in cfg.feature_names:  # type: ignore[attr-defined]
            if f in feature_owner:
                raise ValueError(
                    f"feature {f!r} is read by tables {feature_owner[f]!r} and {name!r}; "
                    "each feature must belong to one table"
                )
            feature_owner[f] = name
