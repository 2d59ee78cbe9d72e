"""Position-weighted features: learnable per-sample weights from an id's position in its bag.

TorchRec's ``PositionWeightedModule`` / ``PositionWeightedModuleCollection`` and
``FeatureProcessedEmbeddingBagCollection``, same names, attributes and state_dict keys
(``_embedding_bag_collection.embedding_bags.<table>.weight``,
``_feature_processors.<feature>.position_weight`` or
``_feature_processors.position_weights.<feature>``), so TorchRec checkpoints load.

The position weights are small dense parameters: ``distribute_module`` shards the inner
collection's tables and leaves the processors data parallel (their gradient summed over
every rank like any dense layer). The weights they compute travel with the ids to the
ranks holding the rows, and the weights' gradients travel back, so every sharding type
trains them exactly as the unsharded module does.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from dtrec.modules.features import RefusedBatch
from dtrec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor, as_kjt


def bag_positions(lengths: Tensor, num_values: int) -> Tensor:
    """Each value's position in its bag: ``[0, 1, .., len - 1]`` per bag, concatenated
    (fbgemm's ``offsets_range``)."""
    lengths = lengths.long()
    starts = torch.cumsum(lengths, 0) - lengths
    index = torch.arange(num_values, device=lengths.device)
    return index - torch.repeat_interleave(starts, lengths, output_size=num_values)


def position_weights(weight: Tensor, lengths: Tensor, num_values: int, feature: str) -> Tensor:
    """``weight[position]`` for every value; a bag longer than ``weight`` is a ValueError
    naming the feature (TorchRec's gather would fail without saying which)."""
    if lengths.numel() and num_values:
        longest = int(lengths.max())
        if longest > weight.numel():
            where = f"feature {feature!r}: " if feature else ""
            raise ValueError(
                f"{where}a bag has {longest} ids but its position weights cover "
                f"max_feature_length={weight.numel()} positions; raise max_feature_length or "
                "truncate the bags"
            )
    return weight.index_select(0, bag_positions(lengths, num_values))


def _check_length(max_feature_length: int, feature: str = "") -> None:
    if isinstance(max_feature_length, bool) or not isinstance(max_feature_length, int):
        raise TypeError(f"max_feature_length{feature} must be an int, got {max_feature_length!r}")
    if max_feature_length <= 0:
        raise ValueError(f"max_feature_length{feature} must be positive, got {max_feature_length}")


class PositionWeightedModule(nn.Module):
    """One feature's processor: per-sample weight = ``position_weight[position in bag]``.

    Initialised to ones (a plain sum until trained), as TorchRec's.

    Example::

        fp = PositionWeightedModule(max_feature_length=20)
        weighted = fp(kjt["f0"])   # JaggedTensor with weights
    """

    def __init__(self, max_feature_length: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        _check_length(max_feature_length)
        self.position_weight = nn.Parameter(torch.ones(max_feature_length, device=device))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.position_weight.fill_(1.0)

    def forward(self, features: JaggedTensor) -> JaggedTensor:
        values, lengths = features.values(), features.lengths()
        weights = position_weights(self.position_weight, lengths, values.numel(), "")
        return JaggedTensor(values, lengths, weights)


class PositionWeightedModuleCollection(nn.Module):
    """Processors of several features in one module: ``position_weights[feature]``.

    Features it has no weights for get weight 1, as in TorchRec.

    Example::

        fps = PositionWeightedModuleCollection({"f0": 20, "f1": 5})
        weighted_kjt = fps(kjt)
    """

    def __init__(
        self, max_feature_lengths: Mapping[str, int], device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        for key, length in max_feature_lengths.items():
            _check_length(length, f" of feature {key!r}")
        self.max_feature_lengths = dict(max_feature_lengths)
        self.position_weights = nn.ParameterDict(
            {
                key: nn.Parameter(torch.ones(length, device=device))
                for key, length in self.max_feature_lengths.items()
            }
        )

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for weight in self.position_weights.values():
                weight.fill_(1.0)

    def forward(self, features: object) -> KeyedJaggedTensor:
        kjt = as_kjt(features)
        per_key = {
            key: position_weights(
                self.position_weights[key], jt.lengths(), jt.values().numel(), key
            )
            for key, jt in kjt.to_dict().items()
            if key in self.position_weights
        }
        return with_weights(kjt, per_key)


def with_weights(kjt: KeyedJaggedTensor, per_key: Mapping[str, Tensor]) -> KeyedJaggedTensor:
    """``kjt`` with per-sample weights ``per_key[feature]`` (ones for other features)."""
    device = kjt.values().device
    parts = [
        per_key[key] if key in per_key else torch.ones(n, device=device)
        for key, n in zip(kjt.keys(), kjt.length_per_key(), strict=True)
    ]
    weights = torch.cat(parts) if parts else torch.zeros(0, device=device)
    variable = kjt.variable_stride_per_key()
    return KeyedJaggedTensor(
        kjt.keys(),
        kjt.values(),
        kjt.lengths(),
        weights=weights,
        stride=None if variable else kjt.stride(),
        stride_per_key_per_rank=kjt.stride_per_key_per_rank() if variable else None,
        inverse_indices=kjt.inverse_indices_or_none(),
    )


def processed_weights(processor: nn.Module, features: JaggedTensor, feature: str) -> Tensor:
    """One feature's per-sample weights from its processor: a position-weighted one
    (dtrec's or TorchRec's, by its ``position_weight``) is applied here, so a bag that is
    too long names the feature; any other is called on the ``JaggedTensor``."""
    weight = getattr(processor, "position_weight", None)
    if isinstance(weight, Tensor):
        return position_weights(weight, features.lengths(), features.values().numel(), feature)
    return processor(features).weights()


class FeatureProcessedEmbeddingBagCollection(nn.Module):
    """A weighted ``EmbeddingBagCollection`` fed by feature processors (TorchRec's FP-EBC).

    ``feature_processors``: feature name -> processor (``PositionWeightedModule``) for
    every feature of the collection, or one ``PositionWeightedModuleCollection``. The
    collection must pool with weights (``is_weighted`` True or None).

    Example::

        ebc = EmbeddingBagCollection(tables, is_weighted=True)
        fp_ebc = FeatureProcessedEmbeddingBagCollection(
            ebc, {"f0": PositionWeightedModule(20), "f1": PositionWeightedModule(5)}
        )
        pooled = fp_ebc(kjt)   # KeyedTensor, as the collection's
    """

    def __init__(
        self,
        embedding_bag_collection: nn.Module,
        feature_processors: Mapping[str, nn.Module] | nn.Module,
    ) -> None:
        super().__init__()
        configs = embedding_bag_collection.embedding_bag_configs()
        features = [f for cfg in configs for f in cfg.feature_names]
        weighted = embedding_bag_collection.is_weighted
        if (weighted() if callable(weighted) else weighted) is False:
            raise ValueError(
                "FeatureProcessedEmbeddingBagCollection needs a collection that pools with "
                "per-sample weights; build it with is_weighted=True"
            )
        if isinstance(feature_processors, Mapping):
            if set(feature_processors) != set(features):
                raise ValueError(
                    f"feature processors are given for {sorted(feature_processors)} but the "
                    f"collection's features are {sorted(features)}: give one per feature"
                )
            feature_processors = nn.ModuleDict(dict(feature_processors))
        self._embedding_bag_collection = embedding_bag_collection
        self._feature_processors = feature_processors

    def is_weighted(self) -> bool:
        return True

    def embedding_bag_configs(self) -> list:
        return self._embedding_bag_collection.embedding_bag_configs()

    def forward(self, features: object) -> KeyedTensor:
        try:
            processed: object = self._processed(features)
        except Exception as exc:
            if not getattr(self._embedding_bag_collection, "collective_forward", False):
                raise
            # a sharded collection still runs its input dist, so its peers fail this step too
            processed = RefusedBatch(exc)
        return self._embedding_bag_collection(processed)

    def _processed(self, features: object) -> KeyedJaggedTensor:
        """The batch with the processors' per-sample weights."""
        kjt = as_kjt(features)
        processors = self._feature_processors
        if isinstance(processors, nn.ModuleDict):
            per_key = {
                key: processed_weights(processors[key], jt, key)
                for key, jt in kjt.to_dict().items()
                if key in processors
            }
            return with_weights(kjt, per_key)
        return processors(kjt)
