"""Every native call dtrec makes while training holds the invariants fbgemm relies on.

The glibc abort ``malloc(): unaligned tcache chunk detected`` seen once in
``test_lr_schedule.py`` is what one id past its table does in fbgemm's fused CPU SGD
backward (``tests/native_invariants.py``; reproduced by ``test_checker_flags_what_
corrupts_the_heap`` without running the op). These tests run dtrec's training paths
with every fbgemm call checked first (``CheckingOps``):

* world of 2: ``test_lr_schedule.py``'s own model, plan, batches and schedules, with
  each fused rule, under the "auto" backend (fbgemm's fused SGD backward, row-wise
  input dist) and the "fbgemm" one (its forward and row-wise Adagrad backward too);
  then its unsharded references, SparseAdam's sparse gradients included;
* world of 4: the soak's model (every sharding type, 1D and 2D meshes, weighted,
  sequence, VBE batches) under both backends, and batches with bad ids, negative
  lengths and a missing feature, which must be refused before any native call sees
  them; with ``bounds_check="off"`` an id past a table does reach fbgemm, and the
  checker stops it.

Sparse tensors are built with torch's invariant checks on
(``torch.sparse.check_sparse_tensor_invariants``), and dtrec's own path is shown to
build none (a ``TorchFunctionMode`` counts sparse constructors).
"""

from __future__ import annotations

import pytest

from tests.multiprocess import run_world

SPARSE_CONSTRUCTORS = (
    "sparse_coo_tensor", "_sparse_coo_tensor_unsafe", "sparse_csr_tensor",
    "sparse_compressed_tensor", "to_sparse", "to_sparse_coo", "to_sparse_csr",
)  # fmt: skip


def _sparse_counter():
    """A TorchFunctionMode counting calls of sparse-tensor constructors."""
    import torch
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: dict[str, int] = {}

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = getattr(func, "__name__", "")
            if name in SPARSE_CONSTRUCTORS:
                self.calls[name] = self.calls.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    torch.sparse.check_sparse_tensor_invariants.enable()
    return Count()


def _checked(fn):  # type: ignore[no-untyped-def]
    """Run ``fn()`` with fbgemm checked and sparse constructors counted."""
    from dtrec.ops.backends.fbgemm_loader import fbgemm_ops
    from tests.native_invariants import CheckingOps, install

    checker = CheckingOps(fbgemm_ops())
    counter = _sparse_counter()
    with install(checker), counter:
        fn()
    return {"calls": dict(checker.calls), "violations": list(checker.violations),
            "unchecked": sorted(checker.unchecked), "sparse": dict(counter.calls)}  # fmt: skip


def _lr_schedule_world(rank: int, world: int) -> dict:
    import dtrec
    from tests.distributed import test_lr_schedule as lr

    mesh = dtrec.init_mesh("cpu", world)
    out = {}
    for backend in ("auto", "fbgemm"):
        dtrec.ops.set_backend(backend)
        for rule in lr.RULES:
            for kind in ("warmup_step_decay", "one_cycle"):
                out[f"{backend}/{rule}/{kind}"] = _checked(
                    lambda rule=rule, kind=kind: lr._train_sharded(mesh, rule, kind)
                )
    dtrec.ops.set_backend("auto")
    if rank == 0:  # the unsharded references, SparseAdam's sparse gradients among them
        out["reference"] = _checked(
            lambda: [lr._train_reference(r, "one_cycle", ref) for r, ref in
                     (("sgd", "torch"), ("adam", "torch"), ("rowwise_adagrad", "rule"))]
        )  # fmt: skip
    return out


def _soak_world(rank: int, world: int) -> dict:
    import torch

    import dtrec
    from benchmarks.soak.model import BAD_BATCHES, BatchSpec, bad_batch, make_batch, rank_loss
    from benchmarks.soak.worker import SoakConfig, build

    out = {}
    cfg = SoakConfig(steps=4, seed=3, root="", events=[])
    for backend in ("auto", "fbgemm"):
        dtrec.ops.set_backend(backend)
        for plan in ("mixed_1d", "mesh_2d"):

            def train(plan=plan) -> None:
                tr = build(cfg, plan)
                for step in range(4):
                    batch = make_batch(3, BatchSpec(step, rank, vbe=step % 2 == 1))
                    rank_loss(tr.model, batch).backward()
                    tr.dense.step()
                for i, kind in enumerate(BAD_BATCHES):  # refused before any native call
                    spec = BatchSpec(10 + i, rank)
                    batch = bad_batch(3, spec, kind, i) if rank == i else make_batch(3, spec)
                    try:
                        rank_loss(tr.model, batch).backward()
                    except (ValueError, KeyError, IndexError):
                        continue
                    raise AssertionError(f"{kind}: not refused")

            out[f"{backend}/{plan}"] = _checked(train)
    dtrec.ops.set_backend("auto")

    # bounds_check="off": under "auto" torch's lookup refuses an id past its table (so the
    # fused SGD backward never sees it); under "fbgemm" it reaches fbgemm's forward
    from dtrec.placements import TableWise
    from tests.distributed.numerics import TinyModel, make_tables
    from tests.distributed.numerics import make_batch as tiny_batch

    tables = make_tables(weighted=False)
    torch.manual_seed(0)
    model = TinyModel(tables)
    model.sparse.bounds_check = "off"
    mesh = dtrec.init_mesh("cpu", world)
    model = dtrec.distribute_module(
        model, mesh, {f"sparse.{c.name}": TableWise(rank=0) for c in tables},
        optimizer=dtrec.optim.SGD(lr=0.1),
    )  # fmt: skip
    kjt, target = tiny_batch(tables, 4, False, torch.Generator().manual_seed(rank))
    values = kjt.values().clone()
    values[0] = 10_000  # feature f0's first id, table t0 has 50 rows
    kjt = dtrec.KeyedJaggedTensor(kjt.keys(), values, kjt.lengths())

    def unchecked_step() -> None:
        try:
            (model(kjt) - target).pow(2).mean().backward()
        except RuntimeError as exc:  # the checker's refusal (rank 0), or a peer's
            out["off_error"] = str(exc)[:300]

    dtrec.ops.set_backend("fbgemm")
    out["bounds_off"] = _checked(unchecked_step)
    dtrec.ops.set_backend("auto")
    return out


@pytest.fixture(scope="module")
def lr_results() -> list[dict]:
    return run_world(2, _lr_schedule_world, timeout=600)


@pytest.fixture(scope="module")
def soak_results() -> list[dict]:
    return run_world(4, _soak_world, timeout=600)


def _assert_clean(name: str, got: dict, ops: set[str]) -> None:
    assert got["violations"] == [], (name, got["violations"])
    assert got["unchecked"] == [], (name, got["unchecked"])
    assert got["sparse"] == {}, (name, got["sparse"])  # dtrec builds no sparse tensor
    assert ops <= set(got["calls"]), (name, got["calls"])


FUSED_SGD = "split_embedding_backward_codegen_sgd_cpu"
FUSED_ADAGRAD = "split_embedding_backward_codegen_rowwise_adagrad_cpu"
FORWARD = "dense_embedding_codegen_lookup_function"
BUCKETIZE = "block_bucketize_sparse_features"


def test_lr_schedule_native_calls_hold_invariants(lr_results) -> None:
    for rank, out in enumerate(lr_results):
        for name, got in out.items():
            if name == "reference":
                continue
            backend, rule, _ = name.split("/")
            ops = {BUCKETIZE}
            if rule == "sgd":
                ops.add(FUSED_SGD)  # the op whose misuse gives the tcache abort
            if backend == "fbgemm":
                ops.add(FORWARD)
                if rule == "rowwise_adagrad":
                    ops.add(FUSED_ADAGRAD)
            _assert_clean(f"rank {rank} {name}", got, ops)


def test_lr_schedule_reference_sparse_grads_satisfy_invariants(lr_results) -> None:
    """SparseAdam's gradients, built by the test's reference with torch's checks on."""
    got = lr_results[0]["reference"]
    assert got["violations"] == [] and got["sparse"].get("sparse_coo_tensor", 0) > 0, got


def test_soak_model_native_calls_hold_invariants(soak_results) -> None:
    for rank, out in enumerate(soak_results):
        for name in ("auto/mixed_1d", "auto/mesh_2d", "fbgemm/mixed_1d", "fbgemm/mesh_2d"):
            ops = {BUCKETIZE} | ({FORWARD} if name.startswith("fbgemm") else set())
            if name == "fbgemm/mixed_1d":  # tables one rank owns (no replica to sync)
                ops.add(FUSED_ADAGRAD)
            _assert_clean(f"rank {rank} {name}", out[name], ops)


def test_bounds_check_off_hands_fbgemm_an_id_past_its_table(soak_results) -> None:
    """The unsafe path exists, is opt-in (``bounds_check="off"``, documented as undefined
    behaviour), and is what the checker catches: the table-wise table lives on rank 0,
    whose fbgemm lookup would read past it (and its fused backward write past it)."""
    got = soak_results[0]["bounds_off"]
    assert [v.split(":")[0] for v in got["violations"]] == [FORWARD], got
    assert "outside its table's [0, 50)" in got["violations"][0], got
    assert "native invariant violated" in soak_results[0]["off_error"]
