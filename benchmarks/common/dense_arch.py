"""The dense archs of ``benchmarks/gpu_step.py``'s DLRM step, and the dtype they compute in.

* ``small`` (``DenseArch``): bottom MLP 13 -> 256 -> D, one low-rank DCNv2 cross layer
  (rank 64) over [bottom, pooled], top MLP 256 -> 1.
* ``mlperf`` (``MLPerfDenseArch``): MLPerf DLRM-DCNv2's (TorchRec's ``DLRM_DCN`` with the
  reference's flags ``--dense_arch_layer_sizes 512,256,128 --dcn_num_layers 3
  --dcn_low_rank_dim 512 --over_arch_layer_sizes 1024,1024,512,256,1``): bottom MLP
  13 -> 512 -> 256 -> D (D = 128 in MLPerf, the tables' dim; ReLU after every layer),
  3 low-rank cross layers (``torchrec.modules.crossnet.LowRankCrossNet``:
  ``x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l``, rank 512) over [bottom, pooled]
  (``(1 + tables) * D`` wide), top MLP 1024 -> 1024 -> 512 -> 256 (ReLU) -> 1.

``dtype="bf16"`` runs the arch's forward under ``torch.autocast(<device>, bfloat16)``
(weights stay fp32, the matmuls run in bf16, the logits come back as fp32); ``"fp32"``
runs it as is (TF32 matmuls on CUDA where ``gpu_step`` enables them).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

NUM_DENSE = 13
CROSS_RANK = 64
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
"""``--dense-dtype`` -> the autocast dtype (None: no autocast)."""


class _Autocast(nn.Module):
    """Runs ``_forward`` under autocast to ``dtype`` (None: not at all); fp32 logits out."""

    def __init__(self, dtype: str) -> None:
        super().__init__()
        self.dtype = dtype
        self._autocast = DTYPES[dtype]

    def forward(self, dense: Tensor, pooled: Tensor) -> Tensor:
        if self._autocast is None:
            return self._forward(dense, pooled)
        with torch.autocast(dense.device.type, dtype=self._autocast):
            out = self._forward(dense, pooled)
        return out.float()

    def _forward(self, dense: Tensor, pooled: Tensor) -> Tensor:
        raise NotImplementedError


class DenseArch(_Autocast):
    """Bottom MLP, one low-rank DCNv2 cross layer over [bottom, pooled], top MLP."""

    def __init__(self, pooled_dim: int, dim: int, dtype: str = "fp32") -> None:
        super().__init__(dtype)
        self.bottom = nn.Sequential(nn.Linear(NUM_DENSE, 256), nn.ReLU(), nn.Linear(256, dim))
        width = dim + pooled_dim
        self.cross_v = nn.Linear(width, CROSS_RANK, bias=False)
        self.cross_u = nn.Linear(CROSS_RANK, width)
        self.top = nn.Sequential(nn.Linear(width, 256), nn.ReLU(), nn.Linear(256, 1))

    def _forward(self, dense: Tensor, pooled: Tensor) -> Tensor:
        x0 = torch.cat([torch.relu(self.bottom(dense)), pooled], dim=1)
        return self.top(x0 * self.cross_u(self.cross_v(x0)) + x0).squeeze(1)


def _mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class LowRankCross(nn.Module):
    """``layers`` low-rank DCNv2 cross layers, TorchRec's ``LowRankCrossNet``:
    ``x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l`` with ``V_l: [rank, width]``,
    ``W_l: [width, rank]``."""

    def __init__(self, width: int, layers: int, rank: int) -> None:
        super().__init__()
        self.v = nn.ModuleList(nn.Linear(width, rank, bias=False) for _ in range(layers))
        self.w = nn.ModuleList(nn.Linear(rank, width) for _ in range(layers))

    def forward(self, x0: Tensor) -> Tensor:
        x = x0
        for v, w in zip(self.v, self.w):
            x = x0 * w(v(x)) + x
        return x


class MLPerfDenseArch(_Autocast):
    """MLPerf DLRM-DCNv2's dense arch (module docstring)."""

    BOTTOM = (512, 256)
    CROSS_LAYERS, CROSS_RANK = 3, 512
    TOP = (1024, 1024, 512, 256, 1)

    def __init__(self, pooled_dim: int, dim: int, dtype: str = "fp32") -> None:
        super().__init__(dtype)
        self.bottom = _mlp([NUM_DENSE, *self.BOTTOM, dim], last_relu=True)
        width = dim + pooled_dim
        self.cross = LowRankCross(width, self.CROSS_LAYERS, self.CROSS_RANK)
        self.top = _mlp([width, *self.TOP], last_relu=False)

    def _forward(self, dense: Tensor, pooled: Tensor) -> Tensor:
        x0 = torch.cat([self.bottom(dense), pooled], dim=1)
        return self.top(self.cross(x0)).squeeze(1)


ARCHS = {"small": DenseArch, "mlperf": MLPerfDenseArch}


def make_dense_arch(kind: str, pooled_dim: int, dim: int, dtype: str = "fp32") -> _Autocast:
    """The ``kind`` arch (``ARCHS``) over ``pooled_dim`` pooled features and a ``dim``-wide
    bottom output, computing in ``dtype`` (``DTYPES``).

    Example::

        arch = make_dense_arch("mlperf", 26 * 128, 128, "bf16")
        logits = arch(dense, pooled)  # [B] fp32, the matmuls in bf16
    """
    return ARCHS[kind](pooled_dim, dim, dtype)


def linear_output_dtypes(arch: nn.Module, dense: Tensor, pooled: Tensor) -> list[str]:
    """The dtypes the arch's ``nn.Linear`` layers output in one forward (no grad): what its
    matmuls computed in."""
    seen: set[str] = set()
    hooks = [
        m.register_forward_hook(lambda _m, _a, out: seen.add(str(out.dtype)))
        for m in arch.modules()
        if isinstance(m, nn.Linear)
    ]
    try:
        with torch.no_grad():
            arch(dense, pooled)
    finally:
        for h in hooks:
            h.remove()
    return sorted(seen)
