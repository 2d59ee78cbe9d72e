"""Moving a batch between ranks: the step's first and third stages.

``input_dist`` validates a batch and sends each id to the shard position(s) holding its
row, over the static ``routing`` (segments = (feature, block) pairs) with the ids laid
out in runs on the device by ``row_buckets``; ``routed_batch`` is what arrives and its
wire format. ``output_dist`` sends the pooled partials back and assembles the output;
``sequence_dist`` is its unpooled counterpart (rows, not sums). ``groups`` makes the
process groups beyond the mesh's own dims.
"""
