"""Run Triton kernels in Triton's CPU interpreter when there is no GPU (must precede triton);
pin the CPU fused row-wise Adagrad's implementation; offloaded copies on their worker."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Offloaded tables' background copy jobs run inline on a CPU by default (no gain from a
# thread there, dtrec/sharded/offload/host.py); tests run them on the worker thread, as on
# CUDA, so its hand-offs and waits are exercised.
os.environ.setdefault("DTREC_OFFLOAD_WORKER", "1")

# The CPU fused row-wise Adagrad is chosen by timing when a model is distributed
# (dtrec/optim/cpu_choice.py): pinned here so that every test run takes the same code,
# whatever the machine's load (fbgemm's where it loads, the faster one on the CI machine's
# processor; torch's path is tested through set_backend("torch") and test_cpu_choice.py).
try:
    from dtrec.ops.backends.fbgemm_loader import fbgemm_ops

    os.environ.setdefault("DTREC_CPU_ROWWISE_ADAGRAD", "fbgemm" if fbgemm_ops() else "torch")
except ImportError:  # pragma: no cover - dtrec not importable: its tests fail on their own
    pass


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        help="run tests marked slow and the long property-based profiles",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Slow tests skip unless ``--slow``; those also marked ``always`` (a short soak that
    keeps its harness alive in CI) run anyway, and ``-m "not slow"`` still leaves them out."""
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "slow" in item.keywords and "always" not in item.keywords:
            item.add_marker(skip)
