"""Kernel benchmark: dtrec's pooled lookup and fused backward vs PyTorch's own path.

For each config: forward, and forward + backward + fused RowWiseAdagrad, timed
side by side with PyTorch's path (per-table ``F.embedding_bag(sparse=True)`` +
``torch.optim.Adagrad`` on the sparse grads). Reports median time, achieved
GB/s (rows read/written + ids + offsets + output, see ``traffic``) and its
ratio to a device-to-device copy measured in the same run, and the forward's
time relative to a plain gather of the same rows (``index_select``).

    PYTHONPATH=. python benchmarks/kernels.py --json benchmarks/results/kernels_<device>_<date>.json
    python benchmarks/kernels.py --device cpu --scale 0.01 --batch 1024   # small CPU run
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

import dtrec
from benchmarks.common.device import copy_bandwidth, timed
from benchmarks.common.dlrm import dlrm_rows, make_ids
from benchmarks.probes.machine import processor
from dtrec.ops.lookup import Lookup
from dtrec.ops.op import lookup_forward


@dataclass
class Config:
    name: str
    rows: list[int]
    dim: int
    batch: int
    pooling: int  # ids per bag (fixed L)
    dist: str  # "uniform" or "zipf"


def traffic(cfg: Config, num_ids: int, unique_rows: int, elem: int, idx: int) -> dict[str, int]:
    """Bytes the kernels must move at least (DRAM/HBM traffic model)."""
    tables = len(cfg.rows)
    out = cfg.batch * tables * cfg.dim * 4
    fwd = num_ids * (cfg.dim * elem + idx) + tables * cfg.batch * 8 + out
    # backward + update: read grad_out, ids again; read+write touched rows and state.
    bwd = out + num_ids * idx + unique_rows * (2 * cfg.dim * elem + 8)
    return {"forward": fwd, "forward_backward_optimizer": fwd + bwd}


def run_config(
    cfg: Config, device: torch.device, dtype: torch.dtype, iters: int, baseline: bool
) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    tables = len(cfg.rows)
    # Tables as views of one flat buffer (how the sharded module packs local shards).
    sizes = [r * cfg.dim for r in cfg.rows]
    flat = torch.empty(sum(sizes), dtype=dtype, device=device).uniform_(-0.01, 0.01, generator=gen)
    weights = list(torch.split(flat, sizes))
    weights = [w.view(r, cfg.dim) for w, r in zip(weights, cfg.rows)]
    n_per = cfg.batch * cfg.pooling
    values = torch.cat([make_ids(r, n_per, cfg.dist, device, gen) for r in cfg.rows])
    offsets = torch.arange(0, tables * n_per + 1, cfg.pooling, device=device)
    entry_table, mean = list(range(tables)), [False] * tables
    unique_rows = sum(
        int(torch.unique(values[t * n_per : (t + 1) * n_per]).numel()) for t in range(tables)
    )
    bytes_moved = traffic(cfg, values.numel(), unique_rows, flat.element_size(), 8)
    grad_out = torch.randn(cfg.batch, tables * cfg.dim, device=device, generator=gen)
    opt = dtrec.optim.RowWiseAdagrad(lr=0.01)
    states = opt.init_states(weights)

    lookup = Lookup(weights, entry_table, values, offsets, mean)

    def dtrec_forward():
        return lookup_forward(lookup)

    def dtrec_step():  # backward + update fused in one pass where the backend can
        lookup_forward(lookup)
        opt.backward_update(lookup, grad_out, states)

    result = {"config": asdict(cfg) | {"rows": cfg.rows}, "num_ids": values.numel()}
    result["unique_rows"] = unique_rows
    result["bytes"] = bytes_moved
    # The same rows read by a plain gather (index_select into [N, D], no pooling): what
    # random row reads alone cost on this device, the floor for a short-bag forward.
    row_base = torch.tensor([0, *cfg.rows[:-1]], device=device).cumsum(0)
    global_ids = values + row_base.repeat_interleave(n_per)
    result["gather_s"] = timed(
        lambda: torch.index_select(flat.view(-1, cfg.dim), 0, global_ids), iters, device
    )
    result["dtrec"] = {
        "forward_s": timed(dtrec_forward, iters, device),
        "forward_backward_optimizer_s": timed(dtrec_step, iters, device),
    }
    if baseline:
        params = [w.detach().clone().requires_grad_() for w in weights]
        adagrad = torch.optim.Adagrad(params, lr=0.01)
        local_offsets = torch.arange(0, n_per, cfg.pooling, device=device)

        def torch_forward(grad: bool = False):
            outs = [
                F.embedding_bag(
                    values[t * n_per : (t + 1) * n_per],
                    params[t],
                    local_offsets,
                    mode="sum",
                    sparse=True,
                )
                for t in range(tables)
            ]
            return torch.cat(outs, dim=1)

        def torch_step():
            out = torch_forward()
            out.backward(grad_out)
            adagrad.step()
            adagrad.zero_grad(set_to_none=True)

        with torch.no_grad():
            torch.testing.assert_close(
                torch_forward(), dtrec_forward().to(torch.float32), rtol=1e-2, atol=1e-3
            )
        result["pytorch"] = {
            "forward_s": timed(lambda: torch.no_grad()(torch_forward)(), iters, device),
            "forward_backward_optimizer_s": timed(torch_step, iters, device),
        }
        del params, adagrad
    tbe = _fbgemm_split_tbe(weights) if device.type == "cpu" else None
    if tbe is not None:
        grad_cpu = grad_out

        def fbgemm_step():
            tbe(values, offsets).backward(grad_cpu)

        with torch.no_grad():
            result["fbgemm"] = {"forward_s": timed(lambda: tbe(values, offsets), iters, device)}
        result["fbgemm"]["forward_backward_optimizer_s"] = timed(fbgemm_step, iters, device)
    for impl in [k for k in IMPLS if k in result]:
        for phase in ("forward", "forward_backward_optimizer"):
            result[impl][f"{phase}_GBps"] = bytes_moved[phase] / result[impl][f"{phase}_s"] / 1e9
    result["dtrec"]["forward_of_gather"] = result["gather_s"] / result["dtrec"]["forward_s"]
    for other in [k for k in IMPLS[1:] if k in result]:
        result[f"speedup_vs_{other}"] = {
            phase: result[other][f"{phase}_s"] / result["dtrec"][f"{phase}_s"]
            for phase in ("forward", "forward_backward_optimizer")
        }
    return result


IMPLS = ("dtrec", "pytorch", "fbgemm")


def _fbgemm_split_tbe(weights: list[torch.Tensor]):
    """fbgemm's CPU TBE with fused exact row-wise Adagrad, or None without fbgemm."""
    from dtrec.ops.backends.fbgemm_loader import fbgemm_available

    if not fbgemm_available() or weights[0].dtype != torch.float32:
        return None
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(w.shape[0], w.shape[1], EmbeddingLocation.HOST, ComputeDevice.CPU) for w in weights],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.01,
        pooling_mode=PoolingMode.SUM,
        bounds_check_mode=BoundsCheckMode.NONE,
    )
    with torch.no_grad():
        for dst, src in zip(tbe.split_embedding_weights(), weights):
            dst.copy_(src)
    return tbe


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies table rows")
    parser.add_argument("--max-rows", type=float, default=5e6, help="largest DLRM table")
    parser.add_argument("--poolings", default="1,20,80")
    parser.add_argument("--dists", default="uniform,zipf", help="id distributions")
    parser.add_argument("--many-small", type=int, default=500,
                        help="tables of the many-small config (0: skip it)")  # fmt: skip
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)

    configs = [
        Config(
            f"dlrm_L{L}_{dist}",
            dlrm_rows(26, 1e5, args.max_rows, args.scale),
            128,
            args.batch,
            L,
            dist,
        )
        for L in map(int, args.poolings.split(","))
        for dist in args.dists.split(",")
    ]
    if args.many_small:
        configs.append(
            Config(
                f"many_small_D32_L20_T{args.many_small}",
                [max(1, int(1e4 * args.scale))] * args.many_small,
                32,
                max(1, args.batch // 4),
                20,
                "zipf",
            )
        )

    copy_gbps = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 27, args.iters)
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
    print(f"device {device} ({name}), copy {copy_gbps:.0f} GB/s, backend {dtrec.ops.get_backend()}")
    results = []
    for cfg in configs:
        r = run_config(cfg, device, dtype, args.iters, not args.no_baseline)
        for impl in [k for k in IMPLS if k in r]:
            for phase in ("forward", "forward_backward_optimizer"):
                r[impl][f"{phase}_of_copy"] = r[impl][f"{phase}_GBps"] / copy_gbps
        results.append(r)
        d = r["dtrec"]
        fb = "forward_backward_optimizer"
        line = (
            f"{cfg.name:<24} fwd {d['forward_s'] * 1e3:8.2f} ms {d['forward_GBps']:7.0f} GB/s "
            f"({d['forward_of_copy']:.0%} of copy) | fwd+bwd+opt {d[fb + '_s'] * 1e3:8.2f} ms "
            f"{d[fb + '_GBps']:7.0f} GB/s ({d[fb + '_of_copy']:.0%})"
            f" | fwd at {d['forward_of_gather']:.0%} of a plain gather's speed"
        )
        for other in IMPLS[1:]:
            if f"speedup_vs_{other}" in r:
                s = r[f"speedup_vs_{other}"]
                line += f" | vs {other} x{s['forward']:.2f} fwd, x{s[fb]:.2f} step"
        print(line, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if args.json:
        import triton

        meta = {
            "date": datetime.date.today().isoformat(),
            "device": torch.cuda.get_device_name()
            if device.type == "cuda"
            else platform.processor(),
            "processor": processor(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "dtype": args.dtype,
            "backend": dtrec.ops.get_backend(),
            "copy_GBps": copy_gbps,
            "command": "python benchmarks/kernels.py "
            + " ".join(
                f"--{k.replace('_', '-')} {v}"
                for k, v in vars(args).items()
                if v not in (None, False)
            ),
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
