"""TorchRec modules and configs as dtrec's: conversion, weighted semantics, dtypes, and
the sparse modules dtrec refuses (never silently replicated). Compared with TorchRec."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import dtrec
from dtrec.interop import from_torchrec_bag_collection, unsupported_module
from dtrec.planning.plan import find_collections
from tests.fake_world import fake_world
from tests.interop.torchrec_or_skip import needs_torchrec, torchrec


def _configs(**extra):
    return [
        torchrec.EmbeddingBagConfig(
            name="t0", num_embeddings=10, embedding_dim=4, feature_names=["f0", "f1"], **extra
        ),
        torchrec.EmbeddingBagConfig(
            name="t1",
            num_embeddings=7,
            embedding_dim=3,
            feature_names=["f2"],
            pooling=torchrec.PoolingType.MEAN,
            **extra,
        ),
    ]


def _kjt(weighted: bool, seed: int = 0, batch: int = 3):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (3 * batch,), generator=gen)
    lengths[2 * batch] = max(int(lengths[2 * batch]), 1)
    values = torch.randint(0, 7, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.shape, generator=gen) if weighted else None
    return torchrec.KeyedJaggedTensor(
        keys=["f2", "f0", "f1"], values=values, lengths=lengths, weights=weights
    )


def test_is_weighted_option() -> None:
    """None: weights used when the batch has them; False: ignored; True: required."""
    torch.manual_seed(0)
    tables = [dtrec.EmbeddingBagConfig("t0", 10, 4, ["f0", "f1"])]
    kjt = dtrec.KeyedJaggedTensor(
        ["f0", "f1"], torch.tensor([1, 2, 3, 4]), torch.tensor([2, 0, 1, 1]),
        torch.tensor([0.5, 2.0, 3.0, -1.0]),
    )  # fmt: skip
    plain = dtrec.KeyedJaggedTensor(kjt.keys(), kjt.values(), kjt.lengths())
    ebc = dtrec.EmbeddingBagCollection(tables)
    weighted = ebc(kjt).values()
    unweighted = ebc(plain).values()
    assert not torch.allclose(weighted, unweighted)
    ebc.is_weighted = False
    torch.testing.assert_close(ebc(kjt).values(), unweighted)
    ebc.is_weighted = True
    torch.testing.assert_close(ebc(kjt).values(), weighted)
    with pytest.raises(ValueError, match="has no per-sample weights"):
        ebc(plain)


@needs_torchrec
def test_config_accepts_torchrec_pooling_enum_and_config() -> None:
    cfg = dtrec.EmbeddingBagConfig("t", 5, 2, ["f"], pooling=torchrec.PoolingType.MEAN)
    assert cfg.pooling == "mean"
    with pytest.raises(ValueError, match="PoolingType.NONE is an unpooled"):
        dtrec.EmbeddingBagConfig("t", 5, 2, ["f"], pooling=torchrec.PoolingType.NONE)
    torch.manual_seed(0)
    ebc = dtrec.EmbeddingBagCollection(_configs())
    assert [c.pooling for c in ebc.embedding_bag_configs()] == ["sum", "mean"]
    assert [c.feature_names for c in ebc.embedding_bag_configs()] == [["f0", "f1"], ["f2"]]


@needs_torchrec
def test_torchrec_config_dtype_and_init_fn() -> None:
    from torchrec.types import DataType

    cfg = torchrec.EmbeddingBagConfig(
        name="t0", num_embeddings=6, embedding_dim=2, feature_names=["f0"],
        data_type=DataType.FP16, init_fn=lambda w: w.fill_(0.25),
    )  # fmt: skip
    ebc = dtrec.EmbeddingBagCollection([cfg])
    weight = ebc.embedding_bags["t0"].weight
    assert weight.dtype == torch.float16
    assert bool((weight == 0.25).all())
    bf16 = torchrec.EmbeddingBagConfig(
        name="t1", num_embeddings=6, embedding_dim=2, feature_names=["f1"], data_type=DataType.BF16
    )
    assert dtrec.EmbeddingBagCollection([bf16]).embedding_bags["t1"].weight.dtype == torch.bfloat16
    int8 = torchrec.EmbeddingBagConfig(
        name="t2", num_embeddings=6, embedding_dim=2, feature_names=["f2"], data_type=DataType.INT8
    )
    with pytest.raises(ValueError, match="table 't2': data_type DataType.INT8 is not a float"):
        dtrec.EmbeddingBagCollection([int8])
    sequence = torchrec.EmbeddingConfig(name="s", num_embeddings=6, embedding_dim=2)
    with pytest.raises(TypeError, match="got EmbeddingConfig .an unpooled sequence table"):
        dtrec.EmbeddingBagCollection([sequence])


@needs_torchrec
@pytest.mark.parametrize("is_weighted", [False, True])
@pytest.mark.parametrize("kjt_weighted", [False, True])
def test_converted_collection_shares_weights_and_matches_torchrec(
    is_weighted: bool, kjt_weighted: bool
) -> None:
    torch.manual_seed(0)
    configs = _configs()
    if is_weighted:  # TorchRec allows per-sample weights with sum pooling only
        configs[1].pooling = torchrec.PoolingType.SUM
    reference = torchrec.EmbeddingBagCollection(configs, is_weighted=is_weighted)
    converted = from_torchrec_bag_collection(reference)
    assert converted.is_weighted is is_weighted
    for name in ("t0", "t1"):
        assert converted.embedding_bags[name].weight is reference.embedding_bags[name].weight
    kjt = _kjt(kjt_weighted)
    if is_weighted and not kjt_weighted:
        with pytest.raises(ValueError, match="has no per-sample weights but the collection"):
            converted(kjt)
        return
    want = reference(kjt)
    got = converted(kjt)
    assert got.keys() == want.keys()
    torch.testing.assert_close(got.values(), want.values(), rtol=0, atol=1e-6)
    grad = torch.randn(want.values().shape)
    (want.values() * grad).sum().backward()
    expected = {n: reference.embedding_bags[n].weight.grad.clone() for n in ("t0", "t1")}
    reference.zero_grad()
    (got.values() * grad).sum().backward()
    for name, g in expected.items():
        torch.testing.assert_close(reference.embedding_bags[name].weight.grad, g)


@needs_torchrec
@pytest.mark.parametrize("dtype", ["FP16", "BF16"])
def test_low_precision_tables_output_like_torchrec(dtype: str) -> None:
    """TorchRec's collection returns fp32 (``.float()``) from fp16 tables (it makes BF16
    configs fp16 too); dtrec's pooled output has the table's dtype (documented)."""
    from torchrec.types import DataType

    configs = [
        torchrec.EmbeddingBagConfig(name="t0", num_embeddings=10, embedding_dim=4,
                                    feature_names=["f0", "f1", "f2"],
                                    data_type=getattr(DataType, dtype))
    ]  # fmt: skip
    reference = torchrec.EmbeddingBagCollection(configs)
    converted = from_torchrec_bag_collection(reference)
    table_dtype = reference.embedding_bags["t0"].weight.dtype
    kjt = _kjt(False)
    want, got = reference(kjt).values(), converted(kjt).values()
    assert want.dtype == torch.float32 and got.dtype == table_dtype
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-3)


@needs_torchrec
def test_mixed_dtype_collection_is_an_error() -> None:
    """dtrec's pooled output has its tables' dtype, so one dtype per collection (a mixed
    TorchRec collection would otherwise round its fp32 tables' output)."""
    from torchrec.types import DataType

    configs = _configs()
    configs[0].data_type = DataType.FP16
    model = nn.Module()
    model.sparse = torchrec.EmbeddingBagCollection(configs)
    with pytest.raises(ValueError, match="must share a dtype .* put the tables of each dtype"):
        find_collections(model)


class _Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)


def _fake(module: str, name: str) -> type[nn.Module]:
    """A class with TorchRec's module and name (for variants not built on CPU here)."""
    return type(name, (nn.Module,), {"__module__": module})


def _unsupported_modules() -> dict[str, nn.Module]:
    class MyEBC(torchrec.EmbeddingBagCollection):
        pass

    class MyEC(torchrec.EmbeddingCollection):
        pass

    return {
        "EmbeddingCollection subclass": MyEC(
            [torchrec.EmbeddingConfig(name="s", num_embeddings=5, embedding_dim=4)]
        ),
        "HashZchManagedCollisionModule": _fake(
            "torchrec.modules.hash_mc_modules", "HashZchManagedCollisionModule"
        )(),
        "quant EmbeddingBagCollection": _fake(
            "torchrec.quant.embedding_modules", "EmbeddingBagCollection"
        )(),
        "FusedEmbeddingBagCollection": _fake(
            "torchrec.modules.fused_embedding_modules", "FusedEmbeddingBagCollection"
        )(),
        "ShardedEmbeddingBagCollection": _fake(
            "torchrec.distributed.embeddingbag", "ShardedEmbeddingBagCollection"
        )(),
        "subclass": MyEBC(_configs()),
    }


UNSUPPORTED_ADVICE = {
    "EmbeddingCollection subclass": "it subclasses torchrec.EmbeddingCollection",
    "HashZchManagedCollisionModule": "hash-probing ZCH modules are not supported",
    "quant EmbeddingBagCollection": "dtrec trains float tables",
    "FusedEmbeddingBagCollection": "pass the optimizer to distribute_module",
    "ShardedEmbeddingBagCollection": "already sharded by TorchRec",
    "subclass": "it subclasses torchrec.EmbeddingBagCollection",
}


@needs_torchrec
@pytest.mark.parametrize("kind", sorted(UNSUPPORTED_ADVICE))
def test_unsupported_torchrec_modules_are_errors_naming_them(kind: str) -> None:
    model = nn.Module()
    model.dense = _Dense()
    model.towers = nn.ModuleDict({"user": _unsupported_modules()[kind]})
    with pytest.raises(TypeError, match="module 'towers.user' is a ") as info:
        find_collections(model)
    assert "TorchRec sparse module dtrec cannot shard" in str(info.value)
    assert re.search(UNSUPPORTED_ADVICE[kind], str(info.value))
    with fake_world(0, 2):
        mesh = dtrec.init_mesh("cpu", 2)
        with pytest.raises(TypeError, match="module 'towers.user' is a "):
            dtrec.distribute_module(model, mesh)
        with pytest.raises(TypeError, match="module 'towers.user' is a "):
            dtrec.plan(model, mesh)


@needs_torchrec
def test_dense_torchrec_modules_are_left_alone() -> None:
    from torchrec.modules.mlp import MLP

    mlp = MLP(4, [8, 2])
    assert unsupported_module("mlp", mlp) is None
    ebc = torchrec.EmbeddingBagCollection(_configs())
    assert unsupported_module("ebc", ebc) is None
    model = nn.Sequential(mlp, copy.deepcopy(ebc))
    assert list(find_collections(model)) == ["1"]
