"""What each native (fbgemm) op dtrec calls needs of its arguments, checked on every call.

fbgemm's CPU ops trust their arguments: an id past its table, offsets that overrun the
ids, or a layout that puts a table past the end of its buffer read and write outside
the tensors, into glibc's heap (``benchmarks/soak/run.py``'s notes: one id past a table in
``split_embedding_backward_codegen_sgd_cpu`` ends in ``malloc(): unaligned tcache chunk
detected``, ``double free or corruption`` or a segfault, depending on what lies there).

``CheckingOps`` stands in for ``torch.ops.fbgemm`` where dtrec looks it up
(``install``): each call of an op listed in ``CHECKS`` is checked first, then run;
violations and calls are recorded. An op dtrec calls that has no check here is
recorded as unchecked, so a new native call cannot slip past the test unnoticed.

The invariants, per op (T features, B bags per feature, rows_t the rows of feature t's
table: the next non-zero step of ``hash_size_cumsum``, as fbgemm reads it):

* ``block_bucketize_sparse_features(lengths, indices, bucketize_pos, sequence,
  block_sizes, my_size, weights)``: lengths and indices 1-D, one integer dtype,
  contiguous; lengths >= 0, ``sum(lengths) == len(indices)``; ``len(lengths)`` a multiple
  of ``len(block_sizes)``; block sizes > 0; ``my_size >= 1``; ids >= 0 and below
  ``block_size * my_size`` of their feature (else fbgemm's fallback bucket is not
  dtrec's row block); weights None or one per id.
* ``dense_embedding_codegen_lookup_function`` and
  ``split_embedding_backward_codegen_{sgd,rowwise_adagrad}_cpu`` (the table-batched
  layout): the weight buffer (and row-wise Adagrad's ``momentum1_host``) 1-D and
  contiguous (rows are addressed as a raw pointer); ``D_offsets`` int32, T + 1
  non-decreasing entries ending at total_D, max_D their largest step;
  ``weights_offsets`` int64, T entries; ``hash_size_cumsum`` int64, T + 1
  non-decreasing entries, ``total_hash_size_bits`` enough for its last entry; every
  feature's table inside the weight buffer (``weights_offsets[t] + rows_t * D_t <=
  numel``); offsets T * B + 1 non-decreasing entries from 0 to ``len(indices)``, the
  ids' dtype; every id of feature t in ``[0, rows_t)``; per-sample weights one per
  id, or None (forward) / an empty tensor (backward: the forward reads an empty one
  as weights, past its end). Backward: ``grad_output`` fp32 ``[B, total_D]`` (fbgemm
  makes it contiguous); placements T entries; row-wise Adagrad's
  ``momentum1_offsets[t] + rows_t <= len(momentum1_host)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from dtrec._torch_compat import op_argument_names

INDEX = (torch.int32, torch.int64)


def _bind(name: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    names = op_argument_names(getattr(torch.ops.fbgemm, name).default)
    return {**dict(zip(names, args)), **kwargs}


def _rows(hash_size_cumsum: list[int], t: int) -> int:
    """Feature t's table rows, read as fbgemm reads them (skipping zero steps of features
    that share the table)."""
    for u in range(t + 1, len(hash_size_cumsum)):
        if hash_size_cumsum[u] - hash_size_cumsum[t]:
            return hash_size_cumsum[u] - hash_size_cumsum[t]
    return 0


def check_block_bucketize(a: dict[str, Any]) -> list[str]:
    bad = []
    lengths, ids, sizes, my_size = a["lengths"], a["indices"], a["block_sizes"], a["my_size"]
    for name, t in (("lengths", lengths), ("indices", ids), ("block_sizes", sizes)):
        if t.dim() != 1 or t.dtype not in INDEX or not t.is_contiguous():
            bad.append(f"{name}: {t.dim()}-D {t.dtype} contiguous={t.is_contiguous()}")
    if len({lengths.dtype, ids.dtype, sizes.dtype}) != 1:
        bad.append(f"dtypes differ: {lengths.dtype}, {ids.dtype}, {sizes.dtype}")
    if bad:
        return bad
    if my_size < 1:
        bad.append(f"my_size {my_size}")
    features = sizes.numel()
    if features == 0 or lengths.numel() % features:
        return [*bad, f"{lengths.numel()} lengths for {features} features"]
    if bool((lengths < 0).any()):
        bad.append(f"negative lengths {lengths[lengths < 0][:5].tolist()}")
    if int(lengths.sum()) != ids.numel():
        bad.append(f"sum(lengths) {int(lengths.sum())} != {ids.numel()} ids")
    if bool((sizes <= 0).any()):
        bad.append(f"block sizes {sizes.tolist()}")
    if bad:
        return bad
    per_feature = lengths.view(features, -1).sum(1)
    bound = torch.repeat_interleave(sizes * my_size, per_feature)
    if bool(((ids < 0) | (ids >= bound)).any()):
        i = int(((ids < 0) | (ids >= bound)).nonzero()[0])
        bad.append(f"id {int(ids[i])} outside [0, {int(bound[i])}) (block size x my_size)")
    w = a.get("weights")
    if w is not None and w.numel() != ids.numel():
        bad.append(f"{w.numel()} weights for {ids.numel()} ids")
    return bad


def _check_layout(
    a: dict[str, Any], weights: Tensor, empty_means_none: bool
) -> tuple[list[str], list[int], int]:
    """The table-batched layout's invariants; (violations, rows per feature, B)."""
    bad: list[str] = []
    d_off, w_off, cumsum = a["D_offsets"], a["weights_offsets"], a["hash_size_cumsum"]
    ids, offsets = a["indices"], a["offsets"]
    if d_off.dtype != torch.int32 or w_off.dtype != torch.int64 or cumsum.dtype != torch.int64:
        return [f"dtypes: D_offsets {d_off.dtype}, weights_offsets {w_off.dtype}, "
                f"hash_size_cumsum {cumsum.dtype}"], [], 0  # fmt: skip
    if weights.dim() != 1 or not weights.is_contiguous():  # rows addressed as raw float*
        bad.append(f"weight buffer {weights.dim()}-D contiguous={weights.is_contiguous()}")
    features = d_off.numel() - 1
    d, w_start, hs = d_off.tolist(), w_off.tolist(), cumsum.tolist()
    dims = [d[t + 1] - d[t] for t in range(features)]
    if features < 1 or any(x < 0 for x in dims) or d[0] != 0:
        return [f"D_offsets {d}"], [], 0
    if "total_D" in a and d[-1] != a["total_D"]:
        bad.append(f"D_offsets end {d[-1]} != total_D {a['total_D']}")
    if a["max_D"] != max(dims):
        bad.append(f"max_D {a['max_D']} != {max(dims)}")
    if len(w_start) != features or len(hs) != features + 1:
        return [*bad, f"{len(w_start)} weights_offsets, {len(hs)} hash_size_cumsum for "
                f"{features} features"], [], 0  # fmt: skip
    if any(b < a_ for a_, b in zip(hs, hs[1:])) or hs[0] != 0:
        bad.append(f"hash_size_cumsum {hs}")
    if hs[-1] and a["total_hash_size_bits"] < math.ceil(math.log2(hs[-1] + 1)):
        bad.append(f"total_hash_size_bits {a['total_hash_size_bits']} for {hs[-1]} rows")
    rows = [_rows(hs, t) for t in range(features)]
    for t in range(features):
        if w_start[t] < 0 or w_start[t] + rows[t] * dims[t] > weights.numel():
            bad.append(f"feature {t}: table [{w_start[t]}, +{rows[t]}x{dims[t]}) past the "
                       f"buffer of {weights.numel()}")  # fmt: skip
    if ids.dim() != 1 or ids.dtype not in INDEX or offsets.dtype != ids.dtype:
        return [*bad, f"indices {ids.dtype} {ids.dim()}-D, offsets {offsets.dtype}"], rows, 0
    n = offsets.numel() - 1
    if n < 0 or n % features:
        return [*bad, f"{offsets.numel()} offsets for {features} features"], rows, 0
    batch = n // features
    off = offsets.tolist()
    if off[0] != 0 or off[-1] != ids.numel() or any(b < a_ for a_, b in zip(off, off[1:])):
        bad.append(f"offsets from {off[0]} to {off[-1]} for {ids.numel()} ids (or decreasing)")
        return bad, rows, batch
    counts = torch.tensor([off[(t + 1) * batch] - off[t * batch] for t in range(features)])
    bound = torch.repeat_interleave(torch.tensor(rows), counts)
    out = (ids < 0) | (ids >= bound)
    if bool(out.any()):
        i = int(out.nonzero()[0])
        bad.append(f"id {int(ids[i])} outside its table's [0, {int(bound[i])})")
    psw = a.get("indice_weights")
    allowed = (0, ids.numel()) if empty_means_none else (ids.numel(),)
    if psw is not None and psw.numel() not in allowed:
        bad.append(f"{psw.numel()} per-sample weights for {ids.numel()} ids")
    return bad, rows, batch


def check_forward(a: dict[str, Any]) -> list[str]:
    return _check_layout(a, a["dev_weights"], empty_means_none=False)[0]


def check_backward(a: dict[str, Any]) -> list[str]:
    bad, rows, batch = _check_layout(a, a["host_weights"], empty_means_none=True)
    grad, total_d = a["grad_output"], int(a["D_offsets"][-1])
    if grad.dtype != torch.float32 or tuple(grad.shape) != (batch, total_d):
        bad.append(f"grad_output {grad.dtype} {tuple(grad.shape)}, want ({batch}, {total_d})")
    if a["weights_placements"].numel() != len(a["weights_offsets"]):
        bad.append(f"{a['weights_placements'].numel()} weights_placements")
    if "momentum1_host" in a:
        m, m_off = a["momentum1_host"], a["momentum1_offsets"].tolist()
        if m.dim() != 1 or not m.is_contiguous():
            bad.append(f"momentum1_host {m.dim()}-D contiguous={m.is_contiguous()}")
        for t, r in enumerate(rows):
            if m_off[t] < 0 or m_off[t] + r > m.numel():
                bad.append(f"feature {t}: momentum1 [{m_off[t]}, +{r}) past {m.numel()}")
    return bad


CHECKS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "block_bucketize_sparse_features": check_block_bucketize,
    "dense_embedding_codegen_lookup_function": check_forward,
    "split_embedding_backward_codegen_sgd_cpu": check_backward,
    "split_embedding_backward_codegen_rowwise_adagrad_cpu": check_backward,
}


class CheckingOps:
    """``torch.ops.fbgemm`` with every listed op's arguments checked before it runs.

    A violating call is recorded and not run (``RuntimeError``: running it could
    corrupt the heap the test needs to report)."""

    def __init__(self, ops: Any) -> None:
        self._ops = ops
        self.calls: dict[str, int] = {}
        self.violations: list[str] = []
        self.unchecked: set[str] = set()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        op = getattr(self._ops, name)
        check = CHECKS.get(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            if check is None:
                self.unchecked.add(name)
                return op(*args, **kwargs)
            bad = check(_bind(name, args, kwargs))
            if bad:
                self.violations.append(f"{name}: {'; '.join(bad)}")
                raise RuntimeError(f"native invariant violated by {name}: {bad}")
            return op(*args, **kwargs)

        return call


@contextmanager
def install(checker: CheckingOps) -> Iterator[CheckingOps]:
    """Make dtrec call fbgemm through ``checker`` (every module that looks the ops up)."""
    import dtrec.ops.backends.fbgemm as backend
    import dtrec.sharded.dist.routing as routing

    saved = backend.fbgemm_ops, routing.fbgemm_ops
    backend.fbgemm_ops = routing.fbgemm_ops = lambda: checker
    try:
        yield checker
    finally:
        backend.fbgemm_ops, routing.fbgemm_ops = saved
