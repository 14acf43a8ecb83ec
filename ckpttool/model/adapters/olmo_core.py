"""OLMo-core dense ``Transformer`` -> HF ``LlamaForCausalLM`` / ``Olmo2ForCausalLM`` (export only).

Key map as OLMo-core's own ``olmo_core/nn/hf/convert.py`` (``OLMO_CORE_TO_HF_WEIGHT_MAPPINGS``, with its
``llama`` overrides in ``MODEL_TYPE_SPECIFIC_OLMO_CORE_TO_HF_TEMPLATE_MAPPINGS``). OLMo-core's RoPE pairs the
two halves of a head as HF does (no row permutation; ``convert_state_to_hf`` copies ``w_q`` / ``w_k`` as
stored). The two families have the same tensor names and differ in where the norms sit, which the keys do
not show: a ``default`` block (``TransformerConfig.llama_like``: pre-norm) is Llama's
``attention_norm -> input_layernorm``, ``feed_forward_norm -> post_attention_layernorm``; a
``reordered_norm`` block (OLMo-2: post-norm, q/k norm over all heads) is Olmo2's ``attention_norm ->
post_attention_layernorm``, ``feed_forward_norm -> post_feedforward_layernorm`` (OLMo-core's default map, model
type ``olmo2``, as its own ``get_hf_config`` names such a model; ``olmo3`` where the blocks have sliding-window
attention, OLMo-3: the same tensors, converted by OLMo-core with the same map, the windows in the config only). So
neither is detected from the keys alone: the config's ``model_type`` (``llama`` / ``olmo2`` / ``olmo3``, the
``model_assets`` config.json) or ``--adapter`` says which. A tensor the family has no place for (MoE ``feed_forward_moe``, biases, Gemma-3's extra norms, q/k
norms under Llama, head-wise q/k norms under Olmo2) is refused (E601), never dropped or renamed; Olmo2 is
detected only when the keys hold its q/k norms.
"""

from __future__ import annotations

from typing import Any

from ckpttool.errors import ExportError
from ckpttool.model.adapters.base import AdapterConfig, HFTensor, KeyMap, ModelAdapter, NativeTensor, Skip
from ckpttool.model.adapters.registry import register_adapter

__all__ = ["OlmoCoreLlama", "OlmoCoreOlmo2"]

#: an OLMo-core block's fqn prefix ``blocks.<N>.`` (group ``layer``)
_BLOCK = r"blocks\.(?P<layer>\d+)\."
#: fragments every OLMo-core Transformer's fqns hold (what tells its names from another trainer's)
_OLMO_CORE = (".attention.w_q.", "lm_head.w_out.")


def _block(native: str, hf: str) -> KeyMap:
    return KeyMap(_BLOCK + native.replace(".", r"\."), "model.layers.{layer}." + hf)


#: the tensors both families have, as OLMo-core's ``OLMO_CORE_TO_HF_WEIGHT_MAPPINGS``
_COMMON = (
    KeyMap(r"embeddings\.weight", "model.embed_tokens.weight"),
    _block("attention.w_q.weight", "self_attn.q_proj.weight"),
    _block("attention.w_k.weight", "self_attn.k_proj.weight"),
    _block("attention.w_v.weight", "self_attn.v_proj.weight"),
    _block("attention.w_out.weight", "self_attn.o_proj.weight"),
    _block("feed_forward.w1.weight", "mlp.gate_proj.weight"),
    _block("feed_forward.w2.weight", "mlp.down_proj.weight"),
    _block("feed_forward.w3.weight", "mlp.up_proj.weight"),
    KeyMap(r"lm_head\.norm\.weight", "model.norm.weight"),
    KeyMap(r"lm_head\.w_out\.weight", "lm_head.weight"),
)


class _OlmoCore(ModelAdapter):
    """The shared detection and refusal; subclasses set :attr:`maps` and :attr:`hf_model_types`."""

    naming = "unknown"
    hf_model_types: tuple[str, ...] = ()  # the HF model types that pick the subclass
    hf_class = ""  # the HF class it writes for (the first model type's)

    @classmethod
    def detects(cls, evidence: Any) -> bool:
        """OLMo-core's names (no naming ckpttool knows, ``.attention.w_q.`` and ``lm_head.w_out.``) and a config
        whose ``model_type`` is one of :attr:`hf_model_types`: without a config the keys do not say where the norms
        sit."""
        if evidence.naming != "unknown" or evidence.model_type not in cls.hf_model_types:
            return False
        if not all(evidence.any_fqn_contains(f) for f in _OLMO_CORE):
            return False
        return not (cls.foreign and evidence.any_fqn_contains(*cls.foreign))

    @classmethod
    def config_model_types(cls) -> tuple[str, ...]:
        return cls.hf_model_types

    def misfit(self, fqns: Any) -> str | None:
        """Names that are not OLMo-core's (no ``blocks.N.attention.w_q`` or ``lm_head.w_out``): another trainer's."""
        if all(any(f in fqn for fqn in fqns) for f in _OLMO_CORE):
            return None
        return (
            "the model tensors are not an OLMo-core Transformer's (no blocks.N.attention.w_q.weight and "
            "lm_head.w_out.weight)"
        )

    def to_hf(self, fqn: str, shape: tuple[int, ...], cfg: AdapterConfig) -> HFTensor | Skip | None:
        """As :meth:`ModelAdapter.to_hf`; a tensor of no map is refused (an OLMo-core variant HF's class lacks).

        Raises:
            ExportError (E601): ``fqn`` has no place in HF's :attr:`hf_class`.
        """
        out = super().to_hf(fqn, shape, cfg)
        if out is None:
            raise ExportError(
                f"{fqn}: OLMo-core tensor with no place in HF {self.hf_class} (adapter {self.name}); "
                "the export would drop it",
                fqn=fqn,
                hint="this OLMo-core model is another variant (MoE, biases, other norms): export it without "
                "`adapter` (raw OLMo-core names), or pick the adapter of its family",
            )
        return out

    def from_hf(self, hf_key: str, shape: tuple[int, ...], cfg: AdapterConfig) -> list[NativeTensor] | Skip | None:
        """Not an import target (export only)."""
        return None


@register_adapter
class OlmoCoreLlama(_OlmoCore):
    name = "olmo-core-llama"
    description = "OLMo-core dense Transformer, default (pre-norm) block, as llama_like -> HF LlamaForCausalLM"
    hf_model_types, hf_class = ("llama",), "LlamaForCausalLM"
    foreign = (".attention.q_norm.", ".attention.k_norm.", ".feed_forward_moe.", ".post_attention_norm.")

    maps = (
        *_COMMON,
        _block("attention_norm.weight", "input_layernorm.weight"),
        _block("feed_forward_norm.weight", "post_attention_layernorm.weight"),
    )


@register_adapter
class OlmoCoreOlmo2(_OlmoCore):
    name = "olmo-core-olmo2"
    description = "OLMo-core dense Transformer, reordered_norm (post-norm, q/k norm) block -> HF Olmo2ForCausalLM"
    # OLMo-3 (``olmo3``: sliding-window attention) has OLMo-2's tensors; its HF Olmo3ForCausalLM their names
    hf_model_types, hf_class = ("olmo2", "olmo3"), "Olmo2ForCausalLM"
    foreign = (".feed_forward_moe.", ".post_attention_norm.")

    maps = (
        *_COMMON,
        _block("attention_norm.weight", "post_attention_layernorm.weight"),
        _block("feed_forward_norm.weight", "post_feedforward_layernorm.weight"),
        _block("attention.q_norm.weight", "self_attn.q_norm.weight"),
        _block("attention.k_norm.weight", "self_attn.k_norm.weight"),
    )

    def misfit(self, fqns: Any) -> str | None:
        """As :meth:`_OlmoCore.misfit`; without q/k norms the model is not OLMo-2 (HF Olmo2 has them in every
        layer: it would load ones)."""
        why = super().misfit(fqns)
        if why is not None or any(".attention.q_norm." in f for f in fqns):
            return why
        return (
            "no OLMo-core q/k norm (blocks.N.attention.q_norm.weight) among the model tensors: HF Olmo2ForCausalLM "
            "has one in every layer, and its post-norm blocks are not this model's if it is llama_like"
        )

    @classmethod
    def detects(cls, evidence: Any) -> bool:
        """As :meth:`_OlmoCore.detects`, and the keys hold q/k norms (HF Olmo2 has them in every layer)."""
        return super().detects(evidence) and bool(evidence.any_fqn_contains(".attention.q_norm."))

    def to_hf(self, fqn: str, shape: tuple[int, ...], cfg: AdapterConfig) -> HFTensor | Skip | None:
        """As :meth:`_OlmoCore.to_hf`; Olmo2's q/k norms span all heads (``[heads * head_dim]``): a head-wise one
        (``use_head_qk_norm``, ``[head_dim]``) is refused.

        Raises:
            ExportError (E601): as there; a q/k norm whose length is not the config's heads times head_dim.
        """
        out = super().to_hf(fqn, shape, cfg)
        if isinstance(out, HFTensor) and (".attention.q_norm." in fqn or ".attention.k_norm." in fqn):
            heads = cfg.n_heads if ".q_norm." in fqn else cfg.n_kv_heads
            if heads is not None and cfg.head_dim is not None and shape != (heads * cfg.head_dim,):
                raise ExportError(
                    f"{fqn}: shape {list(shape)} is not Olmo2's q/k norm over all heads "
                    f"[{heads} * {cfg.head_dim}] (a head-wise q/k norm, use_head_qk_norm)",
                    fqn=fqn,
                    hint="HF Olmo2 normalizes q and k over all heads; this model has no HF Olmo2 equivalent",
                )
        return out
