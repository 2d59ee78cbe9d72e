"""Optional, lazy loading of ``fbgemm_gpu``.

fbgemm_gpu ships compiled operator libraries built against one exact torch
release (fbgemm 1.8.0 <-> torch 2.13, 1.7 <-> 2.12, ...). A mismatched pair is
the most common install failure of TorchRec users: ``import fbgemm_gpu`` dies
with an ``OSError: ... undefined symbol``, a ``RuntimeError`` from operator
registration, or an ``ImportError``, and everything importing it dies with it.

dtrec therefore never needs fbgemm. Its own torch/Triton kernels are always
there; fbgemm is only an optional fast CPU backend and a baseline. This module
tries ``import fbgemm_gpu`` once, on first use (never at ``import dtrec``),
catches *any* exception, and on failure emits exactly one ``RuntimeWarning``
per process and reports fbgemm as unavailable.

Setting the environment variable ``DTREC_DISABLE_FBGEMM=1`` (any value other
than empty, ``0``, ``false``, ``no`` or ``off``) forces fbgemm to be unavailable
without importing it. That case also warns once, saying it was disabled by the
environment variable, so that a slow run is never silently missing its backend.
The variable is read on the first call only; the result is cached.
"""

from __future__ import annotations

import os
import threading
import warnings
from types import ModuleType
from typing import Any

__all__ = ["fbgemm_available", "fbgemm_ops", "fbgemm_module", "fbgemm_error"]

DISABLE_ENV = "DTREC_DISABLE_FBGEMM"

# An op every fbgemm_gpu build registers; if it is missing, the libraries did not load.
_PROBE_OP = "asynchronous_complete_cumsum"

_lock = threading.Lock()
_loaded = False
_module: ModuleType | None = None
_error: str | None = None


def _env_disabled() -> bool:
    value = os.environ.get(DISABLE_ENV, "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def _short_reason(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if len(first) > 200:
        first = first[:197] + "..."
    name = type(exc).__name__
    return f"{name}: {first}" if first else name


def _try_import() -> tuple[ModuleType | None, str | None]:
    if _env_disabled():
        return None, f"disabled by {DISABLE_ENV}={os.environ.get(DISABLE_ENV)}"
    try:
        import fbgemm_gpu  # deliberately lazy: never at `import dtrec`
        import torch

        if not hasattr(torch.ops.fbgemm, _PROBE_OP):
            return None, f"torch.ops.fbgemm.{_PROBE_OP} is not registered"
        return fbgemm_gpu, None
    except Exception as exc:  # OSError (undefined symbol), ImportError, RuntimeError, ...
        return None, _short_reason(exc)


def _load() -> ModuleType | None:
    global _loaded, _module, _error
    if _loaded:
        return _module
    with _lock:
        if not _loaded:
            _module, _error = _try_import()
            _loaded = True
            if _module is None:
                warnings.warn(
                    f"fbgemm_gpu could not be loaded ({_error}); dtrec uses its own "
                    "torch/Triton kernels; install fbgemm-gpu-cpu / fbgemm-gpu matching "
                    "your torch to enable it",
                    RuntimeWarning,
                    stacklevel=4,
                )
    return _module


def fbgemm_available() -> bool:
    """True if ``fbgemm_gpu`` imported and registered its ops. Never raises."""
    return _load() is not None


def fbgemm_module() -> ModuleType | None:
    """The imported ``fbgemm_gpu`` package, or None if unavailable."""
    return _load()


def fbgemm_ops() -> Any | None:
    """``torch.ops.fbgemm`` if fbgemm is available, else None. Never raises."""
    if _load() is None:
        return None
    import torch

    return torch.ops.fbgemm


def fbgemm_error() -> str | None:
    """Why fbgemm is unavailable (after the first attempt), or None."""
    _load()
    return _error
