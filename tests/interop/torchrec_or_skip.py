"""torchrec if it is importable (the ``bench`` extra), else None; and the skip mark."""

from __future__ import annotations

import pytest

try:
    import torchrec
except Exception:  # noqa: BLE001 - any import failure means "no torchrec"
    torchrec = None

needs_torchrec = pytest.mark.skipif(torchrec is None, reason="torchrec (bench extra) not installed")

__all__ = ["needs_torchrec", "torchrec"]
