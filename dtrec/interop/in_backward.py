"""TorchRec's in-backward optimizer recipe as dtrec's fused optimizer (torchrec never imported).

TorchRec users pick the embedding optimizer before sharding::

    # torchrec.optim.apply_optimizer_in_backward, or torch's _apply_optimizer_in_backward
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": 0.02})
    model = DistributedModelParallel(model, ...)
    dense = torch.optim.Adam(dict(in_backward_optimizer_filter(model.named_parameters())).values())

torch's ``_apply_optimizer_in_backward`` leaves three lists on each parameter it was given:
``_in_backward_optimizers`` (optimizer instances), ``_optimizer_classes`` and
``_optimizer_kwargs``; TorchRec's ``EmbeddingBagCollectionSharder`` turns the class and
kwargs of a table's weight into its FBGEMM fused optimizer (``optimizer_type_to_emb_opt_type``,
``lr`` -> ``learning_rate``, FBGEMM's defaults for the rest), and the sharded weights carry
an ``_in_backward_optimizers`` marker so ``in_backward_optimizer_filter`` leaves them out
of the dense optimizer.

``fused_rules`` does the sharder's part for dtrec: each table's class and kwargs become a
``dtrec.optim`` rule with the same math (missing kwargs take FBGEMM's defaults, which
TorchRec trains with: lr 0.01, eps 1e-8, betas (0.9, 0.999)). Anything the rule cannot
honour (full Adagrad, LAMB, momentum or weight decay, an unknown kwarg) is a ValueError
naming the table and the optimizer: never a table trained by something else than what was
asked for. A collection's tables share one rule (one fused update per collection, one
param group in ``model.fused_optimizer``); collections may differ in hyperparameters.

Example::

    rules = fused_rules({"sparse": {"t0": ebc.embedding_bags["t0"].weight}})
    rules  # {"sparse": RowWiseAdagrad(lr=0.02, eps=1e-08)}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from dtrec.optim import SGD, Adam, FusedOptimizer, RowWiseAdagrad

_LR_DEFAULT = 0.01
"""FBGEMM's ``learning_rate`` default: what TorchRec's DMP trains with when the kwargs give
no ``lr`` (not the optimizer class's own default)."""

_RULES: dict[tuple[str, str], type[FusedOptimizer]] = {
    ("torch.optim.sgd", "SGD"): SGD,
    ("torchrec.optim.optimizers", "SGD"): SGD,
    ("torchrec.optim.rowwise_adagrad", "RowWiseAdagrad"): RowWiseAdagrad,
    ("torch.optim.adam", "Adam"): Adam,
    ("torchrec.optim.optimizers", "Adam"): Adam,
}
"""(class module, class name) -> the dtrec rule doing the same update (exact classes only:
a subclass may change the math)."""

_ADVICE = {
    "Adagrad": "dtrec fuses row-wise Adagrad (one accumulator per row), not full Adagrad: use "
    "torchrec.optim.RowWiseAdagrad",
}

_MUST_BE_DEFAULT: dict[type[FusedOptimizer], dict[str, object]] = {
    SGD: {"momentum": 0, "dampening": 0, "weight_decay": 0, "nesterov": False, "maximize": False},
    RowWiseAdagrad: {
        "lr_decay": 0,
        "weight_decay": 0,
        "initial_accumulator_value": 0,
        "maximize": False,
    },
    Adam: {"weight_decay": 0, "amsgrad": False, "maximize": False, "decoupled_weight_decay": False},
}
"""Kwargs the rule has no counterpart for: accepted at their no-op value only."""

_IMPLEMENTATION = frozenset({"foreach", "fused", "differentiable", "capturable"})
"""torch optimizer kwargs that pick an implementation, not the math: ignored."""


def _class_name(cls: object) -> str:
    return f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else repr(cls)


def _rule_for(table: str, cls: object, kwargs: Mapping[str, Any]) -> FusedOptimizer:
    """The dtrec rule for one table's in-backward optimizer class and kwargs."""
    key = (cls.__module__, cls.__qualname__) if isinstance(cls, type) else None
    rule_type = _RULES.get(key) if key is not None else None
    if rule_type is None:
        advice = _ADVICE.get(key[1], "") if key is not None else ""
        raise ValueError(
            f"table {table!r}: in-backward optimizer {_class_name(cls)} has no dtrec fused "
            f"counterpart (dtrec fuses SGD, torchrec.optim.RowWiseAdagrad and Adam)"
            + (f"; {advice}" if advice else "")
        )
    values = dict(kwargs)
    if "learning_rate" in values:  # FBGEMM's name, as TorchRec's fused_params spell it
        values.setdefault("lr", values.pop("learning_rate"))
    if rule_type is Adam and ("beta1" in values or "beta2" in values):
        if "betas" in values:
            raise ValueError(
                f"table {table!r}: in-backward optimizer {_class_name(cls)}: kwargs give both "
                "betas and beta1/beta2; give one"
            )
        values["betas"] = (values.pop("beta1", 0.9), values.pop("beta2", 0.999))
    fixed = _MUST_BE_DEFAULT[rule_type]
    fields = set(rule_type.__dataclass_fields__)
    for key in sorted(values):
        if key in _IMPLEMENTATION:
            continue
        if key in fixed:
            if values[key] != fixed[key]:
                raise ValueError(
                    f"table {table!r}: in-backward optimizer {_class_name(cls)} with "
                    f"{key}={values[key]!r}: dtrec's fused {rule_type.__name__} has no {key} "
                    f"(only {key}={fixed[key]!r} is the same update)"
                )
            continue
        if key not in fields:
            raise ValueError(
                f"table {table!r}: in-backward optimizer {_class_name(cls)} kwarg {key!r} is "
                f"not one dtrec's fused {rule_type.__name__} has (it takes {sorted(fields)})"
            )
    chosen = {k: v for k, v in values.items() if k in fields}
    chosen.setdefault("lr", _LR_DEFAULT)
    chosen = {k: float(v) if isinstance(v, Tensor) else v for k, v in chosen.items()}
    try:
        return rule_type(**chosen)
    except ValueError as exc:
        raise ValueError(
            f"table {table!r}: in-backward optimizer {_class_name(cls)}: {exc}"
        ) from None


def table_rule(table: str, weight: object) -> FusedOptimizer | None:
    """The rule for one table weight marked by ``_apply_optimizer_in_backward``; None if
    unmarked. ValueError naming ``table`` for several optimizers on it or an unmappable one."""
    classes = getattr(weight, "_optimizer_classes", None)
    if classes is None:
        return None
    kwargs = list(getattr(weight, "_optimizer_kwargs", [{}] * len(classes)))
    if len(classes) != 1 or len(kwargs) != 1:
        names = [_class_name(c) for c in classes]
        raise ValueError(
            f"table {table!r} has {len(classes)} in-backward optimizers {names}; dtrec (like "
            "TorchRec's sharder) fuses exactly one per table"
        )
    return _rule_for(table, classes[0], kwargs[0] or {})


def fused_rules(
    collections: Mapping[str, Mapping[str, object]],
) -> dict[str, FusedOptimizer] | None:
    """Collection FQN -> the fused rule of its tables' in-backward optimizers; None when no
    table has one.

    ``collections``: collection FQN -> {table FQN: weight}. ValueError when some tables have
    an in-backward optimizer and others not, a collection's tables differ in class or
    kwargs, or collections differ in class (hyperparameters may differ between them).
    """
    rules = {
        fqn: {table: table_rule(table, weight) for table, weight in tables.items()}
        for fqn, tables in collections.items()
    }
    every = {table: rule for per in rules.values() for table, rule in per.items()}
    marked = sorted(t for t, r in every.items() if r is not None)
    if not marked:
        return None
    unmarked = sorted(t for t, r in every.items() if r is None)
    if unmarked:
        raise ValueError(
            f"tables {marked[:3]} have an in-backward optimizer (apply_optimizer_in_backward) "
            f"but {unmarked[:3]} do not; dtrec fuses the optimizer into every table: apply it "
            "to all of them (e.g. to model.sparse_arch.parameters())"
        )
    out: dict[str, FusedOptimizer] = {}
    for fqn, per in rules.items():
        if not per:
            continue
        (first_table, first), *others = per.items()
        for table, rule in others:
            if rule != first:
                raise ValueError(
                    f"collection {fqn!r}: table {first_table!r} has in-backward optimizer "
                    f"{first!r}, table {table!r} {rule!r}; dtrec updates a collection's "
                    "tables with one rule: give them the same optimizer and kwargs, or put "
                    "them in separate collections"
                )
        out[fqn] = first
    if len({type(rule) for rule in out.values()}) > 1:
        kinds = ", ".join(f"{fqn!r}: {type(rule).__name__}" for fqn, rule in out.items())
        raise ValueError(
            f"collections use different in-backward optimizer types ({kinds}); dtrec fuses "
            "one optimizer type per model (collections may differ in lr, eps, betas)"
        )
    return out


__all__ = ["fused_rules", "table_rule"]
