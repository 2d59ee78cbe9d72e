"""Which backend runs the ops: a static table of backends, chosen once, resolved per device.

The table holds backend objects whose modules import nothing heavy: the Triton
backend imports triton only inside its methods and fbgemm's loads fbgemm_gpu on
first use, so a CPU install never imports triton unless "triton" is selected
(or "auto" meets CUDA tensors).
"""

from __future__ import annotations

import os

import torch

from dtrec.ops.backends.base import Backend
from dtrec.ops.backends.fbgemm import FbgemmBackend
from dtrec.ops.backends.torch import TorchBackend
from dtrec.ops.backends.triton import TritonBackend

# The built-in backends, in the order set_backend's error message lists them.
_REGISTRY: dict[str, Backend] = {
    b.name: b for b in (TritonBackend(), TorchBackend(), FbgemmBackend())
}
_backend: str | None = None  # set_backend's choice; None: DTREC_BACKEND, read at first use
# "auto" without Triton: torch's lookups, fbgemm's fused CPU backward + SGD step where it
# serves; its row-wise Adagrad where it is the faster one on this processor (cpu_choice.py).
_AUTO_FALLBACK = FbgemmBackend(name="torch", lookups=False, fused_rules=("sgd",))


def cpu_fused_rules() -> tuple[str, ...]:
    """The step rules whose fused CPU backward fbgemm runs under ``"auto"``."""
    return _AUTO_FALLBACK.fused_rules


def set_cpu_fused_rules(rules: tuple[str, ...]) -> None:
    """Set them (``cpu_choice.use_cpu_rowwise_adagrad`` decides row-wise Adagrad's)."""
    _AUTO_FALLBACK.fused_rules = tuple(rules)


def register_backend(backend: Backend) -> None:
    """Make ``backend`` selectable by ``set_backend(backend.name)``; idempotent.

    Example::

        register_backend(MyBackend())  # then dtrec.ops.set_backend("mine")
    """
    if backend.name == "auto":
        raise ValueError("backend name 'auto' is reserved")
    known = _REGISTRY.get(backend.name)
    if known is not None and known is not backend:
        raise ValueError(f"a different backend is already registered as {backend.name!r}")
    _REGISTRY[backend.name] = backend


def _names() -> tuple[str, ...]:
    return ("auto", *_REGISTRY)


def set_backend(name: str) -> None:
    """Choose the lookup implementation.

    ``"auto"``: Triton on CUDA, torch on CPU; ``"triton"``: the Triton kernels
    everywhere (CPU tensors need ``TRITON_INTERPRET=1``, which is how CI checks
    them); ``"torch"``: ``F.embedding_bag`` + index_add (deterministic on CPU, not
    on CUDA where index_add_ uses atomics). Also settable with ``DTREC_BACKEND``.

    Example::

        dtrec.ops.set_backend("triton")
    """
    global _backend
    if name not in _names():
        raise ValueError(f"unknown backend {name!r}; available: {_names()}")
    _backend = name


def get_backend() -> str:
    """The backend name as set (may be "auto")."""
    global _backend
    if _backend is None:  # read when first needed, not at import (a forked process sets it)
        _backend = os.environ.get("DTREC_BACKEND", "auto")
    if _backend not in _names():
        raise ValueError(f"DTREC_BACKEND={_backend!r} is not one of {_names()}")
    return _backend


def resolve_backend(device: torch.device) -> Backend:
    """The backend that runs the ops on tensors on ``device``.

    Example::

        resolve_backend(torch.device("cpu")).name  # "torch" under "auto"
    """
    name = get_backend()
    if name == "auto":
        if device.type == "cuda" and triton_available():
            return _REGISTRY["triton"]
        return _AUTO_FALLBACK
    if name == "triton" and not triton_available():
        raise RuntimeError("DTREC backend 'triton' was requested but triton does not import")
    if name == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "the triton backend on CPU tensors needs TRITON_INTERPRET=1 set before triton is "
            "imported (it runs the kernels in Triton's interpreter)"
        )
    return _REGISTRY[name]


_TRITON: bool | None = None


def triton_available() -> bool:
    """Whether ``import triton`` works (cached)."""
    global _TRITON
    if _TRITON is None:
        try:
            import triton  # noqa: F401

            _TRITON = True
        except Exception:  # noqa: BLE001 - any import failure means "no triton"
            _TRITON = False
    return _TRITON


__all__ = [
    "get_backend",
    "register_backend",
    "resolve_backend",
    "set_backend",
    "triton_available",
]
