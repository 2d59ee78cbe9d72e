"""Position-weighted features on one device: TorchRec's results, names and checkpoints."""

from __future__ import annotations

import pytest
import torch

import dtrec
from dtrec.modules.feature_processor import bag_positions
from dtrec.planning.plan import find_collections, model_tables
from tests.interop.torchrec_or_skip import needs_torchrec

TABLES = [("t0", 10, 4, ["f0"]), ("t1", 7, 3, ["f1", "f2"])]
FEATURES = ["f0", "f1", "f2"]
LENGTHS = [2, 0, 3, 1, 5, 0, 4, 1, 1]


def batch(kjt_type: type = dtrec.KeyedJaggedTensor) -> object:
    values = torch.tensor([1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 5, 4, 3, 2, 1]) % 7
    return kjt_type.from_lengths_sync(keys=FEATURES, values=values, lengths=torch.tensor(LENGTHS))


def dtrec_fp_ebc(collection: bool) -> dtrec.FeatureProcessedEmbeddingBagCollection:
    configs = [dtrec.EmbeddingBagConfig(n, rows, dim, feats) for n, rows, dim, feats in TABLES]
    ebc = dtrec.EmbeddingBagCollection(configs, is_weighted=True)
    if collection:
        fps: object = dtrec.PositionWeightedModuleCollection(dict.fromkeys(FEATURES, 5))
    else:
        fps = {f: dtrec.PositionWeightedModule(5) for f in FEATURES}
    return dtrec.FeatureProcessedEmbeddingBagCollection(ebc, fps)


def torchrec_fp_ebc(collection: bool):  # noqa: ANN201
    import torchrec
    from torchrec.modules.feature_processor_ import (
        PositionWeightedModule,
        PositionWeightedModuleCollection,
    )
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    configs = [
        torchrec.EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=f)
        for n, r, d, f in TABLES
    ]
    ebc = torchrec.EmbeddingBagCollection(configs, is_weighted=True)
    if collection:
        fps: object = PositionWeightedModuleCollection(dict.fromkeys(FEATURES, 5))
    else:
        fps = {f: PositionWeightedModule(5) for f in FEATURES}
    fp_ebc = FeatureProcessedEmbeddingBagCollection(ebc, fps)
    with torch.no_grad():
        for name, param in fp_ebc.named_parameters():
            if "position_weight" in name:
                param.uniform_(0.5, 1.5)
    return fp_ebc


def test_bag_positions() -> None:
    lengths = torch.tensor([2, 0, 3, 1])
    assert bag_positions(lengths, 6).tolist() == [0, 1, 0, 1, 2, 0]
    assert bag_positions(torch.zeros(0, dtype=torch.long), 0).numel() == 0


@needs_torchrec
@pytest.mark.parametrize("collection", [False, True], ids=["modules", "collection"])
def test_same_as_torchrec(collection: bool) -> None:
    import torchrec

    theirs = torchrec_fp_ebc(collection)
    ours = dtrec_fp_ebc(collection)
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    out_theirs = theirs(batch(torchrec.KeyedJaggedTensor))
    out_ours = ours(batch())
    assert out_ours.keys() == out_theirs.keys()
    torch.testing.assert_close(out_ours.values(), out_theirs.values(), rtol=0, atol=1e-6)
    grad = torch.randn_like(out_ours.values())
    out_theirs.values().backward(grad)
    out_ours.values().backward(grad)
    theirs_grads = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, theirs_grads[name].grad, rtol=1e-6, atol=1e-6)
        assert param.grad.abs().sum() > 0, name


def test_variable_batch_uses_positions_of_the_deduplicated_bags() -> None:
    fp_ebc = dtrec_fp_ebc(collection=False)
    with torch.no_grad():
        for name, param in fp_ebc.named_parameters():
            if "position_weight" in name:
                param.copy_(torch.arange(1.0, 6.0))
    dense = batch()
    # the same batch, each feature's 3 bags sent once and mapped back by inverse indices
    inverse = torch.arange(3).repeat(3, 1)
    vbe = dtrec.KeyedJaggedTensor(
        FEATURES,
        dense.values(),
        dense.lengths(),
        stride_per_key_per_rank=[[3]] * 3,
        inverse_indices=(FEATURES, inverse),
    )
    torch.testing.assert_close(fp_ebc(vbe).values(), fp_ebc(dense).values())


def test_unweighted_batch_gets_weights_and_given_weights_are_replaced() -> None:
    fp_ebc = dtrec_fp_ebc(collection=True)
    plain = batch()
    weighted = dtrec.KeyedJaggedTensor(
        FEATURES, plain.values(), plain.lengths(), torch.full((plain.values().numel(),), 9.0)
    )
    torch.testing.assert_close(fp_ebc(weighted).values(), fp_ebc(plain).values())


def test_long_bag_names_the_feature() -> None:
    fp_ebc = dtrec_fp_ebc(collection=False)
    lengths = torch.tensor([6, 0, 0, 0, 0, 0, 0, 0, 0])
    kjt = dtrec.KeyedJaggedTensor(FEATURES, torch.arange(6) % 7, lengths)
    with pytest.raises(ValueError, match="feature 'f0': a bag has 6 ids .* max_feature_length=5"):
        fp_ebc(kjt)


@needs_torchrec
def test_torchrec_fp_ebc_is_found_with_its_inner_tables() -> None:
    from torch import nn

    model = nn.Module()
    model.sparse = torchrec_fp_ebc(collection=False)
    assert list(find_collections(model)) == ["sparse._embedding_bag_collection"]
    assert sorted(model_tables(model)) == [
        "sparse._embedding_bag_collection.t0",
        "sparse._embedding_bag_collection.t1",
    ]
