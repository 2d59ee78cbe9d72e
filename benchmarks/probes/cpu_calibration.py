"""The constants a CPU / gloo step prediction needs, measured in the run that is predicted.

Why: a step model is only checked against a measured step if its constants come from the
same machine, at the same time, under the same contention (4 gloo ranks sharing 2 cores
run every kernel at about half speed). So every rank of one world measures at once:

* collectives: the seconds one call costs beyond its bytes (``latency``: back-to-back
  all-to-alls of a few bytes) and the bytes per second a rank sends in an all-to-all and
  in an all-gather of about 1 MB per peer (``a2a_bandwidth``, ``gather_bandwidth``);
* embedding: a forward lookup (Zipf ids over 2 tables, D = 64) and its backward + fused
  row-wise Adagrad update, one pass (the implementation ``"auto"`` picks) and the synced
  path (torch's row gradients, then the update), priced in the cost model's bytes
  (``dtrec.planning.cost_model``: forward reads a row per id; backward reads the output
  gradient per id and reads + writes each touched row and its state);
* dense: forward + backward + ``torch.optim.Adagrad`` step of a caller's dense arch.

``topology`` turns them into ``Topology.cpu`` fields the planner prices with. Medians over
repeats, then over ranks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dtrec.ops import embedding_bag
from dtrec.ops.backends.fbgemm import FbgemmBackend
from dtrec.ops.backends.torch import TorchBackend
from dtrec.ops.lookup import Lookup, packed_views
from dtrec.optim.cpu_choice import MARGIN
from dtrec.optim.rules import RowWiseAdagrad
from dtrec.planning.topology import Topology

ROWS, DIMS, BAGS, PER_BAG = (100_000, 370_000), (64, 8), 2048, 20
"""The calibration lookup: about the benchmark's per-rank table-wise share (2 tables),
at two widths."""
A2A_BYTES, GATHER_BYTES = 1 << 20, 4 << 20
"""Bytes a rank sends to each peer in the bandwidth probes (about the benchmark's output
dist and its largest gradient all-gathers: gloo's bandwidth falls with size)."""


def _median_s(fn: Callable[[], object], repeats: int, barrier: bool = False) -> float:
    times = []
    for _ in range(repeats):
        if barrier:
            dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def comm_constants(repeats: int = 15) -> dict[str, float]:
    """Latency (s per call) and all-to-all / all-gather bandwidths (bytes/s a rank sends)."""
    world = dist.get_world_size()
    tiny = torch.zeros(4 * world, dtype=torch.int32)
    out = torch.empty_like(tiny)
    calls = 10

    def tiny_calls() -> None:
        for _ in range(calls):
            dist.all_to_all_single(out, tiny)

    tiny_calls()
    latency = _median_s(tiny_calls, repeats, barrier=True) / calls
    big = torch.ones(A2A_BYTES // 4 * world)
    big_out = torch.empty_like(big)
    dist.all_to_all_single(big_out, big)
    a2a = _median_s(lambda: dist.all_to_all_single(big_out, big), repeats, barrier=True)
    piece = torch.ones(GATHER_BYTES // 4)
    gathered = torch.empty(GATHER_BYTES // 4 * world)
    dist.all_gather_into_tensor(gathered, piece)
    gather = _median_s(lambda: dist.all_gather_into_tensor(gathered, piece), repeats, True)
    return {
        "latency_s": latency,
        "a2a_bandwidth": (world - 1) * A2A_BYTES / max(a2a - latency, 1e-9),
        "gather_bandwidth": (world - 1) * GATHER_BYTES / max(gather - latency, 1e-9),
    }


IdSampler = Callable[[int, int, torch.Generator], Tensor]
"""(rows, n, generator) -> n ids of a table of ``rows`` rows."""


def embedding_constants(sample_ids: IdSampler, repeats: int = 5) -> dict[str, float]:
    """Seconds and cost-model bytes of a forward lookup of ids drawn by ``sample_ids`` (the
    predicted workload's skew: the update's cost follows the distinct rows), its one-pass
    backward + update and its synced backward + update, at ``DIMS`` (keys suffixed with
    the dim): two widths tell the per-byte cost from the per-id and per-row one."""
    gen = torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0)
    ids = [sample_ids(r, BAGS * PER_BAG, gen) for r in ROWS]
    out: dict[str, float] = {
        "ids": float(sum(i.numel() for i in ids)),
        "touched": float(sum(int(torch.unique(i).numel()) for i in ids)),
    }
    for dim in DIMS:
        for key, value in _one_width(ids, dim, gen, repeats).items():
            out[f"{key}_{dim}"] = value
    return out


def _one_width(ids: list[Tensor], dim: int, gen: torch.Generator, repeats: int) -> dict:
    values = torch.cat(ids)
    offsets = torch.arange(0, values.numel() + 1, PER_BAG)
    weights = packed_views([(r, dim) for r in ROWS], torch.float32, torch.device("cpu"))
    for w in weights:
        w.uniform_(-0.01, 0.01, generator=gen)
    sums = packed_views([(r,) for r in ROWS], torch.float32, torch.device("cpu"), zero=True)
    states = [{"sum": s} for s in sums]
    lookup = Lookup(weights, [0, 1], values, offsets, [False, False])
    grad = torch.randn(BAGS, len(ROWS) * dim, generator=gen)
    rule = RowWiseAdagrad(lr=1e-3)
    fbgemm = FbgemmBackend(name="fbgemm", lookups=False, fused_rules=("rowwise_adagrad",))

    def forward() -> None:
        embedding_bag(weights, values, offsets)

    def synced() -> None:
        rows = TorchBackend().backward_rows(lookup, grad)
        for w, st, (i, g) in zip(weights, states, rows, strict=True):
            rule.update_rows(w, st, i, g)

    def one_pass_fbgemm() -> None:
        fbgemm.backward_update(lookup, grad, rule.step_rule(), states)

    def one_pass_torch() -> bool:  # dtrec.kernels.cpu's fused pass, where it is built
        return TorchBackend().backward_update(lookup, grad, rule.step_rule(), states)

    with torch.no_grad():
        forward()
        t_forward = _median_s(forward, repeats)
        synced()
        t_synced = _median_s(synced, repeats)
        try:
            served = fbgemm.backward_update(lookup, grad, rule.step_rule(), states)
        except Exception:  # fbgemm does not load here: dtrec runs torch's path
            served = False
        t_fbgemm = _median_s(one_pass_fbgemm, repeats) if served else float("inf")
        t_torch = _median_s(one_pass_torch, repeats) if one_pass_torch() else t_synced
    # what "auto" runs for a table no sync touches (dtrec/optim/cpu_choice.py): fbgemm's
    # pass where it is MARGIN faster, else the torch backend's (C kernels, or row grads)
    t_one_pass = t_fbgemm if t_fbgemm * MARGIN < t_torch else t_torch
    n_ids = values.numel()
    touched = sum(int(torch.unique(i).numel()) for i in ids)
    return {
        "forward_s": t_forward,
        "one_pass_s": t_one_pass,
        "synced_s": t_synced,
        "forward_bytes": float(n_ids * dim * 4),
        "backward_bytes": float(n_ids * dim * 4 + touched * 2 * (dim * 4 + 4)),  # + state
        "fbgemm": float(t_one_pass == t_fbgemm),
    }


def dense_constants(dense: nn.Module, batch: int, width: int, repeats: int = 10) -> float:
    """Seconds of ``dense``'s forward + backward (BCE loss) + Adagrad step on a batch."""
    x, y = torch.randn(batch, width), torch.randint(0, 2, (batch,)).float()
    opt = torch.optim.Adagrad(dense.parameters(), lr=0.01)

    def step() -> None:
        loss = nn.functional.binary_cross_entropy_with_logits(dense(x).squeeze(1), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    return _median_s(step, repeats)


def measure_rank(
    rank: int, world: int, sample_ids: IdSampler, dense: nn.Module, batch: int, width: int
) -> dict:
    """One rank's constants (every rank of the world measures at the same time); a
    ``tests.multiprocess.run_world`` function."""
    torch.manual_seed(rank)
    out: dict = {"dense_s": dense_constants(dense, batch, width)}
    out.update(embedding_constants(sample_ids))
    out.update(comm_constants())
    return out


def combine(ranks: list[dict]) -> dict:
    """Medians over ranks."""
    return {k: statistics.median(r[k] for r in ranks) for k in ranks[0]}


def compute_constants(c: dict) -> dict[str, float]:
    """Per-byte bandwidth, per-id and per-row costs (as bytes at that bandwidth) and the
    synced path's factor, from the two widths: the wide run's extra bytes over the narrow
    one's set the bandwidth; what the narrow forward takes beyond its bytes is per id,
    what its backward takes beyond them per touched row."""
    wide, narrow = max(DIMS), min(DIMS)

    def seconds(dim: int) -> float:
        return c[f"forward_s_{dim}"] + c[f"one_pass_s_{dim}"]

    def nbytes(dim: int) -> float:
        return c[f"forward_bytes_{dim}"] + c[f"backward_bytes_{dim}"]

    extra = seconds(wide) - seconds(narrow)
    bandwidth = (nbytes(wide) - nbytes(narrow)) / max(extra, 1e-9)
    forward_left = c[f"forward_s_{narrow}"] - c[f"forward_bytes_{narrow}"] / bandwidth
    backward_left = c[f"one_pass_s_{narrow}"] - c[f"backward_bytes_{narrow}"] / bandwidth
    return {
        "bandwidth": bandwidth,
        "id_cost_bytes": max(0.0, forward_left) / c["ids"] * bandwidth,
        "row_cost_bytes": max(0.0, backward_left) / c["touched"] * bandwidth,
        "synced_factor": c[f"synced_s_{wide}"] / c[f"one_pass_s_{wide}"],
    }


def topology(calibration: dict, **overrides: object) -> Topology:
    """``Topology.cpu`` with the measured constants (``compute_constants``; the shard axis
    at the all-to-all bandwidth, the replicate axis (one node) at the all-gather's, a
    latency per collective call)."""
    c = calibration
    k = compute_constants(c)
    values: dict[str, object] = {
        "hbm_bandwidth": k["bandwidth"],
        "id_cost_bytes": k["id_cost_bytes"],
        "row_cost_bytes": k["row_cost_bytes"],
        "synced_update_factor": k["synced_factor"],
        "intra_node_bandwidth": c["a2a_bandwidth"],
        "inter_node_bandwidth": c["a2a_bandwidth"],
        "replica_bandwidth": c["gather_bandwidth"],
        "collective_latency": c["latency_s"],
    }
    values.update(overrides)
    return Topology.cpu(**values)
