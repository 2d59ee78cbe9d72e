"""The dense part alone: dtrec's replicated DTensor parameters vs torch's DDP, side by side.

What a DLRM's dense arch costs under dtrec (``dtrec.sharded.dense``: every dense parameter
a DTensor replicated over the mesh, gradients averaged in bucketed all-reduces) against
``torch.nn.parallel.DistributedDataParallel`` on plain tensors, at W ranks on gloo CPU:
the dense arch of ``benchmarks/gpu_step.py`` (13 dense features -> MLP 256-D, a low-rank
DCNv2 cross layer over [bottom, 26 pooled embeddings of ``--dim``], MLP 256-1), BCE with
logits, ``torch.optim.Adagrad(foreach=True)`` (CUDA's default), ``zero_grad()``; the pooled
embeddings are a fixed random input, so only the dense machinery differs. Each library
builds its model in the same world from the same seed, and their steps alternate (so the
machine's load falls on both alike); a step is forward + backward + optimizer step, timed
after a ``dist.barrier()``, median over steps, then over ranks. Issue 30's target: dtrec <= 1.10x
DDP at W=1 and W=4 (``--target``; the run prints whether each ratio meets it).

    .venv/bin/python -m benchmarks.dense_step --worlds 1,4 \\
        --json benchmarks/results/dense_step_cpu_<date>.json
    .venv/bin/python -m benchmarks.dense_step --worlds 1 --steps 5 --warmup 1   # smoke
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.common.dense_arch import NUM_DENSE, DenseArch
from benchmarks.probes.machine import processor, processor_line
from benchmarks.probes.report import dtrec_source, write_report
from tests.multiprocess import run_world

LIBS = ("ddp", "dtrec")
NUM_TABLES = 26


class _WithTable(torch.nn.Module):
    """The dense arch beside an embedding collection its forward never reads."""

    def __init__(self, dense_arch: torch.nn.Module) -> None:
        import dtrec

        super().__init__()
        self.ebc = dtrec.EmbeddingBagCollection([dtrec.EmbeddingBagConfig("t", 8, 4, ["f"])])
        self.dense_arch = dense_arch

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.dense_arch(dense, pooled)


def run_rank(rank: int, world: int, opts: dict) -> dict:
    """One rank: both libraries' models side by side in this world, their steps
    interleaved (dtrec, DDP, dtrec, ...) so that the machine's load falls on both alike;
    median step ms of each, the last losses, and the largest difference of the first step's
    gradients (relative to the largest gradient): the correctness check. The last losses
    are not one: both average the same gradients, but in a different summation order, and
    Adagrad's first step moves every weight by about ``lr * sign(g)``, so a weight whose
    gradient is near zero may step either way (measured: 1.3e-3 apart after one step,
    losses some 10% apart after 35, from gradients 1e-8 apart)."""
    import dtrec

    batch, dim = opts["batch"], opts["dim"]
    torch.manual_seed(0)
    plain = DenseArch(NUM_TABLES * dim, dim)
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(plain))
    ours = dtrec.distribute_module(
        _WithTable(plain), dtrec.init_mesh("cpu", world), optimizer=dtrec.optim.SGD(0.01)
    )  # distribute_module wants a collection: one tiny table, never read
    models = {"dtrec": ours, "ddp": ddp}
    opts_ = {
        lib: torch.optim.Adagrad([p for p in m.parameters() if p.requires_grad], lr=0.01,
                                 foreach=True)
        for lib, m in models.items()
    }  # fmt: skip
    gen = torch.Generator().manual_seed(rank)
    batches = [
        (
            torch.randn(batch, NUM_DENSE, generator=gen),
            torch.randn(batch, NUM_TABLES * dim, generator=gen),
            torch.randint(0, 2, (batch,), generator=gen).float(),
        )
        for _ in range(4)
    ]
    times: dict[str, list[float]] = {lib: [] for lib in models}
    losses: dict[str, float] = {}
    first_grads: dict[str, list[torch.Tensor]] = {}

    def step(lib: str, s: int) -> float:
        dense, pooled, labels = batches[s % len(batches)]
        dist.barrier()
        start = time.perf_counter()
        loss = F.binary_cross_entropy_with_logits(models[lib](dense, pooled), labels)
        loss.backward()
        if s == 0:
            first_grads[lib] = [_local(p.grad).clone() for p in _dense_params(models[lib])]
        opts_[lib].step()
        opts_[lib].zero_grad()
        elapsed = 1e3 * (time.perf_counter() - start)
        losses[lib] = loss.item()
        return elapsed

    for s in range(opts["warmup"] + opts["steps"]):
        for lib in models:
            ms = step(lib, s)
            if s >= opts["warmup"]:
                times[lib].append(ms)
    largest = max(g.abs().max().item() for g in first_grads["ddp"])
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(first_grads["dtrec"], first_grads["ddp"], strict=True)
    )
    return {
        "median_ms": {lib: statistics.median(t) for lib, t in times.items()},
        "losses": losses,
        "first_grad_rel_diff": diff / max(largest, 1e-30),
    }


def _dense_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The dense arch's parameters, in the same order in both libraries' models."""
    inner = model.module if hasattr(model, "module") else model.dense_arch
    return list(inner.parameters())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="1,4", help="world sizes, comma-separated")
    p.add_argument("--batch", type=int, default=2048, help="samples per rank per step")
    p.add_argument("--dim", type=int, default=16, help="embedding dim of the pooled input")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--target", type=float, default=1.10, help="dtrec / DDP ratio to meet")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    opts = {k: getattr(args, k) for k in ("batch", "dim", "steps", "warmup")}
    results: dict[str, dict] = {}
    for world in [int(w) for w in args.worlds.split(",") if w]:
        ranks = run_world(world, run_rank, opts, timeout=900)
        ms = {lib: statistics.median(r["median_ms"][lib] for r in ranks) for lib in LIBS}
        ratio = ms["dtrec"] / ms["ddp"]
        grad_diff = max(r["first_grad_rel_diff"] for r in ranks)
        if grad_diff > 1e-5:  # the numerics contract: equal up to float reassociation
            raise AssertionError(f"W={world}: dtrec's dense gradients differ from DDP's by "
                                 f"{grad_diff:.2e} of the largest")  # fmt: skip
        results[f"W{world}"] = {"ms": ms, "ratio": ratio, "meets_target": ratio <= args.target,
                                "first_grad_rel_diff": grad_diff, "ranks": ranks}  # fmt: skip
        verdict = "meets" if ratio <= args.target else "MISSES"
        print(f"W={world}: dtrec {ms['dtrec']:.2f} ms, DDP {ms['ddp']:.2f} ms, "
              f"ratio {ratio:.2f} ({verdict} <= {args.target}); first-step gradients "
              f"{grad_diff:.1e} apart (relative)", flush=True)  # fmt: skip
    print(f"processor: {processor_line()}")
    if args.json:
        meta = {
            "date": datetime.date.today().isoformat(),
            "command": " ".join(["python -m benchmarks.dense_step", *argv]),
            "torch": torch.__version__,
            "processor": processor(),
            "dtrec": dtrec_source(),
            "args": vars(args),
        }
        write_report(args.json, {"meta": meta, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
