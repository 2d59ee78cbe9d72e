"""Which CPU code runs the fused row-wise Adagrad backward under ``"auto"``: measured.

Two exact implementations exist: fbgemm's C++ backward + step (``FbgemmBackend``, one
pass over the ids) and the torch backend's (``TorchBackend``: dtrec's own C pass,
``dtrec.kernels.cpu``, where it is built; torch's row grads + an in-place step otherwise). Their
order is not the same on every processor, on the same workload (2 tables of 1e5 and
3.7e5 rows, D=64, 82k Zipf ids, one thread): fbgemm 5.1 ms vs torch 14.5 ms on an
AVX-512 AMD EPYC (this project's CI machine, 2026-11-27), but 12.5 vs 6.8 ms on the
machine of commit 0aa61ed. The same dtrec step measured 0.69x TorchRec on one machine
and 1.41x on the other (issue 30). So the choice is made by timing both, once per
process, on a small lookup shaped like that workload (tens of ms), when
``distribute_module`` builds a CPU model with row-wise Adagrad: rank 0 times, every rank
takes its answer (replicas must apply bitwise the same update).
``DTREC_CPU_ROWWISE_ADAGRAD=fbgemm`` or ``=torch`` skips the timing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dtrec.ops.backends.fbgemm import FbgemmBackend
from dtrec.ops.backends.registry import cpu_fused_rules, set_cpu_fused_rules
from dtrec.ops.backends.torch import TorchBackend
from dtrec.ops.lookup import Lookup, packed_views
from dtrec.optim.rules import RowWiseAdagrad

ENV = "DTREC_CPU_ROWWISE_ADAGRAD"
CHOICES = ("fbgemm", "torch")
MARGIN = 1.25
"""fbgemm is chosen only when at least this much faster: a near tie keeps torch's path,
whose speed depends less on how busy the cores are (fbgemm's OpenMP threads slow down
badly on oversubscribed cores: measured 91 ms vs torch's 19 on 2 busy cores, 1.6 vs 5.4
ms on one thread)."""


def cpu_rowwise_adagrad() -> str:
    """The implementation ``"auto"`` uses now on CPU: ``"fbgemm"`` or ``"torch"``."""
    return "fbgemm" if "rowwise_adagrad" in cpu_fused_rules() else "torch"


def use_cpu_rowwise_adagrad(choice: str) -> None:
    """Make ``"auto"`` run the CPU fused row-wise Adagrad with ``choice``.

    Example::

        use_cpu_rowwise_adagrad("fbgemm")
    """
    if choice not in CHOICES:
        raise ValueError(f"{ENV}: expected one of {CHOICES}, got {choice!r}")
    rules = tuple(r for r in cpu_fused_rules() if r != "rowwise_adagrad")
    set_cpu_fused_rules(rules + (("rowwise_adagrad",) if choice == "fbgemm" else ()))


def preferred_cpu_rowwise_adagrad() -> str:
    """``$DTREC_CPU_ROWWISE_ADAGRAD`` if set, else the faster implementation on this
    processor (``"torch"`` when fbgemm does not load)."""
    chosen = os.environ.get(ENV)
    if chosen:
        if chosen not in CHOICES:
            raise ValueError(f"{ENV}: expected one of {CHOICES}, got {chosen!r}")
        return chosen
    times = _time_both()
    if times is None:  # fbgemm does not load (or does not serve the lookup)
        return "torch"
    return "fbgemm" if times["fbgemm"] * MARGIN < times["torch"] else "torch"


@dataclass
class RowwiseAdagradLookup:
    """A synthetic CPU lookup with row-wise Adagrad state: what ``_time_both`` times the two
    implementations on, and what ``benchmarks/probes/cpu_calibration.py`` prices updates
    by (one builder, so both time the same thing)."""

    weights: list[Tensor]
    states: list[dict[str, Tensor]]
    lookup: Lookup
    grad: Tensor
    rule: RowWiseAdagrad
    fbgemm: FbgemmBackend

    @classmethod
    def build(
        cls,
        ids: Sequence[Tensor],
        rows: Sequence[int],
        dim: int,
        per_bag: int,
        gen: torch.Generator,
    ) -> RowwiseAdagradLookup:
        """Packed tables of ``rows`` x ``dim`` (small random weights, zero sums) read by
        ``ids[t]`` of table t (every table the same count), in bags of ``per_bag`` ids, and
        a random output gradient."""
        values = torch.cat(list(ids))
        offsets = torch.arange(0, values.numel() + 1, per_bag)
        weights = packed_views([(r, dim) for r in rows], torch.float32, torch.device("cpu"))
        for w in weights:
            w.uniform_(-0.01, 0.01, generator=gen)
        sums = packed_views([(r,) for r in rows], torch.float32, torch.device("cpu"), zero=True)
        lookup = Lookup(weights, list(range(len(rows))), values, offsets, [False] * len(rows))
        batch = (offsets.numel() - 1) // len(rows)  # bags per table: the output's rows
        grad = torch.randn(batch, len(rows) * dim, generator=gen)
        fbgemm = FbgemmBackend(name="fbgemm", lookups=False, fused_rules=("rowwise_adagrad",))
        return cls(weights, [{"sum": s} for s in sums], lookup, grad, RowWiseAdagrad(lr=1e-3),
                   fbgemm)  # fmt: skip

    def fbgemm_pass(self) -> bool:
        """fbgemm's one-pass backward + step (False: it declined the lookup)."""
        return self.fbgemm.backward_update(self.lookup, self.grad, self.rule.step_rule(),
                                           self.states)  # fmt: skip

    def torch_pass(self) -> bool:
        """The torch backend's one-pass backward + step, ``dtrec.kernels.cpu``'s (False:
        not built)."""
        return TorchBackend().backward_update(self.lookup, self.grad, self.rule.step_rule(),
                                              self.states)  # fmt: skip

    def rows_then_update(self) -> None:
        """Row gradients, then the in-place step per table: the unfused path."""
        rows = TorchBackend().backward_rows(self.lookup, self.grad)
        for w, st, (ids, g) in zip(self.weights, self.states, rows, strict=True):
            self.rule.update_rows(w, st, ids, g)


class _NotServed(Exception):
    """fbgemm's backward declined the timing lookup (fbgemm_gpu does not load)."""


def _clock():
    """What ``_time_both`` reads: with one torch thread (torchrun's default), this thread's
    CPU time, which does not count the time the rank waited for a core while other ranks
    or jobs ran: under such load a wall clock picked torch's path over a 1.6x faster
    fbgemm one (2026-12-02, load 10-30 on 2 cores). With more threads, the wall clock:
    it also sees fbgemm's OpenMP threads waiting on busy cores (``MARGIN``)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def _time_both(repeats: int = 5) -> dict[str, float] | None:
    """Best-of-``repeats`` seconds of each implementation (None if fbgemm does not serve
    it) on a synthetic lookup: 2 tables (2e4 and 6e4 rows, D=64), 1024 bags of 20 ids
    skewed toward low rows, with the process's threads as they are, on ``_clock()``."""
    gen = torch.Generator().manual_seed(0)
    rows, dim, bags, per_bag = (20_000, 60_000), 64, 1024, 20
    ids = [(torch.rand(bags * per_bag, generator=gen) ** 3 * r).long() for r in rows]
    bench = RowwiseAdagradLookup.build(ids, rows, dim, per_bag, gen)

    def run_fbgemm() -> None:
        if not bench.fbgemm_pass():
            raise _NotServed

    def run_torch() -> None:
        if not bench.torch_pass():  # dtrec.kernels.cpu's fused pass, else the unfused path
            bench.rows_then_update()

    out, clock = {}, _clock()
    with torch.no_grad():
        for name, fn in (("fbgemm", run_fbgemm), ("torch", run_torch)):
            try:
                fn()  # warm-up
            except _NotServed:
                return None
            best = float("inf")
            for _ in range(repeats):
                start = clock()
                fn()
                best = min(best, clock() - start)
            out[name] = best
    return out


__all__ = [
    "RowwiseAdagradLookup",
    "cpu_rowwise_adagrad",
    "preferred_cpu_rowwise_adagrad",
    "use_cpu_rowwise_adagrad",
]
