"""The sequence lookup (the pooled op with bags of one id) on every backend: rows and
their gradients equal plain indexing; the fused optimizers' one-pass step too."""

from __future__ import annotations

import os

import pytest
import torch

import dtrec
from dtrec.modules.embedding import lookup_rows
from dtrec.ops.backends.registry import triton_available

CASES = [("torch", "cpu"), ("fbgemm", "cpu")]
if torch.cuda.is_available():
    CASES += [("torch", "cuda")] + ([("triton", "cuda")] if triton_available() else [])
elif triton_available() and os.environ.get("TRITON_INTERPRET") == "1":
    CASES += [("triton", "cpu")]


@pytest.fixture(params=CASES, ids=lambda p: f"{p[0]}-{p[1]}")
def device(request):
    backend, dev = request.param
    dtrec.ops.set_backend(backend)
    yield torch.device(dev)
    dtrec.ops.set_backend("auto")


@pytest.mark.parametrize("dim", [1, 4, 33])
def test_rows_and_grads_equal_indexing(device, dim: int) -> None:
    gen = torch.Generator().manual_seed(dim)
    weight = torch.randn(13, dim, generator=gen).to(device).requires_grad_()
    ids = torch.randint(0, 13, (40,), generator=gen).to(device)  # many repeats
    grad_out = torch.randn(40, dim, generator=gen).to(device)
    rows = lookup_rows(weight, ids)
    torch.testing.assert_close(rows, weight[ids], rtol=0, atol=0)
    (rows * grad_out).sum().backward()
    want = torch.zeros_like(weight).index_add_(0, ids, grad_out)
    torch.testing.assert_close(weight.grad, want, rtol=1e-6, atol=1e-6)


def test_collection_on_backend(device) -> None:
    tables = [dtrec.EmbeddingConfig("a", 9, 3, ["x", "y"]), dtrec.EmbeddingConfig("b", 5, 8)]
    ec = dtrec.EmbeddingCollection(tables, device=device)
    kjt = dtrec.KeyedJaggedTensor(
        ["x", "y", "b"], torch.tensor([1, 1, 8, 0, 4, 4]), torch.tensor([2, 0, 1, 0, 1, 2])
    ).to(device)
    out = ec(kjt)
    assert out["x"].values().shape == (2, 3) and out["b"].values().shape == (3, 8)
    torch.testing.assert_close(out["b"].values(), ec.embeddings["b"].weight[kjt["b"].values()])
