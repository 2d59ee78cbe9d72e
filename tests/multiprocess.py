"""Shared harness for multi-process (gloo, CPU) tests.

:func:`run_world` spawns ``world_size`` processes, initialises a gloo process group in each,
runs ``fn(rank, world_size, *args)`` and returns the per-rank return values, ordered by rank.
If any rank raises (or dies without reporting, or the overall timeout passes) the remaining
ranks are terminated straight away and :class:`WorldError` (an ``AssertionError``) is raised
with every failed rank's traceback. No process is ever left behind.

Rules for ``fn``
----------------
* It must be a **module-level function** (the "spawn" start method pickles it by qualified
  name and the child re-imports its module). Lambdas, closures and nested functions fail.
  Test modules are importable as ``tests.<name>`` (``tests/__init__.py`` exists and the
  repo root is on ``sys.path``), so worker functions may live in the test module itself.
* ``args`` and the return value must be picklable. Return plain data (floats, lists, dicts,
  CPU tensors), not DTensors or objects tied to the process group.
* Child processes are daemonic, so ``fn`` cannot start processes of its own (e.g. DataLoader
  workers).

Recommended pattern: one world, many configurations
---------------------------------------------------
Starting a world costs seconds here (spawn + ``import torch`` + rendezvous on a 2-core
machine), so do **not** call :func:`run_world` once per parametrized case. Instead, run every
configuration inside one spawned world, return a dict ``{config_name: result}`` from each
rank, and let parametrized tests assert on it through a module-scoped fixture::

    import pytest
    from tests.multiprocess import run_world

    CONFIGS = {
        "row_wise_sum": dict(num_embeddings=10, dim=4, mode="sum"),
        "col_wise_mean": dict(num_embeddings=7, dim=8, mode="mean"),
    }

    def _check_one(rank, world_size, num_embeddings, dim, mode):
        ...  # build the sharded module, compare with a dense reference
        return {"max_abs_err": err}

    def _run_all(rank, world_size, configs):  # module level: picklable by spawn
        return {name: _check_one(rank, world_size, **cfg) for name, cfg in configs.items()}

    @pytest.fixture(scope="module")
    def world_results():
        return run_world(2, _run_all, CONFIGS)  # list indexed by rank

    @pytest.mark.parametrize("name", sorted(CONFIGS))
    def test_config(world_results, name):
        for rank, per_rank in enumerate(world_results):
            assert per_rank[name]["max_abs_err"] < 1e-6, f"rank {rank}"

An exception in any configuration fails the whole world (and therefore every test using the
fixture), with the traceback in the message. If you want failures isolated per configuration,
catch exceptions in ``_run_all`` and return the formatted traceback as that configuration's
result -- but only when a failure is guaranteed to happen on all ranks alike; otherwise ranks
fall out of step in later collectives.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Collection, Iterator
from typing import Any

__all__ = [
    "PRELOAD",
    "WorldError",
    "error_of",
    "fork_context",
    "free_port",
    "load_factor",
    "run_world",
]

_POLL_S = 0.1  # how long the parent blocks on the result queue between liveness checks
_GRACE_S = 2.0  # time between SIGTERM and SIGKILL when tearing a world down
_SETTLE_S = 1.0  # after a first failure, how long to keep collecting failures of other ranks


PRELOAD = [
    "torch",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "dtrec",
    "tests.multiprocess",
    "torchrec",
]
"""What the fork server imports once (a missing one, e.g. torchrec without the bench
extra, is skipped): every rank is forked from it with these loaded."""

CPU_LOG = "DTREC_WORLD_CPU_LOG"
"""A file each rank of every world appends its ``fn``'s CPU seconds to, where set: the
suite's time goes to worlds of ranks that share the cores, so a world's CPU is what a
change to it is measured by (wall time moves with the machine's other load)."""


READ_AT_USE = frozenset(
    {"DTREC_BACKEND", "DTREC_CPU_ROWWISE_ADAGRAD", "DTREC_OFFLOAD_WORKER", CPU_LOG}
)
"""Variables dtrec reads when it first needs them, not at import: a forked rank that sets
them before its ``fn`` runs behaves as a spawned one born with them."""

_SERVER_ENV = {"MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}  # set before torch loads
_server_env: dict[str, str] | None = None  # the fork server's environment, from its start


def fork_context(env: dict[str, str], backend: str = "gloo") -> mp.context.BaseContext | None:
    """A fork server that imported torch, dtrec (and torchrec) once, if a rank forked from
    it sees what a spawned rank would, else None. Each rank of every world is forked from it
    instead of importing them again (3-5 s of CPU per rank on a loaded 2-core machine,
    some 300 ranks a suite run). ``env`` is the world's environment on top of this
    process's; a variable in it that differs from the server's and that is not read at use
    (``READ_AT_USE``: fbgemm switched off, malloc settings, the Triton interpreter on a GPU
    machine are read at import or process start) needs a fresh process, and so does a
    backend other than gloo (CUDA). The server starts the first time, with this process's
    environment and ``_SERVER_ENV``: no world's own variables."""
    global _server_env
    if backend != "gloo":
        return None
    ctx = mp.get_context("forkserver")
    if _server_env is None:
        ctx.set_forkserver_preload(PRELOAD)
        with _patched_environ(_SERVER_ENV):
            from multiprocessing import forkserver

            forkserver.ensure_running()
            _server_env = dict(os.environ)
    differ = {k for k, v in env.items() if _server_env.get(k) != v}
    return ctx if not differ - READ_AT_USE - {"MASTER_PORT"} else None


def load_factor() -> float:
    """How many times slower than idle this machine is now, at least 1: the larger of the
    1-minute load average and the processes runnable right now, per core. The worlds'
    timeouts are guards against hangs, not speed targets: they scale with it, so a
    suite run while other jobs take every core does not trip them."""
    try:
        with open("/proc/loadavg") as f:
            fields = f.read().split()
        runnable = float(fields[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        runnable = 0.0
    return max(1.0, max(os.getloadavg()[0], runnable) / (os.cpu_count() or 1))


class WorldError(AssertionError):
    """A multi-process world failed: a rank raised, died, or the world timed out."""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    env: dict[str, str],
    collective_timeout: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    result_queue: Any,
    peers_may_die: bool = False,
    backend: str = "gloo",
    exact_env: bool = False,
) -> None:
    """Child entry point: init ``backend``, run ``fn``, report ``("ok", bytes)`` or
    ``("err", tb)``.

    The outcome is reported *before* ``destroy_process_group`` so that the failing rank's
    traceback reaches the parent ahead of the secondary "connection reset" errors on its peers.
    With ``peers_may_die`` (fault tests) a rank exits right after reporting, without tearing
    its process group down: gloo may abort (SIGABRT) tearing down pairs to a dead peer.
    """
    dist = None
    faulthandler.enable()  # a native abort (e.g. at teardown) prints every thread's stack
    try:
        if exact_env:  # forked from the fork server: drop what it had and the parent has not
            os.environ.clear()
        os.environ.update(env)
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
        started = time.process_time()
        result = fn(rank, world_size, *args)
        _log_cpu(fn, rank, world_size, time.process_time() - started)
        # Pickle here, not in the queue's feeder thread, so that an unpicklable result is
        # reported as this rank's error instead of being lost silently.
        payload = pickle.dumps(result)
        result_queue.put((rank, "ok", payload))
    except BaseException:  # noqa: B036 - also report SystemExit / KeyboardInterrupt
        result_queue.put((rank, "err", traceback.format_exc()))
    finally:
        if peers_may_die:
            result_queue.close()
            result_queue.join_thread()  # the report is written before the process ends
            os._exit(0)
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()
        # Leave without the interpreter's finalization: there, after a clean teardown, a
        # static destructor of torch's gloo stack aborted a rank now and then ("terminate
        # called without an active exception", no Python frame on the stack: 2 worlds in
        # thousands, in test_dense_replication and the README examples' world). A hang
        # or abort in destroy_process_group itself is still seen (exit code, timeout).
        sys.stdout.flush()
        sys.stderr.flush()
        result_queue.close()
        result_queue.join_thread()  # the report is written before the process ends
        os._exit(0)


def _log_cpu(fn: Callable[..., Any], rank: int, world_size: int, seconds: float) -> None:
    path = os.environ.get(CPU_LOG)
    if path:
        with open(path, "a") as f:
            f.write(f"{fn.__module__}.{fn.__qualname__} {world_size} {rank} {seconds:.2f}\n")


@contextlib.contextmanager
def _patched_environ(env: dict[str, str]) -> Iterator[None]:
    """Temporarily set ``env`` in this process so spawned children inherit it from birth.

    Needed because the child imports torch (via the pickled ``fn``) before ``_worker`` runs,
    and settings such as ``OMP_NUM_THREADS`` must be in place before that import.
    """
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name} (exit code {exitcode})"
        except ValueError:
            return f"killed by signal {-exitcode} (exit code {exitcode})"
    return f"exit code {exitcode}"


def _teardown(procs: list[Any]) -> None:
    """Terminate, then kill after a grace period, then join every process."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join()


def run_world(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 300.0,
    collective_timeout: float = 60.0,
    env: dict[str, str] | None = None,
    may_die: Collection[int] = (),
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return results by rank.

    Args:
        world_size: number of processes (ranks) to spawn.
        fn: a **module-level** function (picklable under "spawn"); its return value must be
            picklable.
        *args: extra positional arguments passed to ``fn`` on every rank (must be picklable).
        timeout: overall wall-clock limit in seconds for the whole world, startup included,
            on an idle machine: multiplied by ``load_factor()`` at the call.
        collective_timeout: ``timeout`` given to ``init_process_group`` (per collective),
            also multiplied by ``load_factor()``. A test about the timeout itself sets a
            short one on its groups once the stall it tests is in place (see
            ``tests/distributed/test_faults.py``), never through this guard.
        env: extra environment variables for the children (applied on top of
            ``MASTER_ADDR``/``MASTER_PORT``/``OMP_NUM_THREADS=1``). Ranks are forked from
            the fork server (torch and dtrec imported once) unless one of these is read
            at import and differs from the server's: then they are spawned
            (:func:`fork_context`).
        may_die: ranks allowed to exit without reporting (fault tests kill them on
            purpose); their result is None and the world waits for the others.
        backend: the ``torch.distributed`` backend of every rank ("gloo"; the CUDA tier
            also uses "nccl", with ``fn`` choosing each rank's device).

    Raises:
        WorldError: a rank raised (message has ``"rank i: <traceback>"`` per failed rank),
            exited without reporting (message has its exit code), or ``timeout`` passed
            (message lists the ranks that had not finished). Remaining ranks are terminated
            immediately in every case.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    factor = load_factor()
    timeout, collective_timeout = timeout * factor, collective_timeout * factor
    child_env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        **{str(k): str(v) for k, v in (env or {}).items()},
    }
    forked = fork_context(child_env, backend)
    ctx = forked or mp.get_context("spawn")
    rank_env = {**os.environ, **child_env} if forked else child_env  # what a spawned rank sees
    result_queue = ctx.Queue()
    procs: list[Any] = []
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    order: list[int] = []  # failed ranks in the order their failure was noticed
    start = time.monotonic()
    deadline = start + timeout

    def add_error(rank: int, text: str) -> None:
        if rank not in errors:
            order.append(rank)
        errors[rank] = text

    def handle(msg: tuple[int, str, Any]) -> None:
        rank, kind, data = msg
        if kind == "ok":
            try:
                results[rank] = pickle.loads(data)
            except Exception:
                add_error(
                    rank, "result could not be unpickled in the parent:\n" + traceback.format_exc()
                )
        else:
            add_error(rank, data)

    def drain(wait: float) -> None:
        """Read every message available now (waiting up to ``wait`` s for the first)."""
        while True:
            try:
                handle(result_queue.get(timeout=wait) if wait > 0 else result_queue.get_nowait())
            except queue_mod.Empty:
                return
            wait = 0.0

    def check_dead() -> None:
        """Record ranks that exited without reporting anything."""
        dead = [
            r
            for r, p in enumerate(procs)
            if r not in results and r not in errors and p.exitcode is not None
        ]
        if not dead:
            return
        # A message sent just before exiting may still be in the pipe: read it first.
        drain(_POLL_S)
        for r in dead:
            if r in may_die and r not in errors:
                results.setdefault(r, None)
            elif r not in results and r not in errors:
                add_error(
                    r,
                    f"exited without reporting a result ({_describe_exit(procs[r].exitcode)}); "
                    "its stderr above may say why",
                )

    def fail(header: str) -> WorldError:
        parts = [header]
        parts += [f"rank {r}: {errors[r].rstrip()}" for r in sorted(errors)]
        return WorldError("\n\n".join(parts))

    try:
        with _patched_environ(child_env):
            for rank in range(world_size):
                p = ctx.Process(
                    target=_worker,
                    args=(
                        rank,
                        world_size,
                        rank_env,
                        collective_timeout,
                        fn,
                        args,
                        result_queue,
                        bool(may_die),
                        backend,
                        forked is not None,
                    ),
                    name=f"dtrec-rank{rank}",
                    daemon=True,
                )
                p.start()
                procs.append(p)

        # Phase 1: collect one message per rank, until the first failure or the deadline.
        while len(results) + len(errors) < world_size and not errors:
            drain(min(_POLL_S, max(0.0, deadline - time.monotonic())))
            check_dead()
            if errors:
                break
            if time.monotonic() >= deadline:
                drain(0.0)
                if len(results) + len(errors) == world_size:
                    break
                pending = [r for r in range(world_size) if r not in results and r not in errors]
                _teardown(procs)
                raise fail(
                    f"world of {world_size} timed out after {timeout:.1f}s (load factor "
                    f"{factor:.1f}); "
                    f"ranks not finished: {pending}"
                )

        if errors:
            # A failure on one rank usually makes others fail too (gloo notices the closed
            # connection) or die. Collect what happens within a short settling window so the
            # root cause is in the report, then kill the survivors: they are likely blocked
            # in a collective.
            settle_end = time.monotonic() + _SETTLE_S
            while time.monotonic() < settle_end and len(results) + len(errors) < world_size:
                drain(_POLL_S)
                check_dead()
            _teardown(procs)
            raise fail(
                f"world of {world_size}: rank(s) {sorted(errors)} failed "
                f"(first noticed: rank {order[0]})"
            )

        # Phase 2: every rank reported success; wait for clean exits.
        for p in procs:
            p.join(max(_GRACE_S, deadline - time.monotonic()))
        stuck = [r for r, p in enumerate(procs) if p.exitcode is None]
        if stuck:
            _teardown(procs)
            raise fail(
                f"world of {world_size}: ranks {stuck} returned results but did not exit "
                f"by the {timeout:.1f}s timeout (hung in destroy_process_group?)"
            )
        for r, p in enumerate(procs):
            if p.exitcode != 0 and r not in may_die:
                add_error(r, f"returned a result but then {_describe_exit(p.exitcode)}")
        if errors:
            raise fail(f"world of {world_size}: rank(s) {sorted(errors)} exited abnormally")
        return [results[r] for r in range(world_size)]
    finally:
        _teardown(procs)
        result_queue.close()
        result_queue.cancel_join_thread()


def error_of(fn: Callable[[], object]) -> str:
    """Run ``fn`` (inside a rank); ``"ExcType: message"`` if it raised, else ``"ok"``.

    Lets a worker return expected failures as plain data for the parent to assert on.
    """
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type is part of what callers assert
        return f"{type(exc).__name__}: {exc}"
    return "ok"
