"""``distribute_module``'s ``qcomms=`` argument as one dtrec ``QCommsConfig`` per collection.

It takes a dtrec ``QCommsConfig``, TorchRec's ``QCommsConfig``
(``torchrec.distributed.fbgemm_qcomm_codec``, recognised by name and fields: torchrec is
never imported), a dict of either keyed by collection FQN, or None (fp32 everywhere).
TorchRec's ``CommType`` FP32 / FP16 / BF16 map to dtrec's precisions; FP8, INT8 and MX4
(row-wise scaled formats dtrec does not send) are a ValueError. TorchRec drops a loss
scale whose direction stays fp32 (fbgemm's codec ignores it); so does the mapping.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from dtrec.comm.qcomms import PRECISIONS, QCommsConfig


def is_torchrec_qcomms(obj: object) -> bool:
    """Whether ``obj`` is TorchRec's ``QCommsConfig`` (by class name and fields)."""
    return (
        type(obj).__name__ == "QCommsConfig"
        and not isinstance(obj, QCommsConfig)
        and all(hasattr(obj, f) for f in ("forward_precision", "backward_precision"))
    )


def from_torchrec_qcomms(config: object) -> QCommsConfig:
    """dtrec's ``QCommsConfig`` for TorchRec's (same precisions and loss scales).

    Example::

        from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig
        from_torchrec_qcomms(QCommsConfig(CommType.FP16, CommType.BF16))
        # QCommsConfig(forward_precision='fp16', backward_precision='bf16', ...)
    """
    fields: dict[str, object] = {}
    for direction in ("forward", "backward"):
        comm_type = getattr(config, f"{direction}_precision")
        name = str(getattr(comm_type, "value", comm_type)).lower()
        if name not in PRECISIONS:
            shown = _enum_name(comm_type)
            raise ValueError(
                f"TorchRec QCommsConfig.{direction}_precision is {shown}, which dtrec does "
                f"not send; dtrec's precisions are {list(PRECISIONS)} (CommType.FP32, FP16, BF16)"
            )
        fields[f"{direction}_precision"] = name
        scale = getattr(config, f"{direction}_loss_scale", None)
        if name != "fp32":
            fields[f"{direction}_loss_scale"] = scale
    return QCommsConfig(**fields)  # type: ignore[arg-type]


def _enum_name(value: object) -> str:
    name = getattr(value, "name", None)
    return f"{type(value).__name__}.{name}" if isinstance(name, str) else repr(value)


def as_qcomms_config(value: object, where: str = "qcomms") -> QCommsConfig | None:
    """``value`` as dtrec's ``QCommsConfig`` (None stays None); TypeError for anything else."""
    if value is None or isinstance(value, QCommsConfig):
        return value
    if is_torchrec_qcomms(value):
        return from_torchrec_qcomms(value)
    raise TypeError(
        f"{where} must be a dtrec.QCommsConfig, a TorchRec QCommsConfig, a dict "
        f"{{collection fqn: config}} or None, got {type(value).__name__}"
    )


def qcomms_per_collection(
    qcomms: object, collections: Collection[str]
) -> dict[str, QCommsConfig | None]:
    """Collection FQN -> its ``QCommsConfig`` (None: fp32) for ``distribute_module``'s
    ``qcomms``: one config for every collection, or a dict naming some of them."""
    if not isinstance(qcomms, Mapping):
        config = as_qcomms_config(qcomms, "qcomms")
        return {fqn: config for fqn in collections}
    unknown = sorted(set(qcomms) - set(collections))
    if unknown:
        raise KeyError(
            f"qcomms names collection(s) {unknown}, which the model does not have; its "
            f"collections are {sorted(collections)}"
        )
    return {fqn: as_qcomms_config(qcomms.get(fqn), f"qcomms[{fqn!r}]") for fqn in collections}


__all__ = [
    "as_qcomms_config",
    "from_torchrec_qcomms",
    "is_torchrec_qcomms",
    "qcomms_per_collection",
]
