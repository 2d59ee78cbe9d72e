"""dtrec with a mesh per collection vs TorchRec's dynamic 2D (``DMPCollection`` with
per-module sharding groups).

``run`` (the timed runs and the verdict; ``python -m benchmarks.dynamic_2d``), ``model``
(the model, batches, TorchRec configs and the weights check).
"""
