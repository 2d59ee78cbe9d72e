"""dtrec must work without fbgemm_gpu, and say so exactly once.

The module under test is loaded by file path (not ``import dtrec``) so these
tests depend neither on the state of ``dtrec/__init__.py`` nor on whether it
already touched fbgemm at import time.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MODULE_PATH = Path(__file__).resolve().parents[1] / "dtrec/ops/backends/fbgemm_loader.py"

# Run in a fresh interpreter: loads the module by path, calls it twice, reports as JSON.
PROBE = textwrap.dedent(
    """
    import importlib.util, json, sys, warnings
    spec = importlib.util.spec_from_file_location("dtrec_fbgemm_probe", {path!r})
    f = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(f)
    lazy = "fbgemm_gpu" not in sys.modules
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = f.fbgemm_available()
        second = f.fbgemm_available()
        ops_none = f.fbgemm_ops() is None
        error = f.fbgemm_error()
    print(json.dumps({{
        "lazy": lazy,
        "available": [first, second],
        "ops_none": ops_none,
        "error": error,
        "warnings": [[w.category.__name__, str(w.message)] for w in caught],
    }}))
    """
).format(path=str(MODULE_PATH))


def _load_fresh():
    spec = importlib.util.spec_from_file_location("dtrec_fbgemm_under_test", MODULE_PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _probe(extra_env: dict[str, str], pythonpath: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DTREC_DISABLE_FBGEMM", "PYTHONPATH")}
    env.update(extra_env)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_available_when_fbgemm_imports(monkeypatch):
    monkeypatch.delenv("DTREC_DISABLE_FBGEMM", raising=False)
    try:
        import fbgemm_gpu  # noqa: F401
    except Exception as exc:  # any load failure: nothing to check on this machine
        pytest.skip(f"fbgemm_gpu does not import here: {exc!r}")
    f = _load_fresh()
    assert f.fbgemm_available() is True
    assert f.fbgemm_error() is None
    ops = f.fbgemm_ops()
    assert ops is not None
    assert hasattr(ops, "asynchronous_complete_cumsum")


def test_disabled_by_env_warns_once():
    out = _probe({"DTREC_DISABLE_FBGEMM": "1"})
    assert out["lazy"]
    assert out["available"] == [False, False]
    assert out["ops_none"]
    assert len(out["warnings"]) == 1, out["warnings"]
    category, message = out["warnings"][0]
    assert category == "RuntimeWarning"
    assert "DTREC_DISABLE_FBGEMM" in message
    assert "fbgemm_gpu could not be loaded" in message


def test_broken_fbgemm_falls_back_and_warns_with_reason(tmp_path):
    fake = tmp_path / "fake_site" / "fbgemm_gpu"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise OSError("undefined symbol: fake")\n')
    out = _probe({}, pythonpath=str(fake.parent))
    assert out["lazy"]
    assert out["available"] == [False, False]
    assert out["ops_none"]
    assert "undefined symbol: fake" in out["error"]
    assert len(out["warnings"]) == 1, out["warnings"]
    category, message = out["warnings"][0]
    assert category == "RuntimeWarning"
    assert "OSError" in message and "undefined symbol: fake" in message
    assert "install fbgemm-gpu-cpu / fbgemm-gpu" in message


def test_dtrec_imports_and_runs_with_broken_fbgemm(tmp_path):
    """``import dtrec`` and a lookup must not depend on fbgemm loading."""
    fake = tmp_path / "fake_site" / "fbgemm_gpu"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise OSError("undefined symbol: fake")\n')
    repo = str(MODULE_PATH.parents[1])
    script = textwrap.dedent(
        """
        import torch, dtrec
        ebc = dtrec.EmbeddingBagCollection([dtrec.EmbeddingBagConfig("t", 10, 4)])
        kjt = dtrec.KeyedJaggedTensor(["t"], torch.tensor([1, 2, 3]), torch.tensor([2, 1]))
        print(tuple(ebc(kjt).values().shape))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "DTREC_DISABLE_FBGEMM"}
    env["PYTHONPATH"] = os.pathsep.join([str(fake.parent), repo])
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "(2, 4)"
