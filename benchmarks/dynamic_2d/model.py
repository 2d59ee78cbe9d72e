"""The model, batches and TorchRec configs of benchmarks/dynamic_2d/run.py, and its weights check.

``MixedModel`` holds TorchRec's own collections (an ``EmbeddingBagCollection`` and an
``EmbeddingCollection``), so TorchRec shards it as is and dtrec converts it, both from the
same ``DMPCollectionConfig`` list (``dmp_collection_configs``). Kept apart from the runner
so the tests can build and check pieces without a world.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from benchmarks.common.workloads import per_feature_batch

LR = 0.05


@dataclass(frozen=True)
class MixedWorkload:
    """The mixed model and batch shape every library trains."""

    pooled_rows: tuple[int, ...] = (200_000, 100_000, 50_000, 20_000)
    """Rows of each pooled table ``p<i>`` (read by feature ``pf<i>``)."""
    pooled_kinds: tuple[str, ...] = ("tw:0", "rw", "cw", "tw:1")
    """TorchRec plan helper per pooled table: "tw:<shard rank>", "rw" or "cw"."""
    seq_rows: tuple[int, ...] = (100_000, 30_000)
    """Rows of each sequence table ``s<i>`` (feature ``sf<i>``)."""
    seq_kinds: tuple[str, ...] = ("rw", "cw")
    """TorchRec plan helper per sequence table."""
    pooled_dim: int = 64
    """Embedding dim of the pooled tables."""
    seq_dim: int = 32
    """Embedding dim of the sequence tables (TorchRec's EmbeddingCollection wants one)."""
    batch: int = 256
    """Samples per rank per step."""
    bag_range: tuple[int, int] = (10, 30)
    """Ids per pooled bag, uniform over this inclusive range."""
    seq_range: tuple[int, int] = (5, 15)
    """Ids per sequence, uniform over this inclusive range."""
    zipf: float = 1.1
    """Zipf exponent of the ids."""
    pooled_shards: int = 4
    """Sharding group size of the pooled collection (its replicas: W / it)."""
    seq_shards: int = 8
    """Sharding group size of the sequence collection."""

    def scaled(self, scale: float) -> MixedWorkload:
        """Every table's rows times ``scale`` (at least 1)."""
        return replace(
            self,
            pooled_rows=tuple(max(1, int(r * scale)) for r in self.pooled_rows),
            seq_rows=tuple(max(1, int(r * scale)) for r in self.seq_rows),
        )


class MixedModel(nn.Module):
    """Pooled rows + per-sample sums of the sequence rows -> a two-layer MLP (one logit).

    Outputs are read by key (a TorchRec sharded collection orders its output by sharding
    type), so every library's model computes the same function."""

    def __init__(self, w: MixedWorkload) -> None:
        super().__init__()
        import torchrec

        self.pooled = torchrec.EmbeddingBagCollection(
            [
                torchrec.EmbeddingBagConfig(
                    name=f"p{i}", num_embeddings=r, embedding_dim=w.pooled_dim,
                    feature_names=[f"pf{i}"], pooling=torchrec.PoolingType.SUM,
                )
                for i, r in enumerate(w.pooled_rows)
            ]
        )  # fmt: skip
        self.seq = torchrec.EmbeddingCollection(
            [
                torchrec.EmbeddingConfig(
                    name=f"s{i}", num_embeddings=r, embedding_dim=w.seq_dim,
                    feature_names=[f"sf{i}"],
                )
                for i, r in enumerate(w.seq_rows)
            ]
        )  # fmt: skip
        self.pooled_keys = [f"pf{i}" for i in range(len(w.pooled_rows))]
        self.seq_keys = [f"sf{i}" for i in range(len(w.seq_rows))]
        width = len(w.pooled_rows) * w.pooled_dim + len(w.seq_rows) * w.seq_dim
        self.dense = nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, kjt: object) -> Tensor:
        pooled = self.pooled(kjt).to_dict()
        parts = [pooled[k] for k in self.pooled_keys]
        seq = self.seq(kjt)
        for key in self.seq_keys:
            jt = seq[key]
            lengths, rows = jt.lengths(), jt.values()
            sample = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
            parts.append(rows.new_zeros(lengths.numel(), rows.shape[1]).index_add(0, sample, rows))
        return self.dense(torch.cat(parts, dim=1)).squeeze(1)


def reference_model(w: MixedWorkload) -> MixedModel:
    """The model every library starts from: tables uniform in +-0.1, MLP torch's init,
    all from seed 0 (so every rank builds the same one)."""
    torch.manual_seed(0)
    model = MixedModel(w)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("dense."):
                p.uniform_(-0.1, 0.1, generator=gen)
    return model


def make_batch(w: MixedWorkload, rank: int, step: int) -> tuple[list[str], Tensor, Tensor, Tensor]:
    """Rank ``rank``'s batch of step ``step``: (keys, values, key-major lengths, labels)."""
    features = [(f"pf{i}", r, w.bag_range) for i, r in enumerate(w.pooled_rows)]
    features += [(f"sf{i}", r, w.seq_range) for i, r in enumerate(w.seq_rows)]
    return per_feature_batch(features, w.batch, w.zipf, rank, step)


def dmp_collection_configs(model: MixedModel, w: MixedWorkload) -> list:
    """TorchRec ``DMPCollectionConfig`` per collection type, plans by TorchRec's helpers for
    one sharding group (ranks 0..S-1), fused SGD. Fresh objects on every call:
    ``DMPCollection`` remaps the plans in place."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import DMPCollectionConfig, ShardingPlan

    from benchmarks.common.torchrec_side import table_plan_helper

    sharders = torchrec_sharders()
    out = []
    for module, prefix, kinds, shards in (
        (model.pooled, "p", w.pooled_kinds, w.pooled_shards),
        (model.seq, "s", w.seq_kinds, w.seq_shards),
    ):
        module_plan = construct_module_sharding_plan(
            module,
            {f"{prefix}{i}": table_plan_helper(k, shards) for i, k in enumerate(kinds)},
            sharder=sharders[type(module)],
            local_size=shards,
            world_size=shards,
            device_type="cpu",
        )
        path = "pooled" if prefix == "p" else "seq"
        out.append(DMPCollectionConfig(type(module), ShardingPlan({path: module_plan}), shards))
    return out


def torchrec_sharders() -> dict[type, object]:
    """Module type -> TorchRec sharder with FBGEMM's fused exact SGD (lr ``LR``)."""
    import torchrec
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}
    return {
        torchrec.EmbeddingBagCollection: EmbeddingBagCollectionSharder(fused_params=fused),
        torchrec.EmbeddingCollection: EmbeddingCollectionSharder(fused_params=fused),
    }


def compare_weights(
    got: dict[str, Tensor], want: dict[str, Tensor], initial: dict[str, Tensor]
) -> dict:
    """How far ``got`` is from ``want`` (both trained from ``initial``), tensor by tensor.

    ``max_abs``: the largest difference; ``max_rel``: a tensor's largest difference over its
    largest weight (the numerics contract's measure), largest over tensors; ``of_update``:
    a tensor's largest difference over its largest change in training, largest over
    tensors (a sync gone wrong differs by about the update itself, so near 1);
    ``least_moved``: the smallest largest-change of any tensor (every tensor trained).
    """
    missing = sorted(set(initial) - set(got) | set(initial) - set(want))
    if missing:
        raise KeyError(f"weights missing from one side: {missing}")
    diff = {k: (got[k] - want[k]).abs().max().item() for k in initial}
    moved = {k: (want[k] - initial[k]).abs().max().item() for k in initial}
    rel = {k: diff[k] / max(want[k].abs().max().item(), 1e-30) for k in initial}
    of_update = {k: diff[k] / max(moved[k], 1e-30) for k in initial}
    worst = max(rel, key=rel.get)
    return {
        "max_abs": max(diff.values()),
        "max_rel": rel[worst],
        "worst_key": worst,
        "of_update": max(of_update.values()),
        "least_moved": min(moved.values()),
    }
