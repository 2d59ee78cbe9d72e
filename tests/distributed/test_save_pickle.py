"""``torch.save`` / ``torch.load`` of a distributed model's state dict, as with any DTensor.

A rank's tables are views of one packed buffer, and so is the fused optimizer's state;
torch's DTensor wrapper took such a view's storage offset, and pickling it failed
("Attempted to access the data pointer on an invalid python storage") and left a
truncated file. Every sharding type (table-row-wise and grid on a 2-node shard axis,
replicas on a 2D mesh), fused and not, pooled and sequence: each rank saves its state
dicts to a file, a differently initialised distributed model loads them and so does the
unsharded model (through ``dtrec.checkpoint.to_full_state_dict``); values must be equal.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiprocess import run_world

WORLD = 4
# (mesh shard group size, node size, plan name, fused optimizer name)
CASES = [
    (4, 2, plan, fused)
    for plan in (
        "data_parallel",
        "table_wise",
        "row_wise",
        "column_wise",
        "table_row_wise",
        "grid",
        "mixed",
    )
    for fused in ("none", "rowwise_adagrad")
] + [(4, 2, "mixed", "adam"), (2, None, "mixed", "rowwise_adagrad"), (2, None, "mixed", "none")]
# offloaded tables (host-memory blocks behind device caches; state_dict flushes the caches)
CASES += [(4, 2, "offloaded", "rowwise_adagrad"), (2, None, "offloaded", "adam")]
SEQUENCE_CASES = [("row_wise", "none"), ("column_wise", "rowwise_adagrad"), ("mixed", "adam")]


def _fused(name: str):
    import dtrec

    return {
        "none": None,
        "rowwise_adagrad": dtrec.optim.RowWiseAdagrad(lr=0.1),
        "adam": dtrec.optim.Adam(lr=0.05),
    }[name]


def _full(state: dict) -> dict:
    from dtrec.checkpoint import to_full_state_dict

    return to_full_state_dict(state)


def _full_fused(fused) -> dict:
    from dtrec.checkpoint import full_tensor

    if fused is None:
        return {}
    return {
        f"{table}.{name}": full_tensor(value)
        for table, entries in fused.state_dict()["state"].items()
        for name, value in entries.items()
        if value.dim()  # Adam's per-table step count: a plain scalar, compared below
    }


def _offloaded() -> dict:
    """Every sharded table in host memory behind a cache (large enough for one batch)."""
    from dtrec.placements import ColumnWise, DataParallel, RowWise, TableWise

    return {
        "t0": RowWise(cache_fraction=1.0),
        "t1": TableWise(rank=1, cache_rows=3),
        "t2": ColumnWise(cache_fraction=0.5),
        "t3": DataParallel(),
    }


def _equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _round_trip(model, fresh, plain, path: str) -> dict:
    """Save ``model``'s state dicts to ``path``, load them into ``fresh`` and ``plain``."""
    torch.save(
        {
            "model": model.state_dict(),
            "fused": model.fused_optimizer.state_dict() if model.fused_optimizer else None,
        },
        path,
    )
    loaded = torch.load(path)  # weights_only, torch's default
    fresh.load_state_dict(loaded["model"])
    if loaded["fused"] is not None:
        fresh.fused_optimizer.load_state_dict(loaded["fused"])
    plain.load_state_dict(_full(loaded["model"]))
    want = _full(model.state_dict())
    scalars = [
        torch.equal(v, fresh.fused_optimizer.state_dict()["state"][t][k])
        for t, entries in (loaded["fused"] or {"state": {}})["state"].items()
        for k, v in entries.items()
        if not v.dim()
    ]
    return {
        "fresh": _equal(want, _full(fresh.state_dict())),
        "plain": _equal(want, {k: v for k, v in plain.state_dict().items()}),
        "fused": _equal(_full_fused(model.fused_optimizer), _full_fused(fresh.fused_optimizer))
        and all(scalars),
        "table_types": sorted(
            {type(v).__name__ for k, v in loaded["model"].items() if ".embedding" in k}
        ),
    }


def _pooled_case(shards: int, node: int | None, plan_name: str, fused: str, path: str) -> dict:
    import dtrec
    from tests.distributed.numerics import PLANS, TinyModel, make_batch, make_tables

    mesh = dtrec.init_mesh("cpu", shards, node_size=node)
    plans = {**PLANS, "offloaded": _offloaded()}
    plan = {f"sparse.{k}": v for k, v in plans[plan_name].items()}
    tables = make_tables(False)

    def build(seed: int):
        torch.manual_seed(seed)
        return dtrec.distribute_module(TinyModel(tables), mesh, plan, optimizer=_fused(fused))

    model = build(0)
    gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    kjt, target = make_batch(tables, 3, False, gen)
    ((model(kjt) - target) ** 2).mean().backward()  # a step: optimizer state is non-zero
    if model.fused_optimizer is None:
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.1 * p.grad
    torch.manual_seed(5)
    return _round_trip(model, build(7), TinyModel(tables), path)


class SequenceModel(torch.nn.Module):
    def __init__(self) -> None:
        import dtrec

        super().__init__()
        self.seq = dtrec.EmbeddingCollection(
            [
                dtrec.EmbeddingConfig("s0", 30, 4, ["g0"]),
                dtrec.EmbeddingConfig("s1", 9, 4, ["g1"]),
                dtrec.EmbeddingConfig("s2", 17, 4, ["g2"]),
            ]
        )

    def forward(self, kjt):
        return torch.cat([jt.values() for jt in self.seq(kjt).values()])


def _sequence_case(plan_name: str, fused: str, path: str) -> dict:
    import dtrec
    from dtrec.placements import ColumnWise, DataParallel, RowWise, TableWise

    mesh = dtrec.init_mesh("cpu", 4)
    plan = {
        "row_wise": {"seq.s0": RowWise(), "seq.s1": RowWise(), "seq.s2": RowWise()},
        "column_wise": {"seq.s0": ColumnWise(), "seq.s1": ColumnWise(), "seq.s2": ColumnWise()},
        "mixed": {"seq.s0": RowWise(), "seq.s1": TableWise(rank=1), "seq.s2": DataParallel()},
    }[plan_name]

    def build(seed: int):
        torch.manual_seed(seed)
        return dtrec.distribute_module(SequenceModel(), mesh, plan, optimizer=_fused(fused))

    model = build(0)
    kjt = dtrec.KeyedJaggedTensor(
        ["g0", "g1", "g2"], torch.tensor([1, 29, 3, 8, 5, 16, 0]), torch.tensor([2, 1, 1, 1, 2, 0])
    )
    model(kjt).pow(2).sum().backward()
    return _round_trip(model, build(7), SequenceModel(), path)


def _run_all(rank: int, world: int, root: str) -> dict:
    out = {}
    for i, (shards, node, plan, fused) in enumerate(CASES):
        out[(shards, node, plan, fused)] = _pooled_case(
            shards, node, plan, fused, f"{root}/pooled-{i}-rank{rank}.pt"
        )
    for i, (plan, fused) in enumerate(SEQUENCE_CASES):
        out[("sequence", plan, fused)] = _sequence_case(
            plan, fused, f"{root}/sequence-{i}-rank{rank}.pt"
        )
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("pickle")
    return run_world(WORLD, _run_all, str(root), timeout=900)


@pytest.mark.parametrize("case", CASES + [("sequence", *c) for c in SEQUENCE_CASES], ids=str)
def test_torch_save_load_round_trips(results: list[dict], case: tuple) -> None:
    for rank, per_rank in enumerate(results):
        got = per_rank[case]
        assert got["table_types"] == ["DTensor"], (rank, got)
        assert got["fresh"], f"rank {rank}: a fresh distributed model loaded other values"
        assert got["plain"], f"rank {rank}: the unsharded model loaded other values"
        assert got["fused"], f"rank {rank}: the fused optimizer state differs after load"
