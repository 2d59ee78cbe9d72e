"""The backend registry resolves as documented; fallbacks land on torch's implementation."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch

import dtrec
from dtrec.ops.backends import fbgemm as fbgemm_module
from dtrec.ops.backends import registry
from dtrec.ops.backends.fbgemm import FbgemmBackend
from dtrec.ops.backends.torch import TorchBackend, pooled_lookup
from dtrec.ops.lookup import Lookup

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def backend():
    """``set_backend`` for one test, "auto" again after it."""
    yield dtrec.ops.set_backend
    dtrec.ops.set_backend("auto")


def _lookup(mean=(False, False)) -> Lookup:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(6, 4, generator=gen), torch.randn(5, 3, generator=gen)]
    values = torch.tensor([0, 5, 2, 1, 4, 3])
    offsets = torch.tensor([0, 2, 3, 5, 6])
    return Lookup(weights, [0, 1], values, offsets, list(mean))


def test_auto_on_cpu_is_torch_with_fbgemm_fused_step(backend) -> None:
    backend("auto")
    resolved = registry.resolve_backend(CPU)
    assert resolved.name == "torch"
    assert isinstance(resolved, FbgemmBackend) and not resolved.lookups
    with mock.patch.object(fbgemm_module, "_pooled_in_fbgemm") as fbgemm_forward:
        out = resolved.forward(_lookup(), check_ids=True)
    fbgemm_forward.assert_not_called()
    torch.testing.assert_close(out, pooled_lookup(_lookup()), rtol=0, atol=0)


def test_auto_on_cuda_is_triton_when_it_imports(backend) -> None:
    backend("auto")
    with mock.patch.object(registry, "triton_available", lambda: True):
        assert registry.resolve_backend(CUDA).name == "triton"
    with mock.patch.object(registry, "triton_available", lambda: False):
        resolved = registry.resolve_backend(CUDA)
    assert resolved.name == "torch" and not resolved.lookups


@pytest.mark.parametrize("name", ["torch", "fbgemm"])
def test_named_backends_resolve_to_themselves(backend, name: str) -> None:
    backend(name)
    assert registry.resolve_backend(CPU).name == name
    assert dtrec.ops.get_backend() == name


def test_torch_backend_never_steps_in_fbgemm(backend) -> None:
    backend("torch")
    resolved = registry.resolve_backend(CPU)
    assert type(resolved) is TorchBackend
    assert resolved.capabilities.fused_backward_update  # dtrec.kernels.cpu, not fbgemm


def test_fbgemm_falls_back_to_torch_for_calls_it_does_not_serve(backend) -> None:
    backend("fbgemm")
    resolved = registry.resolve_backend(CPU)
    mixed = _lookup(mean=(True, False))
    assert not resolved.capabilities.serves(mixed)
    with mock.patch.object(fbgemm_module, "_pooled_in_fbgemm") as fbgemm_forward:
        out = resolved.forward(mixed)
        with mock.patch.object(fbgemm_module, "fbgemm_ops", lambda: None):  # fbgemm not loaded
            unloaded = resolved.forward(_lookup())
    fbgemm_forward.assert_not_called()
    torch.testing.assert_close(out, pooled_lookup(mixed), rtol=0, atol=0)
    torch.testing.assert_close(unloaded, pooled_lookup(_lookup()), rtol=0, atol=0)


def test_triton_on_cpu_needs_the_interpreter(backend) -> None:
    backend("triton")
    with (
        mock.patch.object(registry, "triton_available", lambda: True),
        mock.patch.dict(os.environ),
    ):
        os.environ.pop("TRITON_INTERPRET", None)
        with pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1 set before triton"):
            registry.resolve_backend(CPU)
        assert registry.resolve_backend(CUDA).name == "triton"
    with (
        mock.patch.object(registry, "triton_available", lambda: False),
        pytest.raises(RuntimeError, match="'triton' was requested but triton does not"),
    ):
        registry.resolve_backend(CUDA)


def test_unknown_names_keep_their_messages() -> None:
    available = "('auto', 'triton', 'torch', 'fbgemm')"
    with pytest.raises(ValueError) as err:
        dtrec.ops.set_backend("cudnn")
    assert str(err.value) == f"unknown backend 'cudnn'; available: {available}"
    with mock.patch.object(registry, "_backend", "cudnn"), pytest.raises(ValueError) as err:
        dtrec.ops.get_backend()
    assert str(err.value) == f"DTREC_BACKEND='cudnn' is not one of {available}"


def test_register_backend_is_idempotent_and_selectable(backend) -> None:
    mine = TorchBackend()
    mine.name = "mine"
    with mock.patch.dict(registry._REGISTRY):
        registry.register_backend(mine)
        registry.register_backend(mine)  # the same object again: no-op
        backend("mine")
        assert registry.resolve_backend(CPU) is mine
        other = TorchBackend()
        other.name = "mine"
        with pytest.raises(ValueError, match="already registered as 'mine'"):
            registry.register_backend(other)
        auto = TorchBackend()
        auto.name = "auto"
        with pytest.raises(ValueError, match="'auto' is reserved"):
            registry.register_backend(auto)
        backend("auto")
    with pytest.raises(ValueError, match="unknown backend 'mine'"):
        dtrec.ops.set_backend("mine")


def test_cpu_lookups_and_fused_steps_never_import_triton_kernels() -> None:
    """With triton unimportable, "auto" on CPU runs the op and every fused optimizer, and
    loads no Triton kernel module (only ``update_math``, the rules' pure-torch math, and
    ``cpu``, dtrec's C kernels)."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # any `import triton` now raises ImportError
        import torch, dtrec
        from dtrec.ops.lookup import Lookup
        w = torch.randn(6, 4, requires_grad=True)
        ids, offsets = torch.tensor([0, 5, 2]), torch.tensor([0, 2, 3])
        dtrec.ops.embedding_bag([w], ids, offsets).sum().backward()
        for opt in (dtrec.optim.SGD(0.1), dtrec.optim.RowWiseAdagrad(0.1), dtrec.optim.Adam(0.1)):
            weights = [w.detach().clone()]
            lookup = Lookup(weights, [0], ids, offsets, [False])
            opt.backward_update(lookup, torch.ones(2, 4), opt.init_states(weights))
        loaded = sorted(m for m in sys.modules if m.startswith("dtrec.kernels."))
        assert loaded == ["dtrec.kernels.cpu", "dtrec.kernels.update_math"], loaded
        print("ok")
        """
    )
    env = {**os.environ, "DTREC_BACKEND": "auto"}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
