"""Checks and reordering of a batch's features against a collection's tables.

Shared by the unsharded and the sharded collection so both reject bad input
with the same, specific error (naming the table, the feature and the rank).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dtrec.modules.config import EmbeddingBagConfig
from dtrec.ops.backends.device_lists import device_list
from dtrec.sparse import KeyedJaggedTensor, as_kjt
from dtrec.sparse.variable_batch import expand_variable_batch


def _where(rank: int | None) -> str:
    return "" if rank is None else f" on rank {rank}"


def feature_order(tables: Sequence[EmbeddingBagConfig]) -> list[str]:
    """Features in output order: tables in config order, features in table order."""
    return [f for cfg in tables for f in cfg.feature_names]


BOUNDS_CHECK_MODES = ("on", "off")


def check_bounds_mode(mode: str) -> str:
    """``"on"`` (default) or ``"off"`` for users who validate ids upstream."""
    if mode not in BOUNDS_CHECK_MODES:
        raise ValueError(f"bounds_check must be one of {BOUNDS_CHECK_MODES}, got {mode!r}")
    return mode


def check_weighted(is_weighted: bool | None) -> bool | None:
    """``is_weighted``: None (use a batch's per-sample weights when it has them), False
    (ignore them: TorchRec's unweighted collection) or True (require them)."""
    if is_weighted is not None and not isinstance(is_weighted, bool):
        raise TypeError(f"is_weighted must be True, False or None, got {is_weighted!r}")
    return is_weighted


class RefusedBatch:
    """Stands in for a batch that failed before it reached a collection (a feature
    processor raised on it): ``prepare_features`` raises ``error``. A sharded collection
    (``collective_forward``) raises it only after its input dist told its peers, so every
    rank fails that step together instead of some waiting in a collective."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def prepare_features(
    features: object,
    tables: Sequence[EmbeddingBagConfig],
    rank: int | None = None,
    bounds_check: str = "on",
    device: torch.device | None = None,
    weighted: bool | None = None,
) -> KeyedJaggedTensor:
    """Validate a batch and permute it into ``feature_order(tables)``.

    Keys no table reads are dropped (as TorchRec's collections ignore them). A KJT with
    ``inverse_indices`` (TorchRec's variable batch per feature) is expanded to its full
    batch (``dtrec.sparse.variable_batch``), so the output has one row per sample as
    TorchRec's has. Raises KeyError for a feature the batch lacks, ValueError for a
    variable-batch KJT without inverse indices, per-sample weights on a mean-pooled
    table or a batch not on ``device`` (where the tables are), IndexError for an id
    outside ``[0, num_embeddings)`` (unless ``bounds_check="off"``: an out-of-range id
    is then undefined behaviour). ``weighted`` (``check_weighted``): False drops the
    batch's per-sample weights, True makes a batch without them a ValueError.
    """
    if isinstance(features, RefusedBatch):
        raise features.error
    kjt = as_kjt(features)
    if device is not None and kjt.device() != device:
        raise ValueError(
            f"batch{_where(rank)} is on {kjt.device()} but the tables are on {device}; "
            f"move it with kjt.to({str(device)!r})"
        )
    order = feature_order(tables)
    present = set(kjt.keys())
    missing = [f for f in order if f not in present]
    if missing:
        owner = {f: cfg.name for cfg in tables for f in cfg.feature_names}
        raise KeyError(
            f"batch{_where(rank)} lacks feature(s) "
            + ", ".join(f"{f!r} (table {owner[f]!r})" for f in missing)
            + f"; batch keys: {kjt.keys()}"
        )
    if kjt.inverse_indices_or_none() is not None:
        kjt = expand_variable_batch(kjt, order)
    elif kjt.variable_stride_per_key():
        raise ValueError(
            f"batch{_where(rank)} has a variable batch per feature (stride_per_key_per_rank "
            f"{kjt.stride_per_key_per_rank()}) but no inverse_indices: the pooled output needs "
            "them to map each sample to its bag (build the KJT with inverse_indices=(keys, "
            "[F, B] tensor), as TorchRec's VBE does)"
        )
    elif kjt.keys() != order:
        kjt = kjt.permute(order)  # also drops keys no table reads
    if weighted is False and kjt.weights_or_none() is not None:
        kjt = KeyedJaggedTensor(kjt.keys(), kjt.values(), kjt.lengths(), stride=kjt.stride())
    if weighted is True and kjt.weights_or_none() is None:
        raise ValueError(
            f"batch{_where(rank)} has no per-sample weights but the collection of tables "
            f"{[cfg.name for cfg in tables]} is weighted (is_weighted=True); build the "
            "KeyedJaggedTensor with weights"
        )
    if kjt.weights_or_none() is not None:
        mean_tables = [cfg.name for cfg in tables if cfg.pooling == "mean"]
        if mean_tables:
            raise ValueError(
                f"per-sample weights{_where(rank)} need sum pooling; "
                f"table(s) {mean_tables} use mean pooling"
            )
    if bounds_check == "on":
        check_id_range(kjt, tables, rank)
    return kjt


def count_bad_ids(kjt: KeyedJaggedTensor, tables: Sequence[EmbeddingBagConfig]) -> Tensor:
    """int64 ``[1]`` on the batch's device: how many ids lie outside ``[0, rows of their
    feature's table)``. No host read: a caller that must fail on a bad batch reads it where
    it reads the device anyway (the sharded input dist's header), or raises
    ``check_id_range``'s error."""
    values = kjt.values()
    if values.numel() == 0:
        return torch.zeros(1, dtype=torch.int64, device=values.device)
    rows = device_list(
        [cfg.num_embeddings for cfg in tables for _ in cfg.feature_names], torch.int64,
        values.device,
    )  # fmt: skip
    counts = bag_lengths(kjt).sum(1)
    bound = torch.repeat_interleave(rows, counts, output_size=values.numel())
    return ((values < 0) | (values >= bound)).sum(dtype=torch.int64).view(1)


def check_id_range(
    kjt: KeyedJaggedTensor, tables: Sequence[EmbeddingBagConfig], rank: int | None = None
) -> None:
    """Every id of feature f lies in ``[0, rows of f's table)``; one vectorized pass and one
    host read (the verdict), then, for a bad batch only, the details of its first bad id."""
    if not int(count_bad_ids(kjt, tables)):
        return
    values = kjt.values()
    rows = torch.tensor([cfg.num_embeddings for cfg in tables for _ in cfg.feature_names])
    counts = bag_lengths(kjt).sum(1).cpu()
    bound = torch.repeat_interleave(rows, counts)
    host = values.cpu()
    bad = (host < 0) | (host >= bound)
    first = int(torch.nonzero(bad)[0])
    key_index = int(torch.searchsorted(torch.cumsum(counts, 0), first, right=True))
    feature = kjt.keys()[key_index]
    table = next(cfg for cfg in tables if feature in cfg.feature_names)
    raise IndexError(
        f"feature {feature!r} (table {table.name!r}){_where(rank)}: id {int(host[first])} "
        f"is outside [0, {table.num_embeddings}) ({int(bad.sum())} bad ids in the batch)"
    )


def bag_lengths(kjt: KeyedJaggedTensor) -> Tensor:
    """Lengths as ``[num_features, B]``."""
    return kjt.lengths().view(len(kjt.keys()), kjt.stride())
