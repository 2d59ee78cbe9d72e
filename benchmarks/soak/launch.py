"""The soak's launcher: start a world of ranks, and when one dies, stop the rest.

What torchrun's elastic agent does for a job: it watches its workers, and when one
exits abnormally it stops the others and restarts the group. Here a rank killed on
purpose (``kill_rank``, ``killed_save``) makes its peers fail their next collective
within moments; any that do not (stuck on a peer that is itself waiting) are killed
after ``grace`` seconds instead of waiting out the process group's timeout. Ranks
write their timelines to files as they go (``worker.log_path``), so nothing a
killed rank did is lost to the supervisor.
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.multiprocess import free_port

_POLL_S = 0.05


def _entry(rank: int, world: int, env: dict[str, str], timeout_s: float, backend: str,
           fn: Callable[..., Any], args: tuple) -> None:  # fmt: skip
    """Child: init the process group (``backend``), run ``fn(rank, world, *args)``, exit
    without tearing the group down (gloo may abort tearing down pairs to a dead peer): 0
    if ``fn`` returned."""
    code = 0
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks before a kill
    try:
        os.environ.update(env)
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
        fn(rank, world, *args)
    except BaseException:  # noqa: B036 - report anything, then exit non-zero
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


_PRELOAD = ["torch", "torch.distributed.checkpoint", "dtrec", "benchmarks.soak.worker"]


def _context() -> mp.context.BaseContext:
    """A fork server that imported torch and dtrec once: each rank of every attempt is
    forked from it (no threads there yet) instead of importing them again (seconds per
    rank on a loaded 2-core machine, four ranks an attempt)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def launch(
    world: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float,
    grace: float,
    collective_timeout: float,
    env: dict[str, str] | None = None,
    backend: str = "gloo",
) -> dict[str, Any]:
    """Run ``fn`` on ``world`` spawned ranks (process group ``backend``); returns
    ``{"exitcodes", "stopped", "timed_out", "seconds"}``. ``stopped``: ranks this launcher
    killed, ``grace`` seconds after the first rank exited abnormally (or at ``timeout``)."""
    child_env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    ctx = _context()
    saved = {k: os.environ.get(k) for k in child_env}
    os.environ.update(child_env)  # children import torch with these set
    procs = []
    start = time.monotonic()
    try:
        for rank in range(world):
            p = ctx.Process(target=_entry, name=f"soak-rank{rank}", args=(
                rank, world, child_env, collective_timeout, backend, fn, args))  # fmt: skip
            p.start()
            procs.append(p)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    first_death, stopped, timed_out = None, [], False
    while any(p.exitcode is None for p in procs):
        time.sleep(_POLL_S)
        now = time.monotonic()
        if first_death is None and any(p.exitcode not in (None, 0) for p in procs):
            first_death = now
        late = first_death is not None and now - first_death > grace
        timed_out = now - start > timeout
        if late or timed_out:
            stuck = [(r, p) for r, p in enumerate(procs) if p.exitcode is None]
            for _, p in stuck:  # where they are stuck goes to stderr first
                os.kill(p.pid, signal.SIGUSR1)
            time.sleep(1.0)
            for r, p in stuck:
                if p.exitcode is None:
                    os.kill(p.pid, signal.SIGKILL)
                stopped.append(r)
            for p in procs:
                p.join()
            break
    for p in procs:
        p.join()
    return {
        "exitcodes": [p.exitcode for p in procs],
        "stopped": stopped,
        "timed_out": timed_out,
        "seconds": time.monotonic() - start,
    }


def read_logs(paths: list[Path]) -> tuple[list[dict], dict[int, dict]]:
    """The attempt's timeline (the longest of the ranks' logs: entries are written after
    every rank agreed on them, so the logs only differ in how far they got) and each
    rank's "end" entry (missing for a rank that was killed)."""
    logs, ends = [], {}
    for rank, path in enumerate(paths):
        entries = []
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    entries.append(json.loads(line))
                except json.JSONDecodeError:  # the last line of a killed writer
                    break
        if entries and entries[-1]["kind"] == "end":
            ends[rank] = entries[-1]
        logs.append([e for e in entries if e["kind"] != "end"])
    return max(logs, key=len), ends
