"""dtrec.ops.embedding_bag against a per-table fp64 F.embedding_bag reference."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import dtrec
from dtrec.ops.backends.registry import triton_available

# Triton runs on CUDA tensors, or on CPU tensors in its interpreter (tests/conftest.py).
CASES = [("torch", "cpu"), ("fbgemm", "cpu")]
if torch.cuda.is_available():
    CASES += [("torch", "cuda")] + ([("triton", "cuda")] if triton_available() else [])
elif triton_available() and os.environ.get("TRITON_INTERPRET") == "1":
    CASES += [("triton", "cpu")]


@pytest.fixture(params=CASES, ids=lambda p: f"{p[0]}-{p[1]}")
def device(request):
    """Run the test on each (backend, device); yields the device."""
    backend, dev = request.param
    dtrec.ops.set_backend(backend)
    yield torch.device(dev)
    dtrec.ops.set_backend("auto")


def _reference(weights, values, offsets, modes, psw):
    """Per-table F.embedding_bag in fp64."""
    batch = (offsets.numel() - 1) // len(weights)
    outs = []
    for t, w in enumerate(weights):
        o = offsets[t * batch : (t + 1) * batch + 1].long()
        ids = values[o[0] : o[-1]].long()
        outs.append(
            F.embedding_bag(
                ids,
                w.double(),
                o - o[0],
                mode=modes[t],
                include_last_offset=True,
                per_sample_weights=None if psw is None else psw[o[0] : o[-1]].double(),
            )
        )
    return torch.cat(outs, dim=1)


def _inputs(dims, rows, batch, max_len, gen, index_dtype=torch.int64):
    lengths = torch.randint(0, max_len + 1, (len(dims) * batch,), generator=gen)
    values = torch.cat(
        [
            torch.randint(
                0, rows[t], (int(lengths[t * batch : (t + 1) * batch].sum()),), generator=gen
            )
            for t in range(len(dims))
        ]
    ).to(index_dtype)
    offsets = torch.zeros(lengths.numel() + 1, dtype=index_dtype)
    offsets[1:] = torch.cumsum(lengths, 0)
    return values, offsets


@pytest.mark.parametrize("dims", [[1], [3, 127], [129, 256, 8], [4, 4, 4]])
@pytest.mark.parametrize("pooling", ["sum", "mean", "mixed"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_forward_backward_match_reference(device, dims, pooling, index_dtype) -> None:
    gen = torch.Generator().manual_seed(len(dims))
    rows = [5 + 7 * t for t in range(len(dims))]
    weights = [
        torch.randn(r, d, generator=gen).to(device).requires_grad_() for r, d in zip(rows, dims)
    ]
    modes = [
        "sum" if (t % 2 == 0 or pooling == "sum") and pooling != "mean" else "mean"
        for t in range(len(dims))
    ]
    values, offsets = _inputs(dims, rows, batch=6, max_len=5, gen=gen, index_dtype=index_dtype)
    values, offsets = values.to(device), offsets.to(device)
    out = dtrec.ops.embedding_bag(weights, values, offsets, modes)
    ref = _reference(weights, values, offsets, modes, None)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref_weights = [w.detach().double().requires_grad_() for w in weights]
    _reference(ref_weights, values, offsets, modes, None).backward(grad.double())
    for w, rw in zip(weights, ref_weights):
        torch.testing.assert_close(w.grad.double(), rw.grad, rtol=1e-5, atol=1e-6)


def test_shared_table_entries_and_per_sample_weights(device) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(9, 4, generator=gen).to(device).requires_grad_()
    weights = [w, w, w]  # one table read by three features
    values, offsets = _inputs([4, 4, 4], [9, 9, 9], batch=5, max_len=4, gen=gen)
    psw = torch.rand(values.numel(), generator=gen).to(device)
    values, offsets = values.to(device), offsets.to(device)
    out = dtrec.ops.embedding_bag(weights, values, offsets, "sum", psw)
    torch.testing.assert_close(out.double(), _reference(weights, values, offsets, ["sum"] * 3, psw))
    out.sum().backward()
    rw = w.detach().double().requires_grad_()
    _reference([rw] * 3, values, offsets, ["sum"] * 3, psw).sum().backward()
    torch.testing.assert_close(w.grad.double(), rw.grad)


def test_adversarial_bags(device) -> None:
    w = torch.randn(4, 3, generator=torch.Generator().manual_seed(3)).to(device)
    # all bags empty, then all ids equal, then one long bag
    values = torch.tensor([2] * 6 + list(range(4)) * 250, device=device)
    offsets = torch.tensor([0, 0, 0, 3, 6, 1006], device=device)
    out = dtrec.ops.embedding_bag([w], values, offsets, "mean")
    ref = _reference([w], values, offsets, ["mean"], None)
    # fp32 sums of a 1000-id bag against float64: ~1e-6 absolute error is expected
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.all(out[:2] == 0)


def test_backward_is_deterministic(device) -> None:
    """By construction on the Triton backend and on CPU; torch's CUDA index_add_ uses atomics."""
    if device.type == "cuda" and dtrec.ops.get_backend() == "torch":
        pytest.skip("the torch backend on CUDA is not deterministic (documented exception)")
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(20, 16, generator=gen).to(device).requires_grad_()
    values = torch.randint(0, 3, (400,), generator=gen).to(device)  # hot rows
    offsets = torch.arange(0, 401, 50, device=device)
    grads = []
    for _ in range(2):
        w.grad = None
        dtrec.ops.embedding_bag([w, w], values, offsets, "sum").square().sum().backward()
        grads.append(w.grad.clone())
    assert torch.equal(grads[0], grads[1])


def test_errors() -> None:
    w = torch.randn(4, 3)
    ids, offsets = torch.tensor([0, 1]), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="per_sample_weights need sum pooling"):
        dtrec.ops.embedding_bag([w], ids, offsets, "mean", torch.ones(2))
    with pytest.raises(TypeError, match="values must be 1-D int32/int64"):
        dtrec.ops.embedding_bag([w], ids.float(), offsets)
    with pytest.raises(ValueError, match="pooling must be one of"):
        dtrec.ops.embedding_bag([w], ids, offsets, "max")
    with pytest.raises(ValueError, match="pooling has 2 entries for 1 tables"):
        dtrec.ops.embedding_bag([w], ids, offsets, ["sum", "sum"])
    with pytest.raises(ValueError, match="offsets has 4 entries"):
        dtrec.ops.embedding_bag([w, w], ids, torch.tensor([0, 1, 2, 2]))
    with pytest.raises(ValueError, match="unknown backend"):
        dtrec.ops.set_backend("cuda-magic")


def test_per_sample_weight_gradients() -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(9, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    values, offsets = _inputs([4, 4], [9, 9], batch=3, max_len=4, gen=gen)
    psw = torch.rand(values.numel(), generator=gen, dtype=torch.float64, requires_grad=True)
    out = dtrec.ops.embedding_bag([w, w], values, offsets, "sum", psw)
    grad = torch.randn_like(out)
    (gw, gp) = torch.autograd.grad(out, [w, psw], grad)
    rw, rp = w.detach().clone().requires_grad_(), psw.detach().clone().requires_grad_()
    ref = _reference([rw, rw], values, offsets, ["sum", "sum"], rp)
    (rgw, rgp) = torch.autograd.grad(ref, [rw, rp], grad)
    torch.testing.assert_close(gw, rgw)
    torch.testing.assert_close(gp, rgp)


def test_out_of_range_id_is_an_index_error_unless_checks_are_off(device) -> None:
    w = torch.randn(4, 3, device=device)  # table 0: entries 0, 1
    other = torch.randn(6, 3, device=device)  # table 1: entries 2, 3
    offsets = torch.tensor([0, 1, 2, 3, 4], device=device)
    cases = {
        (0, 1, 1, 6): "table 1 .*outside \\[0, 6\\)",
        (0, 4, 1, 1): "table 0 .*outside \\[0, 4\\)",
    }
    cases[(-1, 0, 0, 0)] = "table 0 .*outside \\[0, 4\\)"
    for ids, message in cases.items():
        with pytest.raises(IndexError, match=message):
            dtrec.ops.embedding_bag([w, w, other, other], torch.tensor(ids, device=device), offsets)
    ok = dtrec.ops.embedding_bag(
        [w], torch.tensor([0, 3], device=device), offsets[:3], bounds_check="off"
    )
    torch.testing.assert_close(ok, w[[0, 3]])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend: str) -> None:
    """The op traces without graph breaks (fake impls), forward and backward."""
    gen = torch.Generator().manual_seed(5)
    w0 = torch.randn(9, 4, generator=gen, requires_grad=True)
    w1 = torch.randn(7, 3, generator=gen, requires_grad=True)
    values, offsets = _inputs([4, 3, 4], [9, 7, 9], batch=3, max_len=3, gen=gen)

    def step(a, b, v, o):
        return dtrec.ops.embedding_bag([a, b, a], v, o, ["sum", "mean", "sum"]).square().sum()

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    loss = compiled(w0, w1, values, offsets)
    loss.backward()
    grads = (w0.grad.clone(), w1.grad.clone())
    w0.grad = w1.grad = None
    eager = step(w0, w1, values, offsets)
    eager.backward()
    torch.testing.assert_close(loss, eager)
    torch.testing.assert_close(grads[0], w0.grad)
    torch.testing.assert_close(grads[1], w1.grad)


def test_zero_width_table_shard(device) -> None:
    """An empty column shard ([rows, 0]) pools to nothing and gets an empty gradient."""
    w = torch.randn(5, 3, device=device, requires_grad=True)
    z = torch.zeros(4, 0, device=device, requires_grad=True)
    values = torch.tensor([1, 2, 0, 3], device=device)
    offsets = torch.tensor([0, 1, 2, 3, 4], device=device)
    out = dtrec.ops.embedding_bag([w, z], values, offsets)
    assert out.shape == (2, 3)
    out.sum().backward()
    assert z.grad.shape == (4, 0) and w.grad[1:3].abs().sum() > 0


def test_empty_batch_output_is_connected_to_the_tables() -> None:
    """A batch of 0 bags gives a (0, sum D) output that backward() goes through (zero
    gradients), as torch's embedding_bag does: an unsharded model's empty last batch of a
    drop_last=False loop can train its step (it raised 'does not require grad' before)."""
    a = torch.randn(5, 3, requires_grad=True)
    b = torch.randn(7, 2, requires_grad=True)
    none = torch.empty(0, dtype=torch.long)
    out = dtrec.ops.embedding_bag([a, b], none, torch.zeros(1, dtype=torch.long), ["sum", "mean"])
    assert out.shape == (0, 5) and out.requires_grad
    out.sum().backward()
    assert torch.equal(a.grad, torch.zeros_like(a)) and torch.equal(b.grad, torch.zeros_like(b))
    ebc = dtrec.EmbeddingBagCollection([dtrec.EmbeddingBagConfig("t", 10, 4, ["f"])])
    kjt = dtrec.KeyedJaggedTensor(keys=["f"], values=none, lengths=none)
    ebc(kjt).values().sum().backward()
    assert torch.equal(ebc.embedding_bags["t"].weight.grad, torch.zeros(10, 4))
    with torch.no_grad():
        empty = dtrec.ops.embedding_bag([a], none, torch.zeros(1, dtype=torch.long))
    assert not empty.requires_grad
