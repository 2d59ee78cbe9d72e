"""The embedding-bag op and its backends.

``embedding_bag`` is the single entry point used by the unsharded and the
sharded modules; ``set_backend`` picks the implementation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from torch import Tensor

from dtrec.ops.embedding_bag import _pooling_per_table, embedding_bag_torch

__all__ = ["embedding_bag", "get_backend", "set_backend"]

_BACKENDS = ("auto", "torch")
_backend = os.environ.get("DTREC_BACKEND", "auto")


def set_backend(name: str) -> None:
    """Choose the lookup implementation: ``"auto"`` (best available) or ``"torch"``.

    Example::

        dtrec.ops.set_backend("torch")   # or DTREC_BACKEND=torch in the environment
    """
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; available: {_BACKENDS}")
    _backend = name


def get_backend() -> str:
    """The backend ``embedding_bag`` dispatches to now."""
    if _backend not in _BACKENDS:
        raise ValueError(f"DTREC_BACKEND={_backend!r} is not one of {_BACKENDS}")
    return _backend


def embedding_bag(
    weights: Sequence[Tensor],
    values: Tensor,
    offsets: Tensor,
    pooling: str | Sequence[str] = "sum",
    per_sample_weights: Tensor | None = None,
) -> Tensor:
    """Pooled lookup over T tables at once; returns ``[B, sum D]``.

    Bags are table-major (bag ``t * B + b``) and ``offsets`` has ``T * B + 1``
    entries into ``values``; ``pooling`` is one mode or one per table.

    Example::

        out = dtrec.ops.embedding_bag([w0, w1], ids, offsets, pooling=["sum", "mean"])
    """
    modes = _pooling_per_table(pooling, len(weights))
    get_backend()
    return embedding_bag_torch(list(weights), values, offsets, modes, per_sample_weights)
