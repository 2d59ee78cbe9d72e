"""The step of a sharding group of one rank: nothing moves, nothing is routed.

When the "shard" axis has one position (a world of one rank, or replicas only: S=1),
every table is whole on this rank and serves this rank's batch alone (the layout of a
table-wise table whose owner holds the whole batch): the header, ids and output
all-to-alls and the bucketize have nothing to do. One op call pools every feature of
the batch as it came (features in output order, mean pooling and per-sample weights in
the op, the kernels' bounds check), and its output is the collection's.

The bad-batch contract (a bad batch fails on every rank before any weight changes):

* checks on the host (a missing feature, weights on a mean-pooled table, ...) raise in
  forward (kept, not raised, when the batch is only prefetched);
* ids outside their table, with replicas (W > 1): the lookup kernel flags them on the
  device and the flag joins the host verdict in one all-reduce over the replicas (one host
  read per step), so every rank raises in forward, before any update;
* ids outside their table, in a world of one rank with a fused optimizer on a backend
  that skips bad ids (Triton, CUDA's): no collective carries a verdict and a host read
  would stall the step, so the kernel sets a sticky device flag (``HostFlag``), the bad
  ids pool as zero rows, the fused update writes nothing while the flag is set, and the
  first forward after the device has finished that batch (usually the next) raises its
  IndexError (so does ``check_pending_batches``). No table or fused optimizer state
  changes from the bad batch on (Adam's step count still advances); the dense part's
  optimizer, the caller's, has stepped once on its output;
* otherwise (no fused optimizer, or a backend that reads ids on the host anyway) ids are
  checked on the host in forward, as in the routed path.

Offloaded tables (``dtrec.sharded.offload``) are read through their device caches here
too: before the op call the batch is filled (or was, by ``fill`` for a prefetched batch)
and their ids become cache slots. In a world of one rank whose lookup kernel checks ids,
the fill reads nothing on the host either: an id outside its table, or a batch whose rows
do not fit a cache, reads an out-of-range slot, the kernel flags the batch as above, and
a later forward reports it (an IndexError, or the cache's ValueError naming the table).
Otherwise ids are checked on the host, and with replicas the batch verdict is all-reduced
before the lookup (a refused batch fills nothing; the fill's own verdict follows on every
rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from dtrec.comm.collectives import all_reduce_min
from dtrec.modules.config import EmbeddingBagConfig
from dtrec.modules.features import check_id_range, feature_order, prepare_features
from dtrec.ops.backends.registry import resolve_backend
from dtrec.ops.host_flags import HostFlag
from dtrec.ops.op import EmbeddingBagFunction
from dtrec.placements import TableLayout
from dtrec.placements.mesh import mesh_device
from dtrec.sharded.dist.groups import world_group
from dtrec.sharded.dist.routing import Routing
from dtrec.sharded.offload import OffloadedTables
from dtrec.sharded.update.fused_update import FusedUpdater, fused_lookup
from dtrec.sparse import KeyedJaggedTensor, KeyedTensor


@dataclass
class LocalBatch:
    """A batch for the one-rank step: its features in output order, or why it was refused
    (raised by forward); ``device_check``: its ids are checked by the lookup kernel."""

    kjt: KeyedJaggedTensor | None
    error: Exception | None
    device_check: bool = False
    op_check: bool = False
    """Its ids are checked inside the lookup op (under ``torch.compile``: no host read
    is traced; an IndexError raised by the op, before any update)."""


def serves_locally(routing: Routing, layouts: list[TableLayout]) -> bool:
    """Whether the shard axis has one position and every table is one block there (its
    blocks cover it once, so that block is the whole table)."""
    return routing.shard_size == 1 and all(
        t in routing.data_parallel_tables or len(layout.blocks) == 1
        for t, layout in enumerate(layouts)
    )


class LocalPath:
    """Input, lookup and output of a collection whose shard axis has one position."""

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        routing: Routing,
        updater: FusedUpdater | None,
        mesh: DeviceMesh,
        offload: OffloadedTables | None = None,
    ) -> None:
        self._tables = tables
        self._updater = updater
        self._offload = offload
        self._mesh = mesh
        self.world_size = mesh.size()
        """Ranks of the mesh (1: no collective in the step, ``torch.compile`` traces it)."""
        self._device = mesh_device(mesh)
        slots = routing.slots
        self._table_ids = sorted({slot.table for slot in slots})
        index = {t: i for i, t in enumerate(self._table_ids)}
        self._entry_table = [index[slot.table] for slot in slots]
        self._mean = [tables[slot.table].pooling == "mean" for slot in slots]
        self._keys = feature_order(tables)
        self._dims = [slot.dim for slot in slots]
        self._run_tables = [slot.table for slot in slots]  # each feature's ids: one run
        self._flag: HostFlag | None = None
        self._calls = 0

    def start(self, features: object, bounds_check: str, weighted: bool | None) -> LocalBatch:
        """Validate ``features`` (``prepare_features``); a refusal is kept, not raised."""
        rank = dist.get_rank()
        try:
            kjt = prepare_features(features, self._tables, rank, "off", self._device, weighted)
            device_check = (
                bounds_check == "on"
                and not torch.compiler.is_compiling()  # the op checks them (``op_check``)
                and (self._offload is None or self.world_size == 1)
                and self._checks_on_device(kjt)
            )
            on_host = bounds_check == "on" and not device_check
            op_check = on_host and torch.compiler.is_compiling()  # no host read traced
            if on_host and not op_check:
                check_id_range(kjt, self._tables, rank)
        except (KeyError, ValueError, IndexError, TypeError) as exc:
            return LocalBatch(None, exc)
        return LocalBatch(kjt, None, device_check, op_check)

    def _checks_on_device(self, kjt: KeyedJaggedTensor) -> bool:
        """Whether the lookup kernel checks this batch's ids (see the module docstring)."""
        weights = kjt.weights_or_none()
        trained = weights is not None and weights.requires_grad and torch.is_grad_enabled()
        backend = resolve_backend(kjt.values().device)
        return self._updater is not None and backend.capabilities.skips_bad_ids and not trained

    def forward(self, batch: LocalBatch, local: dict[int, Tensor]) -> KeyedTensor:
        """The collection's output for ``batch``; raises a refusal (on every replica) or the
        error of an earlier bad batch (one rank)."""
        if not torch.compiler.is_compiling():  # a traced int would guard on every value
            self._calls += 1  # names device-checked batches, which compiled steps have not
        self.report_bad_batches()
        if batch.error is not None and self.world_size == 1:
            raise batch.error
        agreed_first = self._offload is not None and self.world_size > 1
        if agreed_first:  # before the fill's collective (module docstring)
            try:
                self._verdict(batch, None)
            except (IndexError, ValueError):
                self._offload.drop(batch)  # a prefetched fill of the refused batch
                raise
        out, flag = None, None
        if batch.kjt is not None:
            kjt = batch.kjt
            if batch.device_check:
                flag = self._host_flag(kjt.values().device)
            out = self.lookup(kjt, local, None if flag is None else flag.flag, batch)
        if self.world_size > 1 and not agreed_first:
            self._verdict(batch, flag)
        elif flag is not None:
            flag.snapshot((batch.kjt, self._calls))
        assert out is not None
        return KeyedTensor(self._keys, self._dims, out)

    def lookup(
        self,
        kjt: KeyedJaggedTensor,
        local: dict[int, Tensor],
        error: Tensor | None,
        key: object = None,
    ) -> Tensor:
        """``[B, total dim]``: every feature of the batch pooled by one op call (fused: its
        backward feeds the updater), ids checked into ``error`` when given; offloaded
        tables' ids read their cache slots (the fill of ``key``, the batch, or one now)."""
        tables = [local[t] for t in self._table_ids]
        values, offsets, psw = kjt.values(), kjt.offsets(), kjt.weights_or_none()
        check = isinstance(key, LocalBatch) and key.op_check
        if self._offload is not None:
            values = self._offload.slot_ids(
                kjt if key is None else key, values, self._run_tables, kjt.lengths(),
                kjt.stride(), error is not None,
            )  # fmt: skip
        if self._updater is not None:
            return fused_lookup(
                self._updater, self._table_ids, tables, self._entry_table, self._mean, values,
                offsets, psw, error, check,
            )  # fmt: skip
        return EmbeddingBagFunction.apply(
            self._entry_table, self._mean, check, values, offsets, psw, *tables
        )

    def fill(self, batch: LocalBatch) -> None:
        """Fill offloaded tables' caches for a prefetched batch (``OffloadedTables.fill``).
        A batch refused here joins the fill's verdict with no ids (its peers' batches may
        be good; every rank raises at its forward, which drops the fill)."""
        if self._offload is None or (batch.kjt is None and self.world_size == 1):
            return
        if batch.kjt is None:
            none = torch.zeros(0, dtype=torch.long, device=self._device)
            self._offload.fill(batch, none, self._run_tables, none, 0)
            return
        kjt = batch.kjt
        self._offload.fill(
            batch, kjt.values(), self._run_tables, kjt.lengths(), kjt.stride(),
            batch.device_check,
        )  # fmt: skip

    def _overflow_report(self, kjt: KeyedJaggedTensor, call: int) -> str:
        """The late refusal of a batch whose rows did not fit an offloaded table's cache
        (a deferred fill: ``dtrec.sharded.offload.tables``)."""
        assert self._offload is not None
        detail = self._offload.overflow_detail(
            kjt.values(), self._run_tables, kjt.lengths(), kjt.stride()
        )
        return (
            f"{detail}, in the batch of forward call {call} of this collection: a one-rank "
            "world fills offloaded tables' caches without waiting for the device and reports "
            f"a batch that does not fit at a later forward (this is call {self._calls}); no "
            "table or fused optimizer state has changed since that batch"
        )

    def _host_flag(self, device: torch.device) -> HostFlag:
        if self._flag is None or self._flag.device != device:
            self._flag = HostFlag(device)
        return self._flag

    def _verdict(self, batch: LocalBatch, flag: HostFlag | None) -> None:
        """All-reduce over the replicas the lowest rank that refused its batch (on the host,
        or its ids on the device): one host read; raise on every rank if any did."""
        rank = dist.get_rank()
        own = torch.full((1,), rank if batch.error is not None else self.world_size,
                         dtype=torch.long, device=self._device)  # fmt: skip
        if flag is not None:
            own.masked_fill_(flag.flag[:1].to(own.device) != 0, rank)
        lowest = all_reduce_min(own.clone(), world_group(self._mesh), "input_dist.verdict")
        failed, mine = torch.cat([lowest, own]).tolist()
        if failed >= self.world_size:
            return
        if flag is not None:
            flag.clear()
        if batch.error is not None:
            raise batch.error
        if mine == rank:
            assert batch.kjt is not None
            check_id_range(batch.kjt, self._tables, rank)  # raises the detailed IndexError
        raise ValueError(
            f"rank {failed} rejected its input batch (see the error on that rank): every rank "
            "stops this step in forward, before any weight changes"
        )

    def report_bad_batches(self, wait: bool = False) -> None:
        """Raise the IndexError of an earlier batch whose ids the device found outside their
        table (a one-rank world with a fused optimizer: see the module docstring); ``wait``:
        wait for the device instead of looking only at the batches it has finished."""
        if self._flag is None:
            return
        for (kjt, call), (bad, _) in self._flag.ready(wait):
            if not bad:
                continue
            self._flag.clear()
            try:
                check_id_range(kjt, self._tables, dist.get_rank())
                detail = "an id outside its table"
            except IndexError as exc:
                detail = str(exc)
            else:
                if self._offload is not None:  # its ids fit their tables: its rows did not
                    raise ValueError(self._overflow_report(kjt, call))
            raise IndexError(
                f"{detail}, in the batch of forward call {call} of this collection: a "
                "one-rank world checks ids on the device and reports a bad batch at a later "
                f"forward (this is call {self._calls}); no table or fused optimizer state "
                "has changed since that batch"
            )
