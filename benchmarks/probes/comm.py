"""Bytes and calls of the collectives a step issues, counted as the sender sees them.

``CommCounter`` wraps the ``torch.distributed`` functions while active (what Python code
calls: dtrec, TorchRec, DMPCollection's sync); ``CollectiveCensus`` sees every c10d and
functional-collective op dispatched (DDP's C++ reducer too), slowly; both charge a
collective with ``sent_bytes``: what this rank sends in it.
"""

from __future__ import annotations

import functools
import inspect
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode


def sent_bytes(
    kind: str,
    size: int,
    me: int,
    inputs: Sequence[Tensor],
    splits: Sequence[int] | None = None,
    root: int | None = None,
) -> int:
    """Bytes group rank ``me`` of ``size`` sends in one collective of ``kind``.

    ``inputs``: the tensors it contributes (one per destination for list all-to-all and
    reduce-scatter); ``splits``: dim-0 sizes per destination of a one-tensor all-to-all
    (None or empty: equal); ``root``: the broadcast source (group rank).
    """
    nbytes = [t.numel() * t.element_size() for t in inputs]
    if kind in ("all_to_all", "reduce_scatter") and len(inputs) > 1:
        return sum(nbytes) - nbytes[me]
    if kind == "all_to_all":
        if not splits:
            return nbytes[0] * (size - 1) // size
        row = nbytes[0] // inputs[0].shape[0] if inputs[0].numel() else 0
        return (sum(splits) - splits[me]) * row
    if kind == "all_reduce":
        return 2 * (size - 1) * sum(nbytes) // size
    if kind == "reduce_scatter":
        return (size - 1) * sum(nbytes) // size
    if kind == "all_gather":
        return (size - 1) * sum(nbytes)
    if kind == "broadcast":
        return sum(nbytes) if root == me else 0
    raise ValueError(f"unknown collective kind {kind!r}")


# torch.distributed function -> (kind, its inputs and extras from the bound arguments)
_PY_COLLECTIVES = {
    "all_to_all_single": ("all_to_all", lambda a: ([a["input"]], a.get("input_split_sizes"))),
    "all_to_all": ("all_to_all", lambda a: (list(a["input_tensor_list"]), None)),
    "all_reduce": ("all_reduce", lambda a: ([a["tensor"]], None)),
    "all_reduce_coalesced": ("all_reduce", lambda a: (list(a["tensors"]), None)),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: ([a["input"]], None)),
    "_reduce_scatter_base": ("reduce_scatter", lambda a: ([a["input"]], None)),
    "reduce_scatter": ("reduce_scatter", lambda a: (list(a["input_list"]), None)),
    "all_gather_into_tensor": ("all_gather", lambda a: ([a["input_tensor"]], None)),
    "all_gather_single": ("all_gather", lambda a: ([a["input_tensor"]], None)),
    "_all_gather_base": ("all_gather", lambda a: ([a["input_tensor"]], None)),
    "all_gather": ("all_gather", lambda a: ([a["tensor"]], None)),
    "broadcast": ("broadcast", lambda a: ([a["tensor"]], None)),
}


@dataclass
class CommCounter:
    """Calls and bytes sent per collective, by wrapping ``torch.distributed`` while active.

    Keys are the function names (``all_to_all_single``, ...) and
    ``ProcessGroup.allreduce_coalesced`` (``DMPCollection.sync`` calls it). A collective
    called from inside another one counts once, as the outer one.
    """

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _depth: int = 0

    def _counted(self, name: str, fn, charge):
        """``fn`` wrapped: add ``charge(*args, **kwargs)`` bytes under ``name``, then call it."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self.calls[name] += 1
            self.bytes[name] += charge(*args, **kwargs)
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return wrapper

    @staticmethod
    def _charge(name: str, fn):
        kind, extract = _PY_COLLECTIVES[name]
        sig = inspect.signature(fn)

        def charge(*args, **kwargs) -> int:
            bound = sig.bind(*args, **kwargs).arguments
            group = bound.get("group") or dist.group.WORLD
            inputs, splits = extract(bound)
            root = None
            if kind == "broadcast":
                src = bound.get("group_src")
                root = src if src is not None else dist.get_group_rank(group, bound["src"])
            return sent_bytes(kind, group.size(), group.rank(), inputs, splits=splits, root=root)

        return charge

    @contextmanager
    def active(self) -> Iterator[CommCounter]:
        """Count inside the block (patches ``torch.distributed`` and its c10d module)."""
        c10d, pg_type = dist.distributed_c10d, dist.ProcessGroup
        saved = []
        for name in _PY_COLLECTIVES:
            original = getattr(c10d, name)
            wrapped = self._counted(name, original, self._charge(name, original))
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    saved.append((module, name, original))
                    setattr(module, name, wrapped)
        # The class dict holds pybind's method descriptor: restore that, not the bare function.
        saved.append((pg_type, "allreduce_coalesced", pg_type.__dict__["allreduce_coalesced"]))
        pg_type.allreduce_coalesced = self._counted(
            "ProcessGroup.allreduce_coalesced",
            pg_type.allreduce_coalesced,
            lambda pg, tensors, *a, **k: sent_bytes("all_reduce", pg.size(), pg.rank(), tensors),
        )
        try:
            yield self
        finally:
            for owner, name, fn in saved:
                setattr(owner, name, fn)

    def per_step(self, steps: int) -> dict[str, dict[str, float]]:
        return {
            k: {"calls": self.calls[k] / steps, "bytes": self.bytes[k] / steps}
            for k in sorted(self.calls)
        }


# c10d dispatcher op -> (kind, its inputs and extras from the schema's named arguments)
_C10D_OPS = {
    "alltoall_base_": ("all_to_all", lambda a: ([a["input"]], a["input_split_sizes"])),
    "alltoall_": ("all_to_all", lambda a: (list(a["input_tensors"]), None)),
    "allreduce_": ("all_reduce", lambda a: (list(a["tensors"]), None)),
    "allreduce_coalesced_": ("all_reduce", lambda a: (list(a["tensors"]), None)),
    "_reduce_scatter_base_": ("reduce_scatter", lambda a: ([a["input_tensor"]], None)),
    "reduce_scatter_": ("reduce_scatter", lambda a: (list(a["input_tensors"][0]), None)),
    "_allgather_base_": ("all_gather", lambda a: ([a["input_tensor"]], None)),
    "allgather_": ("all_gather", lambda a: (list(a["input_tensors"]), None)),
    "broadcast_": ("broadcast", lambda a: (list(a["tensors"]), None)),
}
_FUNCTIONAL_OPS = {
    "all_to_all_single": ("all_to_all", lambda a: ([a["input"]], a["input_split_sizes"])),
    "all_reduce": ("all_reduce", lambda a: ([a["input"]], None)),
    "all_reduce_coalesced": ("all_reduce", lambda a: (list(a["inputs"]), None)),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: ([a["input"]], None)),
    "all_gather_into_tensor": ("all_gather", lambda a: ([a["input"]], None)),
}


class CollectiveCensus(TorchDispatchMode):
    """Every c10d / functional-collective op dispatched while active (DDP's C++ reducer too).

    Slow (a Python hook on every op): for an untimed step only.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        table = {"c10d": _C10D_OPS, "_c10d_functional": _FUNCTIONAL_OPS}.get(ns, {})
        if name in table or (ns == "c10d" and name != "barrier"):
            named = dict(zip([a.name for a in func._schema.arguments], args))
            named.update(kwargs)
            key = f"{ns}.{name}"
            self.calls[key] += 1
            if name in table:
                if "process_group" in named:
                    pg = dist.ProcessGroup.unbox(named["process_group"])
                else:
                    pg = dist.distributed_c10d._resolve_process_group(named["group_name"])
                kind, extract = table[name]
                inputs, splits = extract(named)
                root = named.get("root_rank")
                self.bytes[key] += sent_bytes(
                    kind, pg.size(), pg.rank(), inputs, splits=splits, root=root
                )
        return func(*args, **kwargs)
