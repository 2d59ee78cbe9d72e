"""``--pipeline`` of ``benchmarks.distributed``: each library's own train pipeline, timed.

dtrec's ``dtrec.TrainPipeline`` (the input-dist of batch i + 1 in flight during batch i)
and TorchRec's ``TrainPipelineSparseDist`` (the same idea, plus a copy stream on GPU)
run on the model the plain loop trained, over the same batches. A step is one
``next()`` of dtrec's generator or one ``progress()`` of TorchRec's pipeline; a barrier
(outside the timed region) starts every step together, as in the plain loop. Where a
pipeline cannot run, the error says why instead of a time.
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import dtrec


class _Optimizers:
    """Several torch optimizers as the one a pipeline takes."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._optimizers = list(optimizers)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self._optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for opt in self._optimizers:
            opt.step()


def _timed(steps: Iterator[object], count: int) -> list[float]:
    """Run ``count`` steps of ``steps``; the ms of each (a barrier before each, untimed)."""
    times = []
    for _ in range(count):
        dist.barrier()
        start = time.perf_counter()
        next(steps)
        times.append(1e3 * (time.perf_counter() - start))
    return times


def _dtrec_steps(model: nn.Module, optimizers: Sequence, batches: list) -> Iterator[Tensor]:
    def loss_fn(m: nn.Module, batch: tuple) -> Tensor:
        return F.binary_cross_entropy_with_logits(m(batch[0]), batch[1])

    pipe = dtrec.TrainPipeline(model, _Optimizers(optimizers), loss_fn, lambda b: b[0])
    return pipe.run(batches)


class _LossModel(nn.Module):
    """TorchRec's pipeline calls ``model(batch)`` for ``(losses, output)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: object) -> tuple[Tensor, Tensor]:
        logits = self.model(batch.sparse_features)  # type: ignore[attr-defined]
        return F.binary_cross_entropy_with_logits(logits, batch.labels), logits  # type: ignore[attr-defined]


def _torchrec_steps(model: nn.Module, optimizers: Sequence, batches: list) -> Iterator[object]:
    from torchrec.datasets.utils import Batch
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    pipe = TrainPipelineSparseDist(_LossModel(model), _Optimizers(optimizers), torch.device("cpu"))
    it = iter(
        Batch(
            dense_features=torch.zeros(len(labels), 0),
            sparse_features=kjt,
            labels=labels,
        )
        for kjt, labels in batches
    )
    while True:
        yield pipe.progress(it)


def pipeline_run(
    lib: str, model: nn.Module, optimizers: Sequence, batches: list, warmup: int
) -> dict:
    """``{"step_ms": [...], "median_ms"}`` over ``batches`` after ``warmup`` of them, or
    ``{"error": why}`` where the library's pipeline does not run."""
    make: Callable = _dtrec_steps if lib == "dtrec" else _torchrec_steps
    try:
        steps = make(model, optimizers, batches)
        times = _timed(steps, len(batches))
    except Exception as exc:  # reported in the table and the JSON, not raised
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return {"error": f"{lib} pipeline: {last[:600]}"}
    timed = times[warmup:] or times
    return {"step_ms": timed, "median_ms": statistics.median(timed)}


def print_pipeline_table(results: dict[str, dict[str, dict]]) -> None:
    """Plain loop vs each library's pipeline, median step ms (medians over ranks)."""
    head = f"{'config':<16}{'lib':<10}{'plain ms':>10}{'pipelined':>11}{'ratio':>7}"
    print("\nmedian step, plain loop vs the library's train pipeline")
    print(head)
    print("-" * len(head))
    for config, runs in results.items():
        for lib, run in runs.items():
            if run["status"] != "ok":
                continue
            m = run["median"]
            plain, piped = m["step_ms"], m.get("pipeline_step_ms")
            if piped is None:
                print(f"{config:<16}{lib:<10}{plain:>10.1f}{'-':>11}   {m.get('pipeline_error')}")
                continue
            print(f"{config:<16}{lib:<10}{plain:>10.1f}{piped:>11.1f}{piped / plain:>7.2f}")


__all__ = ["pipeline_run", "print_pipeline_table"]
