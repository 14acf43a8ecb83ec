"""torchtitan Llama 3 (dense, GQA) <-> HF ``LlamaForCausalLM``.

Key map as torchtitan's own ``torchtitan/models/llama3/state_dict_adapter.py`` (0.3:
``attention.qkv_linear.wq``; earlier releases: ``attention.wq``, both read). torchtitan's
Llama applies rotary embeddings to interleaved pairs (complex multiplication), HF Llama to
the two halves of each head (``rotate_half``), so ``wq`` / ``wk`` rows are permuted per head
(``k`` with ``num_key_value_heads``). ``lm_head.weight`` is left out when the config ties it.
"""

from __future__ import annotations

from ckpttool.model.adapters.base import KeyMap, ModelAdapter, layer_map
from ckpttool.model.adapters.registry import register_adapter

__all__ = ["TorchtitanLlama3", "torchtitan_dense"]

#: fqn fragments Llama 3 never has (Qwen3's ``q_norm`` and grouped experts)
_NOT_LLAMA3 = (".attention.q_norm.", ".moe.")
#: the regex of ``attention.qkv_linear.w<x>.weight`` (0.3) or ``attention.w<x>.weight`` (earlier)
_QKV = r"attention\.(?:qkv_linear\.)?w{}\.weight"


def torchtitan_dense(*, rope: bool) -> tuple[KeyMap, ...]:
    """The maps of torchtitan's dense transformer names, shared by its Llama 3 and Qwen3: the token
    embedding, attention ``wq``/``wk``/``wv``/``wo``, ``feed_forward`` ``w1``/``w3``/``w2``, both norms of
    a layer, the final norm and the output head. ``rope``: ``wq``/``wk`` rows are permuted (Llama 3's
    interleaved RoPE pairs), else copied as stored (Qwen3 pairs the halves as HF does)."""
    q, k = ("rope_q", "rope_k") if rope else ("copy", "copy")
    return (
        KeyMap(r"tok_embeddings\.weight", "model.embed_tokens.weight", "tok_embeddings.weight"),
        layer_map("attention.qkv_linear.wq.weight", "self_attn.q_proj.weight", q, read=_QKV.format("q")),
        layer_map("attention.qkv_linear.wk.weight", "self_attn.k_proj.weight", k, read=_QKV.format("k")),
        layer_map("attention.qkv_linear.wv.weight", "self_attn.v_proj.weight", read=_QKV.format("v")),
        layer_map("attention.wo.weight", "self_attn.o_proj.weight"),
        layer_map("feed_forward.w1.weight", "mlp.gate_proj.weight"),
        layer_map("feed_forward.w3.weight", "mlp.up_proj.weight"),
        layer_map("feed_forward.w2.weight", "mlp.down_proj.weight"),
        layer_map("attention_norm.weight", "input_layernorm.weight"),
        layer_map("ffn_norm.weight", "post_attention_layernorm.weight"),
        KeyMap(r"norm\.weight", "model.norm.weight", "norm.weight"),
        KeyMap(r"(?:lm_head|output)\.weight", "lm_head.weight", "lm_head.weight"),
    )


@register_adapter
class TorchtitanLlama3(ModelAdapter):
    name = "torchtitan-llama3"
    description = "torchtitan Llama 3 (dense, GQA; RoPE q/k row permutation) <-> HF LlamaForCausalLM"
    import_schema = "torchtitan"

    naming, model_types, foreign = "torchtitan", (None, "llama"), _NOT_LLAMA3

    maps = (
        *torchtitan_dense(rope=True),
        KeyMap(r".*\.freqs_cis|freqs_cis", None, kind="skip", reason="RoPE table (recomputed by the model)"),
    )
