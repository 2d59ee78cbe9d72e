"""Re-sharding a distributed model in place (``dtrec.reshard``): the moves each table's
new spec implies (``moves``), their exchange (``exchange``), the swap (``model``)."""

from dtrec.sharded.reshard.model import reshard

__all__ = ["reshard"]
