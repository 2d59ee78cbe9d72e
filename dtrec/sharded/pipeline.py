"""``TrainPipeline``: overlap the next batch's input-dist with this batch's compute.

Like TorchRec's ``TrainPipelineSparseDist``: before running batch i, every
sharded collection (pooled ``ShardedEmbeddingBagCollection`` and sequence
``ShardedEmbeddingCollection`` alike) starts the input-dist of batch i + 1 (a small
blocking header exchange, then the ids all-to-all left in flight), so those ids travel
while batch i runs its lookups, dense layers, backward and optimizer step. The
math is the plain loop's: same batches, same order of updates.

Which part of a batch each collection reads is found as TorchRec's pipeline finds it,
by the collections' forward inputs: during the first step a forward pre-hook records
the object each collection receives, and its place in the batch (the batch itself, an
item, an attribute, a chain of them) is looked up; later batches are prefetched from
the same places. The first step's own input-dist runs in its forward (nothing to
overlap it with yet); batch 2's is started right after that forward, during backward.
``sparse_features`` (a function of the batch) names them instead.

Offloaded tables (``RowWise(cache_rows=...)``): after batch i's forward and before its
backward, batch i + 1's cache fill starts (its missing rows gathered from host memory
and copied to the device cache, evicted rows written back), so those copies run while
batch i's backward computes; batch i's rows and batch i + 1's stay pinned in the cache.

Example::

    pipeline = dtrec.TrainPipeline(model, opt)     # model(batch) -> (loss, output), TorchRec's
    it = iter(dataloader)
    while True:
        try:
            output = pipeline.progress(it)         # StopIteration when the batches run out
        except StopIteration:
            break
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from dtrec.sharded.collection import ShardedCollection

Path = tuple[tuple[str, object], ...]
"""Where a collection's features sit in a batch: ("attr", name) / ("item", key) steps."""

_MAX_DEPTH = 3


def find_in_batch(batch: object, target: object, depth: int = _MAX_DEPTH) -> Path | None:
    """The path from ``batch`` to the very object ``target`` (identity), or None.

    Looks through tuples and lists (by index), mappings (by key) and objects' attributes
    (``vars``, or a dataclass's / TorchRec ``Batch``'s fields), ``depth`` levels deep.
    """
    if batch is target:
        return ()
    if depth == 0 or isinstance(batch, (Tensor, str, bytes, int, float, bool)) or batch is None:
        return None
    children: list[tuple[tuple[str, object], object]] = []
    if isinstance(batch, (tuple, list)):
        children = [(("item", i), v) for i, v in enumerate(batch)]
    elif isinstance(batch, Mapping):
        children = [(("item", k), v) for k, v in batch.items()]
    elif hasattr(batch, "__dict__"):
        children = [(("attr", k), v) for k, v in vars(batch).items() if not k.startswith("_")]
    for step, child in children:
        found = find_in_batch(child, target, depth - 1)
        if found is not None:
            return (step, *found)
    return None


def follow(batch: object, path: Path) -> object:
    """The object at ``path`` in ``batch`` (``find_in_batch``'s inverse)."""
    for kind, key in path:
        batch = getattr(batch, key) if kind == "attr" else batch[key]  # type: ignore[index]
    return batch


def _recorder(seen: dict[str, object], name: str) -> Callable[[nn.Module, tuple], None]:
    """A forward pre-hook keeping the first input ``name``'s forward receives."""

    def record(module: nn.Module, args: tuple) -> None:
        if args:
            seen.setdefault(name, args[0])

    return record


def _describe(path: Path) -> str:
    return "batch" + "".join(f".{k}" if kind == "attr" else f"[{k!r}]" for kind, k in path)


class TrainPipeline:
    """Runs training steps with input-dist of batch i + 1 in flight during batch i.

    ``loss_fn(model, batch)`` returns the loss of one batch, or ``(loss, output)``;
    without it the model is called as TorchRec's pipeline calls it, ``model(batch)``,
    returning ``(loss, output)`` (the loss is summed before backward). The model must get
    the very objects of the batch its collections read (the prefetched input-dist is
    matched by identity). ``sparse_features``, when given, returns those objects: one
    KJT, or for several sharded collections a mapping from each collection's module name
    to its KJT; by default they are found by the collections' forward inputs (module
    docstring). ``optimizer`` steps the parameters with ``.grad`` (None with only fused
    optimizers).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: Callable[[nn.Module, Any], Any] | None = None,
        sparse_features: Callable[[Any], object] | None = None,
    ) -> None:
        for name, fn in (("loss_fn", loss_fn), ("sparse_features", sparse_features)):
            if fn is not None and not callable(fn):
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
        self.paths: dict[str, Path] | None = None
        """Collection name -> where its features sit in a batch (found at the first step)."""
        self._fetched: deque[Any] = deque()  # batches taken from the iterator, not yet run
        self._prefetched: set[int] = set()  # ids of the batches in _fetched already prefetched

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Run one training step, TorchRec's ``TrainPipelineSparseDist.progress``: take the
        next batch (and the one after it, to prefetch) from ``dataloader_iter``, train on
        the first and return its output (the loss when ``loss_fn`` returns only a loss).
        Raises ``StopIteration`` once every batch has been trained on."""
        return self._advance(dataloader_iter)[1]

    def run(self, batches: Iterable[Any]) -> Iterator[Tensor]:
        """Train on every batch in order; yields each step's (detached) loss."""
        it = iter(batches)
        while True:
            try:
                loss, _ = self._advance(it)
            except StopIteration:
                return
            yield loss

    def _advance(self, it: Iterator[Any]) -> tuple[Tensor, Any]:
        if not self._fetched:
            self._fetched.append(next(it))  # StopIteration: no batch left
            self._maybe_prefetch(self._fetched[0])
        current = self._fetched.popleft()
        following = next(it, _END)
        if following is not _END:
            self._fetched.append(following)
            self._maybe_prefetch(following)  # its ids travel while ``current`` computes
        return self._step(current)

    def _maybe_prefetch(self, batch: Any) -> None:
        features = self._features(batch)
        if features is None:
            return  # places not known yet: the first step finds them
        for name, kjt in features.items():
            self.collections[name].prefetch(kjt)
        self._prefetched.add(id(batch))

    def _step(self, batch: Any) -> tuple[Tensor, Any]:
        discovering = self.paths is None and self.sparse_features is None
        seen: dict[str, object] = {}
        hooks = []
        if discovering:
            for name, module in self.collections.items():
                hooks.append(module.register_forward_pre_hook(_recorder(seen, name)))
        try:
            result = self.loss_fn(self.model, batch) if self.loss_fn else self.model(batch)
        finally:
            for hook in hooks:
                hook.remove()
        loss, output = result if isinstance(result, tuple) else (result, None)
        if not isinstance(loss, Tensor):
            raise TypeError(
                "the step must return a loss tensor or (loss, output) (TorchRec's model(batch) "
                f"convention), got {type(result).__name__}"
            )
        if discovering:
            self.paths = self._find_paths(batch, seen)
            for following in self._fetched:  # the next batch: prefetch it during backward
                if id(following) not in self._prefetched:
                    self._maybe_prefetch(following)
        if id(batch) in self._prefetched:
            self._prefetched.discard(id(batch))
            features = self._features(batch) or {}
            stale = [n for n, f in features.items() if self.collections[n].is_prefetched(f)]
            if stale:
                raise RuntimeError(
                    f"loss_fn did not pass the prefetched features to collection(s) {stale}: "
                    "it must give the model the very object sparse_features(batch) returns"
                )
        for following in self._fetched:  # its cache fill copies rows while this backward runs
            if id(following) in self._prefetched:
                for name, kjt in (self._features(following) or {}).items():
                    self.collections[name].fill(kjt)
        loss.sum().backward()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        loss = loss.detach()
        return loss, (output if isinstance(result, tuple) else loss)

    def _find_paths(self, batch: Any, seen: Mapping[str, object]) -> dict[str, Path]:
        """Where each collection's forward input of the first step sits in ``batch``."""
        missing = sorted(set(self.collections) - set(seen))
        if missing:
            raise RuntimeError(
                f"sharded collection(s) {missing} were not called in the first step: "
                "TrainPipeline finds each collection's features by what its forward receives; "
                "pass sparse_features=lambda batch: {name: features} for a model that skips "
                "collections"
            )
        paths = {}
        for name in self.collections:
            path = find_in_batch(batch, seen[name])
            if path is None:
                raise TypeError(
                    f"TrainPipeline cannot find the features collection {name!r} received in "
                    f"the {type(batch).__name__} batch: it prefetches objects the batch holds "
                    "(the batch, its items or attributes), not ones built in forward; pass "
                    "sparse_features=lambda batch: <the KeyedJaggedTensor the model receives>"
                )
            paths[name] = path
        return paths

    def _features(self, batch: Any) -> Mapping[str, object] | None:
        """Collection name -> the features object of ``batch`` it receives (None: not
        known before the first step)."""
        if self.sparse_features is None:
            if self.paths is None:
                return None
            return {name: follow(batch, path) for name, path in self.paths.items()}
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

    def describe(self) -> dict[str, str]:
        """Collection name -> where its features are read in a batch (after the first step)."""
        return {name: _describe(path) for name, path in (self.paths or {}).items()}


_END = object()

__all__ = ["TrainPipeline", "find_in_batch", "follow"]
