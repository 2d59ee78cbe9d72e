"""Tables trained by a user's ``torch.optim`` optimizer: their state moves with them.

Without a fused optimizer a table is a DTensor parameter that the user's optimizer
holds: its param groups list it, and its ``state`` is keyed by it. ``reshard`` replaces
the parameter, so each optimizer given to it is repointed to the new one: the param
group's list entry and the ``state`` key. State tensors shaped like the table (Adam's
``exp_avg`` and ``exp_avg_sq``, Adagrad's ``sum``, SGD's ``momentum_buffer``: DTensors
placed like the table) move like the weight, as entries ``"torch<i>.<key>"`` of the
table; anything else (a step count, a ``None`` buffer) is kept as it is, the same on
every rank since every rank steps every table (``ShardedCollection._with_absent_grads``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from dtrec._torch_compat import local_block
from dtrec.planning.plan import table_fqn

PREFIX = "torch"
"""Entry names of torch optimizer state: ``"torch<optimizer index>.<state key>"``."""


def check_optimizers(optimizers: object) -> list[torch.optim.Optimizer] | None:
    """``optimizers`` as a list (None stays None); TypeError for anything but optimizers."""
    if optimizers is None:
        return None
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    if not isinstance(optimizers, Sequence) or not all(
        isinstance(o, torch.optim.Optimizer) for o in optimizers
    ):
        raise TypeError(
            "reshard: optimizers must be a torch.optim.Optimizer or a list of them, got "
            f"{optimizers!r}"
        )
    return list(optimizers)


def table_entries(
    optimizers: Sequence[torch.optim.Optimizer], fqn: str, names: Sequence[str], weights: list
) -> dict[int, list[str]]:
    """Table index -> the names of its torch state entries that move (``"torch<i>.<key>"``),
    sorted. ValueError naming the table for a state tensor reshard cannot place (a
    DTensor of another shape or layout than the table, or a plain tensor that is not a
    scalar)."""
    out: dict[int, list[str]] = {}
    for t, weight in enumerate(weights):
        entries = []
        for i, optimizer in enumerate(optimizers):
            for key, value in optimizer.state.get(weight, {}).items():
                if isinstance(value, DTensor):
                    if value.shape != weight.shape or value.placements != weight.placements:
                        raise ValueError(
                            f"reshard: table {table_fqn(fqn, names[t])!r}: its torch optimizer "
                            f"state {key!r} is a DTensor of shape {tuple(value.shape)} and "
                            f"placements {value.placements}, not the table's; reshard moves "
                            "only state placed like its table"
                        )
                    entries.append(f"{PREFIX}{i}.{key}")
                elif isinstance(value, Tensor) and value.numel() > 1:
                    raise ValueError(
                        f"reshard: table {table_fqn(fqn, names[t])!r}: its torch optimizer "
                        f"state {key!r} is a plain tensor of shape {tuple(value.shape)}; "
                        "reshard moves DTensor state placed like its table and keeps scalars"
                    )
        if entries:
            out[t] = sorted(entries)
    return out


def _split(entry: str) -> tuple[int, str]:
    index, key = entry[len(PREFIX) :].split(".", 1)
    return int(index), key


def state_of(optimizers: Sequence[torch.optim.Optimizer], weight: Tensor, entry: str) -> DTensor:
    """The DTensor of a torch state entry of the table ``weight``."""
    index, key = _split(entry)
    return optimizers[index].state[weight][key]


def old_local(optimizers: Sequence[torch.optim.Optimizer], weight: Tensor, entry: str) -> Tensor:
    """This rank's block of a torch state entry of the table ``weight``."""
    return local_block(state_of(optimizers, weight, entry))


@dataclass
class TorchStates:
    """The new tables' torch optimizer state, built aside (``new_local`` filled by the
    moves), then swapped into the optimizers with ``repoint``."""

    optimizers: Sequence[torch.optim.Optimizer]
    new_local: dict[tuple[int, str], Tensor] = field(default_factory=dict)
    """(table, entry) -> this rank's block of the new state (shaped like the new weight's)."""
    moved: list[tuple[Tensor, Tensor, dict[str, Tensor]]] = field(default_factory=list)
    """(old weight, new weight, {entry: this rank's new block}) per table."""

    def allocate(self, t: int, entries: Sequence[str], old: Tensor, new: Tensor) -> None:
        """Blocks for table ``t``'s ``entries``, like ``new``'s local block (dtype of the
        old state); ``repoint`` wraps them as DTensors placed like ``new``."""
        blocks = {}
        for entry in entries:
            dtype = state_of(self.optimizers, old, entry).dtype
            blocks[entry] = torch.empty_like(local_block(new), dtype=dtype)
            self.new_local[t, entry] = blocks[entry]
        self.moved.append((old, new, blocks))

    def repoint(self) -> None:
        """Every optimizer's param groups and ``state`` now hold the new tables: the new
        weight in the old one's place, the moved state entries as DTensors placed like
        it, the other state (scalars) as it was. Gradients are not carried (like
        ``zero_grad``): reshard runs between steps."""
        from dtrec.sharded.tables.tensor import like_dtensor

        swapped = {id(old): new for old, new, _ in self.moved}
        for index, optimizer in enumerate(self.optimizers):
            for group in optimizer.param_groups:
                group["params"] = [swapped.get(id(p), p) for p in group["params"]]
            for old, new, blocks in self.moved:
                if old not in optimizer.state:
                    continue
                state = dict(optimizer.state.pop(old))
                for entry, block in blocks.items():
                    i, key = _split(entry)
                    if i == index:
                        state[key] = like_dtensor(block, new)
                optimizer.state[new] = state


def torch_optimizer_refusal(
    fqn: str, first: str, optimizers: Sequence[torch.optim.Optimizer] | None
) -> ValueError | None:
    """Why a collection without a fused optimizer cannot move: no ``optimizers`` given."""
    if optimizers is not None:
        return None
    return ValueError(
        f"reshard: table {table_fqn(fqn, first)!r} is trained by a torch optimizer (no fused "
        "optimizer): pass the optimizer(s) holding the tables, reshard(model, plan, "
        "optimizers=[opt]), so their param groups and state move to the new tables "
        "(optimizers=[] if none holds them)"
    )


def weights_of(tables: Mapping[str, object]) -> list[Tensor]:
    """The weight parameter of each table, in order."""
    return [table.weight for table in tables.values()]  # type: ignore[attr-defined]
