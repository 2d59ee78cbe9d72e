"""The constants a CPU / gloo step prediction needs, measured in the run that is predicted.

Why: a step model is only checked against a measured step if its constants come from the
same machine, at the same time, under the same contention (4 gloo ranks sharing 2 cores
run every kernel at about half speed). So every rank of one world measures at once:

* collectives: the seconds one call costs beyond its bytes, per op (all-to-all,
  all-reduce, all-gather of a few bytes), and the bytes per second a rank sends in an
  all-to-all of 1 MB per peer and an all-gather of 4 MB (``a2a_bandwidth``,
  ``gather_bandwidth``), each call timed after a forward lookup, as a step's calls come
  after compute (``comm_constants``);
* embedding: a forward lookup (Zipf ids over 2 tables, D = 64) and its backward + fused
  row-wise Adagrad update, one pass (the implementation ``"auto"`` picks) and the synced
  path as dtrec runs it over the world (row gradients, ``sync_rows``, the update of the
  union; its collectives' seconds left out), priced in the cost model's bytes
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

import dtrec
from dtrec.ops import embedding_bag
from dtrec.ops.lookup import packed_views
from dtrec.ops.op import lookup_backward_rows
from dtrec.optim import RowUpdate
from dtrec.optim.cpu_choice import MARGIN, RowwiseAdagradLookup
from dtrec.planning.topology import Topology
from dtrec.sharded.update.grad_sync import TableRows, sync_rows

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


def comm_constants(work: Callable[[], object], repeats: int = 7) -> dict[str, float]:
    """Seconds per call of an all-to-all, an all-reduce and an all-gather of a few bytes
    (``latency_s``, ``reduce_latency_s``, ``gather_latency_s``), and the bytes per second a
    rank sends in an all-to-all and in an all-gather (``a2a_bandwidth``,
    ``gather_bandwidth``), each timed as a step pays it: after ``work`` (a rank's own
    compute, so ranks arrive apart, as between a step's collectives), less ``work`` alone.

    Why: on ranks sharing cores a call costs more after compute than back to back (gloo,
    4 ranks on 2 cores: tiny all-to-all 2.1 ms back to back, 0.65 ms alone after a barrier,
    2.5-4.4 ms after 1.5-10 ms of work; all-reduce and all-gather 1.3-2x the all-to-all's),
    and a bandwidth taken as (sized call - back-to-back latency) read 5 GB/s where the sized
    all-to-all alone moved 1 GB/s."""
    world = dist.get_world_size()
    calls = 8
    tiny = torch.zeros(4 * world, dtype=torch.int32)
    tiny_out = torch.empty_like(tiny)
    flag = torch.zeros(4, dtype=torch.int32)
    count, counts = torch.zeros(8, dtype=torch.long), torch.empty(8 * world, dtype=torch.long)
    big = torch.ones(A2A_BYTES // 4 * world)
    big_out = torch.empty_like(big)
    piece = torch.ones(GATHER_BYTES // 4)
    gathered = torch.empty(GATHER_BYTES // 4 * world)
    ops: dict[str, Callable[[], object]] = {
        "work": lambda: None,
        "a2a": lambda: dist.all_to_all_single(tiny_out, tiny),
        "reduce": lambda: dist.all_reduce(flag),
        "gather": lambda: dist.all_gather_into_tensor(counts, count),
        "a2a_big": lambda: dist.all_to_all_single(big_out, big),
        "gather_big": lambda: dist.all_gather_into_tensor(gathered, piece),
    }
    per_call = {}
    for name, op in ops.items():

        def after_work(op: Callable[[], object] = op) -> None:
            for _ in range(calls):
                work()
                op()

        after_work()
        per_call[name] = _median_s(after_work, repeats, barrier=True) / calls
    cost = {k: max(v - per_call["work"], 1e-9) for k, v in per_call.items() if k != "work"}

    return {
        "latency_s": cost["a2a"],
        "reduce_latency_s": cost["reduce"],
        "gather_latency_s": cost["gather"],
        "a2a_bandwidth": (world - 1) * A2A_BYTES / max(cost["a2a_big"] - cost["a2a"], 1e-9),
        "gather_bandwidth": (world - 1)
        * GATHER_BYTES
        / max(cost["gather_big"] - cost["gather"], 1e-9),
        "work_s": per_call["work"],
    }


IdSampler = Callable[[int, int, torch.Generator], Tensor]
"""(rows, n, generator) -> n ids of a table of ``rows`` rows."""


def embedding_constants(sample_ids: IdSampler, repeats: int = 9) -> dict[str, float]:
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
    # the lookup dtrec's own CPU choice times (dtrec/optim/cpu_choice.py), at this width
    bench = RowwiseAdagradLookup.build(ids, ROWS, dim, PER_BAG, gen)
    weights, states, lookup, grad, rule = (
        bench.weights,
        bench.states,
        bench.lookup,
        bench.grad,
        bench.rule,
    )
    values, offsets = lookup.values, lookup.offsets

    def forward() -> None:
        embedding_bag(weights, values, offsets)

    synced, one_pass_fbgemm, one_pass_torch = (
        bench.rows_then_update,
        bench.fbgemm_pass,
        bench.torch_pass,
    )

    # every rank times the same code at once (a barrier before each repeat): the
    # contention the step's compute sees, not ranks drifting through different probes
    aligned = dist.is_initialized()
    group = dist.group.WORLD if dist.is_initialized() else None
    size = dist.get_world_size() if group is not None else 1
    shape: dict[str, float] = {}

    def synced_group() -> float:
        """The synced path as ``FusedUpdater`` runs it for a table summed over the world
        (row gradients, ``sync_rows``, the update of the union), less the seconds inside
        its collectives (priced apart, by bytes and calls)."""
        with dtrec.comm_stats() as stats:
            start = time.perf_counter()
            rows = lookup_backward_rows(lookup, grad)
            parts = [TableRows(i, g / size, w.shape[0]) for (i, g), w in zip(rows, weights)]
            synced = sync_rows(parts, group, "calibration")
            rule.update_tables(
                [RowUpdate(w, st, i, g) for w, st, (i, g) in zip(weights, states, synced)]
            )
            elapsed = time.perf_counter() - start
        shape["summed"] = float(size * sum(p.rows.numel() for p in parts))
        shape["union"] = float(sum(i.numel() for i, _ in synced))
        return elapsed - sum(stats.seconds.values())

    with torch.no_grad():
        forward()
        t_forward = _median_s(forward, repeats, aligned)
        synced()
        t_synced = _median_s(synced, repeats, aligned)
        try:
            served = bench.fbgemm_pass()
        except Exception:  # fbgemm does not load here: dtrec runs torch's path
            served = False
        t_fbgemm = _median_s(one_pass_fbgemm, repeats, aligned) if served else float("inf")
        t_torch = _median_s(one_pass_torch, repeats, aligned) if one_pass_torch() else t_synced
        synced_group()
        t_group = []
        for _ in range(repeats):
            if group is not None:
                dist.barrier()
            t_group.append(synced_group())
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
        "synced_group_s": statistics.median(t_group),
        "synced_summed": shape["summed"],
        "synced_union": shape["union"],
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
    out.update(comm_constants(_forward_work(sample_ids)))
    return out


def _forward_work(sample_ids: IdSampler) -> Callable[[], object]:
    """The compute the call probes put before each call: the calibration's forward lookup
    at the wider dim (a rank's table-wise share of the benchmark, the work before its
    output dist)."""
    gen = torch.Generator().manual_seed(dist.get_rank())
    values = torch.cat([sample_ids(r, BAGS * PER_BAG, gen) for r in ROWS])
    offsets = torch.arange(0, values.numel() + 1, PER_BAG)
    weights = packed_views([(r, max(DIMS)) for r in ROWS], torch.float32, torch.device("cpu"))
    for w in weights:
        w.uniform_(-0.01, 0.01, generator=gen)

    def work() -> None:
        with torch.no_grad():
            embedding_bag(weights, values, offsets)

    return work


def combine(ranks: list[dict]) -> dict:
    """Medians over ranks."""
    return {k: statistics.median(r[k] for r in ranks) for k in ranks[0]}


def compute_constants(c: dict) -> dict[str, float]:
    """Per-byte bandwidth, per-id and per-row costs (as bytes at that bandwidth) and the
    synced path's factor, from the two widths: the wide run's extra bytes over the narrow
    one's set the bandwidth; what the narrow forward takes beyond its bytes is per id,
    what its backward takes beyond them per touched row; the factor makes the cost model's
    synced backward (the world's rows summed, their union updated) take what the synced
    path measured outside its collectives (``synced_group_s``)."""
    wide, narrow = max(DIMS), min(DIMS)

    def seconds(dim: int) -> float:
        return c[f"forward_s_{dim}"] + c[f"one_pass_s_{dim}"]

    def nbytes(dim: int) -> float:
        return c[f"forward_bytes_{dim}"] + c[f"backward_bytes_{dim}"]

    extra = seconds(wide) - seconds(narrow)
    bandwidth = (nbytes(wide) - nbytes(narrow)) / max(extra, 1e-9)
    forward_left = c[f"forward_s_{narrow}"] - c[f"forward_bytes_{narrow}"] / bandwidth
    backward_left = c[f"one_pass_s_{narrow}"] - c[f"backward_bytes_{narrow}"] / bandwidth
    row_cost = max(0.0, backward_left) / c["touched"] * bandwidth
    if f"synced_group_s_{wide}" in c:  # the cost model's synced backward, at these shapes
        row = wide * 4 + 4  # a row and its row-wise state
        priced = (
            c["ids"] * wide * 4
            + c[f"synced_summed_{wide}"] * (wide * 4 + row_cost)
            + c[f"synced_union_{wide}"] * (2 * row + row_cost)
        )
        synced = c[f"synced_group_s_{wide}"] * bandwidth / priced
    else:  # an older calibration: torch's row grads + update, one rank's rows
        synced = c[f"synced_s_{wide}"] / c[f"one_pass_s_{wide}"]
    return {
        "bandwidth": bandwidth,
        "id_cost_bytes": max(0.0, forward_left) / c["ids"] * bandwidth,
        "row_cost_bytes": row_cost,
        "synced_factor": synced,
    }


def topology(calibration: dict, **overrides: object) -> Topology:
    """``Topology.cpu`` with the measured constants (``compute_constants``; the shard axis
    at the all-to-all bandwidth, the replicate axis (one node) at the all-gather's, a
    latency per collective call of each op)."""
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
        "reduce_latency": c.get("reduce_latency_s"),
        "gather_latency": c.get("gather_latency_s"),
    }
    values.update(overrides)
    return Topology.cpu(**values)
