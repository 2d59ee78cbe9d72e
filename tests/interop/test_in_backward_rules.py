"""The in-backward optimizer recipe's mapping onto dtrec's fused rules (torch's classes;
TorchRec's own are in ``test_in_backward.py``), and what the distributed model shows.

* ``fused_rules``: kwargs, aliases, FBGEMM's defaults; every kwarg dtrec cannot honour is
  an error (``docs/errors.md`` E270-E278 has one case each).
* A 2-rank world: per-collection hyperparameters become the collections' param groups
  and train like the same groups set by hand; the tables carry TorchRec's marker, so
  ``in_backward_optimizer_filter`` (duck-typed: ``hasattr(p, "_in_backward_optimizers")``)
  leaves only dense parameters, and torch's ``_get_in_backward_optimizers`` finds
  ``model.fused_optimizer``.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.optim import _apply_optimizer_in_backward

import dtrec
from dtrec.interop.in_backward import fused_rules, table_rule
from dtrec.optim import SGD, Adam, RowWiseAdagrad
from tests.interop.torchrec_or_skip import needs_torchrec
from tests.multiprocess import run_world


def _marked(cls, kwargs, rows: int = 4) -> torch.nn.Parameter:
    weight = torch.nn.Parameter(torch.zeros(rows, 2))
    _apply_optimizer_in_backward(cls, [weight], kwargs)
    return weight


@pytest.mark.parametrize(
    ("cls", "kwargs", "want"),
    [
        (torch.optim.SGD, {"lr": 0.3}, SGD(lr=0.3)),
        (torch.optim.SGD, {"lr": 0.3, "momentum": 0.0, "foreach": True}, SGD(lr=0.3)),
        (torch.optim.SGD, {}, SGD(lr=0.01)),  # FBGEMM's default, what TorchRec trains with
        (torch.optim.Adam, {"lr": 0.1}, Adam(lr=0.1)),
        (
            torch.optim.Adam,
            {"lr": 0.1, "betas": (0.5, 0.6), "eps": 1e-5, "weight_decay": 0},
            Adam(lr=0.1, betas=(0.5, 0.6), eps=1e-5),
        ),
        (torch.optim.Adam, {"lr": torch.tensor(0.1)}, Adam(lr=float(torch.tensor(0.1)))),
    ],
)
def test_torch_classes_map_to_fused_rules(cls, kwargs, want) -> None:
    assert table_rule("t", _marked(cls, kwargs)) == want


def test_fbgemm_learning_rate_is_lr() -> None:
    weight = torch.nn.Parameter(torch.zeros(2, 2))  # TorchRec's SGD / Adam take any kwargs
    weight._optimizer_classes, weight._optimizer_kwargs = (
        [torch.optim.SGD],
        [{"learning_rate": 0.2}],
    )
    assert table_rule("t", weight) == SGD(lr=0.2)
    weight._optimizer_classes, weight._optimizer_kwargs = [torch.optim.Adam], [{"beta2": 0.9}]
    assert table_rule("t", weight) == Adam(lr=0.01, betas=(0.9, 0.9))


def test_unmarked_weights_have_no_rule() -> None:
    assert table_rule("t", torch.nn.Parameter(torch.zeros(2, 2))) is None
    assert fused_rules({"a": {"a.t": torch.nn.Parameter(torch.zeros(2, 2))}}) is None


def test_collections_may_differ_in_hyperparameters_not_in_type() -> None:
    rules = fused_rules(
        {
            "a": {"a.t0": _marked(torch.optim.SGD, {"lr": 0.1}),
                  "a.t1": _marked(torch.optim.SGD, {"lr": 0.1})},
            "b": {"b.t2": _marked(torch.optim.SGD, {"lr": 0.4})},
        }
    )  # fmt: skip
    assert rules == {"a": SGD(lr=0.1), "b": SGD(lr=0.4)}
    with pytest.raises(ValueError, match="collection 'a': table 'a.t0' has in-backward"):
        fused_rules(
            {"a": {"a.t0": _marked(torch.optim.SGD, {"lr": 0.1}),
                   "a.t1": _marked(torch.optim.SGD, {"lr": 0.2})}}
        )  # fmt: skip


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (torch.optim.Adagrad, {"lr": 0.1}, "has no dtrec fused counterpart.*RowWiseAdagrad"),
        (torch.optim.AdamW, {"lr": 0.1}, "torch.optim.adamw.AdamW has no dtrec fused"),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, "momentum=0.9: dtrec's fused SGD"),
        (torch.optim.SGD, {"lr": 0.1, "nesterov": True}, "nesterov=True"),
        (torch.optim.SGD, {"lr": 0.1, "weight_decay": 1e-4}, "weight_decay=0.0001"),
        (torch.optim.Adam, {"lr": 0.1, "amsgrad": True}, "amsgrad=True"),
        (torch.optim.SGD, {"lr": 0.1, "eps": 1e-3}, "kwarg 'eps' is not one dtrec's fused SGD"),
        (torch.optim.SGD, {"lr": -1.0}, "SGD: lr must be a finite number >= 0"),
    ],
)
def test_what_dtrec_cannot_honour_is_an_error(cls, kwargs, match) -> None:
    weight = torch.nn.Parameter(torch.zeros(2, 2))
    weight._optimizer_classes, weight._optimizer_kwargs = [cls], [kwargs]  # no instance needed
    with pytest.raises(ValueError, match=match):
        table_rule("sparse.t0", weight)


class TwoCollections(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = dtrec.EmbeddingBagCollection(
            [
                dtrec.EmbeddingBagConfig("t0", 20, 4, ["f0"]),
                dtrec.EmbeddingBagConfig("t1", 9, 4, ["f1"]),
            ]
        )
        self.b = dtrec.EmbeddingBagCollection([dtrec.EmbeddingBagConfig("t2", 12, 4, ["f2"])])
        self.dense = torch.nn.Linear(12, 1)

    def forward(self, kjt):
        return self.dense(torch.cat([self.a(kjt).values(), self.b(kjt).values()], 1)).squeeze(1)


def _batch(rank: int, step: int):
    gen = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 3, (9,), generator=gen)
    rows = torch.tensor([20, 9, 12]).repeat_interleave(3).repeat_interleave(lengths)
    values = (torch.rand(int(lengths.sum()), generator=gen) * rows).long()
    return dtrec.KeyedJaggedTensor(["f0", "f1", "f2"], values, lengths)


def _train(model, rank: int) -> dict:
    dense = torch.optim.SGD(
        [p for n, p in model.named_parameters() if not hasattr(p, "_in_backward_optimizers")],
        lr=0.1,
    )
    for step in range(3):
        model(_batch(rank, step)).pow(2).mean().backward()
        dense.step()
        dense.zero_grad()
    return dtrec.checkpoint.full_state_dict(model)


def _world(rank: int, world: int) -> dict:
    from dtrec.placements import RowWise, TableWise

    mesh = dtrec.init_mesh("cpu", 2)
    plan = {"a.t0": RowWise(), "a.t1": TableWise(rank=1), "b.t2": RowWise()}
    torch.manual_seed(0)
    recipe = TwoCollections()
    from torchrec.optim import RowWiseAdagrad as TorchRecRowWiseAdagrad

    for collection, lr in ((recipe.a, 0.1), (recipe.b, 0.3)):
        weights = [t.weight for t in collection.embedding_bags.values()]
        _apply_optimizer_in_backward(TorchRecRowWiseAdagrad, weights, {"lr": lr, "eps": 1e-6})
    recipe = dtrec.distribute_module(recipe, mesh, plan)
    fused = recipe.fused_optimizer
    shown = {
        "rule": fused.optimizer,
        "lrs": [g["lr"] for g in fused.param_groups],
        "eps": [g["eps"] for g in fused.param_groups],
        "hidden": sorted(
            n for n, p in recipe.named_parameters() if hasattr(p, "_in_backward_optimizers")
        ),  # fmt: skip
        "in_backward": {
            id(o) == id(fused) for o in torch.distributed.optim._get_in_backward_optimizers(recipe)
        },
    }
    torch.manual_seed(0)
    by_hand = dtrec.distribute_module(
        TwoCollections(), mesh, plan, optimizer=RowWiseAdagrad(lr=0.1, eps=1e-6)
    )
    by_hand.fused_optimizer.param_groups[1]["lr"] = 0.3
    got, want = _train(recipe, rank), _train(by_hand, rank)
    shown["diff"] = max((got[k] - want[k]).abs().max().item() for k in want)
    return shown


@needs_torchrec
def test_per_collection_recipe_is_per_collection_param_groups() -> None:
    for shown in run_world(2, _world):
        assert shown["rule"] == RowWiseAdagrad(lr=0.1, eps=1e-6)
        assert shown["lrs"] == [0.1, 0.3] and shown["eps"] == [1e-6, 1e-6]
        assert shown["hidden"] == [
            "a.embedding_bags.t0.weight", "a.embedding_bags.t1.weight",
            "b.embedding_bags.t2.weight",
        ]  # fmt: skip
        assert shown["in_backward"] == {True}
        assert shown["diff"] == 0.0
