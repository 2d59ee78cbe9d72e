"""DTensor rules of ``dtrec::embedding_bag`` on a real gloo world (4 ranks, one world).

Each case distributes tables, runs the op through plain DTensor dispatch (and
EmbeddingBagFunction for autograd), and compares with the unsharded op on the
global batch: forward, weight grads, placements, local grad shapes and the
collectives issued (CommDebugMode).
"""

from __future__ import annotations

import pytest

from tests.multiprocess import error_of, run_world

R, S0, S1, P = "R", "S0", "S1", "P"


def _case(S, weights, tables, pooling, out, grad, **options):
    """S: shard group size (4 ranks: S=2 -> (2, 2) mesh, S=4 -> (4, 1)); weights: a dtrec spec
    name or raw placements; out / grad: expected placements of the output / weight grads.

    options: entries (entry -> table), weighted, empty (fraction of empty bags), inputs
    (placements of values/offsets, default replicated), loss_on_output (take the loss on the
    op's output DTensor, not on its full_tensor()), comm (expected collectives {name: count}
    of the forward op, full_tensor, backward, grads' full_tensor; None skips one).
    """
    return dict(S=S, weights=weights, tables=tables, pooling=pooling, out=out, grad=grad, **options)


AR, AG = "all_reduce", "all_gather_into_tensor"
CASES = {
    "rw_sum": _case(
        2, "RowWise", [(10, 4)], ["sum"], (P, R), (S0, R), comm=({}, {AR: 1}, {}, {AG: 1})
    ),
    "rw_mean_loss_on_partial": _case(
        2,
        "RowWise",
        [(10, 4)],
        ["mean"],
        (P, R),
        (S0, R),
        loss_on_output=True,
        comm=({}, {AR: 1}, {}, None),
    ),
    "rw_weighted": _case(2, "RowWise", [(9, 3)], ["sum"], (P, R), (S0, R), weighted=True),
    "rw_two_tables_mixed": _case(
        2, "RowWise", [(11, 5), (7, 7)], ["sum", "mean", "mean"], (P, R), (S0, R), entries=[0, 1, 0]
    ),
    "rw_few_rows_empty_bags_s4": _case(
        4, "RowWise", [(3, 5)], ["mean"], (P, R), (S0, R), empty=0.5, comm=({}, {AR: 1}, {}, None)
    ),
    "rw_weighted_two_tables_s4": _case(
        4, "RowWise", [(13, 7), (6, 5)], ["sum", "sum"], (P, R), (S0, R), weighted=True
    ),
    "cw_sum": _case(
        2, "ColumnWise", [(10, 7)], ["sum"], (S1, R), (S1, R), comm=({}, {AG: 1}, {}, None)
    ),
    "cw_mean_uneven_s4": _case(4, "ColumnWise", [(8, 5)], ["mean"], (S1, R), (S1, R)),
    "cw_two_tables_gathered": _case(
        2,
        "ColumnWise",
        [(10, 5), (6, 7)],
        ["sum", "mean"],
        (R, R),
        (S1, R),
        comm=({AG: 2}, {}, {}, None),
    ),
    "dp_replicated_s4": _case(
        4, "DataParallel", [(10, 4), (5, 7)], ["mean", "sum"], (R, R), (R, R), comm=({}, {}, {}, {})
    ),
    "dp_batch_sharded": _case(
        2,
        "DataParallel",
        [(10, 4), (5, 7)],
        ["mean", "sum"],
        (S0, S0),
        (P, P),
        inputs=(S0, S0),
        comm=({}, {AG: 2}, {}, {AR: 4}),
    ),
    "dp_batch_sharded_weighted": _case(
        2,
        "DataParallel",
        [(10, 5)],
        ["sum"],
        (S0, S0),
        (P, P),
        weighted=True,
        inputs=(S0, S0),
        loss_on_output=True,
    ),
    "raw_rw_batch": _case(
        2,
        (S0, R),
        [(11, 5), (6, 7)],
        ["mean", "sum"],
        (P, S0),
        (S0, P),
        inputs=(R, S0),
        comm=({}, {AR: 1, AG: 1}, {}, {AR: 2, AG: 2}),
    ),
    "raw_grid": _case(2, (S0, S1), [(9, 7)], ["mean"], (P, S1), (S0, S1), loss_on_output=True),
    "raw_cw_rw": _case(2, (S1, S0), [(9, 5)], ["sum"], (S1, P), (S1, S0), weighted=True),
    "raw_rw_rw": _case(
        2,
        (S0, S0),
        [(7, 4), (3, 5)],
        ["mean", "sum"],
        (P, P),
        (S0, S0),
        empty=0.3,
        comm=({}, {AR: 2}, {}, None),
    ),
    "raw_cw_cw_gathered": _case(2, (S1, S1), [(6, 5), (4, 7)], ["sum", "mean"], (R, R), (S1, S1)),
}


def _placement(short: str):
    from torch.distributed.tensor import Partial, Replicate, Shard

    return {R: Replicate(), S0: Shard(0), S1: Shard(1), P: Partial()}[short]


def _comm(debug) -> dict[str, int]:
    return {str(k).rsplit(".", 1)[-1]: v for k, v in debug.get_comm_counts().items()}


def _make_batch(gen, tables, entry_table, batch, empty, weighted):
    """Per entry: (ids, lengths[B], weights or None)."""
    import torch

    per_entry = []
    for t in entry_table:
        lengths = torch.randint(1, 4, (batch,), generator=gen)
        lengths[torch.rand(batch, generator=gen) < empty] = 0
        ids = torch.randint(0, tables[t][0], (int(lengths.sum()),), generator=gen)
        psw = torch.rand(ids.numel(), generator=gen) if weighted else None
        per_entry.append((ids, lengths, psw))
    return per_entry


def _flatten(per_entry):
    """Entry-major (values, offsets, psw) of one batch; ``per_entry`` as from _make_batch."""
    import torch

    values = torch.cat([ids for ids, _, _ in per_entry])
    lengths = torch.cat([ln for _, ln, _ in per_entry])
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    psw = None if per_entry[0][2] is None else torch.cat([w for _, _, w in per_entry])
    return values, offsets, psw


def _concat_batches(batches):
    """The global batch: each entry's bags of every batch shard, in shard order."""
    import torch

    merged = []
    for e in range(len(batches[0])):
        parts = [b[e] for b in batches]
        psw = None if parts[0][2] is None else torch.cat([p[2] for p in parts])
        merged.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), psw))
    return _flatten(merged)


def _check_case(rank, mesh, cfg) -> dict:
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    import dtrec

    tables, pooling = cfg["tables"], cfg["pooling"]
    entry_table = cfg.get("entries", list(range(len(tables))))
    weighted, empty = cfg.get("weighted", False), cfg.get("empty", 0.0)
    in_pl = tuple(_placement(p) for p in cfg.get("inputs", (R, R)))
    batch_axes = [a for a, p in enumerate(cfg.get("inputs", (R, R))) if p == S0]
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(rows, dim, generator=gen) for rows, dim in tables]
    num_shards = 1
    for a in batch_axes:
        num_shards *= mesh.size(a)
    batches = [_make_batch(gen, tables, entry_table, 3, empty, weighted) for _ in range(num_shards)]
    g_values, g_offsets, g_psw = _concat_batches(batches)

    # the unsharded reference on the global batch (per-sample weights learn too)
    ref_w = [w.clone().requires_grad_() for w in weights]
    ref_psw = None if g_psw is None else g_psw.clone().requires_grad_()
    ref = dtrec.ops.embedding_bag(
        [ref_w[t] for t in entry_table], g_values, g_offsets, pooling, ref_psw
    )
    upstream = torch.randn(ref.shape, generator=gen)
    (ref * upstream).sum().backward()

    # the sharded tables
    if isinstance(cfg["weights"], str):
        spec = getattr(dtrec.placements, cfg["weights"])()
        dw = [dtrec.distribute_tensor(w, mesh, spec) for w in weights]
    else:
        placements = [_placement(p) for p in cfg["weights"]]
        dw = [distribute_tensor(w, mesh, placements) for w in weights]
    dw = [w.requires_grad_() for w in dw]

    # the inputs: replicated, or each rank's own batch as a Shard(0) DTensor
    if batch_axes:
        coord = mesh.get_coordinate()
        index = 0
        for a in batch_axes:
            index = index * mesh.size(a) + coord[a]
        values, offsets, psw = _flatten(batches[index])
        total = len(entry_table) * 3 * num_shards + 1

        def shard(t, size):
            return DTensor.from_local(t, mesh, in_pl, run_check=False, shape=(size,), stride=(1,))

        d_values, d_offsets = shard(values, g_values.numel()), shard(offsets, total)
        psw_leaf = None if psw is None else psw.clone().requires_grad_()
        d_psw = None if psw is None else shard(psw_leaf, g_values.numel())
    else:
        d_values, d_offsets = (distribute_tensor(t, mesh, in_pl) for t in (g_values, g_offsets))
        psw_leaf = None if g_psw is None else distribute_tensor(g_psw, mesh, in_pl)
        d_psw = None if psw_leaf is None else psw_leaf.requires_grad_()

    with CommDebugMode() as fwd:
        out = dtrec.ops.embedding_bag(
            [dw[t] for t in entry_table], d_values, d_offsets, pooling, d_psw
        )
    with CommDebugMode() as full:
        full_out = out.full_tensor()
    if cfg.get("loss_on_output"):  # backward straight through the op's own placements
        rep = [_placement(R)] * mesh.ndim
        loss = (out * distribute_tensor(upstream, mesh, rep)).sum()
    else:
        loss = (full_out * upstream).sum()
    with CommDebugMode() as bwd:
        loss.backward()
    grad_err, local_shapes = 0.0, []
    with CommDebugMode() as grad_full:
        for w, r in zip(dw, ref_w, strict=True):
            grad_err = max(grad_err, (w.grad.full_tensor() - r.grad).abs().max().item())
            local_shapes.append(
                (tuple(w.grad.to_local().shape), tuple(w.to_local().shape), tuple(w.shape))
            )
    psw_grad_err = 0.0
    if ref_psw is not None:
        got = psw_leaf.grad
        if batch_axes:  # each rank's own ids: pick them out of the entry-major global batch
            pieces, pos = [], 0
            for e in range(len(entry_table)):
                for shard_index, b in enumerate(batches):
                    n = b[e][0].numel()
                    if shard_index == index:
                        pieces.append(ref_psw.grad[pos : pos + n])
                    pos += n
            want = torch.cat(pieces)
        else:
            got, want = got.full_tensor(), ref_psw.grad
        psw_grad_err = (got - want).abs().max().item()
    return {
        "psw_grad_err": psw_grad_err,
        "fwd_err": (full_out - ref).abs().max().item(),
        "grad_err": grad_err,
        "out_placements": tuple(map(str, out.placements)),
        "grad_placements": [tuple(map(str, w.grad.placements)) for w in dw],
        "local_shapes": local_shapes,
        "comm": (_comm(fwd), _comm(full), _comm(bwd), _comm(grad_full)),
    }


def _check_direct_ops(mesh) -> dict:
    """torch.ops.dtrec.* called on DTensors directly: forward and the backward op."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(3)
    weights = [torch.randn(9, 5, generator=gen), torch.randn(4, 6, generator=gen)]
    values = torch.tensor([0, 8, 3, 2, 1, 3, 3, 0])
    offsets = torch.tensor([0, 2, 3, 6, 8])  # 2 entries x 2 bags
    mean = [True, False]
    ref = torch.ops.dtrec.embedding_bag(weights, [0, 1], values, offsets, mean, None, True)
    grad = torch.randn(ref.shape, generator=gen)
    ref_grads = torch.ops.dtrec.embedding_bag_backward(
        weights, [0, 1], values, offsets, mean, None, grad
    )
    rep = [Replicate(), Replicate()]
    dw = [distribute_tensor(w, mesh, [Shard(0), Replicate()]) for w in weights]
    dv, do, dg = (distribute_tensor(t, mesh, rep) for t in (values, offsets, grad))
    out = torch.ops.dtrec.embedding_bag(dw, [0, 1], dv, do, mean, None, True)
    grads = torch.ops.dtrec.embedding_bag_backward(dw, [0, 1], dv, do, mean, None, dg)
    return {
        "fwd_err": (out.full_tensor() - ref).abs().max().item(),
        "grad_err": max(
            (g.full_tensor() - r).abs().max().item() for g, r in zip(grads, ref_grads, strict=True)
        ),
        "grad_local_rows": [g.to_local().shape[0] for g in grads],
        "grad_placements": [tuple(map(str, g.placements)) for g in grads],
    }


def _check_table_wise(mesh) -> dict:
    """A table-wise table lives on a sub-mesh; inputs replicated on it, other ranks hold nothing."""
    import torch
    from torch.distributed.tensor import Replicate, distribute_tensor

    import dtrec

    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(10, 4, generator=gen)
    values, offsets = torch.tensor([1, 7, 3, 9, 0]), torch.tensor([0, 2, 2, 5])
    ref_w = weight.clone().requires_grad_()
    ref = dtrec.ops.embedding_bag([ref_w], values, offsets, "mean")
    ref.sum().backward()
    w = dtrec.distribute_tensor(weight, mesh, dtrec.placements.TableWise(rank=1))
    w.requires_grad_()
    sub = w.device_mesh
    rep = [Replicate()] * sub.ndim
    dv, do = distribute_tensor(values, sub, rep), distribute_tensor(offsets, sub, rep)
    out = dtrec.ops.embedding_bag([w], dv, do, "mean")
    if sub.get_coordinate() is None:
        return {"member": False, "out_local": tuple(out.to_local().shape)}
    out.full_tensor().sum().backward()
    return {
        "member": True,
        "fwd_err": (out.full_tensor() - ref).abs().max().item(),
        "grad_err": (w.grad.full_tensor() - ref_w.grad).abs().max().item(),
    }


def _check_errors(mesh) -> dict:
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import dtrec

    rep = [Replicate(), Replicate()]
    w_rw = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0), Replicate()])
    w_cw = distribute_tensor(torch.randn(8, 4), mesh, [Shard(1), Replicate()])
    values, offsets = torch.tensor([1, 7, 2]), torch.tensor([0, 2, 3])
    dv, do = distribute_tensor(values, mesh, rep), distribute_tensor(offsets, mesh, rep)
    bad = distribute_tensor(torch.tensor([1, 8, 2]), mesh, rep)
    local_v = DTensor.from_local(values, mesh, [Shard(0), Replicate()], run_check=False)
    local_o = DTensor.from_local(offsets, mesh, [Shard(0), Replicate()], run_check=False)
    return {
        "mixed_placements": error_of(lambda: dtrec.ops.embedding_bag([w_rw, w_cw], dv, do)),
        "plain_inputs": error_of(lambda: dtrec.ops.embedding_bag([w_rw], values, offsets)),
        "rows_and_batch_on_one_axis": error_of(
            lambda: dtrec.ops.embedding_bag([w_rw], local_v, local_o)
        ),
        "id_out_of_range": error_of(lambda: dtrec.ops.embedding_bag([w_rw], bad, do)),
    }


def _run_all(rank: int, world_size: int, cases: dict) -> dict:
    import torch

    import dtrec

    torch.manual_seed(0)
    dtrec.ops.register_dtensor_rules()
    dtrec.ops.register_dtensor_rules()  # idempotent
    meshes = {s: dtrec.init_mesh("cpu", s) for s in (2, 4)}
    results = {name: _check_case(rank, meshes[cfg["S"]], cfg) for name, cfg in cases.items()}
    results["direct_ops"] = _check_direct_ops(meshes[2])
    results["table_wise"] = _check_table_wise(meshes[2])
    results["errors"] = _check_errors(meshes[2])
    return results


@pytest.fixture(scope="module")
def world():
    return run_world(4, _run_all, CASES, timeout=240)


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_unsharded(world, name):
    cfg = CASES[name]
    expect_out = tuple(str(_placement(p)) for p in cfg["out"])
    expect_grad = tuple(str(_placement(p)) for p in cfg["grad"])
    for rank, res in enumerate(world):
        r = res[name]
        assert r["fwd_err"] < 1e-5, f"rank {rank}: forward off by {r['fwd_err']}"
        assert r["grad_err"] < 1e-5, f"rank {rank}: grad off by {r['grad_err']}"
        assert r["psw_grad_err"] < 1e-5, (
            f"rank {rank}: per-sample weight grad off by {r['psw_grad_err']}"
        )
        assert r["out_placements"] == expect_out, f"rank {rank}"
        assert all(g == expect_grad for g in r["grad_placements"]), f"rank {rank}"
        for grad_local, weight_local, full in r["local_shapes"]:
            # a row- or column-sharded table's gradient stays sharded on every rank
            assert grad_local == weight_local, f"rank {rank}: grad {grad_local} vs {weight_local}"
            if S0 in cfg["grad"] or S1 in cfg["grad"]:
                assert grad_local != full or full[0] * full[1] == 0, f"rank {rank}: full grad"


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if "comm" in c))
def test_collectives(world, name):
    stages = ("forward op", "full_tensor", "backward", "grad full_tensor")
    for rank, res in enumerate(world):
        for stage, expect, got in zip(stages, CASES[name]["comm"], res[name]["comm"], strict=True):
            if expect is not None:
                assert got == expect, f"rank {rank} {stage}: {got} != {expect}"


def test_direct_ops(world):
    for rank, res in enumerate(world):
        r = res["direct_ops"]
        assert r["fwd_err"] < 1e-5 and r["grad_err"] < 1e-5, f"rank {rank}: {r}"
        assert r["grad_placements"] == [("S(0)", "R")] * 2
        shard = rank // 2  # mesh (2, 2): shard position of this rank
        assert r["grad_local_rows"] == [[5, 4][shard], 2]


def test_table_wise_sub_mesh(world):
    for rank, res in enumerate(world):
        r = res["table_wise"]
        if rank in (2, 3):  # shard position 1 of the (2, 2) mesh
            assert r["member"] and r["fwd_err"] < 1e-6 and r["grad_err"] < 1e-6, f"rank {rank}"
        else:
            assert r == {"member": False, "out_local": (0,)}, f"rank {rank}: {r}"


def test_errors(world):
    for rank, res in enumerate(world):
        e = res["errors"]
        assert (
            e["mixed_placements"].startswith("ValueError") and "share mesh" in e["mixed_placements"]
        ), f"rank {rank}: {e}"
        assert e["plain_inputs"].startswith("TypeError"), f"rank {rank}: {e}"
        assert e["rows_and_batch_on_one_axis"].startswith("ValueError"), f"rank {rank}: {e}"
        assert "mesh axis 0" in e["rows_and_batch_on_one_axis"]
        assert e["id_out_of_range"].startswith("IndexError"), f"rank {rank}: {e}"
