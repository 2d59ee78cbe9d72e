"""Tests for dtrec.sparse: KeyedJaggedTensor, JaggedTensor, KeyedTensor, as_kjt."""

from __future__ import annotations

import pytest
import torch

from dtrec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor, as_kjt


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def make_kjt(weighted: bool = False, dtype: torch.dtype = torch.int64) -> KeyedJaggedTensor:
    # f1: [10], [], [11, 12]     f2: [20, 21, 22], [23], []
    values = torch.tensor([10, 11, 12, 20, 21, 22, 23], dtype=dtype)
    lengths = torch.tensor([1, 0, 2, 3, 1, 0], dtype=dtype)
    weights = torch.arange(7, dtype=torch.float32) if weighted else None
    return KeyedJaggedTensor(["f1", "f2"], values, lengths, weights)


def assert_jt(jt: JaggedTensor, values: list[int], lengths: list[int]) -> None:
    assert jt.values().tolist() == values
    assert jt.lengths().tolist() == lengths


def test_basic_accessors() -> None:
    kjt = make_kjt()
    assert kjt.keys() == ["f1", "f2"]
    assert kjt.stride() == 3
    assert kjt.length_per_key() == [3, 4]
    assert kjt.offset_per_key() == [0, 3, 7]
    assert kjt.offsets().tolist() == [0, 1, 1, 3, 6, 7, 7]
    assert kjt.offsets().dtype == torch.int64
    assert kjt.offsets() is kjt.offsets()  # cached
    assert kjt.weights_or_none() is None
    assert kjt.device() == torch.device("cpu")  # a method, as in TorchRec
    assert "f1" in repr(kjt) and "stride=3" in repr(kjt)
    with pytest.raises(ValueError, match="no weights"):
        kjt.weights()


def test_to_dict_and_getitem() -> None:
    kjt = make_kjt()
    d = kjt.to_dict()
    assert list(d) == ["f1", "f2"]
    assert_jt(d["f1"], [10, 11, 12], [1, 0, 2])
    assert_jt(d["f2"], [20, 21, 22, 23], [3, 1, 0])
    assert_jt(kjt["f2"], [20, 21, 22, 23], [3, 1, 0])
    assert kjt["f1"].offsets().tolist() == [0, 1, 1, 3]
    assert kjt["f1"].weights_or_none() is None
    with pytest.raises(KeyError, match=r"'nope'.*\['f1', 'f2'\]"):
        kjt["nope"]


def test_from_dict_round_trip() -> None:
    kjt = make_kjt(weighted=True)
    back = KeyedJaggedTensor.from_dict(kjt.to_dict())
    assert back.keys() == kjt.keys()
    assert torch.equal(back.values(), kjt.values())
    assert torch.equal(back.lengths(), kjt.lengths())
    assert torch.equal(back.weights(), kjt.weights())
    assert KeyedJaggedTensor.from_dict({}).keys() == []


def test_from_dict_errors() -> None:
    with pytest.raises(ValueError, match="'b' has batch size 1, expected 2"):
        KeyedJaggedTensor.from_dict(
            {"a": JaggedTensor(t(1, 2), t(1, 1)), "b": JaggedTensor(t(3), t(1))}
        )
    w = torch.ones(1)
    with pytest.raises(ValueError, match=r"\['b'\] have none"):
        KeyedJaggedTensor.from_dict(
            {"a": JaggedTensor(t(1), t(1), w), "b": JaggedTensor(t(3), t(1))}
        )


def test_permute_by_names_and_indices() -> None:
    kjt = make_kjt(weighted=True)
    for order in (["f2", "f1"], [1, 0], [-1, -2]):
        p = kjt.permute(order)
        assert p.keys() == ["f2", "f1"]
        assert p.stride() == 3
        assert p.lengths().tolist() == [3, 1, 0, 1, 0, 2]
        assert p.values().tolist() == [20, 21, 22, 23, 10, 11, 12]
        assert p.weights().tolist() == [3, 4, 5, 6, 0, 1, 2]
        assert p.length_per_key() == [4, 3]
        assert p.offsets().tolist() == [0, 3, 4, 4, 5, 5, 7]
        assert_jt(p["f1"], [10, 11, 12], [1, 0, 2])
    for back in (
        kjt.permute(["f2", "f1"]).permute(kjt.keys()),
        kjt.permute([1, 0]).permute([1, 0]),
    ):
        assert back.keys() == kjt.keys()
        assert torch.equal(back.values(), kjt.values())
        assert torch.equal(back.lengths(), kjt.lengths())
        assert torch.equal(back.weights(), kjt.weights())


def test_permute_subset_and_errors() -> None:
    kjt = make_kjt(weighted=True)
    sub = kjt.permute(["f2"])
    assert sub.keys() == ["f2"] and sub.stride() == 3
    assert_jt(sub["f2"], [20, 21, 22, 23], [3, 1, 0])
    assert sub.weights().tolist() == [3, 4, 5, 6]
    empty = kjt.permute([])
    assert empty.keys() == [] and empty.values().numel() == 0 and empty.stride() == 0
    with pytest.raises(KeyError, match="'f3'"):
        kjt.permute(["f1", "f3"])
    with pytest.raises(IndexError, match="2"):
        kjt.permute([2])
    with pytest.raises(ValueError, match="duplicate key 'f1'"):
        kjt.permute(["f1", "f1"])
    with pytest.raises(TypeError):
        kjt.permute([1.0])  # type: ignore[list-item]


def test_split() -> None:
    kjt = KeyedJaggedTensor.from_dict(
        {
            "a": JaggedTensor(t(1, 2), t(2, 0), torch.tensor([0.1, 0.2])),
            "b": JaggedTensor(t(3), t(0, 1), torch.tensor([0.3])),
            "c": JaggedTensor(t(4, 5, 6), t(1, 2), torch.tensor([0.4, 0.5, 0.6])),
        }
    )
    first, empty, rest = kjt.split([1, 0, 2])
    assert first.keys() == ["a"] and first.stride() == 2
    assert first.values().tolist() == [1, 2] and first.lengths().tolist() == [2, 0]
    assert first.weights().tolist() == pytest.approx([0.1, 0.2])
    assert empty.keys() == [] and empty.values().numel() == 0
    assert rest.keys() == ["b", "c"] and rest.stride() == 2
    assert rest.values().tolist() == [3, 4, 5, 6]
    assert rest.lengths().tolist() == [0, 1, 1, 2]
    assert rest.offset_per_key() == [0, 1, 4]
    assert rest["c"].weights_or_none().tolist() == pytest.approx([0.4, 0.5, 0.6])
    with pytest.raises(ValueError, match="sum to the number of keys"):
        kjt.split([1, 1])
    with pytest.raises(ValueError, match="non-negative"):
        kjt.split([4, -1])


def test_weights_through_to_dict_and_to() -> None:
    kjt = make_kjt(weighted=True)
    assert kjt["f2"].weights_or_none().tolist() == [3, 4, 5, 6]
    moved = kjt.to("cpu")
    assert moved.device() == torch.device("cpu")
    assert torch.equal(moved.weights(), kjt.weights())
    assert moved.length_per_key() == kjt.length_per_key()


def test_int32_inputs() -> None:
    kjt = make_kjt(dtype=torch.int32)
    assert kjt.values().dtype == torch.int32
    assert kjt.offsets().dtype == torch.int64
    assert kjt.offsets().tolist() == [0, 1, 1, 3, 6, 7, 7]
    assert kjt.length_per_key() == [3, 4]
    assert kjt.permute(["f2", "f1"]).lengths().tolist() == [3, 1, 0, 1, 0, 2]


def test_empty_batch_and_zero_keys() -> None:
    kjt = KeyedJaggedTensor(["a", "b"], t(), t())
    assert kjt.stride() == 0
    assert kjt.offsets().tolist() == [0]
    assert kjt.length_per_key() == [0, 0]
    assert_jt(kjt["b"], [], [])
    assert kjt.permute(["b"]).keys() == ["b"]
    assert [s.keys() for s in kjt.split([1, 1])] == [["a"], ["b"]]

    none = KeyedJaggedTensor([], t(), t())
    assert none.keys() == [] and none.stride() == 0
    assert none.length_per_key() == [] and none.offset_per_key() == [0]
    assert none.to_dict() == {}
    assert none.permute([]).keys() == []


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(keys=["f1", 2]), TypeError, "keys must be str"),
        (dict(keys=["f1", "f1"]), ValueError, "duplicate key 'f1'"),
        (dict(values=torch.tensor([1.0] * 7)), TypeError, "values.*float32"),
        (dict(values=torch.zeros(7, 1, dtype=torch.int64)), TypeError, "values.*dim=2"),
        (dict(lengths=torch.tensor([1.0, 0, 2, 3, 1, 0])), TypeError, "lengths.*float32"),
        (dict(lengths=t(1, 0, 2, 3, 1)), ValueError, r"numel\(\)=5.*number of keys 2"),
        (dict(lengths=t(1, 0, 2, 5, -1, 0)), ValueError, "-1 for key 'f2' at sample 1"),
        (dict(values=t(1, 2, 3)), ValueError, r"sum\(lengths\)=7 != values.numel\(\)=3"),
        (dict(lengths=t(1, 0, 2, 3, 1, 1)), ValueError, r"'f1': 3, 'f2': 5"),
        (dict(weights=t(1, 2, 3, 4, 5, 6, 7)), TypeError, "weights must be floating"),
        (dict(weights=torch.ones(6)), ValueError, r"values.numel\(\)=7"),
        (dict(weights=torch.ones(7, 1)), ValueError, "weights must be 1-D"),
        (dict(lengths=t(1, 0, 2, 3, 1, 0).to("meta")), ValueError, "lengths on meta"),
        (dict(weights=torch.ones(7, device="meta")), ValueError, "weights on meta"),
        (dict(keys=[]), ValueError, r"numel\(\)=6.*number of keys 0"),
    ],
)
def test_validation_errors(kwargs: dict, exc: type[Exception], match: str) -> None:
    args = dict(
        keys=["f1", "f2"],
        values=t(10, 11, 12, 20, 21, 22, 23),
        lengths=t(1, 0, 2, 3, 1, 0),
    )
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        KeyedJaggedTensor(**args)


class FakeTorchRecKJT:
    """Duck-typed stand-in with TorchRec's KeyedJaggedTensor method names."""

    def __init__(self, keys, values, lengths, weights=None) -> None:
        self._k, self._v, self._l, self._w = keys, values, lengths, weights

    def keys(self) -> list[str]:
        return self._k

    def values(self) -> torch.Tensor:
        return self._v

    def lengths(self) -> torch.Tensor:
        return self._l

    def weights_or_none(self) -> torch.Tensor | None:
        return self._w


def test_as_kjt() -> None:
    kjt = make_kjt()
    assert as_kjt(kjt) is kjt
    fake = FakeTorchRecKJT(["f1", "f2"], kjt.values(), kjt.lengths(), torch.ones(7))
    conv = as_kjt(fake)
    assert isinstance(conv, KeyedJaggedTensor)
    assert conv.keys() == ["f1", "f2"] and conv.stride() == 3
    assert_jt(conv["f2"], [20, 21, 22, 23], [3, 1, 0])
    assert conv.weights().tolist() == [1.0] * 7
    with pytest.raises(ValueError, match="'f2' at sample 0"):
        as_kjt(FakeTorchRecKJT(["f1", "f2"], t(), t(0, 0, -1, 1)))
    with pytest.raises(TypeError, match="expected a dtrec KeyedJaggedTensor.*object"):
        as_kjt(object())
    with pytest.raises(TypeError, match="dict"):
        as_kjt({"f1": t(1)})


def test_keyed_tensor() -> None:
    values = torch.arange(10.0).view(2, 5)
    kt = KeyedTensor(["a", "b"], [2, 3], values)
    assert kt.keys() == ["a", "b"]
    assert kt.length_per_key() == [2, 3]
    assert kt.offset_per_key() == [0, 2, 5]
    assert kt.key_dim() == 1
    assert kt.values() is values
    d = kt.to_dict()
    assert d["a"].tolist() == [[0, 1], [5, 6]]
    assert d["b"].tolist() == [[2, 3, 4], [7, 8, 9]]
    assert d["b"].data_ptr() == values[:, 2:].data_ptr()  # a view, not a copy
    assert torch.equal(kt["b"], d["b"])
    assert "KeyedTensor" in repr(kt)
    with pytest.raises(KeyError, match="'c'"):
        kt["c"]


def test_keyed_tensor_errors() -> None:
    with pytest.raises(ValueError, match=r"sum\(length_per_key\)=4.*\(2, 5\)"):
        KeyedTensor(["a", "b"], [2, 2], torch.zeros(2, 5))
    with pytest.raises(ValueError, match="one per key"):
        KeyedTensor(["a", "b"], [5], torch.zeros(2, 5))
    with pytest.raises(ValueError, match="non-negative"):
        KeyedTensor(["a", "b"], [6, -1], torch.zeros(2, 5))
    with pytest.raises(ValueError, match="duplicate key 'a'"):
        KeyedTensor(["a", "a"], [2, 3], torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"shape \(10,\)"):
        KeyedTensor(["a"], [10], torch.zeros(10))
