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
- ``router.weight [L, E, H]`` -> ``mlp.gate.weight``;
- ``linear_qkv.bias [L, ng * (nq/ng + 2) * hd]`` (Qwen2) as the weight's rows; ``q_layernorm`` /
  ``k_layernorm [L, hd]`` (Qwen3) -> ``self_attn.q_norm`` / ``k_norm``.

Export: experts fused (``--experts per-expert``: split by the export's expert rules, ``split_adapter_experts``). Import (``import --schema
megatron``): :func:`megatron_from_hf` inverts the same maps for a whole HF model at once (one
megatron tensor gathers one HF tensor per layer), HF experts fused (transformers v5
``experts.gate_up_proj``) or per expert (``experts.{j}.gate_proj``). Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from ckpttool.errors import ExportError
from ckpttool.model.adapters.base import CONFIG_HINT, AdapterConfig, HFTensor, ModelAdapter, NativeTensor, Skip
from ckpttool.model.adapters.registry import register_adapter

__all__ = ["MegatronGPT", "MegatronImport", "StackedNative", "megatron_from_hf"]

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
    "self_attention.q_layernorm.weight": _HF + "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": _HF + "self_attn.k_norm.weight",
}
_QKV = "self_attention.linear_qkv.weight"
_QKV_BIAS = "self_attention.linear_qkv.bias"
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


#: a per-layer key ``decoder.layers.<i>.<suffix>`` (megatron-core's ``non_homogeneous_layers``, and every layer when
#: saved with ``singleton_local_shards``)
_ONE_LAYER = re.compile(r"(?P<layer>\d+)\.(?P<rest>.+)")
#: ``singleton_local_shards``: expert ``j`` of a layer its own key, its gated ``linear_fc1`` in two (``_w`` gate, ``_v`` up)
_ONE_EXPERT = re.compile(r"mlp\.experts\.experts\.(?P<j>\d+)\.(?P<name>linear_fc1\.weight_[wv]|linear_fc2\.weight)")
#: ``singleton_local_shards``: a dense gated ``linear_fc1`` saved as its two halves
_SPLIT_FC1 = {"mlp.linear_fc1.weight_w": "mlp.gate_proj.weight", "mlp.linear_fc1.weight_v": "mlp.up_proj.weight"}


def _one_expert(fqn: str, shape: tuple[int, ...], cfg: AdapterConfig, layer: int, j: int, name: str) -> HFTensor:
    """Expert ``j`` of ``layer`` saved as its own key (``[I, H]`` gate or up half, ``[H, I]`` down) -> its slot of
    Mixtral's fused ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]``, written in part.

    Raises:
        ExportError: the config names no expert count, or ``j`` is not below it.
    """
    e = cfg.num_experts
    if e is None or j >= e or len(shape) != 2:
        raise ExportError(
            f"{fqn}: expert {j} of shape {list(shape)} needs the config's expert count (`num_local_experts`) above {j}",
            fqn=fqn,
            hint=CONFIG_HINT,
        )
    a, b = shape
    slab = a * b
    if name == "linear_fc2.weight":
        key, full, dst = _HF.format(l=layer) + "mlp.experts.down_proj", (e, a, b), j * slab
    else:
        key, full, dst = (
            _HF.format(l=layer) + "mlp.experts.gate_up_proj",
            (e, 2 * a, b),
            (2 * j + name.endswith("_v")) * slab,
        )
    return HFTensor(key, full, pieces=((key, full),), runs=((0, slab, 0, dst),), fused_experts=True, shared=True)


def _layers(
    fqn: str, shape: tuple[int, ...], pieces: list[tuple[str, tuple[int, ...], int, int]], first: int = 0
) -> HFTensor:
    """An :class:`HFTensor` whose pieces are ``(key, shape, src row of layer 0, rows)`` blocks of every layer.

    ``shape`` is ``[L, R, ...]``; each piece takes ``rows`` rows of dim 1 starting at its offset, in every layer;
    ``first``: the model layer of the tensor's layer 0 (a per-layer key is one layer).
    """
    n_layers, rows = shape[0], shape[1] if len(shape) > 1 else 1
    row = math.prod(shape[2:]) if len(shape) > 2 else 1
    out_pieces: list[tuple[str, tuple[int, ...]]] = []
    runs: list[tuple[int, int, int, int]] = []
    for layer in range(n_layers):
        base = layer * rows * row
        for key, pshape, start, n in pieces:
            runs.append((base + start * row, n * row, len(out_pieces), 0))
            out_pieces.append((key.format(l=first + layer), pshape))
    return HFTensor(out_pieces[0][0], out_pieces[0][1], pieces=tuple(out_pieces), runs=tuple(runs))


def _heads(cfg: AdapterConfig, fqn: str, task: str, source: str, hint: str) -> tuple[int, int, int]:
    """``(num_attention_heads, num_key_value_heads, head_dim)`` of ``cfg``, the query heads a multiple of the KV heads.

    Raises:
        ExportError: one is missing from the config, or the heads do not group (``fqn``: ``task`` needs them).
    """
    nq, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    if nq is None or nkv is None or hd is None or nq % nkv:
        raise ExportError(
            f"{fqn}: {task} needs `num_attention_heads`, `num_key_value_heads` and `head_dim` from {source}",
            fqn=fqn,
            hint=hint,
        )
    return nq, nkv, hd


def _qkv(fqn: str, shape: tuple[int, ...], cfg: AdapterConfig, first: int = 0) -> HFTensor:
    nq, nkv, hd = _heads(cfg, fqn, "splitting linear_qkv", "the model's config.json", CONFIG_HINT)
    per = nq // nkv
    bias = fqn.endswith(".bias")
    if len(shape) != (2 if bias else 3) or shape[1] != nkv * (per + 2) * hd:
        raise ExportError(
            f"{fqn}: shape {list(shape)} is not [L, {nkv} * ({per} + 2) * {hd}{'' if bias else ', H'}] "
            "as the config's heads say",
            fqn=fqn,
            hint="pass the config.json of the model this checkpoint was trained as",
        )
    n_layers, rows, hidden = shape[0], shape[1], 1 if bias else shape[2]
    out_pieces: list[tuple[str, tuple[int, ...]]] = []
    runs: list[tuple[int, int, int, int]] = []
    for layer in range(n_layers):
        q, k, v = len(out_pieces), len(out_pieces) + 1, len(out_pieces) + 2
        for name, n in (("q_proj", nq), ("k_proj", nkv), ("v_proj", nkv)):
            pshape = (n * hd,) if bias else (n * hd, hidden)
            out_pieces.append((f"{_HF.format(l=first + layer)}self_attn.{name}.{'bias' if bias else 'weight'}", pshape))
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
    import_schema = "megatron"

    naming = "megatron"

    def matches(self, fqn: str) -> bool:
        return fqn in _TOP or (fqn.startswith("decoder.layers.") and self._suffix(fqn) is not None)

    @staticmethod
    def _suffix(fqn: str) -> str | None:
        rest = fqn[len("decoder.layers.") :]
        m = _ONE_LAYER.fullmatch(rest)
        sub = m["rest"] if m else rest
        if sub in _PER_LAYER or sub in (_QKV, _QKV_BIAS, "mlp.linear_fc1.weight"):
            return rest
        if m and (_ONE_EXPERT.fullmatch(sub) or sub in _SPLIT_FC1):
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
        return self._stacked(fqn, rest, shape, cfg)

    def _stacked(self, fqn: str, rest: str, shape: tuple[int, ...], cfg: AdapterConfig, first: int = 0) -> HFTensor:
        """The HF tensors of ``decoder.layers.<rest>``: stacked ``[L, ...]`` from layer ``first``; a per-layer key
        ``<i>.<suffix>`` (megatron's non-homogeneous layers) as layer ``i`` of a stack of one."""
        one = _ONE_LAYER.fullmatch(rest)
        if one is not None:
            layer, sub = int(one["layer"]), one["rest"]
            if sub in _SPLIT_FC1:
                return HFTensor(_HF.format(l=layer) + _SPLIT_FC1[sub], shape)
            expert = _ONE_EXPERT.fullmatch(sub)
            if expert is not None:
                return _one_expert(fqn, shape, cfg, layer, int(expert["j"]), expert["name"])
            return self._stacked(fqn, sub, (1, *shape), cfg, layer)
        if rest in (_QKV, _QKV_BIAS):
            return _qkv(fqn, shape, cfg, first)
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
                first,
            )
        hf = _layers(fqn, shape, [(_PER_LAYER[rest], per_layer, 0, shape[1] if len(shape) > 1 else 1)], first)
        if ".experts.experts." in fqn:
            hf = dataclasses.replace(hf, fused_experts=True)
        return hf

    def from_hf(self, hf_key: str, shape: tuple[int, ...], cfg: AdapterConfig) -> list[NativeTensor] | Skip | None:
        """Not a per-key import: one megatron tensor gathers many HF tensors (:func:`megatron_from_hf`)."""
        return None


# ------------------------------------------------------------------------------------------ import
@dataclass(frozen=True)
class StackedNative:
    """One megatron tensor to write and where its elements come from.

    Attributes:
        key: the megatron sharded key (``decoder.layers.self_attention.linear_qkv.weight``).
        shape: its global shape (``[L, ...]`` for layer tensors, ``[L, E, ...]`` for experts).
        rows: per dim-0 row (a layer; the whole tensor for a top-level one), its element runs in
            order: ``(HF key, first element, elements)`` of the HF tensor's flat C-order data.
    """

    key: str
    shape: tuple[int, ...]
    rows: tuple[tuple[tuple[str, int, int], ...], ...]


@dataclass(frozen=True)
class MegatronImport:
    """What :func:`megatron_from_hf` plans: the tensors, the HF keys left out, the ``_extra_state`` item keys.

    ``extra_state`` are the byte items megatron-core writes for every linear layer's ``_extra_state``
    (``<module>._extra_state/shard_<layer>_<L>``, experts ``shard_<layer>.<expert>_<L>.<E>``), whose
    value is ``[None]`` for megatron's own (non Transformer Engine) linear layers.
    """

    tensors: tuple[StackedNative, ...]
    skipped: dict[str, list[str]]
    extra_state: tuple[str, ...]
    num_layers: int
    num_experts: int | None


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SKIP_SUFFIX = ("self_attn.rotary_emb.inv_freq",)
#: HF per-layer suffix -> megatron layer suffix, for the tensors copied whole into their layer's row
_FROM_HF = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.experts.gate_up_proj": "mlp.experts.experts.linear_fc1.weight",
    "mlp.experts.down_proj": "mlp.experts.experts.linear_fc2.weight",
}
#: HF suffixes gathered into one megatron tensor per layer, in the order of its rows
_GATHERED = {
    "self_attn.q_proj.weight": _QKV,
    "self_attn.k_proj.weight": _QKV,
    "self_attn.v_proj.weight": _QKV,
    "self_attn.q_proj.bias": _QKV_BIAS,
    "self_attn.k_proj.bias": _QKV_BIAS,
    "self_attn.v_proj.bias": _QKV_BIAS,
    "mlp.gate_proj.weight": "mlp.linear_fc1.weight",
    "mlp.up_proj.weight": "mlp.linear_fc1.weight",
}
_EXTRA_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def _missing(hf_key: str) -> ExportError:
    return ExportError(
        f"{hf_key}: missing from the HF model (megatron stacks every layer into one tensor)",
        fqn=hf_key,
        hint="the HF checkpoint is incomplete, or its config's num_hidden_layers / num_experts do not match",
    )


def _qkv_rows(layer_keys: dict[str, tuple[int, ...]], pre: str, kind: str, cfg: AdapterConfig) -> tuple[Any, ...]:
    """The element runs of one layer's ``linear_qkv`` ``kind`` (weight / bias): per query group q, k, v rows."""
    q, k, v = (f"{pre}self_attn.{n}_proj.{kind}" for n in "qkv")
    nq, nkv, hd = _heads(
        cfg, q, "fusing q/k/v into linear_qkv", "config.json", "pass the model's config.json with --config"
    )
    for key in (q, k, v):
        if key not in layer_keys:
            raise _missing(key)
    row = 1 if kind == "bias" else math.prod(layer_keys[q][1:])
    for key, heads in ((q, nq), (k, nkv), (v, nkv)):
        s = layer_keys[key]
        if s[0] != heads * hd or len(s) != (1 if kind == "bias" else 2) or math.prod(s[1:]) != row:
            raise ExportError(
                f"{key}: shape {list(layer_keys[key])} does not fit {heads} heads of {hd} (config.json)",
                fqn=key,
                hint="pass the config.json of this model",
            )
    per = nq // nkv
    runs: list[tuple[str, int, int]] = []
    for g in range(nkv):
        runs += [(q, g * per * hd * row, per * hd * row), (k, g * hd * row, hd * row), (v, g * hd * row, hd * row)]
    return tuple(runs)


def _layer_tensors(
    pre: str, keys: dict[str, tuple[int, ...]], cfg: AdapterConfig, experts: int | None
) -> dict[str, tuple[tuple[int, ...], tuple[tuple[str, int, int], ...]]]:
    """One layer's megatron tensors: layer suffix -> (per-layer shape, element runs)."""
    out: dict[str, tuple[tuple[int, ...], tuple[tuple[str, int, int], ...]]] = {}
    rest = {k[len(pre) :]: s for k, s in keys.items()}
    for hf, mg in _FROM_HF.items():
        if hf in rest:
            out[mg] = (rest[hf], ((pre + hf, 0, math.prod(rest[hf])),))
    for kind, mg in (("weight", _QKV), ("bias", _QKV_BIAS)):
        if f"self_attn.q_proj.{kind}" in rest:
            runs = _qkv_rows(keys, pre, kind, cfg)
            elems = sum(n for _, _, n in runs)
            hidden = 1 if kind == "bias" else keys[pre + "self_attn.q_proj.weight"][1]
            out[mg] = ((elems,) if kind == "bias" else (elems // hidden, hidden), runs)
    if "mlp.gate_proj.weight" in rest or "mlp.up_proj.weight" in rest:
        g, u = pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight"
        for key in (g, u):
            if key not in keys:
                raise _missing(key)
        if keys[g] != keys[u] or len(keys[g]) != 2:
            raise ExportError(f"{g}: gate_proj {list(keys[g])} and up_proj {list(keys[u])} differ", fqn=g)
        n = math.prod(keys[g])
        out["mlp.linear_fc1.weight"] = ((2 * keys[g][0], keys[g][1]), ((g, 0, n), (u, 0, n)))
    if experts is not None:
        _per_expert(pre, keys, experts, out)
    return out


def _per_expert(pre: str, keys: dict[str, tuple[int, ...]], n: int, out: dict[str, Any]) -> None:
    """Per-expert HF tensors (``mlp.experts.{j}.gate_proj``...) -> the layer's stacked expert tensors."""
    for mg, parts in (
        ("mlp.experts.experts.linear_fc1.weight", ("gate_proj", "up_proj")),
        ("mlp.experts.experts.linear_fc2.weight", ("down_proj",)),
    ):
        runs: list[tuple[str, int, int]] = []
        shape: tuple[int, ...] | None = None
        for j in range(n):
            for p in parts:
                key = f"{pre}mlp.experts.{j}.{p}.weight"
                if key not in keys:
                    raise _missing(key)
                if shape is None:
                    shape = keys[key]
                if keys[key] != shape or len(shape) != 2:
                    raise ExportError(f"{key}: shape {list(keys[key])}, not the [A, B] of the other experts", fqn=key)
                runs.append((key, 0, math.prod(shape)))
        assert shape is not None
        out[mg] = ((n, shape[0] * len(parts), shape[1]), tuple(runs))


def megatron_from_hf(
    shapes: dict[str, tuple[int, ...]], cfg: AdapterConfig, num_layers: int | None, tie: bool
) -> MegatronImport:
    """Plan an HF Llama / Qwen2 / Qwen3 / Mixtral / Qwen3-MoE model as megatron-core GPTModel tensors.

    The inverse of :meth:`MegatronGPT.to_hf` (module docstring): every HF layer tensor becomes
    row ``l`` of its stacked megatron tensor; ``q/k/v_proj`` are interleaved per query group
    into ``linear_qkv``, ``gate_proj``/``up_proj`` concatenated into ``linear_fc1``. A tied
    ``lm_head.weight`` is left out (megatron's ``share_embeddings_and_output_weights`` has no
    ``output_layer.weight``).

    Args:
        shapes: HF key -> shape of every stored tensor.
        cfg: the config's dimensions (heads, head_dim, ``num_experts``).
        num_layers: the config's ``num_hidden_layers`` (``None``: one more than the highest layer).
        tie: the config's ``tie_word_embeddings``.

    Raises:
        ExportError (E601): an HF key megatron has no place for (shared experts, vision towers...),
            a layer or expert missing, q/k/v shapes that do not fit the config's heads, layers that differ.
    """
    skipped: dict[str, list[str]] = {}
    by_layer: dict[int, dict[str, tuple[int, ...]]] = {}
    top: list[StackedNative] = []
    inverse_top = {v: k for k, v in _TOP.items()}
    expert_ids: set[int] = set()
    for key, shape in shapes.items():
        m = _LAYER_RE.match(key)
        if m is None:
            if key == "lm_head.weight" and tie:
                skipped.setdefault("tied to the embedding (share_embeddings_and_output_weights)", []).append(key)
            elif key in inverse_top:
                top.append(StackedNative(inverse_top[key], shape, (((key, 0, math.prod(shape)),),)))
            else:
                raise _unknown(key, shape)
            continue
        rest = m.group(2)
        if rest.endswith(_SKIP_SUFFIX):
            skipped.setdefault("recomputed at load (rotary inv_freq)", []).append(key)
            continue
        em = _EXPERT_RE.match(rest)
        if em is not None:
            expert_ids.add(int(em.group(1)))
        elif rest not in _FROM_HF and rest not in _GATHERED:
            raise _unknown(key, shape)
        by_layer.setdefault(int(m.group(1)), {})[key] = shape
    n_layers = num_layers if num_layers is not None else (max(by_layer) + 1 if by_layer else 0)
    if by_layer and max(by_layer) >= n_layers:
        bad = f"model.layers.{max(by_layer)}"
        raise ExportError(
            f"{bad}: beyond the config's num_hidden_layers {n_layers}",
            fqn=bad,
            hint="pass the config.json of this model",
        )
    _refuse_mixed_mlps(by_layer)
    per_expert = (cfg.num_experts or max(expert_ids) + 1) if expert_ids else None
    # Layers past the first absent one are never built: that layer is missing (E601 from _stack), however many
    # more the config claims (``num_hidden_layers: 10**18`` looped and grew a list without end).
    first_gap = next((i for i in range(n_layers) if i not in by_layer), n_layers)  # at most len(by_layer) + 1 steps
    if not by_layer and n_layers > 0:
        raise _missing("model.layers.0.*")
    built = min(n_layers, first_gap + 1)
    layers = [_layer_tensors(f"model.layers.{i}.", by_layer.get(i, {}), cfg, per_expert) for i in range(built)]
    tensors = top + _stack(layers)
    n_exp = next((t.shape[1] for t in tensors if "mlp.experts.experts." in t.key), None)
    return MegatronImport(
        tensors=tuple(tensors),
        skipped=skipped,
        extra_state=_extra_state_keys(n_layers, n_exp),
        num_layers=n_layers,
        num_experts=n_exp,
    )


_DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def _refuse_mixed_mlps(by_layer: dict[int, dict[str, tuple[int, ...]]]) -> None:
    """Raise for dense MLP layers beside MoE layers (Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``,
    DeepSeek's ``first_k_dense_replace``): the stacked keys hold one MLP kind in every layer.

    Raises:
        ExportError (E601): naming a dense layer's key and a MoE layer.
    """
    dense = next((i for i in sorted(by_layer) if f"model.layers.{i}.{_DENSE_MLP[0]}" in by_layer[i]), None)
    if dense is None:
        return
    moe = next((i for i in sorted(by_layer) if any(".mlp.experts." in k for k in by_layer[i])), None)
    if moe is None:
        return
    key = f"model.layers.{dense}.{_DENSE_MLP[0]}"
    raise ExportError(
        f"{key}: layer {dense} has a dense MLP while layer {moe} has experts; megatron's stacked layers "
        "(decoder.layers.*) hold one MLP kind, and import --schema megatron does not write megatron's per-layer keys "
        "for mixed dense and MoE layers (moe_layer_freq)",
        fqn=key,
        hint="import it with --schema torch-native (it loads into the transformers model the config builds)",
    )


def _unknown(key: str, shape: tuple[int, ...]) -> ExportError:
    return ExportError(
        f"{key}: not a tensor of a megatron-core GPTModel (shape {list(shape)})",
        fqn=key,
        hint="import --schema megatron takes Llama / Qwen2 / Qwen3 dense and Mixtral / Qwen3-MoE style models "
        "(no shared experts, no vision tower)",
    )


def _stack(layers: list[dict[str, Any]]) -> list[StackedNative]:
    """Layer dicts -> stacked tensors ``[L, ...]``; every layer must have every tensor, of one shape."""
    out: list[StackedNative] = []
    if not layers:
        return out
    names = list(dict.fromkeys(k for d in layers for k in d))
    for name in names:
        rows = []
        shape = None
        for i, d in enumerate(layers):
            if name not in d:
                raise _missing(f"model.layers.{i}.* ({name} of megatron)")
            s, runs = d[name]
            if shape is None:
                shape = s
            if s != shape:
                raise ExportError(
                    f"model.layers.{i}: {name} has per-layer shape {list(s)}, layer 0 {list(shape)}",
                    fqn=f"model.layers.{i}",
                    hint="megatron stacks layers of one shape; this HF model's layers differ",
                )
            rows.append(runs)
        assert shape is not None
        out.append(StackedNative("decoder.layers." + name, (len(layers), *shape), tuple(rows)))
    return out


def _extra_state_keys(n_layers: int, experts: int | None) -> tuple[str, ...]:
    """megatron-core's ``_extra_state`` byte item keys (``sharded_offsets`` of layer / layer.expert)."""
    keys: list[str] = []
    for mod in _EXTRA_MODULES:
        if experts is not None and mod.startswith("mlp."):
            base = f"decoder.layers.mlp.experts.experts.{mod[4:]}._extra_state"
            keys += [f"{base}/shard_{i}.{e}_{n_layers}.{experts}" for i in range(n_layers) for e in range(experts)]
        else:
            keys += [f"decoder.layers.{mod}._extra_state/shard_{i}_{n_layers}" for i in range(n_layers)]
    return tuple(keys)
