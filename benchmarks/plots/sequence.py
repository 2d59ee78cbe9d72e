"""Plot ``benchmarks/sequence.py`` JSON: step time, bytes and where the step goes.

    python -m benchmarks.plots.sequence benchmarks/results/sequence_cpu_2026-11-25_final.json \\
        -o /tmp/sequence.png

Left: median step (ms) of dtrec and TorchRec per config; middle: bytes sent per step and
rank; both with dtrec/TorchRec on top. Right: CPU ms per step by stage
(``benchmarks/probes/sequence_stages.py``), stacked, dtrec plain and TorchRec hatched.
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.probes.stages import STAGES  # noqa: E402

LIBS = ("dtrec", "torchrec")
WIDTH = 0.38


def _bars(ax, results: dict, configs: list[str], value, label: str) -> None:
    """Side-by-side bars of ``value(run)`` per library, the ratio dtrec/TorchRec on top."""
    for i, lib in enumerate(LIBS):
        xs = [x + (i - 0.5) * WIDTH for x in range(len(configs))]
        ax.bar(xs, [value(results[c][lib]) for c in configs], WIDTH, label=lib)
    for x, c in enumerate(configs):
        ours, theirs = (value(results[c][lib]) for lib in LIBS)
        ax.text(x, max(ours, theirs), f"{ours / theirs:.2f}x", ha="center", va="bottom")
    ax.set_ylabel(label)
    ax.set_xticks(range(len(configs)), configs)
    ax.legend(fontsize=8)


def plot(path: str, out: str) -> None:
    with open(path) as f:
        results = json.load(f)["results"]
    ok = [
        c for c, runs in results.items() for lib in LIBS if runs.get(lib, {}).get("status") == "ok"
    ]
    configs = [c for c in results if ok.count(c) == len(LIBS)]
    fig, (step, nbytes, stages) = plt.subplots(1, 3, figsize=(16, 4.5))
    _bars(step, results, configs, lambda r: r["step_ms"], "median step, ms")
    step.set_title("step time; dtrec / TorchRec on top")
    _bars(nbytes, results, configs, lambda r: r["bytes_per_step"] / 1e6, "MB sent per step")
    nbytes.set_title("bytes per step and rank; dtrec / TorchRec")
    for i, lib in enumerate(LIBS):
        bottom = [0.0] * len(configs)
        xs = [x + (i - 0.5) * WIDTH for x in range(len(configs))]
        for k, stage in enumerate(STAGES):
            ms = [results[c][lib]["median"]["stage_cpu_ms"].get(stage, 0.0) for c in configs]
            stages.bar(xs, ms, WIDTH, bottom=bottom, color=f"C{k}", hatch="//" if i else None,
                       label=stage if i == 0 else None)  # fmt: skip
            bottom = [b + m for b, m in zip(bottom, ms, strict=True)]
    stages.set_ylabel("CPU ms per step (rank median)")
    stages.set_xticks(range(len(configs)), configs)
    stages.set_title("by stage: dtrec plain, TorchRec hatched")
    stages.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json")
    parser.add_argument("-o", "--out", required=True)
    args = parser.parse_args(argv)
    plot(args.json, args.out)


if __name__ == "__main__":
    main()
