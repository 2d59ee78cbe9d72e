"""CPU tables ask Linux for transparent huge pages (``dtrec.ops.huge_pages``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dtrec.ops import huge_pages
from dtrec.ops.lookup import packed_views

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_bytes(address: int) -> int:
    """AnonHugePages of the memory mapping that holds ``address`` (this process)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here"
)
def test_packed_tables_on_cpu_get_huge_pages(monkeypatch) -> None:
    (table,) = packed_views([(1 << 18, 64)], torch.float32, torch.device("cpu"), zero=True)
    middle = table.data_ptr() + table.numel() * 2  # inside the advised, aligned part
    assert _huge_bytes(middle) >= 16 * huge_pages.HUGE_PAGE
    assert torch.count_nonzero(table) == 0  # zeroed after the advice

    if "[madvise]" not in THP.read_text():  # "always": huge pages without the advice too
        return
    monkeypatch.setenv(huge_pages.ENV, "0")
    (plain,) = packed_views([(1 << 18, 64)], torch.float32, torch.device("cpu"), zero=True)
    assert _huge_bytes(plain.data_ptr() + plain.numel() * 2) == 0


def test_small_buffers_are_left_alone() -> None:
    assert not huge_pages.advise_huge_pages(torch.empty(1000))
