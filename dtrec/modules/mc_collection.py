"""Managed-collision collections: remap each table's raw ids, then look them up.

``ManagedCollisionCollection`` holds one remapper per table
(``MCHManagedCollisionModule``) and turns a batch of raw ids into a batch of rows;
``ManagedCollisionEmbeddingBagCollection`` feeds that batch to a pooled
``EmbeddingBagCollection``, ``ManagedCollisionEmbeddingCollection`` to a sequence
``EmbeddingCollection``. Names, constructor arguments, the ``(pooled,
remapped or None)`` output and state-dict keys are TorchRec's unsharded
modules', so checkpoints load both ways.

Unlike TorchRec's unsharded module (whose ``evict`` is a no-op), rows whose id
was evicted are reset before the lookup that first uses them: their weights to
fresh values of the table's init (``dtrec.modules.init.reset_rows_init``, the same
on every rank and under any sharding; a TorchRec config's ``init_fn`` when it has
one), then every eviction hook runs (optimizer state:
``reset_torch_optimizer_rows`` for a torch optimizer, ``FusedOptimizer.reset_rows``
for a fused one).

Example::

    tables = [EmbeddingBagConfig("user", 1000, 16, ["user_id"])]
    mc_ebc = ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(tables),
        ManagedCollisionCollection(
            {"user": MCHManagedCollisionModule(1000, eviction_policy=LFU(),
                                               eviction_interval=10)},
            tables,
        ),
        return_remapped_features=True,
    )
    pooled, remapped = mc_ebc(kjt)      # kjt holds raw 64-bit ids
    opt = torch.optim.Adam(mc_ebc.parameters())
    mc_ebc.register_eviction_hook(
        lambda table, rows: reset_torch_optimizer_rows(opt, mc_ebc.table_weight(table), rows))
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from dtrec._torch_compat import local_shape_and_offset
from dtrec.modules.config import EmbeddingBagConfig, as_bag_config
from dtrec.modules.embedding import (
    EmbeddingCollection,
    EmbeddingConfig,
    as_sequence_config,
    is_torchrec_sequence_config,
)
from dtrec.modules.embedding_bag import EmbeddingBagCollection
from dtrec.modules.features import feature_order, prepare_features
from dtrec.modules.init import reset_rows_init, uniform_init_bounds
from dtrec.modules.managed_collision import MCHManagedCollisionModule
from dtrec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor

EvictionHook = Callable[[str, Tensor], None]


def _table_config(cfg: object) -> EmbeddingBagConfig | EmbeddingConfig:
    """dtrec's config for a pooled or sequence table config (dtrec's or TorchRec's)."""
    if isinstance(cfg, EmbeddingConfig) or is_torchrec_sequence_config(cfg):
        return as_sequence_config(cfg)
    return as_bag_config(cfg)


class ManagedCollisionCollection(nn.Module):
    """One remapper per table: raw ids in, rows out (TorchRec's class of that name).

    A table's features are remapped together, as one step of its remapper: a table
    read by two features counts both features' ids.
    """

    def __init__(
        self,
        managed_collision_modules: Mapping[str, MCHManagedCollisionModule],
        embedding_configs: Sequence[object],
    ) -> None:
        super().__init__()
        self._embedding_configs = list(embedding_configs)
        self._tables = [_table_config(cfg) for cfg in self._embedding_configs]
        for cfg in self._tables:
            mc = managed_collision_modules.get(cfg.name)
            if not isinstance(mc, MCHManagedCollisionModule):
                got = "none" if mc is None else type(mc).__name__
                raise TypeError(
                    f"table {cfg.name!r}: managed_collision_modules needs a dtrec "
                    f"MCHManagedCollisionModule for it, got {got}"
                )
            if mc.output_size() != cfg.num_embeddings:
                raise ValueError(
                    f"table {cfg.name!r}: zch_size {mc.output_size()} of its managed collision "
                    f"module must equal num_embeddings {cfg.num_embeddings}"
                )
        extra = set(managed_collision_modules) - {cfg.name for cfg in self._tables}
        if extra:
            raise KeyError(f"managed collision modules {sorted(extra)} name no table")
        self._managed_collision_modules = nn.ModuleDict(
            {cfg.name: managed_collision_modules[cfg.name] for cfg in self._tables}
        )

    def embedding_configs(self) -> list[object]:
        """The table configs, as given."""
        return list(self._embedding_configs)

    def forward(self, features: object) -> KeyedJaggedTensor:
        """The batch in the tables' feature order with each id replaced by its row.

        One host sync (the per-feature id counts, to cut the ids by table)."""
        kjt = prepare_features(features, self._tables, bounds_check="off")
        counts = kjt.length_per_key()
        rows, at = [], 0
        for cfg in self._tables:
            n = sum(counts[at : at + len(cfg.feature_names)])
            start = sum(counts[:at])
            at += len(cfg.feature_names)
            rows.append(self._managed_collision_modules[cfg.name](kjt.values()[start : start + n]))
        values = torch.cat(rows) if len(rows) != 1 else rows[0]
        return kjt.with_values(values)

    def evict(self) -> dict[str, Tensor | None]:
        """Per table, the rows whose id changed since the last call (None: none)."""
        return {name: mc.evict() for name, mc in self._managed_collision_modules.items()}

    def open_slots(self) -> dict[str, Tensor]:
        """Per table, rows no id holds yet."""
        return {name: mc.open_slots() for name, mc in self._managed_collision_modules.items()}


class ManagedCollisionLookup(nn.Module):
    """A pooled or sequence collection looked up by raw ids through managed collision:
    what ``ManagedCollisionEmbeddingBagCollection`` and ``ManagedCollisionEmbeddingCollection``
    share (``distribute_module`` shards either; the remap and eviction are the same)."""

    _kind = "collection"
    _tables_attr = "embedding_bags"

    def __init__(
        self,
        embedding_module: EmbeddingBagCollection | EmbeddingCollection,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        reset_seed: int = 0,
    ) -> None:
        super().__init__()
        tables = self._configs_of(embedding_module)
        mc_tables = [_table_config(c) for c in managed_collision_collection.embedding_configs()]
        if feature_order(tables) != feature_order(mc_tables) or [
            (c.name, c.num_embeddings) for c in tables
        ] != [(c.name, c.num_embeddings) for c in mc_tables]:
            raise ValueError(
                f"the {self._kind} and the ManagedCollisionCollection must have the "
                f"same tables and features: {[c.name for c in tables]} vs "
                f"{[c.name for c in mc_tables]}"
            )
        self._managed_collision_collection = managed_collision_collection
        self._embedding_module = embedding_module
        self._return_remapped_features = return_remapped_features
        self._reset_seed = reset_seed
        # an OrderedDict: RemovableHandle holds it by weak reference, as torch's hooks
        self._eviction_hooks: OrderedDict[int, EvictionHook] = OrderedDict()
        # a TorchRec config's init_fn: uniform(a, b) (TorchRec's default) is redrawn by the
        # counter-based hash with its bounds; any other is called (torch's global generator)
        self._init_fns: dict[str, Callable[[Tensor], object] | None] = {}
        self._init_bounds: dict[str, tuple[float, float] | None] = {}
        for cfg in tables:
            init_fn = embedding_module.table_init_fn(cfg.name)
            self._init_bounds[cfg.name] = uniform_init_bounds(init_fn)
            self._init_fns[cfg.name] = None if self._init_bounds[cfg.name] else init_fn

    def _configs_of(self, module: nn.Module) -> list:
        raise NotImplementedError

    def table_weight(self, table: str) -> Tensor:
        """Table ``table``'s weight parameter (KeyError naming it if absent)."""
        tables = getattr(self._embedding_module, self._tables_attr)
        if table not in tables:
            raise KeyError(f"no table {table!r}; tables: {list(tables)}")
        return tables[table].weight

    def register_eviction_hook(self, hook: EvictionHook) -> RemovableHandle:
        """Call ``hook(table, rows)`` after evicted ``rows`` of ``table`` were reset and
        before they are looked up: reset the optimizer state of those rows there."""
        handle = RemovableHandle(self._eviction_hooks)
        self._eviction_hooks[handle.id] = hook
        return handle

    def forward(
        self, features: object, mutate_miss_lengths: bool = True
    ) -> tuple[KeyedTensor | dict[str, JaggedTensor], KeyedJaggedTensor | None]:
        """``mutate_miss_lengths`` is TorchRec's argument, accepted for drop-in calls; as in
        TorchRec's MCH module it changes nothing (misses go to the miss row)."""
        remapped = self._managed_collision_collection(features)
        self._reset_evicted(self._managed_collision_collection.evict())
        pooled = self._embedding_module(remapped)
        return pooled, remapped if self._return_remapped_features else None

    def share_windows(self, group: ProcessGroup | None) -> None:
        """Evict over every rank of ``group``'s ids (``MCHManagedCollisionModule.share_window``):
        what ``distribute_module`` sets, so that every rank makes the unsharded decisions."""
        for mc in self._managed_collision_collection._managed_collision_modules.values():
            mc.share_window(group)

    def tables_with_init_fn(self) -> list[str]:
        """Tables reset by a TorchRec ``init_fn`` other than uniform(a, b) (torch's global
        generator: not the same draws on every rank, so such tables cannot be distributed)."""
        return [name for name, fn in self._init_fns.items() if fn is not None]

    def _reset_evicted(self, evictions: Mapping[str, Tensor | None]) -> None:
        for table, rows in evictions.items():
            if rows is None or rows.numel() == 0:
                continue
            self._embedding_module.reset_rows(table, rows, self._row_values(table))
            for hook in list(self._eviction_hooks.values()):
                hook(table, rows)

    def _row_values(self, table: str) -> Callable[[Tensor, tuple[int, int]], Tensor]:
        """The values evicted rows of ``table`` get at this step: (rows, cols) -> values."""
        weight = self.table_weight(table)
        num_rows, dim, dtype = weight.shape[0], weight.shape[1], weight.dtype
        init_fn = self._init_fns.get(table)
        if init_fn is not None:  # a TorchRec config's init: torch's global generator

            def drawn(rows: Tensor, cols: tuple[int, int]) -> Tensor:
                fresh = torch.empty(rows.numel(), dim, dtype=dtype, device=rows.device)
                out = init_fn(fresh)
                return (fresh if out is None else out)[:, cols[0] : cols[1]]

            return drawn
        mc = self._managed_collision_collection._managed_collision_modules[table]
        step, seed = mc.current_iter, self._reset_seed

        bounds = self._init_bounds.get(table)

        def hashed(rows: Tensor, cols: tuple[int, int]) -> Tensor:
            return reset_rows_init(table, num_rows, dim, rows, step, seed, cols, dtype, bounds)

        return hashed


class ManagedCollisionEmbeddingBagCollection(ManagedCollisionLookup):
    """A pooled collection looked up by raw ids through managed collision.

    ``forward(kjt)`` returns ``(KeyedTensor, remapped KJT or None)`` (the remapped batch
    when ``return_remapped_features``), as TorchRec's module does. ``reset_seed`` keys the
    values evicted rows are reset to.
    """

    _kind = "EmbeddingBagCollection"
    _tables_attr = "embedding_bags"

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        reset_seed: int = 0,
    ) -> None:
        super().__init__(
            embedding_bag_collection,
            managed_collision_collection,
            return_remapped_features,
            reset_seed,
        )

    def _configs_of(self, module: nn.Module) -> list:
        if not isinstance(module, EmbeddingBagCollection):
            raise TypeError(
                "embedding_bag_collection must be a dtrec EmbeddingBagCollection, got "
                f"{type(module).__name__}"
            )
        return module.embedding_bag_configs()


class ManagedCollisionEmbeddingCollection(ManagedCollisionLookup):
    """A sequence (unpooled) collection looked up by raw ids through managed collision.

    ``forward(kjt)`` returns ``({feature: JaggedTensor of rows}, remapped KJT or None)``, as
    TorchRec's ``ManagedCollisionEmbeddingCollection`` does; state-dict keys are its
    (``_embedding_module.embeddings.<table>.weight``).

    Example::

        tables = [EmbeddingConfig("item", 1000, 16, ["history"])]
        mc_ec = ManagedCollisionEmbeddingCollection(
            EmbeddingCollection(tables),
            ManagedCollisionCollection(
                {"item": MCHManagedCollisionModule(1000, eviction_policy=LFU(),
                                                   eviction_interval=10)},
                tables,
            ),
        )
        rows, _ = mc_ec(kjt)            # rows["history"].values(): [ids, 16]
    """

    _kind = "EmbeddingCollection"
    _tables_attr = "embeddings"

    def __init__(
        self,
        embedding_collection: EmbeddingCollection,
        managed_collision_collection: ManagedCollisionCollection,
        return_remapped_features: bool = False,
        reset_seed: int = 0,
    ) -> None:
        super().__init__(
            embedding_collection, managed_collision_collection, return_remapped_features, reset_seed
        )

    def _configs_of(self, module: nn.Module) -> list:
        if not isinstance(module, EmbeddingCollection):
            raise TypeError(
                "embedding_collection must be a dtrec EmbeddingCollection, got "
                f"{type(module).__name__}"
            )
        return module.embedding_configs()


MANAGED_COLLISION_MODULES = (
    ManagedCollisionLookup,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
"""dtrec's managed-collision modules: ``distribute_module`` shards the collection and
refuses the other two outside one."""


@torch.no_grad()
def reset_torch_optimizer_rows(
    optimizer: torch.optim.Optimizer, param: Tensor, rows: Tensor
) -> None:
    """Zero the per-row state (``exp_avg``, ``sum``, ``momentum_buffer``...) of ``rows`` of
    ``param`` in a torch optimizer; scalar state (``step``) stays.

    ``param`` may be a distributed table's DTensor weight (its state then DTensors placed
    alike): ``rows`` are global, the same list on every rank, and each rank zeroes those
    its block holds (torch's ``Shard`` offsets: row-wise, table-wise, column-wise)."""
    local_rows = rows
    if isinstance(param, DTensor):
        shape, offset = local_shape_and_offset(param.shape, param.device_mesh, param.placements)
        if not shape or 0 in shape:  # no block of this table here (table-wise elsewhere)
            return
        r0, r1 = offset[0], offset[0] + shape[0]
        local_rows = rows[(rows >= r0) & (rows < r1)] - r0
    for value in optimizer.state.get(param, {}).values():
        if isinstance(value, Tensor) and value.dim() and value.shape[0] == param.shape[0]:
            local = value.to_local() if isinstance(value, DTensor) else value
            local[local_rows.to(local.device)] = 0


__all__ = [
    "ManagedCollisionCollection",
    "ManagedCollisionEmbeddingBagCollection",
    "ManagedCollisionEmbeddingCollection",
    "ManagedCollisionLookup",
    "reset_torch_optimizer_rows",
]
