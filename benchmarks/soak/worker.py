"""One rank of one soak attempt (``benchmarks/soak/run.py``): restore, train, inject faults.

An attempt starts from the newest complete checkpoint that has its trainer state (or
from scratch), runs the schedule's steps and events, and writes its timeline to a file
as it goes (``log_path``): every trained step (what each rank fed, the losses, the
time), every published checkpoint (with a digest of the full state) and every fault's
outcome. An attempt ends when the run is done, or when a rank died (a planned kill, or
an event that broke the step): the supervisor then starts the next one.

Fault outcomes are agreed on by every rank (one small all-gather per event), so a
"survived" means it survived everywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dtrec
from benchmarks.soak.model import (
    BAD_BATCHES,
    WORLD,
    BatchSpec,
    Schedule,
    SoakModel,
    bad_batch,
    dense_optimizer,
    fused_rule,
    make_batch,
    plans_for,
    rank_loss,
    to_device,
)
from dtrec.checkpoint import full_tensor

CLEAN_ERRORS = (ValueError, KeyError, IndexError, TypeError)


@dataclass(frozen=True)
class Event:
    """One scheduled fault: before good step ``step``, of ``kind``, on ``rank``."""

    id: int
    step: int
    kind: str
    rank: int = 0
    variant: int = 0
    plan: str = ""  # reshard: the plan restored into


@dataclass
class SoakConfig:
    steps: int
    seed: int
    root: str  # checkpoint root
    events: list[Event]
    warmup: int = 50
    foreach: bool = False
    uneven: str = "auto"  # "auto" | "train" | "refuse"
    vbe_every: int = 3
    keep_last: int = 2
    t0: float = 0.0  # the supervisor's start (time.time()), for the timeline
    fired: frozenset[int] = field(default_factory=frozenset)
    attempt: int = 0
    device: str = "cpu"  # "cuda": each rank on GPU rank % device_count, batches moved there
    world: int = WORLD  # ranks (1 or 4: soak_model.plans_for)


def log_path(root: str | Path, attempt: int, rank: int) -> Path:
    """Where a rank writes its timeline of an attempt, a JSON line per entry (the
    supervisor reads it even when the rank was killed)."""
    return Path(root) / "log" / f"attempt-{attempt:03d}-rank-{rank}.jsonl"


def final_path(root: str | Path, attempt: int) -> Path:
    return Path(root) / "log" / f"attempt-{attempt:03d}-final.pt"


@dataclass
class Trainer:
    plan: str
    model: nn.Module
    dense: torch.optim.Optimizer
    schedules: tuple[Any, Any]  # LambdaLRs of the fused and the dense optimizer


def build(cfg: SoakConfig, plan: str) -> Trainer:
    spec = plans_for(cfg.world)[plan]
    mesh = dtrec.init_mesh(cfg.device, spec.shard_group_size, spec.node_size)
    torch.manual_seed(0)
    model = dtrec.distribute_module(SoakModel(), mesh, dict(spec.specs), optimizer=fused_rule())
    dense = dense_optimizer(model, cfg.foreach)
    schedule = Schedule(cfg.warmup, cfg.steps)
    lambda_lr = torch.optim.lr_scheduler.LambdaLR
    return Trainer(plan, model, dense, (lambda_lr(model.fused_optimizer, schedule),
                                        lambda_lr(dense, schedule)))  # fmt: skip


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()


def _walk(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k in sorted(value, key=str):
            _walk(f"{prefix}.{k}", value[k], out)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _walk(f"{prefix}.{i}", v, out)
    else:
        out[prefix] = value


def _state_items(tr: Trainer) -> dict[str, tuple[Any, bool]]:
    """Everything a checkpoint holds, flat: key -> (value, whether this rank holds it).
    A fused state on a rank without a block of its table (an empty column block) is
    part of the DTensor but unused there, and not saved: not held."""
    out: dict[str, Any] = {}
    _walk("model", tr.model.state_dict(), out)
    fused = tr.model.fused_optimizer
    blocks = fused.blocks()
    for table, entries in fused.state_dict()["state"].items():
        _walk(f"fused.{table}", entries, out)
    _walk("dense", tr.dense.state_dict()["state"], out)
    _walk("lr", [g["lr"] for g in fused.param_groups], out)
    return {
        k: (
            v,
            not k.startswith("fused.") or blocks[k[len("fused.") :].rsplit(".", 1)[0]] is not None,
        )
        for k, v in out.items()
    }


def local_digest(tr: Trainer) -> str:
    """Hash of everything this rank holds (its blocks, states, dense params, lrs)."""
    h = hashlib.sha256()
    for key, (value, _) in _state_items(tr).items():
        h.update(key.encode())
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            h.update(_tensor_bytes(local))
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


def global_digest(tr: Trainer) -> tuple[dict[str, str], list[str]]:
    """Hash per entry of the full state (tables assembled), the same under every plan,
    taken from the ranks that hold the entry (collective). Also every copy that is not
    the same on all ranks: "key@rank" for a rank without a block of the table whose
    copy is stale (not held, so harmless), "key!" for holders that disagree (a bug)."""
    mine = {}
    for key, (value, held) in _state_items(tr).items():
        if isinstance(value, torch.Tensor):
            digest = hashlib.sha256(_tensor_bytes(full_tensor(value).float())).hexdigest()
        else:
            digest = repr(value)
        mine[key] = (digest, held)
    everyone = _agree(mine)
    out, odd = {}, []
    for key in mine:
        held = {r: d[key][0] for r, d in enumerate(everyone) if d[key][1]}
        out[key] = held[min(held)] if held else "not held"
        if len(set(held.values())) > 1:
            odd.append(f"{key}!")
        odd += [f"{key}@{r}" for r, d in enumerate(everyone)
                if not d[key][1] and d[key][0] != out[key]]  # fmt: skip
    return out, odd


def differing(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """Entries whose digests differ (or that only one side has)."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _agree(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _trainer_path(root: Path, name: str) -> Path:
    return root / "trainer" / f"{name}.pt"


def newest_restorable(root: Path) -> tuple[Path, dict] | None:
    """The newest complete checkpoint with its trainer state written, and that state."""
    if not root.is_dir():
        return None
    for ckpt in sorted(root.glob("ckpt-*"), reverse=True):
        state = _trainer_path(root, ckpt.name)
        if (ckpt / "COMPLETE.json").is_file() and state.is_file():
            return ckpt, torch.load(state, weights_only=False)
    return None


class Run:
    """One attempt on one rank."""

    def __init__(self, rank: int, cfg: SoakConfig) -> None:
        self.rank, self.cfg, self.root = rank, cfg, Path(cfg.root)
        self.good_steps = 0  # scheduler steps taken (the step count the reference replays)
        path = log_path(cfg.root, cfg.attempt, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(path, "w")  # noqa: SIM115 - open for the attempt's life

    def add(self, entry: dict) -> None:
        """Append ``entry`` to this rank's timeline file (flushed: a kill loses nothing)."""
        self._log.write(json.dumps(entry, default=str) + "\n")
        self._log.flush()

    def now(self) -> float:
        return time.time() - self.cfg.t0

    # ------------------------------------------------------------ checkpoints

    def save(self, tr: Trainer, step: int, then: str | None = None) -> dict:
        """A checkpoint; a restart from it goes on under plan ``then`` (default: this
        one's)."""
        start = time.perf_counter()
        digest, odd = global_digest(tr)
        final = dtrec.checkpoint.save(self.root, tr.model, tr.dense, keep_last=self.cfg.keep_last)
        if self.rank == 0:  # the trainer state, atomically, after the checkpoint is published
            path = _trainer_path(self.root, final.name)
            path.parent.mkdir(exist_ok=True)
            schedules = [s.state_dict() for s in tr.schedules]
            state = {"step": step, "good_steps": self.good_steps, "plan": then or tr.plan,
                     "digest": digest, "schedules": schedules}  # fmt: skip
            torch.save(state, path.with_suffix(".tmp"))
            os.rename(path.with_suffix(".tmp"), path)
            for stale in path.parent.glob("ckpt-*.pt"):  # checkpoints keep_last removed
                if not (self.root / stale.stem).is_dir():
                    stale.unlink()
        dist.barrier()
        entry = {"kind": "checkpoint", "name": final.name, "step": step, "digest": digest,
                 "odd": odd, "good_steps": self.good_steps, "plan": tr.plan, "t": self.now(),
                 "seconds": time.perf_counter() - start}  # fmt: skip
        self.add(entry)
        return entry

    def restore(self, path: Path, state: dict, plan: str) -> tuple[Trainer, list[str]]:
        """Build ``plan`` and load ``path`` into it; the entries of the full state whose
        digest differs from the one recorded when it was saved (none: a good restore)."""
        tr = build(self.cfg, plan)
        dtrec.checkpoint.load(path, tr.model, tr.dense)
        for sched, saved in zip(tr.schedules, state["schedules"], strict=True):
            sched.load_state_dict(saved)
        digest, odd = global_digest(tr)
        return tr, differing(digest, state["digest"]) + [f"odd {k}" for k in odd if k.endswith("!")]

    # ------------------------------------------------------------ steps

    def batch(self, step: int, salt: int = 0, size: int | None = None) -> tuple[BatchSpec, dict]:
        vbe = self.cfg.vbe_every > 0 and step % self.cfg.vbe_every == 1
        spec = BatchSpec(step, self.rank, size if size is not None else BatchSpec.size, vbe, salt)
        return spec, to_device(make_batch(self.cfg.seed, spec), self.cfg.device)

    def train(self, tr: Trainer, batch: dict, kill: bool = False) -> float:
        loss = rank_loss(tr.model, batch)
        if kill:  # dies mid-step: its peers are about to exchange gradients
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        tr.dense.step()
        tr.dense.zero_grad()
        for sched in tr.schedules:
            sched.step()
        self.good_steps += 1
        return float(loss.detach())

    def record_step(self, tr: Trainer, spec: BatchSpec, loss: float, seconds: float, tag: str):
        """Every rank's batch size, loss and time for the timeline (one small all-gather)."""
        mine = torch.tensor([loss, seconds, spec.size], dtype=torch.float64)
        everyone = torch.zeros(dist.get_world_size() * 3, dtype=torch.float64)
        dist.all_gather_into_tensor(everyone, mine)
        everyone = everyone.view(-1, 3)
        sizes = [int(x) for x in everyone[:, 2]]
        self.add({
            "kind": "step", "step": spec.step, "tag": tag, "plan": tr.plan, "t": self.now(),
            "vbe": spec.vbe, "salt": spec.salt, "sizes": sizes,
            "losses": everyone[:, 0].tolist(), "seconds": float(everyone[:, 1].max()),
            "good_steps": self.good_steps,
        })  # fmt: skip

    def fault(self, event: Event, survived: bool, detail: Any) -> None:
        self.add({"kind": "fault", "id": event.id, "type": event.kind,
                              "step": event.step, "rank": event.rank, "survived": survived,
                              "detail": detail, "t": self.now()})  # fmt: skip

    def try_step(self, tr: Trainer, spec: BatchSpec, batch: dict) -> tuple[str, list]:
        """Feed ``batch``: "trained" if every rank trained, "refused" if every rank refused
        it with a clean error and changed nothing, else raises ``Diverged``."""
        before = local_digest(tr)
        start = time.perf_counter()
        loss, error = None, None
        try:
            loss = self.train(tr, batch)
        except CLEAN_ERRORS as exc:
            error = f"{type(exc).__name__}: {str(exc)[:240]}"
        unchanged = loss is not None or local_digest(tr) == before
        everyone = _agree((error, unchanged))
        if all(e is None for e, _ in everyone):
            self.record_step(tr, spec, loss, time.perf_counter() - start, "uneven")
            return "trained", everyone
        if all(e is not None and same for e, same in everyone):
            return "refused", everyone
        raise Diverged(
            f"step {spec.step}: ranks disagree on a batch (error, unchanged): {everyone}"
        )

    # ------------------------------------------------------------ events

    def handle(self, tr: Trainer, ev: Event) -> Trainer:
        """Inject ``ev`` before good step ``ev.step``; returns the trainer to go on with."""
        if ev.kind in BAD_BATCHES:
            spec, batch = self.batch(ev.step, salt=1000 + ev.id)
            if self.rank == ev.rank:
                batch = to_device(bad_batch(self.cfg.seed, spec, ev.kind, ev.variant),
                                  self.cfg.device)  # fmt: skip
            outcome, everyone = self.try_step(tr, spec, batch)
            self.fault(ev, outcome == "refused", everyone)
        elif ev.kind == "uneven":
            size = (BatchSpec.size // 2, 0)[ev.variant] if self.rank == ev.rank else None
            spec, batch = self.batch(ev.step, salt=1000 + ev.id, size=size)
            outcome, everyone = self.try_step(tr, spec, batch)
            allowed = {"auto": ("trained", "refused"), "train": ("trained",),
                       "refuse": ("refused",)}[self.cfg.uneven]  # fmt: skip
            self.fault(ev, outcome in allowed, {"outcome": outcome, "ranks": everyone})
        elif ev.kind == "checkpoint_save":
            entry = self.save(tr, ev.step)
            self.fault(ev, True, entry["name"])
        elif ev.kind == "killed_save":
            if self.rank == ev.rank:
                _die_inside_save(self.root, self.rank, ev.variant)
            self.save(tr, ev.step)  # the killed rank never returns; its peers raise
            raise Diverged(f"the save of step {ev.step} was to be killed but completed")
        elif ev.kind == "reshard":
            entry = self.save(tr, ev.step, then=ev.plan)
            state = {"digest": entry["digest"], "schedules": [s.state_dict() for s in tr.schedules]}
            new, bad = self.restore(self.root / entry["name"], state, ev.plan)
            ok = not bad
            self.fault(ev, ok, {"from": tr.plan, "to": ev.plan, "checkpoint": entry["name"],
                                "differing": bad[:20]})  # fmt: skip
            return new
        elif ev.kind == "kill_rank":
            spec, batch = self.batch(ev.step)
            self.train(tr, batch, kill=self.rank == ev.rank)
            raise Diverged(
                f"rank {ev.rank} was to be killed at step {ev.step} but its peers went on"
            )
        else:
            raise ValueError(f"unknown event kind {ev.kind!r}")
        return tr


class Diverged(RuntimeError):
    """The ranks' states no longer agree: the attempt must end (and restart)."""


def _die_inside_save(root: Path, rank: int, point: int) -> None:
    """Make this rank die inside its next checkpoint save: point 0, right after writing its
    data file, which it first tears (truncates to half); point 1 (rank 0), after writing the
    checkpoint's marker, just before the rename that publishes it."""
    if point % 2 == 0:
        from torch.distributed.checkpoint import FileSystemWriter

        original = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):  # type: ignore[no-untyped-def]
            future = original(self, plan, planner)
            future.wait()
            for f in Path(self.path).glob(f"__{rank}_*"):
                with open(f, "r+b") as fh:
                    fh.truncate(max(f.stat().st_size // 2, 1))
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = write_then_die
    else:
        original_rename = os.rename

        def rename_or_die(src, dst, *args, **kwargs):  # type: ignore[no-untyped-def]
            if str(src).endswith(".partial"):
                os.kill(os.getpid(), signal.SIGKILL)
            return original_rename(src, dst, *args, **kwargs)

        os.rename = rename_or_die


# --------------------------------------------------------------------------- attempt


def attempt(rank: int, world: int, cfg: SoakConfig) -> None:
    """One attempt on this rank: restore, then train and inject until the end or a death.
    Writes its timeline (``log_path``): a "start" entry, the steps, checkpoints and
    faults, an "end" entry (how it ended, the event being injected if one broke it);
    rank 0 writes the final full weights (``final_path``) when the run is done."""
    torch.set_num_threads(1)
    if cfg.device == "cuda":  # exact fp32 matmuls: the reference trains on CPU
        torch.cuda.set_device(rank % torch.cuda.device_count())
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.sparse.check_sparse_tensor_invariants.enable()  # any sparse tensor built is checked
    run = Run(rank, cfg)
    found = [newest_restorable(run.root) if rank == 0 else None]
    dist.broadcast_object_list(found, src=0)
    started = time.perf_counter()
    if found[0] is not None:
        path, state = found[0]
        tr, bad = run.restore(path, state, state["plan"])
        run.good_steps, step = state["good_steps"], state["step"]
        start = {"checkpoint": path.name, "step": step, "digest_ok": not bad,
                 "differing": bad[:20]}  # fmt: skip
    else:
        tr, step = build(cfg, next(iter(plans_for(cfg.world)))), 0
        start = {"checkpoint": None, "step": 0, "digest_ok": True}
    run.add({"kind": "start", **start, "plan": tr.plan, "t": run.now(),
             "seconds": time.perf_counter() - started})  # fmt: skip
    events: dict[int, list[Event]] = {}
    for ev in cfg.events:
        if ev.id not in cfg.fired:
            events.setdefault(ev.step, []).append(ev)
    end, current = "done", None
    try:
        while step < cfg.steps:
            for ev in events.get(step, []):
                current = ev.id
                tr = run.handle(tr, ev)
                current = None
            spec, batch = run.batch(step)
            t = time.perf_counter()
            loss = run.train(tr, batch)
            run.record_step(tr, spec, loss, time.perf_counter() - t, "good")
            step += 1
        weights, (digest, odd) = dtrec.checkpoint.full_state_dict(tr.model), global_digest(tr)
        if rank == 0:
            torch.save({"weights": weights, "digest": digest, "odd": odd},
                       final_path(cfg.root, cfg.attempt))  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - a peer's death (or a fault's) ends the attempt
        end = f"{type(exc).__name__}: {str(exc)[:400]}"
    run.add({"kind": "end", "end": end, "event": current, "t": run.now()})
