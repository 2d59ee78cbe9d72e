"""The soak harness: a long 4-rank training run under injected faults, checked against an
unsharded replay (docs/soak.md).

``run`` (CLI, fault schedule, supervisor, tally, report; ``python -m benchmarks.soak``),
``model`` (model, plans, batches), ``worker`` (one rank of one attempt), ``launch``
(fork-server ranks), ``reference`` (the unsharded replay), ``plot`` (the report's figure).
"""
