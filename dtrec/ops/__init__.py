"""The embedding-bag op and its backends.

``embedding_bag`` is the single entry point used by the unsharded and the
sharded modules; ``set_backend`` picks the implementation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from dtrec.ops.backends.registry import get_backend, set_backend
from dtrec.ops.dtensor_bridge import register_dtensor_rules as register_dtensor_rules
from dtrec.ops.lookup import check_embedding_bag_args, pooling_flags
from dtrec.ops.op import EmbeddingBagFunction

__all__ = ["embedding_bag", "get_backend", "set_backend"]


def distinct_tables(weights: Sequence[Tensor]) -> tuple[list[Tensor], list[int]]:
    """Split a per-entry table list into distinct tables (by identity) + entry -> table."""
    index: dict[int, int] = {}
    tables: list[Tensor] = []
    entry_table = []
    for w in weights:
        if id(w) not in index:
            index[id(w)] = len(tables)
            tables.append(w)
        entry_table.append(index[id(w)])
    return tables, entry_table


def embedding_bag(
    weights: Sequence[Tensor],
    values: Tensor,
    offsets: Tensor,
    pooling: str | Sequence[str] = "sum",
    per_sample_weights: Tensor | None = None,
    bounds_check: str = "on",
) -> Tensor:
    """Pooled lookup over T tables at once; returns ``[B, sum D]``.

    Bags are table-major (bag ``t * B + b``) and ``offsets`` has ``T * B + 1``
    entries into ``values``; ``pooling`` is one mode or one per table. The same
    tensor may appear several times in ``weights`` (it is looked up once per
    appearance and gets one gradient). ``bounds_check="off"`` skips the checks of
    the ids and offsets' values (in range; offsets from 0 to ``values.numel()``,
    non-decreasing) for callers that validate upstream (a bad one is then
    undefined behaviour); they cost a device-to-host read each.

    Example::

        out = dtrec.ops.embedding_bag([w0, w1], ids, offsets, pooling=["sum", "mean"])
    """
    if isinstance(weights, Tensor) or not all(isinstance(w, Tensor) for w in weights):
        raise TypeError(
            "weights must be a list of 2-D tensors (one per table), got "
            + (
                "one Tensor; write [weight]"
                if isinstance(weights, Tensor)
                else str([type(w).__name__ for w in weights])
            )
        )
    if bounds_check not in ("on", "off"):
        raise ValueError(f"bounds_check must be 'on' or 'off', got {bounds_check!r}")
    mean = pooling_flags(pooling, len(weights))
    tables, entry_table = distinct_tables(weights)
    batch = check_embedding_bag_args(tables, entry_table, values, offsets, mean, per_sample_weights)
    if batch == 0 and entry_table and _connects(weights):
        # an empty batch's (0, sum D) output still hangs off the tables, so a loss over it
        # can call backward() (zero gradients), as torch's own embedding_bag allows
        return torch.cat([w[:0] for w in weights], dim=1)
    if not entry_table or batch == 0:
        width = sum(w.shape[1] for w in weights)
        dtype = weights[0].dtype if weights else torch.float32
        return values.new_zeros((batch, width), dtype=dtype)
    return EmbeddingBagFunction.apply(
        entry_table, mean, bounds_check == "on", values, offsets, per_sample_weights, *tables
    )


def _connects(weights: Sequence[Tensor]) -> bool:
    """Whether an output must be connected to ``weights`` in autograd (plain tensors; a
    DTensor's empty batch goes through its sharding rule)."""
    return torch.is_grad_enabled() and any(
        w.requires_grad and not isinstance(w, DTensor) for w in weights
    )
