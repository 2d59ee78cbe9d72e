"""Launch and host-sync budget of a fully sharded 2D step (issue 43 item 9), counted on CPU.

``benchmarks.probes.step.StepCounter`` (as ``tests/test_step_budget.py`` uses it) counts
one steady-state embedding step (input dist -> fetch from the owner slices -> lookup ->
output dist -> backward -> gradients to the owners -> fused update) on a 4-rank gloo world,
S 2 x R 2, Triton backend in Triton's interpreter: every Triton launch and every ATen op
that would launch device work on CUDA, and every op that would make the host wait for a
GPU. The same step with every table exact 2D (``RowWise()``) is the reference.

Budget:

* a fully sharded step waits for the device at most as often as the exact 2D step. Its own
  waits are two, whatever the number of tables, both in ``fetch_touched``: the number of
  distinct touched rows (one ``unique`` over every table's ids) and the request counts
  (one read of the counts after their exchange, which runs on the device: the ids and
  rows all-to-alls need their split sizes on the host, as the input dist's does). The way
  back reuses those counts (no wait), and exact 2D's replica sync, which waits in
  ``grad_sync`` (its sparse all-gather sizes and boolean masks), is not run at all;
* syncs do not grow with the number of tables (exact 2D's do: 2 boolean masks per table
  in its sparse all-gather);
* launches: at most ``FIXED_EXTRA_LAUNCHES`` + ``LAUNCHES_PER_TABLE`` per table above the
  exact 2D step's. Both grow with the tables: exact 2D by 8 a table here (its replica
  sync's masks and gathers), fully sharded by 10 (each table's owners answer each replica
  with a ``sub`` + ``index_select`` of their slice, its compact table is a ``cat`` of its
  owners' parts, its gradients go back in 2 ``cat`` and are summed per row at the owner).

Measured (rank 0, every rank alike; launches / syncs): exact 2D 100 / 14 (4 tables),
132 / 22 (8); fully sharded 133 / 7, 173 / 7; fully sharded by autograd (torch optimizers)
118 / 5, 166 / 5. Before ``fetch_touched`` keyed every table's ids into one ``unique``
and kept its counts on the device, a fully sharded step waited 51 times (4 tables: a
``unique``, masks, ``bincount`` and reads per table) and launched 166 ops.
"""

from __future__ import annotations

import pytest

from tests.multiprocess import run_world

pytest.importorskip("triton")

# Launches and syncs do not depend on the shapes (the same counts at 16 x 16): small ones
# keep Triton's interpreter, which runs every program of every launch, short.
BATCH, DIM = 4, 4
TABLE_COUNTS = (4, 8)
LAUNCHES_PER_TABLE = 3
"""Per table, above exact 2D's own growth per table (measured: 2)."""
FIXED_EXTRA_LAUNCHES = 36
"""The fetch and the way back (keys, unique, searchsorted, where, 4 all-to-alls, the send
buffers' cats) less exact 2D's replica sync (measured: 33 at 4 tables, less 2 a table)."""
FS_SYNC_SITES = 2  # fetch_touched: unique, the counts read


def fully_sharded_step(
    rank: int, num_tables: int, mode: str, device: str = "cpu", backend: str | None = "triton"
):
    """(step, batch) of a 2 x 2 mesh's embedding step: ``mode`` "exact" (every table
    ``RowWise()``), "fs" (``RowWise(fully_sharded=True)``, fused row-wise Adagrad) or
    "fs_autograd" (fully sharded, trained by autograd); tables, batches on ``device``."""
    import torch

    import dtrec
    from dtrec.placements import RowWise

    if backend is not None:
        dtrec.ops.set_backend(backend)
    rows = [200 + 100 * (t % 5) for t in range(num_tables)]
    tables = [
        dtrec.EmbeddingBagConfig(f"t{t}", r, DIM, [f"f{t}"], "sum") for t, r in enumerate(rows)
    ]
    torch.manual_seed(0)
    ebc = dtrec.EmbeddingBagCollection(tables, device="meta")
    plan = {t.name: RowWise(fully_sharded=mode != "exact") for t in tables}
    fused = None if mode == "fs_autograd" else dtrec.optim.RowWiseAdagrad(lr=0.1)
    model = dtrec.distribute_module(ebc, dtrec.init_mesh(device, 2), plan, optimizer=fused)
    gen = torch.Generator().manual_seed(rank)

    def batch() -> dtrec.KeyedJaggedTensor:
        lengths = torch.randint(1, 6, (num_tables * BATCH,), generator=gen)
        per_feature = lengths.view(num_tables, BATCH).sum(1).tolist()
        values = torch.cat(
            [torch.randint(0, r, (n,), generator=gen) for r, n in zip(rows, per_feature)]
        )
        keys = [f"f{t}" for t in range(num_tables)]
        return dtrec.KeyedJaggedTensor(keys, values, lengths).to(device)

    grad = torch.randn(BATCH, num_tables * DIM, generator=gen).to(device)

    def step(kjt: dtrec.KeyedJaggedTensor) -> None:
        model(kjt).values().backward(grad)

    return step, batch


def _count(rank: int, world: int, num_tables: int, mode: str) -> dict:
    from benchmarks.probes.step import count_steady_step

    return count_steady_step(*fully_sharded_step(rank, num_tables, mode), warmup=2)


def fs_sync_sites(sites: dict) -> dict:
    """The sync sites of ``sites`` in ``dtrec/sharded/dist/replica_slices.py``."""
    return {s: n for s, n in sites.items() if "replica_slices.py" in s}


def _count_all(rank: int, world: int) -> dict:
    return {
        (mode, k): _count(rank, world, k, mode)
        for mode in ("exact", "fs", "fs_autograd")
        for k in TABLE_COUNTS
    }


@pytest.fixture(scope="module")
def counts() -> list[dict]:
    env = {"TRITON_INTERPRET": "1", "DTREC_BACKEND": "triton"}
    return run_world(4, _count_all, timeout=600, env=env)


@pytest.mark.parametrize("num_tables", TABLE_COUNTS)
def test_fully_sharded_step_waits_no_more_than_exact_2d(counts, num_tables: int) -> None:
    for rank, c in enumerate(counts):
        exact, fs = c["exact", num_tables], c["fs", num_tables]
        assert fs["syncs"] <= exact["syncs"], (rank, fs["sync_sites"], exact["sync_sites"])
        own = fs_sync_sites(fs["sync_sites"])
        assert sum(own.values()) == FS_SYNC_SITES, (rank, own)
        assert all("fetch_touched" in s for s in own), (rank, own)


@pytest.mark.parametrize("mode", ["fs", "fs_autograd"])
def test_fully_sharded_syncs_do_not_grow_with_tables(counts, mode: str) -> None:
    for rank, c in enumerate(counts):
        few, many = (c[mode, k] for k in TABLE_COUNTS)
        assert few["sync_sites"] == many["sync_sites"], (rank, few["sync_sites"],
                                                         many["sync_sites"])  # fmt: skip
        assert sum(fs_sync_sites(many["sync_sites"]).values()) == FS_SYNC_SITES, rank


def test_fully_sharded_launches_within_budget(counts) -> None:
    for rank, c in enumerate(counts):
        for k in TABLE_COUNTS:
            exact, fs = c["exact", k], c["fs", k]
            budget = exact["launches"] + FIXED_EXTRA_LAUNCHES + LAUNCHES_PER_TABLE * k
            assert fs["launches"] <= budget, (rank, k, fs["launch_kinds"], exact["launch_kinds"])
        few, many = (c["fs", k] for k in TABLE_COUNTS)
        exact_few, exact_many = (c["exact", k]["launches"] for k in TABLE_COUNTS)
        exact_growth = exact_many - exact_few
        growth = many["launches"] - few["launches"] - exact_growth
        assert growth <= LAUNCHES_PER_TABLE * (TABLE_COUNTS[1] - TABLE_COUNTS[0]), (rank, growth)


def test_torch_optimizer_path_waits_no_more_than_fused(counts) -> None:
    """Fully sharded tables trained by autograd (``FetchTouched``): the same two waits."""
    for rank, c in enumerate(counts):
        for k in TABLE_COUNTS:
            autograd = c["fs_autograd", k]
            assert autograd["syncs"] <= c["fs", k]["syncs"], (rank, autograd["sync_sites"])
            assert sum(fs_sync_sites(autograd["sync_sites"]).values()) == FS_SYNC_SITES, rank
