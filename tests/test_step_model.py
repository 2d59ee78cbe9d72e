"""The step model's collective times follow NCCL's tuning model where it is simple to state
(``dtrec/planning/step_model.py``), and its step adds up as the pipeline overlaps it."""

from __future__ import annotations

import pytest

from dtrec.planning.step_model import Device, Fabric, collective_of, collective_time, step_time

FABRIC = Fabric()


def test_a_large_all_reduce_across_nodes_runs_at_the_nic_bandwidth() -> None:
    sent = 2 * 63 / 64 * 1e9  # a 1 GB buffer over 64 ranks, 8 per node: ring, Simple
    t = collective_time("all_reduce", sent, 1, 64, 8, FABRIC)
    assert t == pytest.approx(sent / FABRIC.network_bandwidth, rel=0.02)


def test_inside_a_node_nvlink_carries_it() -> None:
    sent = 2 * 7 / 8 * 1e9
    t = collective_time("all_reduce", sent, 1, 8, 8, FABRIC)
    assert t == pytest.approx(sent / FABRIC.nvlink_bandwidth, rel=0.02)


def test_a_small_all_reduce_over_4096_ranks_takes_the_tree() -> None:
    ring_latency = FABRIC.base_latency[0] + 2 * (4096 - 512) * FABRIC.nvlink_latency[0] * 1.8
    t = collective_time("all_reduce", 8.0, 1, 4096, 8, FABRIC)
    assert t < ring_latency / 10  # log2(512) network hops, not 8190 ring steps


def test_all_to_all_sends_off_node_bytes_over_the_nic() -> None:
    sent = 63e6  # 1 MB to each of 63 peers, 7 of them on this node
    t = collective_time("all_to_all", sent, 1, 64, 8, FABRIC)
    off = sent * 56 / 63 / FABRIC.network_bandwidth
    assert t == pytest.approx(off + FABRIC.base_latency[1] + FABRIC.network_latency[1], rel=1e-6)


def test_every_collective_of_a_step_is_known_and_new_ones_are_refused() -> None:
    assert collective_of("output_dist.backward") == ("shard", "all_to_all")
    assert collective_of("grad_sync.replicate.sparse") == ("replicate", "all_gather")
    with pytest.raises(KeyError, match="COLLECTIVES"):
        collective_of("some_new.exchange")


def test_the_input_dist_hides_behind_compute_and_the_output_dist_does_not() -> None:
    device = Device("d", 1e12, 1e-7, 0.0, 0.0, 1e12)
    emb = 2e9  # 2 ms of embedding work, 1.6 ms of dense for B = 16384
    quiet = step_time({}, 8, 1, 16384, emb, device, FABRIC).step
    small = {"input_dist.ids": {"calls": 1, "bytes": 1e8}}
    assert step_time(small, 8, 1, 16384, emb, device, FABRIC).step == pytest.approx(quiet)
    out = {"output_dist": {"calls": 1, "bytes": 1e8}}
    timed = step_time(out, 8, 1, 16384, emb, device, FABRIC)
    assert timed.step == pytest.approx(quiet + timed.comm["output_dist"])
    assert timed.comm_share == pytest.approx(timed.comm["output_dist"] / timed.step)


def test_a_same_batch_groups_collectives_are_priced_over_that_group() -> None:
    """``distribute_module(..., same_batch=world["tp"])`` records ``same_batch.gather``
    (and, checked, ``same_batch.check``): all-gathers over the tp group, on the critical
    path; a step priced without the group's size is a ValueError, not a KeyError."""
    assert collective_of("same_batch.gather") == ("same_batch", "all_gather")
    assert collective_of("same_batch.check") == ("same_batch", "all_gather")
    device = Device("d", 1e12, 1e-7, 0.0, 0.0, 1e12)
    quiet = step_time({}, 4, 2, 64, 1e6, device, FABRIC).step
    comm = {"same_batch.gather": {"calls": 1, "bytes": 6144.0}}
    timed = step_time(comm, 4, 2, 64, 1e6, device, FABRIC, same_batch=2)
    expected = collective_time("all_gather", 6144.0, 1, 2, 2, FABRIC)
    assert timed.comm["same_batch.gather"] == pytest.approx(expected) and expected > 0
    assert timed.step == pytest.approx(quiet + expected)  # not hidden behind compute
    wider = step_time(comm, 4, 2, 64, 1e6, device, FABRIC, same_batch=4)
    assert wider.comm["same_batch.gather"] > expected
    with pytest.raises(ValueError, match="same_batch="):
        step_time(comm, 4, 2, 64, 1e6, device, FABRIC)


def test_every_kind_a_composed_step_records_is_priced() -> None:
    """The kinds of ``benchmarks/composed.py``'s dtrec + FSDP2 + TP step (same_batch over
    tp 2) as ``comm_stats().per_step()`` gave them: the step model prices every one."""
    kinds = [
        "grad_sync.replicate.counts", "grad_sync.replicate.dense", "grad_sync.replicate.sparse",
        "input_dist.header", "input_dist.ids", "input_dist.verdict", "optim.row_sq_sum",
        "output_dist", "output_dist.backward", "same_batch.gather", "sequence_output_dist",
        "sequence_output_dist.backward",
    ]  # fmt: skip
    comm = {k: {"calls": 1.0, "bytes": 1000.0} for k in kinds}
    device = Device("d", 1e12, 1e-7, 0.0, 0.0, 1e12)
    t = step_time(comm, 4, 2, 64, 1e6, device, FABRIC, same_batch=2)
    assert set(t.comm) == set(kinds) and all(s > 0 for s in t.comm.values()), t.comm
