"""The hardware and workload a plan is costed for: ``Topology`` (defaults: H100 nodes of 8).

Bandwidths, memory per rank, node size, batch and pooling factors, the optimizer, what a
collective call costs beyond its bytes, and the quantized-communication precisions
(``QCommsConfig``, per collection or for all); checked when built. ``cost_model`` prices
tables on it, ``plan_step`` adds the calls.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from dtrec.comm.qcomms import QCommsConfig
from dtrec.interop.qcomms import as_qcomms_config
from dtrec.modules.config import EmbeddingBagConfig
from dtrec.planning.step_model import Fabric, collective_time

# Optimizer state bytes: (per row, per element).
OPTIMIZER_STATE = {"sgd": (0, 0), "rowwise_adagrad": (4, 0), "adam": (0, 8)}
PRECISION_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
"""Bytes per element of each ``QCommsConfig`` precision."""
HOST_CALL_SECONDS = 20e-6
"""Host time of one ``torch.distributed`` collective call on CUDA (an assumption, not
measured here): Python dispatch into c10d, ``ProcessGroupNCCL``'s work object, stream
events and the NCCL kernel launch cost roughly 10-30 us a call; 20 us is the middle. It is
paid in full when the step is host-bound, as the H200 run's was (``step_model``)."""


@dataclass(frozen=True)
class Topology:
    """The hardware and workload the planner plans for (defaults: H100 nodes of 8)."""

    device: str = "cuda"
    memory_per_rank: float = 80e9
    """Bytes a rank may hold (HBM; DRAM per rank on CPU)."""
    hbm_bandwidth: float = 3.0e12
    """Bytes/s of a rank's memory."""
    intra_node_bandwidth: float = Fabric.nvlink_bandwidth
    """Bytes/s a rank sends or receives over the links inside its node (NVLink): the scale
    model's (``dtrec.planning.step_model.Fabric``, 450 GB/s per direction x 0.8)."""
    inter_node_bandwidth: float = Fabric.network_bandwidth
    """Bytes/s a rank sends or receives to other nodes (one 400 Gb/s NIC per GPU, x 0.9):
    the scale model's."""
    replica_bandwidth: float | None = None
    """Bytes/s of the replicate-axis and data-parallel gradient sums (all-gathers,
    all-reduces) where measured apart from the shard axis's all-to-all (gloo on one host:
    about a third of it); None: the link the group spans (``cost_model.link_bandwidth``)."""
    collective_latency: float = 0.0
    """Seconds one collective call costs beyond its bytes: 0 for the per-table search
    (every table shares a plan's calls); what ``plan_step`` adds per call (gloo ranks
    sharing cores: a few ms, measured by ``benchmarks/probes/cpu_calibration.py``; H100:
    the host's ``HOST_CALL_SECONDS``, ``fabric`` adding NCCL's): the all-to-all's, and
    every call's where ``reduce_latency`` / ``gather_latency`` is None."""
    reduce_latency: float | None = None
    """Seconds per all-reduce call where it differs from an all-to-all's (gloo on 2 shared
    cores: about 1.5x, measured); None: ``collective_latency``."""
    gather_latency: float | None = None
    """Seconds per all-gather call, likewise; None: ``collective_latency``."""
    fabric: Fabric | None = None
    """NCCL's latency model (``step_model.Fabric``: tuning.cc's baseLat and hwLat), whose
    zero-byte ``collective_time`` of its op over its group a call pays on top of the
    latencies above: it grows with the group and the nodes it spans, which ``plan_step``
    knows per call (ranks per node from ``node_size``; the fabric's own is not read).
    None (the default, and on CPU): the latencies above only."""
    node_size: int = 8
    batch_size_per_rank: int = 512
    pooling_factors: Mapping[str, float] = field(default_factory=dict)
    """Mean ids per bag per feature; features not named use ``default_pooling_factor``."""
    default_pooling_factor: float = 1.0
    optimizer: str = "rowwise_adagrad"
    """Fused optimizer state to budget: "sgd", "rowwise_adagrad" or "adam"."""
    synced_update_factor: float = 2.0
    """Backward + update cost of a block whose gradient is synced first (replicas, column
    peers, data-parallel) relative to the one-pass fused path: row gradients are written
    out and read back (2x on GPU); on CPU the synced path is torch code and the one-pass
    path fbgemm's C++ (4.5x measured: 13.7 vs 3.0 ms for 8 tables, 82k ids, one rank)."""
    id_cost_bytes: float = 0.0
    """Memory bytes each looked-up id costs besides its row, as time at ``hbm_bandwidth``
    (reading, sorting and scattering it): 0 prices bytes only; on CPU, where a lookup's
    index work is as slow as its rows, measured (``benchmarks/probes/cpu_calibration.py``)."""
    row_cost_bytes: float = 0.0
    """The same for each row an update writes (its optimizer bookkeeping): 0 or measured."""
    memory_headroom: float = 0.1
    """Fraction of ``memory_per_rank`` left for activations and the dense model."""
    host_memory_per_rank: float = 0.0
    """Bytes of host memory a rank may hold for offloaded tables (pinned, on CUDA): the
    second tier. 0 (the default): the planner never offloads; > 0: tables that do not fit
    the device budget live there behind device caches (``RowWise(cache_rows=...)``)."""
    host_bandwidth: float = 50e9
    """Bytes/s a rank copies between host memory and its device, each way (PCIe Gen5 x16):
    what an offloaded table's cache misses and write-backs cost."""
    zipf_exponent: float = 0.0
    """The id skew the planner assumes for an offloaded table's cache hit rate: ids
    Zipf(s) over the table's rows, hot rows scattered over its blocks (hashed ids). 0: uniform
    (a cache of a fraction f of the rows hits a fraction f: the pessimistic default)."""
    bytes_per_element: int = 4
    id_distributions: Mapping[str, object] = field(default_factory=dict)
    """Table FQN -> where its ids fall (an ``IdDistribution``: ``mass(start, end)`` and
    ``unique(n, start, end)``), e.g. the ``CountedIds`` that ``dtrec.IdCounters`` measured
    (``IdCounters.topology``); tables not named assume ``zipf_exponent``'s spread. Each
    collection's table costs read their own (``for_collection``)."""
    qcomms: QCommsConfig | Mapping[str, QCommsConfig | None] | None = None
    """Precisions of the collections' exchanges, as ``distribute_module(qcomms=)`` takes
    them: one config (dtrec's or TorchRec's), a dict by collection FQN (collections it
    does not name: fp32), or None (fp32). They price the output dist forward and backward
    and the replicate-axis gradient sum of sharded tables (data-parallel tables' world
    sum is fp32 in any case); loss scales cost nothing."""

    def __post_init__(self) -> None:
        if isinstance(self.qcomms, Mapping):
            per_collection = {
                fqn: as_qcomms_config(config, f"Topology.qcomms[{fqn!r}]")
                for fqn, config in self.qcomms.items()
            }
            object.__setattr__(self, "qcomms", per_collection)
        else:
            object.__setattr__(self, "qcomms", as_qcomms_config(self.qcomms, "Topology.qcomms"))
        if self.optimizer not in OPTIMIZER_STATE:
            raise ValueError(
                f"Topology.optimizer must be one of {sorted(OPTIMIZER_STATE)}, "
                f"got {self.optimizer!r}"
            )
        for name in _POSITIVE_NUMBERS:
            _check_number(f"Topology.{name}", getattr(self, name), positive=True)
        for name in ("node_size", "batch_size_per_rank", "bytes_per_element"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"Topology.{name} must be an int >= 1, got {value!r}")
        _check_number("Topology.default_pooling_factor", self.default_pooling_factor)
        if not isinstance(self.pooling_factors, Mapping):
            raise TypeError(
                f"Topology.pooling_factors must be a mapping feature -> ids per bag, got "
                f"{type(self.pooling_factors).__name__}"
            )
        for feature, factor in self.pooling_factors.items():
            _check_number(f"Topology.pooling_factors[{feature!r}]", factor)
        _check_number("Topology.memory_headroom", self.memory_headroom)
        _check_number("Topology.host_memory_per_rank", self.host_memory_per_rank)
        _check_number("Topology.zipf_exponent", self.zipf_exponent)
        _check_number("Topology.collective_latency", self.collective_latency)
        _check_number("Topology.id_cost_bytes", self.id_cost_bytes)
        if not isinstance(self.id_distributions, Mapping) or not all(
            hasattr(d, "mass") and hasattr(d, "unique") for d in self.id_distributions.values()
        ):
            raise TypeError(
                "Topology.id_distributions must map table FQNs to id distributions (with "
                "mass(start, end) and unique(n, start, end)), e.g. IdCounters.topology()'s"
            )
        _check_number("Topology.row_cost_bytes", self.row_cost_bytes)
        for name in ("reduce_latency", "gather_latency"):
            if getattr(self, name) is not None:
                _check_number(f"Topology.{name}", getattr(self, name))
        if self.fabric is not None and not isinstance(self.fabric, Fabric):
            raise TypeError(
                f"Topology.fabric must be a dtrec.planning.step_model.Fabric or None, got "
                f"{self.fabric!r}"
            )
        if self.replica_bandwidth is not None:
            _check_number("Topology.replica_bandwidth", self.replica_bandwidth, positive=True)
        if self.memory_headroom >= 1:
            raise ValueError(
                f"Topology.memory_headroom is a fraction in [0, 1), got {self.memory_headroom}"
            )

    @classmethod
    def h100(cls, **overrides: object) -> Topology:
        """An H100 80 GB per rank, 8 per node, NVLink and one 400 Gb/s NIC per GPU at the
        bandwidths the scale model uses (``step_model.Fabric``: 360 and 45 GB/s), and its
        calls at the scale model's NCCL latencies plus ``HOST_CALL_SECONDS`` each (an
        all-to-all inside a node: 20 + 11.8 us; across nodes 20 + 18 us)."""
        values: dict[str, object] = {
            "collective_latency": HOST_CALL_SECONDS,
            "fabric": Fabric(),
        }
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def cpu(cls, **overrides: object) -> Topology:
        """This kind of machine: gloo ranks sharing one host's DRAM and loopback (memory
        per rank: the host's RAM over ``LOCAL_WORLD_SIZE``, as torchrun sets it)."""
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):
            ram = 16e9
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        values: dict[str, object] = {
            "device": "cpu",
            "memory_per_rank": ram / local,
            "hbm_bandwidth": 10e9,
            "intra_node_bandwidth": 2e9,
            "inter_node_bandwidth": 2e9,
            "node_size": 1 << 20,
            "synced_update_factor": 4.5,
            "host_bandwidth": 10e9,
        }
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]

    def call_latency(self, op: str, size: int | None = None, per_node: int | None = None) -> float:
        """Seconds one call of ``op`` ("all_to_all", "all_reduce", "all_gather") costs
        beyond its bytes, over a group of ``size`` ranks, ``per_node`` of them per node
        (what ``fabric`` prices; default: one node's ranks, ``node_size``).

        Example::

            Topology.h100().call_latency("all_to_all", size=64, per_node=8)  # 38 us
        """
        own = {"all_reduce": self.reduce_latency, "all_gather": self.gather_latency}.get(op)
        flat = self.collective_latency if own is None else own
        if self.fabric is None:
            return flat
        size = self.node_size if size is None else size
        per_node = min(size, self.node_size) if per_node is None else per_node
        return flat + collective_time(op, 0.0, 1, size, per_node, self.fabric)

    def without_latency(self) -> Topology:
        """This topology with free calls (the per-table search's pricing)."""
        return replace(
            self, collective_latency=0.0, reduce_latency=None, gather_latency=None, fabric=None
        )

    @property
    def memory_budget(self) -> float:
        return self.memory_per_rank * (1.0 - self.memory_headroom)

    @property
    def host_budget(self) -> float:
        """Host memory a rank may fill with offloaded blocks (no headroom: it holds only them)."""
        return self.host_memory_per_rank

    def for_collection(self, fqn: str) -> Topology:
        """The topology a table of collection ``fqn`` is priced with: ``qcomms`` given per
        collection resolved to ``fqn``'s config (fp32 where it names none), and
        ``id_distributions`` narrowed to ``fqn``'s tables, keyed by table name (what
        ``cost_model.table_ids`` looks up)."""
        out = self
        if isinstance(self.qcomms, Mapping):
            out = replace(out, qcomms=self.qcomms.get(fqn))
        if self.id_distributions:
            prefix = f"{fqn}." if fqn else ""
            own = {
                key[len(prefix) :]: d
                for key, d in self.id_distributions.items()
                if key.startswith(prefix) and "." not in key[len(prefix) :]
            }
            out = replace(out, id_distributions=own)
        return out

    def output_dist_bytes(self) -> tuple[int, int]:
        """Bytes per element the output dist sends forward and backward (``qcomms``)."""
        qcomms = self._one_qcomms()
        if qcomms is None:
            return 4, 4
        return PRECISION_BYTES[qcomms.forward_precision], PRECISION_BYTES[qcomms.backward_precision]

    def replica_sync_bytes(self) -> int:
        """Bytes per gradient element the replicate-axis sum sends (``qcomms``)."""
        qcomms = self._one_qcomms()
        return 4 if qcomms is None else PRECISION_BYTES[qcomms.replica_sync_precision]

    def _one_qcomms(self) -> QCommsConfig | None:
        if isinstance(self.qcomms, Mapping):
            raise ValueError(
                f"Topology.qcomms is given per collection ({sorted(self.qcomms)}), so a "
                "table's costs depend on its collection: price it with "
                "topology.for_collection(fqn)"
            )
        return self.qcomms

    def pooling(self, cfg: EmbeddingBagConfig) -> float:
        """Ids per sample the table receives (summed over its features)."""
        return sum(
            self.pooling_factors.get(f, self.default_pooling_factor) for f in cfg.feature_names
        )


_POSITIVE_NUMBERS = (
    "memory_per_rank",
    "hbm_bandwidth",
    "intra_node_bandwidth",
    "inter_node_bandwidth",
    "synced_update_factor",
    "host_bandwidth",
)


def _check_number(name: str, value: object, positive: bool = False) -> None:
    """A finite real number, > 0 (``positive``) or >= 0: TypeError / ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        want = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {want}, got {value}")
