"""dtrec's expected bytes per rank per step, from the tables' shard layouts (no processes)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from benchmarks.common.workloads import Workload, dtrec_spec, row_probs
from dtrec.modules.config import EmbeddingBagConfig
from dtrec.placements.mesh import ShardAxis, positions_per_node
from dtrec.planning.cost_model import Topology, comm_by_kind, table_cost


def cost_model(
    w: Workload,
    kinds: Sequence[str],
    world: int,
    shard_group_size: int,
    node_size: int | None = None,
) -> dict:
    """Expected bytes one rank sends per training step in dtrec, per dtrec collective kind.

    Built from each table's ``TableLayout.blocks`` the way ``dtrec.sharded`` routes data
    (B = batch per rank, L = mean bag length, S shard group, R = W / S replicas,
    P(b) = probability mass of block b's rows,
    U(n, b) = expected distinct rows of block b among n ids = sum_r in b 1 - (1 - p_r)^n):

    * ``input_dist.header``: to each of the S - 1 peers 4 int32 when any table is not data
      parallel, and one int32 id count per segment that peer serves;
    * ``input_dist.ids``: to each block's position, from every other position, B int64
      lengths + B L P(b) int64 ids (column blocks get every id of their rows);
    * ``output_dist``: a block's position sends (S - 1) x [B, block cols] fp32 partials;
      ``output_dist.backward``: every other position sends [B, block cols] fp32 grads back;
    * ``grad_sync.replicate.*`` / ``grad_sync.data_parallel.*`` (fused optimizer, gradients
      synced every step): per group (the R replicas of sharded blocks; the W ranks for
      data-parallel tables) one all-gather of per-table counts, (g - 1) x 8 x tables; then
      per table the cheaper of a sparse all-gather, (g - 1) m (8 + 4 cols) with
      m = U(S B L, b) (U(B L, table) for data parallel), and a dense all-reduce,
      2 (g - 1) / g x rows (cols + 1) x 4 (``replica_sync.sync_bytes``, "auto" mode);
    * ``optim.row_sq_sum`` (row-wise Adagrad, blocks sharing rows with c > 1 column peers):
      all-reduce of U(W B L, b) fp32 row sums: 2 (c - 1) / c x 4 U.

    ``dense_ddp_estimate`` is separate (torch DDP, not dtrec). Returns the mean and max over
    ranks of the total, and the mean per kind (plus the id/length split of input_dist.ids).
    """
    s_size, replicas = shard_group_size, world // shard_group_size
    per_node = None if node_size is None else positions_per_node(world, s_size, node_size)
    axis = ShardAxis(s_size, replicas, per_node)
    topology = Topology(batch_size_per_rank=w.batch, default_pooling_factor=w.mean_bag)
    costs = [
        table_cost(
            EmbeddingBagConfig(f"t{t}", w.rows[t], w.dim),
            dtrec_spec(kind),
            axis,
            topology,
            row_probs(w.rows[t], w.zipf),
        )
        for t, kind in enumerate(kinds)
    ]
    sent = comm_by_kind(costs, axis)
    kinds_out = [k for k in sent if k not in ("input_dist.lengths", "input_dist.id_values")]
    total = sum(sent[k] for k in kinds_out) if kinds_out else np.zeros(s_size)
    return {
        "mean_total": float(np.mean(total)),
        "max_total": float(np.max(total)),
        "mean_by_kind": {k: float(np.mean(v)) for k, v in sorted(sent.items()) if v.any()},
    }
