"""Sharding plans: table FQN -> spec, and a simple balancing planner.

``plan`` here balances stored bytes per shard position greedily (largest table
first onto the least-loaded choice). It resolves the choices users leave open
(``TableWise(rank=None)``, ``TableRowWise(node=None)``) and fills in tables a
user plan omits. A cost-model planner replaces the heuristic later; the
interface stays.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dtrec.config import EmbeddingBagConfig
from dtrec.mesh import ShardAxis, shard_axis
from dtrec.placements import TableSpec, TableWise


class ShardingPlan(dict[str, TableSpec]):
    """``{"<module fqn>.<table name>": spec}``, printable.

    Example::

        plan = ShardingPlan({"sparse.t0": RowWise(), "sparse.t1": TableWise(rank=0)})
    """

    def __str__(self) -> str:
        width = max((len(k) for k in self), default=0)
        return "\n".join(f"{k:<{width}}  {spec}" for k, spec in self.items())


def find_collections(model: nn.Module) -> dict[str, nn.Module]:
    """FQN -> every unsharded ``EmbeddingBagCollection`` in ``model`` (outermost only)."""
    from dtrec.modules import EmbeddingBagCollection

    found: dict[str, nn.Module] = {}
    for fqn, module in model.named_modules():
        if isinstance(module, EmbeddingBagCollection) and not any(
            fqn.startswith(f + ".") or f == "" for f in found
        ):
            found[fqn] = module
    return found


def table_fqn(collection_fqn: str, table: str) -> str:
    """The plan key of a table: ``"<collection fqn>.<table name>"`` (just the name at the root)."""
    return f"{collection_fqn}.{table}" if collection_fqn else table


def model_tables(model: nn.Module) -> dict[str, EmbeddingBagConfig]:
    """Plan key -> table config, over every collection of ``model``."""
    return {
        table_fqn(fqn, cfg.name): cfg
        for fqn, ebc in find_collections(model).items()
        for cfg in ebc.embedding_bag_configs()
    }


def _position_bytes(spec: TableSpec, cfg: EmbeddingBagConfig, axis: ShardAxis) -> dict[int, int]:
    load: dict[int, int] = {}
    for block in spec.layout(cfg, axis).blocks:
        load[block.position] = load.get(block.position, 0) + block.numel
    return load


def plan(
    model: nn.Module,
    mesh: DeviceMesh,
    constraints: Mapping[str, TableSpec] | None = None,
    topology: object | None = None,
) -> ShardingPlan:
    """A complete plan for every table of ``model`` on ``mesh``.

    ``constraints`` pins specs per table FQN; an unresolved pinned spec (e.g.
    ``TableWise(rank=None)``) gets its rank chosen here, and unpinned tables
    become table-wise on the least-loaded position. Deterministic, so every
    rank computes the same plan. ``topology`` is reserved for the cost model.

    Example::

        p = dtrec.plan(model, mesh, constraints={"sparse.big": RowWise()})
    """
    axis = shard_axis(mesh)
    tables = model_tables(model)
    constraints = dict(constraints or {})
    check_plan_keys(constraints, tables)
    load = [0] * axis.size
    chosen: dict[str, TableSpec] = {}
    order = sorted(tables, key=lambda k: (-tables[k].num_embeddings * tables[k].embedding_dim, k))
    # Fixed specs first, so open choices balance around them.
    for key in sorted(order, key=lambda k: not (k in constraints and constraints[k].resolved)):
        cfg = tables[key]
        pinned = constraints.get(key, TableWise())
        candidates = pinned.candidates(axis)
        best, best_cost = candidates[0], None
        for spec in candidates:
            bytes_at = _position_bytes(spec, cfg, axis)
            cost = max(load[p] + bytes_at.get(p, 0) for p in range(axis.size))
            if best_cost is None or cost < best_cost:
                best, best_cost = spec, cost
        for p, n in _position_bytes(best, cfg, axis).items():
            load[p] += n
        chosen[key] = best
    return ShardingPlan({key: chosen[key] for key in tables})


def check_plan_keys(plan: Mapping[str, object], tables: Mapping[str, EmbeddingBagConfig]) -> None:
    """Every key names a table of the model and every value is a spec."""
    unknown = [k for k in plan if k not in tables]
    if unknown:
        raise KeyError(
            f"plan names unknown table(s) {unknown}; the model's tables are {sorted(tables)}"
        )
    for key, spec in plan.items():
        if not isinstance(spec, TableSpec):
            raise TypeError(f"plan entry {key!r}: expected a dtrec.placements spec, got {spec!r}")
