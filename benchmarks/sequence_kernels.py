"""Unpooled (sequence) lookup kernels vs a device copy of the same bytes (issue 15).

The sequence path's fallback looks rows up through the pooled op with bags of one id
(``dtrec.sharded.lookup.sequence.RowPool``; with a fused optimizer it gathers from the packed
shards instead, ``gather_of_copy`` below). This times that op at
DLRM-like shapes: 26 tables of dim 128 (rows geometric 1e5..``--max-rows``), ``--batch``
samples with ``L`` ids each per table (``--lengths``), uniform or Zipf(1.1) ids:

* ``forward``: the gather, ``[n, D]`` per table;
* ``forward_backward_optimizer``: forward, then backward + fused row-wise Adagrad
  (``RowWiseAdagrad.backward_update``: one pass over the touched rows where the backend
  fuses it).

Both as one op call per table (``per_table``) and as one call
over every table (``batched``: T entries, ``[n, T*D]``, possible here since every table
gets n ids). Each is compared with a device-to-device copy moving the same bytes (read +
write, ``traffic``), timed in the same run: ``of_copy`` = copy time / kernel time, the
achieved bandwidth as a fraction of copy bandwidth (the issue's target: forward >= 0.8 on
GPU). ``gather_of_copy``: the same for a plain ``index_select`` of the rows.

    PYTHONPATH=. python benchmarks/sequence_kernels.py --device cuda \\
        --json benchmarks/results/sequence_kernels_<card>_<date>.json
    PYTHONPATH=. python benchmarks/sequence_kernels.py --device cpu --scale 0.001 \\
        --batch 16 --lengths 1,4 --iters 2   # CPU smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

import dtrec
from benchmarks.common.device import timed
from benchmarks.common.dlrm import dlrm_rows, make_ids
from dtrec.ops.lookup import Lookup
from dtrec.ops.op import lookup_forward

PHASES = ("forward", "forward_backward_optimizer")


@dataclass(frozen=True)
class SequenceConfig:
    name: str
    rows: list[int]
    dim: int
    batch: int
    length: int  # ids per sample per table, each its own bag
    dist: str  # "uniform" or "zipf"


def traffic(cfg: SequenceConfig, unique_rows: int, elem: int) -> dict[str, int]:
    """Bytes each phase must move at least: rows read and written, ids, offsets, output
    (fp32), and for the update the output's gradient and the touched rows + their state."""
    n = cfg.batch * cfg.length * len(cfg.rows)
    fwd = n * (cfg.dim * elem + 8 + 8 + cfg.dim * 4)
    bwd = n * (cfg.dim * 4 + 8) + unique_rows * (2 * cfg.dim * elem + 8)
    return {"forward": fwd, "forward_backward_optimizer": fwd + bwd}


def copy_seconds(nbytes: int, device: torch.device, iters: int) -> float:
    """Seconds of a device-to-device copy that reads and writes ``nbytes`` in all."""
    src = torch.empty(max(nbytes // 8, 1), dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src), iters, device)


def run_config(cfg: SequenceConfig, device: torch.device, dtype: torch.dtype, iters: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    tables, n = len(cfg.rows), cfg.batch * cfg.length
    sizes = [r * cfg.dim for r in cfg.rows]
    flat = torch.empty(sum(sizes), dtype=dtype, device=device).uniform_(-0.01, 0.01, generator=gen)
    weights = [w.view(r, cfg.dim) for w, r in zip(flat.split(sizes), cfg.rows, strict=True)]
    ids = [make_ids(r, n, cfg.dist, device, gen) for r in cfg.rows]
    unique_rows = sum(int(torch.unique(i).numel()) for i in ids)
    opt = dtrec.optim.RowWiseAdagrad(lr=0.01)
    states = opt.init_states(weights)
    bags = torch.arange(n + 1, device=device)
    singles = [Lookup([w], [0], i, bags, [False]) for w, i in zip(weights, ids, strict=True)]
    values = torch.cat(ids)
    all_bags = torch.arange(tables * n + 1, device=device)
    batched = Lookup(weights, list(range(tables)), values, all_bags, [False] * tables)
    grads = [torch.randn(n, cfg.dim, device=device, generator=gen) for _ in range(tables)]
    grad_all = torch.cat(grads, dim=1)

    def per_table_step() -> None:
        for t, lookup in enumerate(singles):
            lookup_forward(lookup)
            opt.backward_update(lookup, grads[t], [states[t]])

    def batched_step() -> None:
        lookup_forward(batched)
        opt.backward_update(batched, grad_all, states)

    with torch.no_grad():  # the op gathers exactly the rows (bags of one id)
        for w, i, lookup in zip(weights, ids, singles, strict=True):
            torch.testing.assert_close(lookup_forward(lookup), w[i].float(), rtol=0, atol=0)
    variants: dict[str, dict[str, Callable[[], object]]] = {
        "per_table": {
            "forward": lambda: [lookup_forward(lookup) for lookup in singles],
            "forward_backward_optimizer": per_table_step,
        },
        "batched": {
            "forward": lambda: lookup_forward(batched),
            "forward_backward_optimizer": batched_step,
        },
    }
    moved = traffic(cfg, unique_rows, flat.element_size())
    copy_s = {phase: copy_seconds(moved[phase], device, iters) for phase in PHASES}
    row_base = torch.tensor([0, *cfg.rows[:-1]], device=device).cumsum(0)
    global_ids = values + row_base.repeat_interleave(n)
    gather_s = timed(lambda: flat.view(-1, cfg.dim).index_select(0, global_ids), iters, device)
    result: dict = {"config": asdict(cfg), "num_ids": values.numel(), "unique_rows": unique_rows}
    result |= {"bytes": moved, "copy_s": copy_s, "gather_s": gather_s}
    result["gather_of_copy"] = copy_s["forward"] / gather_s
    for variant, fns in variants.items():
        result[variant] = {}
        for phase in PHASES:
            seconds = timed(fns[phase], iters, device)
            result[variant][f"{phase}_s"] = seconds
            result[variant][f"{phase}_GBps"] = moved[phase] / seconds / 1e9
            result[variant][f"{phase}_of_copy"] = copy_s[phase] / seconds
    return result


def configs(args: argparse.Namespace) -> list[SequenceConfig]:
    rows = dlrm_rows(26, 1e5, args.max_rows, args.scale)
    return [
        SequenceConfig(f"dlrm_seq_L{length}_{dist}", rows, 128, args.batch, length, dist)
        for length in map(int, args.lengths.split(","))
        for dist in ("uniform", "zipf")
    ]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--lengths", default="1,20", help="ids per sample per table")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies table rows")
    parser.add_argument("--max-rows", type=float, default=2e6, help="largest table's rows")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    card = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
    print(f"device {device} ({card}), backend {dtrec.ops.get_backend()}, dtype {args.dtype}")
    results = []
    for cfg in configs(args):
        r = run_config(cfg, device, dtype, args.iters)
        results.append(r)
        cells = " | ".join(
            f"{variant} fwd {r[variant]['forward_s'] * 1e3:.2f} ms "
            f"({r[variant]['forward_of_copy']:.0%} of copy), fwd+bwd+opt "
            f"{r[variant]['forward_backward_optimizer_s'] * 1e3:.2f} ms "
            f"({r[variant]['forward_backward_optimizer_of_copy']:.0%})"
            for variant in ("per_table", "batched")
        )
        print(f"{cfg.name:<22} {cells} | gather {r['gather_of_copy']:.0%} of copy", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        meta = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": card,
            "torch": torch.__version__,
            "backend": dtrec.ops.get_backend(),
            "argv": sys.argv,
            "args": vars(args),
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
