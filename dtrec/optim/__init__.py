"""Optimizers fused into the embedding backward (typed configs; update touched rows only).

Example::

    model = dtrec.distribute_module(model, mesh, plan, optimizer=dtrec.optim.RowWiseAdagrad(lr=0.1))
"""

from dtrec.optim.base import FusedOptimizer, RowUpdate
from dtrec.optim.rules import SGD, Adam, RowWiseAdagrad

__all__ = ["SGD", "Adam", "FusedOptimizer", "RowUpdate", "RowWiseAdagrad"]
