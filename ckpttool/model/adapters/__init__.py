"""Model adapters: one family's key maps and tensor transforms between a trainer's names and HF's.

Torch-free (names and shapes only; the export / import streaming path moves the bytes).
Built in (:data:`ADAPTERS`): ``torchtitan-llama3``, ``torchtitan-qwen3``, ``hf`` (identity).
Selected with ``--adapter NAME`` or by :func:`detect_adapter` from the key schema's naming,
the keys and the config's ``model_type``. See ``docs/export.md`` ("Model adapters").

Usage::

    from ckpttool.model.adapters import AdapterConfig, get_adapter
    ad = get_adapter("torchtitan-llama3")
    ad.to_hf("layers.0.attention.wq.weight", (4096, 4096), AdapterConfig.from_hf_config(cfg))
"""

from __future__ import annotations

from typing import Any

from ckpttool.errors import UsageError
from ckpttool.model.adapters.base import (
    AdapterConfig,
    HFTensor,
    KeyMap,
    ModelAdapter,
    NativeTensor,
    Skip,
    rope_from_hf_rows,
    rope_to_hf_rows,
)
from ckpttool.model.adapters.identity import HFIdentity
from ckpttool.model.adapters.llama3 import TorchtitanLlama3
from ckpttool.model.adapters.qwen3 import TorchtitanQwen3

__all__ = [
    "ADAPTERS",
    "AdapterConfig",
    "HFTensor",
    "KeyMap",
    "ModelAdapter",
    "NativeTensor",
    "Skip",
    "detect_adapter",
    "get_adapter",
    "rope_from_hf_rows",
    "rope_to_hf_rows",
]

#: name -> adapter class, in the order ``--adapter`` lists them.
ADAPTERS: dict[str, type[ModelAdapter]] = {a.name: a for a in (TorchtitanLlama3, TorchtitanQwen3, HFIdentity)}


def get_adapter(name: str) -> ModelAdapter:
    """The built-in adapter ``name``.

    Raises:
        UsageError: an unknown name (the message lists the built-in ones).
    """
    cls = ADAPTERS.get(name)
    if cls is None:
        raise UsageError(
            f"`adapter` {name!r} is not one of {', '.join(ADAPTERS)}",
            param="adapter",
            hint="omit it to detect the adapter from the checkpoint's key names",
        )
    return cls()


def detect_adapter(naming: str, fqns: list[str], config: dict[str, Any] | None = None) -> ModelAdapter | None:
    """The adapter for a checkpoint whose model fqns follow ``naming`` (``KeySchema.naming``).

    ``hf`` naming -> the identity; ``torchtitan`` naming -> ``torchtitan-qwen3`` when the
    config's ``model_type`` starts with ``qwen3`` or the keys hold Qwen3's ``q_norm`` /
    grouped experts, ``torchtitan-llama3`` when the config says ``llama`` or nothing
    contradicts it; ``None`` when no built-in adapter fits (unknown naming, or a config
    of another family).
    """
    if naming == "hf":
        return HFIdentity()
    if naming != "torchtitan":
        return None
    mt = AdapterConfig.from_hf_config(config).model_type
    qwen_keys = any(".attention.q_norm." in f or ".moe." in f for f in fqns)
    if mt is not None:
        if mt.startswith("qwen3"):
            return TorchtitanQwen3()
        if mt == "llama":
            return None if qwen_keys else TorchtitanLlama3()
        return None
    return TorchtitanQwen3() if qwen_keys else TorchtitanLlama3()
