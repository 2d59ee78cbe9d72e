"""dtrec tables on a stage of ``torch.distributed.pipelining`` (docs/composing.md).

A pipeline schedule splits a stage's tensor arguments into microbatches along dim 0 and
hands anything else, such as a ``KeyedJaggedTensor``, whole to every microbatch: its ids
are jagged, so no chunk of ``values`` is a chunk of samples. The first stage therefore
takes the batch's sample positions as a tensor argument, which the schedule does split,
and cuts its microbatch out of the whole KJT with :func:`microbatch`. The tables' mesh
is the stage's slice of the world mesh (``dtrec.table_mesh(..., pipeline="pp")``), and
``dtrec.accumulate_gradients`` makes the fused tables take one update per step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dtrec.sharded.dist.batch_split import slice_samples
from dtrec.sparse import KeyedJaggedTensor

__all__ = ["microbatch"]


def microbatch(kjt: KeyedJaggedTensor, samples: Tensor) -> KeyedJaggedTensor:
    """The samples ``samples`` of ``kjt`` (every key's lengths, ids and weights): one
    microbatch, when ``samples`` is that microbatch's chunk of ``torch.arange(batch)``.

    ``samples`` must be consecutive positions (what the schedule's split of an arange
    gives); they are checked on the host (keep ``samples`` on the CPU).
    ValueError for positions that are not consecutive or outside the batch, and for a
    variable batch per feature (VBE), whose keys have batch sizes of their own.

    Example (the first stage's forward)::

        def forward(self, samples, dense, kjt):
            pooled = self.sparse(dtrec.pipelining.microbatch(kjt, samples))
            ...
        schedule.step(torch.arange(batch), dense, kjt=kjt)  # on the first stage
    """
    if kjt.variable_stride_per_key() or kjt.inverse_indices_or_none() is not None:
        raise ValueError(
            f"microbatch: the KJT of features {kjt.keys()} has a variable batch per feature "
            "(VBE); cutting microbatches out of it is not supported: feed one batch size "
            "for every feature"
        )
    if samples.dim() != 1 or samples.numel() == 0 or samples.is_floating_point():
        raise ValueError(
            f"microbatch: samples must be a non-empty 1-D integer tensor of positions, got "
            f"shape {tuple(samples.shape)} {samples.dtype}"
        )
    start, last = (int(v) for v in samples[[0, -1]].tolist())
    stop = last + 1
    if (
        start < 0
        or stop > kjt.stride()
        or stop - start != samples.numel()
        or not bool((samples == torch.arange(start, stop, device=samples.device)).all())
    ):
        raise ValueError(
            f"microbatch: samples must be consecutive positions in [0, {kjt.stride()}) (a "
            f"chunk of torch.arange(batch)), got {samples.numel()} from {start} to {last}"
        )
    return slice_samples(kjt, start, stop)
