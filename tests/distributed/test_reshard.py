"""``dtrec.reshard``: exact continuation on the new plan, only moved rows on the wire.

One world of 4 gloo ranks runs every case. A case trains a model 2 steps on plan A
(a StepLR scheduler halving the fused optimizer's lr each step), reshards it to plan B,
trains 2 more steps, and compares its weights and fused state with

* the same model distributed directly to plan B from A's weights, state and param groups
  after step 2 (a scheduler of its own), trained the same 2 steps: equal to 1e-6
  relative (and counted bitwise);
* the unsharded model trained all 4 steps on the global batch by the rule's own math.

Plan pairs: every ordered pair of TW, RW, CW, DP (a Latin square over four tables, plus
same-type moves TW(0)->TW(1), CW -> CW over positions (1, 2)), and random pairs drawn
from a seeded generator, with SGD, RowWiseAdagrad and Adam, on the 4 x 1 mesh and on
the 2 x 2 mesh; table-row-wise and grid to and from the others on a node-aware 4 x 1 mesh
(2 nodes of 2 positions, TRW(0) -> TRW(1) too) and a node-aware 2 x 2 one (replicas
across nodes). The bytes each reshard sent (``dtrec.comm_stats``' ``reshard.rows``,
summed over the world) must equal the bytes of the cells whose set of holders grew,
counted cell by cell from the two plans' blocks.

The same plan pairs with the tables trained by a torch optimizer (SGD with momentum,
Adam, each also ``foreach=True``; Adagrad on some): the optimizer object passed to
``reshard(..., optimizers=[opt])`` goes on, its params and state keys the new tables
and its state moved (only moved cells sent), bitwise equal to a model distributed to
plan B with that state loaded, and within 1e-5 of the unsharded model.

Quantized communication (``QCOMMS_CASES``: bf16 forward and replica sums, fp16 gradients):
the config moves with the model, bitwise the model distributed to plan B with it.

Offloaded tables (``"RW@4"``: behind a cache of 4 rows per block) onto, off and between
host tiers, resharded with their caches as training left them; every case's
``model.sharding_plan`` prints as the directly distributed model's (the planner's report
of the new layout). Refusals before anything moves (the model unchanged): among them
FSDP2 / TP dense layers given a new mesh, a dense optimizer left out, a target that fits
the memory budget at rest but not the move's peak.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import random

import pytest

from tests.multiprocess import error_of, run_world

WORLD = 4
BATCH = 3
LR = {"sgd": 0.5, "rowwise_adagrad": 0.2, "adam": 0.05}
TABLES = [  # (name, rows, dim, pooling): uneven rows and columns; t2 has fewer rows than S
    ("t0", 13, 8, "sum"),
    ("t1", 10, 6, "mean"),
    ("t2", 3, 4, "sum"),
    ("t3", 17, 5, "sum"),
]


def _types(shard: int) -> list[str]:
    return ["TW(0)", "RW", "CW", "DP"] if shard == 4 else ["TW(1)", "RW", "CW", "DP"]


def _cases() -> dict[str, tuple[int, list[str], list[str]]]:
    """name -> (shard group size, plan A, plan B) as spec strings per table."""
    cases = {}
    for shard in (4, 2):
        types = _types(shard)
        for k in range(4):  # t gets types[t] then types[t + k]: all 16 ordered pairs
            a = types
            b = [types[(t + k) % 4] for t in range(4)]
            if k == 0:  # same-type moves
                b = [
                    "TW(0)" if shard == 2 else "TW(1)",
                    "RW",
                    "CW(0)" if shard == 2 else "CW(1,2)",
                    "DP",
                ]
            cases[f"s{shard}_shift{k}"] = (shard, a, b)
    # node-aware: S = 4 in 2 nodes of 2 positions (a 1-D mesh built with node_size=2)
    cases["n4_shift"] = ("4n2", ["TRW(0)", "GRID", "TW(1)", "DP"],
                         ["GRID", "TRW(1)", "TRW(0)", "GRID"])  # fmt: skip
    cases["n4_back"] = ("4n2", ["RW", "CW", "GRID", "TRW(1)"],
                        ["TRW(1)", "TRW(0)", "CW(0,3)", "RW"])  # fmt: skip
    cases["n4_same"] = ("4n2", ["TRW(0)", "DP", "GRID", "TRW(1)"],
                        ["TRW(1)", "GRID", "DP", "TRW(0)"])  # fmt: skip
    # and 2-D: S = 2 on one node of 2 positions, the replicas across nodes
    cases["n2_2d"] = ("2n2", ["TRW(0)", "GRID", "TW(1)", "DP"], ["GRID", "RW", "TRW(0)", "CW"])
    gen = random.Random(44)
    pool = {4: ["TW(0)", "TW(1)", "TW(3)", "RW", "CW", "CW(0,2)", "CW(3)", "DP"],
            2: ["TW(0)", "TW(1)", "RW", "CW", "CW(1)", "DP"]}  # fmt: skip
    for shard, count in ((4, 3), (2, 1)):
        for i in range(count):
            a = [gen.choice(pool[shard]) for _ in TABLES]
            b = [gen.choice(pool[shard]) for _ in TABLES]
            cases[f"s{shard}_random{i}"] = (shard, a, b)
    return cases


CASES = _cases()


def _mesh_cases() -> dict[str, tuple[object, object, list[str], list[str]]]:
    """name -> (mesh key before, mesh key after, plan A, plan B): the shard group size
    changes (4 x 1 <-> 2 x 2: 1-D <-> 2-D), or the ranks' places (2 x 2 with replicas
    within a node -> across nodes), or the node split; every type pair across them."""
    four, two = _types(4), _types(2)
    cases: dict[str, tuple[object, object, list[str], list[str]]] = {}
    for k in range(4):
        cases[f"m4to2_shift{k}"] = (4, 2, four, [two[(t + k) % 4] for t in range(4)])
        cases[f"m2to4_shift{k}"] = (2, 4, two, [four[(t + k) % 4] for t in range(4)])
    cases["m2to2n2"] = (2, "2n2", two, ["TRW(0)", "GRID", "CW", "TW(1)"])
    cases["m4n2to2"] = ("4n2", 2, ["TRW(0)", "GRID", "TW(1)", "DP"], ["RW", "TW(0)", "CW", "DP"])
    gen = random.Random(4402)
    pool = {4: ["TW(0)", "TW(3)", "RW", "CW", "CW(0,2)", "DP"],
            2: ["TW(0)", "TW(1)", "RW", "CW", "CW(1)", "DP"]}  # fmt: skip
    for i, (src, dst) in enumerate(((4, 2), (2, 4))):
        a = [gen.choice(pool[src]) for _ in TABLES]
        b = [gen.choice(pool[dst]) for _ in TABLES]
        cases[f"m_random{i}"] = (src, dst, a, b)
    return cases


MESH_CASES = _mesh_cases()
SEQUENCE_CASES = {  # name -> (mesh before, mesh after, plan A, plan B) of an EmbeddingCollection
    "q4_shift1": (4, 4, _types(4), _types(4)[1:] + _types(4)[:1]),
    "q2_shift2": (2, 2, _types(2), _types(2)[2:] + _types(2)[:2]),
    "q4to2": (4, 2, _types(4), ["RW", "CW", "DP", "TW(1)"]),
    "q2to4": (2, 4, _types(2), ["CW(0,2)", "DP", "TW(3)", "RW"]),
}
OFFLOAD_CASES = {  # name -> (mesh before, mesh after, plan A, plan B): "@n" offloaded
    # onto, off and between host tiers (LRU caches that evict, and caches of whole blocks);
    # the caches are as small as the batches' distinct rows per block allow
    "o4_in": (4, 4, ["TW(0)", "RW", "CW", "DP"], ["CW@12", "TW(2)@10", "RW@1", "TW(1)@16"]),
    "o4_out": (4, 4, ["TW(1)@12", "RW@4", "CW@3", "CW@16"], ["RW", "TW(3)", "DP", "TW(0)"]),
    "o2_between": (
        2,
        2,
        ["TW(0)@0.7", "RW@5", "CW@3", "TW(1)@11"],
        ["RW@6", "CW@9", "TW(1)@3", "RW@7"],
    ),  # fmt: skip
    "o4to2": (4, 2, ["CW@12", "TW(2)@10", "RW", "TW(0)@16"], ["TW(1)@9", "RW@5", "CW@3", "CW@11"]),
}
RULES = ("sgd", "rowwise_adagrad", "adam")
QCOMMS = {"forward_precision": "bf16", "backward_precision": "fp16",
          "replica_sync_precision": "bf16"}  # fmt: skip
QCOMMS_CASES = {  # name -> (mesh before, mesh after, plan A, plan B), with QCOMMS
    "c4_shift1": (4, 4, _types(4), _types(4)[1:] + _types(4)[:1]),
    "c4to2": (4, 2, _types(4), ["RW", "CW", "DP", "TW(1)"]),
    "c2to4": (2, 4, ["RW", "RW", "CW", "TW(1)"], ["CW(0,2)", "DP", "TW(3)", "RW"]),
}
PEAK_FITS = 1e4
"""A memory per rank that holds the errors case's move of t0 to row-wise at its peak."""
CHUNK_BYTES = {2: 96}  # to the 2 x 2 mesh: rounds of at most 24 bytes per peer (4 ranks)
DENSE_LR = 0.05


def _spec(text: str):
    """A spec from its short name; ``"<spec>@<n>"``: offloaded behind a cache of n rows per
    block (``"@0.5"``: of half of each block's rows)."""
    from dtrec.placements import ColumnWise, DataParallel, Grid, RowWise, TableRowWise, TableWise

    if "@" in text:
        text, cache = text.split("@")
        key = "cache_fraction" if "." in cache else "cache_rows"
        value = float(cache) if "." in cache else int(cache)
        return dataclasses.replace(_spec(text), **{key: value})
    if text.startswith("TRW"):
        return TableRowWise(node=int(text[4:-1]))
    if text == "GRID":
        return Grid()
    if text.startswith("TW"):
        return TableWise(rank=int(text[3:-1]))
    if text.startswith("CW("):
        return ColumnWise(positions=tuple(int(p) for p in text[3:-1].split(",")))
    return {"RW": RowWise(), "CW": ColumnWise(), "DP": DataParallel()}[text]


def _plan(specs: list[str]) -> dict:
    return {f"sparse.{t[0]}": _spec(s) for t, s in zip(TABLES, specs, strict=True)}


def _configs(sequence: bool = False):
    import dtrec

    if sequence:
        return [dtrec.EmbeddingConfig(n, r, d, [f"f{n[1:]}"]) for n, r, d, _ in TABLES]
    return [dtrec.EmbeddingBagConfig(n, r, d, [f"f{n[1:]}"], p) for n, r, d, p in TABLES]


def _model(dense: bool = False, sequence: bool = False):
    """The four tables (an EmbeddingBagCollection, or with ``sequence`` an
    EmbeddingCollection: one scalar per id then); ``dense``: times a dense scale."""
    import torch
    from torch import nn

    import dtrec

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if sequence:
                self.sparse = dtrec.EmbeddingCollection(_configs(True))
            else:
                self.sparse = dtrec.EmbeddingBagCollection(_configs())
            if dense:
                self.scale = nn.Parameter(torch.ones(sum(t[2] for t in TABLES)))

        def forward(self, kjt):
            if sequence:
                out = self.sparse(kjt)
                return torch.cat([
                    (out[f].values() * torch.linspace(-1.0, 1.0, out[f].values().shape[1])).sum(1)
                    for f in sorted(out)
                ])  # fmt: skip
            values = self.sparse(kjt).values()
            return values * self.scale if dense else values

    torch.manual_seed(0)
    model = Model()
    with torch.no_grad():  # weights of a magnitude Adam's steps do not swamp
        for p in model.parameters():
            p.normal_()
    return model


def _batches(step: int) -> list:
    """Every rank's batch of this step."""
    import torch

    import dtrec

    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(WORLD):
        keys, values, lengths = [], [], []
        for name, rows, _, _ in TABLES:
            ls = torch.randint(1, 4, (BATCH,), generator=gen)
            keys.append(f"f{name[1:]}")
            lengths.append(ls)
            values.append(torch.randint(0, rows, (int(ls.sum()),), generator=gen))
        kjt = dtrec.KeyedJaggedTensor(keys, torch.cat(values), torch.cat(lengths))
        out.append((kjt, torch.randn(BATCH, generator=gen)))
    return out


def _loss(out, target):
    import torch

    if out.dim() == 1:  # a sequence model's one scalar per id
        return ((out - 0.5) ** 2).mean()
    coef = torch.linspace(-1.0, 1.0, out.shape[1])
    return (((out * coef).sum(1) - target) ** 2).mean()


def _rule(name: str):
    import dtrec

    return {
        "sgd": dtrec.optim.SGD,
        "rowwise_adagrad": dtrec.optim.RowWiseAdagrad,
        "adam": dtrec.optim.Adam,
    }[name](lr=LR[name])


def _dense_optimizer(model):
    """A torch Adam (foreach) over the dense scale, or None without one."""
    import torch

    if not hasattr(model, "scale"):
        return None
    return torch.optim.Adam([model.scale], lr=DENSE_LR, foreach=True)


def _train(model, steps: range, scheduler, dense=None) -> None:
    import torch.distributed as dist

    for step in steps:
        kjt, target = _batches(step)[dist.get_rank()]
        _loss(model(kjt), target).backward()
        model.fused_optimizer.step()
        scheduler.step()
        if dense is not None:
            dense.step()
            dense.zero_grad()


def _is_table(key: str) -> bool:
    return ".embedding_bags." in key or ".embeddings." in key


def _dense_state(model, optimizer, out: dict) -> None:
    """The dense scale and its torch optimizer state into ``out`` (no collective: every
    rank holds them whole)."""
    from torch.distributed.tensor import DTensor

    if optimizer is None:
        return
    value = model.scale
    local = value.to_local() if isinstance(value, DTensor) else value
    out["scale"] = local.detach().float().clone()  # a copy: the optimizer steps in place
    for key, v in optimizer.state[value].items():
        local = v.to_local() if isinstance(v, DTensor) else v
        out[f"scale.{key}"] = local.detach().float().clone()


def _full_state(model, dense=None) -> dict:
    """Full weights and fused state (scalars: the largest over ranks), and the dense part's
    with its optimizer ``dense``. Collective."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from dtrec.checkpoint import to_full_state_dict

    gathered = {k: v for k, v in model.state_dict().items() if _is_table(k)}
    scalars = {}
    for table, entries in model.fused_optimizer.state_dict()["state"].items():
        for name, value in entries.items():
            if isinstance(value, DTensor):
                gathered[f"{table}.{name}"] = value
            else:
                scalars[f"{table}.{name}"] = value.detach().float().clone()
    out = {k: v.float() for k, v in to_full_state_dict(gathered).items()}  # one gather
    _dense_state(model, dense, out)
    if scalars:  # the largest over ranks, all in one all-reduce
        stacked = torch.stack(list(scalars.values()))
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
        out.update(zip(scalars, stacked.unbind()))
    return out


def _tables_of(model):
    sparse = model.sparse
    return sparse.embeddings if hasattr(sparse, "embeddings") else sparse.embedding_bags


@functools.cache
def _reference(rule_name: str, steps: int, dense: bool = False, sequence: bool = False) -> dict:
    """The unsharded model, the rule's math on the rows the global batch touched (the dense
    scale: torch Adam on the mean of the ranks' losses). Computed once per arguments in a
    rank: callers only read it."""
    import torch

    model = _model(dense, sequence)
    dense_optimizer = _dense_optimizer(model)
    rule = _rule(rule_name)
    bags = _tables_of(model)
    attr = "embeddings" if sequence else "embedding_bags"
    state = {name: rule.init_state(bags[name].weight) for name, *_ in TABLES}
    for step in range(steps):
        lr_rule = rule.with_hyperparameters({"lr": LR[rule_name] * 0.5**step})
        batches = _batches(step)
        loss = sum(_loss(model(kjt), target) for kjt, target in batches) / WORLD
        loss.backward()
        for name, *_ in TABLES:
            weight = bags[name].weight
            rows = torch.unique(torch.cat([kjt[f"f{name[1:]}"].values() for kjt, _ in batches]))
            with torch.no_grad():
                lr_rule.update_rows(weight, state[name], rows, weight.grad[rows].float())
            weight.grad = None
        if dense_optimizer is not None:
            dense_optimizer.step()
            dense_optimizer.zero_grad()
    out = {f"sparse.{attr}.{n}.weight": bags[n].weight.detach().clone() for n, *_ in TABLES}
    _dense_state(model, dense_optimizer, out)
    for name, *_ in TABLES:
        for entry, value in state[name].items():
            out[f"sparse.{name}.{entry}"] = value.float()
    return out


def _axis(shard):
    """The ShardAxis of a case's mesh key: S (an int), or "<S>n<node size>" (node-aware)."""
    from dtrec.placements.mesh import ShardAxis

    if isinstance(shard, str):
        size, per_node = (int(x) for x in shard.split("n"))
        return ShardAxis(size, WORLD // size, per_node)
    return ShardAxis(shard, WORLD // shard, None)


def _expected_bytes(
    meshes: dict, shard, a: list[str], b: list[str], rule_name: str, to=None
) -> int:
    """Bytes the world sends: per cell (a row, for row state), one copy to each rank that
    holds it after (on mesh ``to``, default: the same) and did not before."""
    import dtrec

    to = shard if to is None else to
    axis, new_axis = _axis(shard), _axis(to)
    ranks, new_ranks = meshes[shard].mesh.tolist(), meshes[to].mesh.tolist()
    kinds = {"weight": "weight", **_rule(rule_name).state_layout()}
    total = 0
    for (name, rows, dim, pooling), sa, sb in zip(TABLES, a, b, strict=True):
        cfg = dtrec.EmbeddingBagConfig(name, rows, dim, [f"f{name[1:]}"], pooling)
        old, new = _spec(sa).layout(cfg, axis).blocks, _spec(sb).layout(cfg, new_axis).blocks
        for kind in kinds.values():
            if kind == "scalar":
                continue
            cols = range(dim) if kind == "weight" else range(1)
            for r in range(rows):
                for c in cols:

                    def holds(block, r=r, c=c, kind=kind):
                        inside = block.rows[0] <= r < block.rows[1]
                        return inside and (kind == "row" or block.cols[0] <= c < block.cols[1])

                    had = {r for blk in old if holds(blk) for r in ranks[blk.position]}
                    has = {r for blk in new if holds(blk) for r in new_ranks[blk.position]}
                    total += len(has - had) * 4
    return total


def _blocks_match(model) -> bool:
    """Whether this rank's block of every table is its cells of the full table (every
    replica received its copy: ``full_tensor`` alone reads one replica). Collective."""
    import torch

    from dtrec.checkpoint import full_tensor

    ok = True
    for table in _tables_of(model).values():
        full = full_tensor(table.weight)
        if table.block is not None:
            (r0, r1), (c0, c1) = table.block.rows, table.block.cols
            ok = ok and torch.equal(table.weight.to_local(), full[r0:r1, c0:c1])
    return ok


def _max_rel(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(
        ((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-6)).item()
        if a[k].numel()
        else 0.0
        for k in a
    )


def _copy_into(direct, before: dict, dense) -> None:
    """The tables' and the dense scale's values and the dense optimizer's state of
    ``before`` into the unsharded ``direct`` (``dense``: its dense optimizer, built on the
    distributed ``direct`` afterwards by ``_load_dense``)."""
    import torch

    attr = "embeddings" if hasattr(direct.sparse, "embeddings") else "embedding_bags"
    with torch.no_grad():
        for name, *_ in TABLES:
            _tables_of(direct)[name].weight.copy_(before[f"sparse.{attr}.{name}.weight"])
        if dense:
            direct.scale.copy_(before["scale"])


def _load_dense(direct, before: dict):
    """A dense optimizer of the distributed ``direct`` holding ``before``'s state."""
    from dtrec.sharded.dense import as_replicated_dtensor

    optimizer = _dense_optimizer(direct)
    if optimizer is None:
        return None
    mesh = direct.scale.device_mesh
    optimizer.state[direct.scale] = {
        key[len("scale.") :]: value.clone()
        if value.dim() == 0
        else as_replicated_dtensor(value.clone(), mesh)
        for key, value in before.items()
        if key.startswith("scale.")
    }
    return optimizer


def _one_case(
    meshes: dict,
    shard,
    a: list[str],
    b: list[str],
    rule_name: str,
    to=None,
    sequence=False,
    qcomms=None,
    keep_after=False,
) -> dict:
    """Plan A on mesh ``shard``, 2 steps, reshard to plan B (on mesh ``to``: with a dense
    scale trained by a torch Adam, which follows), 2 steps; vs a model distributed there
    (both with ``qcomms``, a ``dtrec.QCommsConfig``'s fields, if given; ``keep_after``:
    the state after the 4 steps comes back too, as ``"after"``)."""
    import torch
    import torch.distributed as dist
    from torch.optim.lr_scheduler import StepLR

    import dtrec

    to = shard if to is None else to
    dense = to != shard and not sequence
    mesh = meshes[to]
    q = None if qcomms is None else dtrec.QCommsConfig(**qcomms)
    model = dtrec.distribute_module(
        _model(dense, sequence), meshes[shard], _plan(a), optimizer=_rule(rule_name), qcomms=q
    )
    dense_optimizer = _dense_optimizer(model)
    scheduler = StepLR(model.fused_optimizer, step_size=1, gamma=0.5)
    _train(model, range(2), scheduler, dense_optimizer)
    if any("@" in spec for spec in a):  # offloaded: read a copy, so that the reshard
        before = _full_state(copy.deepcopy(model))  # finds its caches as training left them
        _dense_state(model, dense_optimizer, before)  # (reading the model flushes them)
    else:
        before = _full_state(model, dense_optimizer)
    groups = model.fused_optimizer.saved_param_groups()
    sparse = model.sparse
    moves = {} if to == shard else {"mesh": mesh}
    if dense_optimizer is not None:
        moves["optimizers"] = [dense_optimizer]
    with dtrec.comm_stats() as stats:
        returned = dtrec.reshard(
            model, _plan(b), chunk_bytes=CHUNK_BYTES.get(to, 64 << 20), **moves
        )
    sent = torch.tensor([stats.bytes_sent.get("reshard.rows", 0)], dtype=torch.long)
    dist.all_reduce(sent)
    moved_exact = _max_rel(_full_state(model, dense_optimizer), before)  # the move: no change
    every_copy = _blocks_match(model)
    plan_ok = all(model.sharding_plan[k] == v for k, v in _plan(b).items())
    on_mesh = model.sparse.mesh is mesh and (not dense or model.scale.device_mesh is mesh)
    _train(model, range(2, 4), scheduler, dense_optimizer)
    after = _full_state(model, dense_optimizer)

    direct = _model(dense, sequence)
    _copy_into(direct, before, dense)
    direct = dtrec.distribute_module(direct, mesh, _plan(b), optimizer=_rule(rule_name), qcomms=q)
    direct_dense = _load_dense(direct, before)
    state: dict = {f"sparse.{name}": {} for name, *_ in TABLES}
    for key, value in before.items():
        if not _is_table(key) and not key.startswith("scale"):
            table, entry = key.rsplit(".", 1)
            state.setdefault(table, {})[entry] = value
    direct.fused_optimizer.load_state_dict({"state": state, "param_groups": groups})
    scheduler = StepLR(direct.fused_optimizer, step_size=1, gamma=0.5)
    _train(direct, range(2, 4), scheduler, direct_dense)
    expected = _full_state(direct, direct_dense)
    return {
        "vs_direct": _max_rel(after, expected),
        "bitwise": all(torch.equal(after[k], expected[k]) for k in after),
        "vs_unsharded": _max_rel(after, _reference(rule_name, 4, dense, sequence)),
        "moved_exact": moved_exact,
        "bytes": int(sent),
        "rounds": stats.calls.get("reshard.rows", 0),
        "expected_bytes": _expected_bytes(meshes, shard, a, b, rule_name, to),
        "same_objects": returned is model and model.sparse is sparse,
        "plan": plan_ok,
        # the planner's report of the new layout, as the model distributed there carries
        "report": str(model.sharding_plan) == str(direct.sharding_plan),
        "on_mesh": on_mesh and every_copy,
        "lr": model.fused_optimizer.param_groups[0]["lr"],
        "qcomms": model.sparse.qcomms == q,
        **({"after": after} if keep_after else {}),
    }


TORCH_RULES = {  # name -> (torch.optim class name, its arguments)
    "sgd": ("SGD", {"lr": 0.5, "momentum": 0.9}),
    "sgd_foreach": ("SGD", {"lr": 0.5, "momentum": 0.9, "foreach": True}),
    "adam": ("Adam", {"lr": 0.05}),
    "adam_foreach": ("Adam", {"lr": 0.05, "foreach": True}),
    "adagrad": ("Adagrad", {"lr": 0.2}),
}
TORCH_ENTRIES = {"sgd": 1, "sgd_foreach": 1, "adam": 2, "adam_foreach": 2, "adagrad": 1}
"""Table-shaped state entries of each (momentum_buffer; exp_avg, exp_avg_sq; sum)."""
TORCH_CASES = {  # case -> the torch optimizers it runs with
    case: ("sgd", "sgd_foreach", "adam", "adam_foreach")
    + (("adagrad",) if case.endswith("shift1") else ())
    for case in CASES
}
TORCH_CASES.update(dict.fromkeys(MESH_CASES, ("sgd", "adam_foreach")))
TORCH_CASES.update(dict.fromkeys(SEQUENCE_CASES, ("adam_foreach",)))
ALL_CASES = {  # name -> (mesh before, mesh after, plan A, plan B, sequence collection)
    **{name: (shard, shard, a, b, False) for name, (shard, a, b) in CASES.items()},
    **{name: (src, dst, a, b, False) for name, (src, dst, a, b) in MESH_CASES.items()},
    **{name: (src, dst, a, b, True) for name, (src, dst, a, b) in SEQUENCE_CASES.items()},
    **{name: (src, dst, a, b, False) for name, (src, dst, a, b) in OFFLOAD_CASES.items()},
    # a sequence collection's offloaded tables (2 x 2: updates of rows the other replica read)
    "qo2_between": (2, 2, *OFFLOAD_CASES["o2_between"][2:], True),
}


def _torch_optimizer(name: str, params):
    import torch

    kind, kwargs = TORCH_RULES[name]
    return getattr(torch.optim, kind)(params, **kwargs)


def _train_torch(model, optimizer, steps: range, scheduler, world: bool = False) -> None:
    """Steps of a torch optimizer; ``world``: the unsharded model on the global batch."""
    import torch.distributed as dist

    for step in steps:
        optimizer.zero_grad()
        batches = _batches(step)
        if world:
            loss = sum(_loss(model(kjt), target) for kjt, target in batches) / WORLD
        else:
            kjt, target = batches[dist.get_rank()]
            loss = _loss(model(kjt), target)
        loss.backward()
        optimizer.step()
        scheduler.step()


def _torch_state(model, optimizer) -> dict:
    """Full weights and torch optimizer state of the tables (scalars: the largest over
    ranks; an unsharded model's as they are). Collective for a distributed model."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from dtrec.checkpoint import to_full_state_dict

    bags = _tables_of(model)
    attr = "embeddings" if hasattr(model.sparse, "embeddings") else "embedding_bags"
    out = {}
    if hasattr(model, "scale"):
        _dense_state(model, optimizer, out)
    gathered, scalars = {}, {}
    for name, *_ in TABLES:
        weight = bags[name].weight
        gathered[f"sparse.{attr}.{name}.weight"] = weight
        for key, value in sorted(optimizer.state[weight].items()):
            if isinstance(value, DTensor):
                gathered[f"sparse.{name}.{key}"] = value
            elif isinstance(value, torch.Tensor):
                scalars[f"sparse.{name}.{key}"] = (value.detach().float().clone(), weight)
    out.update({k: v.float() for k, v in to_full_state_dict(gathered).items()})  # one gather
    for key, (scalar, weight) in scalars.items():
        if isinstance(weight, DTensor):
            dist.all_reduce(scalar, op=dist.ReduceOp.MAX)
        out[key] = scalar
    return out


def _load_torch_state(model, optimizer, state: dict) -> None:
    """Put full torch optimizer state (``_torch_state``'s) into a distributed model's
    optimizer: each rank's block of it, as DTensors placed like their tables."""

    from dtrec.sharded.dense import as_replicated_dtensor
    from dtrec.sharded.tables.tensor import like_dtensor

    if hasattr(model, "scale"):
        mesh = model.scale.device_mesh
        optimizer.state[model.scale] = {
            key[len("scale.") :]: value.clone()
            if value.dim() == 0
            else as_replicated_dtensor(value.clone(), mesh)
            for key, value in state.items()
            if key.startswith("scale.")
        }
    for name, *_ in TABLES:
        table = _tables_of(model)[name]
        entries = {}
        for key, value in state.items():
            if not key.startswith(f"sparse.{name}.") or _is_table(key):
                continue
            entry = key.rsplit(".", 1)[1]
            if value.dim() == 0:
                entries[entry] = value.clone()
                continue
            local = table.weight.detach().to_local().clone()
            if table.block is not None:
                (r0, r1), (c0, c1) = table.block.rows, table.block.cols
                local.copy_(value[r0:r1, c0:c1])
            entries[entry] = like_dtensor(local, table.weight)
        optimizer.state[table.weight] = entries


def _one_torch_case(
    meshes: dict, shard, a: list[str], b: list[str], name: str, to=None, sequence=False
) -> dict:
    """A case with the tables trained by a torch optimizer: the same object goes on after
    the reshard; compared with a model distributed to plan B with that optimizer's state
    loaded, and with the unsharded model trained by the same optimizer. To another mesh
    (``to``): with a dense scale the same optimizer trains, which follows."""
    import torch
    import torch.distributed as dist
    from torch.optim.lr_scheduler import StepLR

    import dtrec

    to = shard if to is None else to
    dense = to != shard and not sequence
    mesh = meshes[to]
    model = dtrec.distribute_module(_model(dense, sequence), meshes[shard], _plan(a))
    optimizer = _torch_optimizer(name, model.parameters())
    scheduler = StepLR(optimizer, step_size=1, gamma=0.5)
    _train_torch(model, optimizer, range(2), scheduler)
    before = _torch_state(model, optimizer)
    lr = optimizer.param_groups[0]["lr"]
    with dtrec.comm_stats() as stats:
        dtrec.reshard(
            model, _plan(b), chunk_bytes=CHUNK_BYTES.get(to, 64 << 20), optimizers=[optimizer],
            mesh=None if to == shard else mesh,
        )  # fmt: skip
    sent = torch.tensor([stats.bytes_sent.get("reshard.rows", 0)], dtype=torch.long)
    dist.all_reduce(sent)
    params = list(model.parameters())
    held = optimizer.param_groups[0]["params"]
    repointed = (
        len(held) == len(params)
        and all(x is y for x, y in zip(held, params, strict=True))
        and all(p in optimizer.state for p in params)
        and len(optimizer.state) == len(params)
    )
    moved_exact = _max_rel(_torch_state(model, optimizer), before)
    _train_torch(model, optimizer, range(2, 4), scheduler)
    after = _torch_state(model, optimizer)

    direct = _model(dense, sequence)
    _copy_into(direct, before, dense)
    direct = dtrec.distribute_module(direct, mesh, _plan(b))
    direct_optimizer = _torch_optimizer(name, direct.parameters())
    direct_optimizer.param_groups[0]["lr"] = lr
    _load_torch_state(direct, direct_optimizer, before)
    direct_scheduler = StepLR(direct_optimizer, step_size=1, gamma=0.5)
    _train_torch(direct, direct_optimizer, range(2, 4), direct_scheduler)
    expected = _torch_state(direct, direct_optimizer)

    unsharded = _model(dense, sequence)
    plain_optimizer = _torch_optimizer(name, unsharded.parameters())
    plain_scheduler = StepLR(plain_optimizer, step_size=1, gamma=0.5)
    _train_torch(unsharded, plain_optimizer, range(4), plain_scheduler, world=True)
    return {
        "vs_direct": _max_rel(after, expected),
        "bitwise": all(torch.equal(after[k], expected[k]) for k in after),
        "vs_unsharded": _max_rel(after, _torch_state(unsharded, plain_optimizer)),
        "moved_exact": moved_exact,
        "repointed": repointed,
        "state_keys": sorted(k for k in after if not _is_table(k) and not k.startswith("scale")),
        "bytes": int(sent),  # the weight and each table-shaped state entry, moved cells
        "expected_bytes": _expected_bytes(meshes, shard, a, b, "sgd", to)
        * (1 + TORCH_ENTRIES[name]),
        "on_mesh": model.sparse.mesh is mesh and (not dense or model.scale.device_mesh is mesh),
        "report": str(model.sharding_plan) == str(direct.sharding_plan),
    }


def _refused(model, plan, before: dict, prepare=None, **kwargs) -> dict:
    """What ``reshard(model, plan)`` raised (type, message) and whether the model is
    unchanged: its weights and state, plan, collection and fused optimizer's tables."""
    import dtrec

    plan_before = dict(model.sharding_plan)
    params = list(model.fused_optimizer.param_groups[0]["params"])
    if prepare is not None:
        prepare()
    error = error_of(lambda: dtrec.reshard(model, plan, **kwargs))
    now = model.fused_optimizer.param_groups[0]["params"]
    unchanged = (
        _max_rel(_full_state(model), before) == 0.0
        and dict(model.sharding_plan) == plan_before
        and len(now) == len(params)
        and all(x is y for x, y in zip(now, params, strict=True))
    )
    return {"error": error, "unchanged": unchanged}


def _errors(meshes: dict) -> dict:
    """Refused reshards, each before anything moved; the model then still trains."""
    import torch
    import torch.distributed as dist
    from torch.optim.lr_scheduler import StepLR

    import dtrec
    import dtrec.sharded.reshard.exchange as exchange
    from dtrec.placements import RowWise, TableRowWise, TableWise

    rank = dist.get_rank()
    a = ["TW(0)", "RW", "CW", "DP"]
    model = dtrec.distribute_module(_model(), meshes[4], _plan(a), optimizer=_rule("adam"))
    scheduler = StepLR(model.fused_optimizer, step_size=1, gamma=0.5)
    _train(model, range(1), scheduler)
    before = _full_state(model)
    out = {
        "unknown": _refused(model, {"sparse.t9": RowWise(), "sparse.t0": RowWise()}, before),
        "rank_off_mesh": _refused(model, {"sparse.t1": TableWise(rank=4)}, before),
        "unresolved": _refused(model, {"sparse.t1": TableWise()}, before),
        "node_aware": _refused(model, {"sparse.t3": TableRowWise(node=0)}, before),
        "fully_sharded": _refused(model, {"sparse.t0": RowWise(fully_sharded=True)}, before),
        "not_a_spec": _refused(model, {"sparse.t0": "RW"}, before),
        "disagree": _refused(model, {"sparse.t0": TableWise(rank=rank % 2)}, before),
        # every table data parallel: 3,132 bytes of weights and Adam moments on every
        # rank, over a budget of 1,800 (2,000 minus the 10% headroom)
        "memory": _refused(
            model, _plan(["DP"] * 4), before, topology=dtrec.Topology.cpu(memory_per_rank=2e3)
        ),
    }
    kjt, target = _batches(1)[rank]
    out["prefetched"] = _refused(
        model, {"sparse.t0": RowWise()}, before, lambda: model.sparse.prefetch(kjt)
    )
    _loss(model(kjt), target).backward()  # consumes the prefetched batch
    scheduler.step()
    before = _full_state(model)

    calls = []

    def failing(*args, **kwargs):  # a collective error in the middle of the move
        calls.append(1)
        if len(calls) == 2:
            raise dtrec.CollectiveError("rank died (simulated)")
        return real(*args, **kwargs)

    real, exchange.all_to_all = exchange.all_to_all, failing
    try:
        out["mid_move"] = _refused(
            model, {"sparse.t0": RowWise(), "sparse.t1": TableWise(rank=2)}, before,
            chunk_bytes=64,
        )  # fmt: skip
    finally:
        exchange.all_to_all = real
    # still trains, and a reshard after the failures works
    kjt, target = _batches(2)[rank]
    _loss(model(kjt), target).backward()
    # a target that fits the same budget at rest (1,656 bytes on rank 0), but not the move
    # to it: the old collection, the new one and the exchange buffers together
    before = _full_state(model)
    out["peak"] = _refused(
        model, {"sparse.t0": RowWise()}, before, topology=dtrec.Topology.cpu(memory_per_rank=2e3)
    )
    dtrec.reshard(  # a budget that holds the peak
        model, {"sparse.t0": RowWise()}, topology=dtrec.Topology.cpu(memory_per_rank=PEAK_FITS)
    )
    out["after"] = str(model.sharding_plan["sparse.t0"])
    # to another mesh: a spec the plan omits is kept and must fit the new mesh; meshes=
    # is checked as distribute_module checks it
    dtrec.reshard(model, {"sparse.t1": TableWise(rank=3)})
    before = _full_state(model)
    out["kept_spec_off_mesh"] = _refused(
        model, {"sparse.t0": TableWise(rank=1)}, before, mesh=meshes[2]
    )
    out["meshes_unknown"] = _refused(model, {}, before, meshes={"nope": meshes[2]})

    plain = dtrec.distribute_module(_model(), meshes[4], _plan(a))
    out["no_fused"] = {"error": error_of(lambda: dtrec.reshard(plain, {"sparse.t0": RowWise()}))}
    # offloaded tables train only with a fused optimizer and the per-step replica sync
    opt = torch.optim.Adam(plain.parameters(), lr=0.01)
    _train_torch(plain, opt, range(1), StepLR(opt, step_size=1))
    out["offloaded_torch_state"] = {
        "error": error_of(
            lambda: dtrec.reshard(plain, {"sparse.t1": RowWise(cache_rows=4)}, optimizers=[opt])
        )
    }
    # a dense optimizer left out of optimizers= while the tables' one is given
    split = dtrec.distribute_module(_model(dense=True), meshes[4], _plan(a))
    tables_opt = torch.optim.Adam(split.sparse.parameters(), lr=0.01)
    dense_opt = torch.optim.Adam([split.scale], lr=0.01)
    for optimizer in (tables_opt, dense_opt):
        _train_torch(split, optimizer, range(1), StepLR(optimizer, step_size=1))
    out["dense_left_out"] = {
        "error": error_of(
            lambda: dtrec.reshard(split, {}, mesh=meshes[2], optimizers=[tables_opt])
        ),
        "unchanged": split.scale.device_mesh is meshes[4] and split.sparse.mesh is meshes[4],
    }
    averaged = dtrec.distribute_module(
        _model(), meshes[2], _plan(a), optimizer=_rule("sgd"), sync_every=2
    )
    out["offloaded_sync_every"] = {
        "error": error_of(lambda: dtrec.reshard(averaged, {"sparse.t3": RowWise(cache_rows=4)}))
    }
    out["bad_optimizers"] = {
        "error": error_of(lambda: dtrec.reshard(plain, {"sparse.t0": RowWise()}, optimizers="adam"))
    }
    out["not_distributed"] = {"error": error_of(lambda: dtrec.reshard(_model(), {}))}
    return out


def _shapes(meshes: dict) -> dict:
    """Models of other shapes: the collection itself distributed (the model is the
    collection), and two collections of which only the second moves (its param group)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import dtrec
    from dtrec.placements import ColumnWise, RowWise, TableWise

    rank = dist.get_rank()
    out = {}
    torch.manual_seed(0)
    ebc = dtrec.EmbeddingBagCollection(_configs())
    root = dtrec.distribute_module(
        ebc, meshes[4], {"t0": TableWise(rank=1)}, optimizer=_rule("rowwise_adagrad")
    )
    kjt, target = _batches(0)[rank]
    _loss(root(kjt).values(), target).backward()
    root.eval()
    before = _full_state(root)
    dtrec.reshard(root, {"t0": RowWise(), "t2": ColumnWise()})
    out["root_exact"] = _max_rel(_full_state(root), before) == 0.0
    out["root_plan"] = str(root.sharding_plan["t0"]) + " " + str(root.sharding_plan["t2"])
    out["root_eval"] = not root.training and not any(m.training for m in root.modules())
    root.train()
    _loss(root(kjt).values(), target).backward()  # still trains

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sparse = dtrec.EmbeddingBagCollection(_configs()[:2])
            self.other = dtrec.EmbeddingBagCollection(_configs()[2:])

        def forward(self, kjt):
            return torch.cat([self.sparse(kjt).values(), self.other(kjt).values()], 1)

    torch.manual_seed(0)
    two = dtrec.distribute_module(Two(), meshes[2], optimizer=_rule("adam"))
    _loss(two(kjt), target).backward()
    first = list(two.fused_optimizer.param_groups[0]["params"])
    dtrec.reshard(two, {"other.t3": TableWise(rank=1), "other.t2": RowWise()})
    groups = two.fused_optimizer.param_groups
    tables = two.other.embedding_bags
    out["two_groups"] = all(
        a is b for a, b in zip(groups[0]["params"], first, strict=True)
    ) and all(
        a is b
        for a, b in zip(
            groups[1]["params"], [tables["t2"].weight, tables["t3"].weight], strict=True
        )
    )
    out["two_state"] = all(
        two.fused_optimizer.state[w]["exp_avg"] is two.other.fused_optimizer_state()[n]["exp_avg"]
        for n, w in (("t2", tables["t2"].weight), ("t3", tables["t3"].weight))
    )
    _loss(two(kjt), target).backward()

    # per-collection meshes: "other" alone to the 4 x 1 mesh, then every collection onto
    # one 2 x 2 mesh; a step after each bitwise that of a model distributed there
    out["per_collection"] = []
    for plan, moves in (
        ({"other.t2": TableWise(rank=3)}, {"meshes": {"other": meshes[4]}}),
        ({"other.t2": ColumnWise(), "sparse.t0": TableWise(rank=1)}, {"mesh": meshes[2]}),
    ):
        before = _full_state(two)
        groups = two.fused_optimizer.saved_param_groups()
        dtrec.reshard(two, plan, **moves)
        moved = _max_rel(_full_state(two), before) == 0.0
        torch.manual_seed(0)
        direct = Two()
        with torch.no_grad():
            for key, value in before.items():
                if _is_table(key):
                    direct.get_parameter(key).copy_(value)
        own = None if two.other.mesh is two.sparse.mesh else {"other": two.other.mesh}
        direct = dtrec.distribute_module(
            direct, two.sparse.mesh, dict(two.sharding_plan), _rule("adam"), meshes=own
        )
        state: dict = {}
        for key, value in before.items():
            if not _is_table(key):
                table, entry = key.rsplit(".", 1)
                state.setdefault(table, {})[entry] = value
        direct.fused_optimizer.load_state_dict({"state": state, "param_groups": groups})
        for model in (two, direct):
            _loss(model(kjt), target).backward()
        after, expected = _full_state(two), _full_state(direct)
        out["per_collection"].append(
            {
                "report": str(two.sharding_plan) == str(direct.sharding_plan)
                and (two.sharding_plan.report or two.sharding_plan.reports) is not None,
                "moved_exact": moved,
                "bitwise": all(torch.equal(after[k], expected[k]) for k in expected),
                "meshes": [two.sparse.mesh.mesh.tolist(), two.other.mesh.mesh.tolist()],
            }
        )
    return out


def _composed(meshes: dict) -> dict:
    """Dense layers that torch's parallelisms distribute do not follow ``mesh=``: FSDP2 on
    dtrec's 2 x 2 mesh (SPMD mode, after distribute_module) and TP before it are refused
    naming the parameter, the model unchanged; the tables still move with ``meshes=``
    (exact), and the FSDP model trains on."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import dtrec

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sparse = dtrec.EmbeddingBagCollection(_configs())
            self.mlp = nn.Sequential(nn.Linear(sum(t[2] for t in TABLES), 4))

        def forward(self, kjt):
            return self.mlp(self.sparse(kjt).values())

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = dtrec.distribute_module(Net(), meshes[2], _plan(_types(2)), optimizer=_rule("adam"))
    fully_shard(
        model.mlp, mesh=meshes[2], dp_mesh_dims=DataParallelMeshDims(("shard", "replicate"))
    )
    dense = torch.optim.Adam(model.mlp.parameters(), lr=DENSE_LR)
    kjt, target = _batches(0)[rank]
    _loss(model(kjt), target).backward()
    dense.step()
    before = _full_state(model)
    out = {
        "fsdp": _refused(model, {}, before, mesh=meshes[4], optimizers=[dense]),
    }
    dtrec.reshard(model, _plan(_types(4)), meshes={"sparse": meshes[4]})
    out["fsdp_tables_moved"] = _max_rel(_full_state(model), before) == 0.0
    kjt, target = _batches(1)[rank]
    _loss(model(kjt), target).backward()  # trains on: FSDP on its mesh, the tables on theirs
    dense.step()

    torch.manual_seed(0)
    net = Net()
    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    parallelize_module(net.mlp, tp, {"0": ColwiseParallel()})
    model = dtrec.distribute_module(net, meshes[4], _plan(_types(4)), optimizer=_rule("sgd"))
    out["tp"] = _refused(model, {}, _full_state(model), mesh=meshes[2], optimizers=[])
    return out


def _eval_offloaded(meshes: dict) -> dict:
    """A model without a fused optimizer (eval only: offloaded tables train only with one)
    moves its offloaded tables to other host tiers on another mesh (``optimizers=[]``):
    every table whole and equal, the same outputs."""
    import torch

    import dtrec
    from dtrec.checkpoint import full_state_dict

    rank = torch.distributed.get_rank()
    model = dtrec.distribute_module(_model(), meshes[4], _plan(["RW@4", "TW(1)@10", "CW", "DP"]))
    model.eval()
    kjt, _ = _batches(0)[rank]
    with torch.no_grad():
        before_out = model(kjt)
    before = full_state_dict(model)
    b = ["TW(1)@9", "RW@5", "RW@2", "CW@11"]
    dtrec.reshard(model, _plan(b), mesh=meshes[2], optimizers=[])
    after = full_state_dict(model)
    with torch.no_grad():
        after_out = model(kjt)
    return {
        "same_state": sorted(before) == sorted(after)
        and all(torch.equal(before[k], after[k]) for k in before),
        "out_rel": ((after_out - before_out).abs().max() / before_out.abs().max()).item(),
        "plan": all(model.sharding_plan[k] == v for k, v in _plan(b).items()),
        "on_mesh": model.sparse.mesh is meshes[2],
    }


def _counted(meshes: dict) -> dict:
    """``dtrec.IdCounters`` on a distributed model: 2 steps counted on every rank and summed
    over the world (vs the counts of every rank's known batches), a re-plan from them, the
    reshard to it, and a step after."""
    import torch
    import torch.distributed as dist
    from torch.optim.lr_scheduler import StepLR

    import dtrec

    model = dtrec.distribute_module(
        _model(), meshes[4], _plan(["TW(0)"] * 4), optimizer=_rule("rowwise_adagrad")
    )
    counters = dtrec.IdCounters(model, distinct_every=1)
    scheduler = StepLR(model.fused_optimizer, step_size=1, gamma=0.5)
    _train(model, range(2), scheduler)
    stats = counters.stats()
    expected = {}
    for name, *_ in TABLES:
        ids = [kjt[f"f{name[1:]}"].values() for step in range(2) for kjt, _ in _batches(step)]
        total = sum(len(x) for x in ids)
        distinct = sum(len(torch.unique(x)) for x in ids)
        expected[f"sparse.{name}"] = (
            total / (2 * WORLD),
            distinct / total,
            total / (2 * WORLD * BATCH),
        )
    got = {key: (s.ids_per_step, s.unique_ratio, s.pooling_factor) for key, s in stats.items()}
    new_plan = dtrec.plan(model, meshes[4], id_counters=counters)
    dtrec.reshard(model, new_plan)
    _train(model, range(2, 3), scheduler)
    counters.remove()
    return {
        "counts": got,
        "expected": expected,
        "replanned": {k: str(v) for k, v in new_plan.items()},
        "poor": {k: str(v) for k, v in _plan(["TW(0)"] * 4).items()},
        "plan": {k: str(v) for k, v in model.sharding_plan.items()},
        "rank": dist.get_rank(),
    }


def _torchrec_target(meshes: dict) -> dict:
    """A TorchRec ``ShardingPlan`` (built by its own helpers) as the target: mapped onto the
    mesh as ``distribute_module`` maps one, the move exact, training goes on; a UVM-caching
    entry moves its table into host memory behind a cache, exact; an entry dtrec has no
    kernel for (plain UVM) is a ValueError naming the table before anything moves."""
    from tests.interop.torchrec_or_skip import torchrec

    if torchrec is None:
        return {"skipped": True}
    import torch
    from torch.optim.lr_scheduler import StepLR
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.types import ShardingPlan

    import dtrec

    model = dtrec.distribute_module(
        _model(), meshes[4], _plan(["TW(0)", "RW", "CW", "DP"]), optimizer=_rule("adam")
    )
    scheduler = StepLR(model.fused_optimizer, step_size=1, gamma=0.5)
    _train(model, range(2), scheduler)
    before = _full_state(model)
    configs = [
        torchrec.EmbeddingBagConfig(
            name=n, num_embeddings=r, embedding_dim=d, feature_names=[f"f{n[1:]}"]
        )
        for n, r, d, _ in TABLES
    ]
    ebc = torchrec.EmbeddingBagCollection(configs, device=torch.device("meta"))

    def plan_of(per_table: dict) -> ShardingPlan:
        module_plan = sp.construct_module_sharding_plan(
            ebc, per_table, world_size=WORLD, local_size=WORLD, device_type="cpu"
        )
        return ShardingPlan({"sparse": module_plan})

    per_table = {
        "t0": sp.column_wise(ranks=[1, 3]),
        "t1": sp.table_wise(rank=2),
        "t2": sp.data_parallel(),
        "t3": sp.row_wise(),
    }
    dtrec.reshard(model, plan_of(per_table))
    moved = _max_rel(_full_state(model), before)
    plan = {k: repr(v) for k, v in model.sharding_plan.items()}
    _train(model, range(2, 3), scheduler)
    before = _full_state(model)  # UVM caching: the table offloaded (a fifth of its rows cached)
    dtrec.reshard(
        model, plan_of(per_table | {"t3": sp.row_wise(compute_kernel="fused_uvm_caching")})
    )
    cached = _max_rel(_full_state(model), before)
    bad = plan_of(per_table | {"t3": sp.row_wise(compute_kernel="fused_uvm")})
    return {
        "plan": plan,
        "moved_exact": moved,
        "cached": repr(model.sharding_plan["sparse.t3"]),
        "cached_exact": cached,
        "bad": error_of(lambda: dtrec.reshard(model, bad)),
    }


def _run_all(rank: int, world_size: int) -> dict:
    import dtrec

    meshes = {
        4: dtrec.init_mesh("cpu", 4),
        2: dtrec.init_mesh("cpu", 2),
        "4n2": dtrec.init_mesh("cpu", 4, node_size=2),
        "2n2": dtrec.init_mesh("cpu", 2, node_size=2, replicas_within_node=False),
    }
    out = {
        f"{name}-{rule}": _one_case(meshes, src, a, b, rule, dst, sequence)
        for name, (src, dst, a, b, sequence) in ALL_CASES.items()
        for rule in RULES
    }
    for name, (src, dst, a, b, sequence) in ALL_CASES.items():
        for rule in TORCH_CASES.get(name, ()):
            out[f"{name}-torch-{rule}"] = _one_torch_case(meshes, src, a, b, rule, dst, sequence)
    for name, (src, dst, a, b) in QCOMMS_CASES.items():
        got = _one_case(meshes, src, a, b, "rowwise_adagrad", dst, qcomms=QCOMMS, keep_after=True)
        fp32 = _one_case(meshes, src, a, b, "rowwise_adagrad", dst, keep_after=True)
        got["vs_fp32"] = _max_rel(got.pop("after"), fp32["after"])  # the precisions mattered
        out[f"{name}-qcomms"] = got
    out["errors"] = _errors(meshes)
    out["shapes"] = _shapes(meshes)
    out["composed"] = _composed(meshes)
    out["eval_offloaded"] = _eval_offloaded(meshes)
    out["counted"] = _counted(meshes)
    out["torchrec"] = _torchrec_target(meshes)
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(WORLD, _run_all, timeout=900)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_continuation_is_exact(results, case, rule):
    """Same mesh, another mesh (with a dense part that follows), a sequence collection:
    bitwise the model distributed to plan B directly, within 1e-5 of the unsharded one."""
    src, dst, a, b, _ = ALL_CASES[case]
    for rank, per_rank in enumerate(results):
        got = per_rank[f"{case}-{rule}"]
        where = f"rank {rank}, {a} on {src} -> {b} on {dst}"
        assert got["moved_exact"] == 0.0, where
        assert got["bitwise"] and got["vs_direct"] == 0.0, (where, got)
        assert got["vs_unsharded"] <= 1e-5, (where, got)
        assert got["same_objects"] and got["plan"] and got["on_mesh"], where
        assert got["report"], where
        assert got["lr"] == pytest.approx(LR[rule] * 0.5**4), where


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_only_moved_rows_travel(results, case, rule):
    got = results[0][f"{case}-{rule}"]
    assert got["bytes"] == got["expected_bytes"], ALL_CASES[case]


def test_small_chunks_take_rounds(results):
    """To the 2 x 2 mesh every round carries at most 24 bytes per pair of ranks (96 over
    4 ranks), so at most 4 x 3 x 24 over the world: a move of a few hundred bytes takes
    several all-to-alls (and ends exact, checked above)."""
    for case, (_, dst, _, _, _) in ALL_CASES.items():
        got = results[0][f"{case}-adam"]
        if dst == 2 and got["bytes"]:
            most = WORLD * (WORLD - 1) * 24  # world bytes per round
            assert got["rounds"] >= got["bytes"] / most, (case, got)


@pytest.mark.parametrize(
    "case, rule", [(case, rule) for case, rules in sorted(TORCH_CASES.items()) for rule in rules]
)
def test_torch_optimizer_continues_exactly(results, case, rule):
    """The user's torch optimizer object goes on after the reshard: its params and state
    keys are the new tables, its state moved; then bitwise what a model distributed to the
    new plan with that state does, and within 1e-5 of the unsharded model."""
    src, dst, a, b, _ = ALL_CASES[case]
    for rank, per_rank in enumerate(results):
        got = per_rank[f"{case}-torch-{rule}"]
        where = f"rank {rank}, {a} on {src} -> {b} on {dst}, {rule}"
        assert got["repointed"] and got["on_mesh"] and got["report"], where
        assert got["moved_exact"] == 0.0, where
        assert got["bitwise"] and got["vs_direct"] == 0.0, (where, got)
        assert got["vs_unsharded"] <= 1e-5, (where, got)
        expected = {"sgd": ["momentum_buffer"], "adam": ["exp_avg", "exp_avg_sq", "step"],
                    "adagrad": ["step", "sum"]}[rule.split("_")[0]]  # fmt: skip
        assert got["bytes"] == got["expected_bytes"], where
        assert got["state_keys"] == sorted(
            f"sparse.{t[0]}.{k}" for t in TABLES for k in expected
        ), where


ERRORS = {  # case -> words its error names
    "unknown": ["KeyError", "sparse.t9"],
    "rank_off_mesh": ["ValueError", "sparse.t1", "TableWise(rank=4)"],
    "unresolved": ["ValueError", "sparse.t1", "resolved"],
    "node_aware": ["ValueError", "sparse.t3", "node-aware mesh", "node_size"],
    "offloaded_torch_state": ["ValueError", "sparse.t1", "exp_avg", "fused optimizer"],
    "dense_left_out": ["ValueError", "['scale']", "none of the 1 optimizer(s)", "requires_grad_"],
    "offloaded_sync_every": ["ValueError", "sparse.t3", "sync_every=2"],
    "fully_sharded": ["ValueError", "sparse.t0", "fully sharded 2D", "does not move yet"],
    "not_a_spec": ["TypeError", "sparse.t0"],
    "disagree": ["ValueError", "another plan"],
    "kept_spec_off_mesh": ["ValueError", "sparse.t1", "keeps TableWise(rank=3)", "new mesh"],
    "meshes_unknown": ["KeyError", "nope"],
    "memory": ["ValueError", "3.06 KiB", "on rank 0", "'sparse.t0'", "budget of 1.76 KiB"],
    "prefetched": ["ValueError", "prefetched batch"],
    "peak": ["ValueError", "at its peak", "on rank 0", "budget of 1.76 KiB", "chunk_bytes="],
    "mid_move": ["CollectiveError", "simulated"],
    "no_fused": ["ValueError", "sparse.t0", "torch optimizer", "optimizers=[opt]"],
    "bad_optimizers": ["TypeError", "torch.optim.Optimizer"],
    "not_distributed": ["TypeError", "distribute_module"],
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_refusals_leave_the_model_as_it_was(results, case):
    for rank, per_rank in enumerate(results):
        got = per_rank["errors"][case]
        for word in ERRORS[case]:
            assert word in got["error"], (rank, case, got["error"])
        assert got.get("unchanged", True), (rank, case)
        assert per_rank["errors"]["after"] == "RW"


def test_fsdp_and_tp_dense_layers_are_refused_a_new_mesh(results):
    """E374 before anything moves, naming the parameter and who distributes it."""
    for rank, per_rank in enumerate(results):
        got = per_rank["composed"]
        for case, words in (
            ("fsdp", ["mlp.0.weight", "fully_shard"]),
            ("tp", ["mlp.0.weight", "parallelize_module"]),
        ):
            assert "ValueError" in got[case]["error"] and got[case]["unchanged"], (rank, got)
            for word in words + ["meshes="]:
                assert word in got[case]["error"], (rank, case, got[case]["error"])
        assert got["fsdp_tables_moved"], rank


def test_eval_only_offloaded_tables_move(results):
    for rank, per_rank in enumerate(results):
        got = per_rank["eval_offloaded"]
        assert got["same_state"] and got["plan"] and got["on_mesh"], (rank, got)
        assert got["out_rel"] <= 1e-6, (rank, got)


def test_id_counters_replan(results):
    """Counters on a distributed model sum every rank's batches; the re-plan from them
    moves tables off the all-on-position-0 plan, reshard applies it, training goes on."""
    for rank, per_rank in enumerate(results):
        got = per_rank["counted"]
        for key, want in got["expected"].items():
            assert got["counts"][key] == pytest.approx(want), (rank, key)
        assert got["replanned"] != got["poor"], got
        assert got["plan"] == got["replanned"] == results[0]["counted"]["replanned"]


def test_torchrec_plan_as_target(results):
    if results[0]["torchrec"].get("skipped"):
        pytest.skip("torchrec not installed")
    for rank, per_rank in enumerate(results):
        got = per_rank["torchrec"]
        assert got["moved_exact"] == 0.0, rank
        assert got["plan"] == {
            "sparse.t0": "ColumnWise(positions=(1, 3))",
            "sparse.t1": "TableWise(rank=2)",
            "sparse.t2": "DataParallel()",
            "sparse.t3": "RowWise()",
        }, (rank, got)
        assert got["cached"] == "RowWise(cache_fraction=0.2)" and got["cached_exact"] == 0.0
        assert "ValueError" in got["bad"] and "t3" in got["bad"], got["bad"]
        assert "fused_uvm" in got["bad"], got["bad"]


def test_model_shapes(results):
    for rank, per_rank in enumerate(results):
        got = per_rank["shapes"]
        assert got["root_exact"] and got["root_eval"], (rank, got)
        assert got["root_plan"] == "RW CW", (rank, got)
        assert got["two_groups"] and got["two_state"], (rank, got)
        first, second = got["per_collection"]
        assert first["moved_exact"] and first["bitwise"] and first["report"], (rank, first)
        assert first["meshes"] == [[[0, 1], [2, 3]], [[0], [1], [2], [3]]], first
        assert second["moved_exact"] and second["bitwise"] and second["report"], (rank, second)
        assert second["meshes"] == [[[0, 1], [2, 3]], [[0, 1], [2, 3]]], second


@pytest.mark.parametrize("case", sorted(QCOMMS_CASES))
def test_qcomms_settings_move_with_the_model(results, case):
    """A model distributed with quantized communication (bf16 forward and replica sums,
    fp16 gradients) keeps its ``QCommsConfig`` through ``reshard``: the continuation is
    bitwise the model distributed to plan B with the same config (and differs from the
    fp32 run, so a reshard that dropped the config fails), only moved rows travel."""
    src, dst, a, b = QCOMMS_CASES[case]
    for rank, per_rank in enumerate(results):
        got = per_rank[f"{case}-qcomms"]
        where = f"rank {rank}, {a} on {src} -> {b} on {dst}"
        assert got["qcomms"] and got["moved_exact"] == 0.0, where
        assert got["bitwise"] and got["vs_direct"] == 0.0, (where, got)
        assert got["vs_fp32"] > 1e-6, (where, got["vs_fp32"])
        assert got["bytes"] == got["expected_bytes"], where
