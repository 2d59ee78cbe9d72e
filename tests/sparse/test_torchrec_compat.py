"""TorchRec-compatible inputs and outputs: KJT constructors, variable batch per feature
(VBE), unused keys, KeyedTensor regrouping. Compared with TorchRec itself where the
``bench`` extra is installed, else with a plain-torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtrec
from dtrec.sparse.variable_batch import expand_variable_batch

try:
    import torchrec
except Exception:  # noqa: BLE001 - any import failure means "no torchrec"
    torchrec = None

needs_torchrec = pytest.mark.skipif(torchrec is None, reason="torchrec (bench extra) not installed")


def _vbe_kjt(weighted: bool = False, gen_seed: int = 0) -> dtrec.KeyedJaggedTensor:
    """Keys f0 (2 bags from 2 ranks: 1 + 1), f1 (3 bags: 2 + 1); full batch B = 4."""
    gen = torch.Generator().manual_seed(gen_seed)
    lengths = torch.tensor([2, 0, 1, 3, 2])  # f0: [2, 0], f1: [1, 3, 2]
    values = torch.randint(0, 6, (8,), generator=gen)
    weights = torch.rand(8, generator=gen) if weighted else None
    inverse = torch.tensor([[1, 0, 0, 1], [2, 2, 0, 1]])
    return dtrec.KeyedJaggedTensor(
        ["f0", "f1"],
        values,
        lengths,
        weights,
        stride_per_key_per_rank=[[1, 1], [2, 1]],
        inverse_indices=(["f0", "f1"], inverse),
    )


def test_vbe_kjt_accessors() -> None:
    kjt = _vbe_kjt()
    assert kjt.variable_stride_per_key()
    assert kjt.stride() == 4 and kjt.stride_per_key() == [2, 3]
    assert kjt.stride_per_key_per_rank() == [[1, 1], [2, 1]]
    assert kjt.length_per_key() == [2, 6]
    assert kjt["f0"].lengths().tolist() == [2, 0] and kjt["f1"].lengths().tolist() == [1, 3, 2]
    swapped = kjt.permute(["f1", "f0"])
    assert swapped["f0"].values().tolist() == kjt["f0"].values().tolist()
    assert swapped.stride_per_key_per_rank() == [[2, 1], [1, 1]]
    first, second = kjt.split([1, 1])
    assert first.lengths().tolist() == [2, 0] and second.lengths().tolist() == [1, 3, 2]
    assert not dtrec.KeyedJaggedTensor(
        ["a"], torch.tensor([1]), torch.tensor([1])
    ).variable_stride_per_key()


def test_expand_variable_batch_copies_each_samples_bag() -> None:
    kjt = _vbe_kjt(weighted=True)
    out = expand_variable_batch(kjt, ["f1", "f0"])
    assert out.keys() == ["f1", "f0"] and out.stride() == 4
    for key in ("f0", "f1"):
        row = ["f0", "f1"].index(key)
        bags = kjt[key]
        offsets = bags.offsets().tolist()
        for b, bag in enumerate(kjt.inverse_indices()[1][row].tolist()):
            lo, hi = offsets[bag], offsets[bag + 1]
            got = out[key]
            g_lo, g_hi = got.offsets()[b], got.offsets()[b + 1]
            assert got.values()[g_lo:g_hi].tolist() == bags.values()[lo:hi].tolist()
            assert (
                got.weights_or_none()[g_lo:g_hi].tolist() == bags.weights_or_none()[lo:hi].tolist()
            )


def _ebc(pooling: str = "sum") -> dtrec.EmbeddingBagCollection:
    torch.manual_seed(1)
    return dtrec.EmbeddingBagCollection(
        [
            dtrec.EmbeddingBagConfig("t0", 6, 3, ["f0"], pooling=pooling),
            dtrec.EmbeddingBagConfig("t1", 6, 5, ["f1"]),
        ]
    )


def _reference(ebc: dtrec.EmbeddingBagCollection, kjt: dtrec.KeyedJaggedTensor) -> torch.Tensor:
    """TorchRec's semantics by hand: pool each key's own bags, gather rows by inverse index."""
    inverse_keys, inverse = kjt.inverse_indices()
    cols = []
    for cfg in ebc.embedding_bag_configs():
        for f in cfg.feature_names:
            jt = kjt[f]
            w = jt.weights_or_none()
            pooled = F.embedding_bag(
                jt.values(), ebc.embedding_bags[cfg.name].weight, jt.offsets()[:-1],
                mode=cfg.pooling, per_sample_weights=w,
            )  # fmt: skip
            cols.append(pooled.index_select(0, inverse[inverse_keys.index(f)]))
    return torch.cat(cols, dim=1)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_vbe_output_and_grads_match_pooled_then_expanded(pooling: str) -> None:
    ebc = _ebc(pooling)
    kjt = _vbe_kjt()
    out = ebc(kjt).values()
    ref = _reference(ebc, kjt)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    up = torch.randn(out.shape)
    grads = torch.autograd.grad((out * up).sum(), list(ebc.parameters()))
    ref_grads = torch.autograd.grad((ref * up).sum(), list(ebc.parameters()))
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


def test_vbe_errors_name_what_is_wrong() -> None:
    ebc = _ebc()
    kjt = _vbe_kjt()
    no_inverse = dtrec.KeyedJaggedTensor(
        kjt.keys(), kjt.values(), kjt.lengths(), stride_per_key_per_rank=[[1, 1], [2, 1]]
    )
    with pytest.raises(ValueError, match="variable batch per feature.*no inverse_indices"):
        ebc(no_inverse)
    bad_index = dtrec.KeyedJaggedTensor(
        kjt.keys(), kjt.values(), kjt.lengths(), stride_per_key_per_rank=[[1, 1], [2, 1]],
        inverse_indices=(["f0", "f1"], torch.tensor([[0, 0, 2, 1], [0, 0, 0, 0]])),
    )  # fmt: skip
    with pytest.raises(
        IndexError, match="feature 'f0', sample 2: inverse index 2 is outside its 2"
    ):
        ebc(bad_index)
    missing_row = dtrec.KeyedJaggedTensor(
        kjt.keys(), kjt.values(), kjt.lengths(), stride_per_key_per_rank=[[1, 1], [2, 1]],
        inverse_indices=(["f0"], torch.tensor([[0, 0, 1, 1]])),
    )  # fmt: skip
    with pytest.raises(KeyError, match="no row for feature\\(s\\) \\['f1'\\]"):
        ebc(missing_row)
    with pytest.raises(
        ValueError, match="lengths.numel\\(\\)=5 != sum of stride_per_key_per_rank=4"
    ):
        dtrec.KeyedJaggedTensor(
            kjt.keys(), kjt.values(), kjt.lengths(), stride_per_key_per_rank=[[1, 1], [1, 1]]
        )
    with pytest.raises(ValueError, match="stride_per_key_per_rank has 1 entries for 2 keys"):
        dtrec.KeyedJaggedTensor(
            kjt.keys(), kjt.values(), kjt.lengths(), stride_per_key_per_rank=[[5]]
        )
    with pytest.raises(ValueError, match="stride=3 but lengths has 4 entries"):
        dtrec.KeyedJaggedTensor(["a", "b"], torch.tensor([1]), torch.tensor([1, 0, 0, 0]), stride=3)


def test_kjt_constructors_like_torchrec() -> None:
    keys, values = ["a", "b"], torch.tensor([1, 2, 3, 4])
    lengths = torch.tensor([1, 0, 2, 1])
    by_lengths = dtrec.KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)
    by_offsets = dtrec.KeyedJaggedTensor.from_offsets_sync(
        keys, values, torch.tensor([0, 1, 1, 3, 4])
    )
    by_dict = dtrec.KeyedJaggedTensor.from_jt_dict(by_lengths.to_dict())
    for kjt in (by_offsets, by_dict, by_lengths.sync()):
        assert kjt.keys() == keys and kjt.lengths().tolist() == lengths.tolist()
        assert kjt.values().tolist() == values.tolist() and kjt.stride() == 2
    assert by_lengths._key_indices() == {"a": 0, "b": 1}
    with pytest.raises(ValueError, match="exactly one of lengths and offsets"):
        dtrec.KeyedJaggedTensor(keys, values)


def test_keyed_tensor_regroup() -> None:
    a = dtrec.KeyedTensor(["x", "y"], [2, 3], torch.arange(10.0).view(2, 5))
    b = dtrec.KeyedTensor.from_tensor_list(["z"], [torch.ones(2, 1)])
    groups = dtrec.KeyedTensor.regroup([a, b], [["z", "x"], ["y"]])
    torch.testing.assert_close(groups[0], torch.cat([b["z"], a["x"]], dim=1))
    torch.testing.assert_close(groups[1], a["y"])
    named = dtrec.KeyedTensor.regroup_as_dict([a, b], [["y", "z"]], ["yz"])
    assert list(named) == ["yz"] and named["yz"].shape == (2, 4)
    assert a.device() == torch.device("cpu") and a.to("cpu").keys() == ["x", "y"]
    assert a._key_indices() == {"x": 0, "y": 1}
    with pytest.raises(KeyError, match="\\['w'\\] are in none"):
        dtrec.KeyedTensor.regroup([a], [["w"]])


# ----------------------------------------------------------------- against TorchRec itself


def _torchrec_ebc(ebc: dtrec.EmbeddingBagCollection, pooling: str):
    pool = {"sum": torchrec.PoolingType.SUM, "mean": torchrec.PoolingType.MEAN}
    configs = [
        torchrec.EmbeddingBagConfig(
            name=cfg.name,
            embedding_dim=cfg.embedding_dim,
            num_embeddings=cfg.num_embeddings,
            feature_names=list(cfg.feature_names),
            pooling=pool[cfg.pooling],
        )  # fmt: skip
        for cfg in ebc.embedding_bag_configs()
    ]
    trec = torchrec.EmbeddingBagCollection(tables=configs)
    trec.load_state_dict(ebc.state_dict())
    return trec


@needs_torchrec
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_vbe_matches_torchrec(pooling: str) -> None:
    ebc = _ebc(pooling)
    trec = _torchrec_ebc(ebc, pooling)
    mine = _vbe_kjt(gen_seed=3)
    theirs = torchrec.KeyedJaggedTensor(
        keys=mine.keys(), values=mine.values(), lengths=mine.lengths(),
        stride_per_key_per_rank=mine.stride_per_key_per_rank(),
        inverse_indices=mine.inverse_indices(),
    )  # fmt: skip
    want = trec(theirs)
    for batch in (mine, theirs):  # dtrec's KJT, and TorchRec's handed straight to dtrec
        got = ebc(batch)
        assert got.keys() == want.keys()
        torch.testing.assert_close(got.values(), want.values(), rtol=1e-6, atol=1e-6)
    up = torch.randn(want.values().shape)
    grads = torch.autograd.grad((ebc(theirs).values() * up).sum(), list(ebc.parameters()))
    ref = torch.autograd.grad((want.values() * up).sum(), list(trec.parameters()))
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


@needs_torchrec
def test_unused_keys_ignored_like_torchrec() -> None:
    ebc = _ebc()
    trec = _torchrec_ebc(ebc, "sum")
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=["extra", "f1", "f0"], values=torch.tensor([99, 1, 2, 3, 4]),
        lengths=torch.tensor([1, 0, 2, 1, 1, 0]),
    )  # fmt: skip
    torch.testing.assert_close(ebc(kjt).values(), trec(kjt).values(), rtol=1e-6, atol=1e-6)


@needs_torchrec
def test_torchrec_regroup_accepts_dtrec_outputs() -> None:
    from torchrec.modules.regroup import KTRegroupAsDict

    ebc = _ebc()
    kjt = dtrec.KeyedJaggedTensor(["f0", "f1"], torch.tensor([1, 2, 3]), torch.tensor([1, 1, 0, 1]))
    out = ebc(kjt)
    groups = [["f1"], ["f0", "f1"]]
    theirs = torchrec.KeyedTensor.regroup([out], groups)
    mine = dtrec.KeyedTensor.regroup([out], groups)
    for t, m in zip(theirs, mine, strict=True):
        torch.testing.assert_close(t, m, rtol=0, atol=0)
    as_dict = KTRegroupAsDict(groups=groups, keys=["user", "both"])([out])
    torch.testing.assert_close(as_dict["both"], mine[1], rtol=0, atol=0)
