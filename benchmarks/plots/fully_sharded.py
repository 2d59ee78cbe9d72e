"""Plot ``benchmarks/fully_sharded_step.py`` JSON: memory, bytes per axis and step time.

    python -m benchmarks.plots.fully_sharded \\
        benchmarks/results/fully_sharded_cpu_2026-12-02.json -o /tmp/fully_sharded.png

One column per model group, one group per (W, S x R) world. Left: MB per rank at rest
(solid) and at the step's peak (light, on top), with TorchRec FULLY_SHARDED's computed
figures hatched (it does not run on CPU). Middle: MB sent per rank and step over
"shard", "replicate" and the world, stacked. Right: median step ms, with the fully
sharded / exact ratio on top. All medians over ranks.
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MODELS = ("exact", "fully_sharded", "torchrec")
LABELS = {"exact": "dtrec exact 2D", "fully_sharded": "dtrec fully sharded 2D",
          "torchrec": "TorchRec DMPCollection", "torchrec_fs": "TorchRec FULLY_SHARDED "
          "(computed)"}  # fmt: skip
AXES = ("shard", "replicate", "world")


def _groups(configs: dict) -> list[tuple[str, dict]]:
    return [(f"W {c['world']}: {c['shards']} x {c['replicas']}", c) for c in configs.values()]


def plot(path: str, out: str) -> None:
    with open(path) as f:
        configs = json.load(f)["configs"]
    groups = _groups(configs)
    models = [m for m in MODELS if all(m in c["median"] for _, c in groups)]
    computed = all("torchrec_fully_sharded_computed" in c for _, c in groups)
    shown = [*models, *(["torchrec_fs"] if computed else [])]
    width = 0.8 / len(shown)
    fig, (mem, sent, step) = plt.subplots(1, 3, figsize=(17, 4.8))
    for i, name in enumerate(shown):
        xs = [g + (i - (len(shown) - 1) / 2) * width for g in range(len(groups))]
        runs = [
            c["torchrec_fully_sharded_computed"] if name == "torchrec_fs" else c["median"][name]
            for _, c in groups
        ]
        rest = [r["at_rest_bytes"] / 1e6 for r in runs]
        peak = [(r["peak_bytes"] - r["at_rest_bytes"]) / 1e6 for r in runs]
        hatch = "//" if name == "torchrec_fs" else None
        mem.bar(xs, rest, width, color=f"C{i}", hatch=hatch, label=LABELS[name])
        mem.bar(xs, peak, width, bottom=rest, color=f"C{i}", alpha=0.35, hatch=hatch)
        if name == "torchrec_fs":
            continue
        bottom = [0.0] * len(groups)
        for k, axis in enumerate(AXES):
            mb = [r["bytes_per_axis"].get(axis, 0) / 1e6 for r in runs]
            sent.bar(xs, mb, width, bottom=bottom, color=f"C{i}", alpha=1 - 0.3 * k,
                     label=f"{LABELS[name]}: {axis}")  # fmt: skip
            bottom = [b + m for b, m in zip(bottom, mb, strict=True)]
        step.bar(xs, [r["step_ms"] for r in runs], width, color=f"C{i}", label=LABELS[name])
    for g, (_, c) in enumerate(groups):
        m = c["median"]
        top = max(m[n]["step_ms"] for n in models)
        step.text(g, top, f"FS/exact {c['ratio']['step_ms']:.2f}x", ha="center", va="bottom")
    for ax, title, unit in (
        (mem, "per rank: at rest (solid) + step peak (light)", "MB"),
        (sent, "sent per rank and step, by axis", "MB"),
        (step, "median step", "ms"),
    ):
        ax.set_xticks(range(len(groups)), [name for name, _ in groups])
        ax.set_title(title)
        ax.set_ylabel(unit)
    mem.legend(fontsize=7)
    sent.legend(fontsize=6, ncol=1)
    fig.suptitle("fully sharded 2D vs exact 2D vs TorchRec 2D (gloo, CPU; rank medians)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json")
    parser.add_argument("-o", "--out", default="fully_sharded.png")
    args = parser.parse_args(argv)
    plot(args.json, args.out)


if __name__ == "__main__":
    main()
