"""Whether a reshard's target, and the move to it, fit each rank's memory, checked
before anything moves.

The target's blocks are known from the specs and meshes alone, so every rank computes
every rank's bytes of tables and optimizer state (fused state, and table-shaped torch
optimizer state; an offloaded block: its cache on the device, its rows in host memory)
without communicating, and compares the fullest with the budget the planner plans
within (``Topology.memory_budget``: ``memory_per_rank`` minus its headroom). The planner
also counts a step's buffers; this check counts what the tables hold at rest, so a plan
``dtrec.plan`` made always passes it.

The move itself needs more for a while: the changed collections are built aside on the
new plan while the old ones still hold everything, and each all-to-all round holds its
send and receive buffers. That peak is counted the same way (the rounds from the same
moves the exchange runs) and checked against the same budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from dtrec.placements import TableSpec
from dtrec.placements.mesh import shard_axis
from dtrec.planning.offload import MAP_BYTES, SLOT_BYTES
from dtrec.planning.plan import table_fqn
from dtrec.planning.topology import Topology
from dtrec.sharded.collection import ShardedCollection
from dtrec.sharded.reshard.exchange import exchange_ranks, round_buffers
from dtrec.sharded.reshard.moves import entry_moves
from dtrec.sharded.reshard.torch_state import state_of, table_entries, weights_of


def default_topology(mesh: DeviceMesh) -> Topology:
    """What ``dtrec.plan`` assumes without a topology: an H100 on CUDA, this host on CPU."""
    return Topology.h100() if mesh.device_type == "cuda" else Topology.cpu()


def _entry_sizes(
    collection: ShardedCollection,
    fqn: str,
    optimizers: Sequence[torch.optim.Optimizer] | None,
) -> list[list[tuple[str, int]]]:
    """Per table: (kind, element size) of each entry held like it (weight and state)."""
    weights = weights_of(collection._stored())
    out: list[list[tuple[str, int]]] = []
    torch_entries: Mapping[int, list[str]] = {}
    if collection._updater is None and optimizers:
        names = [cfg.name for cfg in collection._tables]
        torch_entries = table_entries(optimizers, fqn, names, weights)
    fused = {} if collection.optimizer is None else collection.optimizer.state_layout()
    for t in range(len(collection._tables)):
        sizes = [("weight", collection._dtype.itemsize)]
        for entry, kind in fused.items():
            if kind != "scalar":
                assert collection._updater is not None
                sizes.append((kind, collection._updater.state[t][entry].element_size()))
        for entry in torch_entries.get(t, []):
            sizes.append(("weight", state_of(optimizers or [], weights[t], entry).element_size()))
        out.append(sizes)
    return out


Holdings = tuple[dict[int, float], dict[int, float], dict[int, tuple[float, str]]]
"""Per rank: device bytes, host bytes (offloaded blocks), and its largest table on the
device (bytes, table FQN)."""


def _holdings(
    collections: Mapping[str, ShardedCollection],
    specs: Mapping[str, Mapping[str, TableSpec]],
    meshes: Mapping[str, DeviceMesh],
    sizes: Mapping[str, list[list[tuple[str, int]]]],
) -> Holdings:
    """What the collections named in ``meshes`` hold per rank with every table on
    ``specs[fqn]`` over ``meshes[fqn]``: each block's rows and optimizer state on the device,
    or an offloaded block's in host memory and its cache (rows, state and bookkeeping,
    as the planner counts them) on the device."""
    device: dict[int, float] = {}
    host: dict[int, float] = {}
    largest: dict[int, tuple[float, str]] = {}
    for fqn, mesh in meshes.items():
        collection = collections[fqn]
        axis = shard_axis(mesh)
        rows_of = mesh.mesh.tolist()  # position -> its ranks
        for cfg, entries in zip(collection._tables, sizes[fqn], strict=True):
            layout = specs[fqn][cfg.name].layout(cfg, axis)
            for i, block in enumerate(layout.blocks):
                row = sum(
                    (block.num_cols if kind == "weight" else 1) * size for kind, size in entries
                )
                if layout.offloaded:
                    cache = layout.cache_rows[i]
                    on_device = cache * (row + SLOT_BYTES) + (block.num_rows + 1) * MAP_BYTES
                    on_host = block.num_rows * row
                else:
                    on_device, on_host = block.num_rows * row, 0
                for rank in rows_of[block.position]:
                    device[rank] = device.get(rank, 0.0) + on_device
                    host[rank] = host.get(rank, 0.0) + on_host
                    if on_device > largest.get(rank, (-1.0, ""))[0]:
                        largest[rank] = (on_device, table_fqn(fqn, cfg.name))
    return device, host, largest


def _buffers(
    collections: Mapping[str, ShardedCollection],
    specs: Mapping[str, Mapping[str, TableSpec]],
    targets: Mapping[str, DeviceMesh],
    sizes: Mapping[str, list[list[tuple[str, int]]]],
    chunk_bytes: int,
) -> dict[int, float]:
    """Per rank: the most bytes the exchange's round buffers hold on it at once, over the
    changed collections (moved one after another), from the same moves and rounds as
    the move itself (``exchange.round_buffers``)."""
    most: dict[int, float] = {}
    for fqn, new_specs in specs.items():
        collection, mesh = collections[fqn], targets[fqn]
        _, index, old_ranks, new_ranks = exchange_ranks(collection.mesh, mesh)
        axis = shard_axis(mesh)
        pieces = []
        for t, (cfg, entries) in enumerate(zip(collection._tables, sizes[fqn], strict=True)):
            new = new_specs[cfg.name].layout(cfg, axis)
            for e, (kind, size) in enumerate(entries):
                pieces += entry_moves(
                    t, cfg.name, f"entry{e}", kind, collection._layouts[t], new, size,
                    old_ranks, new_ranks,
                )  # fmt: skip
        rank_of = {i: g for g, i in index.items()}
        for i, held in round_buffers(pieces, len(index), chunk_bytes).items():
            most[rank_of[i]] = max(most.get(rank_of[i], 0.0), float(held))
    return most


def memory_refusal(
    collections: Mapping[str, ShardedCollection],
    specs: Mapping[str, Mapping[str, TableSpec]],
    targets: Mapping[str, DeviceMesh],
    optimizers: Sequence[torch.optim.Optimizer] | None,
    topology: Topology,
    chunk_bytes: int,
) -> ValueError | None:
    """Why the target (every collection's ``specs`` on its ``targets`` mesh; collections
    not in ``specs`` as they are) or the move to it does not fit ``topology``'s budget on
    some rank; None when both fit.

    At rest (E355; offloaded blocks' host memory: E372, checked when
    ``Topology.host_memory_per_rank`` is set): the target's tables and optimizer state.
    At the peak of the move (E373): every collection as it is, plus the changed
    collections built aside on their target (swapped in only when all are built), plus
    the largest round of exchange buffers (``chunk_bytes``)."""
    sizes = {fqn: _entry_sizes(c, fqn, optimizers) for fqn, c in collections.items()}
    target = {fqn: specs.get(fqn) or c.specs() for fqn, c in collections.items()}
    device, host, largest = _holdings(collections, target, targets, sizes)
    if not device:
        return None
    budget, host_budget = topology.memory_budget, topology.host_budget
    rank = max(sorted(device), key=lambda r: device[r])
    if device[rank] > budget:
        held, table = largest[rank]
        return ValueError(
            f"reshard: the new plan holds {_size(device[rank])} of tables and optimizer state "
            f"on rank {rank} (largest: {table!r}, {_size(held)}), over the budget of "
            f"{_size(budget)} per rank (Topology.memory_per_rank minus headroom); reshard to "
            "a plan that fits (dtrec.plan makes one), or give topology= with the memory the "
            "ranks have"
        )
    rank = max(sorted(host), key=lambda r: host[r])
    if host_budget > 0 and host[rank] > host_budget:
        return ValueError(
            f"reshard: the new plan holds {_size(host[rank])} of offloaded tables and their "
            f"optimizer state in host memory on rank {rank}, over the host budget of "
            f"{_size(host_budget)} per rank (Topology.host_memory_per_rank); give the "
            "offloaded tables more ranks, or keep some on the device"
        )
    current = {fqn: c.specs() for fqn, c in collections.items()}
    old = _holdings(collections, current, {f: c.mesh for f, c in collections.items()}, sizes)
    new = _holdings(collections, specs, {fqn: targets[fqn] for fqn in specs}, sizes)
    buffers = _buffers(collections, specs, targets, sizes, chunk_bytes)
    for tier, at, most, extra in (
        ("device", 0, budget, buffers),
        ("host", 1, host_budget if host_budget > 0 else float("inf"), {}),
    ):
        peak = {
            r: old[at].get(r, 0.0) + new[at].get(r, 0.0) + extra.get(r, 0.0)
            for r in old[at].keys() | new[at].keys()
        }
        rank = max(sorted(peak), key=lambda r: peak[r])
        if peak[rank] > most:
            return ValueError(
                f"reshard: moving to the new plan holds {_size(peak[rank])} of {tier} memory on "
                f"rank {rank} at its peak ({_size(old[at].get(rank, 0.0))} of the tables as "
                f"they are, {_size(new[at].get(rank, 0.0))} of the changed collections built "
                f"on the new plan, {_size(extra.get(rank, 0.0))} of exchange buffers), over "
                f"the budget of {_size(most)} per rank; move fewer collections per reshard "
                "call, give a smaller chunk_bytes=, or give topology= with the memory the "
                "ranks have"
            )
    return None


def _size(nbytes: float) -> str:
    """``nbytes`` in B, KiB, MiB or GiB, whichever reads best."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def check_topology(topology: object) -> Topology | None:
    """``topology`` checked: a ``dtrec.Topology`` or None."""
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"reshard: topology must be a dtrec.Topology or None, got {topology!r}")
    return topology
