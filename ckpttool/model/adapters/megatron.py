"""Megatron-core GPT (dense and MoE) -> HF ``LlamaForCausalLM`` / ``MixtralForCausalLM`` names and layouts.

The keys are megatron-core's sharded keys (``megatron/core/models/gpt/gpt_model.py``, the local
and Transformer Engine layer specs write the same ones): the layers stacked on a leading dim
``[L, ...]`` (experts ``[L, E, ...]``), the input norm fused into ``linear_qkv.layer_norm_weight``
and the pre-MLP norm into ``linear_fc1.layer_norm_weight``. Element layouts
(``megatron/core/transformer/attention.py``, ``mlp.py``):

- ``linear_qkv.weight [L, ng * (nq/ng + 2) * hd, H]``: per query group ``g``, its ``nq/ng`` query
  heads, then its key head, then its value head -> ``q_proj [nq*hd, H]``, ``k_proj``, ``v_proj``
  ``[ng*hd, H]`` (rotate-half RoPE on both sides: no row permutation);
- ``linear_fc1.weight [L, 2I, H]`` (gated): gate rows, then up rows -> ``gate_proj``, ``up_proj``;
- experts ``linear_fc1 [L, E, 2I, H]`` -> Mixtral's fused ``experts.gate_up_proj [E, 2I, H]``
  (gate first, as transformers chunks it), ``linear_fc2 [L, E, H, I]`` -> ``experts.down_proj``;
- ``router.weight [L, E, H]`` -> ``mlp.gate.weight``.

Export only (``from_hf`` answers nothing: no ``import --schema megatron``); experts fused only
(``--experts per-expert`` is refused). Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ckpttool.errors import ExportError
from ckpttool.model.adapters.base import AdapterConfig, HFTensor, ModelAdapter, NativeTensor, Skip
from ckpttool.model.adapters.registry import register_adapter

__all__ = ["MegatronGPT"]

_HF = "model.layers.{l}."
#: stacked per-layer tensors with one HF tensor per layer: suffix -> HF template
_PER_LAYER = {
    "self_attention.linear_qkv.layer_norm_weight": _HF + "input_layernorm.weight",
    "input_layernorm.weight": _HF + "input_layernorm.weight",
    "self_attention.linear_proj.weight": _HF + "self_attn.o_proj.weight",
    "mlp.linear_fc1.layer_norm_weight": _HF + "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": _HF + "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": _HF + "mlp.down_proj.weight",
    "mlp.router.weight": _HF + "mlp.gate.weight",
    "mlp.experts.experts.linear_fc1.weight": _HF + "mlp.experts.gate_up_proj",
    "mlp.experts.experts.linear_fc2.weight": _HF + "mlp.experts.down_proj",
}
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def _layers(fqn: str, shape: tuple[int, ...], pieces: list[tuple[str, tuple[int, ...], int, int]]) -> HFTensor:
    """An :class:`HFTensor` whose pieces are ``(key, shape, src row of layer 0, rows)`` blocks of every layer.

    ``shape`` is ``[L, R, ...]``; each piece takes ``rows`` rows of dim 1 starting at its offset, in every layer.
    """
    n_layers, rows = shape[0], shape[1] if len(shape) > 1 else 1
    row = math.prod(shape[2:]) if len(shape) > 2 else 1
    out_pieces: list[tuple[str, tuple[int, ...]]] = []
    runs: list[tuple[int, int, int, int]] = []
    for layer in range(n_layers):
        base = layer * rows * row
        for key, pshape, start, n in pieces:
            runs.append((base + start * row, n * row, len(out_pieces), 0))
            out_pieces.append((key.format(l=layer), pshape))
    return HFTensor(out_pieces[0][0], out_pieces[0][1], pieces=tuple(out_pieces), runs=tuple(runs))


def _qkv(fqn: str, shape: tuple[int, ...], cfg: AdapterConfig) -> HFTensor:
    nq, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    if nq is None or nkv is None or hd is None or nq % nkv:
        raise ExportError(
            f"{fqn}: splitting linear_qkv needs `num_attention_heads`, `num_key_value_heads` and `head_dim` "
            "from the model's config.json",
            fqn=fqn,
            hint="pass the model's config.json with `model_assets`",
        )
    per = nq // nkv
    if len(shape) != 3 or shape[1] != nkv * (per + 2) * hd:
        raise ExportError(
            f"{fqn}: shape {list(shape)} is not [L, {nkv} * ({per} + 2) * {hd}, H] as the config's heads say",
            fqn=fqn,
            hint="pass the config.json of the model this checkpoint was trained as",
        )
    n_layers, rows, hidden = shape
    out_pieces: list[tuple[str, tuple[int, ...]]] = []
    runs: list[tuple[int, int, int, int]] = []
    for layer in range(n_layers):
        q, k, v = len(out_pieces), len(out_pieces) + 1, len(out_pieces) + 2
        for name, n in (("q_proj", nq), ("k_proj", nkv), ("v_proj", nkv)):
            out_pieces.append((f"{_HF.format(l=layer)}self_attn.{name}.weight", (n * hd, hidden)))
        for g in range(nkv):
            src = (layer * rows + g * (per + 2) * hd) * hidden
            runs.append((src, per * hd * hidden, q, g * per * hd * hidden))
            runs.append((src + per * hd * hidden, hd * hidden, k, g * hd * hidden))
            runs.append((src + (per + 1) * hd * hidden, hd * hidden, v, g * hd * hidden))
    return HFTensor(out_pieces[0][0], out_pieces[0][1], pieces=tuple(out_pieces), runs=tuple(runs))


@register_adapter
class MegatronGPT(ModelAdapter):
    name = "megatron-gpt"
    description = "Megatron-core GPTModel dense / MoE (stacked layers) -> HF LlamaForCausalLM / MixtralForCausalLM"

    @classmethod
    def detects(cls, evidence: Any) -> bool:
        """Megatron-core names (``KeySchema.naming == "megatron"``)."""
        return bool(evidence.naming == "megatron")

    def matches(self, fqn: str) -> bool:
        return fqn in _TOP or (fqn.startswith("decoder.layers.") and self._suffix(fqn) is not None)

    @staticmethod
    def _suffix(fqn: str) -> str | None:
        rest = fqn[len("decoder.layers.") :]
        if rest in _PER_LAYER or rest in ("self_attention.linear_qkv.weight", "mlp.linear_fc1.weight"):
            return rest
        return None

    def to_hf(self, fqn: str, shape: tuple[int, ...], cfg: AdapterConfig) -> HFTensor | Skip | None:
        """Where the megatron tensor goes in HF (module docstring).

        Raises:
            ExportError (E601): ``linear_qkv`` without the config's head counts, or a shape that does not fit them;
                a gated ``linear_fc1`` with an odd number of rows.
        """
        if fqn in _TOP:
            return HFTensor(_TOP[fqn], shape)
        if not fqn.startswith("decoder.layers."):
            return None
        rest = self._suffix(fqn)
        if rest is None:
            return None
        if rest == "self_attention.linear_qkv.weight":
            return _qkv(fqn, shape, cfg)
        per_layer = shape[1:]
        if rest == "mlp.linear_fc1.weight":
            if len(shape) != 3 or shape[1] % 2:
                raise ExportError(
                    f"{fqn}: a gated linear_fc1 must be [L, 2I, H], got shape {list(shape)}",
                    fqn=fqn,
                    hint="only gated (SwiGLU) MLPs map to Llama's gate_proj/up_proj",
                )
            i = shape[1] // 2
            return _layers(
                fqn,
                shape,
                [
                    (_HF + "mlp.gate_proj.weight", (i, shape[2]), 0, i),
                    (_HF + "mlp.up_proj.weight", (i, shape[2]), i, i),
                ],
            )
        hf = _layers(fqn, shape, [(_PER_LAYER[rest], per_layer, 0, shape[1] if len(shape) > 1 else 1)])
        if ".experts.experts." in fqn:
            hf = dataclasses.replace(hf, fused_experts=True)
        return hf

    def from_hf(self, hf_key: str, shape: tuple[int, ...], cfg: AdapterConfig) -> list[NativeTensor] | Skip | None:
        """Not an import target (export only)."""
        return None
