"""A sequence collection's output as one ``KeyedJaggedTensor`` of rows (``from_jt_dict``) and
back (``to_dict``): equal to the dict path on unsharded and sharded outputs, gradients
through it, empty bags, mixed dims refused, and TorchRec's own ``from_jt_dict`` agrees."""

from __future__ import annotations

import pytest
import torch

import dtrec
from tests.multiprocess import run_world

TABLES = [("t0", 20, 4, ["f0", "f1"]), ("t1", 7, 4, ["f2"])]
MIXED = [("t0", 20, 4, ["f0"]), ("t1", 7, 8, ["f1"])]


def _collection(tables=TABLES, need_indices: bool = True) -> dtrec.EmbeddingCollection:
    torch.manual_seed(0)
    return dtrec.EmbeddingCollection(
        [dtrec.EmbeddingConfig(*t) for t in tables], need_indices=need_indices
    )


def _batch(seed: int, tables=TABLES, batch: int = 3) -> dtrec.KeyedJaggedTensor:
    """Random bags, some empty; the second feature of the first batch has no ids at all."""
    gen = torch.Generator().manual_seed(seed)
    keys, values, lengths = [], [], []
    for _, rows, _, feats in tables:
        for f in feats:
            ls = torch.randint(0, 4, (batch,), generator=gen)
            if seed == 0 and len(keys) == 1:
                ls.zero_()
            keys.append(f)
            lengths.append(ls)
            values.append(torch.randint(0, rows, (int(ls.sum()),), generator=gen))
    return dtrec.KeyedJaggedTensor(keys, torch.cat(values), torch.cat(lengths))


def _check_same(kjt: dtrec.KeyedJaggedTensor, out: dict) -> None:
    """The KJT of rows holds exactly the dict's features, in order, and gives them back."""
    assert kjt.keys() == list(out)
    assert kjt.stride() == next(iter(out.values())).lengths().numel()
    torch.testing.assert_close(kjt.values(), torch.cat([jt.values() for jt in out.values()]))
    torch.testing.assert_close(kjt.lengths(), torch.cat([jt.lengths() for jt in out.values()]))
    back = kjt.to_dict()
    assert list(back) == list(out)
    for f, jt in out.items():
        assert torch.equal(back[f].values(), jt.values())
        assert torch.equal(back[f].lengths(), jt.lengths())
        assert torch.equal(kjt[f].weights(), jt.weights())  # the ids (need_indices)


def test_kjt_of_rows_equals_the_dict_and_round_trips() -> None:
    ec = _collection()
    kjt = _batch(0)
    out = ec(kjt)
    rows = dtrec.KeyedJaggedTensor.from_jt_dict(out)
    assert rows.values().shape == (kjt.values().numel(), 4)
    assert rows.length_per_key() == kjt.length_per_key()
    assert rows["f1"].values().shape == (0, 4)  # a feature without ids
    torch.testing.assert_close(rows.weights(), kjt.values())
    _check_same(rows, out)
    assert rows.permute(["f2", "f0"]).to_dict()["f2"].values().equal(out["f2"].values())


def test_gradients_through_the_kjt_of_rows_equal_the_dict_path() -> None:
    grads = []
    for via_kjt in (False, True):
        ec = _collection(need_indices=False)
        out = ec(_batch(1))
        values = (
            dtrec.KeyedJaggedTensor.from_jt_dict(out).values()
            if via_kjt
            else torch.cat([jt.values() for jt in out.values()])
        )
        (values * torch.arange(values.numel()).view(values.shape)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in ec.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=0)


def test_features_of_different_dims_are_refused() -> None:
    out = _collection(MIXED)(_batch(2, MIXED))
    with pytest.raises(ValueError, match=r"'f0': 'rows of dim 4', 'f1': 'rows of dim 8'"):
        dtrec.KeyedJaggedTensor.from_jt_dict(out)
    ids = dtrec.JaggedTensor(torch.tensor([1]), torch.tensor([1, 0, 0]))
    with pytest.raises(ValueError, match=r"'f0': 'rows of dim 4', 'x': 'ids'"):
        dtrec.KeyedJaggedTensor.from_dict({"f0": out["f0"], "x": ids})


def test_a_kjt_of_rows_is_not_a_batch() -> None:
    ec = _collection()
    rows = dtrec.KeyedJaggedTensor.from_jt_dict(ec(_batch(3)))
    with pytest.raises(TypeError, match=r"batch values are embedding rows \(\d+, 4\)"):
        ec(rows)
    ebc = dtrec.EmbeddingBagCollection([dtrec.EmbeddingBagConfig("t0", 20, 4, ["f0"])])
    with pytest.raises(TypeError, match="not ids"):
        ebc(rows)


def test_rows_must_match_the_lengths() -> None:
    with pytest.raises(ValueError, match=r"sum\(lengths\)=3 != values.rows=2"):
        dtrec.KeyedJaggedTensor(["f0"], torch.zeros(2, 4), torch.tensor([1, 2]))


def test_torchrec_from_jt_dict_agrees() -> None:
    jagged = pytest.importorskip("torchrec.sparse.jagged_tensor", reason="torchrec not installed")
    out = _collection()(_batch(4))
    theirs = jagged.KeyedJaggedTensor.from_jt_dict(
        {
            f: jagged.JaggedTensor(values=jt.values(), lengths=jt.lengths(), weights=jt.weights())
            for f, jt in out.items()
        }
    )
    ours = dtrec.KeyedJaggedTensor.from_jt_dict(out)
    assert theirs.keys() == ours.keys() and theirs.stride() == ours.stride()
    for name in ("values", "lengths", "weights", "offsets"):
        assert torch.equal(getattr(theirs, name)(), getattr(ours, name)()), name
    for f, jt in theirs.to_dict().items():
        assert torch.equal(jt.values(), ours[f].values())


def _sharded(rank: int, world: int) -> dict[str, bool]:
    """Per plan: the sharded output's KJT of rows equals the unsharded one's on the same
    local batch (same weights)."""
    from dtrec.sharded.sequence import ShardedEmbeddingCollection

    mesh = dtrec.init_mesh("cpu", world)
    ec = _collection()
    weights = {name: m.weight.detach() for name, m in ec.embeddings.items()}
    configs = [dtrec.EmbeddingConfig(*t) for t in TABLES]
    placements = dtrec.placements
    plans = {
        "row_wise": {"t0": placements.RowWise(), "t1": placements.RowWise()},
        "table_wise": {"t0": placements.TableWise(rank=0), "t1": placements.TableWise(rank=1)},
        "column_wise": {"t0": placements.ColumnWise(), "t1": placements.DataParallel()},
    }
    result = {}
    for name, plan in plans.items():
        sharded = ShardedEmbeddingCollection(configs, weights, mesh, plan, need_indices=True)
        kjt = _batch(10 + rank)
        got = dtrec.KeyedJaggedTensor.from_jt_dict(sharded(kjt))
        _check_same(got, ec(kjt))
        want = dtrec.KeyedJaggedTensor.from_jt_dict(ec(kjt))
        result[name] = torch.equal(got.values(), want.values()) and torch.equal(
            got.lengths(), want.lengths()
        )
    return result


def test_sharded_output_as_kjt_of_rows_equals_unsharded() -> None:
    for rank_result in run_world(2, _sharded):
        assert rank_result == {"row_wise": True, "table_wise": True, "column_wise": True}
