"""HF-named checkpoints: the identity adapter (keys and tensors as stored)."""

from __future__ import annotations

from ckpttool.model.adapters.base import AdapterConfig, HFTensor, KeyMap, ModelAdapter, NativeTensor, Skip

__all__ = ["HFIdentity"]


class HFIdentity(ModelAdapter):
    name = "hf"
    description = "Hugging Face names (identity: keys and tensors as stored, the export key rules apply)"
    maps = (KeyMap(r".+", "{fqn}", "{fqn}"),)

    def to_hf(self, fqn: str, shape: tuple[int, ...], cfg: AdapterConfig) -> HFTensor | Skip | None:
        return HFTensor(fqn, shape)

    def from_hf(self, hf_key: str, shape: tuple[int, ...], cfg: AdapterConfig) -> list[NativeTensor] | Skip | None:
        return [NativeTensor(hf_key, shape)]
