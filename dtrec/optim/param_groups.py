"""A fused rule's hyperparameters as a torch ``param_groups`` entry, read back every step.

``model.fused_optimizer.param_groups`` holds one dict per distributed collection whose
values (``lr``, and ``eps`` / ``betas`` where the rule has them) an LR scheduler or the
user changes between steps. Before each fused update the updater turns its group back
into a rule with ``rule_for_group``: a key the rule does not have (``weight_decay``,
``momentum``) or a bad value (negative or NaN lr) is a ValueError naming the group and
the key, never a setting that is silently ignored.

Example::

    rule = rule_for_group(RowWiseAdagrad(lr=0.1), {"params": [...], "lr": 0.05, "eps": 1e-8})
    rule.lr  # 0.05
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dtrec.optim.base import FusedOptimizer

#: Keys of a group that name its tables, not hyperparameters.
PARAM_KEYS = frozenset({"params", "param_names"})
#: Keys ``torch.optim.lr_scheduler`` and ``swa_utils`` keep in a group for their own
#: bookkeeping (OneCycleLR's ``max_lr``, ``initial_lr`` of every scheduler, ...); the
#: update never reads them.
SCHEDULER_KEYS = frozenset(
    {"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "swa_lr"}
)


def describe_group(group: Mapping[str, Any]) -> str:
    """How errors name a group: by its tables (``param_names``), the first three."""
    names = list(group.get("param_names", ()))
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"fused optimizer param group of tables {names[:3]}{more}"


def hyperparameters_of(group: Mapping[str, Any]) -> dict[str, Any]:
    """The group's entries that are not its tables (hyperparameters and scheduler keys)."""
    return {k: v for k, v in group.items() if k not in PARAM_KEYS}


def rule_for_group(rule: FusedOptimizer, group: Mapping[str, Any]) -> FusedOptimizer:
    """``rule`` with the group's current hyperparameters (validated like the constructor).

    ValueError naming the group and the key for a key the rule does not have or a value
    its constructor rejects.
    """
    names = rule.hyperparameters()
    values = hyperparameters_of(group)
    unknown = sorted(set(values) - set(names) - SCHEDULER_KEYS)
    if unknown:
        raise ValueError(
            f"{describe_group(group)}: {unknown[0]!r} is not a hyperparameter of "
            f"{type(rule).__name__} (it has {sorted(names)}); remove it from the group"
        )
    try:
        return rule.with_hyperparameters({k: values[k] for k in names if k in values})
    except ValueError as exc:
        raise ValueError(f"{describe_group(group)}: {exc}") from None


def check_loaded_group(rule: FusedOptimizer, group: Mapping[str, Any]) -> None:
    """A saved group carries every hyperparameter of ``rule`` with a valid value."""
    missing = sorted(set(rule.hyperparameters()) - set(group))
    if missing:
        raise KeyError(
            f"{describe_group(group)}: saved group lacks {missing} of {type(rule).__name__} "
            "(saved by a different optimizer?)"
        )
    rule_for_group(rule, group)


__all__ = [
    "PARAM_KEYS",
    "SCHEDULER_KEYS",
    "check_loaded_group",
    "describe_group",
    "hyperparameters_of",
    "rule_for_group",
]
