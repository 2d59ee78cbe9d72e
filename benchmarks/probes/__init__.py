"""Measuring tools the benchmarks (and some tests) share; no benchmark lives here.

``step`` (GPU/CPU step probes: ``StageTimer``, ``StepCounter``, ``SyncSites``,
``FullTableWatch``, ``count_steady_step``), ``stages`` (exclusive CPU time per stage of a
pooled training step, dtrec and TorchRec), ``sequence_stages`` (the same for the sequence
path), ``comm`` (bytes and calls per collective: ``CommCounter``, ``CollectiveCensus``),
``machine`` (the processor a report ran on), ``report`` (which dtrec ran, the JSON file).
"""
