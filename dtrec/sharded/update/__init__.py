"""Updating the tables at the end of backward: fused optimizer and replica sync.

``fused_update`` stashes the lookups' backward inputs and runs one update per table
when backward ends (no table-sized gradient); ``sync_plan`` says which ranks sum each
table's gradient and ``grad_sync`` sums the row-sparse gradients over them, coalesced;
``fused_optimizer`` is the ``torch.optim.Optimizer`` face of the fused update's state.
"""
