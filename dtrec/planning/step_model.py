"""A calibrated model of one training step on many GPUs: how long each collective takes on a
stated fabric, how long the lookups and the dense math take, and what overlaps.

Why: a user sizing a 256-GPU job needs the step time and whether 2D beats 1D before the
job exists. The inputs are the bytes and sizes one rank sends and computes per step (from
``benchmarks/scale/sim.py``, which runs dtrec's own exchanges on a mirror world); this
module turns them into seconds.

Collectives: NCCL's own tuning model (``src/graph/tuning.cc``, ``ncclTopoTuneModel`` and
``ncclTopoGetAlgoTime``): time = latency + bytes / bus bandwidth, the latency a base term
plus one hardware term per step (NVLink inside a node, the network across nodes), ring and
tree all-reduce, LL and Simple protocols, the fastest taken as NCCL does. All-to-all
(NCCL's grouped send/recv) pays one ring step's latency and moves the bytes that stay in
the node over NVLink and the rest over the rank's NIC at once.

Compute: calibrated on this project's H200 run (``benchmarks/results/gpu_step_h200_*.json``,
one GPU, the DLRM step of ``benchmarks/gpu_step.py``): the embedding part at the bandwidth
it reached there for the bytes it must move (``embedding_bytes``), the dense arch per
sample, the host's floor per step (that step was host-bound). H100: the HBM-bound parts
scaled by the copy bandwidth measured on each card.

Overlap, as ``dtrec.TrainPipeline`` runs it: the input dist of batch i+1 during batch i's
compute; the dense all-reduce buckets during the dense backward (DDP-style); the output
dist and the replica sync on the critical path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

COLLECTIVES = {
    "input_dist.header": ("shard", "all_to_all"),
    "input_dist.ids": ("shard", "all_to_all"),
    "input_dist.weights": ("shard", "all_to_all"),
    "output_dist": ("shard", "all_to_all"),
    "sequence_output_dist": ("shard", "all_to_all"),
    "optim.row_sq_sum": ("shard", "all_reduce"),
    "input_dist.verdict": ("replicate", "all_reduce"),
    "grad_sync.replicate.counts": ("replicate", "all_gather"),
    "grad_sync.replicate.sparse": ("replicate", "all_gather"),
    "grad_sync.replicate.dense": ("replicate", "all_reduce"),
    "grad_sync.data_parallel.counts": ("world", "all_gather"),
    "grad_sync.data_parallel.sparse": ("world", "all_gather"),
    "grad_sync.data_parallel.dense": ("world", "all_reduce"),
    "dense.grad_sync": ("world", "all_reduce"),
    "replica_sync.weights": ("replicate", "all_reduce"),
    "same_batch.gather": ("same_batch", "all_gather"),
    "same_batch.check": ("same_batch", "all_gather"),
    "same_batch.sizes": ("same_batch", "all_gather"),
    "replica_slices": ("replicate", "all_to_all"),  # fully sharded 2D's rows and grads
}
"""``comm_stats`` kind (or its prefix: ``output_dist.backward``) -> (mesh axis, pattern).
"same_batch": a ``distribute_module(..., same_batch=world["tp"])`` group (its pooled rows'
gather, ``DTREC_CHECK_SAME_BATCH``'s digests), sized by ``step_time``'s ``same_batch``."""

PHASES = {
    "input_dist": "input",
    "output_dist": "output",
    "sequence_output_dist": "output",
    "grad_sync": "sync",
    "optim": "sync",
    "dense": "dense",
    "replica_sync": "sync",
    "same_batch": "output",
    "replica_slices": "sync",
}
"""Kind prefix -> where the step spends it (``step_time``). A same_batch group's gather
waits on the output dist and the dense forward waits on it: on the critical path."""


def collective_of(kind: str) -> tuple[str, str]:
    """(mesh axis, pattern) of a ``comm_stats`` kind; a KeyError for one not known yet, so a
    new collective is priced on purpose, never silently."""
    parts = kind.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in COLLECTIVES:
            return COLLECTIVES[".".join(parts[:n])]
    raise KeyError(f"no pattern known for collective {kind!r}; add it to COLLECTIVES")


@dataclass(frozen=True)
class Fabric:
    """The links between GPUs (defaults: DGX H100-like nodes)."""

    node_size: int = 8
    """GPUs per node (NVLink domain)."""
    nvlink_bandwidth: float = 450e9 * 0.8
    """Bytes/s a GPU sends over NVLink: 450 GB/s per direction on H100 SXM (NVLink 4, 900
    GB/s total, NVIDIA H100 datasheet) times 0.8 for what NCCL reaches (an assumption in
    line with nccl-tests bus bandwidths on 8x H100)."""
    network_bandwidth: float = 50e9 * 0.9
    """Bytes/s a GPU sends to other nodes: one 400 Gb/s NDR InfiniBand NIC per GPU (8 per
    DGX H100 node) = 50 GB/s, times 0.9 for what NCCL reaches (assumption)."""
    base_latency: tuple[float, float, float, float] = (6.6e-6, 8.4e-6, 6.8e-6, 0.0)
    """NCCL baseLat (s): ring LL, ring Simple, tree LL, tree Simple (tuning.cc)."""
    nvlink_latency: tuple[float, float, float, float] = (0.47e-6, 3.4e-6, 0.52e-6, 28e-6)
    """NCCL hwLat[NVLINK] per step (s), same order."""
    network_latency: tuple[float, float, float, float] = (2.7e-6, 9.6e-6, 5.0e-6, 50e-6)
    """NCCL hwLat[NET] per step (s), same order."""
    max_tree_bandwidth: float = 80e9
    """NCCL caps a tree's bus bandwidth at 80 GB/s beyond 2 nodes (tuning.cc)."""

    def members_per_node(
        self, axis: str, shards: int, replicas: int, same_batch: int | None = None
    ) -> int:
        """Members of one ``axis`` group on a node, for the mesh ``arange(W).reshape(S, R)``
        (replica groups are contiguous ranks, sharding groups strided by R); a
        ``same_batch`` group of that many ranks is contiguous too (tp, the innermost dim of
        a torchtitan world mesh)."""
        sizes = {"shard": shards, "replicate": replicas, "world": shards * replicas}
        size = _same_batch_size(same_batch) if axis == "same_batch" else sizes[axis]
        stride = replicas if axis == "shard" else 1
        return max(1, min(size, self.node_size // stride))


def _same_batch_size(same_batch: int | None) -> int:
    """The ranks of a same_batch group, or a ValueError when a step that has its collectives
    was priced without it (a size of 1 would price them at nothing)."""
    if same_batch is None:
        raise ValueError(
            "the step has same_batch collectives (distribute_module(..., same_batch=...)): "
            "pass step_time(..., same_batch=<ranks of a same_batch group, e.g. the tp size>)"
        )
    return same_batch


def collective_time(
    pattern: str, sent: float, calls: float, size: int, per_node: int, fabric: Fabric
) -> float:
    """Seconds for ``calls`` collectives of ``pattern`` over a group of ``size`` ranks,
    ``per_node`` of them per node, in which this rank sends ``sent`` bytes in all (as
    ``comm_stats`` counts them: ``2 (n-1)/n`` of the buffer for an all-reduce, ``n - 1``
    inputs for an all-gather, the chunks to other ranks for an all-to-all)."""
    if size <= 1 or calls <= 0:
        return 0.0
    nodes = max(1, math.ceil(size / per_node))
    bus = fabric.network_bandwidth if nodes > 1 else fabric.nvlink_bandwidth
    each = sent / calls
    if pattern == "all_to_all":
        lat = fabric.base_latency[1] + (
            fabric.network_latency[1] if nodes > 1 else fabric.nvlink_latency[1]
        )
        off_node = (size - per_node) / (size - 1)
        move = max(each * (1 - off_node) / fabric.nvlink_bandwidth, each * off_node / bus)
        return calls * (lat + move)
    if pattern == "all_gather":
        steps, inter = size - 1, nodes - 1
        options = [_ring(fabric, p, steps, inter, nodes, each, bus) for p in (0, 1)]
        return calls * min(options)
    if pattern != "all_reduce":
        raise ValueError(f"unknown collective pattern {pattern!r}")
    steps, inter = 2 * (size - 1), 2 * (nodes - 1)
    options = [_ring(fabric, p, steps, inter, nodes, each, bus) for p in (0, 1)]
    buffer = each * size / (2 * (size - 1))
    for p in (0, 1):  # tree: 2 x (intra-node chain + log2(nodes) network hops)
        intra = (fabric.nvlink_latency[2 + p]) * (1.8 if nodes > 1 and p == 0 else 1.0)
        lat = fabric.base_latency[2 + p] + 2 * (
            (per_node - 1) * intra + math.log2(nodes) * fabric.network_latency[2 + p]
        )
        cap = fabric.max_tree_bandwidth if nodes > 2 else 110e9
        tree_bw = min(bus * 0.9, cap) * (1 / 3.8 if p == 0 else 1.0)
        options.append(lat + 2 * buffer / tree_bw)
    return calls * min(options)


def _ring(fabric: Fabric, p: int, steps: int, inter: int, nodes: int, each: float, bus: float):
    """One ring collective, protocol ``p`` (0: LL at a quarter of the bandwidth, 1: Simple)."""
    intra = fabric.nvlink_latency[p] * (1.8 if nodes > 1 and p == 0 else 1.0)
    lat = fabric.base_latency[p] + (steps - inter) * intra + inter * fabric.network_latency[p]
    return lat + each / (bus * (0.25 if p == 0 else 1.0))


@dataclass(frozen=True)
class Device:
    """One GPU's compute, calibrated from a measured one-GPU step (``calibrate``)."""

    name: str
    embedding_bandwidth: float
    """Bytes/s the embedding forward + backward + fused update reach (``embedding_bytes``)."""
    dense_per_sample: float
    """Seconds of dense forward + backward per sample (backward = 2 x forward)."""
    dense_optimizer: float
    """Seconds per step of the dense optimizer."""
    host_floor: float
    """Seconds per step the host needs to issue it (a step is never faster)."""
    copy_bandwidth: float
    """Bytes/s of a device-to-device copy on this card (what scales HBM-bound parts)."""


def calibrate(gpu_step: dict, name: str = "H200") -> Device:
    """The ``Device`` of a ``benchmarks/gpu_step.py`` report: embedding bandwidth from its
    largest multi-hot batch (device-bound), dense time per sample from that batch's dense
    forward, optimizer from its fastest config, host floor from its smallest multi-hot
    batch's step (host-bound: the device was busy 5.1 of its 7.4 ms)."""
    results = gpu_step["results"]
    multi = sorted(
        (int(k.split("_")[0][1:]), k) for k in results if k.endswith("multi_hot")
    )  # fmt: skip
    small, large = multi[0], multi[-1]
    big = results[large[1]]["dtrec"]
    runs = [r for r in results.values() if "dtrec" in r]
    return Device(
        name=name,
        embedding_bandwidth=big["embedding"]["bytes"] / big["embedding"]["fwd_bwd_update_s"],
        dense_per_sample=3 * big["stages"]["device_s"]["dense_fwd"] / large[0],
        dense_optimizer=min(r["dtrec"]["stages"]["device_s"]["optimizers"] for r in runs),
        host_floor=results[small[1]]["dtrec"]["step_s"],
        copy_bandwidth=gpu_step["meta"]["copy_GBps"] * 1e9,
    )


def scaled(device: Device, name: str, copy_bandwidth: float) -> Device:
    """``device`` on another card of the same architecture: HBM-bound embedding work scaled by
    the cards' copy bandwidths; dense math (same SMs) and host floor unchanged."""
    ratio = copy_bandwidth / device.copy_bandwidth
    return replace(
        device,
        name=name,
        embedding_bandwidth=device.embedding_bandwidth * ratio,
        copy_bandwidth=copy_bandwidth,
    )


def embedding_bytes(
    looked_up: float, ids: float, bags: float, pooled: float, updated: float, rows: float
) -> float:
    """Bytes the embedding part moves at least, as ``benchmarks/gpu_step.embedding_bytes``
    counts them: forward reads each id's row (``looked_up`` elements), its id and the bag
    offsets and writes the ``pooled`` partials; backward reads the partials' gradient and
    the ids again and reads + writes each touched row (``updated`` elements) and its
    row-wise Adagrad state."""
    return looked_up * 4 + ids * 8 + bags * 8 + pooled * 4 + pooled * 4 + ids * 8 + (
        updated * 8 + rows * 8
    )  # fmt: skip


@dataclass
class StepTime:
    """Predicted seconds of one rank's step and where they go."""

    step: float
    embedding: float
    dense: float
    comm: dict[str, float]
    """Kind -> seconds of its collectives."""
    exposed_comm: float
    """Communication seconds not hidden behind compute."""
    host_bound: bool

    @property
    def comm_total(self) -> float:
        return sum(self.comm.values())

    @property
    def comm_share(self) -> float:
        """Share of the step spent waiting on communication."""
        return self.exposed_comm / self.step if self.step > 0 else 0.0


def step_time(
    comm: dict[str, dict[str, float]],
    shards: int,
    replicas: int,
    batch: int,
    embedding_bytes_moved: float,
    device: Device,
    fabric: Fabric,
    same_batch: int | None = None,
) -> StepTime:
    """One rank's step from its per-kind ``comm`` ({"calls", "bytes"} per step, as
    ``comm_stats().per_step()``), its embedding bytes and its batch (module docstring).
    ``same_batch``: the ranks of the model's same_batch group (``distribute_module``), if
    ``comm`` has its kinds (``same_batch.*``; ValueError without it)."""
    seconds: dict[str, float] = {}
    sizes = {"shard": shards, "replicate": replicas, "world": shards * replicas}
    for kind, v in comm.items():
        axis, pattern = collective_of(kind)
        size = _same_batch_size(same_batch) if axis == "same_batch" else sizes[axis]
        per_node = fabric.members_per_node(axis, shards, replicas, same_batch)
        seconds[kind] = collective_time(pattern, v["bytes"], v["calls"], size, per_node, fabric)
    phase = {"input": 0.0, "output": 0.0, "sync": 0.0, "dense": 0.0}
    for kind, t in seconds.items():
        phase[PHASES[kind.split(".")[0]]] += t
    emb = embedding_bytes_moved / device.embedding_bandwidth
    dense = batch * device.dense_per_sample
    compute = emb + dense + device.dense_optimizer
    exposed = (
        phase["output"]
        + phase["sync"]
        + max(0.0, phase["dense"] - dense * 2 / 3)  # buckets during the dense backward
        + max(0.0, phase["input"] - compute)  # next batch's input dist during this one
    )
    busy = compute + exposed
    step = max(device.host_floor, busy)
    return StepTime(step, emb, dense, seconds, exposed, device.host_floor >= busy)
