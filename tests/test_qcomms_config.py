"""``dtrec.QCommsConfig``, its codecs, TorchRec's config mapped, ``qcomms=`` per collection.

The multi-process behaviour (bounds, bytes) is ``tests/distributed/test_qcomms.py``; bad
input is pinned by ``docs/errors.md`` (E180-E185).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import dtrec
from dtrec.comm.quantized import Codec
from dtrec.interop.qcomms import from_torchrec_qcomms, qcomms_per_collection
from tests.fake_world import fake_world
from tests.interop.torchrec_or_skip import needs_torchrec


def test_precisions_by_name_or_dtype() -> None:
    config = dtrec.QCommsConfig(torch.bfloat16, "FP16", replica_sync_precision=torch.float32)
    assert (config.forward_precision, config.backward_precision) == ("bf16", "fp16")
    assert config.replica_sync_precision == "fp32"
    assert config == dtrec.QCommsConfig("bf16", "fp16")  # hashable, comparable values
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.forward_precision = "fp32"  # type: ignore[misc]


def test_codecs_carry_the_right_scale() -> None:
    config = dtrec.QCommsConfig(
        "fp16", "bf16", "fp16", forward_loss_scale=4.0, backward_loss_scale=1024
    )
    assert config.forward_codec == Codec(torch.float16, 4.0)
    assert config.backward_codec == Codec(torch.bfloat16, 1024.0)
    assert config.replica_sync_codec == Codec(torch.float16, 1024.0)
    plain = dtrec.QCommsConfig(backward_precision="bf16")
    assert plain.forward_codec is None and plain.replica_sync_codec is None
    assert plain.backward_codec == Codec(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_cast_is_within_the_unit_roundoff(dtype: torch.dtype) -> None:
    codec = Codec(dtype)
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 10
    back = codec.decode(codec.encode(x), torch.float32)
    assert ((back - x).abs() <= codec.unit_roundoff * x.abs()).all()
    assert codec.unit_roundoff == {torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]


def test_loss_scale_keeps_tiny_fp16_values() -> None:
    x = torch.rand(1000, generator=torch.Generator().manual_seed(0)) * 1e-6 + 1e-7
    bound = Codec(torch.float16).unit_roundoff * x.abs()
    unscaled = Codec(torch.float16)
    scaled = Codec(torch.float16, 2.0**14)
    assert ((unscaled.decode(unscaled.encode(x), torch.float32) - x).abs() > bound).any()
    assert ((scaled.decode(scaled.encode(x), torch.float32) - x).abs() <= bound).all()


class TwoCollections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = dtrec.EmbeddingBagCollection([dtrec.EmbeddingBagConfig("t0", 10, 4, ["f0"])])
        self.b = dtrec.EmbeddingBagCollection([dtrec.EmbeddingBagConfig("t1", 6, 3, ["f1"])])


def test_one_config_or_a_dict_per_collection() -> None:
    bf16 = dtrec.QCommsConfig("bf16", "bf16")
    assert qcomms_per_collection(bf16, ["a", "b"]) == {"a": bf16, "b": bf16}
    assert qcomms_per_collection(None, ["a"]) == {"a": None}
    assert qcomms_per_collection({"b": bf16}, ["a", "b"]) == {"a": None, "b": bf16}
    with pytest.raises(TypeError, match=r"qcomms\['b'\] must be a dtrec.QCommsConfig"):
        qcomms_per_collection({"b": "bf16"}, ["a", "b"])
    with fake_world(0, 2):
        mesh = dtrec.init_mesh("cpu", 2)
        model = dtrec.distribute_module(TwoCollections(), mesh, qcomms={"a": bf16})
    assert model.a.qcomms == bf16 and model.b.qcomms is None


@needs_torchrec
def test_torchrec_config_maps_to_the_same_precisions() -> None:
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig

    torchrec_config = QCommsConfig(
        forward_precision=CommType.FP16,
        backward_precision=CommType.BF16,
        forward_loss_scale=2.0,
        backward_loss_scale=128.0,
    )
    assert from_torchrec_qcomms(torchrec_config) == dtrec.QCommsConfig(
        "fp16", "bf16", forward_loss_scale=2.0, backward_loss_scale=128.0
    )
    # fbgemm's codec ignores a loss scale on an fp32 exchange; so does the mapping
    dropped = QCommsConfig(CommType.FP32, CommType.FP16, forward_loss_scale=3.0)
    assert from_torchrec_qcomms(dropped) == dtrec.QCommsConfig("fp32", "fp16")
    for unsupported in (CommType.FP8, CommType.INT8, CommType.MX4):
        with pytest.raises(ValueError, match=f"CommType.{unsupported.name}, which dtrec"):
            from_torchrec_qcomms(QCommsConfig(backward_precision=unsupported))
    mapped = qcomms_per_collection({"a": torchrec_config}, ["a", "b"])
    assert mapped["a"] == from_torchrec_qcomms(torchrec_config) and mapped["b"] is None
