"""Managed collision (zero-collision hashing): unbounded raw ids -> ``zch_size`` rows.

The remapper keeps the raw ids that own a row in a sorted array
(``_mch_sorted_raw_ids``, empty slots hold int64 max) and, position by position,
the row each owns (``_mch_remapped_ids_mapping``). A lookup is one
``searchsorted``: a kept id gets its row, any other id the reserved miss row
``zch_size - 1``. No host sync, no loop over ids.

Training batches are also recorded; every ``eviction_interval`` steps the window's
ids compete with the kept ones under the eviction policy
(``dtrec.modules.eviction``), winners take the losers' rows, and those rows are
reported by ``evict()`` so their embeddings and optimizer state can be reset. This
is the one place with host syncs (boolean masks), as in TorchRec.

Semantics, buffers and state-dict keys are TorchRec's ``MCHManagedCollisionModule``;
one difference: TorchRec records at most 1.25x the first batch's ids per window and
silently drops the rest, dtrec records the whole window.

Example::

    mc = MCHManagedCollisionModule(zch_size=1000, eviction_policy=LFU(), eviction_interval=10)
    rows = mc(raw_ids)          # int64 in [0, 1000); 999 for ids without a row
    evicted = mc.evict()        # None, or rows whose id changed at this step
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from dtrec.comm.collectives import all_gather_varied
from dtrec.modules.eviction import INT64_MAX, EvictionPolicy, as_policy, select_evictions
from dtrec.modules.features import check_bounds_mode
from dtrec.modules.remap_index import HashRemapIndex
from dtrec.modules.split_eviction import coalesce_window, split_admit
from dtrec.sparse import JaggedTensor

#: TorchRec's ``_output_segments_tensor`` length (up to 1024 row-wise segments)
_SEGMENTS = 1025


def remap_ids(values: Tensor, sorted_raw_ids: Tensor, rows: Tensor, miss_row: int) -> Tensor:
    """Row of each raw id: ``rows[i]`` where ``sorted_raw_ids[i] == id``, else ``miss_row``.

    ``sorted_raw_ids`` is ascending (int64); searching all but its last entry keeps every
    index in range, and the last entry still matches through the gather."""
    index = torch.searchsorted(sorted_raw_ids[:-1], values)
    hit = sorted_raw_ids[index] == values
    return torch.where(hit, rows[index], miss_row)


def _check_int(name: str, field: str, value: object, low: int, high: int = INT64_MAX) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"managed collision {name!r}: {field} must be an int, got {value!r}")
    if not low <= value <= high:
        raise ValueError(
            f"managed collision {name!r}: {field} must be in [{low}, {high}], got {value}"
        )
    return value


class MCHManagedCollisionModule(nn.Module):
    """Remaps raw int64 ids of one table into ``zch_size`` rows (TorchRec's MCH module).

    ``input_hash_size``: raw ids (after ``input_hash_func(ids, input_hash_size)`` when
    given) must lie in ``[0, input_hash_size)``; ``bounds_check="on"`` (default) checks it
    each step (one host sync), ``"off"`` trusts the caller. ``eviction_interval``: steps
    (training forwards) per eviction. Only training forwards are recorded and advance
    the step; evaluation only remaps.
    """

    _mch_sorted_raw_ids: Tensor
    _mch_remapped_ids_mapping: Tensor
    _current_iter_tensor: Tensor

    def __init__(
        self,
        zch_size: int,
        device: torch.device | str | None = None,
        *,
        eviction_policy: EvictionPolicy,
        eviction_interval: int,
        input_hash_size: int = INT64_MAX,
        input_hash_func: Callable[[Tensor, int], Tensor] | None = None,
        name: str | None = None,
        bounds_check: str = "on",
    ) -> None:
        super().__init__()
        label = name or "<unnamed>"
        self._name = name
        self._zch_size = _check_int(label, "zch_size", zch_size, 1)
        self._eviction_interval = _check_int(label, "eviction_interval", eviction_interval, 1)
        self._input_hash_size = _check_int(label, "input_hash_size", input_hash_size, 1)
        self._input_hash_func = input_hash_func
        self._eviction_policy = as_policy(eviction_policy)
        self.bounds_check = check_bounds_mode(bounds_check)
        device = torch.device("cpu") if device is None else torch.device(device)

        def buffer(name: str, value: Tensor, persistent: bool = True) -> None:
            self.register_buffer(name, value.to(device=device, dtype=torch.int64), persistent)

        segments = [0, zch_size] + [-1] * (_SEGMENTS - 2)
        buffer("_output_segments_tensor", torch.tensor(segments))
        buffer("_current_iter_tensor", torch.zeros(1))
        buffer("_mch_sorted_raw_ids", torch.full((zch_size,), INT64_MAX))
        buffer("_mch_remapped_ids_mapping", torch.arange(zch_size))
        for meta in self._eviction_policy.metadata:
            buffer(f"_mch_{meta}", torch.zeros(zch_size))

        # the step as a Python int (read from the buffer once, at the first training step)
        self._current_iter = -1
        self._last_eviction_iter = -1
        # the buffer's version after this module's own last write: any other write (a
        # checkpoint loaded in place) makes the next training step re-read the step
        self._iter_version = -1
        self._history: list[tuple[Tensor, int]] = []
        # a window summary (unique ids, counts, last access) carried over from a checkpoint
        # or a converted TorchRec module, merged into the next eviction
        self._carried: tuple[Tensor, Tensor, Tensor] | None = None
        self._evicted_rows: Tensor | None = None
        # the hash index of the map (remap's hot path) and the map's state it was built for
        self._index: HashRemapIndex | None = None
        self._index_key: tuple[int, ...] | None = None
        # set by share_window: the ranks whose batches form one global batch
        self._window_shared = False
        self._window_group: ProcessGroup | None = None
        #: a shared window's eviction is decided by raw-id range over its ranks
        #: (``dtrec.modules.split_eviction``; False: every rank decides everything alone,
        #: the same decisions)
        self.split_eviction = True
        self.register_load_state_dict_post_hook(_after_load)

    def share_window(self, group: ProcessGroup | None) -> None:
        """Evict over the ids every rank of ``group`` (None: the default group) saw, not
        only this rank's: each rank then makes the decisions the unsharded module makes on
        the global batch. Every rank of ``group`` must step it in lockstep: an eviction
        step all-gathers each rank's window summary (unique ids, counts, last access) and,
        with ``split_eviction`` (the default), each rank decides for its raw-id range and
        the ranks exchange the decisions (``dtrec.modules.split_eviction``)."""
        self._window_shared, self._window_group = True, group

    # -- what it is --------------------------------------------------------------------

    def output_size(self) -> int:
        """Rows of the table it feeds (the miss row included)."""
        return self._zch_size

    def input_size(self) -> int:
        """Raw ids lie in ``[0, input_size())``."""
        return self._input_hash_size

    @property
    def eviction_policy(self) -> EvictionPolicy:
        """The policy deciding which ids keep a row."""
        return self._eviction_policy

    @property
    def eviction_interval(self) -> int:
        """Training steps per eviction."""
        return self._eviction_interval

    @property
    def current_iter(self) -> int:
        """Training steps seen (checkpointed as ``_current_iter_tensor``)."""
        return self._current_iter if self._current_iter >= 0 else int(self._current_iter_tensor)

    def open_slots(self) -> Tensor:
        """Rows no id holds yet (the miss row excluded), as a 1-element tensor."""
        kept = self._mch_sorted_raw_ids
        used = torch.searchsorted(kept, torch.tensor([INT64_MAX], device=kept.device))
        return (self._zch_size - 1) - used

    # -- the three stages ---------------------------------------------------------------

    def preprocess(self, values: Tensor) -> Tensor:
        """Raw ids as the map keys them: int64, hashed by ``input_hash_func`` if given,
        checked against ``input_hash_size``."""
        values = values.to(torch.int64)
        if self._input_hash_func is not None:
            values = self._input_hash_func(values, self._input_hash_size).to(torch.int64)
        if self.bounds_check == "on" and values.numel():
            bad = (values < 0) | (values >= self._input_hash_size)
            if bool(bad.any()):
                first = int(values[bad][0])
                raise IndexError(
                    f"managed collision {self._name or '<unnamed>'!r}: id {first} outside "
                    f"[0, input_hash_size={self._input_hash_size}); hash unbounded ids with "
                    f"input_hash_func"
                )
        return values

    @torch.no_grad()
    def profile(self, values: Tensor) -> None:
        """Record one training step's ids; every ``eviction_interval`` steps, evict."""
        if not self.training:
            return
        if self._current_iter == -1 or self._current_iter_tensor._version != self._iter_version:
            self._reread_iter()
        self._current_iter += 1
        self._current_iter_tensor += 1
        self._iter_version = self._current_iter_tensor._version
        self._history.append((values, self._current_iter))
        if self._current_iter - self._last_eviction_iter == self._eviction_interval:
            self._evict_window()
            self._last_eviction_iter = self._current_iter

    def remap(self, values: Tensor) -> Tensor:
        """Each id's row (``remap_ids``): no host sync.

        A map indexed when it changed (``_build_index``: at an eviction when
        ``eviction_interval > 1``, at a load) is looked up in its ``HashRemapIndex`` (a few
        contiguous reads per id instead of a binary search); any other (evicting every
        step, written from outside since) by searching the sorted ids."""
        kept, rows = self._mch_sorted_raw_ids, self._mch_remapped_ids_mapping
        if self._index is not None and self._index_key == self._map_state():
            return self._index.lookup(values)
        return remap_ids(values, kept, rows, self._zch_size - 1)

    def _map_state(self) -> tuple[int, ...]:
        kept, rows = self._mch_sorted_raw_ids, self._mch_remapped_ids_mapping
        return kept._version, rows._version, kept.data_ptr(), rows.data_ptr()

    @torch.no_grad()
    def _build_index(self) -> None:
        """Index the map as it is now (one host sync: only where the caller syncs anyway)."""
        kept, rows = self._mch_sorted_raw_ids, self._mch_remapped_ids_mapping
        self._index = HashRemapIndex(kept, rows, self._zch_size - 1)
        self._index_key = self._map_state()

    def forward(self, features: Tensor | Mapping[str, Any]) -> Any:
        """Preprocess, profile (training) and remap: a tensor of ids, or TorchRec's
        ``{name: JaggedTensor}`` (all of it one step of this table)."""
        if isinstance(features, Tensor):
            values = self.preprocess(features)
            self.profile(values)
            return self.remap(values)
        jts = dict(features)
        values = [self.preprocess(jt.values()) for jt in jts.values()]
        self.profile(torch.cat(values) if len(values) != 1 else values[0])
        return {
            key: JaggedTensor(self.remap(v), jt.lengths(), jt.weights_or_none())
            for (key, jt), v in zip(jts.items(), values, strict=True)
        }

    @torch.no_grad()
    def evict(self) -> Tensor | None:
        """Rows whose id changed since the last call (None if none): reset their embedding
        and optimizer state before they are looked up."""
        rows, self._evicted_rows = self._evicted_rows, None
        return rows

    def _reread_iter(self) -> None:
        """The step from the buffer (one host sync): at the first training step, or after
        something else wrote it. A new step starts a new window there, as TorchRec's
        module does after a load (``load_window`` resumes a saved one instead)."""
        step = int(self._current_iter_tensor)
        if step != self._current_iter:
            self._current_iter = self._last_eviction_iter = step
            self._history, self._carried, self._evicted_rows = [], None, None
        self._iter_version = self._current_iter_tensor._version

    # -- the window in progress: checkpoints and converted modules ------------------------

    @torch.no_grad()
    def window_state(self) -> Tensor:
        """The eviction window in progress, as int64 ``[1 + n, 3]``: row 0 is (step, step
        of the last eviction, n), then (id, count, last access step) per id seen since
        (every rank's, merged, when the window is shared: then collective, every rank of
        the group calls it and gets the same tensor). ``dtrec.checkpoint`` saves it, so a
        resumed run evicts as an uninterrupted one would."""
        uniq, counts, access = self._window_summary()
        if self._window_shared:
            merged = merge_windows(uniq, counts, access, self._window_group)
            uniq, counts, access = merged[0], merged[1], merged[2]
            assert access is not None
        step = self.current_iter
        last = self._last_eviction_iter if self._current_iter != -1 else step
        header = torch.tensor([[step, last, uniq.numel()]], dtype=torch.int64)
        body = torch.stack([uniq, counts, access], dim=1).cpu()
        return torch.cat([header, body])

    @torch.no_grad()
    def load_window(self, state: Tensor) -> None:
        """Resume the window ``window_state`` returned, after the buffers were loaded
        (their step must be the saved one). When the window is shared, the group's first
        rank carries the saved ids and the others start empty: the next eviction merges
        them once."""
        step, last, n = (int(v) for v in state[0].tolist())
        if step != int(self._current_iter_tensor):
            raise ValueError(
                f"managed collision {self._name or '<unnamed>'!r}: the saved window is of step "
                f"{step} but the loaded _current_iter_tensor is {int(self._current_iter_tensor)}"
            )
        body = state[1 : 1 + n].to(self._mch_sorted_raw_ids.device)
        first = not self._window_shared or dist.get_rank(self._window_group) == 0
        carried = (body[:, 0], body[:, 1], body[:, 2]) if first and n else None
        self._resume(step, last, [], carried, None)
        self._build_index()

    def _resume(
        self,
        step: int,
        last_eviction: int,
        history: list[tuple[Tensor, int]],
        carried: tuple[Tensor, Tensor, Tensor] | None,
        evicted_rows: Tensor | None,
    ) -> None:
        """Continue a window: this step, the last eviction's, the ids recorded since."""
        self._current_iter, self._last_eviction_iter = step, last_eviction
        self._history, self._carried, self._evicted_rows = history, carried, evicted_rows
        self._iter_version = self._current_iter_tensor._version

    def _window_summary(self) -> tuple[Tensor, Tensor, Tensor]:
        """(sorted unique ids, counts, last access step) of the window in progress."""
        device = self._mch_sorted_raw_ids.device
        if self._history:
            ids = torch.cat([v for v, _ in self._history])
            iters = torch.cat([torch.full_like(v, it) for v, it in self._history])
            uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
            access = torch.zeros_like(counts).scatter_reduce_(
                0, inverse, iters, reduce="amax", include_self=False
            )
        else:
            uniq = counts = access = torch.empty(0, dtype=torch.int64, device=device)
        if self._carried is not None:
            carried = self._carried
            uniq, counts, merged = coalesce_window(
                torch.cat([carried[0], uniq]),
                torch.cat([carried[1], counts]),
                torch.cat([carried[2], access]),
            )
            assert merged is not None
            access = merged
        return uniq, counts, access

    # -- eviction -----------------------------------------------------------------------

    def _metadata(self, name: str) -> Tensor | None:
        return getattr(self, f"_mch_{name}", None)

    @torch.no_grad()
    def _evict_window(self) -> None:
        """Coalesce the window, score, let winners take losers' rows, re-sort."""
        uniq, counts, window_access = self._window_summary()
        self._history, self._carried = [], None
        if self._split_eviction():
            self._evict_split(uniq, counts, window_access)
            return
        access = window_access if "last_access_iter" in self._eviction_policy.metadata else None
        if self._window_shared:
            uniq, counts, access = merge_windows(uniq, counts, access, self._window_group)
        threshold = self._eviction_policy.threshold_filter
        if threshold is not None:
            mask, _ = threshold(counts)
            uniq, counts = uniq[mask], counts[mask]
            access = None if access is None else access[mask]
        self._admit(uniq, counts, access)

    def _admit(self, uniq: Tensor, counts: Tensor, access: Tensor | None) -> None:
        # candidates by descending count (ties: ascending id), as TorchRec orders them
        order = torch.argsort(counts, descending=True, stable=True)
        ids, counts = uniq[order], counts[order]
        access = None if access is None else access[order]
        kept = self._mch_sorted_raw_ids
        index = torch.searchsorted(kept[:-1], ids)
        hit = kept[index] == ids
        matched, new = index[hit], ~hit
        it, last = self._current_iter, self._zch_size - 1
        mch_counts, mch_access = self._metadata("counts"), self._metadata("last_access_iter")
        merged_counts = merged_access = None
        if mch_counts is not None:
            mch_counts[matched] += counts[hit]
            mch_counts[last] = INT64_MAX  # the miss row is never evicted
            merged_counts = torch.cat([mch_counts, counts[new]])
        if mch_access is not None:
            assert access is not None
            mch_access[matched] = access[hit]
            mch_access[last] = it
            merged_access = torch.cat([mch_access, access[new]])
        scores = self._eviction_policy.scores(it, merged_counts, merged_access)
        evicted, admitted = select_evictions(scores, self._zch_size)
        if mch_counts is not None:
            mch_counts[evicted] = counts[new][admitted]
        if mch_access is not None:
            mch_access[evicted] = access[new][admitted]  # type: ignore[index]
        self._take(evicted, ids[new][admitted])

    def _split_eviction(self) -> bool:
        """Whether this eviction is decided by raw-id range over the window's ranks
        (``dtrec.modules.split_eviction``): a shared window of more than one rank, and no
        threshold filter (which reads the whole window)."""
        return (
            self.split_eviction
            and self._window_shared
            and self._eviction_policy.threshold_filter is None
            and dist.get_world_size(self._window_group) > 1
        )

    def _evict_split(self, uniq: Tensor, counts: Tensor, access: Tensor) -> None:
        packed = torch.stack([uniq, counts, access], dim=1).flatten()
        window = torch.cat(
            all_gather_varied(packed, self._window_group, "managed_collision.window")
        )
        self._admit_split(window.view(-1, 3))

    def _admit_split(self, window: Tensor) -> None:
        """The split eviction after the window gather (``window``: every rank's summaries,
        ``[N, 3]``): decide by range, exchange, apply."""
        kept, it, last = self._mch_sorted_raw_ids, self._current_iter, self._zch_size - 1
        mch_counts, mch_access = self._metadata("counts"), self._metadata("last_access_iter")
        d = split_admit(
            kept, mch_counts, mch_access, self._eviction_policy, it, window,
            self._input_hash_size, self._window_group,
        )  # fmt: skip
        if mch_counts is not None:
            assert d.matched_counts is not None and d.admitted_counts is not None
            mch_counts[d.matched] = d.matched_counts
            mch_counts[last] = INT64_MAX
            mch_counts[d.evicted] = d.admitted_counts
        if mch_access is not None:
            assert d.matched_access is not None and d.admitted_access is not None
            mch_access[d.matched] = d.matched_access
            mch_access[last] = it
            mch_access[d.evicted] = d.admitted_access
        self._take(d.evicted, d.admitted)

    def _take(self, evicted: Tensor, admitted: Tensor) -> None:
        """Give the map positions ``evicted`` to the raw ids ``admitted`` (paired in order;
        their metadata already written), report their rows, re-sort, re-index."""
        kept = self._mch_sorted_raw_ids
        kept[evicted] = admitted
        rows = self._mch_remapped_ids_mapping[evicted]
        if self._evicted_rows is not None:  # not yet consumed by evict()
            rows = torch.unique(torch.cat([self._evicted_rows, rows]))
        self._evicted_rows = rows
        self._sort(evicted)
        if self._eviction_interval > 1:  # worth an index: looked up interval times
            self._build_index()

    @torch.no_grad()
    def _sort(self, changed: Tensor | None = None) -> None:
        """Sort the kept ids (stable: empty slots keep their order, the miss row last).

        ``changed``: the only positions written since the ids were last sorted (an
        eviction's), each now a distinct id no other position holds: the untouched ids are
        still in order, so the two sorted runs are merged (``merge_order``) instead of
        sorting all ``zch_size`` ids again."""
        kept = self._mch_sorted_raw_ids
        full = changed is None
        order = torch.argsort(kept, stable=True) if full else merge_order(kept, changed)
        self._mch_sorted_raw_ids.copy_(kept[order])
        self._mch_remapped_ids_mapping.copy_(self._mch_remapped_ids_mapping[order])
        for meta in self._eviction_policy.metadata:
            buf = self._metadata(meta)
            assert buf is not None
            buf.copy_(buf[order])

    def extra_repr(self) -> str:
        return (
            f"zch_size={self._zch_size}, eviction_policy={self._eviction_policy}, "
            f"eviction_interval={self._eviction_interval}, input_hash_size={self._input_hash_size}"
        )


@torch.no_grad()
def merge_order(values: Tensor, changed: Tensor) -> Tensor:
    """The permutation a stable ``argsort(values)`` gives, when ``values`` was sorted but
    for the positions ``changed``, which hold values no other position holds.

    The untouched positions form one ascending run (ties: their position order) and the
    changed ones, sorted, another; each element's place in the merge is its rank in its
    own run plus the count of the other run's values below it (no value is in both): a
    ``searchsorted`` of the changed values into the run, then a running count of where
    they land for the untouched ones. One sort of ``changed`` and linear passes, not a sort
    of ``values``."""
    keep = torch.ones_like(values, dtype=torch.bool)
    keep[changed] = False
    same = keep.nonzero().squeeze(1)
    new = changed[torch.argsort(values[changed])]
    same_values = values[same]
    below = torch.searchsorted(same_values, values[new])  # untouched values below each new
    order = torch.empty(values.shape, dtype=torch.int64, device=values.device)
    at_new = torch.arange(new.numel(), device=values.device)
    order[at_new + below] = new
    # untouched i has every new value with ``below <= i`` before it
    landed = torch.bincount(below, minlength=same.numel() + 1)[: same.numel()]
    at_same = torch.arange(same.numel(), device=values.device)
    order[at_same + landed.cumsum(0)] = same
    return order


@torch.no_grad()
def merge_windows(
    uniq: Tensor, counts: Tensor, access: Tensor | None, group: ProcessGroup | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Every rank's window summary merged: (sorted unique ids, summed counts, latest
    access) of all ranks' ids together, as ``torch.unique`` over the global window gives.
    One all-gather of ``[n, 2 or 3]`` int64 per rank (plus its sizes)."""
    parts = [uniq, counts] if access is None else [uniq, counts, access]
    packed = torch.stack(parts, dim=1).flatten()
    gathered = torch.cat(all_gather_varied(packed, group, "managed_collision.window"))
    gathered = gathered.view(-1, len(parts))
    return coalesce_window(
        gathered[:, 0], gathered[:, 1], None if access is None else gathered[:, 2]
    )


def _after_load(module: nn.Module, incompatible: object) -> None:
    """A loaded map is re-sorted and its step re-read; the old window is dropped."""
    assert isinstance(module, MCHManagedCollisionModule)
    module._sort()
    module._build_index()
    module._current_iter = -1
    module._history, module._carried = [], None
    module._evicted_rows = None


__all__ = [
    "MCHManagedCollisionModule",
    "coalesce_window",
    "merge_order",
    "merge_windows",
    "remap_ids",
]
