"""Why the planner chose each table's spec: the numbers the cost model used.

Per table (``python -m dtrec.planner --explain``): its kind, shape and the ids per sample
the cost model assumed; the output rows one rank's batch makes per step (pooled: one per
sample and feature, however many ids a bag has; sequence: one per id, so a sequence
table's output-dist bytes grow with its ids, not only with the batch); the chosen spec's
bytes per collective kind and its slowest position's time split into HBM, shard-axis
and replicate-axis parts; for a sequence table, what the same table pooled would send;
and the candidates it beat. An offloaded table also gets its cache: rows, expected hit
rate (and the id distribution assumed), host <-> device bytes, and why it was offloaded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from dtrec.comm.qcomms import QCommsConfig
from dtrec.modules.config import EmbeddingBagConfig
from dtrec.modules.embedding import EmbeddingConfig
from dtrec.placements.mesh import ShardAxis
from dtrec.planning.cost_model import (
    HBM,
    HOST_LINK,
    RECEIVED_INTER,
    RECEIVED_INTRA,
    REPLICA,
    SENT_INTER,
    SENT_INTRA,
    WORLD,
    Topology,
    step_time,
    table_cost,
    table_ids,
)
from dtrec.planning.offload import block_ids_per_step, expected_misses, row_buckets
from dtrec.planning.plan_step import PlanCandidate, candidate_lines, plan_step
from dtrec.planning.planner import collection_of
from dtrec.planning.search import Choice

TIME_PARTS = {
    "HBM": (HBM,),
    "shard axis": (SENT_INTRA, RECEIVED_INTRA, SENT_INTER, RECEIVED_INTER),
    "replicate axis": (REPLICA, WORLD),
    "host link": (HOST_LINK,),
}
"""The step time's terms, by the ``cost_model`` rows they read."""

SHOWN_CANDIDATES = 4


def time_parts(stack: np.ndarray, axis: ShardAxis, topology: Topology) -> dict[str, np.ndarray]:
    """Seconds per position of each ``TIME_PARTS`` term (they add up to ``step_time``)."""
    parts = {}
    for name, rows in TIME_PARTS.items():
        only = np.zeros_like(stack)
        only[list(rows)] = stack[list(rows)]
        parts[name] = step_time(only, axis, topology)
    return parts


def output_rows(cfg: EmbeddingBagConfig | EmbeddingConfig, topology: Topology) -> str:
    """The output rows one rank's batch makes per step, and why that many."""
    batch, ids = topology.batch_size_per_rank, topology.pooling(cfg)
    features = len(cfg.feature_names)
    if isinstance(cfg, EmbeddingConfig):
        return (
            f"{batch} samples x {ids:g} ids = {batch * ids:g} rows of {cfg.embedding_dim} "
            f"(one per id: grows with the ids; pooled it would be {batch} x {features} "
            f"feature(s) = {batch * features} rows)"
        )
    return (
        f"{batch} samples x {features} feature(s) = {batch * features} rows of "
        f"{cfg.embedding_dim} (pooled: the same for any ids per bag, here {ids:g})"
    )


def describe_qcomms(qcomms: QCommsConfig | Mapping[str, QCommsConfig | None] | None) -> str:
    """The precisions the costs price each quantizable exchange in, in one line."""
    if isinstance(qcomms, Mapping):
        per = "; ".join(f"{fqn!r}: {describe_qcomms(c)}" for fqn, c in sorted(qcomms.items()))
        return f"per collection ({per}; any other: fp32)"
    if qcomms is None:
        return "all fp32 (no qcomms)"
    return (
        f"output dist forward {qcomms.forward_precision}, backward "
        f"{qcomms.backward_precision}; replicate-axis gradient sum "
        f"{qcomms.replica_sync_precision}; data-parallel world sum fp32"
    )


def _mib(values: np.ndarray) -> str:
    return f"{float(np.max(values)) / 2**20:.3f} MiB"


def explain_table(
    key: str,
    cfg: EmbeddingBagConfig | EmbeddingConfig,
    choice: Choice,
    axis: ShardAxis,
    topology: Topology,
) -> list[str]:
    """The lines ``--explain`` prints for one table (see the module doc)."""
    sequence = isinstance(cfg, EmbeddingConfig)
    kind = "sequence" if sequence else f"pooled ({cfg.pooling})"
    topology = topology.for_collection(collection_of(key, cfg))
    cost = table_cost(cfg, choice.spec, axis, topology)
    time = step_time(cost.stack, axis, topology)
    slowest = int(np.argmax(time))
    parts = time_parts(cost.stack, axis, topology)
    split = " + ".join(f"{name} {1e3 * float(t[slowest]):.4f}" for name, t in parts.items())
    sent = ", ".join(f"{k} {_mib(v)}" for k, v in sorted((cost.comm or {}).items()))
    lines = [
        f"{key}: {choice.spec}  [{kind} table, {cfg.num_embeddings} x {cfg.embedding_dim}, "
        f"features {list(cfg.feature_names)}, {topology.pooling(cfg):g} ids/sample]",
        f"  output rows per rank per step: {output_rows(cfg, topology)}",
        f"  chosen: {1e3 * float(time[slowest]):.4f} ms on its slowest position {slowest} "
        f"= {split} ms; memory {_mib(cost.memory)} on the fullest",
        f"  bytes sent per step (each kind at its busiest position): {sent or 'none'}",
    ]
    layout = choice.spec.layout(cfg, axis)
    if layout.offloaded:
        lines.append(offload_line(cfg, layout, axis, topology, cost.host_memory))
    if choice.why:
        lines.append(f"  why: {choice.why}")
    if sequence:
        pooled = EmbeddingBagConfig(
            cfg.name, cfg.num_embeddings, cfg.embedding_dim, list(cfg.feature_names)
        )
        as_bag = table_cost(pooled, choice.spec, axis, topology).comm or {}
        if "output_dist" in as_bag:
            rows = (cost.comm or {})["sequence_output_dist"]
            lines.append(
                f"  sequence_output_dist {_mib(rows)} vs {_mib(as_bag['output_dist'])} "
                "if the same table were pooled"
            )
    # Alone, a table's calls are not its own (a plan's tables share them): no latency here,
    # as in the search; the plan line adds it.
    bytes_only = topology.without_latency()
    ranked = sorted(
        ((s, plan_step([c], axis, bytes_only), float(c.memory.max())) for s, c in choice.costs),
        key=lambda o: (o[0] != choice.spec, o[1].step, o[2]),
    )
    shown = ", ".join(
        f"{s} {1e3 * t.step:.4f} ms ({t.comm_share:.0%} comm) {m / 2**20:.1f} MiB"
        for s, t, m in ranked[1:][:SHOWN_CANDIDATES]
    )
    more = len(ranked) - 1 - SHOWN_CANDIDATES
    lines.append(
        f"  other candidates (alone: predicted ms, communication share, max MiB): "
        f"{shown or 'none'}" + (f", +{more} more" if more > 0 else "")
    )
    return lines


def offload_line(
    cfg: EmbeddingBagConfig | EmbeddingConfig,
    layout: object,
    axis: ShardAxis,
    topology: Topology,
    host_memory: np.ndarray,
) -> str:
    """An offloaded table's cache: its size, expected hit rate and the assumption behind it."""
    ids = table_ids(cfg, topology)
    per_step = block_ids_per_step(cfg, axis, topology)
    # fully sharded: caches of owner slices (1/R of a block's rows, its reads): priced as
    # the block with R times the cache (``cost_model._offloaded_slice``)
    r = axis.replicas if layout.replica_sliced else 1  # type: ignore[attr-defined]
    read = missed = 0.0
    for block, rows in zip(layout.blocks, layout.cache_rows, strict=True):  # type: ignore[attr-defined]
        rows = min(rows, -(-block.num_rows // r))
        got, m = expected_misses(*row_buckets(ids, *block.rows), per_step, rows * r)
        read, missed = read + got / r, missed + m / r
    blocks = layout.blocks  # type: ignore[attr-defined]
    share = max(
        min(c, -(-b.num_rows // r)) / -(-b.num_rows // r)
        for c, b in zip(layout.cache_rows, blocks, strict=True)  # type: ignore[attr-defined]
    )
    whose = "an owner slice" if r > 1 else "a block"
    assumed = (
        f"Zipf({topology.zipf_exponent:g}) ids, hot rows scattered over the blocks"
        if topology.zipf_exponent > 0
        else "uniform ids"
    )
    hit = 1.0 - missed / read if read else 1.0
    return (
        f"  offloaded: blocks in host memory ({_mib(host_memory)} on the fullest rank), device "
        f"caches of {max(layout.cache_rows)} rows (up to {100 * share:.2f}% of {whose}); "  # type: ignore[attr-defined]
        f"expected hit rate {100 * hit:.1f}% of the distinct rows a step reads (LRU, Che's "
        f"approximation, {assumed}): {missed:.0f} rows copied in (and out) per step over all "
        "blocks"
    )


def explain(
    tables: Mapping[str, EmbeddingBagConfig | EmbeddingConfig],
    choices: Mapping[str, Choice],
    axis: ShardAxis,
    topology: Topology,
    compared: Sequence[PlanCandidate] = (),
) -> str:
    """The plan's predicted step and communication share (``plan_line``), the whole plans
    the planner compared (``compared``, from ``plan_tables(..., compared=)``), then every
    table's ``explain_table`` lines, in the tables' order."""
    lines = [
        plan_line(tables, choices, axis, topology),
        *candidate_lines(compared),
        f"why each spec (batch {topology.batch_size_per_rank} per rank; times in ms per step "
        "of the table alone; the planner also weighs the other tables on each position; "
        f"exchanges: {describe_qcomms(topology.qcomms)}):",
    ]
    for key, cfg in tables.items():
        lines += explain_table(key, cfg, choices[key], axis, topology)
    return "\n".join(lines)


def plan_line(
    tables: Mapping[str, EmbeddingBagConfig | EmbeddingConfig],
    choices: Mapping[str, Choice],
    axis: ShardAxis,
    topology: Topology,
) -> str:
    """The whole plan's predicted step (``plan_step``: its slowest position, plus
    ``Topology.call_latency`` per collective call) and the share of it spent on
    communication (the shard and replicate axes' terms and the calls)."""
    costs = [
        table_cost(cfg, choices[key].spec, axis, topology.for_collection(collection_of(key, cfg)))
        for key, cfg in tables.items()
    ]
    if not costs:
        return "plan: no tables"
    step = plan_step(costs, axis, topology)
    return (
        f"plan: predicted step {1e3 * step.step:.6g} ms (embedding part, slowest position "
        f"{step.position}), communication {1e3 * step.comm:.6g} ms = {step.comm_share:.2f} of "
        f"it ({step.calls} collective calls, their latency included)"
    )


__all__ = ["describe_qcomms", "explain", "explain_table", "output_rows", "plan_line", "time_parts"]
