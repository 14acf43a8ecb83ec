"""HF-named checkpoints: the identity adapter (keys and tensors as stored)."""

from __future__ import annotations

from ckpttool.model.adapters.base import AdapterConfig, HFTensor, KeyMap, ModelAdapter, NativeTensor, Skip
from ckpttool.model.adapters.registry import register_adapter

__all__ = ["HFIdentity"]


@register_adapter
class HFIdentity(ModelAdapter):
    name = "hf"
    description = "Hugging Face names (identity: keys and tensors as stored, the export key rules apply)"
    import_schema = "torch-native"
    maps = (KeyMap(r".+", "{fqn}", "{fqn}"),)
    identity = True
    naming = "hf"

    def to_hf(self, fqn: str, shape: tuple[int, ...], cfg: AdapterConfig) -> HFTensor | Skip | None:
        return HFTensor(fqn, shape)

    def from_hf(self, hf_key: str, shape: tuple[int, ...], cfg: AdapterConfig) -> list[NativeTensor] | Skip | None:
        return [NativeTensor(hf_key, shape)]
