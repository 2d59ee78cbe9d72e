"""Figures from benchmark reports: ``kernels`` (``benchmarks/kernels.py`` GB/s vs pooling),
``distributed`` (``benchmarks/distributed.py`` step time and stages), ``sequence``
(``benchmarks/sequence.py`` step time, bytes and stages). The soak's figure is
``benchmarks.soak.plot``.
"""
