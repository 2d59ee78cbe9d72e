"""The planner's dry run at scale, one process, no tensors: the mesh is built on torch's
fake process group, the tables are planned (``dtrec.planning.planner``) and the
per-rank memory, traffic and step time are printed and plotted::

    python -m dtrec.planner --config model.json --world-size 4096 \
        --shard-group-size 64 --node-size 8

``--shard-group-size auto`` (the default) first ranks every shard group size of the world
by the planner's predicted step (``dtrec.planning.mesh_choice``) and dry-runs the fastest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np
import torch.distributed as dist

from dtrec._torch_compat import init_fake_process_group
from dtrec.comm.qcomms import QCommsConfig
from dtrec.modules.config import EmbeddingBagConfig
from dtrec.modules.embedding import EmbeddingConfig
from dtrec.placements.mesh import init_mesh, shard_axis
from dtrec.planning.explain import describe_qcomms, explain
from dtrec.planning.mesh_choice import MAX_SIZES, rank_shard_group_sizes
from dtrec.planning.plan import ShardingPlan
from dtrec.planning.plan_step import PlanCandidate
from dtrec.planning.planner import plan_tables
from dtrec.planning.topology import Topology

TABLE_FIELDS = {
    "pooled": {"name", "num_embeddings", "embedding_dim", "feature_names", "pooling"},
    "sequence": {"name", "num_embeddings", "embedding_dim", "feature_names"},
}
"""The fields of a config table of each ``"kind"`` (besides ``kind`` itself)."""
TABLE_KINDS = {"pooled": EmbeddingBagConfig, "sequence": EmbeddingConfig}
CONFIG_KEYS = ("tables", "batch_size_per_rank", "pooling_factors", "qcomms")
"""The keys of a planner config JSON."""
QCOMMS_FIELDS = tuple(f.name for f in dataclasses.fields(QCommsConfig))
"""The keys of its ``"qcomms"`` object: ``dtrec.QCommsConfig``'s fields."""


def load_config(path: str) -> tuple[list[EmbeddingBagConfig | EmbeddingConfig], dict]:
    """A planner config JSON: tables, ``batch_size_per_rank``, ``pooling_factors``,
    ``qcomms``.

    A table is pooled (an ``EmbeddingBagCollection``'s) unless it says ``"kind":
    "sequence"`` (an ``EmbeddingCollection``'s: one output row per id, no pooling); a
    ``pooling_factors`` entry is then the feature's ids per sample (its sequence length).
    ``"qcomms"``: the ``dtrec.QCommsConfig`` the model will be distributed with, as an
    object of its fields (``{"forward_precision": "bf16", "replica_sync_precision":
    "fp16", ...}``), so the costs price those exchanges in their precisions.
    """
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("tables"), list):
        raise ValueError(f"{path}: expected {{'tables': [...], ...}}")
    unknown_keys = sorted(set(data) - set(CONFIG_KEYS))
    if unknown_keys:
        raise ValueError(
            f"{path}: unknown key(s) {unknown_keys}; a planner config has {list(CONFIG_KEYS)}"
        )
    tables: list[EmbeddingBagConfig | EmbeddingConfig] = []
    first_of: dict[str, int] = {}
    for i, entry in enumerate(data["tables"]):
        if not isinstance(entry, dict):
            raise ValueError(
                f'{path}: table #{i} must be an object {{"name": ..., "num_embeddings": ..., '
                f"...}}, got {entry!r}"
            )
        kind = entry.get("kind", "pooled")
        if kind not in TABLE_KINDS:
            raise ValueError(
                f"{path}: table #{i} has kind {kind!r}; expected one of {list(TABLE_KINDS)}"
            )
        fields = {k: v for k, v in entry.items() if k != "kind"}
        unknown = sorted(set(fields) - TABLE_FIELDS[kind])
        if kind == "sequence" and "pooling" in unknown:
            raise ValueError(
                f"{path}: table #{i} is a sequence table (one output row per id), so it "
                "takes no 'pooling'; drop the field, or make it a pooled table"
            )
        if unknown:
            raise ValueError(f"{path}: table #{i} has unknown fields {unknown}")
        cfg = TABLE_KINDS[kind](**fields)
        if cfg.name in first_of:
            raise ValueError(
                f"{path}: tables #{first_of[cfg.name]} and #{i} are both named {cfg.name!r}; "
                "the plan is keyed by table name, so names must be unique"
            )
        first_of[cfg.name] = i
        tables.append(cfg)
    options = {
        "batch_size_per_rank": int(data.get("batch_size_per_rank", 512)),
        "pooling_factors": {str(k): float(v) for k, v in data.get("pooling_factors", {}).items()},
        "qcomms": qcomms_from_json(path, data.get("qcomms")),
    }
    return tables, options


def qcomms_from_json(path: str, value: object) -> QCommsConfig | None:
    """The config's ``"qcomms"`` object as a ``QCommsConfig`` (absent or null: None, fp32);
    a ValueError naming the file for anything else."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(
            f'{path}: "qcomms" must be an object of QCommsConfig fields, e.g. '
            f'{{"forward_precision": "bf16", "backward_precision": "bf16", '
            f'"replica_sync_precision": "bf16"}}, got {value!r}'
        )
    unknown = sorted(set(value) - set(QCOMMS_FIELDS))
    if unknown:
        raise ValueError(
            f'{path}: "qcomms" has unknown field(s) {unknown}; its fields are {list(QCOMMS_FIELDS)}'
        )
    try:
        return QCommsConfig(**value)
    except ValueError as exc:
        raise ValueError(f'{path}: "qcomms": {exc}') from exc


def dry_run(
    tables: list[EmbeddingBagConfig | EmbeddingConfig],
    world_size: int,
    shard_group_size: int,
    node_size: int | None,
    topology: Topology,
    with_explanation: bool = False,
) -> dict:
    """Plan ``tables`` for a (S, R) mesh of ``world_size`` ranks built on torch's fake
    process group in this process; every table's blocks (no tensors) and the costs
    (``with_explanation``: also why each table got its spec, ``dtrec.planning.explain``)."""
    started = time.perf_counter()
    init_fake_process_group(rank=0, world_size=world_size)
    try:
        mesh = init_mesh("cpu", shard_group_size, node_size)
        axis = shard_axis(mesh)
    finally:
        dist.destroy_process_group()
    mesh_s = time.perf_counter() - started
    named = {cfg.name: cfg for cfg in tables}
    started = time.perf_counter()
    compared: list[PlanCandidate] = []
    choices, sums = plan_tables(named, axis, None, topology, compared)
    plan_s = time.perf_counter() - started
    blocks = {key: len(c.spec.layout(named[key], axis).blocks) for key, c in choices.items()}
    time_per_position = sums.time(axis, topology)
    return {
        "world_size": world_size,
        "shard_group_size": axis.size,
        "replicas": axis.replicas,
        "node_size": node_size,
        "plan": ShardingPlan({k: c.spec for k, c in choices.items()}),
        "blocks": blocks,
        "memory": sums.memory,
        "host_memory": sums.host_memory,
        "time": time_per_position,
        "shard_bytes": np.maximum(sums.shard_sent, sums.shard_received),
        "replicate_bytes": sums.replica_bytes,
        "world_bytes": sums.world_bytes,
        "mesh_seconds": mesh_s,
        "plan_seconds": plan_s,
        "sequence_tables": sum(isinstance(cfg, EmbeddingConfig) for cfg in tables),
        "qcomms": topology.qcomms,
        "compared": compared,
        "explanation": (
            explain(named, choices, axis, topology, compared) if with_explanation else None
        ),
    }


def _stats(values: np.ndarray, scale: float, unit: str) -> str:
    lo, mid, hi = (float(np.min(values)), float(np.median(values)), float(np.max(values)))
    return f"min {lo / scale:.2f} / median {mid / scale:.2f} / max {hi / scale:.2f} {unit}"


def print_dry_run(result: dict) -> None:
    plan = result["plan"]
    counts: dict[str, int] = {}
    for spec in plan.values():
        kind = type(spec).__name__ + ("+FS" if getattr(spec, "fully_sharded", False) else "")
        counts[kind] = counts.get(kind, 0) + 1
    print(
        f"W={result['world_size']} = S {result['shard_group_size']} x R {result['replicas']}"
        f" (node size {result['node_size']}): {len(plan)} tables "
        f"({result['sequence_tables']} sequence), {sum(result['blocks'].values())} blocks; "
        f"types {counts}"
    )
    print(f"mesh on the fake process group: {result['mesh_seconds']:.2f} s; "
          f"planning: {result['plan_seconds']:.2f} s")  # fmt: skip
    print(f"exchanges: {describe_qcomms(result['qcomms'])}")
    print(f"memory per rank:  {_stats(result['memory'], 2**30, 'GiB')}")
    if result["host_memory"].any():
        offloaded = sorted(k for k, spec in plan.items() if getattr(spec, "offloaded", False))
        print(f"host memory per rank (offloaded tables {offloaded}): "
              f"{_stats(result['host_memory'], 2**30, 'GiB')}")  # fmt: skip
    print(f"comm per rank per step, shard dim:     {_stats(result['shard_bytes'], 2**20, 'MiB')}")
    print(
        f"comm per rank per step, replicate dim: {_stats(result['replicate_bytes'], 2**20, 'MiB')}"
    )
    print(f"comm per rank per step, world (DP):    {_stats(result['world_bytes'], 2**20, 'MiB')}")
    t = result["time"]
    print(f"predicted step time: {1e3 * float(t.max()):.3f} ms (slowest rank), "
          f"imbalance {float(t.max() / t.mean()) if t.mean() > 0 else 1.0:.2f}")  # fmt: skip
    chosen = next((c for c in result["compared"] if c.chosen), None)
    if chosen is not None:
        print(
            f"with each collective call's latency: {1e3 * chosen.step.step:.3f} ms "
            f"({chosen.step.calls} calls, {chosen.step.comm_share:.0%} communication)"
        )


def plot_dry_run(result: dict, path: str) -> None:
    """Per shard position: memory and estimated time (every replica is the same)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    positions = np.arange(len(result["memory"]))
    top.bar(positions, result["memory"] / 2**30, width=1.0)
    top.set_ylabel("memory per rank (GiB)")
    bottom.bar(positions, 1e3 * result["time"], width=1.0, color="tab:orange")
    bottom.set_ylabel("est. step time (ms)")
    bottom.set_xlabel("shard position (each is R ranks)")
    fig.suptitle(
        f"dtrec plan: W={result['world_size']}, S={result['shard_group_size']}, "
        f"R={result['replicas']}, {len(result['plan'])} tables"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _shard_group_size(text: str) -> int | str:
    """``--shard-group-size``: "auto" or an int >= 1."""
    if text == "auto":
        return text
    try:
        size = int(text)
    except ValueError:
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an int >= 1, got {text!r}")
    return size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dtrec.planner",
        description="Plan a model's tables for a large 2D mesh in one process (a dry run).",
    )
    parser.add_argument(
        "--config",
        required=True,
        help='model JSON: {"tables": [{"name", "num_embeddings", "embedding_dim", '
        '"feature_names", "pooling"} or {..., "kind": "sequence"} (an EmbeddingCollection '
        'table: no pooling)], "batch_size_per_rank": int, "pooling_factors": {feature: ids '
        'per bag, or per sample for a sequence feature}, "qcomms": {"forward_precision", '
        '"backward_precision", "replica_sync_precision": "fp32" | "fp16" | "bf16", '
        '"forward_loss_scale", "backward_loss_scale"} (a dtrec.QCommsConfig; optional)}',
    )
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument(
        "--shard-group-size",
        type=_shard_group_size,
        default="auto",
        help="S, the ranks of one sharding group (R = W / S replica groups), or 'auto' (the "
        "default): plan every S that divides W (its powers of two and W itself when W has "
        f"more than {MAX_SIZES} divisors), print them ranked by predicted step, dry-run "
        "the fastest",
    )
    parser.add_argument("--node-size", type=int, default=None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--memory-per-rank-gb", type=float, default=None)
    parser.add_argument(
        "--host-memory-per-rank-gb",
        type=float,
        default=None,
        help="host memory a rank may fill with offloaded tables (the second tier): tables "
        "that do not fit the device budget are offloaded behind device caches",
    )
    parser.add_argument(
        "--zipf-exponent",
        type=float,
        default=None,
        help="id skew assumed for offloaded tables' cache hit rates (default 0: uniform)",
    )
    parser.add_argument("--plan-json", help="write the plan here")
    parser.add_argument(
        "--explain",
        action="store_true",
        help="print why each table got its spec: ids per sample, output rows (per id for "
        "sequence tables), bytes per collective, time split, the other candidates",
    )
    parser.add_argument("--png", default="dtrec_plan.png", help="per-rank plot ('' to skip)")
    args = parser.parse_args(argv)
    tables, options = load_config(args.config)
    base = Topology.h100 if args.device == "cuda" else Topology.cpu
    overrides: dict[str, object] = dict(options)
    if args.node_size is not None:
        overrides["node_size"] = args.node_size
    if args.memory_per_rank_gb is not None:
        overrides["memory_per_rank"] = args.memory_per_rank_gb * 1e9
    if args.host_memory_per_rank_gb is not None:
        overrides["host_memory_per_rank"] = args.host_memory_per_rank_gb * 1e9
    if args.zipf_exponent is not None:
        overrides["zipf_exponent"] = args.zipf_exponent
    topology = base(**overrides)
    size = args.shard_group_size
    if size == "auto":
        named = {cfg.name: cfg for cfg in tables}
        choice = rank_shard_group_sizes(named, args.world_size, args.node_size, topology)
        print("\n".join(choice.lines()))
        size = choice.shard_group_size
    result = dry_run(tables, args.world_size, size, args.node_size, topology, args.explain)
    print_dry_run(result)
    if args.explain:
        print(result["explanation"])
    if args.plan_json:
        with open(args.plan_json, "w") as f:
            f.write(result["plan"].to_json())
        print(f"wrote {args.plan_json}")
    if args.png:
        try:
            plot_dry_run(result, args.png)
            print(f"wrote {args.png}")
        except ImportError:
            print("matplotlib is not installed: no PNG (pip install matplotlib)")
