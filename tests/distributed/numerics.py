"""Numerics contract harness: sharded training == unsharded training on the global batch.

Shared by the numerics tests (and later property tests): builds a small model,
trains it sharded on W ranks and unsharded on the concatenated batch, and
reports the largest differences.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import dtrec
from dtrec.placements import ColumnWise, DataParallel, Grid, RowWise, TableRowWise, TableWise

TABLES = [
    # (name, rows, dim, features, pooling); rows 3 < S exercises empty row shards.
    ("t0", 50, 8, ["f0", "f1"], "sum"),
    ("t1", 3, 5, ["f2"], "mean"),
    ("t2", 97, 7, ["f3"], "sum"),
    ("t3", 20, 4, ["f4"], "mean"),
]

PLANS = {
    "data_parallel": {t[0]: DataParallel() for t in TABLES},
    "table_wise": {t[0]: TableWise(rank=None) for t in TABLES},
    "row_wise": {t[0]: RowWise() for t in TABLES},
    "column_wise": {t[0]: ColumnWise() for t in TABLES},
    "table_row_wise": {t[0]: TableRowWise() for t in TABLES},
    "grid": {t[0]: Grid() for t in TABLES},
    "mixed": {"t0": RowWise(), "t1": TableWise(rank=0), "t2": ColumnWise(), "t3": DataParallel()},
}


def make_tables(weighted: bool) -> list[dtrec.EmbeddingBagConfig]:
    return [
        dtrec.EmbeddingBagConfig(n, rows, dim, feats, "sum" if weighted else pooling)
        for n, rows, dim, feats, pooling in TABLES
    ]


class TinyModel(nn.Module):
    """Embeddings -> one linear layer: enough to exercise sparse and dense grads."""

    def __init__(self, tables: list[dtrec.EmbeddingBagConfig]) -> None:
        super().__init__()
        self.sparse = dtrec.EmbeddingBagCollection(tables)
        self.dense = nn.Linear(sum(t.embedding_dim * len(t.feature_names) for t in tables), 1)

    def forward(self, kjt: dtrec.KeyedJaggedTensor) -> torch.Tensor:
        return self.head(self.sparse(kjt).values())

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        """The dense part, in fp32 whatever the tables' dtype."""
        return self.dense(pooled.float()).squeeze(1)


def make_batch(
    tables: list[dtrec.EmbeddingBagConfig],
    batch: int,
    weighted: bool,
    gen: torch.Generator,
    empty: Collection[str] = (),
) -> tuple[dtrec.KeyedJaggedTensor, torch.Tensor]:
    """A random batch; features named in ``empty`` get no ids at all."""
    keys, values, lengths, weights = [], [], [], []
    for cfg in tables:
        for f in cfg.feature_names:
            ls = torch.randint(0, 5, (batch,), generator=gen)
            if f in empty:
                ls.zero_()
            keys.append(f)
            lengths.append(ls)
            values.append(torch.randint(0, cfg.num_embeddings, (int(ls.sum()),), generator=gen))
            weights.append(torch.rand(int(ls.sum()), generator=gen))
    kjt = dtrec.KeyedJaggedTensor(
        keys, torch.cat(values), torch.cat(lengths), torch.cat(weights) if weighted else None
    )
    return kjt, torch.randn(batch, generator=gen)


@dataclass
class Result:
    max_weight_diff: float = 0.0
    """Largest |sharded - unsharded| weight after the last step (bf16: in units of the bf16
    spacing at the largest |weight| of the unsharded row, see :func:`spacing`)."""
    max_dense_diff: float = 0.0
    """Largest difference of the dense layer's weight (part of ``max_weight_diff`` in fp32)."""
    max_loss_diff: float = 0.0
    max_output_diff: float = 0.0
    """Largest difference of this rank's pooled embeddings, every step."""
    max_grad_diff: float = 0.0
    """Largest difference of this rank's table gradient blocks, every step (not fused)."""
    max_output: float = 0.0
    max_grad: float = 0.0
    """Largest magnitudes of the unsharded pooled embeddings and gradient blocks (the
    scale of the differences above)."""
    max_norm_diff: float = 0.0
    """Largest |sharded - unsharded| total norm returned by ``clip_grad_norm_`` (``clip``)."""
    max_norm: float = 0.0
    grads_sharded_like_weights: bool = True
    shapes_match: bool = True
    """This rank's pooled output had the unsharded one's shape every step (``(0, D)`` for an
    empty batch); a mismatch is described in ``notes``."""
    notes: list[str] = field(default_factory=list)
    inspected: object = None
    """What ``check_numerics``'s ``inspect`` returned (None without one)."""


def check_numerics(
    mesh: torch.distributed.device_mesh.DeviceMesh,
    plan: dict[str, dtrec.placements.TableSpec],
    weighted: bool,
    steps: int = 5,
    batch: int = 3,
    lr: float = 0.5,
    seed: int = 0,
    optimizer: str = "sgd",
    fused: dtrec.optim.FusedOptimizer | None = None,
    tables: list[dtrec.EmbeddingBagConfig] | None = None,
    dtype: torch.dtype = torch.float32,
    sync_every: int | None = None,
    empty: Mapping[int, Collection[str]] | None = None,
    device: str = "cpu",
    batch_sizes: Sequence[Sequence[int]] | None = None,
    opt_kwargs: Mapping[str, object] | None = None,
    clip: Mapping[str, object] | None = None,
    inspect: Callable[[nn.Module, torch.optim.Optimizer], object] | None = None,
) -> Result:
    """Train sharded and unsharded side by side; return the largest differences.

    ``tables``: the model's tables (default: ``make_tables(weighted)``); ``dtype``: the
    tables' dtype (with a fused optimizer the unsharded tables stay fp32, rounded to
    ``dtype`` after each update: fused steps take fp32 gradient rows, which a bf16
    ``.grad`` would round); ``empty``: per rank, features its batches leave empty;
    ``device``: where both models and the batches live (the mesh's device type; the
    batches are drawn on CPU, so every device sees the same numbers); ``batch_sizes``:
    per step, every rank's batch size (uneven, 0 included; default: ``batch`` on every
    rank for ``steps`` steps). Each rank's loss is over its own batch
    (``rank_loss``), the unsharded model's the sum of those over W. ``opt_kwargs``:
    extra arguments of the torch optimizer (``foreach=True``, ``fused=True``), given to the
    sharded and the unsharded model's alike; ``clip``: keyword arguments of
    ``torch.nn.utils.clip_grad_norm_`` run on both models' parameters before each step
    (with a fused optimizer the unsharded model clips its dense part only: the sharded
    tables have no ``.grad``), the largest difference of the returned norms in
    ``Result.max_norm_diff``; ``inspect``: called with the sharded model and its torch
    optimizer after the last step, its return value kept in ``Result.inspected`` (e.g. what
    a rank holds at rest).

    The unsharded run depends on none of plan, mesh and ``sync_every``: it is trained once
    per everything else in a rank (``_unsharded_run``) and read by every plan that shares it.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    tables = tables if tables is not None else make_tables(weighted)
    empty = empty or {}
    if batch_sizes is None:
        batch_sizes = [[batch] * world] * steps
    setup = _Setup(tables, weighted, seed, fused, dtype, empty, device, batch_sizes)
    ref = _unsharded_run(setup, optimizer, lr, opt_kwargs or {}, clip)
    sharded = dtrec.distribute_module(
        _initial_model(setup),
        mesh,
        {f"sparse.{k}": v for k, v in plan.items()},
        optimizer=fused,
        sync_every=sync_every,
    )
    opt = _torch_optimizer(optimizer, lr, opt_kwargs or {})(sharded.parameters())
    result = Result()
    gen = torch.Generator().manual_seed(seed + 1)
    # this rank's stored block (a fully sharded table's: its owner slice)
    blocks = {name: table.block for name, table in sharded.sparse.embedding_bags.items()}

    def block_of(name: str, full: torch.Tensor) -> torch.Tensor:
        block = blocks[name]
        return full[block.rows[0] : block.rows[1], block.cols[0] : block.cols[1]]

    seen: dict[str, torch.Tensor] = {}
    sharded.sparse.register_forward_hook(lambda m, i, out: seen.update(pooled=out.values()))
    for step, sizes in enumerate(batch_sizes):
        kjt, target = _step_batches(setup, sizes, gen)[rank]
        loss = rank_loss(sharded(kjt), target)  # the root forward: dense grad sync
        pooled = seen["pooled"]
        loss.backward()

        want_pooled = ref.pooled[step][rank]
        result.max_loss_diff = max(result.max_loss_diff, abs(loss.item() - ref.losses[step][rank]))
        if pooled.shape != want_pooled.shape:
            result.shapes_match = False
            result.notes.append(f"step {step}: output {tuple(pooled.shape)}, want "
                                f"{tuple(want_pooled.shape)}")  # fmt: skip
        out_diff = (
            (pooled.float() - want_pooled.float()).abs().max().item() if pooled.numel() else 0.0
        )
        result.max_output_diff = max(result.max_output_diff, out_diff)
        result.max_output = max(result.max_output, ref.max_output[step])

        for name, table in sharded.sparse.embedding_bags.items():
            w, g = table.weight, table.weight.grad
            if step == 0:
                if fused is not None and g is not None:
                    result.grads_sharded_like_weights = False
                    result.notes.append(f"{name}: fused optimizer left a .grad")
                same = g is None or (
                    g.placements == w.placements and g.to_local().shape == w.to_local().shape
                )
                if not same:
                    result.grads_sharded_like_weights = False
                    result.notes.append(f"{name}: grad {g.placements} vs weight {w.placements}")
            # with sync_every replicas keep their own gradients (summed over S, not W)
            # (a fully sharded table's owner slice may be empty: no rows to compare)
            if fused is None and sync_every is None and blocks[name] and blocks[name].numel:
                want = ref.grads[step][name]
                got = torch.zeros_like(w.to_local()) if g is None else g.to_local()
                diff = (got.float() - block_of(name, want).float()).abs().max().item()
                result.max_grad_diff = max(result.max_grad_diff, diff if got.numel() else 0.0)
                result.max_grad = max(
                    result.max_grad, block_of(name, want).abs().max().item() if got.numel() else 0.0
                )
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(sharded.parameters(), **clip)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            result.max_norm_diff = max(result.max_norm_diff, (norm - ref.norms[step]).abs().item())
            result.max_norm = max(result.max_norm, ref.norms[step].item())
        opt.step()
        opt.zero_grad()
    if sync_every is not None:
        sharded.sparse.sync_replicas()  # the last steps since a sync
    if inspect is not None:
        result.inspected = inspect(sharded, opt)

    for name, table in sharded.sparse.embedding_bags.items():
        if blocks[name] is None:
            continue
        full = ref.weights[name]
        want = block_of(name, full)
        diff = (table.weight.to_local().float() - want.float()).abs()
        if dtype != torch.float32 and diff.numel():  # the unit: set by the row's largest
            rows = blocks[name].rows
            scale = full[rows[0] : rows[1]].float().abs().amax(dim=1, keepdim=True)
            diff = diff / spacing(scale.to(dtype))
        result.max_weight_diff = max(
            result.max_weight_diff, diff.max().item() if diff.numel() else 0.0
        )
    dense = sharded.dense.weight  # a DTensor replicated over the mesh: every rank's copy
    dense = dense.to_local() if isinstance(dense, DTensor) else dense
    result.max_dense_diff = (dense - ref.dense).abs().max().item()
    if dtype == torch.float32:
        result.max_weight_diff = max(result.max_weight_diff, result.max_dense_diff)
    return result


@dataclass(frozen=True)
class _Setup:
    """What the models' start and the batches depend on (the same for both models)."""

    tables: list[dtrec.EmbeddingBagConfig]
    weighted: bool
    seed: int
    fused: dtrec.optim.FusedOptimizer | None
    dtype: torch.dtype
    empty: Mapping[int, Collection[str]]
    device: str
    batch_sizes: Sequence[Sequence[int]]

    def key(self) -> str:
        fused = self.fused
        rule = None if fused is None else (type(fused).__qualname__, repr(vars(fused)))
        return repr((self.tables, self.weighted, self.seed, rule, self.dtype,
                     sorted((r, sorted(f)) for r, f in self.empty.items()), self.device,
                     [list(s) for s in self.batch_sizes]))  # fmt: skip


def _initial_model(setup: _Setup) -> TinyModel:
    """Both models' start: the same seed, the tables in ``setup.dtype``."""
    torch.manual_seed(setup.seed)
    model = TinyModel(setup.tables)
    if setup.device != "cpu":
        model.to(setup.device)
    model.sparse.to(setup.dtype)
    return model


def _step_batches(setup: _Setup, sizes: Sequence[int], gen: torch.Generator) -> list:
    """Every rank's (kjt, target) of one step, drawn on CPU from ``gen``."""
    batches = [
        make_batch(setup.tables, n, setup.weighted, gen, setup.empty.get(r, ()))
        for r, n in enumerate(sizes)
    ]
    if setup.device != "cpu":
        batches = [(kjt.to(setup.device), target.to(setup.device)) for kjt, target in batches]
    return batches


def _torch_optimizer(
    optimizer: str, lr: float, kw: Mapping[str, object]
) -> Callable[..., torch.optim.Optimizer]:
    return {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=lr, **kw),
        "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=lr / 5, momentum=0.9, **kw),
        "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=lr, **kw),
        "adam": lambda ps: torch.optim.Adam(ps, lr=lr / 10, **kw),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=lr / 10, weight_decay=0.1, **kw),
        "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=lr / 50, **kw),
    }[optimizer]


@dataclass
class _UnshardedRun:
    """The unsharded model's run, as ``check_numerics`` compares with it, per step: every
    rank's pooled output and loss, the largest pooled magnitude, the tables' full
    gradients (zeros where none), the clipped norm; then the final weights."""

    pooled: list[list[torch.Tensor]] = field(default_factory=list)
    losses: list[list[float]] = field(default_factory=list)
    max_output: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    norms: list[torch.Tensor] = field(default_factory=list)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    dense: torch.Tensor | None = None


_UNSHARDED_RUNS: dict[str, _UnshardedRun] = {}


def _unsharded_run(
    setup: _Setup,
    optimizer: str,
    lr: float,
    opt_kwargs: Mapping[str, object],
    clip: Mapping[str, object] | None,
) -> _UnshardedRun:
    """The unsharded model trained on the global batches (each rank's loss over its own
    batch, their mean), kept per everything it depends on."""
    key = repr((setup.key(), optimizer, lr, sorted(opt_kwargs.items()), clip))
    if key in _UNSHARDED_RUNS:
        return _UNSHARDED_RUNS[key]
    fused = setup.fused
    reference = _initial_model(setup)
    if fused is not None:
        reference.sparse.float()
    state = {n: fused.init_state(t.weight) for n, t in reference.sparse.embedding_bags.items()
             } if fused is not None else {}  # fmt: skip
    ref_opt = _torch_optimizer(optimizer, lr, opt_kwargs)(reference.parameters())
    ref_tables = reference.sparse.embedding_bags
    run = _UnshardedRun()
    gen = torch.Generator().manual_seed(setup.seed + 1)
    for sizes in setup.batch_sizes:
        batches = _step_batches(setup, sizes, gen)
        ref_pooled = [reference.sparse(k).values() for k, _ in batches]
        ref_losses = [rank_loss(reference.head(p), t) for p, (_, t) in zip(ref_pooled, batches)]
        torch.stack(ref_losses).mean().backward()
        run.pooled.append([p.detach().clone() for p in ref_pooled])
        run.losses.append([x.item() for x in ref_losses])
        run.max_output.append(max([0.0] + [p.abs().max().item() for p in ref_pooled if p.numel()]))
        run.grads.append({
            name: torch.zeros_like(t.weight) if t.weight.grad is None else t.weight.grad.clone()
            for name, t in ref_tables.items()
        })  # fmt: skip
        if clip is not None:
            ref_params = reference.dense if fused is not None else reference
            run.norms.append(torch.nn.utils.clip_grad_norm_(ref_params.parameters(), **clip))
        if fused is not None:
            fused_reference_update(
                reference, setup.tables, fused, state, [k for k, _ in batches], setup.dtype
            )
        ref_opt.step()
        ref_opt.zero_grad()
    run.weights = {name: t.weight.detach().clone() for name, t in ref_tables.items()}
    run.dense = reference.dense.weight.detach().clone()
    _UNSHARDED_RUNS[key] = run
    return run


def rank_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """One rank's loss over its own batch: the mean squared error, 0 for an empty batch
    (``sum / max(B, 1)``: finite, and every parameter still gets a (zero) gradient)."""
    return ((prediction - target) ** 2).sum() / max(target.numel(), 1)


def spacing(x: torch.Tensor) -> torch.Tensor:
    """The gap between ``x`` and the next representable value of its dtype (at least the
    smallest normal's), as fp32: the unit bf16 weights are compared in."""
    info = torch.finfo(x.dtype)
    exponent = torch.frexp(x.float().abs().clamp_min(info.tiny)).exponent
    return torch.ldexp(torch.full_like(x, info.eps, dtype=torch.float32), exponent - 1)


def fused_reference_update(
    model: TinyModel,
    tables: list[dtrec.EmbeddingBagConfig],
    fused: dtrec.optim.FusedOptimizer,
    state: dict[str, dict[str, torch.Tensor]],
    batches: list[dtrec.KeyedJaggedTensor],
    dtype: torch.dtype = torch.float32,
) -> None:
    """The unsharded model's fused step: the update rule on rows the global batch touched,
    in fp32, the weights then rounded to ``dtype`` (as the sharded tables store them)."""
    for cfg in tables:
        weight = model.sparse.embedding_bags[cfg.name].weight
        ids = torch.cat([b[f].values() for b in batches for f in cfg.feature_names])
        rows = torch.unique(ids.long())
        grad = torch.zeros_like(weight) if weight.grad is None else weight.grad
        with torch.no_grad():  # also without rows (empty batches): the sharded tables step
            fused.update_rows(weight, state[cfg.name], rows, grad[rows].float())
            weight.copy_(weight.to(dtype).float())
        weight.grad = None
