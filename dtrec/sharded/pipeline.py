"""``TrainPipeline``: overlap the next batch's input-dist with this batch's compute.

Like TorchRec's ``TrainPipelineSparseDist``: before running batch i, every
sharded collection (pooled ``ShardedEmbeddingBagCollection`` and sequence
``ShardedEmbeddingCollection`` alike) starts the input-dist of batch i + 1 (a small
blocking header exchange, then the ids all-to-all left in flight), so those ids travel
while batch i runs its lookups, dense layers, backward and optimizer step. The
math is the plain loop's: same batches, same order of updates.

Offloaded tables (``RowWise(cache_rows=...)``): after batch i's forward and before its
backward, batch i + 1's cache fill starts (its missing rows gathered from host memory
and copied to the device cache, evicted rows written back), so those copies run while
batch i's backward computes; batch i's rows and batch i + 1's stay pinned in the cache.

Example::

    pipeline = dtrec.TrainPipeline(model, opt, lambda m, b: loss_fn(m(b.sparse, b.dense), b.y),
                                   sparse_features=lambda b: b.sparse)
    for loss in pipeline.run(batches):
        ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from dtrec.sharded.collection import ShardedCollection
from dtrec.sparse import KeyedJaggedTensor


def _default_sparse_features(batch: Any) -> object:
    """The batch itself if it is a KJT, its one KJT element, or ``batch.sparse_features``."""
    if isinstance(batch, KeyedJaggedTensor) or hasattr(batch, "offset_per_key"):
        return batch
    if isinstance(batch, (tuple, list)):
        found = [x for x in batch if hasattr(x, "offset_per_key")]
        if len(found) == 1:
            return found[0]
    if hasattr(batch, "sparse_features"):
        return batch.sparse_features
    raise TypeError(
        f"TrainPipeline cannot find the sparse features of a {type(batch).__name__} batch; "
        "pass sparse_features=lambda batch: <the KeyedJaggedTensor the model receives>"
    )


class TrainPipeline:
    """Runs training steps with input-dist of batch i + 1 in flight during batch i.

    ``loss_fn(model, batch)`` returns the loss of one batch and must pass the model the
    very object ``sparse_features(batch)`` returns (the prefetched input-dist is matched
    by identity). ``sparse_features`` returns that KJT, or, for a model with several
    sharded collections, a mapping from each collection's module name to its KJT.
    ``optimizer`` steps the parameters with ``.grad`` (None with only fused optimizers).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: Callable[[nn.Module, Any], Tensor],
        sparse_features: Callable[[Any], object] = _default_sparse_features,
    ) -> None:
        for name, fn in (("loss_fn", loss_fn), ("sparse_features", sparse_features)):
            if not callable(fn):
                raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
        if optimizer is not None and not all(
            callable(getattr(optimizer, m, None)) for m in ("step", "zero_grad")
        ):
            raise TypeError(
                f"optimizer must be a torch optimizer (with step() and zero_grad()) or None, "
                f"got {type(optimizer).__name__}; a dtrec.optim fused optimizer goes to "
                "dtrec.distribute_module(..., optimizer=...)"
            )
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.sparse_features = sparse_features
        self.collections = {
            name: m for name, m in model.named_modules() if isinstance(m, ShardedCollection)
        }
        if not self.collections:
            raise ValueError("TrainPipeline needs a model distributed with dtrec")

    def run(self, batches: Iterable[Any]) -> Iterator[Tensor]:
        """Train on every batch in order; yields each step's (detached) loss."""
        it = iter(batches)
        current = next(it, None)
        if current is not None:
            self._prefetch(current)
        while current is not None:
            following = next(it, None)
            if following is not None:
                self._prefetch(following)  # its ids travel while ``current`` computes
            yield self._step(current, following)
            current = following

    def _step(self, batch: Any, following: Any = None) -> Tensor:
        loss = self.loss_fn(self.model, batch)
        features = self._features(batch)
        stale = [name for name, f in features.items() if self.collections[name].is_prefetched(f)]
        if stale:
            raise RuntimeError(
                f"loss_fn did not pass the prefetched features to collection(s) {stale}: it "
                "must give the model the very object sparse_features(batch) returns"
            )
        if following is not None:  # its cache fill copies rows while this backward runs
            for name, kjt in self._features(following).items():
                self.collections[name].fill(kjt)
        loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def _prefetch(self, batch: Any) -> None:
        for name, kjt in self._features(batch).items():
            self.collections[name].prefetch(kjt)

    def _features(self, batch: Any) -> Mapping[str, object]:
        """Collection name -> the features object of ``batch`` it receives."""
        features = self.sparse_features(batch)
        if not isinstance(features, Mapping):
            if len(self.collections) != 1:
                raise ValueError(
                    f"the model has {len(self.collections)} sharded collections "
                    f"({sorted(self.collections)}): sparse_features must map each name to its "
                    "KeyedJaggedTensor"
                )
            features = {next(iter(self.collections)): features}
        unknown = sorted(set(features) - set(self.collections))
        if unknown:
            raise ValueError(
                f"sparse_features names {unknown}, not sharded collections of the model "
                f"({sorted(self.collections)})"
            )
        return features


__all__ = ["TrainPipeline"]
