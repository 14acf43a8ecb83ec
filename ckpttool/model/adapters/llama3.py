"""torchtitan Llama 3 (dense, GQA) <-> HF ``LlamaForCausalLM``.

Key map as torchtitan's own ``torchtitan/models/llama3/state_dict_adapter.py`` (0.3:
``attention.qkv_linear.wq``; earlier releases: ``attention.wq``, both read). torchtitan's
Llama applies rotary embeddings to interleaved pairs (complex multiplication), HF Llama to
the two halves of each head (``rotate_half``), so ``wq`` / ``wk`` rows are permuted per head
(``k`` with ``num_key_value_heads``). ``lm_head.weight`` is left out when the config ties it.
"""

from __future__ import annotations

from ckpttool.model.adapters.base import KeyMap, ModelAdapter
from ckpttool.model.adapters.registry import register_adapter

__all__ = ["TorchtitanLlama3"]

#: fqn fragments Llama 3 never has (Qwen3's ``q_norm`` and grouped experts)
_NOT_LLAMA3 = (".attention.q_norm.", ".moe.")

_L = r"layers\.(?P<layer>\d+)\."


@register_adapter
class TorchtitanLlama3(ModelAdapter):
    name = "torchtitan-llama3"
    description = "torchtitan Llama 3 (dense, GQA; RoPE q/k row permutation) <-> HF LlamaForCausalLM"

    naming, model_types, foreign = "torchtitan", (None, "llama"), _NOT_LLAMA3

    maps = (
        KeyMap(r"tok_embeddings\.weight", "model.embed_tokens.weight", "tok_embeddings.weight"),
        KeyMap(
            _L + r"attention\.(?:qkv_linear\.)?wq\.weight",
            "model.layers.{layer}.self_attn.q_proj.weight",
            "layers.{layer}.attention.qkv_linear.wq.weight",
            "rope_q",
        ),
        KeyMap(
            _L + r"attention\.(?:qkv_linear\.)?wk\.weight",
            "model.layers.{layer}.self_attn.k_proj.weight",
            "layers.{layer}.attention.qkv_linear.wk.weight",
            "rope_k",
        ),
        KeyMap(
            _L + r"attention\.(?:qkv_linear\.)?wv\.weight",
            "model.layers.{layer}.self_attn.v_proj.weight",
            "layers.{layer}.attention.qkv_linear.wv.weight",
        ),
        KeyMap(
            _L + r"attention\.wo\.weight",
            "model.layers.{layer}.self_attn.o_proj.weight",
            "layers.{layer}.attention.wo.weight",
        ),
        KeyMap(
            _L + r"feed_forward\.w1\.weight",
            "model.layers.{layer}.mlp.gate_proj.weight",
            "layers.{layer}.feed_forward.w1.weight",
        ),
        KeyMap(
            _L + r"feed_forward\.w3\.weight",
            "model.layers.{layer}.mlp.up_proj.weight",
            "layers.{layer}.feed_forward.w3.weight",
        ),
        KeyMap(
            _L + r"feed_forward\.w2\.weight",
            "model.layers.{layer}.mlp.down_proj.weight",
            "layers.{layer}.feed_forward.w2.weight",
        ),
        KeyMap(
            _L + r"attention_norm\.weight",
            "model.layers.{layer}.input_layernorm.weight",
            "layers.{layer}.attention_norm.weight",
        ),
        KeyMap(
            _L + r"ffn_norm\.weight",
            "model.layers.{layer}.post_attention_layernorm.weight",
            "layers.{layer}.ffn_norm.weight",
        ),
        KeyMap(r"norm\.weight", "model.norm.weight", "norm.weight"),
        KeyMap(r"(?:lm_head|output)\.weight", "lm_head.weight", "lm_head.weight"),
        KeyMap(r".*\.freqs_cis|freqs_cis", None, kind="skip", reason="RoPE table (recomputed by the model)"),
    )
