"""torchtune Llama (2 / 3 / 3.1, dense, GQA) <-> HF ``LlamaForCausalLM``.

Key map as torchtune's own ``torchtune/models/convert_weights.py`` (``_FROM_HF``, used by
``tune_to_hf`` / ``hf_to_tune``). torchtune's ``RotaryPositionalEmbeddings`` rotates
interleaved pairs (``x[..., 0::2]``, ``x[..., 1::2]``: Meta's layout), HF Llama the two halves
of each head (``rotate_half``), so ``tune_to_hf`` permutes the ``q_proj`` / ``k_proj`` rows per
head (``view(heads, head_dim // 2, 2, dim).transpose(1, 2)``, ``k`` with
``num_key_value_heads``): kinds ``rope_q`` / ``rope_k``, as for torchtitan. ``lm_head.weight`` is
left out when the config ties it (torchtune's ``TiedLinear`` saves no ``output.weight``).
Export only: ``ckpttool import`` writes torch-native or torchtitan keys, never torchtune's
(:meth:`TorchtuneLlama.from_hf` answers nothing).
"""

from __future__ import annotations

from ckpttool.model.adapters.base import AdapterConfig, KeyMap, ModelAdapter, NativeTensor, Skip, layer_map
from ckpttool.model.adapters.registry import register_adapter

__all__ = ["TorchtuneLlama"]

#: torchtune's names of a layer's tensors copied as stored -> HF's (``_FROM_HF`` inverted)
_COPIED = {
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.output_proj.weight": "self_attn.o_proj.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
    "sa_norm.scale": "input_layernorm.weight",
    "mlp_norm.scale": "post_attention_layernorm.weight",
}
_MAPS = (
    KeyMap(r"tok_embeddings\.weight", "model.embed_tokens.weight", "tok_embeddings.weight"),
    layer_map("attn.q_proj.weight", "self_attn.q_proj.weight", "rope_q"),
    layer_map("attn.k_proj.weight", "self_attn.k_proj.weight", "rope_k"),
    *(layer_map(ours, hf) for ours, hf in _COPIED.items()),
    KeyMap(r"norm\.scale", "model.norm.weight", "norm.scale"),
    KeyMap(r"output\.weight", "lm_head.weight", "output.weight"),
)
#: fqn fragments a torchtune Llama never has (Qwen / Gemma q/k norms, MoE experts, LoRA adapters)
_NOT_LLAMA = (".attn.q_norm.", ".attn.k_norm.", ".experts.", ".lora_", ".mlp.router.")


@register_adapter
class TorchtuneLlama(ModelAdapter):
    name = "torchtune-llama"
    description = "torchtune Llama (dense, GQA; RoPE q/k row permutation as tune_to_hf) <-> HF LlamaForCausalLM"

    naming, model_types, foreign = "torchtune", (None, "llama"), _NOT_LLAMA

    maps = _MAPS

    def from_hf(self, hf_key: str, shape: tuple[int, ...], cfg: AdapterConfig) -> list[NativeTensor] | Skip | None:
        """Not an import target (export only): a torchtitan import must not get torchtune's names."""
        return None
