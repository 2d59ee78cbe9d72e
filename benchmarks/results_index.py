"""Write ``benchmarks/results/README.md``: one row per committed report (command, device,
date, headline figure), read from the reports themselves.

    python -m benchmarks.results_index            # rewrite the index
    python -m benchmarks.results_index --check    # exit 1 if the committed index is stale

A report is a ``.json`` (or a ``.txt`` with no ``.json`` of its name) named
``<benchmark>_<device>_<date>[_<label>].json``; files that start with its stem (its
``.png``, ``.md``, ``.log``) are listed beside it. Command, device and date come from the
report's ``meta`` where it records them, else from the file name ("not recorded" where
neither says). ``tests/test_results_index.py`` checks the committed index is current.
Reads JSON only: no torch, no world.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
INDEX = RESULTS / "README.md"
NOT_RECORDED = "not recorded"

BENCHMARKS = ("checkpoint", "composed", "cpu_lookup", "dense_step", "distributed", "dynamic_2d",
              "fully_sharded", "gpu_check", "gpu_profile", "gpu_step", "kernels", "loaded_suite",
              "managed_collision", "managed_collision_quality", "offload", "planner", "qcomms",
              "replan", "scale", "sequence", "soak")  # fmt: skip
"""Benchmark names a report's file name starts with (longest match wins)."""

NAME = re.compile(
    r"^(?P<bench>" + "|".join(sorted(BENCHMARKS, key=len, reverse=True)) + r")"
    r"(?:_(?P<device>[a-z0-9]+))?_(?P<date>\d{4}-\d\d-\d\d)(?:_(?P<label>.+))?$"
)

MOVED = {  # entry points renamed since a report recorded its command (issue 35)
    "benchmarks/scale.py": "-m benchmarks.scale",
    "benchmarks/gpu_check.py": "-m benchmarks.gpu_check",
    "benchmarks/soak.py": "-m benchmarks.soak",
}

SHORT = {"table_wise": "TW", "row_wise": "RW", "column_wise": "CW", "data_parallel": "DP",
         "mixed": "mixed", "2d_row_wise": "2D RW", "2d_mixed": "2D mixed"}  # fmt: skip


def _x(value: float) -> str:
    return f"{value:.2f}x"


def _ratios(pairs: dict[str, float]) -> str:
    return ", ".join(f"{SHORT.get(k, k)} {_x(v)}" for k, v in pairs.items())


def _distributed(r: dict) -> str:
    step, pipe = {}, {}
    for config, libs in r["results"].items():
        d = (libs.get("dtrec") or {}).get("median") or {}
        t = (libs.get("torchrec") or {}).get("median") or {}
        if d.get("step_ms") and t.get("step_ms"):
            step[config] = d["step_ms"] / t["step_ms"]
        if d.get("pipeline_step_ms") and t.get("pipeline_step_ms"):
            pipe[config] = d["pipeline_step_ms"] / t["pipeline_step_ms"]
    out = f"median step, dtrec / TorchRec: {_ratios(step)}" if step else NOT_RECORDED
    out += f"; pipelined: {_ratios(pipe)}" if pipe else ""
    predicted = (r.get("step_prediction") or {}).get("configs")
    if predicted:  # issue 33's CPU step check
        errors = ", ".join(f"{SHORT.get(k, k)} {v['error']:+.0%}" for k, v in predicted.items())
        head = "dtrec step predicted vs measured: " if out == NOT_RECORDED else "; predicted: "
        order = "right" if not r["step_prediction"]["misordered"] else "WRONG"
        out = (out if out != NOT_RECORDED else "") + f"{head}{errors} (order {order})"
    return out


def _sequence(r: dict) -> str:
    step, sent = {}, {}
    for config, libs in r["results"].items():
        d, t = libs.get("dtrec") or {}, libs.get("torchrec") or {}
        if d.get("step_ms") and t.get("step_ms"):
            step[config] = d["step_ms"] / t["step_ms"]
        if d.get("bytes_per_step") and t.get("bytes_per_step"):
            sent[config] = d["bytes_per_step"] / t["bytes_per_step"]
    return f"step, dtrec / TorchRec: {_ratios(step)}; bytes: {_ratios(sent)}"


def _qcomms(r: dict) -> str:
    ratio = {c: v["quantized_bytes_ratio"]["bf16"]["all_dtrec_collectives"]
             for c, v in r["results"].items()}  # fmt: skip
    return f"bf16 bytes / fp32, all of dtrec's collectives: {_ratios(ratio)}"


def _checkpoint(r: dict) -> str:
    parts = []
    for config, libs in r["results"].items():
        d, t = libs.get("dtrec") or {}, libs.get("torchrec") or {}
        if "save_s" in d and "save_s" in t:
            parts.append(f"{SHORT.get(config, config)}: save {d['save_s']:.2f} s "
                         f"(TorchRec {t['save_s']:.2f} s), load {d['load_s']:.2f} s "
                         f"({t['load_s']:.2f} s)")  # fmt: skip
    return "; ".join(parts) or NOT_RECORDED


def _composed(r: dict) -> str:
    res = r["results"]
    base = res["torchrec_ddp"]
    names = {"dtrec_tp_hsdp": "TP+HSDP", "dtrec_fsdp": "FSDP", "torchrec_ddp": "DDP"}
    step = {names[m]: res[m]["step_ms"] / base["step_ms"] for m in names if m != "torchrec_ddp"}
    dense = ", ".join(f"{names[m]} {res[m]['dense_bytes_max'] / res[m]['full_dense_bytes']:.2f}"
                      for m in names)  # fmt: skip
    return f"step, dtrec / TorchRec: {_ratios(step)}; dense bytes per rank / full: {dense}"


def _cpu_lookup(r: dict) -> str:
    fwd = r["configs"]["default"]["results"]["threads=1"]["forward"]
    best = min((k for k in fwd if not k.startswith("_")), key=lambda k: fwd[k]["median_ms"])
    return (f"default config, 1 thread, forward: fastest {best} {fwd[best]['median_ms']:.2f} ms "
            f"({_x(fwd[best]['ratio_vs_a'])} the per-table loop)")  # fmt: skip


def _dense_step(r: dict) -> str:
    return "step, dtrec / DDP: " + ", ".join(f"{w} {_x(v['ratio'])}"
                                             for w, v in r["results"].items())  # fmt: skip


def _dynamic_2d(r: dict) -> str:
    v = r["verdict"]
    return (
        f"{'passed' if v['passed'] else 'FAILED'} (same weights as TorchRec); step "
        f"{_x(v['dtrec_step_ratio'])}, bytes {_x(v['dtrec_bytes_ratio'])} TorchRec's"
    )


def _fully_sharded(r: dict) -> str:
    parts = [f"{c['shards']}x{c['replicas']}: at rest {_x(c['ratio']['at_rest'])}, peak "
             f"{_x(c['ratio']['peak'])}, step {_x(c['ratio']['step_ms'])}"
             for c in r["configs"].values()]  # fmt: skip
    return "fully sharded / exact 2D, " + "; ".join(parts)


def _gpu_check(r: dict) -> str:
    tier = r.get("cuda_tier") or {}
    counts = ", ".join(f"{n} {k}" for k, n in (tier.get("counts") or {}).items())
    parts = [f"CUDA tier: {counts or NOT_RECORDED}"]
    parts += [f"{k} exit {v['exit_code']}" for k, v in r.items()
              if isinstance(v, dict) and "exit_code" in v and k != "cuda_tier"]  # fmt: skip
    return "; ".join(parts)


def _gpu_step(r: dict) -> str:
    return "; ".join(f"{row['config']}: dtrec {row['dtrec_step_ms']:.2f} ms, "
                     f"PyTorch {row['pytorch_step_ms']:.2f} ms"
                     for row in r["issue_table"][:2])  # fmt: skip


def _kernels(r: dict) -> str:
    rows = {row["config"]["name"]: row for row in r["results"]}
    row = rows.get("dlrm_L20_uniform") or next(iter(rows.values()))
    d = row["dtrec"]
    return (
        f"{row['config']['name']}: dtrec fwd+bwd+opt "
        f"{d['forward_backward_optimizer_GBps']:.0f} GB/s "
        f"({_x(row['speedup_vs_pytorch']['forward_backward_optimizer'])} PyTorch); "
        f"copy {r['meta']['copy_GBps']:.0f} GB/s"
    )


def _loaded_suite(r: dict) -> str:
    runs = r["runs"]
    tests = runs[0]["counts"]["tests"] if runs else 0
    verdict = "all passed" if r["all_passed"] else "FAILURES"
    return f"{len(runs)} runs of {tests} tests under CPU burners: {verdict}"


def _managed_collision(r: dict) -> str:
    s = r["summary"]
    ev = s["eviction"]
    return (f"remap {100 * s['remap_share_of_step']:.1f}% of the step (target <= "
            f"{100 * s['target_share']:.0f}%: {'met' if s['meets_target'] else 'not met'}); "
            f"step vs id % rows {_x(s['mc_step_ms'] / s['modulo_step_ms'])}; eviction step "
            f"{ev['step_ms'] / 1e3:.2f} s (evict {ev['evict_ms'] / 1e3:.2f} s, reset "
            f"{ev['reset_ms'] / 1e3:.2f} s)")  # fmt: skip


def _managed_collision_quality(r: dict) -> str:
    s, res = r["summary"], r["results"]
    b, m = res[s["best_zch"]], res["modulo"]
    return (f"{s['best_zch']} vs id % rows at {r['meta']['task']['rows']} rows, "
            f"{r['meta']['task']['true_ids']} true ids: eval AUC {b['eval_auc']:.4f} vs "
            f"{m['eval_auc']:.4f}, log loss {b['eval_logloss']:.4f} vs {m['eval_logloss']:.4f}; "
            f"lookups colliding {b['collision_rate']['lookups']:.1%} vs "
            f"{m['collision_rate']['lookups']:.1%}")  # fmt: skip


def _offload(r: dict) -> str:
    parts = []
    for name, by_cache in r["results"].items():
        base, cached = by_cache["all_on_device"], by_cache.get("cache_10pct")
        if cached:
            parts.append(f"{name}: 10% cache step {_x(cached['step_s'] / base['step_s'])} "
                         f"all-on-device (hit rate {cached['hit_rate']:.0%})")  # fmt: skip
    return "; ".join(parts) or NOT_RECORDED


def _planner(r: dict) -> str:
    p = r["plans"]
    told = p["pairs_told_apart"]
    return (
        f"plans in {p['dtrec_planning_seconds']:.3f} s (TorchRec "
        f"{p['torchrec_planning_seconds']:.3f} s); cost order = measured order on "
        f"{p['pairs_ordered_alike']}/{told} pairs"
    )


def _scale(r: dict) -> str:
    a, c = r["mlperf_anchor"], r["one_gpu_check"]
    return (
        f"MLPerf anchor predicted / published {_x(a['ratio'])}; one-GPU check worst "
        f"error {c['worst_error']:.0%} ({'ok' if c['ok'] else 'FAILED'})"
    )


def _soak(r: dict) -> str:
    faults = {k: v for k, v in r["faults"].items() if isinstance(v, dict) and "lost" in v}
    injected = sum(v["injected"] for v in faults.values())
    lost = sum(v["lost"] for v in faults.values())
    diff = r["reference"]["max_abs_diff"]
    return (
        f"{'ok' if r['ok'] else 'FAILED'}: {r['meta'].get('steps', '?')} steps, "
        f"{injected} faults, {lost} lost; max |weight - reference| {diff:.1e}"
    )


def _replan(r: dict) -> str:
    x = r["result"]
    return (
        f"reshard {x['reshard_s']:.2f} s, {x['reshard_bytes_sent'] / 1e6:.0f} MB sent; "
        f"DCP round trip {x['round_trip_s']:.2f} s, {x['round_trip_bytes_written'] / 1e6:.0f} "
        f"MB written; same state: {x['same_as_round_trip']}"
    )


HEADLINES: dict[str, Callable[[dict], str]] = {
    "checkpoint": _checkpoint, "composed": _composed, "cpu_lookup": _cpu_lookup,
    "dense_step": _dense_step, "distributed": _distributed, "dynamic_2d": _dynamic_2d,
    "fully_sharded": _fully_sharded, "gpu_check": _gpu_check,
    "gpu_step": _gpu_step, "kernels": _kernels, "loaded_suite": _loaded_suite,
    "managed_collision": _managed_collision,
    "managed_collision_quality": _managed_collision_quality,
    "offload": _offload, "planner": _planner, "qcomms": _qcomms, "replan": _replan,
    "scale": _scale,
    "sequence": _sequence, "soak": _soak,
}  # fmt: skip
"""Per benchmark: the report's headline figure, read from its JSON."""


def headline(bench: str, report: dict) -> str:
    fn = HEADLINES.get(bench)
    try:
        return fn(report) if fn else NOT_RECORDED
    except (KeyError, IndexError, TypeError, ZeroDivisionError, StopIteration):
        return NOT_RECORDED  # an older report shape: say so rather than guess


def _python(argv0: str) -> bool:
    return Path(argv0).name.startswith("python")


def command(bench: str, meta: dict) -> str:
    """The report's command with the interpreter path shortened to ``python`` and moved
    entry points under their current name; from ``meta.argv`` when no command was kept."""
    if meta.get("command"):
        words = shlex.split(meta["command"])
    elif meta.get("argv"):
        argv = list(meta["argv"])
        if argv and argv[0].endswith(".py"):
            argv = argv[1:]
        words = ["python", "-m", f"benchmarks.{bench}", *argv]
    else:
        return NOT_RECORDED
    if words and _python(words[0]):
        words[0] = "python"
    text = shlex.join(words)
    for old, new in MOVED.items():
        text = text.replace(old, new)
    return text


def _text_headline(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("#####"):
            return line.strip("# ").strip()
    return NOT_RECORDED


def rows(results: Path = RESULTS) -> list[dict[str, str]]:
    """One dict per report in ``results``: file, companions, benchmark, device, date,
    command, headline; sorted by benchmark, date, device, file."""
    files = sorted(p for p in results.iterdir() if p.is_file() and p.name != "README.md")
    reports = [p for p in files if p.suffix == ".json"]
    stems = {p.stem for p in reports}
    reports += [p for p in files if p.suffix == ".txt" and p.stem not in stems]
    out = []
    for path in reports:
        match = NAME.match(path.stem)
        if match is None:
            continue
        bench = match["bench"]
        meta, report = {}, {}
        if path.suffix == ".json":
            report = json.loads(path.read_text())
            meta = report.get("meta") or {}
        other_reports = [p.stem for p in reports if p != path]
        companions = [p.name for p in files if p != path and p.name.startswith(path.stem)
                      and p.suffix != ".json" and not any(
                          p.name.startswith(s) and len(s) > len(path.stem)
                          for s in other_reports)]  # fmt: skip
        device = meta.get("device") or match["device"] or NOT_RECORDED
        date = str(meta.get("date") or report.get("date") or match["date"])[:10]
        out.append({
            "file": path.name,
            "companions": ", ".join(companions),
            "benchmark": bench,
            "device": device,
            "date": date,
            "command": command(bench, meta),
            "headline": _text_headline(path) if path.suffix == ".txt"
            else headline(bench, report),
        })  # fmt: skip
    return sorted(out, key=lambda r: (r["benchmark"], r["date"], r["device"], r["file"]))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


HEADER = """\
# Benchmark results

Generated by `python -m benchmarks.results_index` from the reports in this folder; do not
edit by hand (`tests/test_results_index.py` fails when it is stale). One report per
benchmark, device and day: superseded runs of a day left the tree and stay in git history
(`git log --diff-filter=D --name-only -- benchmarks/results`). Commands are as each report
recorded them (interpreter shortened to `python`, entry points moved since under their
current name); "not recorded" where the report does not say. GPU runs, what they found and
how to reproduce them: [gpu_README.md](gpu_README.md).

| report | benchmark | device | date | command | headline | with it |
| --- | --- | --- | --- | --- | --- | --- |
"""


def render(results: Path = RESULTS) -> str:
    """The index's Markdown."""
    lines = [
        "| " + " | ".join([
            f"[{r['file']}]({r['file']})", r["benchmark"], _cell(r["device"]), r["date"],
            f"`{_cell(r['command'])}`" if r["command"] != NOT_RECORDED else NOT_RECORDED,
            _cell(r["headline"]), _cell(r["companions"]),
        ]) + " |"
        for r in rows(results)
    ]  # fmt: skip
    return HEADER + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the index is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = INDEX.read_text() if INDEX.exists() else ""
        if current != text:
            print(f"{INDEX} is stale: run python -m benchmarks.results_index")
            return 1
        return 0
    INDEX.write_text(text)
    print(f"wrote {INDEX} ({text.count(chr(10)) - HEADER.count(chr(10))} reports)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
