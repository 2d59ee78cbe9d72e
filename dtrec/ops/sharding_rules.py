"""DTensor sharding rules of the dtrec ops.

Per mesh axis, with the weights' placement W and the inputs' (values, offsets,
per-sample weights) placement I:

| W        | I        | output                  | weight grad                     |
| -------- | -------- | ----------------------- | ------------------------------- |
| Replicate| Replicate| Replicate               | Replicate (Partial if grad is)  |
| Replicate| Shard(0) | Shard(0) (batch)        | Partial(sum) over the batch     |
| Shard(0) | Replicate| Partial(sum)            | Shard(0): local rows only       |
| Shard(1) | Replicate| Shard(1) (one entry)    | Shard(1): grad_out's columns    |

"Batch-sharded" inputs are jagged: each rank's local values/offsets are its
own batch (``DTensor.from_local(..., run_check=False)``); the output's global
batch is the local batch times the batch axes' sizes (so local batches must be
equal, as torch's Shard(0) of the output needs). With several entries a
column split of the weights is not a column split of the concatenated output,
so each entry's block is all-gathered over the Shard(1) axes (the output is
Replicate there). Any other combination is a ValueError naming the axis.

The rules are pure functions of placements; ``dtrec.ops.dtensor_bridge`` applies them
to real DTensors (the one file that touches DTensor dispatch).
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

__all__ = [
    "embedding_bag_backward_strategy",
    "embedding_bag_psw_backward_strategy",
    "embedding_bag_strategy",
]

Placements = tuple[Placement, ...]


def is_shard(p: Placement, dim: int) -> bool:
    """``p`` is exactly ``Shard(dim)`` (not a subclass such as a strided or masked shard)."""
    return type(p) is Shard and p.dim == dim


def _axis_rule(axis: int, w: Placement, i: Placement, entries: int) -> tuple[Placement, ...]:
    """(output, grad_out needed by backward, weight grad) on one mesh axis."""
    if isinstance(w, Replicate) and isinstance(i, Replicate):
        return Replicate(), Replicate(), Replicate()
    if isinstance(w, Replicate) and is_shard(i, 0):
        return Shard(0), Shard(0), Partial()
    if is_shard(w, 0) and isinstance(i, Replicate):
        return Partial(), Replicate(), Shard(0)
    if is_shard(w, 1) and isinstance(i, Replicate):
        split = Shard(1) if entries == 1 else Replicate()
        return split, split, Shard(1)
    raise ValueError(
        f"dtrec.embedding_bag: mesh axis {axis}: weights {w} with inputs {i} is not supported "
        "(weights Replicate/Shard(0)/Shard(1) need replicated inputs; batch-sharded inputs "
        "(Shard(0)) need replicated weights)"
    )


def embedding_bag_strategy(
    weight_placements: Placements, input_placements: Placements, num_entries: int
) -> Placements:
    """Output placements of ``dtrec::embedding_bag`` (see the module table).

    Example::

        embedding_bag_strategy((Shard(0), Replicate()), (Replicate(), Shard(0)), 1)
        # -> (Partial(sum), Shard(dim=0))
    """
    rules = zip(weight_placements, input_placements, strict=True)
    return tuple(_axis_rule(a, w, i, num_entries)[0] for a, (w, i) in enumerate(rules))


def embedding_bag_backward_strategy(
    weight_placements: Placements,
    input_placements: Placements,
    num_entries: int,
    grad_out_placements: Placements,
) -> tuple[Placements, Placements]:
    """(placements grad_out is redistributed to, weight-grad placements) of the backward.

    A Partial grad_out on a fully replicated axis stays Partial (so does the
    weight grad there): the lookup is linear, the sum can wait.

    Example::

        embedding_bag_backward_strategy((Shard(0),), (Replicate(),), 1, (Replicate(),))
        # -> ((Replicate(),), (Shard(dim=0),))
    """
    grad_out: list[Placement] = []
    grad_weight: list[Placement] = []
    rules = zip(weight_placements, input_placements, grad_out_placements, strict=True)
    for axis, (w, i, g) in enumerate(rules):
        _, need, gw = _axis_rule(axis, w, i, num_entries)
        if isinstance(need, Replicate) and isinstance(gw, Replicate) and g.is_partial():
            need, gw = g, g
        grad_out.append(need)
        grad_weight.append(gw)
    return tuple(grad_out), tuple(grad_weight)


def embedding_bag_psw_backward_strategy(
    weight_placements: Placements, input_placements: Placements, num_entries: int
) -> tuple[Placements, Placements]:
    """(placements grad_out is redistributed to, psw-grad placements).

    A row (Shard(0)) or column (Shard(1)) shard only sees part of each id's
    dot product, so the per-id gradient is Partial there; batch-sharded
    inputs give a batch-sharded (jagged, Shard(0)) gradient.

    Example::

        embedding_bag_psw_backward_strategy((Shard(0),), (Replicate(),), 1)
        # -> ((Replicate(),), (Partial(sum),))
    """
    grad_out: list[Placement] = []
    grad_psw: list[Placement] = []
    rules = zip(weight_placements, input_placements, strict=True)
    for axis, (w, i) in enumerate(rules):
        _, need, _ = _axis_rule(axis, w, i, num_entries)
        grad_out.append(need)
        grad_psw.append(
            Shard(0) if is_shard(i, 0) else Replicate() if isinstance(w, Replicate) else Partial()
        )
    return tuple(grad_out), tuple(grad_psw)
