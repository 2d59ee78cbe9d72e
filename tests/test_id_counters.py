"""``dtrec.IdCounters``: exact counts on a known batch stream, the distribution the planner
reads from them, and a re-plan from them (single process; the sum over ranks and the
re-plan + reshard of a distributed model run in ``tests/distributed/test_reshard.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import dtrec
from dtrec.planning.id_counters import CountedIds

ROWS = {"t0": 10, "t1": 1000, "t2": 7}


class Model(nn.Module):
    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        self.sparse = dtrec.EmbeddingBagCollection(
            [
                dtrec.EmbeddingBagConfig("t0", ROWS["t0"], 4, ["a"]),
                dtrec.EmbeddingBagConfig("t1", ROWS["t1"], 4, ["b"]),
                dtrec.EmbeddingBagConfig("t2", ROWS["t2"], 4, ["c", "d"]),
            ],
            device=device,
        )

    def forward(self, kjt):
        return self.sparse(kjt).values()


def _kjt(per_key: dict[str, list[list[int]]]) -> dtrec.KeyedJaggedTensor:
    keys = list(per_key)
    values = [i for bags in per_key.values() for bag in bags for i in bag]
    lengths = [len(bag) for bags in per_key.values() for bag in bags]
    return dtrec.KeyedJaggedTensor(keys, torch.tensor(values), torch.tensor(lengths))


STREAM = [  # two batches of 2 samples
    {"a": [[1, 1, 2], [1]], "b": [[500], [999]], "c": [[0], []], "d": [[3, 3], [6]]},
    {"a": [[1], [4]], "b": [[500], [0]], "c": [[6], [6]], "d": [[], [2]]},
]


def test_counts_on_a_known_stream():
    model = Model()
    counters = dtrec.IdCounters(model, rows_counted=100, hot_rows=2, distinct_every=1)
    for batch in STREAM:
        model(_kjt(batch))
    model.eval()
    model(_kjt(STREAM[0]))  # not counted: eval mode
    model.train()
    counters.enabled = False
    model(_kjt(STREAM[0]))  # not counted: switched off
    counters.enabled = True
    stats = counters.stats()

    t0 = stats["sparse.t0"]  # ids 1,1,2,1 | 1,4: 6 ids, distinct 2 + 2, 4 bags
    assert t0.ids_per_step == 3.0
    assert t0.unique_ratio == pytest.approx(4 / 6)
    assert t0.pooling_factor == pytest.approx(6 / 4)
    assert t0.hot_rows == (((1, 2), 4 / 6), ((2, 3), 1 / 6))
    t1 = stats["sparse.t1"]  # 1000 rows over 100 slots of 10 rows: ranges
    assert t1.ids_per_step == 2.0 and t1.unique_ratio == 1.0  # distinct within a batch
    assert t1.hot_rows[0] == ((500, 510), 0.5)
    t2 = stats["sparse.t2"]  # features c and d: 0,3,3,6 | 6,6,2 -> 7 ids over 8 bags
    assert t2.ids_per_step == 3.5 and t2.pooling_factor == pytest.approx(7 / 8)
    assert t2.unique_ratio == pytest.approx((3 + 2) / 7)
    assert t2.distribution.mass(6, 7) == pytest.approx(3 / 7)

    topology = counters.topology(dtrec.Topology.cpu(pooling_factors={"zz": 9.0}))
    assert topology.pooling_factors == {
        "zz": 9.0, "a": 1.5, "b": 1.0, "c": 0.75, "d": 1.0,
    }  # fmt: skip
    assert topology.batch_size_per_rank == 2
    assert set(topology.id_distributions) == {"sparse.t0", "sparse.t1", "sparse.t2"}
    assert set(topology.for_collection("sparse").id_distributions) == {"t0", "t1", "t2"}
    assert not topology.for_collection("other").id_distributions

    counters.remove()
    model(_kjt(STREAM[0]))  # hooks off
    assert counters.stats()["sparse.t0"].ids_per_step == 3.0
    counters.reset()
    assert counters.stats()["sparse.t0"].ids_per_step == 0.0
    sampled = dtrec.IdCounters(model, distinct_every=2)  # batch 1 of each 2: its ratio
    for batch in STREAM:
        model(_kjt(batch))
    assert sampled.stats()["sparse.t0"].unique_ratio == pytest.approx(2 / 4)


def test_counted_distribution():
    """Each slot's ids spread evenly over its rows: mass prorated inside a slot, expected
    distinct rows as for independent draws with those row probabilities."""
    ids = CountedIds(10, np.array([6.0, 0.0, 2.0, 2.0, 0.0]))  # slots of 2 rows
    assert ids.mass(0, 10) == pytest.approx(1.0)
    assert ids.mass(0, 1) == pytest.approx(0.3)
    assert ids.mass(2, 4) == 0.0
    assert ids.mass(5, 8) == pytest.approx(0.1 + 0.2)
    p = np.array([0.3, 0.3, 0.1, 0.1, 0.1, 0.1])
    n = 5
    assert ids.unique(n, 0, 10) == pytest.approx(float(np.sum(1 - (1 - p) ** n)))
    assert ids.unique(n, 2, 4) == 0.0
    uniform = CountedIds(10, np.zeros(5))  # nothing counted: uniform
    assert uniform.mass(0, 5) == pytest.approx(0.5)


def test_replan_from_counters():
    """Tables whose traffic the static pooling factor (1 id per bag) underestimates: the plan
    from what was counted differs from the static one and from a poor plan, and the
    tables with heavy traffic are split over the shard axis."""
    from tests.fake_world import fake_world

    rows = [200_000, 100_000, 50_000, 20_000, 10_000, 5000, 2000, 1000]
    pooling = [1, 1, 1, 1, 1, 1, 20, 40]
    model = nn.Module()
    model.sparse = dtrec.EmbeddingBagCollection(
        [dtrec.EmbeddingBagConfig(f"t{i}", r, 64, [f"f{i}"]) for i, r in enumerate(rows)],
        device="meta",
    )
    counters = dtrec.IdCounters(model)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        batch = 64
        ids = [torch.randint(0, r, (batch * p,), generator=gen) for r, p in zip(rows, pooling)]
        kjt = dtrec.KeyedJaggedTensor(
            [f"f{i}" for i in range(len(rows))],
            torch.cat(ids),
            torch.cat([torch.full((batch,), p) for p in pooling]),
        )
        for hook in model.sparse._forward_hooks.values():  # a meta model: hooks only
            hook(model.sparse, (kjt,), None)
    with fake_world(0, 4):
        mesh = dtrec.init_mesh("cpu", 4)
        static = dtrec.plan(model, mesh)
        counted = dtrec.plan(model, mesh, id_counters=counters)
    poor = {key: dtrec.placements.TableWise(rank=0) for key in static}
    assert dict(counted) != poor
    assert dict(counted) != dict(static)
    for heavy in ("sparse.t6", "sparse.t7"):
        assert isinstance(static[heavy], dtrec.placements.TableWise)
        assert not isinstance(counted[heavy], dtrec.placements.TableWise), counted


def test_bad_arguments():
    with pytest.raises(ValueError, match="rows_counted"):
        dtrec.IdCounters(Model(), rows_counted=0)
    with pytest.raises(ValueError, match="distinct_every"):
        dtrec.IdCounters(Model(), distinct_every=0)
    with pytest.raises(TypeError, match="id_distributions"):
        dtrec.Topology.cpu(id_distributions={"t": 3})
