"""Reading rows on this rank: the step's second stage, one batched op per call.

``pooled`` pools ids on this rank's own blocks (``EmbeddingBagCollection``),
``sequence`` returns their rows (``EmbeddingCollection``), ``local_path`` is the whole
step of a sharding group of one rank (nothing routed, one op call), and ``compiled``
the same fused lookup as ops ``torch.compile`` traces whole.
"""
