"""fbgemm's table-batched forward (``dense_embedding_codegen_lookup_function``) as a backend.

Used for comparisons and where fbgemm's CPU kernel is fastest. It returns None
(the caller then uses the torch backend) when fbgemm does not load (warned
once by ``dtrec._fbgemm``), for mixed sum/mean pooling in one call (fbgemm
pools a whole call one way) or for non-fp32 tables. Backward rows come from
the torch backend.
"""

from __future__ import annotations

import math
from itertools import accumulate

import torch
from torch import Tensor

from dtrec._fbgemm import fbgemm_ops
from dtrec.ops.embedding_bag import Lookup

_SUM, _MEAN = 0, 1  # fbgemm PoolingMode values


def forward(lookup: Lookup) -> Tensor | None:
    """Pooled lookup via fbgemm, or None when fbgemm cannot serve this call."""
    weights, entry_table, values, mean = (
        lookup.weights,
        lookup.entry_table,
        lookup.values,
        lookup.mean,
    )
    offsets, per_sample_weights = lookup.offsets, lookup.per_sample_weights
    ops = fbgemm_ops()
    if ops is None or len(set(mean)) > 1 or weights[0].dtype != torch.float32:
        return None
    from dtrec.ops.triton_backend import pack_tables  # pure-torch helper, no triton needed

    flat, table_offsets = pack_tables(weights)
    device = values.device
    dims = [weights[t].shape[1] for t in entry_table]
    rows = [w.shape[0] for w in weights]
    row_starts = [0, *accumulate(rows)]
    hash_size_cumsum = [row_starts[t] for t in entry_table] + [row_starts[-1]]
    total_rows = row_starts[-1]
    return ops.dense_embedding_codegen_lookup_function(
        dev_weights=flat,
        weights_offsets=table_offsets[list(entry_table)].long(),
        D_offsets=torch.tensor([0, *accumulate(dims)], dtype=torch.int32, device=device),
        total_D=sum(dims),
        max_D=max(dims),
        hash_size_cumsum=torch.tensor(hash_size_cumsum, dtype=torch.int64, device=device),
        total_hash_size_bits=int(math.log2(total_rows) + 1) if total_rows else 0,
        indices=values,
        offsets=offsets.to(values.dtype),
        pooling_mode=_MEAN if mean[0] else _SUM,
        indice_weights=None if per_sample_weights is None else per_sample_weights.float(),
        feature_requires_grad=None,
    )
