"""``DenseArch`` for ``benchmarks/scale/run.py``, which reads it from here until it imports
``benchmarks.common.dense_arch`` itself (issue 46); nothing else imports this module."""

from benchmarks.common.dense_arch import DenseArch

__all__ = ["DenseArch"]
