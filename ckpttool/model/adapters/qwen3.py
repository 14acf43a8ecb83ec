"""torchtitan Qwen3 (dense and MoE) <-> HF ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``.

Key map as torchtitan's own ``torchtitan/models/qwen3/state_dict_adapter.py`` (0.3 names
``moe.routed_experts.inner_experts.w1_EFD`` ...; earlier ``moe.experts.w1``, both read).
Qwen3 uses HF's half-split rotary pairing in both, so ``wq`` / ``wk`` are copied as stored.
Grouped experts: ``w1`` / ``w3`` ``[E, I, H]`` become the two halves (gate first) of HF's fused
``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``w2`` ``[E, H, I]`` is ``mlp.experts.down_proj``;
``--experts per-expert`` writes ``mlp.experts.{j}.gate_proj/up_proj/down_proj.weight`` instead.
The router is ``mlp.gate.weight``; torchtitan's load-balancing ``expert_bias`` buffer has no HF
counterpart and is left out (as torchtitan's adapter does).
"""

from __future__ import annotations

from typing import Any

from ckpttool.model.adapters.base import KeyMap, ModelAdapter
from ckpttool.model.adapters.registry import register_adapter

__all__ = ["TorchtitanQwen3"]

_L = r"layers\.(?P<layer>\d+)\."
_EXP = r"moe\.(?:routed_experts\.inner_experts|experts)\."
_HF = "model.layers.{layer}."
#: fqn fragments of Qwen3 that Llama 3 lacks (``q_norm``, grouped experts)
_QWEN3_ONLY = (".attention.q_norm.", ".moe.")


@register_adapter
class TorchtitanQwen3(ModelAdapter):
    name = "torchtitan-qwen3"
    description = "torchtitan Qwen3 dense / MoE <-> HF Qwen3ForCausalLM / Qwen3MoeForCausalLM (fused or per-expert)"

    @classmethod
    def detects(cls, evidence: Any) -> bool:
        """torchtitan names and a config whose ``model_type`` starts with ``qwen3``, or no config and Qwen3 keys."""
        if evidence.naming != "torchtitan":
            return False
        mt = evidence.model_type
        if mt is not None:
            return bool(mt.startswith("qwen3"))
        return bool(evidence.any_fqn_contains(*_QWEN3_ONLY))

    maps = (
        KeyMap(r"tok_embeddings\.weight", "model.embed_tokens.weight", "tok_embeddings.weight"),
        KeyMap(
            _L + r"attention\.(?:qkv_linear\.)?wq\.weight",
            _HF + "self_attn.q_proj.weight",
            "layers.{layer}.attention.qkv_linear.wq.weight",
        ),
        KeyMap(
            _L + r"attention\.(?:qkv_linear\.)?wk\.weight",
            _HF + "self_attn.k_proj.weight",
            "layers.{layer}.attention.qkv_linear.wk.weight",
        ),
        KeyMap(
            _L + r"attention\.(?:qkv_linear\.)?wv\.weight",
            _HF + "self_attn.v_proj.weight",
            "layers.{layer}.attention.qkv_linear.wv.weight",
        ),
        KeyMap(_L + r"attention\.wo\.weight", _HF + "self_attn.o_proj.weight", "layers.{layer}.attention.wo.weight"),
        KeyMap(
            _L + r"attention\.q_norm\.weight", _HF + "self_attn.q_norm.weight", "layers.{layer}.attention.q_norm.weight"
        ),
        KeyMap(
            _L + r"attention\.k_norm\.weight", _HF + "self_attn.k_norm.weight", "layers.{layer}.attention.k_norm.weight"
        ),
        KeyMap(_L + r"feed_forward\.w1\.weight", _HF + "mlp.gate_proj.weight", "layers.{layer}.feed_forward.w1.weight"),
        KeyMap(_L + r"feed_forward\.w3\.weight", _HF + "mlp.up_proj.weight", "layers.{layer}.feed_forward.w3.weight"),
        KeyMap(_L + r"feed_forward\.w2\.weight", _HF + "mlp.down_proj.weight", "layers.{layer}.feed_forward.w2.weight"),
        KeyMap(
            _L + _EXP + r"w1(?:_EFD)?",
            _HF + "mlp.experts.gate_up_proj",
            "layers.{layer}.moe.routed_experts.inner_experts.w1_EFD",
            "gate",
            per_expert=_HF + "mlp.experts.{j}.gate_proj.weight",
        ),
        KeyMap(
            _L + _EXP + r"w3(?:_EFD)?",
            _HF + "mlp.experts.gate_up_proj",
            "layers.{layer}.moe.routed_experts.inner_experts.w3_EFD",
            "up",
            per_expert=_HF + "mlp.experts.{j}.up_proj.weight",
        ),
        KeyMap(
            _L + _EXP + r"w2(?:_EDF)?",
            _HF + "mlp.experts.down_proj",
            "layers.{layer}.moe.routed_experts.inner_experts.w2_EDF",
            "experts",
            per_expert=_HF + "mlp.experts.{j}.down_proj.weight",
        ),
        KeyMap(_L + r"moe\.router\.gate\.weight", _HF + "mlp.gate.weight", "layers.{layer}.moe.router.gate.weight"),
        KeyMap(
            _L + r"moe\.expert_bias(?:_E)?",
            None,
            kind="skip",
            reason="torchtitan load-balancing expert_bias buffer (no HF counterpart)",
        ),
        KeyMap(_L + r"moe\.tokens_per_expert", None, kind="skip", reason="torchtitan routing statistics buffer"),
        KeyMap(_L + r"attention_norm\.weight", _HF + "input_layernorm.weight", "layers.{layer}.attention_norm.weight"),
        KeyMap(_L + r"ffn_norm\.weight", _HF + "post_attention_layernorm.weight", "layers.{layer}.ffn_norm.weight"),
        KeyMap(r"norm\.weight", "model.norm.weight", "norm.weight"),
        KeyMap(r"(?:lm_head|output)\.weight", "lm_head.weight", "lm_head.weight"),
    )
