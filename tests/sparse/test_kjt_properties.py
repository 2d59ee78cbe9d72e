"""No silent wrong output: random KJTs, well-formed or broken in one way, into a collection.

Hypothesis draws a batch as the *intended* per-feature bags (so the right answer is
known without dtrec), optionally with a variable batch per feature (TorchRec's VBE:
each feature's distinct bags plus inverse indices), extra keys no table reads, and
per-sample weights; then breaks it in at most one way (a length that does not add
up, a negative length, a length entry too many, an id out of range, an inverse index
out of range, a feature missing from the inverse indices, a missing feature). Every
result must either equal the reference built from the intended bags (and TorchRec's
own collection on the same weights and KJT, where torchrec is installed and accepts
the KJT) or be a clear ``ValueError`` / ``TypeError`` / ``KeyError`` / ``IndexError``
— never a wrong shape or wrong numbers.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtrec

try:
    import torchrec
except Exception:  # noqa: BLE001 - any import failure means "no torchrec"
    torchrec = None


def _tables(weighted: bool) -> list[dtrec.EmbeddingBagConfig]:
    """Two tables; t1 mean-pooled unless the batch carries per-sample weights (which need
    sum pooling: that refusal has its own test)."""
    return [
        dtrec.EmbeddingBagConfig("t0", 7, 3, ["a", "b"]),
        dtrec.EmbeddingBagConfig("t1", 5, 2, ["c"], pooling="sum" if weighted else "mean"),
    ]


ROWS = {"a": 7, "b": 7, "c": 5}
FEATURES = ["a", "b", "c"]
BREAKS = (
    None,
    "lengths_sum",
    "negative_length",
    "extra_length",
    "id_out_of_range",
    "inverse_out_of_range",
    "inverse_missing_feature",
    "missing_feature",
)
CLEAR_ERRORS = (ValueError, TypeError, KeyError, IndexError)


@st.composite
def batches(draw):
    batch = draw(st.integers(1, 4))
    variable = draw(st.booleans())
    weighted = draw(st.booleans())
    extra_keys = draw(st.lists(st.sampled_from(["x", "y"]), unique=True, max_size=2))
    order = draw(st.permutations(FEATURES + extra_keys))
    rows = {**ROWS, **{k: 100 for k in extra_keys}}
    bags, inverse = {}, {}
    for key in order:
        count = draw(st.integers(1, 3)) if variable else batch
        bags[key] = [
            draw(st.lists(st.integers(0, rows[key] - 1), max_size=3)) for _ in range(count)
        ]
        if variable:
            inverse[key] = draw(st.lists(st.integers(0, count - 1), min_size=batch, max_size=batch))
    breaks = [b for b in BREAKS if variable or b is None or "inverse" not in b]
    broken = draw(st.sampled_from(breaks))
    weights_seed = draw(st.integers(0, 2**16))
    return dict(batch=batch, order=order, bags=bags, inverse=inverse, variable=variable,
                weighted=weighted, broken=broken, seed=weights_seed)  # fmt: skip


def _kjt_parts(case):
    """(keys, values, lengths, weights, stride_per_key_per_rank, inverse_indices), with the
    case's one break applied."""
    order = list(case["order"])
    if case["broken"] == "missing_feature":
        order.remove(case["order"][0] if case["order"][0] in FEATURES else "a")
    values, lengths = [], []
    for key in order:
        for bag in case["bags"][key]:
            values.extend(bag)
            lengths.append(len(bag))
    broken = case["broken"]
    if broken == "id_out_of_range":
        first_table_feature = next(k for k in order if k in FEATURES)
        at = sum(
            sum(len(b) for b in case["bags"][k]) for k in order[: order.index(first_table_feature)]
        )
        values.insert(at, 1000)
        lengths[sum(len(case["bags"][k]) for k in order[: order.index(first_table_feature)])] += 1
    if broken == "lengths_sum":
        lengths[0] += 1
    if broken == "negative_length":
        lengths[0] = -1
        values = values[: max(0, len(values) - 0)]
    if broken == "extra_length":
        lengths.append(0)
    weights = None
    if case["weighted"]:
        weights = torch.tensor([_weight(case, i) for i in range(len(values))])
    per_rank, inverse = None, None
    if case["variable"]:
        per_rank = [[len(case["bags"][k])] for k in order]
        inv_keys = [k for k in order]
        rows = [list(case["inverse"][k]) for k in inv_keys]
        if broken == "inverse_out_of_range":
            rows[0][0] = len(case["bags"][inv_keys[0]])
        if broken == "inverse_missing_feature":
            drop = next(k for k in inv_keys if k in FEATURES)
            rows.pop(inv_keys.index(drop))
            inv_keys.remove(drop)
        inverse = (inv_keys, torch.tensor(rows, dtype=torch.long).view(len(inv_keys), -1))
    return (
        order,
        torch.tensor(values, dtype=torch.long),
        torch.tensor(lengths),
        weights,
        per_rank,
        inverse,
    )


def _weight(case, position: int) -> float:
    """The per-sample weight of the id at ``position`` of the KJT's values."""
    return float(torch.rand(1, generator=torch.Generator().manual_seed(case["seed"] + position)))


def _reference(ebc, case) -> torch.Tensor:
    """Pooled rows from the intended bags (dtrec never involved): [B, 8]."""
    start, first_value = 0, {}
    for key in case["order"]:  # where each bag's ids start in the KJT's values
        for bag, ids in enumerate(case["bags"][key]):
            first_value[key, bag] = start
            start += len(ids)
    cols = []
    for cfg in _tables(case["weighted"]):
        table = ebc.embedding_bags[cfg.name].weight
        for f in cfg.feature_names:
            rows = []
            for b in range(case["batch"]):
                bag = case["inverse"][f][b] if case["variable"] else b
                ids = case["bags"][f][bag]
                if not ids:
                    rows.append(torch.zeros(cfg.embedding_dim))
                    continue
                vec = table[torch.tensor(ids)]
                if case["weighted"]:
                    w = [_weight(case, first_value[f, bag] + i) for i in range(len(ids))]
                    vec = vec * torch.tensor(w).unsqueeze(1)
                rows.append(vec.mean(0) if cfg.pooling == "mean" else vec.sum(0))
            cols.append(torch.stack(rows))
    return torch.cat(cols, dim=1)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(batches())
def test_every_kjt_is_either_right_or_a_clear_error(case) -> None:
    torch.manual_seed(0)
    ebc = dtrec.EmbeddingBagCollection(_tables(case["weighted"]))
    try:
        keys, values, lengths, weights, per_rank, inverse = _kjt_parts(case)
        kjt = dtrec.KeyedJaggedTensor(
            keys, values, lengths, weights, stride_per_key_per_rank=per_rank,
            inverse_indices=inverse,
        )  # fmt: skip
        with torch.no_grad():
            out = ebc(kjt)
    except CLEAR_ERRORS as exc:
        assert case["broken"] is not None, (
            f"a well-formed batch was refused: {type(exc).__name__}: {exc}"
        )
        assert str(exc), "an error without a message"
        return
    assert case["broken"] is None, f"broken batch ({case['broken']}) accepted: {out}"
    assert out.keys() == ["a", "b", "c"]
    assert out.values().shape == (case["batch"], 8)
    with torch.no_grad():
        torch.testing.assert_close(out.values(), _reference(ebc, case), rtol=1e-6, atol=1e-6)
    if torchrec is not None:
        _check_against_torchrec(ebc, case, out.values())


def _check_against_torchrec(ebc, case, ours: torch.Tensor) -> None:
    pool = {"sum": torchrec.PoolingType.SUM, "mean": torchrec.PoolingType.MEAN}
    theirs = torchrec.EmbeddingBagCollection(
        [
            torchrec.EmbeddingBagConfig(
                name=c.name,
                num_embeddings=c.num_embeddings,
                embedding_dim=c.embedding_dim,
                feature_names=list(c.feature_names),
                pooling=pool[c.pooling],
            )  # fmt: skip
            for c in _tables(case["weighted"])
        ],
        is_weighted=case["weighted"],
    )
    theirs.load_state_dict(ebc.state_dict())
    keys, values, lengths, weights, per_rank, inverse = _kjt_parts(case)
    kjt = torchrec.KeyedJaggedTensor(
        keys=keys, values=values, lengths=lengths, weights=weights,
        stride_per_key_per_rank=per_rank, inverse_indices=inverse,
    )  # fmt: skip
    with torch.no_grad():
        want = theirs(kjt).values()
    torch.testing.assert_close(ours, want, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(torchrec is None, reason="torchrec (bench extra) not installed")
def test_torchrec_handles_the_reference_case() -> None:
    """The TorchRec comparison above really runs (a VBE batch with an extra key)."""
    case = dict(batch=2, order=["c", "x", "a", "b"], variable=True, weighted=False, broken=None,
                seed=0, bags={"a": [[1, 2], []], "b": [[3]], "c": [[0], [4, 4]], "x": [[9]]},
                inverse={"a": [1, 0], "b": [0, 0], "c": [1, 1], "x": [0, 0]})  # fmt: skip
    torch.manual_seed(0)
    ebc = dtrec.EmbeddingBagCollection(_tables(False))
    keys, values, lengths, weights, per_rank, inverse = _kjt_parts(case)
    kjt = dtrec.KeyedJaggedTensor(keys, values, lengths, weights, stride_per_key_per_rank=per_rank,
                                  inverse_indices=inverse)  # fmt: skip
    with torch.no_grad():
        out = ebc(kjt).values()
        torch.testing.assert_close(out, _reference(ebc, case))
    _check_against_torchrec(ebc, case, out)
