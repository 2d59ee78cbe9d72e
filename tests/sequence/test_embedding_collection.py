"""The unsharded EmbeddingCollection: outputs, grads and state_dict like TorchRec's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dtrec
from dtrec import EmbeddingCollection, EmbeddingConfig, JaggedTensor, KeyedJaggedTensor
from tests.interop.torchrec_or_skip import needs_torchrec, torchrec

TABLES = [("t0", 10, 4, ["f0", "f1"]), ("t1", 7, 4, ["f2"]), ("t2", 1, 4, ["f3"])]


def random_kjt(tables, batch: int, gen: torch.Generator, max_len: int = 4) -> KeyedJaggedTensor:
    keys, values, lengths = [], [], []
    for _, rows, _, feats in tables:
        for f in feats:
            ls = torch.randint(0, max_len + 1, (batch,), generator=gen)
            keys.append(f)
            lengths.append(ls)
            values.append(torch.randint(0, rows, (int(ls.sum()),), generator=gen))
    return KeyedJaggedTensor(keys, torch.cat(values), torch.cat(lengths))


def reference(ec: EmbeddingCollection, kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
    """Plain indexing of each feature's table."""
    owner = {f: cfg.name for cfg in ec.embedding_configs() for f in cfg.feature_names}
    return {f: ec.embeddings[owner[f]].weight[kjt[f].values()] for f in ec.feature_names()}


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), batch=st.integers(0, 5), max_len=st.integers(0, 6))
def test_forward_and_grads_match_indexing(seed: int, batch: int, max_len: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tables = [("t0", 10, 4, ["f0", "f1"]), ("t1", 7, 3, ["f2"]), ("t2", 5, 6, ["f3"])]
    ec = EmbeddingCollection([EmbeddingConfig(*t) for t in tables], need_indices=True)
    kjt = random_kjt(tables, batch, gen, max_len)
    out = ec(kjt)
    assert list(out) == ["f0", "f1", "f2", "f3"]
    ref = reference(ec, kjt)
    loss = 0.0
    for f, jt in out.items():
        assert isinstance(jt, JaggedTensor)
        torch.testing.assert_close(jt.values(), ref[f], rtol=0, atol=0)
        assert torch.equal(jt.lengths(), kjt[f].lengths())
        assert torch.equal(jt.weights(), kjt[f].values())
        loss = loss + (jt.values() * torch.arange(jt.values().numel()).view_as(jt.values())).sum()
    if isinstance(loss, torch.Tensor):
        loss.backward()
        grads = {n: e.weight.grad.clone() for n, e in ec.embeddings.items()}
        for e in ec.embeddings.values():
            e.weight.grad = None
        sum(
            (r * torch.arange(r.numel()).view_as(r)).sum() for r in reference(ec, kjt).values()
        ).backward()
        for n, e in ec.embeddings.items():
            torch.testing.assert_close(grads[n], e.weight.grad, rtol=0, atol=1e-6)


def test_state_dict_keys_and_configs() -> None:
    ec = EmbeddingCollection([EmbeddingConfig(*t) for t in TABLES])
    assert list(ec.state_dict()) == [f"embeddings.{t[0]}.weight" for t in TABLES]
    assert [c.name for c in ec.embedding_configs()] == ["t0", "t1", "t2"]
    assert EmbeddingConfig("t", 3, 2).feature_names == ["t"]


def test_bad_input_is_an_error() -> None:
    ec = EmbeddingCollection([EmbeddingConfig("t0", 5, 2, ["f0"])])
    with pytest.raises(IndexError, match="feature 'f0' \\(table 't0'\\).*id 5"):
        ec(KeyedJaggedTensor(["f0"], torch.tensor([5]), torch.tensor([1])))
    with pytest.raises(KeyError, match="lacks feature"):
        ec(KeyedJaggedTensor(["g"], torch.tensor([1]), torch.tensor([1])))
    vbe = KeyedJaggedTensor(
        ["f0"], torch.tensor([1, 2]), torch.tensor([1, 1]), stride_per_key_per_rank=[[2]],
        inverse_indices=(["f0"], torch.tensor([[0, 1, 1]])),
    )  # fmt: skip
    with pytest.raises(ValueError, match="variable-batch KJT"):
        ec(vbe)
    with pytest.raises(TypeError, match="pooled table"):
        EmbeddingCollection([dtrec.EmbeddingBagConfig("t0", 5, 2)])


def test_jagged_tensor_takes_rows() -> None:
    rows = torch.randn(3, 2)
    jt = JaggedTensor(rows, torch.tensor([2, 0, 1]), torch.tensor([4, 5, 6]))
    assert [x.shape[0] for x in jt.to_dense()] == [2, 0, 1]
    with pytest.raises(ValueError, match="sum\\(lengths\\)=2 != values.rows=3"):
        JaggedTensor(rows, torch.tensor([2]))
    with pytest.raises(TypeError, match="2-D values must be floating point"):
        JaggedTensor(torch.zeros(2, 2, dtype=torch.long), torch.tensor([2]))


@needs_torchrec
@pytest.mark.parametrize("need_indices", [False, True])
def test_same_as_torchrec(need_indices: bool) -> None:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TrKJT

    configs = [
        torchrec.EmbeddingConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=f)
        for n, r, d, f in TABLES
    ]
    theirs = torchrec.EmbeddingCollection(tables=configs, need_indices=need_indices)
    ours = EmbeddingCollection(configs, need_indices=need_indices)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    kjt = random_kjt(TABLES, 5, torch.Generator().manual_seed(0))
    tr_kjt = TrKJT(kjt.keys(), kjt.values(), lengths=kjt.lengths())
    out, expected = ours(kjt), theirs(tr_kjt)
    assert list(out) == list(expected)
    for f in expected:
        torch.testing.assert_close(out[f].values(), expected[f].values(), rtol=0, atol=0)
        assert torch.equal(out[f].lengths(), expected[f].lengths())
        if need_indices:
            assert torch.equal(out[f].weights(), expected[f].weights())
    sum((jt.values() ** 2).sum() for jt in out.values()).backward()
    sum((jt.values() ** 2).sum() for jt in expected.values()).backward()
    for name in theirs.embeddings:
        torch.testing.assert_close(
            ours.embeddings[name].weight.grad, theirs.embeddings[name].weight.grad
        )


@needs_torchrec
def test_mixed_dims_and_torchrec_init() -> None:
    configs = [
        torchrec.EmbeddingConfig(name="a", num_embeddings=4, embedding_dim=2, feature_names=["x"]),
        torchrec.EmbeddingConfig(name="b", num_embeddings=4, embedding_dim=6, feature_names=["y"],
                                 init_fn=torch.nn.init.ones_),
    ]  # fmt: skip
    ec = EmbeddingCollection(configs)
    assert torch.equal(ec.embeddings["b"].weight, torch.ones(4, 6))
    out = ec(KeyedJaggedTensor(["x", "y"], torch.tensor([0, 1, 2]), torch.tensor([1, 1, 0, 1])))
    assert out["x"].values().shape == (2, 2) and out["y"].values().shape == (1, 6)
