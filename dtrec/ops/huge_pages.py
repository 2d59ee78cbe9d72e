"""Transparent huge pages for CPU tables: fewer TLB misses on random row reads and writes.

A lookup or row update touches rows scattered over tables far larger than the caches;
with 4 KiB pages nearly every row is also a TLB miss and a page walk. Asking Linux for
2 MiB pages (``madvise(MADV_HUGEPAGE)``) on the tables' buffer before its pages are first
written measured, on one thread of the CI machine's kind (Intel Xeon, AVX-512, 1e6 x 64
fp32 table): row-wise Adagrad on 12.5k random rows 0.75 -> 0.55 ms, ``F.embedding_bag``
of 40k random ids 0.82 -> 0.48 ms. Linux's default THP mode, ``madvise``, grants the
advice; ``never`` ignores it; other systems have no such call: nothing happens there.
``DTREC_HUGE_PAGES=0`` turns the advice off.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

from torch import Tensor

ENV = "DTREC_HUGE_PAGES"
HUGE_PAGE = 2 << 20
MIN_BYTES = 4 * HUGE_PAGE
"""Smaller buffers are left alone: at most a page or two would be huge."""
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(buffer: Tensor) -> bool:
    """Ask for huge pages on the whole 2 MiB pages inside a CPU ``buffer``'s memory; call
    it before the buffer is first written. True if the kernel took the advice."""
    nbytes = buffer.numel() * buffer.element_size()
    if buffer.device.type != "cpu" or nbytes < MIN_BYTES or os.environ.get(ENV, "1") == "0":
        return False
    madvise = _madvise()
    if madvise is None:
        return False
    start = -(-buffer.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (buffer.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
    return end > start and madvise(start, end - start, _MADV_HUGEPAGE) == 0


__all__ = ["ENV", "advise_huge_pages"]
