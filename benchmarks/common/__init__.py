"""The harness the benchmarks share; no benchmark lives here, and nothing here imports one.

``workloads`` (the CPU side-by-side tables, Zipf ids, batches, plans and model),
``dlrm`` (the one-device DLRM workload and each library's side), ``dense_arch``,
``torchrec_side`` (TorchRec's side, imported only where TorchRec runs), ``run_loop``
(a (library, config) in a fresh world: warm-up, timed steps, census, the malloc env),
``pipeline``, ``cost_model``, ``step_prediction``, ``device`` (timing on one device),
``report`` (number formats and a run's meta). The measuring instruments are in
``benchmarks.probes``.
"""
