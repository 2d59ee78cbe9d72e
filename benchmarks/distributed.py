"""dtrec vs TorchRec, side by side: the same model, batches and optimizers on W gloo CPU ranks.

Model: 8 tables (rows geometric 1e5..1e6 times ``--scale``, D=64, one feature each, sum
pooling), bags of 10..30 ids (uniform, mean 20), ids Zipf(1.1) over each table's rows (a
truncated inverse CDF, then a fixed multiplicative hash scatters hot ids over the rows),
``--batch`` samples per rank; pooled embeddings -> Linear(T x 64, 64) -> ReLU -> Linear(64, 1),
BCE-with-logits vs random labels. Tables: fused exact row-wise Adagrad (lr 0.01, eps 1e-8);
MLP: ``torch.optim.Adagrad(lr=0.01)``, data parallel (dtrec's replicated DTensor dense
parameters, ``dtrec.sharded.dense``; TorchRec DDP).
Rank r's batch of step s is generated from the seed (r, s) alike for both libraries.
``--workload mixed_sizes`` (issue 46's second workload): 16 tables of 100..1e6 rows
(geometric), Zipf(1.05), same bags: many small tables whose ids repeat heavily.

Configs (``--configs``): ``table_wise`` (table i on shard rank i % S), ``row_wise``,
``column_wise``, ``data_parallel``, ``mixed`` (quarters of the tables: DP, TW, CW, RW) on a
shard group of S = W ranks (dtrec mesh (W, 1), TorchRec ``DistributedModelParallel``), and
``2d_<type>`` on S = W / 2 (dtrec mesh (W/2, 2), TorchRec ``DMPCollection`` with ``sync()``
after every step, patched to run on CPU: see ``benchmarks/common/torchrec_side.py``).

Every (library, config) runs in a fresh world of W processes (so ``ru_maxrss`` is that run's
peak): ``--warmup`` steps, then ``--steps`` timed steps, each preceded by a ``dist.barrier()``
outside the timed region; a step is forward + backward + optimizer step(s) (+ ``sync()``).
Bytes: every ``torch.distributed`` collective (and ``ProcessGroup.allreduce_coalesced``) is
wrapped during the timed steps and charged what this rank sends (all-to-all: all but its own
split; all-reduce: 2 (n-1)/n of the tensor; reduce-scatter: (n-1)/n of the input; all-gather:
(n-1) inputs; broadcast: the tensor, on the source). TorchRec's DDP gradient all-reduce
runs in C++ and is not seen by the wrappers: ``dense_ddp_estimate`` = 2 (W-1)/W x bytes
of the parameters DDP reduces (TorchRec's data-parallel tables included); dtrec's dense
all-reduce is seen (its estimate is 0). One more untimed step runs under a
dispatch-mode census of every c10d op (DDP's included) to check the wrappers missed nothing.

Before the configs (and again after them, to tell whether the machine's speed held), one
world measures the machine (``benchmarks/probes/cpu_calibration.py``: collective latency
and bandwidths, lookup and update speed, the dense step, a host floor); the report then
predicts every config's dtrec step from the first measurement and the planner's cost model
and prints the error and the plans' order (``benchmarks/common/step_prediction.py``, issue 33;
``--no-predict`` skips all of it).

``--cost-model`` prints dtrec's expected bytes per rank per step for large worlds (no processes),
computed from the tables' shard layouts (``cost_model``); the full run also checks it against the
bytes dtrec measured at W.

    .venv/bin/python -m benchmarks.distributed --steps 20 --warmup 3 \\
        --json benchmarks/results/distributed_cpu_<date>.json
    .venv/bin/python -m benchmarks.distributed --scale 0.01 --steps 2 --warmup 1 --batch 32 \\
        --configs table_wise,row_wise --no-torchrec          # smoke run, about 30 s
    .venv/bin/python -m benchmarks.distributed --cost-model

(from the repository root; ``dtrec`` is imported from the working directory first, so running
from a clone of a given commit measures that commit, see ``meta.dtrec`` in the JSON).
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.common.cost_model import cost_model
from benchmarks.common.pipeline import print_pipeline_table
from benchmarks.common.report import fmt_bytes, num, ratio, run_meta
from benchmarks.common.run_loop import MALLOC_ENV, run_config
from benchmarks.common.step_prediction import calibrate, check
from benchmarks.common.workloads import TYPES, WORKLOADS, Workload, table_kinds, workload
from benchmarks.probes.machine import processor_line
from benchmarks.probes.report import dtrec_source, write_report
from benchmarks.probes.stages import print_stage_table
from dtrec.placements.mesh import positions_per_node

CONFIGS = (*TYPES, *(f"2d_{t}" for t in TYPES))
DEFAULT_CONFIGS = (*TYPES, "2d_row_wise", "2d_mixed")


def print_table(results: dict[str, dict[str, dict]]) -> None:
    """The side-by-side table (medians over ranks), then bytes per collective."""

    def get(config: str, lib: str, key: str) -> float | None:
        run = results[config].get(lib)
        return run["median"][key] if run and run["status"] == "ok" else None

    head = (
        f"{'config':<16}{'dtrec ms':>9}{'TR ms':>9}{'ratio':>6}{'dtrec B/step':>13}"
        f"{'TR B/step':>11}{'ratio':>6}{'dtrec RSS MB':>14}{'TR RSS MB':>12}"
    )
    print(head)
    print("-" * len(head))
    for config in results:
        d_ms, t_ms = get(config, "dtrec", "step_ms"), get(config, "torchrec", "step_ms")
        d_b = get(config, "dtrec", "total_bytes_per_step")
        t_b = get(config, "torchrec", "total_bytes_per_step")
        rss = [_rss(results[config].get(lib)) for lib in ("dtrec", "torchrec")]
        print(
            f"{config:<16}{num(d_ms):>9}{num(t_ms):>9}{ratio(d_ms, t_ms):>6}"
            f"{fmt_bytes(d_b):>13}{fmt_bytes(t_b):>11}{ratio(d_b, t_b):>6}"
            f"{rss[0]:>14}{rss[1]:>12}"
        )
    print(
        "ms: median step; B/step: wrapped collectives + dense_ddp_estimate, per rank; "
        "RSS: peak/end per rank"
    )
    for config, runs in results.items():
        for lib, run in runs.items():
            if run["status"] != "ok":
                last = run["error"].strip().splitlines()[-1] if run["error"].strip() else "?"
                print(f"  {config} {lib}: FAILED: {last[:200]}")
                continue
            m = run["median"]
            parts = [f"{k} {fmt_bytes(v)}" for k, v in m["bytes_by_collective"].items()]
            parts.append(f"DDP est. {fmt_bytes(m['dense_ddp_estimate'])}")
            print(f"  {config} {lib}: " + ", ".join(parts))
            if lib == "dtrec":
                check = run["cost_model_check"]
                stats = m["dtrec_comm_stats"]
                print(
                    f"  {config} dtrec comm_stats: "
                    + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in stats.items())
                    + f" | cost model {fmt_bytes(check['model_mean_bytes'])} vs measured "
                    + f"{fmt_bytes(check['measured_mean_bytes'])}"
                )
                comm_ms = m["dtrec_comm_ms"]
                print(
                    f"  {config} dtrec ms in collectives: {sum(comm_ms.values()):.1f} of "
                    f"{m['step_ms']:.1f} ("
                    + ", ".join(f"{k} {v:.1f}" for k, v in comm_ms.items() if v >= 0.05)
                    + ")"
                )


def check_targets(results: dict[str, dict[str, dict]], target: float) -> dict[str, dict]:
    """Per config, dtrec's step time over TorchRec's against ``target`` (issue 30: <= 0.75
    for every type and for 2D vs DMPCollection), and its bytes over TorchRec's (must not
    exceed 1): a ratio measured side by side in this run, never an absolute time."""
    out = {}
    for config, runs in results.items():
        d, t = runs.get("dtrec"), runs.get("torchrec")
        if not (d and t and d["status"] == "ok" and t["status"] == "ok"):
            continue
        ratio = d["median"]["step_ms"] / t["median"]["step_ms"]
        nbytes = d["median"]["total_bytes_per_step"] / max(t["median"]["total_bytes_per_step"], 1)
        out[config] = {"step_ratio": ratio, "bytes_ratio": nbytes,
                       "meets": ratio <= target and nbytes <= 1.0}  # fmt: skip
        verdict = "meets" if out[config]["meets"] else "MISSES"
        print(f"  target {config}: step {ratio:.2f}x TorchRec, bytes {nbytes:.2f}x: {verdict} "
              f"(step <= {target}x, bytes <= 1x)")  # fmt: skip
    return out


def _rss(run: dict | None) -> str:
    """Peak/end RSS in MB (medians over ranks) of a run, or "-"."""
    if not run or run["status"] != "ok":
        return "-"
    return f"{run['median']['peak_rss_mb']:.0f}/{run['median']['end_rss_mb']:.0f}"


COST_WORLDS = (8, 64, 512, 4096)
COST_SHARDS = (8, 64, 512)
COST_TYPES = (*TYPES, "table_row_wise", "grid")


def cost_model_table(w: Workload, node_size: int = 8) -> list[dict]:
    """``cost_model`` for every type x S x W (S <= W); node-aware types use ``node_size``."""
    out = []
    for kind in COST_TYPES:
        for s_size in COST_SHARDS:
            for world in COST_WORLDS:
                if s_size > world:
                    continue
                row = {"type": kind, "S": s_size, "W": world, "R": world // s_size}
                try:
                    if kind in ("table_row_wise", "grid"):
                        nodes = s_size // positions_per_node(world, s_size, node_size)
                        trw = [f"trw:{i % nodes}" for i in range(len(w.rows))]
                        kinds = trw if kind == "table_row_wise" else ["grid"] * len(w.rows)
                        row.update(cost_model(w, kinds, world, s_size, node_size))
                    else:
                        row.update(cost_model(w, table_kinds(kind, s_size), world, s_size))
                except ValueError as exc:  # e.g. column-wise with D < S
                    row["error"] = str(exc)
                out.append(row)
    return out


def print_cost_model(rows: list[dict]) -> None:
    print("\ndtrec cost model: mean bytes per rank per step (max over ranks in parentheses)")
    print(f"{'type':<16}{'S':>5}" + "".join(f"{'W=' + str(x):>24}" for x in COST_WORLDS))
    keys = sorted({(r["type"], r["S"]) for r in rows}, key=lambda k: (COST_TYPES.index(k[0]), k[1]))
    for kind, s_size in keys:
        cells = []
        for world in COST_WORLDS:
            r = next(
                (r for r in rows if (r["type"], r["S"], r["W"]) == (kind, s_size, world)), None
            )
            if r is None:
                cells.append("")
            elif "error" in r:
                cells.append("n/a")
            else:
                cells.append(f"{fmt_bytes(r['mean_total'])} ({fmt_bytes(r['max_total'])})")
        print(f"{kind:<16}{s_size:>5}" + "".join(f"{c:>24}" for c in cells))


# --------------------------------------------------------------------------- main


def write_profiles(path: str, results: dict[str, dict[str, dict]]) -> None:
    """Every run's rank-0 profile (``--profile``) into one text file, run by run."""
    with open(path, "w") as f:
        f.write(f"processor: {processor_line()}\n")
        for config, libs in results.items():
            for lib, run in libs.items():
                table = run.get("ranks", [{}])[0].get("profile") if run["status"] == "ok" else None
                f.write(f"\n##### {config} {lib}\n{table or run.get('error', 'no profile')}\n")
    print(f"profiles in {path}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies table rows")
    parser.add_argument("--batch", type=int, default=512, help="samples per rank per step")
    parser.add_argument("--workload", default="large_tables", choices=WORKLOADS,
                        help="the tables and ids (see benchmarks/common/workloads.py)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--census-steps", type=int, default=1, help="untimed census steps")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"of {CONFIGS}")
    parser.add_argument("--no-torchrec", action="store_true", help="run dtrec only")
    parser.add_argument("--dtrec-backend", default="auto", help="dtrec.ops.set_backend value")
    parser.add_argument("--cost-model", action="store_true", help="only the cost-model table")
    parser.add_argument("--timeout", type=float, default=1200.0, help="per world, seconds")
    parser.add_argument("--json", help="write results here")
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="also time dtrec.TrainPipeline / TorchRec's TrainPipelineSparseDist",
    )
    parser.add_argument("--no-predict", action="store_true",
                        help="skip the calibration world and the predicted steps")  # fmt: skip
    parser.add_argument("--target", type=float, default=0.75,
                        help="dtrec / TorchRec step time each config should meet")  # fmt: skip
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="profile STEPS more steps on rank 0 of each run; tables in --profile-out",
    )
    parser.add_argument("--profile-out", default="distributed_profile.txt",
                        help="where --profile writes its tables")  # fmt: skip
    parser.add_argument(
        "--malloc-default", action="store_true", help=f"leave glibc malloc as is (not {MALLOC_ENV})"
    )
    args = parser.parse_args(argv)
    w = workload(args.scale, args.batch, args.workload)
    env = {} if args.malloc_default else MALLOC_ENV
    meta = run_meta("benchmarks.distributed", argv, w)
    report: dict = {"meta": {**meta, "workload_kind": args.workload, "rank_env": env}}
    report["cost_model"] = cost_table = cost_model_table(w)
    if not args.cost_model:
        configs = [c for c in args.configs.split(",") if c]
        unknown = sorted(set(configs) - set(CONFIGS))
        if unknown:
            parser.error(f"unknown configs {unknown}; choose from {CONFIGS}")
        names = ("steps", "warmup", "census_steps", "timeout", "dtrec_backend", "pipeline",
                 "profile")  # fmt: skip
        opts = {**{k: getattr(args, k) for k in names}, "env": env}
        libs = ["dtrec"] if args.no_torchrec else ["dtrec", "torchrec"]
        calibration = None
        if not args.no_predict:
            calibration = report["meta"]["cpu_calibration"] = calibrate(w, args.world_size)
            print(f"[calibration] ok ({calibration['wall_s']:.0f} s)", flush=True)
        results: dict[str, dict[str, dict]] = {}
        for config in configs:
            results[config] = {}
            for lib in libs:
                run = run_config(lib, config, w, opts, args.world_size)
                results[config][lib] = run
                state = run["status"]
                ms = f"{run['median']['step_ms']:.1f} ms/step" if state == "ok" else ""
                load = "load {:.1f} -> {:.1f}".format(*run["load_avg"])
                first = run.get("ranks", [{}])[0]
                update = first.get("cpu_rowwise_adagrad")
                update = f", row-wise Adagrad on {update}" if update else ""
                if first.get("cpu_kernels") is not None:  # dtrec.kernels.cpu built or not
                    update += ", C kernels " + ("on" if first["cpu_kernels"] else "off")
                print(f"[{config} {lib}] {state} {ms} ({run['wall_s']:.0f} s, {load}{update})",
                      flush=True)  # fmt: skip
        report["results"] = results
        if args.profile:
            write_profiles(args.profile_out, results)
        print()
        print_table(results)
        report["targets"] = check_targets(results, args.target)
        print_stage_table(results)
        print_stage_table(results, "stage_cpu_ms")
        if args.pipeline:
            print_pipeline_table(results)
        if calibration is not None:
            after = report["meta"]["cpu_calibration_after"] = calibrate(w, args.world_size)
            report["step_prediction"] = check(w, results, calibration, args.world_size, after)
        after = dtrec_source()
        if after["sources_sha256"] != report["meta"]["dtrec"]["sources_sha256"]:
            report["meta"]["dtrec_at_end"] = after  # worlds started later ran the new code
            print("WARNING: dtrec's sources changed during the run (see meta.dtrec_at_end)")
    print_cost_model(cost_table)
    print(f"processor: {processor_line(report['meta']['processor'])}")
    if args.json:
        write_report(args.json, report)


if __name__ == "__main__":
    main()
