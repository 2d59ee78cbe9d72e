"""Where a sequence (``EmbeddingCollection``) training step's time goes, dtrec and TorchRec.

The same exclusive stages as ``benchmarks/probes/stages.py`` (``ExclusiveStageTimer``), with the
sequence path's classes in place of the pooled ones:

* ``input_dist``: validation, bucketizing and the id exchange, waits on it included;
* ``lookup_fwd``: the row gathers on local shards (dtrec: ``SequenceLookup``, which also
  lays the rows out for the exchange; TorchRec: its lookup modules);
* ``output_dist``: the row exchange and placing rows in the per-feature outputs (dtrec:
  ``SequenceOutputDist`` plus ``ReturnPlan``, which is also reported alone as
  ``return_plan``, and ``sequence_outputs``; TorchRec: its output-dist modules and
  awaitable waits, wherever the dense part first reads them);
* ``output_dist_bwd``: the row exchange's backward;
* ``backward_update`` and ``dense``: as in ``benchmarks/probes/stages.py`` (dtrec's fused update
  alone is also ``fused_update``).
"""

from __future__ import annotations

from torch import nn

from benchmarks.probes.stages import Target

PART_OF = {"fused_update": "backward_update", "return_plan": "output_dist"}
"""Stages reported alone that are also part of a bigger one (part -> whole)."""


def dtrec_sequence_targets(model: nn.Module) -> list[Target]:
    """dtrec's sequence stages by the classes and functions that run them."""
    from dtrec.comm import collectives
    from dtrec.sharded import sequence
    from dtrec.sharded.dist import sequence_dist
    from dtrec.sharded.dist.input_dist import RoutedBatch
    from dtrec.sharded.update import fused_update

    del model  # dtrec's stages are its classes'
    return [
        ("input_dist", sequence.ShardedEmbeddingCollection, "_start"),
        ("input_dist", RoutedBatch, "wait_served"),
        ("lookup_fwd", sequence_dist.SequenceLookup, "served"),
        ("lookup_fwd", sequence_dist.SequenceLookup, "data_parallel"),
        ("return_plan", sequence_dist.ReturnPlan, "__init__"),
        ("output_dist", sequence_dist.SequenceOutputDist, "__call__"),
        ("output_dist", sequence, "sequence_outputs"),
        ("output_dist_bwd", collectives._AllToAll, "backward"),
        ("fused_update", fused_update, "update_waiting"),
    ]


def torchrec_sequence_targets(model: nn.Module) -> list[Target]:
    """TorchRec's sequence stages: the sharded EC's input dist and its awaitables, the
    lookup and output-dist modules it holds, the sequence collectives' backward."""
    from torchrec.distributed import comm_ops, dist_data, embedding, embedding_sharding

    targets: list[Target] = [
        ("input_dist", embedding.ShardedEmbeddingCollection, "input_dist"),
        ("input_dist", dist_data.KJTAllToAllSplitsAwaitable, "_wait_impl"),
        ("input_dist", dist_data.KJTAllToAllTensorsAwaitable, "_wait_impl"),
        ("input_dist", embedding_sharding.KJTListSplitsAwaitable, "_wait_impl"),
        ("input_dist", embedding_sharding.KJTListAwaitable, "_wait_impl"),
        ("output_dist", dist_data.SequenceEmbeddingsAwaitable, "_wait_impl"),
        ("output_dist", embedding.EmbeddingCollectionAwaitable, "_wait_impl"),
    ]
    for name in ("All2All_Seq_Req", "All2All_Seq_Req_Wait", "All2Allv_Req", "All2Allv_Wait"):
        targets.append(("output_dist_bwd", getattr(comm_ops, name), "backward"))
    for module in model.modules():
        if isinstance(module, embedding.ShardedEmbeddingCollection):
            targets += [("lookup_fwd", type(m), "forward") for m in module._lookups]
            targets += [("output_dist", type(m), "forward") for m in module._output_dists]
    return targets
