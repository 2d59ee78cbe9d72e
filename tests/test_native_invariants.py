"""The native-invariant checker (``tests/native_invariants.py``) can fail: each invariant
of each fbgemm op dtrec calls is broken once and flagged, valid calls pass and run, and
every place in dtrec that reaches fbgemm's ops is one ``install`` patches."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.native_invariants import CHECKS, CheckingOps, check_backward, check_block_bucketize

fbgemm_gpu = pytest.importorskip("fbgemm_gpu")

ROWS, D = 4, 4


def _bucketize_args(**change):
    args = {
        "lengths": torch.tensor([2, 1, 0, 1]),  # 2 features x 2 bags
        "indices": torch.tensor([0, 5, 3, 7]),
        "bucketize_pos": False,
        "sequence": False,
        "block_sizes": torch.tensor([4, 4]),
        "my_size": 2,
        "weights": None,
    }
    return {**args, **change}


def _backward_args(**change):
    """Two tables (rows 4 and 3, dims 4 and 2) packed in one buffer, two bags each."""
    args = {
        "grad_output": torch.ones(2, 6),
        "host_weights": torch.zeros(ROWS * D + 3 * 2),
        "weights_placements": torch.full((2,), 3, dtype=torch.int32),
        "weights_offsets": torch.tensor([0, ROWS * D]),
        "D_offsets": torch.tensor([0, D, D + 2], dtype=torch.int32),
        "max_D": D,
        "hash_size_cumsum": torch.tensor([0, ROWS, ROWS + 3]),
        "total_hash_size_bits": 3,
        "indices": torch.tensor([3, 0, 1, 2, 2]),
        "offsets": torch.tensor([0, 1, 2, 4, 5]),
        "pooling_mode": 0,
        "indice_weights": torch.empty(0),
        "stochastic_rounding": False,
        "learning_rate_tensor": torch.tensor(0.5),
    }
    return {**args, **change}


def test_valid_calls_pass_and_run() -> None:
    ops = CheckingOps(torch.ops.fbgemm)
    ops.block_bucketize_sparse_features(*_bucketize_args().values())
    args = _backward_args()
    ops.split_embedding_backward_codegen_sgd_cpu(**args)
    assert args["host_weights"].abs().sum() > 0  # it ran: rows moved
    forward = {k: v for k, v in args.items() if k not in ("grad_output", "weights_placements",
               "stochastic_rounding", "learning_rate_tensor")}  # fmt: skip
    forward["dev_weights"] = forward.pop("host_weights")
    forward["indice_weights"] = None
    out = ops.dense_embedding_codegen_lookup_function(
        **forward, total_D=D + 2, feature_requires_grad=None
    )
    assert out.shape == (2, D + 2)
    adagrad = {**_backward_args(), "momentum1_host": torch.zeros(ROWS + 3),
               "momentum1_placements": torch.full((2,), 3, dtype=torch.int32),
               "momentum1_offsets": torch.tensor([0, ROWS]), "eps": 1e-8}  # fmt: skip
    ops.split_embedding_backward_codegen_rowwise_adagrad_cpu(**adagrad)
    assert ops.violations == [] and ops.unchecked == set()
    assert set(ops.calls) == set(CHECKS)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lengths": torch.tensor([2, -1, 1, 2])}, "negative lengths"),
        ({"lengths": torch.tensor([2, 1, 0, 2])}, "sum(lengths) 5 != 4 ids"),
        ({"indices": torch.tensor([0, 5, 3, 8])}, "id 8 outside [0, 8)"),
        ({"indices": torch.tensor([0, -5, 3, 7])}, "id -5 outside"),
        ({"block_sizes": torch.tensor([4, 0])}, "block sizes"),
        ({"weights": torch.ones(3)}, "3 weights for 4 ids"),
        ({"indices": torch.tensor([0, 5, 3, 7], dtype=torch.int32)}, "dtypes differ"),
    ],
)
def test_bucketize_violations_are_flagged(change, message) -> None:
    assert any(message in v for v in check_block_bucketize(_bucketize_args(**change)))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"indices": torch.tensor([3, 4, 1, 2, 2])}, "id 4 outside its table's [0, 4)"),
        ({"indices": torch.tensor([3, 0, 1, 2, 3])}, "id 3 outside its table's [0, 3)"),
        ({"offsets": torch.tensor([0, 1, 2, 4, 6])}, "offsets from 0 to 6 for 5 ids"),
        ({"weights_offsets": torch.tensor([0, ROWS * D + 1])}, "past the buffer"),
        ({"hash_size_cumsum": torch.tensor([0, ROWS, ROWS + 5])}, "past the buffer"),
        ({"grad_output": torch.ones(3, 6)}, "want (2, 6)"),
        ({"D_offsets": torch.tensor([0, D, D + 3], dtype=torch.int32)}, "past the buffer"),
        ({"max_D": 2}, "max_D 2 != 4"),
        ({"indice_weights": torch.ones(4)}, "4 per-sample weights for 5 ids"),
        ({"host_weights": torch.zeros(44)[::2]}, "weight buffer 1-D contiguous=False"),
    ],
)
def test_table_batched_violations_are_flagged(change, message) -> None:
    got = check_backward(_backward_args(**change))
    assert any(message in v for v in got), got


def test_forward_reads_an_empty_weight_tensor_as_weights() -> None:
    """Found by this file's first draft, which allowed it and segfaulted in fbgemm: the
    backward takes an empty ``indice_weights`` for none, the forward needs None."""
    from tests.native_invariants import check_forward

    args = {k: v for k, v in _backward_args().items() if k != "grad_output"}
    args["dev_weights"] = args.pop("host_weights")
    assert any("0 per-sample weights for 5 ids" in v for v in check_forward(args))
    assert check_forward({**args, "indice_weights": None}) == []


def test_momentum_past_its_buffer_is_flagged_and_not_run() -> None:
    ops = CheckingOps(torch.ops.fbgemm)
    args = {**_backward_args(), "momentum1_host": torch.zeros(ROWS + 2),
            "momentum1_placements": torch.full((2,), 3, dtype=torch.int32),
            "momentum1_offsets": torch.tensor([0, ROWS]), "eps": 1e-8}  # fmt: skip
    before = args["host_weights"].clone()
    with pytest.raises(RuntimeError, match="native invariant violated"):
        ops.split_embedding_backward_codegen_rowwise_adagrad_cpu(**args)
    assert "momentum1 [4, +3) past 6" in ops.violations[0]
    assert torch.equal(args["host_weights"], before)  # refused, not run


def test_every_fbgemm_call_site_is_patched_by_install() -> None:
    """dtrec reaches fbgemm's ops only through ``fbgemm_ops()``, looked up in the modules
    ``install`` patches (a new call site must be added there and get a check)."""
    root = Path(__file__).resolve().parents[1] / "dtrec"
    users = set()
    for path in root.rglob("*.py"):
        text = path.read_text()
        if path.name == "fbgemm_loader.py":
            continue
        if re.search(r"torch\.ops\.fbgemm|fbgemm_gpu\.", text):
            users.add(f"raw:{path.relative_to(root)}")
        if re.search(r"\bfbgemm_ops\(\)", text):
            users.add(str(path.relative_to(root)))
    assert users == {"ops/backends/fbgemm.py", "sharded/dist/routing.py"}, users
