"""Model adapters: one family's key maps and tensor transforms between a trainer's names and HF's.

Torch-free (names and shapes only; the export / import streaming path moves the bytes).
Each adapter module registers its class (:func:`~.registry.register_adapter`) with its
detection predicate (:meth:`ModelAdapter.detects`); :data:`ADAPTERS` holds them by name:
``torchtitan-llama3``, ``torchtitan-qwen3``, ``megatron-gpt``, ``torchtune-llama``, ``olmo-core-llama``,
``olmo-core-olmo2``, ``hf`` (identity). Selected with ``--adapter NAME`` or by :func:`detect_adapter` (the one
adapter whose predicate claims the key schema's naming, the keys and the config's ``model_type``). See ``docs/export.md``
("Model adapters").

Usage::

    from ckpttool.model.adapters import AdapterConfig, get_adapter
    ad = get_adapter("torchtitan-llama3")
    ad.to_hf("layers.0.attention.wq.weight", (4096, 4096), AdapterConfig.from_hf_config(cfg))
"""

from __future__ import annotations

# the built-in adapters register themselves on import, in the order ``--adapter`` lists them
from ckpttool.model.adapters import llama3, qwen3, megatron, torchtune_llama, olmo_core, identity  # noqa: F401  # isort: skip
from ckpttool.model.adapters.base import (
    CONFIG_HINT,
    AdapterConfig,
    HFTensor,
    KeyMap,
    ModelAdapter,
    NativeTensor,
    Skip,
    rope_from_hf_rows,
    rope_to_hf_rows,
)
from ckpttool.model.adapters.registry import (
    ADAPTERS,
    Evidence,
    adapter_metavar,
    adapters_by_config,
    detect_adapter,
    get_adapter,
    import_adapters,
    register_adapter,
)

__all__ = [
    "CONFIG_HINT",
    "ADAPTERS",
    "AdapterConfig",
    "Evidence",
    "HFTensor",
    "KeyMap",
    "ModelAdapter",
    "NativeTensor",
    "Skip",
    "adapter_metavar",
    "adapters_by_config",
    "detect_adapter",
    "get_adapter",
    "import_adapters",
    "register_adapter",
    "rope_from_hf_rows",
    "rope_to_hf_rows",
]
