"""Plot achieved GB/s vs pooling factor L from ``benchmarks/kernels.py`` JSON.

    python benchmarks/plots/kernels.py benchmarks/results/kernels_h100_2026-11-22.json \\
        -o kernels_h100.png

One panel per id distribution (uniform, Zipf); lines per implementation and
phase (forward, forward+backward+optimizer); the copy bandwidth measured in
the same run is the dashed ceiling.
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PHASES = {"forward": "fwd", "forward_backward_optimizer": "fwd+bwd+opt"}


def plot(path: str, out: str) -> None:
    with open(path) as f:
        data = json.load(f)
    meta, results = data["meta"], data["results"]
    dists = ("uniform", "zipf")
    fig, axes = plt.subplots(1, len(dists), figsize=(11, 4.2), sharey=True)
    for ax, dist in zip(axes, dists):
        rows = sorted(
            (
                r
                for r in results
                if r["config"]["dist"] == dist and r["config"]["name"].startswith("dlrm")
            ),
            key=lambda r: r["config"]["pooling"],
        )
        pooling = [r["config"]["pooling"] for r in rows]
        for impl in ("dtrec", "pytorch", "fbgemm"):
            for phase, label in PHASES.items():
                key = f"{phase}_GBps"
                if rows and impl in rows[0]:
                    style = "-" if phase == "forward" else "--"
                    ax.plot(
                        pooling,
                        [r[impl][key] for r in rows],
                        style,
                        marker="o",
                        label=f"{impl} {label}",
                    )
        ax.axhline(meta["copy_GBps"], color="gray", linestyle=":", label="device copy")
        ax.set_xscale("log")
        ax.set_xlabel("ids per bag (L)")
        ax.set_title(f"DLRM-like, {dist} ids")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("achieved GB/s (traffic model)")
    axes[-1].legend(fontsize=8)
    fig.suptitle(
        f"{meta['device']} | torch {meta['torch']} | triton {meta['triton']} | {meta['date']}"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("json")
    parser.add_argument("-o", "--out", default="kernels.png")
    args = parser.parse_args()
    plot(args.json, args.out)


if __name__ == "__main__":
    main()
