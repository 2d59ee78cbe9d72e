"""The unsharded EmbeddingBagCollection: the reference users write, and its input checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtrec


def _ebc() -> dtrec.EmbeddingBagCollection:
    torch.manual_seed(0)
    return dtrec.EmbeddingBagCollection(
        [
            dtrec.EmbeddingBagConfig("t0", 10, 4, ["a", "b"]),
            dtrec.EmbeddingBagConfig("t1", 5, 3, ["c"], pooling="mean"),
        ]
    )


def _kjt(**overrides) -> dtrec.KeyedJaggedTensor:
    args = dict(
        keys=["c", "a", "b"],  # any key order; output follows table order
        values=torch.tensor([4, 0, 1, 2, 9, 9, 3]),
        lengths=torch.tensor([2, 0, 1, 2, 1, 1]),
    )
    args.update(overrides)
    return dtrec.KeyedJaggedTensor(**args)


def test_forward_matches_embedding_bag_per_feature() -> None:
    ebc = _ebc()
    out = ebc(_kjt())
    assert out.keys() == ["a", "b", "c"] and out.values().shape == (2, 11)
    w0, w1 = ebc.embedding_bags["t0"].weight, ebc.embedding_bags["t1"].weight
    d = out.to_dict()
    # keys c, a, b with lengths [2, 0 | 1, 2 | 1, 1] over values [4, 0 | 1 | 2, 9 | 9 | 3]
    torch.testing.assert_close(
        d["a"], F.embedding_bag(torch.tensor([1, 2, 9]), w0, torch.tensor([0, 1]), mode="sum")
    )
    torch.testing.assert_close(
        d["b"], F.embedding_bag(torch.tensor([9, 3]), w0, torch.tensor([0, 1]), mode="sum")
    )
    torch.testing.assert_close(d["c"][0], w1[[4, 0]].mean(0))
    assert torch.all(d["c"][1] == 0)


def test_state_dict_keys_are_torchrec_keys() -> None:
    assert sorted(_ebc().state_dict()) == ["embedding_bags.t0.weight", "embedding_bags.t1.weight"]


def test_duck_typed_torchrec_kjt_is_accepted() -> None:
    real = _kjt()

    class FakeTorchRecKJT:  # TorchRec's method names, no dtrec type
        def keys(self):
            return real.keys()

        def values(self):
            return real.values()

        def lengths(self):
            return real.lengths()

        def weights_or_none(self):
            return None

    torch.testing.assert_close(_ebc()(FakeTorchRecKJT()).values(), _ebc()(real).values())


def test_keys_no_table_reads_are_ignored() -> None:
    """As TorchRec's collections do: an extra key (here with ids out of every range) is dropped."""
    ebc = _ebc()
    extra = _kjt(
        keys=["c", "zzz", "a", "b"],
        values=torch.tensor([4, 0, 99, -5, 1, 2, 9, 9, 3]),
        lengths=torch.tensor([2, 0, 1, 1, 1, 2, 1, 1]),
    )
    out = ebc(extra)
    assert out.keys() == ["a", "b", "c"]
    torch.testing.assert_close(out.values(), ebc(_kjt()).values(), rtol=0, atol=0)


def test_bad_input_names_the_table_and_feature() -> None:
    ebc = _ebc()
    with pytest.raises(
        IndexError, match="feature 'b' \\(table 't0'\\): id 10 is outside \\[0, 10\\)"
    ):
        ebc(_kjt(values=torch.tensor([4, 0, 1, 2, 9, 10, 3])))
    with pytest.raises(IndexError, match="feature 'c' \\(table 't1'\\): id -1"):
        ebc(_kjt(values=torch.tensor([-1, 0, 1, 2, 9, 9, 3])))
    with pytest.raises(KeyError, match="lacks feature.*'b' \\(table 't0'\\)"):
        ebc(dtrec.KeyedJaggedTensor(["a", "c"], torch.tensor([1]), torch.tensor([1, 0, 0, 0])))
    with pytest.raises(ValueError, match="need sum pooling.*\\['t1'\\]"):
        ebc(_kjt(weights=torch.ones(7)))
    with pytest.raises(ValueError, match="sum"):
        _kjt(lengths=torch.tensor([2, 0, 1, 2, 1, 2]))  # lengths sum to 8, 7 values
    with pytest.raises(TypeError, match="float32"):
        _kjt(values=torch.tensor([4.0, 0, 1, 2, 9, 9, 3]))
    with pytest.raises(TypeError, match="KeyedJaggedTensor"):
        ebc({"a": torch.tensor([1])})


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="table 'x': pooling must be one of"):
        dtrec.EmbeddingBagConfig("x", 3, 2, pooling="max")
    with pytest.raises(ValueError, match="table 'x': num_embeddings must be a positive int"):
        dtrec.EmbeddingBagConfig("x", 0, 2)
    with pytest.raises(ValueError, match="feature 'f' is read by tables 'a' and 'b'"):
        dtrec.EmbeddingBagCollection(
            [dtrec.EmbeddingBagConfig("a", 3, 2, ["f"]), dtrec.EmbeddingBagConfig("b", 3, 2, ["f"])]
        )
    with pytest.raises(ValueError, match="duplicate table name 'a'"):
        dtrec.EmbeddingBagCollection(
            [dtrec.EmbeddingBagConfig("a", 3, 2), dtrec.EmbeddingBagConfig("a", 3, 2, ["g"])]
        )
    assert dtrec.EmbeddingBagConfig("x", 3, 2).feature_names == ["x"]


def test_meta_device_collection_has_no_storage() -> None:
    ebc = dtrec.EmbeddingBagCollection([dtrec.EmbeddingBagConfig("x", 10**9, 128)], device="meta")
    assert ebc.embedding_bags["x"].weight.is_meta


def test_bounds_check_off_skips_the_id_check() -> None:
    ebc = _ebc()
    ebc_off = dtrec.EmbeddingBagCollection(ebc.embedding_bag_configs(), bounds_check="off")
    ebc_off.load_state_dict(ebc.state_dict())
    torch.testing.assert_close(ebc_off(_kjt()).values(), ebc(_kjt()).values())
    with pytest.raises(ValueError, match="bounds_check must be one of"):
        dtrec.EmbeddingBagCollection(ebc.embedding_bag_configs(), bounds_check="maybe")
