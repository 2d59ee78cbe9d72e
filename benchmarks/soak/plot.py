"""Plot a ``benchmarks/soak/run.py`` report: loss and step time over the run, faults marked.

    python -m benchmarks.soak.plot benchmarks/results/soak_cpu_2026-11-26.json \\
        -o /tmp/soak.png

Top: the mean loss over the 4 ranks of every executed step (steps later rolled back by a
restart included, in grey) against wall time. Bottom: each step's time (slowest rank).
Vertical lines: the faults, one colour per type; shaded: the relaunches after a kill.
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FAULT_COLORS = {
    "bad_ids": "C3", "negative_lengths": "C1", "missing_feature": "C4", "uneven": "C8",
    "checkpoint_save": "C2", "killed_save": "C6", "reshard": "C9", "kill_rank": "k",
}  # fmt: skip


def plot(report: dict, out: str) -> None:
    timeline = report["timeline"]
    attempts = report["attempts"]
    cols = report["steps"]
    rows = list(zip(cols["attempt"], cols["step"], cols["t"], cols["loss"], cols["ms"],
                    strict=True))  # fmt: skip
    restarted_at = {i: a["start"]["step"] for i, a in enumerate(attempts) if a["start"]}
    # a step is rolled back when the next attempt restarted from before it
    kept = [i + 1 not in restarted_at or step < restarted_at[i + 1] for i, step, *_ in rows]
    fig, (loss_ax, time_ax) = plt.subplots(2, 1, figsize=(13, 7), sharex=True)
    for ax, col, label in ((loss_ax, 3, "loss (mean over ranks)"),
                           (time_ax, 4, "step time, ms (slowest rank)")):  # fmt: skip
        for keep, color, name in ((True, "C0", "kept"), (False, "0.6", "rolled back")):
            pts = [(r[2], r[col]) for r, k in zip(rows, kept, strict=True) if k == keep]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, ".", ms=2, color=color, label=f"steps {name}")
        ax.set_ylabel(label)
    time_ax.set_yscale("log")
    seen = set()
    for e in timeline:
        if e["kind"] != "fault":
            continue
        kind = e["type"]
        for ax in (loss_ax, time_ax):
            ax.axvline(e["t"], color=FAULT_COLORS.get(kind, "C7"), lw=0.8, alpha=0.8,
                       label=kind if ax is loss_ax and kind not in seen else None)  # fmt: skip
        seen.add(kind)
    for i, a in enumerate(attempts[1:], start=1):
        prev = [e for e in timeline if e["attempt"] == i - 1]
        ts = [t for a_, t in zip(cols["attempt"], cols["t"], strict=True) if a_ == i - 1]
        end_prev = max([e["t"] for e in prev] + ts, default=attempts[i - 1]["wall"][0])
        start = a["start"]["t"] if a["start"] else a["wall"][1]
        for ax in (loss_ax, time_ax):
            ax.axvspan(end_prev, start, color="k", alpha=0.12,
                       label="relaunch" if ax is loss_ax and i == 1 else None)  # fmt: skip
        cause = next((e["type"] for e in reversed(prev) if e["kind"] == "fault"), "crash")
        where = a["start"]["checkpoint"] if a["start"] else "?"
        loss_ax.annotate(f"{cause} -> restart from {where}", (end_prev, loss_ax.get_ylim()[1]),
                         fontsize=7, rotation=90, va="top")  # fmt: skip
    time_ax.set_xlabel("wall time, s")
    fl = report["faults"]
    lost = sum(v["lost"] for v in fl.values())
    ref = report.get("reference", {})
    tp = report.get("throughput", {})
    loss_ax.set_title(
        f"soak: {report['meta']['steps']} steps on {report['meta']['world']} gloo ranks, "
        f"{sum(v['injected'] for v in fl.values())} faults injected, {lost} lost; final weights vs "
        f"unsharded reference max |diff| {ref.get('max_abs_diff', float('nan')):.2g}; "
        f"steps/s clean {tp.get('clean_steps_per_s') or float('nan'):.1f}, "
        f"under faults {tp.get('faults_steps_per_s', float('nan')):.1f}",
        fontsize=9,
    )
    loss_ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.02),
                   framealpha=0.9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report")
    parser.add_argument("-o", "--out", required=True)
    args = parser.parse_args(argv)
    with open(args.report) as f:
        plot(json.load(f), args.out)


if __name__ == "__main__":
    main()
