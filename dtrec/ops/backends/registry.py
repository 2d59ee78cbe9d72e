"""Which implementation the embedding-bag op runs: chosen once, read per call."""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "torch", "fbgemm")
_backend = os.environ.get("DTREC_BACKEND", "auto")


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
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; available: {BACKENDS}")
    _backend = name


def get_backend() -> str:
    """The backend name as set (may be "auto")."""
    if _backend not in BACKENDS:
        raise ValueError(f"DTREC_BACKEND={_backend!r} is not one of {BACKENDS}")
    return _backend


def resolve_backend(device: torch.device) -> str:
    """The concrete backend for tensors on ``device``."""
    name = get_backend()
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "triton" and not triton_available():
        raise RuntimeError("DTREC backend 'triton' was requested but triton does not import")
    if name == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "the triton backend on CPU tensors needs TRITON_INTERPRET=1 set before triton is "
            "imported (it runs the kernels in Triton's interpreter)"
        )
    return name


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
