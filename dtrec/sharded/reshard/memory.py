"""Whether a reshard's target fits each rank's memory, checked before anything moves.

The target's blocks are known from the specs and meshes alone, so every rank computes
every rank's bytes of tables and optimizer state (fused state, and table-shaped torch
optimizer state) without communicating, and compares the fullest with the budget the
planner plans within (``Topology.memory_budget``: ``memory_per_rank`` minus its
headroom). The planner also counts a step's buffers; this check counts what the tables
hold at rest, so a plan ``dtrec.plan`` made always passes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from dtrec.placements import TableSpec
from dtrec.placements.mesh import shard_axis
from dtrec.planning.plan import table_fqn
from dtrec.planning.topology import Topology
from dtrec.sharded.collection import ShardedCollection
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


def memory_refusal(
    collections: Mapping[str, ShardedCollection],
    specs: Mapping[str, Mapping[str, TableSpec]],
    targets: Mapping[str, DeviceMesh],
    optimizers: Sequence[torch.optim.Optimizer] | None,
    topology: Topology,
) -> ValueError | None:
    """Why the target (every collection's ``specs`` on its ``targets`` mesh; collections
    not in ``specs`` as they are) does not fit ``topology``'s budget on some rank, naming
    the fullest rank, its bytes and its largest table; None when it fits."""
    per_rank: dict[int, float] = {}
    largest: dict[int, tuple[float, str]] = {}
    for fqn, collection in collections.items():
        mesh = targets[fqn]
        axis = shard_axis(mesh)
        own = specs.get(fqn) or collection.specs()
        rows_of = mesh.mesh.tolist()  # position -> its ranks
        for cfg, sizes in zip(
            collection._tables, _entry_sizes(collection, fqn, optimizers), strict=True
        ):
            layout = own[cfg.name].layout(cfg, axis)
            for block in layout.blocks:
                held = sum(
                    block.num_rows * (block.num_cols if kind == "weight" else 1) * size
                    for kind, size in sizes
                )
                for rank in rows_of[block.position]:
                    per_rank[rank] = per_rank.get(rank, 0.0) + held
                    if held > largest.get(rank, (-1.0, ""))[0]:
                        largest[rank] = (held, table_fqn(fqn, cfg.name))
    if not per_rank:
        return None
    budget = topology.memory_budget
    rank = max(sorted(per_rank), key=lambda r: per_rank[r])
    if per_rank[rank] <= budget:
        return None
    held, table = largest[rank]
    return ValueError(
        f"reshard: the new plan holds {_size(per_rank[rank])} of tables and optimizer state "
        f"on rank {rank} (largest: {table!r}, {_size(held)}), over the budget of "
        f"{_size(budget)} per rank (Topology.memory_per_rank minus headroom); reshard to a "
        "plan that fits (dtrec.plan makes one), or give topology= with the memory the "
        "ranks have"
    )


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
