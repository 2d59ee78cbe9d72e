"""The sharded module: tables as DTensors, and one step's input-dist -> lookup ->
output-dist -> backward -> fused update -> replicate-axis gradient sync.

Entry points: ``distribute`` (``dtrec.distribute_module``) and ``tensor``
(``dtrec.distribute_tensor``: a spec made into a DTensor). ``module`` composes the
stages, one file each: ``input_dist`` (with ``routing``), ``lookup``,
``output_dist``, ``fused_update``, ``sync_plan`` + ``grad_sync`` (replicate-axis
sync), over the tables in ``storage``; ``groups`` makes the extra process groups;
``pipeline`` overlaps the next batch's input dist with this one.
"""
