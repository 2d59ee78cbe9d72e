"""Table configuration: the one description of a table every layer shares."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    """How a bag's rows are combined: "sum" or "mean"."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"EmbeddingBagConfig.name must be a non-empty str, got {self.name!r}")
        for attr in ("num_embeddings", "embedding_dim"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"table {self.name!r}: {attr} must be a positive int, got {value!r}"
                )
        if self.pooling not in POOLING_MODES:
            raise ValueError(
                f"table {self.name!r}: pooling must be one of {POOLING_MODES}, got {self.pooling!r}"
            )
        if isinstance(self.feature_names, str):
            raise TypeError(
                f"table {self.name!r}: feature_names must be a list of str, got the str "
                f"{self.feature_names!r}; write [{self.feature_names!r}]"
            )
        names = list(self.feature_names) or [self.name]
        if any(not isinstance(f, str) or not f for f in names):
            raise TypeError(f"table {self.name!r}: feature_names must be non-empty strings")
        if len(set(names)) != len(names):
            raise ValueError(f"table {self.name!r}: duplicate feature names {names}")
        object.__setattr__(self, "feature_names", names)

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


def validate_tables(tables: list[EmbeddingBagConfig]) -> None:
    """Table names unique, every feature read by exactly one table."""
    seen_tables: set[str] = set()
    feature_owner: dict[str, str] = {}
    for cfg in tables:
        if not isinstance(cfg, EmbeddingBagConfig):
            raise TypeError(f"expected EmbeddingBagConfig, got {type(cfg).__name__}")
        if cfg.name in seen_tables:
            raise ValueError(f"duplicate table name {cfg.name!r}")
        seen_tables.add(cfg.name)
        for f in cfg.feature_names:
            if f in feature_owner:
                raise ValueError(
                    f"feature {f!r} is read by tables {feature_owner[f]!r} and {cfg.name!r}; "
                    "each feature must belong to one table"
                )
            feature_owner[f] = cfg.name
