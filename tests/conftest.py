"""Run Triton kernels in Triton's CPU interpreter when there is no GPU (must precede triton)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
