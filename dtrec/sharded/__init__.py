"""The sharded module: tables as DTensors, and one step's input-dist -> lookup ->
output-dist -> backward -> fused update -> replicate-axis gradient sync.

Entry points: ``distribute`` (``dtrec.distribute_module``) and ``tables.tensor``
(``dtrec.distribute_tensor``: a spec made into a DTensor). The collections
(``collection``, with ``module`` for pooled bags and ``sequence`` for rows) compose the
step's stages, one sub-package each, in the order they run:

* ``dist/``: input dist (validate, route and send ids) and output dist (send results
  back), with the routing and the process groups;
* ``lookup/``: this rank's batched lookup (pooled, sequence, the one-rank local path,
  the compiled form);
* ``update/``: the fused update at the end of backward and the replicate-axis sync;
* ``offload/``: tables in host memory behind a device cache of rows.

Beside the step: ``tables/`` (DTensor parameters, packed shards, DTensor op handlers),
``dense`` (the dense part replicated like DDP), ``pipeline`` (overlap the next batch's
input dist) and ``copies`` (``copy.deepcopy`` of a distributed model).
"""
