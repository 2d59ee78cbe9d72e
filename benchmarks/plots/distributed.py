"""Plot ``benchmarks/distributed.py`` JSON: step time per config and where it goes.

    python -m benchmarks.plots.distributed \\
        benchmarks/results/distributed_cpu_2026-12-02.json \\
        -o /tmp/distributed.png

Left: median step (ms) of dtrec and TorchRec per config, dtrec/TorchRec ratio on top.
Right: CPU ms per step by stage (``benchmarks/probes/stages.py``), stacked, dtrec and TorchRec
side by side per config (CPU time: steadier than wall time on a shared machine).
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.probes.stages import STAGES  # noqa: E402

LIBS = ("dtrec", "torchrec")


def _ok(run: dict | None) -> bool:
    return bool(run) and run["status"] == "ok"


def plot(path: str, out: str) -> None:
    with open(path) as f:
        results = json.load(f)["results"]
    configs = [c for c, runs in results.items() if all(_ok(runs.get(lib)) for lib in LIBS)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.38
    for i, lib in enumerate(LIBS):
        ms = [results[c][lib]["median"]["step_ms"] for c in configs]
        left.bar([x + (i - 0.5) * width for x in range(len(configs))], ms, width, label=lib)
    for x, c in enumerate(configs):
        d, t = (results[c][lib]["median"]["step_ms"] for lib in LIBS)
        left.text(x, max(d, t), f"{d / t:.2f}x", ha="center", va="bottom", fontsize=8)
    left.set_yscale("log")
    left.set_ylabel("median step, ms (log)")
    left.set_xticks(range(len(configs)), configs, rotation=30, ha="right")
    left.set_title("step time; dtrec / TorchRec on top")
    left.legend()
    for i, lib in enumerate(LIBS):
        bottom = [0.0] * len(configs)
        xs = [x + (i - 0.5) * width for x in range(len(configs))]
        for k, stage in enumerate(STAGES):
            ms = [
                results[c][lib]["median"].get("stage_cpu_ms", {}).get(stage, 0.0) for c in configs
            ]
            right.bar(xs, ms, width, bottom=bottom, color=f"C{k}", hatch="//" if i else None,
                      label=stage if i == 0 else None)  # fmt: skip
            bottom = [b + m for b, m in zip(bottom, ms, strict=True)]
    right.set_ylabel("CPU ms per step (rank median)")
    right.set_xticks(range(len(configs)), configs, rotation=30, ha="right")
    right.set_title("by stage: dtrec plain, TorchRec hatched")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json")
    parser.add_argument("-o", "--out", required=True)
    args = parser.parse_args()
    plot(args.json, args.out)


if __name__ == "__main__":
    main()
