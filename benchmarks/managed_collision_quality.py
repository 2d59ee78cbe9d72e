"""Does managed collision matter? ZCH vs ``id % rows`` on a synthetic click task.

Issue 45, item 7. A fixed set of ``--true-ids`` "true" ids is drawn uniformly from
``[0, 2**40)``; each has a hidden click propensity (logit ~ N(``--logit-mean``,
``--logit-std``)), and its popularity is Zipf(``--zipf``) over a random ranking. A sample
is one id, drawn by popularity, and a click drawn from its propensity: a model that gives
each id its own row can learn every id's propensity; ids that share a row share a
prediction. Every model sees the same batches, the same dense init and the same optimizer
(torch Adagrad), with a table of ``--rows`` rows (fewer than the true ids):

- ``zch_<policy>``: ``dtrec.ManagedCollisionEmbeddingBagCollection`` with one
  ``MCHManagedCollisionModule`` (``zch_size = --rows``, eviction every ``--interval``
  steps); evicted rows' weights are reset by dtrec, their Adagrad state by an eviction
  hook (``reset_torch_optimizer_rows``). Policies: LFU, LRU(1), DistanceLFU(0.5).
- ``modulo``: the same ``EmbeddingBagCollection`` fed ``id % rows``.

Model: embedding (``--dim``) -> Linear(dim, 16) -> ReLU -> Linear(16, 1), BCE loss.
Reported per model, on ``--eval`` fresh samples after ``--steps`` steps (eval mode: the
remapper only remaps): log loss and AUC (rank statistic with tied scores averaged, plain
torch), the collision rate (the share of eval lookups, and of distinct ids, whose row
also holds another live true id: one seen in training), the training loss over the last
tenth of the steps, and for ZCH the rows reset by evictions. The Bayes model (the true
propensities) bounds what any model can reach.

    python -m benchmarks.managed_collision_quality \
        --json benchmarks/results/managed_collision_quality_cpu_<date>.json
    python -m benchmarks.managed_collision_quality --rows 64 --true-ids 256 --steps 20 \
        --batch 64 --eval 512     # smoke
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

import dtrec
from benchmarks.probes.machine import processor, processor_line
from benchmarks.probes.report import dtrec_source, write_report
from dtrec.modules import reset_torch_optimizer_rows
from dtrec.modules.eviction import LFU, LRU, DistanceLFU, EvictionPolicy

ID_SPACE = 1 << 40
"""True ids are drawn from ``[0, ID_SPACE)``."""


@dataclass(frozen=True)
class Task:
    """The click task and the training every model gets."""

    rows: int = 4096
    """Rows of the table (ZCH: its ``zch_size``, the miss row included)."""
    true_ids: int = 32768
    """Distinct true ids (their popularity is Zipf over them)."""
    zipf: float = 1.1
    """Zipf exponent of the ids' popularity: P(rank k) ~ (k + 1) ** -zipf."""
    logit_mean: float = -1.0
    """Mean of the ids' hidden click logits."""
    logit_std: float = 1.5
    """Spread of the ids' hidden click logits."""
    dim: int = 16
    """Embedding dim."""
    batch: int = 1024
    """Samples per step."""
    steps: int = 600
    """Training steps."""
    interval: int = 10
    """Steps per eviction of the ZCH remapper."""
    lr: float = 0.05
    """torch Adagrad learning rate (tables and dense)."""
    eval_samples: int = 100_000
    """Fresh samples the models are scored on."""
    seed: int = 0
    """Seeds the task, the batches and the model init."""


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lfu": LFU,
    "lru": lambda: LRU(1.0),
    "distance_lfu": lambda: DistanceLFU(0.5),
}
"""The ZCH policies compared (name -> policy)."""


@dataclass(frozen=True)
class World:
    """The task's hidden truth: the ids, their popularity and click logits."""

    ids: Tensor
    """int64 [true_ids], distinct, in [0, ID_SPACE)."""
    popularity: Tensor
    """float64 [true_ids], sums to 1."""
    logits: Tensor
    """float32 [true_ids], each id's click logit."""


def make_world(t: Task) -> World:
    """The true ids, a random popularity ranking (Zipf) and their hidden click logits."""
    gen = torch.Generator().manual_seed(t.seed)
    ids = torch.unique(torch.randint(0, ID_SPACE, (2 * t.true_ids,), generator=gen))
    ids = ids[torch.randperm(ids.numel(), generator=gen)[: t.true_ids]]
    if ids.numel() < t.true_ids:
        raise ValueError(f"could not draw {t.true_ids} distinct ids from 2**40")
    rank = torch.arange(1, t.true_ids + 1, dtype=torch.float64)
    popularity = rank.pow(-t.zipf)
    logits = t.logit_mean + t.logit_std * torch.randn(t.true_ids, generator=gen)
    return World(ids, popularity / popularity.sum(), logits)


def sample(world: World, n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """``n`` samples: (index into the true ids, click label in {0., 1.})."""
    which = torch.multinomial(world.popularity, n, replacement=True, generator=gen)
    clicks = torch.rand(n, generator=gen) < torch.sigmoid(world.logits[which])
    return which, clicks.float()


def auc(scores: Tensor, labels: Tensor) -> float:
    """Area under the ROC curve: the Mann-Whitney statistic, tied scores given their mean
    rank (a row shared by many ids scores them alike; ties must count half)."""
    _, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    mean_rank = (ends - (counts.double() - 1) / 2)[inverse]
    positive = labels > 0.5
    n_pos = int(positive.sum())
    n_neg = labels.numel() - n_pos
    if not n_pos or not n_neg:
        raise ValueError("AUC needs both labels")
    return float((mean_rank[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _dense(t: Task) -> nn.Module:
    return nn.Sequential(nn.Linear(t.dim, 16), nn.ReLU(), nn.Linear(16, 1))


class ClickModel(nn.Module):
    """One id per sample -> a row (ZCH remap or ``id % rows``) -> embedding -> MLP."""

    def __init__(self, t: Task, policy: EvictionPolicy | None) -> None:
        super().__init__()
        cfgs = [dtrec.EmbeddingBagConfig("item", t.rows, t.dim, ["item_id"], "sum")]
        ebc = dtrec.EmbeddingBagCollection(cfgs)
        self.remapper: dtrec.MCHManagedCollisionModule | None = None
        if policy is None:
            self.sparse: nn.Module = ebc
        else:
            self.remapper = dtrec.MCHManagedCollisionModule(
                t.rows, eviction_policy=policy, eviction_interval=t.interval, name="item"
            )
            self.sparse = dtrec.ManagedCollisionEmbeddingBagCollection(
                ebc, dtrec.ManagedCollisionCollection({"item": self.remapper}, cfgs)
            )
        self.dense = _dense(t)
        self.rows = t.rows

    def table_rows(self, ids: Tensor) -> Tensor:
        """The row each raw id is looked up in (no recording: evaluation's view)."""
        if self.remapper is None:
            return ids % self.rows
        return self.remapper.remap(self.remapper.preprocess(ids))

    def forward(self, ids: Tensor) -> Tensor:
        kjt = dtrec.KeyedJaggedTensor(["item_id"], ids, torch.ones_like(ids))
        if self.remapper is None:
            pooled = self.sparse(kjt.with_values(ids % self.rows))
        else:
            pooled, _ = self.sparse(kjt)
        return self.dense(pooled.values()).squeeze(1)


def collision_rate(rows_of_live: Tensor, rows_of_eval: Tensor, eval_live: Tensor) -> dict:
    """Share of distinct live ids, and of eval lookups, whose row another live id shares.

    ``rows_of_live``: the row of each live true id (seen in training); ``rows_of_eval``:
    the row of each eval lookup, ``eval_live`` whether its id is live itself."""
    per_row = torch.bincount(rows_of_live, minlength=int(rows_of_live.max()) + 1)
    shared_ids = per_row[rows_of_live] >= 2
    per_row = torch.cat([per_row, per_row.new_zeros(1)])  # an eval row beyond every live row
    rows_of_eval = rows_of_eval.clamp(max=per_row.numel() - 1)
    others = per_row[rows_of_eval] - eval_live.long()
    return {
        "ids": float(shared_ids.double().mean()),
        "lookups": float((others >= 1).double().mean()),
    }


def train_and_score(
    t: Task, world: World, name: str, policy: EvictionPolicy | None, data: dict
) -> dict:
    """Train one model on the shared batches, then score it on the shared eval set."""
    torch.manual_seed(t.seed)
    model = ClickModel(t, policy)
    opt = torch.optim.Adagrad(model.parameters(), lr=t.lr)
    reset_rows = 0
    if isinstance(model.sparse, dtrec.ManagedCollisionEmbeddingBagCollection):
        weight = model.sparse.table_weight("item")

        def on_evict(table: str, rows: Tensor) -> None:
            nonlocal reset_rows
            reset_rows += rows.numel()
            reset_torch_optimizer_rows(opt, weight, rows)

        model.sparse.register_eviction_hook(on_evict)
    losses = []
    start = time.process_time()
    model.train()
    for which, labels in data["batches"]:
        loss = nn.functional.binary_cross_entropy_with_logits(model(world.ids[which]), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    cpu_s = time.process_time() - start
    model.eval()
    which, labels = data["eval"]
    with torch.no_grad():
        logits = model(world.ids[which])
        rows_live = model.table_rows(world.ids[data["live"]])
        rows_eval = model.table_rows(world.ids[which])
    tail = max(1, len(losses) // 10)
    out = {
        "model": name,
        "eval_logloss": float(nn.functional.binary_cross_entropy_with_logits(logits, labels)),
        "eval_auc": auc(logits, labels),
        "train_loss_last_tenth": sum(losses[-tail:]) / tail,
        "collision_rate": collision_rate(rows_live, rows_eval, data["eval_live"]),
        "train_cpu_s": cpu_s,
    }
    if model.remapper is not None:
        out["rows_reset_by_evictions"] = reset_rows
        out["rows_held"] = int(t.rows - 1 - int(model.remapper.open_slots()))
    return out


def run(t: Task, policies: list[str] | None = None) -> dict:
    """Every model trained and scored on the same task; the summary compares each ZCH
    policy with ``modulo``."""
    policies = list(POLICIES) if policies is None else policies
    world = make_world(t)
    gen = torch.Generator().manual_seed(t.seed + 1)
    batches = [sample(world, t.batch, gen) for _ in range(t.steps)]
    seen = torch.zeros(t.true_ids, dtype=torch.bool)
    for which, _ in batches:
        seen[which] = True
    which, labels = sample(world, t.eval_samples, gen)
    data = {"batches": batches, "eval": (which, labels), "live": seen.nonzero().squeeze(1),
            "eval_live": seen[which]}  # fmt: skip
    results = {"modulo": train_and_score(t, world, "modulo", None, data)}
    for p in policies:
        results[f"zch_{p}"] = train_and_score(t, world, f"zch_{p}", POLICIES[p](), data)
    bayes = world.logits[which]
    results["bayes"] = {
        "model": "bayes",
        "eval_logloss": float(nn.functional.binary_cross_entropy_with_logits(bayes, labels)),
        "eval_auc": auc(bayes, labels),
    }
    return {"results": results, "summary": summarize(results), "live_true_ids": int(seen.sum())}


def summarize(results: dict) -> dict:
    """The best ZCH policy (lowest eval log loss) against ``modulo``: it wins when both its
    eval log loss is lower and its AUC higher; by how much, and the share of modulo's log
    loss gap to the Bayes model it closes."""
    base, bayes = results["modulo"], results["bayes"]
    zch = {k: v for k, v in results.items() if k.startswith("zch_")}
    best = min(zch, key=lambda k: zch[k]["eval_logloss"])
    b = zch[best]
    gap = base["eval_logloss"] - bayes["eval_logloss"]
    return {
        "best_zch": best,
        "zch_wins": b["eval_logloss"] < base["eval_logloss"] and b["eval_auc"] > base["eval_auc"],
        "policies_that_win": sorted(
            k for k, v in zch.items()
            if v["eval_logloss"] < base["eval_logloss"] and v["eval_auc"] > base["eval_auc"]
        ),
        "auc_gain": b["eval_auc"] - base["eval_auc"],
        "logloss_drop": base["eval_logloss"] - b["eval_logloss"],
        "logloss_gap_to_bayes_closed": None if gap <= 0 else
        (base["eval_logloss"] - b["eval_logloss"]) / gap,
        "collision_rate_lookups": {"zch": b["collision_rate"]["lookups"],
                                   "modulo": base["collision_rate"]["lookups"]},
    }  # fmt: skip


def _meta(argv: list[str], t: Task) -> dict:
    return {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python -m benchmarks.managed_collision_quality", *argv]),
        "device": "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_cores": os.cpu_count(),
        "processor": processor(),
        "platform": platform.platform(),
        "dtrec": dtrec_source(),
        "task": asdict(t),
        "note": "one process; quality figures are deterministic for a seed, CPU seconds "
        "are of a shared machine",
    }


def print_report(report: dict) -> None:
    heads = ("eval logloss", "eval AUC", "train loss", "coll. lookups", "coll. ids")
    print(f"{'model':18s} " + " ".join(f"{h:>12s}" for h in heads) + "  rows reset  cpu s")
    for name, r in report["results"].items():
        cr = r.get("collision_rate") or {}

        def pct(key: str, cr: dict = cr) -> str:
            return f"{100 * cr[key]:.1f}%" if key in cr else "-"

        train = r.get("train_loss_last_tenth")
        print(f"{name:18s} {r['eval_logloss']:12.4f} {r['eval_auc']:12.4f} "
              f"{'-' if train is None else f'{train:.4f}':>12s} {pct('lookups'):>12s} "
              f"{pct('ids'):>12s} {r.get('rows_reset_by_evictions', '-')!s:>11s} "
              f"{r.get('train_cpu_s', math.nan):6.1f}")  # fmt: skip
    s = report["summary"]
    closed = s["logloss_gap_to_bayes_closed"]
    print(f"best ZCH ({s['best_zch']}) vs id % rows: AUC +{s['auc_gain']:.4f}, log loss "
          f"-{s['logloss_drop']:.4f}"
          + ("" if closed is None else f" ({100 * closed:.0f}% of modulo's gap to Bayes)")
          + f"; wins: {s['zch_wins']}; policies that beat it on both: "
          + (", ".join(s["policies_that_win"]) or "none"))  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    d = Task()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=d.rows)
    p.add_argument("--true-ids", type=int, default=d.true_ids)
    p.add_argument("--zipf", type=float, default=d.zipf)
    p.add_argument("--dim", type=int, default=d.dim)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--interval", type=int, default=d.interval)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--eval", type=int, default=d.eval_samples, help="eval samples")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    t = Task(rows=args.rows, true_ids=args.true_ids, zipf=args.zipf, dim=args.dim,
             batch=args.batch, steps=args.steps, interval=args.interval, lr=args.lr,
             eval_samples=args.eval, seed=args.seed)  # fmt: skip
    report = run(t, args.policies.split(","))
    report["meta"] = _meta(argv, t)
    print(f"processor: {processor_line(report['meta']['processor'])}")
    print_report(report)
    if args.json:
        write_report(args.json, report)


if __name__ == "__main__":
    main()
