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

from ckpttool.model.adapters.base import LAYER_RE, KeyMap, ModelAdapter, layer_map
from ckpttool.model.adapters.llama3 import torchtitan_dense
from ckpttool.model.adapters.registry import register_adapter

__all__ = ["TorchtitanQwen3"]

#: the regex of a grouped expert tensor ``moe.routed_experts.inner_experts.<w>_<dims>`` (0.3) or ``moe.experts.<w>``
_EXP = r"moe\.(?:routed_experts\.inner_experts|experts)\.{}(?:_{})?"
#: fqn fragments of Qwen3 that Llama 3 lacks (``q_norm``, grouped experts)
_QWEN3_ONLY = (".attention.q_norm.", ".moe.")


@register_adapter
class TorchtitanQwen3(ModelAdapter):
    name = "torchtitan-qwen3"
    description = "torchtitan Qwen3 dense / MoE <-> HF Qwen3ForCausalLM / Qwen3MoeForCausalLM (fused or per-expert)"
    import_schema = "torchtitan"

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
        *torchtitan_dense(rope=False),
        layer_map("attention.q_norm.weight", "self_attn.q_norm.weight"),
        layer_map("attention.k_norm.weight", "self_attn.k_norm.weight"),
        layer_map(
            "moe.routed_experts.inner_experts.w1_EFD",
            "mlp.experts.gate_up_proj",
            "gate",
            read=_EXP.format("w1", "EFD"),
            per_expert="mlp.experts.{j}.gate_proj.weight",
        ),
        layer_map(
            "moe.routed_experts.inner_experts.w3_EFD",
            "mlp.experts.gate_up_proj",
            "up",
            read=_EXP.format("w3", "EFD"),
            per_expert="mlp.experts.{j}.up_proj.weight",
        ),
        layer_map(
            "moe.routed_experts.inner_experts.w2_EDF",
            "mlp.experts.down_proj",
            "experts",
            read=_EXP.format("w2", "EDF"),
            per_expert="mlp.experts.{j}.down_proj.weight",
        ),
        layer_map("moe.router.gate.weight", "mlp.gate.weight"),
        KeyMap(
            LAYER_RE + r"moe\.expert_bias(?:_E)?",
            None,
            kind="skip",
            reason="torchtitan load-balancing expert_bias buffer (no HF counterpart)",
        ),
        KeyMap(LAYER_RE + r"moe\.tokens_per_expert", None, kind="skip", reason="torchtitan routing statistics buffer"),
    )
