"""The hash index equals the sorted-ids search (``remap_ids``) on every kind of map, by
its C pass and by its torch ops (the GPU path), and the remapper uses it for a map
indexed at its last change (an eviction, a load)."""

from __future__ import annotations

import pytest
import torch

from dtrec.modules.eviction import INT64_MAX, LFU
from dtrec.modules.managed_collision import MCHManagedCollisionModule, remap_ids
from dtrec.modules.remap_index import HashRemapIndex


def _map(zch: int, kept: torch.Tensor, gen: torch.Generator):
    """(sorted ids, row of each position) for ``kept`` ids in a table of ``zch`` rows."""
    ids = torch.full((zch,), INT64_MAX)
    ids[: kept.numel()] = kept
    rows = torch.randperm(zch, generator=gen)
    order = torch.argsort(ids, stable=True)
    return ids[order], rows[order]


@pytest.mark.parametrize(
    "zch, kind",
    [(1, "empty"), (2, "full"), (7, "half"), (1000, "full"), (1000, "sequential"),
     (4096, "clustered"), (100_000, "full"), (50, "empty")],
)  # fmt: skip
@pytest.mark.parametrize("path", ["c", "torch"])
def test_index_equals_search(zch, kind, path, monkeypatch):
    from dtrec.kernels import cpu as cpu_kernels

    if path == "torch":  # the ops a GPU runs
        monkeypatch.setenv(cpu_kernels.ENV, "0")
    elif not cpu_kernels.available():
        pytest.skip("dtrec's C kernels did not build here")
    gen = torch.Generator().manual_seed(zch)
    room = zch - 1
    if kind == "empty":
        kept = torch.empty(0, dtype=torch.int64)
    elif kind == "sequential":  # consecutive ids: the hash must spread them
        kept = torch.arange(10**12, 10**12 + room)
    elif kind == "clustered":  # ids equal in their low bits
        kept = torch.arange(room) << 40
    else:
        n = room if kind == "full" else room // 2
        kept = torch.unique(torch.randint(0, 2**63 - 1, (2 * n + 8,), generator=gen))[:n]
    sorted_ids, rows = _map(zch, kept, gen)
    misses = torch.randint(0, 2**63 - 1, (500,), generator=gen)
    queries = torch.cat([kept, misses, torch.tensor([0, 1, 2**63 - 2])])
    queries = queries[torch.randperm(queries.numel(), generator=gen)]
    index = HashRemapIndex(sorted_ids, rows, zch - 1)
    assert torch.equal(index.lookup(queries), remap_ids(queries, sorted_ids, rows, zch - 1))
    assert index.probes <= 16, index.probes


def test_remapper_indexes_its_map_at_evictions_and_loads():
    mc = MCHManagedCollisionModule(100, eviction_policy=LFU(), eviction_interval=3)
    ids = torch.randint(0, 2**62, (200,), generator=torch.Generator().manual_seed(0))
    for _ in range(3):  # the third step evicts: the map changes, and is indexed
        mc(ids[:80])
    want = remap_ids(ids, mc._mch_sorted_raw_ids, mc._mch_remapped_ids_mapping, 99)
    assert mc._index is not None and mc._index_key == mc._map_state()
    assert torch.equal(mc.eval()(ids), want)
    mc._mch_sorted_raw_ids[0] = 5  # a write from outside: searched until indexed again
    assert mc._index_key != mc._map_state()
    assert torch.equal(
        mc(ids), remap_ids(ids, mc._mch_sorted_raw_ids, mc._mch_remapped_ids_mapping, 99)
    )
    mc.load_state_dict(mc.state_dict())
    assert mc._index_key == mc._map_state()
    every_step = MCHManagedCollisionModule(100, eviction_policy=LFU(), eviction_interval=1)
    every_step(ids)
    assert every_step._index is None or every_step._index_key != every_step._map_state()
