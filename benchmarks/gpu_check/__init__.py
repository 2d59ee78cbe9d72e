"""``make gpu-check``: everything the project measures on a GPU, in one command
(docs/gpu_check.md).

``run`` (device check, install, the timed commands, the merged report; ``python -m
benchmarks.gpu_check``), ``parts`` (each part's commands, timeouts and report summary).
Nothing here imports torch at import time: ``run`` installs it when it is missing.
"""
