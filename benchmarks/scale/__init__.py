"""What 2D buys at 8 to 4096 GPUs, predicted (issue 33; docs/scale.md).

``run`` (the workload, plans, fabric and report; ``python -m benchmarks.scale``), ``sim``
(one rank's step through dtrec's own exchanges), ``mirror_world`` (the one-process stand-in
for a W-rank process group that ``sim`` runs on).
"""
