"""Where an offloaded collection's background copy jobs run (``dtrec/sharded/offload/host.py``):
on a CPU inline by default (a thread there only competes with the step for its cores), on
the worker thread with ``DTREC_OFFLOAD_WORKER=1`` (what the test suite sets, so the
pipelined tests run the threaded path that CUDA takes); a job's error reaches ``wait``."""

from __future__ import annotations

import threading

import pytest
import torch

from dtrec.sharded.offload.host import CopyJobs, CopyStream, worker_thread


def _where_it_ran(monkeypatch: pytest.MonkeyPatch, worker: str | None) -> str:
    if worker is None:
        monkeypatch.delenv("DTREC_OFFLOAD_WORKER", raising=False)
    else:
        monkeypatch.setenv("DTREC_OFFLOAD_WORKER", worker)
    jobs, ran = CopyJobs(CopyStream(torch.device("cpu"))), []
    jobs.start(lambda: ran.append(threading.current_thread().name), background=True)
    jobs.wait()
    return ran[0]


def test_a_cpu_runs_background_copy_jobs_inline_by_default(monkeypatch) -> None:
    assert _where_it_ran(monkeypatch, None) == threading.current_thread().name
    assert not worker_thread(torch.device("cpu"))
    assert worker_thread(torch.device("cuda"))  # no device needed to decide


def test_the_worker_thread_on_request(monkeypatch) -> None:
    assert _where_it_ran(monkeypatch, "1").startswith("dtrec-offload")


def test_a_background_jobs_error_reaches_wait(monkeypatch) -> None:
    monkeypatch.setenv("DTREC_OFFLOAD_WORKER", "1")
    jobs = CopyJobs(CopyStream(torch.device("cpu")))

    def fail() -> None:
        raise RuntimeError("copy failed")

    jobs.start(fail, background=True)
    with pytest.raises(RuntimeError, match="copy failed"):
        jobs.wait()
