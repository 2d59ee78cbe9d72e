"""Triton kernels for the multi-table pooled embedding lookup (forward).

Plain tensors only: nothing here knows of DTensor, meshes or process groups, and
there is no autograd. Each kernel sits beside its launcher; the row-sparse backward
is ``embedding_bag_bwd.py``, the fused optimizer updates ``update_rows.py`` and the
pure-torch references of all of them ``reference.py``;
``tests/ops/test_triton_kernels.py`` compares them.

Packed layout shared by every kernel here and in ``embedding_bag_bwd.py``:

* ``weights``: one flat 1-D buffer (fp32, bf16 or fp16) holding all U local tables.
  Table ``u`` is ``weights[table_offsets[u] : table_offsets[u] + rows_u * dims[u]]``,
  row-major: row ``r`` starts at ``table_offsets[u] + r * dims[u]`` (a row is contiguous).
* ``table_offsets`` int64 ``[U]``; ``dims`` int32 ``[U]``; ``num_rows`` int64 ``[U]``.
* E entries (one feature reading one table; several may share a table):
  ``entry_table`` int32 ``[E]``, ``out_cols`` int32 or int64 ``[E]`` (first output column of the
  entry), ``mean`` int8/bool ``[E]`` (mean instead of sum pooling).
* ``values`` int32/int64 ids local to their table, entry-major then bag-major;
  ``offsets`` int64 ``[E * B + 1]``, bag ``(e, b)`` is
  ``values[offsets[e * B + b] : offsets[e * B + b + 1]]``; ``offsets[0] == 0`` and
  ``offsets[-1] == len(values)``. Optional ``per_sample_weights`` fp32 ``[N]``.
* pooled output ``[B, total_dim]`` row-major; entry e fills columns
  ``out_cols[e] : out_cols[e] + dims[entry_table[e]]``.

Everything accumulates in fp32. Run on CPU tensors with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["embedding_bag_fwd"]

_MAX_BLOCK_D = 128
_BLOCK_L = 16
# Forward tuning, swept on an H100 (26 tables, D=128, B=16384, fp32): several bags per program
# on 2 warps beat one bag per program at every L tried (L=1: 0.33 vs 1.15 ms; L=20: 1.8 vs
# 2.2 ms; L=80: 5.8 vs 6.5 ms): 4 bags of 128 for short bags, 2 for longer ones. Very long
# bags keep one program each, which reads BLOCK_L of its rows at a time.
_SHORT_BAG = 8  # mean ids per bag up to which the forward uses the short-bag tile
_LONG_BAG = 128  # mean ids per bag above which each bag gets its own program
_FWD_TILE_SHORT = 512  # elements of the multi-bag forward tile [bags, BLOCK_D]
_FWD_TILE = 256
_FWD_BAGS_WARPS = 2
_FWD_MAX_BAGS = 64


def _dim_blocks(max_dim: int) -> tuple[int, int, int]:
    """(BLOCK_D, number of column blocks, num_warps) for rows of up to ``max_dim`` columns."""
    block_d = min(_MAX_BLOCK_D, triton.next_power_of_2(max(int(max_dim), 1)))
    return block_d, triton.cdiv(max(int(max_dim), 1), block_d), max(1, min(4, block_d // 32))


def _max_dim(dims: Tensor, max_dim: int | None) -> int:
    # .item() syncs on GPU; callers that know their dims pass max_dim.
    return int(dims.max().item()) if max_dim is None else int(max_dim)


def _nonempty(t: Tensor) -> Tensor:
    # An empty tensor may have a null data pointer, which a launch may reject; the kernels
    # never read it then, so any one-element tensor of the same dtype will do.
    return t if t.numel() > 0 else t.new_zeros(1)


# --------------------------------------------------------------------------- forward


@triton.jit
def _embedding_bag_fwd_kernel(
    weights_ptr,
    table_offsets_ptr,
    dims_ptr,
    entry_table_ptr,
    out_cols_ptr,
    values_ptr,
    offsets_ptr,
    mean_ptr,
    psw_ptr,
    bounds_ptr,
    error_ptr,
    out_ptr,
    batch_size,
    total_dim,
    blocks_per_entry,
    HAS_PSW: tl.constexpr,
    HAS_BOUNDS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[b, out_cols[e] + d] = scale_e(b) * sum_i psw[i] * W_t[values[i], d], t = entry_table[e].

    Grid ``(E * blocks_per_entry, cdiv(max_dim, BLOCK_D))``: program (p, k) pools columns
    ``k * BLOCK_D ...`` of the bags ``b = (p % blocks_per_entry) * BLOCK_B ...`` of entry
    ``e = p // blocks_per_entry`` (bag ``e * B + b``: ids ``offsets[bag] .. offsets[bag +
    1]``). Step ``l`` adds ids ``l * BLOCK_L ...`` of each of its bags as one ``[BLOCK_B,
    BLOCK_L, BLOCK_D]`` tile, the next step's ids loaded meanwhile, up to the longest bag of
    the block. One configuration serves both shapes of work: short bags take several bags
    and one id per step (BLOCK_B gathers in flight instead of a program per tiny bag), long
    bags one bag and BLOCK_L ids per step. ``W_t[r, d] = weights[table_offsets[t] + r *
    dims[t] + d]`` (d contiguous). ``scale = 1 / len`` for mean entries (0 for an empty
    bag, whose sum is 0), else 1; ``psw = 1`` without per-sample weights. With HAS_BOUNDS
    an id outside ``[0, bounds[t])`` adds nothing (it is never dereferenced) and sets
    ``error[0] = 1``, ``error[1] = max`` bad entry index.
    """
    pid = tl.program_id(0)
    d0 = tl.program_id(1) * BLOCK_D
    entry = pid // blocks_per_entry
    b = (pid - entry * blocks_per_entry) * BLOCK_B + tl.arange(0, BLOCK_B)
    b_mask = b < batch_size
    table = tl.load(entry_table_ptr + entry)
    dim = tl.load(dims_ptr + table)
    base = tl.load(table_offsets_ptr + table).to(tl.int64)
    bag = entry.to(tl.int64) * batch_size + b
    start = tl.load(offsets_ptr + bag, mask=b_mask, other=0).to(tl.int64)
    end = tl.load(offsets_ptr + bag + 1, mask=b_mask, other=0).to(tl.int64)
    # Column blocks past this table's dim do no work (an empty loop, not an early return).
    count = tl.where(b_mask & (d0 < dim), end - start, 0)
    cols = d0 + tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    if HAS_BOUNDS:
        num_rows = tl.load(bounds_ptr + table)
    num_bad = tl.zeros([BLOCK_B, BLOCK_L], dtype=tl.int32)

    step = tl.arange(0, BLOCK_L)
    pos = start[:, None] + step[None, :]
    live = step[None, :] < count[:, None]
    ids = tl.load(values_ptr + pos, mask=live, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_B, BLOCK_L, BLOCK_D], dtype=tl.float32)
    for l0 in range(0, tl.max(count, axis=0), BLOCK_L):
        use = live
        if HAS_BOUNDS:
            bad = use & ((ids < 0) | (ids >= num_rows))
            num_bad += bad.to(tl.int32)
            use = use & (~bad)
        rows = tl.load(
            weights_ptr + base + ids[:, :, None] * dim + cols[None, None, :],
            mask=use[:, :, None] & col_mask[None, None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_PSW:
            rows = rows * tl.load(psw_ptr + pos, mask=use, other=0.0)[:, :, None]
        pos += BLOCK_L
        live = (l0 + BLOCK_L + step)[None, :] < count[:, None]
        ids = tl.load(values_ptr + pos, mask=live, other=0).to(tl.int64)
        acc += rows

    if HAS_BOUNDS:  # noqa: SIM102 (a constexpr branch: compiled out without bounds)
        # One reduction and (rarely) two atomics per program, outside the hot loop.
        if tl.sum(tl.sum(num_bad, axis=1), axis=0) > 0:
            tl.atomic_max(error_ptr, 1)
            tl.atomic_max(error_ptr + 1, entry)

    is_mean = tl.load(mean_ptr + entry) != 0
    scale = tl.where(is_mean, 1.0 / tl.maximum(end - start, 1).to(tl.float32), 1.0)
    pooled = tl.sum(acc, axis=1) * scale[:, None]
    out_col = tl.load(out_cols_ptr + entry).to(tl.int64)
    out_ptrs = out_ptr + b.to(tl.int64)[:, None] * total_dim + out_col + cols[None, :]
    tl.store(
        out_ptrs, pooled.to(out_ptr.dtype.element_ty), mask=b_mask[:, None] & col_mask[None, :]
    )


def _bags_per_program(num_ids: int, num_bags: int, block_d: int) -> int:
    if num_ids > _LONG_BAG * num_bags:
        return 1
    tile = _FWD_TILE_SHORT if num_ids <= _SHORT_BAG * num_bags else _FWD_TILE
    return max(1, min(_FWD_MAX_BAGS, tile // block_d))


def embedding_bag_fwd(
    weights: Tensor,
    table_offsets: Tensor,
    dims: Tensor,
    entry_table: Tensor,
    out_cols: Tensor,
    values: Tensor,
    offsets: Tensor,
    batch_size: int,
    total_dim: int,
    mean: Tensor,
    per_sample_weights: Tensor | None = None,
    bounds: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    max_dim: int | None = None,
    bags_per_program: int | None = None,
    error: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Pooled lookup of E entries over packed tables in one launch; ``[B, total_dim]``.

    Layout: see the module docstring. ``out_dtype`` defaults to the weights dtype;
    ``max_dim`` (largest ``dims[u]``) avoids a device sync when given. Mean pooling with
    per-sample weights divides the weighted sum by the bag length. Bags are pooled several
    per program unless they hold more than ``_LONG_BAG`` ids on average;
    ``bags_per_program`` overrides that choice (1: one bag per program).

    Bounds check: with ``bounds`` (int64 ``[U]``, rows per table) every id is checked
    against ``[0, bounds[t])`` inside the kernel, bad ids contribute zero (and are never
    read), and the result is ``(out, error)``: ``error`` int32 ``[2]`` with ``error[0] == 1``
    if any id was bad and ``error[1]`` the largest entry index holding one. The caller
    checks ``error`` later (one small read, no extra pass over the ids). ``error`` may be
    given (int32 ``[2]``, zeroed once): the kernel only ever raises its fields, so a flag
    kept across calls stays set (sticky) until its owner clears it, and no launch zeroes a
    new one.

    Example::

        out = embedding_bag_fwd(w, toff, dims, entry_table, out_cols, ids, offsets,
                                batch_size=B, total_dim=sum_d, mean=mean)
    """
    num_bags = offsets.numel() - 1
    device = weights.device
    if error is None:
        error = torch.zeros(2, dtype=torch.int32, device=device)
    if num_bags <= 0 or total_dim <= 0 or weights.numel() == 0:
        out = torch.zeros((batch_size, total_dim), dtype=out_dtype or weights.dtype, device=device)
        return out if bounds is None else (out, error)
    # Every element is written: the entries' columns tile the output, every bag is pooled.
    out = torch.empty((batch_size, total_dim), dtype=out_dtype or weights.dtype, device=device)
    block_d, col_blocks, num_warps = _dim_blocks(_max_dim(dims, max_dim))
    if bags_per_program is None:
        bags_per_program = _bags_per_program(values.numel(), num_bags, block_d)
    if bags_per_program > 1:  # several bags, one id of each per step
        block_b, block_l, num_warps = triton.next_power_of_2(bags_per_program), 1, _FWD_BAGS_WARPS
    else:  # one bag, _BLOCK_L of its ids per step
        block_b, block_l = 1, _BLOCK_L
    per_entry = triton.cdiv(batch_size, block_b)
    psw = values if per_sample_weights is None else per_sample_weights.float()
    _embedding_bag_fwd_kernel[(entry_table.numel() * per_entry, col_blocks)](
        weights, table_offsets.to(torch.int64), dims.to(torch.int32),
        entry_table.to(torch.int32), out_cols, _nonempty(values),
        offsets.to(torch.int64), mean.to(torch.int8), _nonempty(psw),
        error if bounds is None else bounds.to(torch.int64), error, out, batch_size, total_dim,
        per_entry, HAS_PSW=per_sample_weights is not None, HAS_BOUNDS=bounds is not None,
        BLOCK_B=block_b, BLOCK_L=block_l, BLOCK_D=block_d, num_warps=num_warps,
    )  # fmt: skip
    return out if bounds is None else (out, error)


# --------------------------------------------------------------------------- backward
