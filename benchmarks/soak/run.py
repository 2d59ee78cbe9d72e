"""A long run under faults loses nothing: train a DLRM-shaped model on 4 ranks while
bad batches, odd batches, checkpoint saves, killed saves, restores into other plans and
killed ranks happen on a seeded schedule; end equal to an unsharded reference.

    python -m benchmarks.soak                       # ~20 minutes on a 2-core machine
    python -m benchmarks.soak --steps 300 --json out.json --plot out.png
    python -m benchmarks.soak --device cuda --world 1 --steps 60      # NCCL on one GPU
    python -m benchmarks.soak --device cuda --world 4 --steps 60      # gloo, ranks share it

``--device cuda`` puts each rank on GPU ``rank % device_count`` (tables, batches,
collectives); a world uses NCCL when each rank has a GPU of its own (with gloo beside it
for the harness's small CPU all-gathers: backend ``cpu:gloo,cuda:nccl``), else gloo on
shared GPUs, as the CUDA test tier picks (``tests/gpu/cuda_worlds.py``). ``--world 1``
runs plans of its own (``soak_model.PLANS_W1``); the reference always trains on CPU.

What runs (``benchmarks/soak/model.py``): a pooled, a weighted and a sequence
collection with every sharding type in one plan (data-parallel, table-wise, row-wise,
column-wise, table-row-wise, grid) on the 1D mesh, the types rotated over the tables in a
second plan and a 2 x 2 mesh in a third; VBE batches every ``--vbe-every`` steps; fused
row-wise Adagrad with a warmup + cosine LR schedule (torch's LambdaLR on
``model.fused_optimizer``); the MLPs on torch's Adam (``--foreach`` on/off).

Faults (``--faults``: how many of each; seeded by ``--seed``), each before a step:
``bad_ids``, ``negative_lengths``, ``missing_feature`` (one rank's batch; every rank
must refuse the step and change nothing), ``uneven`` (one rank feeds a smaller or an
empty batch: it must train on every rank, and the reference replays it; ``--uneven
refuse`` demands a clean refusal everywhere instead, ``auto`` accepts either),
``checkpoint_save``, ``killed_save`` (a rank dies inside a save after tearing its data
file, or rank 0 after writing the marker, before publishing: the last complete
checkpoint must load and equal what was saved), ``reshard`` (save, rebuild under the
next plan, load: the full state must be bitwise the same), ``kill_rank`` (a rank is
SIGKILLed between its forward and backward: the supervisor, this script, relaunches
all ranks from the last complete checkpoint).

The run's log is replayed on the unsharded model (``Reference``): the same good
batches, the same restarts (rolled back to the same checkpoints). The final weights
must match (max abs diff printed). The JSON has per fault type injected / survived /
lost, steps/s in the clean window and under faults; the plot shows loss and step time
over wall time with the faults marked (``benchmarks/soak/plot.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.soak.launch import launch, read_logs
from benchmarks.soak.model import BATCH, WORLD, BatchSpec, make_batch, plans_for
from benchmarks.soak.reference import Reference
from benchmarks.soak.worker import Event, SoakConfig, attempt, final_path, log_path

FAULTS = ("bad_ids", "negative_lengths", "missing_feature", "uneven", "checkpoint_save",
          "killed_save", "reshard", "kill_rank")  # fmt: skip
RESTARTS = ("killed_save", "kill_rank")  # faults after which the job restarts
STEP_S_IDLE = 0.08  # one step of 4 ranks on an idle 2-core machine (measured)
TOL = 1e-4  # final weights: float reassociation over many fused steps, fp32


UNEVEN = ("small", "empty")  # an uneven event's variant: half a batch, or no samples


def schedule(
    steps: int,
    clean: int,
    counts: dict[str, int],
    seed: int,
    uneven: tuple[str, ...] = UNEVEN,
    world: int = WORLD,
) -> list[Event]:
    """The faults, each at its own step in ``[clean, steps)``: a seeded draw of steps,
    ranks (of ``world``) and variants; the first checkpoint at ``clean`` so restarts have
    one."""
    rng = random.Random(seed)
    kinds = [k for k in FAULTS for _ in range(counts.get(k, 0))]
    free = list(range(clean + 1, steps))
    if len(kinds) + 1 > len(free):
        raise ValueError(f"{len(kinds)} faults do not fit in steps {clean}..{steps}")
    at = sorted(rng.sample(free, len(kinds)))
    rng.shuffle(kinds)
    plans = list(plans_for(world))
    events, reshards = [Event(0, clean, "checkpoint_save")], 0
    for i, (step, kind) in enumerate(zip(at, kinds), start=1):
        rank, variant, plan = rng.randrange(world), rng.randrange(6), ""
        if kind == "reshard":
            reshards += 1
            plan = plans[reshards % len(plans)]
        if kind == "uneven":
            variant = UNEVEN.index(uneven[sum(e.kind == "uneven" for e in events) % len(uneven)])
        if kind == "killed_save":
            # 0: a rank tears its data file and dies; 1: rank 0 dies before publishing
            variant = sum(e.kind == "killed_save" for e in events) % 2
            rank = rank if variant == 0 else 0
        events.append(Event(i, step, kind, rank, variant, plan))
    return events


def supervise(cfg: SoakConfig, timeout: float, grace: float, env: dict[str, str],
              log=print, backend: str = "gloo") -> dict:  # fmt: skip
    """Run attempts until the steps are done; relaunch after each death (planned or not).

    An attempt that ends without its planned kill is "unexpected"; the event being
    injected when it broke (if any) is lost and not injected again."""
    attempts: list[dict] = []
    fired: set[int] = set()
    unexpected: list[str] = []
    restarts = sorted((e for e in cfg.events if e.kind in RESTARTS), key=lambda e: e.step)
    while len(unexpected) <= 3:
        nxt = next((e for e in restarts if e.id not in fired), None)
        cfg.fired, cfg.attempt = frozenset(fired), len(attempts)
        t = time.time() - cfg.t0
        ran = launch(cfg.world, attempt, cfg, timeout=timeout, grace=grace,
                     collective_timeout=max(120.0, grace), env=env, backend=backend)  # fmt: skip
        paths = [log_path(cfg.root, cfg.attempt, r) for r in range(cfg.world)]
        timeline, ends = read_logs(paths)
        a = {"start": timeline[0] if timeline and timeline[0]["kind"] == "start" else None,
             "timeline": timeline[1:], "ends": {r: e["end"] for r, e in ends.items()},
             "launch": ran, "wall": (t, time.time() - cfg.t0)}  # fmt: skip
        died = [r for r, code in enumerate(ran["exitcodes"]) if code == -signal.SIGKILL
                and r not in ran["stopped"]]  # fmt: skip
        a["killed"] = died
        attempts.append(a)
        fired.update(e["id"] for e in a["timeline"] if e["kind"] == "fault")
        done = (
            bool(ends) and all(e["end"] == "done" for e in ends.values()) and len(ends) == cfg.world
        )
        steps = sum(e["kind"] == "step" for e in a["timeline"])
        what = "done" if done else f"ended: {sorted(set(a['ends'].values()))[:2]}"[:300]
        log(f"attempt {cfg.attempt}: from {a['start'] and a['start']['checkpoint']}, "
            f"{steps} steps, killed {died}, stopped {ran['stopped']}; {what}")  # fmt: skip
        if done:
            a["final"] = torch.load(final_path(cfg.root, cfg.attempt), weights_only=False)
            break
        if nxt is not None and died == [nxt.rank] and a["start"] is not None:
            fired.add(nxt.id)
            a["killed_event"] = nxt.id
            a["timeline"].append({"kind": "fault", "id": nxt.id, "type": nxt.kind,
                                  "step": nxt.step, "rank": nxt.rank, "survived": None,
                                  "t": a["timeline"][-1]["t"] if a["timeline"] else t})  # fmt: skip
            continue
        culprit = next((e["event"] for e in ends.values() if e["event"] is not None), None)
        if culprit is not None:  # the event broke the step: lost, and not injected again
            ev = next(e for e in cfg.events if e.id == culprit)
            fired.add(culprit)
            a["timeline"].append({"kind": "fault", "id": ev.id, "type": ev.kind, "step": ev.step,
                                  "rank": ev.rank, "survived": False, "detail": a["ends"],
                                  "t": a["timeline"][-1]["t"] if a["timeline"] else t})  # fmt: skip
        else:
            unexpected.append(f"attempt {cfg.attempt}: exit codes {ran['exitcodes']}, "
                              f"ends {a['ends']}")  # fmt: skip
    return {"attempts": attempts, "unexpected": unexpected}


def replay(cfg: SoakConfig, attempts: list[dict]) -> tuple[Reference, dict]:
    """The unsharded reference through the same attempts: each starts from the snapshot
    of the checkpoint its attempt restored, trains its steps on the same batches."""
    ref = Reference(cfg.steps, cfg.warmup)
    snapshots = {None: ref.snapshot()}
    loss_diff = 0.0
    for a in attempts:
        if a["start"] is None:  # died before it restored anything
            continue
        ref.restore(snapshots[a["start"]["checkpoint"]])
        for entry in a["timeline"]:
            if entry["kind"] == "checkpoint":
                snapshots[entry["name"]] = ref.snapshot()
            elif entry["kind"] == "step":
                specs = [BatchSpec(entry["step"], r, size, entry["vbe"], entry["salt"])
                         for r, size in enumerate(entry["sizes"])]  # fmt: skip
                losses = ref.step([make_batch(cfg.seed, s) for s in specs])
                diff = max(abs(a - b) for a, b in zip(losses, entry["losses"], strict=True))
                loss_diff = max(loss_diff, diff)
                if ref.steps != entry["good_steps"]:
                    raise AssertionError(f"replay out of step at {entry}: {ref.steps}")
    return ref, {"max_loss_diff": loss_diff}


def tally(cfg: SoakConfig, run: dict) -> dict[str, dict[str, int]]:
    """Per fault type: injected, survived, lost. A kill (``survived`` None in the log)
    survives when the next attempt restored a checkpoint whose full state equals the
    one saved; an attempt that broke without a planned kill is an "unexpected" loss."""
    out = {k: {"injected": 0, "survived": 0, "lost": 0} for k in FAULTS}
    attempts = run["attempts"]
    for i, a in enumerate(attempts):
        for entry in a["timeline"]:
            if entry["kind"] != "fault":
                continue
            survived = entry["survived"]
            if survived is None:
                nxt = attempts[i + 1]["start"] if i + 1 < len(attempts) else None
                survived = bool(nxt and nxt["digest_ok"] and nxt["checkpoint"])
                entry["survived"] = survived
            row = out[entry["type"]]
            row["injected"] += 1
            row["survived" if survived else "lost"] += 1
    out["unexpected"] = {"injected": 0, "survived": 0, "lost": len(run["unexpected"])}
    return out


def throughput(cfg: SoakConfig, attempts: list[dict], clean: int) -> dict:
    """Steps/s in the clean window (before the first fault) and under faults (net
    progress: steps of the final trajectory / wall time, restarts and saves included)."""
    steps = [e for a in attempts for e in a["timeline"] if e["kind"] == "step"]
    window = [e for e in steps if e["step"] < clean and e["tag"] == "good"]
    first = next(a["start"]["t"] for a in attempts if a["start"] is not None)
    last = max([e["t"] for a in attempts for e in a["timeline"]], default=first)
    clean_end = window[-1]["t"] if window else first
    faulty = [e for e in steps if e["step"] >= clean]
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
    return {
        "clean_steps_per_s": len(window) / max(clean_end - first, 1e-9) if window else None,
        "faults_steps_per_s": (cfg.steps - clean) / max(last - clean_end, 1e-9),
        "faults_executed_steps_per_s": len(faulty) / max(last - clean_end, 1e-9),
        "clean_median_step_ms": 1e3 * med([e["seconds"] for e in window]) if window else None,
        "faults_median_step_ms": 1e3 * med([e["seconds"] for e in faulty]) if faulty else None,
        "executed_steps": len(steps),
        "wall_s": last,
    }


def compare(final: dict, ref: Reference) -> dict:
    want = ref.full_state()
    keys = sorted(want)
    if sorted(final) != keys:
        raise AssertionError(f"keys differ: {sorted(set(final) ^ set(keys))}")
    diffs = {k: float((final[k].float() - want[k].float()).abs().max()) if want[k].numel() else 0.0
             for k in keys}  # fmt: skip
    return {"max_abs_diff": max(diffs.values()), "per_tensor": diffs}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="total good steps (default: --minutes' worth)")
    parser.add_argument(
        "--minutes",
        type=float,
        default=20.0,
        help=f"sizes --steps at {STEP_S_IDLE * 1e3:.0f} ms per step plus faults",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clean", type=float, default=0.1, help="fault-free first fraction")
    parser.add_argument("--faults", type=int, help="of each type (default: ~1 per 400 steps)")
    parser.add_argument(
        "--foreach",
        choices=("on", "off"),
        default="on",
        help="the dense Adam's foreach (torch's CUDA default)",
    )
    parser.add_argument(
        "--uneven",
        choices=("auto", "train", "refuse"),
        default="train",
        help="what a smaller / empty batch on one rank must do (train: dtrec supports them)",
    )
    parser.add_argument("--vbe-every", type=int, default=3)
    parser.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where the ranks train (cuda: GPU rank %% device_count)",
    )
    parser.add_argument("--world", type=int, default=WORLD, choices=(1, WORLD), help="ranks")
    parser.add_argument("--ckpt-dir", help="checkpoint root (default: a temporary directory)")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--plot", help="write the PNG plot here")
    parser.add_argument("--timeout", type=float, default=3600, help="per attempt, seconds")
    parser.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds the survivors of a death get to stop on their own",
    )
    parser.add_argument(
        "--uneven-sizes",
        default="small,empty",
        help="odd batches to inject: 'small' (half a batch), 'empty' (none)",
    )
    args = parser.parse_args(argv)
    sizes = tuple(x for x in args.uneven_sizes.split(",") if x)
    if not sizes or set(sizes) - set(UNEVEN):
        parser.error(f"--uneven-sizes: choose from {UNEVEN}")
    # the reference replays here: one thread, as the ranks (on a loaded machine torch's
    # intra-op threads spin against the ranks: 0.5 s per reference step instead of 16 ms)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(args, argv, sizes)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, argv: list[str] | None, sizes: tuple[str, ...]) -> dict:
    steps = args.steps or int(args.minutes * 60 / STEP_S_IDLE * 0.7)
    clean = max(int(steps * args.clean), 5)
    faults = args.faults if args.faults is not None else max(1, steps // 400)
    counts = {k: faults for k in FAULTS}
    counts["uneven"] = len(sizes) * faults
    plans = plans_for(args.world)
    counts["reshard"] = max(faults, len(plans) - 1)  # visit every plan
    counts["killed_save"] = max(faults, 2)  # a torn data file, and a marker not published
    root = Path(args.ckpt_dir or tempfile.mkdtemp(prefix="dtrec-soak-"))
    if root.exists() and any(root.iterdir()):
        raise SystemExit(f"--ckpt-dir {root} is not empty")
    events = schedule(steps, clean, counts, args.seed, sizes, args.world)
    cfg = SoakConfig(
        steps=steps, seed=args.seed, root=str(root), events=events, warmup=max(steps // 20, 1),
        foreach=args.foreach == "on", uneven=args.uneven, vbe_every=args.vbe_every, t0=time.time(),
        device=args.device, world=args.world,
    )  # fmt: skip
    env = _checker_env()
    backend = backend_for(args.device, args.world)
    print(f"soak: {steps} steps on {args.world} ranks ({args.device}, {backend}), "
          f"{len(cfg.events)} events, checkpoints in {root}")  # fmt: skip
    try:
        run = supervise(cfg, args.timeout, args.grace, env, backend=backend)
    finally:
        if not args.ckpt_dir:
            shutil.rmtree(root, ignore_errors=True)
    attempts = run["attempts"]
    report: dict = {"meta": {**_meta(argv, cfg, clean), "backend": backend}}
    report["faults"] = tally(cfg, run)
    report["unexpected"] = run["unexpected"]
    done = bool(attempts) and "final" in attempts[-1]
    if done:
        ref, replayed = replay(cfg, attempts)
        report["reference"] = {**compare(attempts[-1]["final"]["weights"], ref), **replayed}
    report["throughput"] = throughput(cfg, attempts, clean) if attempts else {}
    report["steps"] = _columns([(i, e) for i, a in enumerate(attempts) for e in a["timeline"]
                                if e["kind"] == "step"])  # fmt: skip
    report["timeline"] = [_compact(e, i) for i, a in enumerate(attempts) for e in a["timeline"]
                          if e["kind"] != "step"]  # fmt: skip
    report["attempts"] = [
        {"start": a["start"], "ends": a["ends"], "killed": a["killed"], "wall": a["wall"],
         "stopped": a["launch"]["stopped"], "exitcodes": a["launch"]["exitcodes"],
         "faults": [e for e in a["timeline"] if e["kind"] == "fault"]}
        for a in attempts
    ]  # fmt: skip
    report["stale_copies"] = sorted({k for a in attempts for e in a["timeline"]
                                     if e["kind"] == "checkpoint" for k in e["odd"]})  # fmt: skip
    lost = sum(v["lost"] for v in report["faults"].values())
    diff = report.get("reference", {}).get("max_abs_diff")
    report["ok"] = done and lost == 0 and diff is not None and diff <= TOL
    _print(report)
    if args.json:
        Path(args.json).write_text(dumps(report))
    if args.plot:
        from benchmarks.soak.plot import plot

        plot(report, args.plot)
    return report


def _columns(steps: list[tuple[int, dict]]) -> dict[str, list]:
    """Every executed step, one list per field (compact in the JSON)."""
    return {
        "attempt": [i for i, _ in steps],
        "step": [e["step"] for _, e in steps],
        "t": [round(e["t"], 3) for _, e in steps],
        "loss": [round(sum(e["losses"]) / len(e["losses"]), 5) for _, e in steps],
        "ms": [round(1e3 * e["seconds"], 2) for _, e in steps],
        "tag": [e["tag"] for _, e in steps],
        "plan": [e["plan"] for _, e in steps],
    }


def _compact(entry: dict, attempt: int) -> dict:
    """A checkpoint or fault entry for the report (no digests)."""
    return {k: v for k, v in entry.items() if k not in ("digest", "odd")} | {"attempt": attempt}


def dumps(report: dict) -> str:
    """The report as JSON, indented, with each step column on one line."""
    rest = json.dumps({k: v for k, v in report.items() if k != "steps"}, indent=1, default=str)
    cols = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in report["steps"].items())
    return rest[:-2] + ',\n "steps": {\n' + cols + "\n }\n}\n"


def _meta(argv: list[str] | None, cfg: SoakConfig, clean: int) -> dict:
    return {
        "argv": sys.argv[:1] + list(argv if argv is not None else sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "load_avg_start": os.getloadavg(), "steps": cfg.steps, "clean_steps": clean,
        "batch_per_rank": BATCH, "world": cfg.world, "plans": list(plans_for(cfg.world)),
        "device": cfg.device, "seed": cfg.seed,
        "foreach": cfg.foreach, "uneven": cfg.uneven, "events": [asdict(e) for e in cfg.events],
        "env": _checker_env(),
    }  # fmt: skip


def backend_for(device: str, world: int, gpus: int | None = None) -> str:
    """The ranks' process-group backend: gloo on CPU; on CUDA, NCCL when each rank has a
    GPU of its own (gloo beside it for the harness's CPU tensors), else gloo on shared
    GPUs (``tests/gpu/cuda_worlds.py``'s choice). ``gpus``: default, torch's count."""
    if device != "cuda":
        return "gloo"
    gpus = torch.cuda.device_count() if gpus is None else gpus
    return "cpu:gloo,cuda:nccl" if world <= gpus else "gloo"


def _checker_env() -> dict[str, str]:
    """The memory checkers' settings (MALLOC_CHECK_, MALLOC_PERTURB_, LD_PRELOAD, ASAN_OPTIONS,
    PYTORCH_CHECK_SPARSE_TENSOR_INVARIANTS...), passed to every rank and recorded."""
    prefixes = ("MALLOC_", "PYTORCH_", "LD_", "ASAN_", "GLIBC_")
    return {k: v for k, v in os.environ.items() if k.startswith(prefixes)}


def _print(report: dict) -> None:
    print(f"\n{'fault':<18}{'injected':>9}{'survived':>9}{'lost':>6}")
    for kind, row in report["faults"].items():
        print(f"{kind:<18}{row['injected']:>9}{row['survived']:>9}{row['lost']:>6}")
    tp = report["throughput"]
    if tp:
        clean = tp["clean_steps_per_s"]
        faults = tp["faults_steps_per_s"]
        print(f"steps/s: clean {clean or float('nan'):.2f}, under faults {faults:.2f} "
              f"(executed {tp['faults_executed_steps_per_s']:.2f}); {tp['executed_steps']} steps "
              f"executed in {tp['wall_s']:.0f} s")  # fmt: skip
    ref = report.get("reference")
    if ref:
        print(
            f"final weights vs unsharded reference: max abs diff {ref['max_abs_diff']:.3g} "
            f"(tolerance {TOL}); max loss diff {ref['max_loss_diff']:.3g}"
        )
    print("OK" if report["ok"] else "FAILED")


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
