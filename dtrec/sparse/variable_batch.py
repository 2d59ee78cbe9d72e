"""Variable batch per feature (TorchRec's VBE): expand each feature's bags to the full batch.

A VBE ``KeyedJaggedTensor`` sends each feature's distinct bags once and says, with
``inverse_indices[1][f, b]``, which of its bags sample ``b`` of the full batch uses.
TorchRec's ``EmbeddingBagCollection`` pools the distinct bags, then gathers the
pooled rows through ``inverse_indices``. Pooling is per bag, so pooling the
*expanded* bags gives the same rows (and, through autograd, the same gradients:
a bag used by k samples gets the sum of their k output gradients either way).
dtrec expands the ids once at the input and runs its ordinary fixed-batch path on
every sharding type; the price is sending a repeated bag's ids once per use.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dtrec.sparse.checks import exclusive_cumsum, prefix_sums
from dtrec.sparse.keyed_jagged_tensor import KeyedJaggedTensor

__all__ = ["expand_variable_batch"]


def expand_variable_batch(kjt: KeyedJaggedTensor, keys: Sequence[str]) -> KeyedJaggedTensor:
    """The fixed-batch KJT of ``keys`` (in that order) that ``kjt``'s inverse indices describe.

    Key f's sample b gets a copy of bag ``inverse_indices[1][row of f, b]`` of f (ids,
    lengths, per-sample weights). KeyError for a key the inverse indices do not list,
    IndexError for an inverse index outside the key's bags. One vectorized gather.

    Example::

        kjt = KeyedJaggedTensor(["f"], torch.tensor([4, 5, 6]), torch.tensor([2, 1]),
                                stride_per_key_per_rank=[[2]],
                                inverse_indices=(["f"], torch.tensor([[1, 0, 1]])))
        expand_variable_batch(kjt, ["f"]).lengths()  # tensor([1, 2, 1]); values [6, 4, 5, 6]
    """
    inverse_keys, inverse = kjt.inverse_indices()
    row_of = {k: i for i, k in enumerate(inverse_keys)}
    absent = [k for k in keys if k not in row_of]
    if absent:
        raise KeyError(
            f"variable-batch KJT: inverse_indices list no row for feature(s) {absent}; "
            f"their keys: {inverse_keys}"
        )
    device = kjt.device()
    index_of = kjt._key_indices()
    positions = [index_of[k] for k in keys]
    stride_per_key = kjt.stride_per_key()
    first_bag = prefix_sums(stride_per_key)
    rows = torch.tensor([row_of[k] for k in keys], dtype=torch.long, device=device)
    chosen = inverse.index_select(0, rows).long()  # [F, B]: bag of each sample, per key
    bags = torch.tensor([stride_per_key[p] for p in positions], device=device).unsqueeze(1)
    if torch.compiler.is_compiling():  # checked in an op: no host read is traced
        chosen = checked_inverse_indices_op(chosen, bags, "\n".join(keys))
    else:
        _check_inverse_indices(chosen, bags, keys)
    base = torch.tensor([first_bag[p] for p in positions], device=device).unsqueeze(1)
    bag = (base + chosen).reshape(-1)  # entry of every expanded bag in kjt.lengths()
    lengths = kjt.lengths().index_select(0, bag)
    starts = kjt.offsets().index_select(0, bag)
    total = int(lengths.sum()) if lengths.numel() else 0  # traced: an unbacked size
    # each expanded id's position in kjt.values(): its bag's start + its rank in the bag
    shift = torch.repeat_interleave(
        starts - exclusive_cumsum(lengths)[:-1], lengths.long(), output_size=total
    )
    source = torch.arange(total, device=device) + shift
    weights = kjt.weights_or_none()
    # Pieces of a validated KJT (lengths >= 0, their sum the values'): not validated again.
    # The full batch is the inverse indices' width (a size, dynamic under torch.compile;
    # the KJT's int stride would be guarded on its value).
    return kjt._derived(
        list(keys),
        kjt.values().index_select(0, source),
        lengths,
        None if weights is None else weights.index_select(0, source),
        None,
        stride=inverse.shape[1],
    )


def _check_inverse_indices(chosen: Tensor, bags: Tensor, keys: Sequence[str]) -> None:
    """IndexError for an inverse index outside its feature's bags (one host read)."""
    bad = (chosen < 0) | (chosen >= bags)
    if bool(bad.any()):
        f, b = (int(x) for x in bad.nonzero()[0])
        raise IndexError(
            f"variable-batch KJT: feature {keys[f]!r}, sample {b}: inverse index "
            f"{int(chosen[f, b])} is outside its {int(bags[f])} bags"
        )


@torch.library.custom_op("dtrec::checked_inverse_indices", mutates_args=())
def checked_inverse_indices_op(chosen: Tensor, bags: Tensor, keys: str) -> Tensor:
    """``chosen`` (``[F, B]``: each sample's bag, per feature; ``bags``: ``[F, 1]`` bags
    per feature; ``keys``: the features, one a line), checked at run time: under
    ``torch.compile`` the check is this op, so the traced expansion reads nothing on the
    host for it (``_check_inverse_indices``)."""
    _check_inverse_indices(chosen, bags, keys.split("\n"))
    return chosen.clone()


@checked_inverse_indices_op.register_fake
def _checked_inverse_indices_fake(chosen: Tensor, bags: Tensor, keys: str) -> Tensor:
    return torch.empty_like(chosen)
