"""Memory: a model whose tables are on the meta device never holds a full table on any rank.

Each of 4 ranks builds a model of ~400 MiB of tables on the meta device, row-wise over
S=4, with fused row-wise Adagrad, and trains a step. Its peak resident memory may grow by
at most 1.2x its shard bytes + optimizer state (+ 16 MiB for the allocator and one init
chunk), not by the full model (which the non-meta path would copy first).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multiprocess import run_world

ROWS, DIM, TABLES = 400_000, 64, 4  # 4 x 97.7 MiB


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _fixed_mmap_threshold() -> None:
    """glibc's mmap threshold fixed at 1 MiB, as ``MALLOC_MMAP_THRESHOLD_`` would set it
    at process start (``mallopt`` also turns the dynamic threshold off): a rank forked
    from the fork server sets it here instead of being spawned with the variable."""
    import ctypes

    m_mmap_threshold = -3  # glibc's malloc.h
    if not ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 1 << 20):
        raise OSError("mallopt(M_MMAP_THRESHOLD) refused")


def _run(rank: int, world: int) -> dict:
    import torch

    import dtrec
    from dtrec.placements import RowWise

    _fixed_mmap_threshold()
    torch.manual_seed(0)  # meta tables are initialised from it: the same on every rank
    mesh = dtrec.init_mesh("cpu", world)

    def build_and_step(rows: int):
        tables = [dtrec.EmbeddingBagConfig(f"t{i}", rows, DIM, [f"f{i}"]) for i in range(TABLES)]
        model = dtrec.distribute_module(
            dtrec.EmbeddingBagCollection(tables, device="meta"), mesh,
            {f"t{i}": RowWise() for i in range(TABLES)},
            optimizer=dtrec.optim.RowWiseAdagrad(lr=0.1),
        )  # fmt: skip
        gen = torch.Generator().manual_seed(rank)
        lengths = torch.randint(0, 4, (TABLES * 8,), generator=gen)
        kjt = dtrec.KeyedJaggedTensor(
            [f"f{i}" for i in range(TABLES)],
            torch.randint(0, rows, (int(lengths.sum()),), generator=gen),
            lengths,
        )
        model(kjt).values().sum().backward()
        return model

    build_and_step(100)  # warm up: torch's one-time allocations are not the model's
    Path("/proc/self/clear_refs").write_text("5")  # restart the peak (VmHWM) from now
    before = _kib("VmRSS")
    model = build_and_step(ROWS)
    local = sum(t.weight.to_local().numel() * 4 for t in model.embedding_bags.values())
    state = sum(v.numel() * 4 for s in model.fused_optimizer_state().values() for v in s.values())
    return {"grew_kib": _kib("VmHWM") - before, "expected_kib": (local + state) // 1024}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as exc:
        pytest.skip(f"cannot reset the peak RSS here: {exc}")
    # A fixed 1 MiB mmap threshold: glibc's dynamic one otherwise keeps freed shard-sized
    # temporaries of the build in the heap, and the resident peak varies by ~30 MiB from
    # run to run (measured 104-141 MiB); with it, RSS is the live memory, and a full-table
    # temporary (98 MiB) would still show in the peak.
    return run_world(4, _run, timeout=300)


def test_peak_memory_is_the_shards_not_the_model(results) -> None:
    full_kib = ROWS * DIM * 4 * TABLES // 1024
    for rank, r in enumerate(results):
        assert r["expected_kib"] < full_kib / 3  # a quarter of the model per rank
        limit = 1.2 * r["expected_kib"] + 16 * 1024
        assert r["grew_kib"] <= limit, (rank, r, limit, full_kib)
