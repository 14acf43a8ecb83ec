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

from ckpttool.model.adapters.base import AdapterConfig, KeyMap, ModelAdapter, NativeTensor, Skip
from ckpttool.model.adapters.registry import register_adapter

__all__ = ["TorchtuneLlama"]

#: fqn fragments a torchtune Llama never has (Qwen / Gemma q/k norms, MoE experts, LoRA adapters)
_NOT_LLAMA = (".attn.q_norm.", ".attn.k_norm.", ".experts.", ".lora_", ".mlp.router.")

_L = r"layers\.(?P<layer>\d+)\."


@register_adapter
class TorchtuneLlama(ModelAdapter):
    name = "torchtune-llama"
    description = "torchtune Llama (dense, GQA; RoPE q/k row permutation as tune_to_hf) <-> HF LlamaForCausalLM"

    naming, model_types, foreign = "torchtune", (None, "llama"), _NOT_LLAMA

    maps = (
        KeyMap(r"tok_embeddings\.weight", "model.embed_tokens.weight", "tok_embeddings.weight"),
        KeyMap(
            _L + r"attn\.q_proj\.weight",
            "model.layers.{layer}.self_attn.q_proj.weight",
            "layers.{layer}.attn.q_proj.weight",
            "rope_q",
        ),
        KeyMap(
            _L + r"attn\.k_proj\.weight",
            "model.layers.{layer}.self_attn.k_proj.weight",
            "layers.{layer}.attn.k_proj.weight",
            "rope_k",
        ),
        KeyMap(
            _L + r"attn\.v_proj\.weight",
            "model.layers.{layer}.self_attn.v_proj.weight",
            "layers.{layer}.attn.v_proj.weight",
        ),
        KeyMap(
            _L + r"attn\.output_proj\.weight",
            "model.layers.{layer}.self_attn.o_proj.weight",
            "layers.{layer}.attn.output_proj.weight",
        ),
        KeyMap(_L + r"mlp\.w1\.weight", "model.layers.{layer}.mlp.gate_proj.weight", "layers.{layer}.mlp.w1.weight"),
        KeyMap(_L + r"mlp\.w3\.weight", "model.layers.{layer}.mlp.up_proj.weight", "layers.{layer}.mlp.w3.weight"),
        KeyMap(_L + r"mlp\.w2\.weight", "model.layers.{layer}.mlp.down_proj.weight", "layers.{layer}.mlp.w2.weight"),
        KeyMap(_L + r"sa_norm\.scale", "model.layers.{layer}.input_layernorm.weight", "layers.{layer}.sa_norm.scale"),
        KeyMap(
            _L + r"mlp_norm\.scale",
            "model.layers.{layer}.post_attention_layernorm.weight",
            "layers.{layer}.mlp_norm.scale",
        ),
        KeyMap(r"norm\.scale", "model.norm.weight", "norm.scale"),
        KeyMap(r"output\.weight", "lm_head.weight", "output.weight"),
    )

    def from_hf(self, hf_key: str, shape: tuple[int, ...], cfg: AdapterConfig) -> list[NativeTensor] | Skip | None:
        """Not an import target (export only): a torchtitan import must not get torchtune's names."""
        return None
