"""dtrec's own CPU kernels (``rows.c``): the row-sparse backward and row-wise updates, and
managed collision's remap lookup (``remap_lookup``).

On CPU, torch runs the exact row-sparse backward as several ATen passes (a stable sort
of the ids, ``unique_consecutive``, a segment sum through ``F.embedding_bag``) and the
row-wise Adagrad step as five more (``vector_norm``, ``index_select``, ``mul``,
``index_copy_``, ``index_add_``). Each pass reads and writes the whole row block again;
on the 4-rank CPU benchmark they were the largest share of the step (issue 30). ``rows.c``
does the same math in three loops: a radix sort of the keys, one summing pass, one
in-place update pass; about 3x less CPU for the same bytes.

The C file is compiled with the machine's C compiler on first use (``$CC``, else
``cc`` / ``gcc``; about a second) into a cache keyed by its source, flags and
processor (``$DTREC_CACHE_DIR``, default ``~/.cache/dtrec``), the way Triton and
inductor build their host code, and loaded with ctypes. Without a compiler, or with
``DTREC_CPU_KERNELS=0``, every caller keeps its pure-torch path: ``available()`` says
which runs. Each wrapper takes plain CPU tensors and returns what the torch path it
replaces returns; ``tests/ops/test_cpu_kernels.py`` compares them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

ENV = "DTREC_CPU_KERNELS"
"""``0`` turns the C kernels off (the pure-torch paths run)."""

_SOURCE = Path(__file__).with_name("rows.c")
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11")
_MAX_KEYS = 2**32  # the radix sort packs a key and its position in 32 bits each


def available() -> bool:
    """Whether the C kernels run: built, loaded, and not turned off (``$DTREC_CPU_KERNELS``)."""
    return os.environ.get(ENV, "1") != "0" and _library() is not None


def _processor() -> str:
    """What ``-march=native`` compiles for: the cache must not serve another processor."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _build(cc: str, target: Path) -> None:
    """Compile ``rows.c`` into ``target`` (atomically: ranks may build at once)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        for flags in (_FLAGS, tuple(f for f in _FLAGS if f != "-march=native")):
            done = subprocess.run(
                [cc, *flags, str(_SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True
            )
            if done.returncode == 0:
                os.replace(tmp, target)
                return
        raise RuntimeError(done.stderr.strip()[-2000:])
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@functools.cache
def _library() -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None:
        warnings.warn(
            "no C compiler ($CC, cc, gcc, clang) for dtrec's CPU kernels; the pure-torch CPU "
            "paths run instead",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    key = hashlib.sha256(
        "\0".join([_SOURCE.read_text(), cc, *_FLAGS, platform.machine(), _processor()]).encode()
    ).hexdigest()[:16]
    cache = Path(os.environ.get("DTREC_CACHE_DIR") or Path.home() / ".cache" / "dtrec")
    target = cache / f"cpu_rows_{key}.so"
    try:
        if not target.exists():
            _build(cc, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError) as err:
        warnings.warn(
            f"dtrec's CPU kernels did not build ({err}); the pure-torch CPU paths run instead",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.dtrec_sort_keys.argtypes = [ptr, i64, i64, ptr]
    lib.dtrec_sort_keys.restype = i64
    lib.dtrec_sort_bag_rows.argtypes = [ptr, ptr, i64, i64, *[ptr] * 4, i64, i64, i64, ptr]
    lib.dtrec_sort_bag_rows.restype = i64
    lib.dtrec_sum_sorted.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, ptr, ptr]
    lib.dtrec_sum_sorted.restype = None
    lib.dtrec_indices_within.argtypes = [ptr, i64, i64]
    lib.dtrec_indices_within.restype = i64
    lib.dtrec_row_sq_sums.argtypes = [ptr, i64, i64, ptr]
    lib.dtrec_row_sq_sums.restype = None
    lib.dtrec_rowwise_adagrad.argtypes = [ptr, i64, ptr, ptr, i64, ptr, i64, ptr, i64, f32, f32]
    lib.dtrec_rowwise_adagrad.restype = None
    lib.dtrec_sgd.argtypes = [ptr, i64, ptr, i64, ptr, i64, f32]
    lib.dtrec_sgd.restype = None
    lib.dtrec_backward_update.argtypes = [ptr, i64, ptr, i64, i64, *[ptr] * 3, i64, *[ptr] * 5,
                                          i64, ptr, f32, i64, f32, f32, *[ptr] * 4]  # fmt: skip
    lib.dtrec_backward_update.restype = i64
    lib.dtrec_remap_lookup.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, ptr]
    lib.dtrec_remap_lookup.restype = None
    return lib


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows_ok(t: Tensor) -> bool:
    """A CPU fp32 matrix whose rows are contiguous (any row stride)."""
    return (
        t.device.type == "cpu"
        and t.dtype == torch.float32
        and t.dim() == 2
        and (t.stride(1) == 1 or t.shape[1] <= 1)
    )


def sum_rows_by_key(
    keys: Tensor,
    rows: Tensor,
    index: Tensor | None = None,
    scale: Tensor | None = None,
    key_bound: int | None = None,
) -> tuple[Tensor, Tensor] | None:
    """``dtrec.ops.backends.torch.sum_rows_by_key`` in C: (sorted distinct keys, per key the
    sum of ``rows[index[i]] * scale[i]`` over its occurrences i, in their order), or None
    where the C kernel does not serve the call (the caller then runs torch's)."""
    n = keys.numel()
    if (
        not available()
        or key_bound is None
        or not 0 < key_bound <= _MAX_KEYS
        or n >= _MAX_KEYS
        or keys.device.type != "cpu"
        or not _rows_ok(rows)
        or (index is not None and (index.dtype != torch.int64 or index.numel() != n))
        or (scale is not None and (scale.dtype != torch.float32 or scale.numel() != n))
    ):
        return None
    lib = _library()
    keys = keys.to(torch.int64).contiguous()
    index = None if index is None else index.contiguous()
    bound = rows.shape[0] if index is not None else n + 1  # no index: row i of n <= rows
    if index is None and n > rows.shape[0]:
        raise IndexError(f"{n} keys but only {rows.shape[0]} rows to sum")
    if index is not None and not lib.dtrec_indices_within(_ptr(index), n, bound):
        raise IndexError(f"a row index outside [0, {bound}) reached the row-sparse backward")
    scale = None if scale is None else scale.contiguous()
    pairs = torch.empty(2 * n, dtype=torch.int64)
    distinct = lib.dtrec_sort_keys(_ptr(keys), n, key_bound, _ptr(pairs))
    if distinct < 0:
        raise IndexError(f"a key outside [0, {key_bound}) reached the row-sparse backward")
    dim = rows.shape[1]
    unique = torch.empty(distinct, dtype=torch.int64)
    sums = torch.empty(distinct, dim, dtype=torch.float32)
    lib.dtrec_sum_sorted(
        _ptr(pairs), n, _ptr(index), _ptr(scale), _ptr(rows), rows.stride(0), dim,
        _ptr(unique), _ptr(sums),
    )  # fmt: skip
    return unique, sums


def sum_bag_rows(
    values: Tensor,
    offsets: Tensor,
    batch: int,
    entries: list[int],
    entry_base: list[int],
    row_start: list[int],
    row_stride: list[int],
    rows: Tensor,
    key_bound: int,
) -> tuple[Tensor, Tensor] | None:
    """``sum_rows_by_key`` of the bags of ``entries`` without per-id keys or index: each id
    ``v`` of bag ``b`` of entry ``entries[j]`` (bag ``e * batch + b`` of ``offsets``) has the
    key ``entry_base[e] + v`` and the gradient row ``row_start[j] + b * row_stride[j]`` of
    ``rows``. (sorted distinct keys, per key the sum of its rows in occurrence order): the
    same sums, bitwise, as ``sum_rows_by_key`` of the repeated keys and rows; None where not
    served (the caller then builds those)."""
    if (
        not available()
        or not 0 < key_bound <= _MAX_KEYS
        or values.device.type != "cpu"
        or not _rows_ok(rows)
        or rows.shape[0] >= _MAX_KEYS
        or offsets.numel() != len(entry_base) * batch + 1
    ):
        return None
    lib = _library()
    values = values.to(torch.int64).contiguous()
    offsets = offsets.to(torch.int64).contiguous()
    ends = offsets[[e * batch for e in entries] + [(e + 1) * batch for e in entries]].tolist()
    n = max(0, sum(ends[len(entries) + j] - ends[j] for j in range(len(entries))))
    if n >= _MAX_KEYS:
        return None
    if batch and any(r + (batch - 1) * s >= rows.shape[0] for r, s in zip(row_start, row_stride)):
        raise IndexError(f"a bag's gradient row outside the {rows.shape[0]} rows given")
    meta = torch.tensor([entries, row_start, row_stride], dtype=torch.int64)
    bases = torch.tensor(entry_base, dtype=torch.int64)
    pairs = torch.empty(2 * n, dtype=torch.int64)
    distinct = lib.dtrec_sort_bag_rows(
        _ptr(values), _ptr(offsets), batch, len(entries), _ptr(meta[0]), _ptr(bases),
        _ptr(meta[1]), _ptr(meta[2]), key_bound, values.numel(), n, _ptr(pairs),
    )  # fmt: skip
    if distinct == -2:
        raise IndexError(f"the bags' offsets do not lie within the {values.numel()} ids")
    if distinct < 0:
        raise IndexError(f"a key outside [0, {key_bound}) reached the row-sparse backward")
    dim = rows.shape[1]
    unique = torch.empty(distinct, dtype=torch.int64)
    sums = torch.empty(distinct, dim, dtype=torch.float32)
    lib.dtrec_sum_sorted(
        _ptr(pairs), n, None, None, _ptr(rows), rows.stride(0), dim, _ptr(unique), _ptr(sums)
    )
    return unique, sums


def remap_lookup(
    slot_ids: Tensor, slot_rows: Tensor, bits: int, probes: int, values: Tensor, miss_row: int
) -> Tensor | None:
    """``HashRemapIndex.lookup`` in C (one pass, probing stops at the id or an empty slot),
    or None where not served (the caller then runs the torch ops)."""
    if not available() or values.device.type != "cpu" or values.dtype != torch.int64:
        return None
    values = values.contiguous()
    out = torch.empty_like(values)
    _library().dtrec_remap_lookup(
        _ptr(slot_ids), _ptr(slot_rows), bits, probes, _ptr(values), values.numel(), miss_row,
        _ptr(out),
    )  # fmt: skip
    return out


def row_sq_sums(grads: Tensor) -> Tensor | None:
    """Each row's ``sum_d g^2`` (summed in order of d), or None where not served."""
    if not available() or not _rows_ok(grads):
        return None
    grads = grads.contiguous()
    out = torch.empty(grads.shape[0], dtype=torch.float32)
    _library().dtrec_row_sq_sums(_ptr(grads), grads.shape[0], grads.shape[1], _ptr(out))
    return out


def _update_ok(weight: Tensor, rows: Tensor, grads: Tensor) -> bool:
    return (
        available()
        and _rows_ok(weight)
        and _rows_ok(grads)
        and rows.dtype == torch.int64
        and rows.device.type == "cpu"
        and rows.dim() == 1
        and grads.shape == (rows.numel(), weight.shape[1])
    )


def _check_rows(rows: Tensor, weight: Tensor) -> None:
    """IndexError for a row outside ``weight`` (as ``index_add_`` raises), before any write."""
    if not _library().dtrec_indices_within(_ptr(rows), rows.numel(), weight.shape[0]):
        raise IndexError(f"a row to update lies outside [0, {weight.shape[0]})")


def rowwise_adagrad_(
    weight: Tensor,
    acc: Tensor,
    rows: Tensor,
    grads: Tensor,
    row_sq_sum: Tensor | None,
    full_dim: int,
    lr: float,
    eps: float,
) -> bool:
    """Exact row-wise Adagrad on the distinct ``rows`` of ``weight`` and ``acc``, in place;
    ``dtrec.kernels.update_math.rowwise_adagrad_step`` added by ``index_add_`` for the same
    ``row_sq_sum``, within an ulp (torch's vectorised ``sqrt`` is not always correctly
    rounded). False (nothing changed) where not served."""
    if (
        not _update_ok(weight, rows, grads)
        or acc.dtype != torch.float32
        or not acc.is_contiguous()
        or acc.numel() != weight.shape[0]
        or (
            row_sq_sum is not None
            and (row_sq_sum.dtype != torch.float32 or row_sq_sum.numel() != rows.numel())
        )
    ):
        return False
    rows, grads = rows.contiguous(), grads.contiguous()
    _check_rows(rows, weight)
    sq = None if row_sq_sum is None else row_sq_sum.contiguous()
    _library().dtrec_rowwise_adagrad(
        _ptr(weight), weight.stride(0), _ptr(acc), _ptr(rows), rows.numel(), _ptr(grads),
        grads.shape[1], _ptr(sq), full_dim, lr, eps,
    )  # fmt: skip
    return True


def sgd_(weight: Tensor, rows: Tensor, grads: Tensor, lr: float) -> bool:
    """``weight[rows] += grads * -lr`` on distinct ``rows``, in place; False where not served."""
    if not _update_ok(weight, rows, grads):
        return False
    rows, grads = rows.contiguous(), grads.contiguous()
    _check_rows(rows, weight)
    _library().dtrec_sgd(
        _ptr(weight), weight.stride(0), _ptr(rows), rows.numel(), _ptr(grads), grads.shape[1], lr
    )
    return True


RULES = {"sgd": 0, "rowwise_adagrad": 1}
"""The step rules ``backward_update`` fuses, and their codes in ``rows.c``."""


def backward_update(
    weights: Sequence[Tensor],
    accumulators: Sequence[Tensor] | None,
    entry_table: Sequence[int],
    values: Tensor,
    offsets: Tensor,
    mean: Sequence[bool],
    per_sample_weights: Tensor | None,
    grad_out: Tensor,
    grad_scale: float,
    rule: str,
    lr: float,
    eps: float = 0.0,
) -> bool:
    """A pooled lookup's backward (the ``dtrec.ops.lookup`` layout) and one ``rule`` step
    (``RULES``) on its tables, in place, in one C pass: no row gradient is stored.

    The same math as ``row_grads`` then the rule's update (bitwise for sum pooling); for
    tables whose whole gradient this lookup holds. ``accumulators``: row-wise Adagrad's
    per-row sums, one per table. False (nothing changed) where not served: not built,
    not CPU fp32 with contiguous tables, an empty table or dim, an id outside its table,
    arguments whose sizes do not match (the torch path then reports them).
    """
    tables = list(weights)
    if (
        not available()
        or rule not in RULES
        or values.device.type != "cpu"
        or grad_out.dtype != torch.float32
        or grad_out.dim() != 2
        or grad_out.stride(1) != 1
        or not all(_rows_ok(w) and w.is_contiguous() and w.numel() for w in tables)
        or (rule == "rowwise_adagrad")
        != (accumulators is not None and all(a.is_contiguous() for a in accumulators))
        or (per_sample_weights is not None and per_sample_weights.dtype != torch.float32)
    ):
        return False
    psw = None if per_sample_weights is None else per_sample_weights.contiguous()
    num_entries, n = len(entry_table), values.numel()
    batch = (offsets.numel() - 1) // max(num_entries, 1)
    cols = [0]
    for t in entry_table:
        cols.append(cols[-1] + tables[t].shape[1])
    if (
        num_entries == 0
        or offsets.numel() != num_entries * batch + 1
        or tuple(grad_out.shape) != (batch, cols[-1])
        or (psw is not None and psw.numel() != n)
        or not all(0 <= t < len(tables) for t in entry_table)
    ):
        return False
    values = values.to(torch.int64).contiguous()
    offsets = offsets.to(torch.int64).contiguous()
    small = torch.tensor(
        [*entry_table, *cols[:-1], *(w.shape[0] for w in tables), *(w.shape[1] for w in tables),
         *(w.data_ptr() for w in tables),
         *(a.data_ptr() for a in (accumulators if accumulators is not None else tables))],
        dtype=torch.int64,
    )  # fmt: skip
    e, k = num_entries, len(tables)
    entry_t, entry_c, rows, dims, wp, ap = small.split([e, e, k, k, k, k])
    flags = torch.tensor([bool(m) for m in mean], dtype=torch.uint8)
    pairs = torch.empty(2 * n, dtype=torch.int64)
    bag_of = torch.empty(n, dtype=torch.int32)
    row_base = torch.empty(k + 1, dtype=torch.int64)
    rowbuf = torch.empty(max(w.shape[1] for w in tables), dtype=torch.float32)
    done = _library().dtrec_backward_update(
        _ptr(values), n, _ptr(offsets), e, batch, _ptr(entry_t), _ptr(entry_c), _ptr(flags), k,
        _ptr(rows), _ptr(dims), _ptr(wp), _ptr(ap) if accumulators is not None else None,
        _ptr(grad_out), grad_out.stride(0), _ptr(psw), grad_scale, RULES[rule], lr, eps,
        _ptr(pairs), _ptr(bag_of), _ptr(row_base), _ptr(rowbuf),
    )  # fmt: skip
    return done == 0


__all__ = [
    "RULES",
    "backward_update",
    "ENV",
    "available",
    "remap_lookup",
    "row_sq_sums",
    "rowwise_adagrad_",
    "sgd_",
    "sum_rows_by_key",
]
