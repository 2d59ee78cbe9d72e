"""The sharded module: tables as DTensors, and one step's input-dist -> lookup ->
output-dist -> backward -> fused update -> replicate-axis gradient sync.

``distribute`` is the entry point (``dtrec.distribute_module``); ``module`` composes
the stages; ``tensor`` turns a spec into a DTensor (``dtrec.distribute_tensor``).
"""
