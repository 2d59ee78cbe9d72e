"""The tables themselves: DTensor parameters and this rank's packed shards.

``tensor`` turns a spec into a DTensor (``dtrec.distribute_tensor``) and moves tensors
into and out of a table's blocks, the one place tables meet ``DeviceMesh``;
``storage`` packs this rank's shards in one flat buffer; ``dtensor_handlers`` are the
DTensor op handlers dtrec installs for torch's ops on its tables.
"""
