"""TorchRec plans and constraints as dtrec's: ``ShardingPlan`` -> specs on the mesh,
``ParameterConstraints`` -> ``TableConstraint``.

Ranks in a TorchRec plan are positions on the "shard" axis when they all fit it (a
``DMPCollection`` plan is made for one sharding group, ranks 0..S-1; with R = 1 they
are the world's ranks, as ``DistributedModelParallel``'s are). A plan made for the whole
world of a 2D mesh (some rank >= S) names global ranks: each maps to its mesh
position, and every replica group the table's ranks touch must get the same positions.
The spec chosen per table is then checked block by block (rows, columns, position)
against the plan's own shards, so a plan dtrec cannot reproduce exactly (uneven rows,
TorchRec's column blocks that are not one per position, a rank list off the mesh) is a
ValueError naming the table, never a different layout in silence.
"""

from __future__ import annotations

from collections.abc import Mapping
from statistics import fmean

from torch.distributed.device_mesh import DeviceMesh

from dtrec.modules.config import EmbeddingBagConfig
from dtrec.placements import (
    ColumnWise,
    DataParallel,
    Grid,
    RowWise,
    TableRowWise,
    TableSpec,
    TableWise,
    chunk_bounds,
)
from dtrec.placements.constraints import TableConstraint
from dtrec.placements.mesh import ShardAxis, shard_axis

SHARDING_TYPES: dict[str, type[TableSpec]] = {
    "data_parallel": DataParallel,
    "table_wise": TableWise,
    "row_wise": RowWise,
    "column_wise": ColumnWise,
    "table_column_wise": ColumnWise,  # column blocks on some ranks: what ColumnWise lays out
    "table_row_wise": TableRowWise,
    "grid_shard": Grid,
}
"""TorchRec ``ShardingType`` value -> the dtrec spec class that lays a table out alike."""

COMPUTE_KERNELS = ("dense", "fused", "fused_uvm_caching")
"""TorchRec compute kernels dtrec has (fused or not is ``distribute_module``'s
``optimizer``; UVM caching is an offloaded spec, ``dtrec.placements.offload``); plain
UVM, key-value, quantized and virtual-table kernels it lacks."""

CACHING_KERNEL = "fused_uvm_caching"
DEFAULT_CACHE_LOAD_FACTOR = 0.2
"""TorchRec's cache load factor when neither the plan nor the sharder gives one (its
batched embedding kernel's default)."""


def is_torchrec_plan(obj: object) -> bool:
    """Whether ``obj`` is a TorchRec ``ShardingPlan`` (module path -> per-table shardings)."""
    return (
        type(obj).__name__ == "ShardingPlan"
        and not isinstance(obj, Mapping)  # dtrec's own ShardingPlan is a dict
        and isinstance(getattr(obj, "plan", None), Mapping)
    )


def is_torchrec_plan_dict(obj: object) -> bool:
    """Whether ``obj`` is a TorchRec ``ShardingPlan.plan``: module path -> module plan
    (table -> ``ParameterSharding``), as ``ShardingPlan(plan=...)`` takes it."""
    return (
        isinstance(obj, Mapping)
        and bool(obj)
        and all(
            isinstance(module_plan, Mapping)
            and bool(module_plan)
            and all(_is_parameter_sharding(v) for v in module_plan.values())
            for module_plan in obj.values()
        )
    )


def _is_parameter_sharding(obj: object) -> bool:
    return all(hasattr(obj, a) for a in ("sharding_type", "compute_kernel", "ranks"))


def _is_parameter_constraints(obj: object) -> bool:
    return type(obj).__name__ == "ParameterConstraints" and hasattr(obj, "sharding_types")


def from_torchrec(
    constraints: object, tables: Mapping[str, EmbeddingBagConfig], mesh: DeviceMesh
) -> object:
    """dtrec's ``{table fqn: spec or TableConstraint}`` for a TorchRec ``ShardingPlan`` or
    a mapping holding TorchRec ``ParameterConstraints`` (keyed by table name, as TorchRec's
    planner takes them, or by table FQN); anything else is returned unchanged.

    Example::

        specs = from_torchrec(torchrec_plan, model_tables(model), mesh)
    """
    if is_torchrec_plan(constraints):
        return from_torchrec_plan(constraints.plan, tables, mesh)  # type: ignore[attr-defined]
    if is_torchrec_plan_dict(constraints):
        return from_torchrec_plan(constraints, tables, mesh)  # type: ignore[arg-type]
    if not isinstance(constraints, Mapping):
        return constraints
    values = list(constraints.values())
    if any(_is_parameter_sharding(v) for v in values):
        raise TypeError(
            "got a TorchRec module plan (table -> ParameterSharding); wrap it in "
            "{'<collection fqn>': module_plan} (a TorchRec ShardingPlan.plan) or "
            "torchrec's ShardingPlan of that, so each table has its collection's path"
        )
    if not any(_is_parameter_constraints(v) for v in values):
        return constraints
    axis = shard_axis(mesh)
    converted: dict[str, object] = {}
    for key, value in constraints.items():
        if not _is_parameter_constraints(value):
            converted[key] = value
            continue
        for fqn in _tables_named(key, tables):
            converted[fqn] = from_parameter_constraints(tables[fqn], value, axis)
    return converted


def _tables_named(key: str, tables: Mapping[str, EmbeddingBagConfig]) -> list[str]:
    if key in tables:
        return [key]
    matches = [fqn for fqn, cfg in tables.items() if cfg.name == key]
    if not matches:
        raise KeyError(
            f"TorchRec ParameterConstraints for unknown table {key!r}; the model's tables "
            f"are {sorted(tables)}"
        )
    return matches


def from_parameter_constraints(
    table: EmbeddingBagConfig, constraints: object, axis: ShardAxis
) -> TableConstraint:
    """A ``TableConstraint`` for one table's TorchRec ``ParameterConstraints``.

    ``sharding_types`` -> allowed spec classes; ``min_partition`` (narrowest column
    shard) drops ``ColumnWise`` when its columns per position would be narrower;
    ``pooling_factors`` (per feature) -> their mean; ``compute_kernels`` must include one
    dtrec has; only ``fused_uvm_caching`` -> the table offloaded behind a cache of
    ``cache_params.load_factor`` of its rows (TorchRec's default 0.2 without one;
    ``TableConstraint.cache_fraction``). Key-value and virtual-table settings are a
    ValueError; the other fields (batch sizes, bounds check mode, and cache parameters
    when other kernels are allowed too) are hints dtrec's planner does not use.
    """
    name = table.name
    for field_name in ("key_value_params", "use_virtual_table"):
        if getattr(constraints, field_name, None) not in (None, False):
            raise ValueError(
                f"table {name!r}: TorchRec constraint {field_name} is not supported by dtrec "
                "(its tables live in device memory, or in host memory behind a device cache, "
                "without key-value stores or virtual tables); drop it"
            )
    kernels = getattr(constraints, "compute_kernels", None)
    if kernels is not None and not any(_value(k) in COMPUTE_KERNELS for k in kernels):
        raise ValueError(
            f"table {name!r}: TorchRec compute_kernels {[_value(k) for k in kernels]} has none "
            f"dtrec runs ({list(COMPUTE_KERNELS)})"
        )
    cache_fraction = None
    if kernels and all(_value(k) == CACHING_KERNEL for k in kernels):
        params = getattr(constraints, "cache_params", None)
        cache_fraction = _load_factor(f"table {name!r}", getattr(params, "load_factor", None))
    sharding_types = getattr(constraints, "sharding_types", None)
    types = list(SHARDING_TYPES.values())
    if sharding_types is not None:
        types = [_spec_class(_value(t), name) for t in sharding_types]
    min_partition = getattr(constraints, "min_partition", None)
    if min_partition is not None and ColumnWise in types:
        widths = [hi - lo for lo, hi in chunk_bounds(table.embedding_dim, axis.size)]
        if min(widths) < min_partition:
            types.remove(ColumnWise)
            if not types:
                raise ValueError(
                    f"table {name!r}: TorchRec constraints allow only column_wise, but "
                    f"embedding_dim {table.embedding_dim} over {axis.size} shard positions "
                    f"gives columns of {min(widths)} < min_partition {min_partition}"
                )
    factors = getattr(constraints, "pooling_factors", None)
    if cache_fraction is not None:
        types = [t for t in types if t is not DataParallel]
        if not types:
            raise ValueError(
                f"table {name!r}: TorchRec constraints allow only data_parallel with compute "
                f"kernel {CACHING_KERNEL!r}; a replicated table cannot be offloaded"
            )
    restricted = sharding_types is not None or min_partition is not None
    return TableConstraint(
        types=tuple(types) if restricted or cache_fraction is not None else None,
        pooling_factor=float(fmean(factors)) if factors else None,
        cache_fraction=cache_fraction,
    )


def _value(item: object) -> object:
    """An enum's value (TorchRec's ``ShardingType.ROW_WISE``), else the item itself."""
    value = getattr(item, "value", None)
    return value if isinstance(value, str) else item


def _spec_class(sharding_type: object, table: str) -> type[TableSpec]:
    if sharding_type not in SHARDING_TYPES:
        raise ValueError(
            f"table {table!r}: TorchRec sharding type {sharding_type!r} has no dtrec spec; "
            f"dtrec has {list(SHARDING_TYPES)}"
        )
    return SHARDING_TYPES[sharding_type]


_FP_INNER = "{prefix}_embedding_bag_collection.{table}"
"""Where a ``FeatureProcessedEmbeddingBagCollection``'s tables are (its inner collection)."""


def from_torchrec_plan(
    plan: Mapping[str, Mapping[str, object]],
    tables: Mapping[str, EmbeddingBagConfig],
    mesh: DeviceMesh,
) -> dict[str, TableSpec]:
    """``{table fqn: spec}`` for a TorchRec ``ShardingPlan``'s ``plan`` (module path ->
    module plan) on this mesh (module doc)."""
    axis = shard_axis(mesh)
    ranks = mesh.mesh.tolist()  # [S][R] global ranks
    position_of = {r: (p, c) for p, row in enumerate(ranks) for c, r in enumerate(row)}
    entries: list[tuple[str, object]] = []
    for module_path, module_plan in plan.items():
        for table, sharding in module_plan.items():
            key = f"{module_path}.{table}" if module_path else table
            if key not in tables:  # TorchRec plans a feature-processed collection at its
                # own path; its tables are its inner collection's
                key = _FP_INNER.format(prefix=f"{module_path}." if module_path else "", table=table)
            if key not in tables:
                raise KeyError(
                    f"TorchRec plan names table {table!r} of module {module_path!r}, which is "
                    f"no table of the model; the model's tables are {sorted(tables)}"
                )
            entries.append((key, sharding))
    all_ranks = [r for _, s in entries for r in (s.ranks or [])]  # type: ignore[attr-defined]
    world_ranks = any(r >= axis.size for r in all_ranks)
    specs: dict[str, TableSpec] = {}
    for key, sharding in entries:
        kind = _value(getattr(sharding, "sharding_type", None))
        kernel = _value(getattr(sharding, "compute_kernel", None))
        if kernel not in COMPUTE_KERNELS:
            raise ValueError(
                f"TorchRec plan entry {key!r}: compute kernel {kernel!r} is not one dtrec has "
                f"({list(COMPUTE_KERNELS)}; pass a dtrec.optim optimizer for fused updates)"
            )
        cls = _spec_class(kind, key)
        cache = _cache_of(key, kind, kernel, sharding)
        if cls is DataParallel:
            specs[key] = DataParallel()
            continue
        shards = _shards(key, tables[key], sharding, world_ranks, position_of)
        specs[key] = _spec_for(key, tables[key], cls, sharding, shards, axis, cache)
    return specs


def _cache_of(key: str, kind: object, kernel: object, sharding: object) -> dict[str, float]:
    """The spec's cache fields for a plan entry: ``cache_fraction`` = its cache load factor
    under the UVM caching kernel (TorchRec's default 0.2 when it gives none), else none."""
    if kernel != CACHING_KERNEL:
        return {}
    if kind == "data_parallel":
        raise ValueError(
            f"TorchRec plan entry {key!r}: data_parallel with compute kernel {kernel!r}; a "
            "replicated table cannot be offloaded (dtrec offloads sharded tables only)"
        )
    params = getattr(sharding, "cache_params", None)
    factor = _load_factor(f"TorchRec plan entry {key!r}", getattr(params, "load_factor", None))
    return {"cache_fraction": factor}


def _load_factor(what: str, factor: object) -> float:
    """A cache load factor as a cache fraction (TorchRec's default when None)."""
    factor = DEFAULT_CACHE_LOAD_FACTOR if factor is None else factor
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ValueError(f"{what}: cache load factor must be in (0, 1], got {factor!r}")
    return float(factor)


def _shards(
    key: str,
    table: EmbeddingBagConfig,
    sharding: object,
    world_ranks: bool,
    position_of: dict[int, tuple[int, int]],
) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """The plan's blocks of one table as (shard position, rows, cols), one replica group's."""
    ranks = list(getattr(sharding, "ranks", None) or [])
    spec = getattr(sharding, "sharding_spec", None)
    metas = list(getattr(spec, "shards", None) or [])
    if not metas:  # no sharding spec: the whole table on each listed rank
        full = ([0, 0], [table.num_embeddings, table.embedding_dim])
        metas_as = [full] * len(ranks)
    else:
        metas_as = [(list(m.shard_offsets), list(m.shard_sizes)) for m in metas]
    if len(metas_as) != len(ranks):
        raise ValueError(
            f"TorchRec plan entry {key!r}: {len(ranks)} ranks for {len(metas_as)} shards"
        )
    by_group: dict[int, list[tuple[int, tuple[int, int], tuple[int, int]]]] = {}
    for rank, (offsets, sizes) in zip(ranks, metas_as, strict=True):
        if rank not in position_of:
            raise ValueError(
                f"TorchRec plan entry {key!r}: rank {rank} is not in the mesh {sorted(position_of)}"
            )
        position, group = position_of[rank] if world_ranks else (rank, 0)
        rows = (offsets[0], offsets[0] + sizes[0])
        cols = (offsets[1], offsets[1] + sizes[1])
        if rows[1] > rows[0] and cols[1] > cols[0]:
            by_group.setdefault(group, []).append((position, rows, cols))
    groups = list(by_group.values())
    if any(sorted(g) != sorted(groups[0]) for g in groups[1:]):
        raise ValueError(
            f"TorchRec plan entry {key!r}: ranks {ranks} place the table differently in "
            f"different replica groups ({sorted(by_group.items())}); dtrec places a table "
            "alike in every replica group"
        )
    return sorted(groups[0]) if groups else []


def _spec_for(
    key: str,
    table: EmbeddingBagConfig,
    cls: type[TableSpec],
    sharding: object,
    shards: list[tuple[int, tuple[int, int], tuple[int, int]]],
    axis: ShardAxis,
    cache: dict[str, float],
) -> TableSpec:
    """A spec (with ``cache``'s fields) whose blocks on this mesh are exactly ``shards``: of
    class ``cls``, or one laying out the same blocks (a column-wise entry of a single full
    block is table-wise)."""
    kind = _value(getattr(sharding, "sharding_type", None))
    candidates = _candidates(key, table, cls, shards, axis, cache)
    last: tuple[TableSpec, list] | None = None
    for spec in candidates:
        try:
            layout = spec.layout(table, axis)
        except ValueError as exc:
            if len(candidates) == 1:
                raise ValueError(f"TorchRec plan entry {key!r} ({kind}): {exc}") from None
            continue
        ours = sorted((b.position, b.rows, b.cols) for b in layout.blocks)
        if ours == shards:
            return spec
        last = (spec, ours)
    why = ""
    if cls is ColumnWise:
        by_columns = sorted(shards, key=lambda s: s[2])
        positions = [p for p, _, _ in by_columns]
        widths = [cols[1] - cols[0] for _, _, cols in by_columns]
        why = (
            f"; dtrec's ColumnWise holds one block per shard position, the columns in "
            f"torch.chunk widths over increasing positions (torch orders a sub-mesh's process "
            f"group by rank); TorchRec's blocks, in column order, have widths {widths} at "
            f"positions {positions}"
        )
    tried = (
        f", which dtrec's {last[0]!r} does not reproduce on this mesh ({last[1]})" if last else ""
    )
    raise ValueError(
        f"TorchRec plan entry {key!r} ({kind}, ranks {getattr(sharding, 'ranks', None)}) "
        f"has blocks (position, rows, cols) {shards}{tried}{why}; use a dtrec spec for this "
        "table instead"
    )


def _candidates(
    key: str,
    table: EmbeddingBagConfig,
    cls: type[TableSpec],
    shards: list[tuple[int, tuple[int, int], tuple[int, int]]],
    axis: ShardAxis,
    cache: dict[str, float],
) -> list[TableSpec]:
    """The specs (with ``cache``'s fields) that may lay out a ``cls`` entry's blocks, most
    specific last."""
    first = shards[0][0] if shards else 0
    if cls is TableWise:
        return [TableWise(rank=first, **cache)]
    if cls is TableRowWise:
        if axis.per_node is None:
            raise ValueError(
                f"TorchRec plan entry {key!r}: table_row_wise needs a node-aware mesh; build "
                "it with dtrec.init_mesh(..., node_size=N)"
            )
        return [TableRowWise(node=first // axis.per_node, **cache)]
    if cls is ColumnWise:  # column_wise and table_column_wise, as TorchRec's planner cuts them
        whole = [(first, (0, table.num_embeddings), (0, table.embedding_dim))]
        single = [TableWise(rank=first, **cache)] if shards == whole else []
        by_columns = tuple(p for p, _, _ in sorted(shards, key=lambda s: s[2]))
        return [*single, ColumnWise(**cache), ColumnWise(positions=by_columns, **cache)]
    return [cls(**cache)]  # type: ignore[call-arg]
