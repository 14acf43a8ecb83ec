"""HF checkpoint forms of fused MoE experts: the per-expert names ``save_pretrained`` writes -> the model's own keys.

transformers v5 models hold their routed experts fused (``<p>.experts.gate_up_proj`` ``[E, 2I, H]``, gate
rows first, ``<p>.experts.down_proj`` ``[E, H, I]``), but ``save_pretrained`` writes (and ``from_pretrained``
reads) the legacy per-expert names of the family, which transformers' ``conversion_mapping.py`` converts on
load (``MergeModulelist(dim=0)`` stacks the experts, ``Concatenate(dim=1)`` puts the gate before the up
projection; no transpose). One :class:`ExpertForm` per such convention, registered with
:func:`register_form`; the import (``ops/import_hf.py``) fuses through them and refuses keys of a form it
cannot apply. Torch-free (names only).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

__all__ = [
    "FORMS",
    "KEY_RENAMES",
    "ExpertForm",
    "KeyRename",
    "fold_expert_forms",
    "forms_for",
    "model_key",
    "register_form",
    "register_rename",
]


@dataclass(frozen=True)
class ExpertForm:
    """One checkpoint form of per-expert tensors and the renames transformers applies with it.

    Attributes:
        name: the form's name (reported in errors).
        model_types: the config ``model_type`` values it applies to (``None``: any, also without a config).
        module: the regex of the path before ``.experts`` as stored (group ``p``).
        gate, up, down: the per-expert projection names (``<p>.experts.<j>.<name>.weight``).
        renames: ``(old, new)`` substrings replaced in every key of the model (transformers' ``WeightRenaming``),
            applied to the fused keys too.
        reference: where transformers defines it.
    """

    name: str
    model_types: tuple[str, ...] | None
    gate: str
    up: str
    down: str
    module: str = r".+"
    renames: tuple[tuple[str, str], ...] = ()
    reference: str = ""

    @functools.cached_property
    def pattern(self) -> re.Pattern[str]:
        """``<p>.experts.<j>.<proj>.weight`` (groups ``p``, ``j``, ``proj``)."""
        projs = "|".join(re.escape(p) for p in (self.gate, self.up, self.down))
        return re.compile(rf"^(?P<p>{self.module})\.experts\.(?P<j>\d+)\.(?P<proj>{projs})\.weight$")

    def applies(self, model_type: str | None) -> bool:
        return self.model_types is None or model_type in self.model_types

    def rename(self, key: str) -> str:
        """``key`` with the form's renames applied (the model's own name of a stored key)."""
        for old, new in self.renames:
            key = key.replace(old, new)
        return key

    def saved_name(self, key: str) -> str:
        """The name ``save_pretrained`` writes for the model's own ``key``: the renames reversed, last first
        (transformers' ``revert_weight_conversion``; Mixtral's ``.mlp.gate.weight`` -> ``.block_sparse_moe.gate.weight``)."""
        for old, new in reversed(self.renames):
            key = key.replace(new, old)
        return key

    def fused(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """The fused tensors and their per-expert parts, in concatenation order (dim 1 of ``[E, ., .]``)."""
        return (("gate_up_proj", (self.gate, self.up)), ("down_proj", (self.down,)))


#: name -> form, in registration order (the order the import tries them in).
FORMS: dict[str, ExpertForm] = {}


def register_form(form: ExpertForm) -> ExpertForm:
    assert form.name not in FORMS, f"expert form {form.name!r} registered twice"
    FORMS[form.name] = form
    return form


def forms_for(model_type: str | None) -> list[ExpertForm]:
    """The forms that apply to a model of ``model_type`` (``None``: no config)."""
    return [f for f in FORMS.values() if f.applies(model_type)]


# transformers' "qwen2_moe" conversion (Qwen2/3-MoE, DeepSeek, ...): per-expert gate_proj / up_proj / down_proj,
# under the same module path as the fused tensors.
register_form(
    ExpertForm(
        "per-expert",
        None,
        "gate_proj",
        "up_proj",
        "down_proj",
        reference="transformers/conversion_mapping.py 'qwen2_moe'",
    )
)
# transformers' "mixtral" conversion (also MiniMax's, `_MODEL_TO_CONVERSION_PATTERN`): `.block_sparse_moe.` ->
# `.mlp.` (the router `gate.weight` too), w1 = gate, w3 = up, w2 = down.
register_form(
    ExpertForm(
        "mixtral",
        ("mixtral", "minimax", "minimax_m2"),
        "w1",
        "w3",
        "w2",
        module=r".+\.block_sparse_moe",
        renames=((".block_sparse_moe.", ".mlp."),),
        reference="transformers/conversion_mapping.py 'mixtral'",
    )
)
# transformers' "phimoe" conversion: Mixtral's, and the router `gate.weight` is the model's `router.weight`.
register_form(
    ExpertForm(
        "phimoe",
        ("phimoe",),
        "w1",
        "w3",
        "w2",
        module=r".+\.block_sparse_moe",
        renames=((".block_sparse_moe.", ".mlp."), (".gate.weight", ".router.weight")),
        reference="transformers/conversion_mapping.py 'phimoe'",
    )
)


@dataclass(frozen=True)
class KeyRename:
    """A stored key name that transformers' loader renames for the model classes of some ``model_type`` values (a
    ``WeightRenaming`` of ``conversion_mapping.py`` outside any expert form): ``save_pretrained`` writes the name
    ``stored`` matches (the name the family's hub checkpoints hold), the model's ``state_dict()`` holds ``model``.

    Attributes:
        model_types: the config ``model_type`` values it applies to.
        stored: a regex the whole stored key matches.
        model: the model's own key (``re.Match.expand`` template: ``\\1`` is the first group).
        reference: where transformers defines it.
    """

    model_types: tuple[str, ...]
    stored: str
    model: str
    reference: str = ""

    def apply(self, key: str, model_type: str | None) -> str | None:
        """The model's key for the stored ``key``, or ``None`` where this rename does not apply to it (a ``model_type``
        not a string, as an untrusted config.json may hold, is none of its ``model_types``)."""
        if not isinstance(model_type, str) or model_type not in self.model_types:
            return None
        m = re.fullmatch(self.stored, key)
        return m.expand(self.model) if m is not None else None


#: the whole-key renames, in registration order.
KEY_RENAMES: list[KeyRename] = []


def register_rename(rename: KeyRename) -> KeyRename:
    KEY_RENAMES.append(rename)
    return rename


def model_key(key: str, model_type: str | None) -> str:
    """The model's own name of the stored ``key`` under a config of ``model_type``: the first of the
    :data:`KEY_RENAMES` that applies (GPT-NeoX's ``embed_out.weight`` -> ``lm_head.weight``), else ``key``."""
    for r in KEY_RENAMES:
        name = r.apply(key, model_type)
        if name is not None:
            return name
    return key


# transformers' "lfm2_moe" conversion: Mixtral's projection names under `feed_forward`, no renames.
register_form(
    ExpertForm(
        "lfm2_moe",
        ("lfm2_moe",),
        "w1",
        "w3",
        "w2",
        module=r".+\.feed_forward",
        reference="transformers/conversion_mapping.py 'lfm2_moe'",
    )
)


# transformers v5 names GPT-NeoX's output projection `lm_head` (it was `embed_out`); `save_pretrained` still writes
# `embed_out.weight`, the name of the hub's Pythia / GPT-NeoX checkpoints, and `from_pretrained` renames it.
register_rename(
    KeyRename(
        ("gpt_neox",),
        r"embed_out\.weight",
        "lm_head.weight",
        reference="transformers/conversion_mapping.py 'GPTNeoXForCausalLM'",
    )
)
# Qwen2-VL / Qwen2.5-VL: `save_pretrained` writes the language model at the top level (`model.layers.N...`) and the
# vision tower as `visual.*`; the v5 `Qwen2VLForConditionalGeneration` holds them under `model.language_model.` and
# `model.visual.` (`lm_head.weight` stays).
for _stored, _model in (
    (r"visual\.(.+)", r"model.visual.\1"),
    (r"model\.(?!language_model\.|visual\.)(.+)", r"model.language_model.\1"),
):
    register_rename(
        KeyRename(
            ("qwen2_vl", "qwen2_5_vl"),
            _stored,
            _model,
            reference="transformers/conversion_mapping.py 'Qwen2VLForConditionalGeneration'",
        )
    )
# The Llava-style vision-language models (Gemma 3, Mistral 3, PaliGemma, ...): `save_pretrained` writes
# `language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`, `multi_modal_projector.*`; the v5
# `...ForConditionalGeneration` holds `model.language_model.*`, `lm_head.*`, `model.vision_tower.*`,
# `model.multi_modal_projector.*` (its `llava` conversion, with `LlavaModel`'s `language_model.model` -> `language_model`).
_LLAVA = (
    "llava",
    "aria",
    "paligemma",
    "aya_vision",
    "got_ocr2",
    "gemma3",
    "internvl",
    "vipllava",
    "mistral3",
    "pp_chart2table",
)
for _stored, _model in (
    (r"language_model\.model\.(.+)", r"model.language_model.\1"),
    (r"language_model\.lm_head\.(.+)", r"lm_head.\1"),
    (r"vision_tower\.(.+)", r"model.vision_tower.\1"),
    (r"multi_modal_projector\.(.+)", r"model.multi_modal_projector.\1"),
):
    register_rename(KeyRename(_LLAVA, _stored, _model, reference="transformers/conversion_mapping.py 'llava'"))
# Granite MoE stores its experts fused under the names of its own MoE module (`input_linear` [E, 2I, H], gate rows
# first, `output_linear` [E, H, I], `router.layer`); the v5 model holds them as `experts.gate_up_proj` / `down_proj`.
_GRANITE_MOE = ("granitemoe", "granitemoeshared", "granitemoehybrid")
for _stored, _model in (
    ("input_linear.weight", "experts.gate_up_proj"),
    ("output_linear.weight", "experts.down_proj"),
    ("router.layer.weight", "router.weight"),
):
    register_rename(
        KeyRename(
            _GRANITE_MOE,
            rf"(.+\.block_sparse_moe)\.{re.escape(_stored)}",
            rf"\1.{_model}",
            reference="transformers/conversion_mapping.py 'granitemoe'",
        )
    )


def fold_expert_forms(
    written: dict[str, tuple[tuple[int, ...], str]], model_type: str | None, want_dtype: str | None = None
) -> dict[str, tuple[tuple[int, ...], str]]:
    """``written`` as transformers' weight conversion loads it into the model class of ``model_type``: each
    per-expert form that applies (:func:`~ckpttool.model.hf_forms.forms_for`: the generic
    ``<p>.experts.<j>.{gate,up,down}_proj.weight``, Mixtral's ``<p>.block_sparse_moe.experts.<j>.{w1,w3,w2}.weight``)
    with every expert ``0..E-1``, parts of one shape, folded into the fused ``<p>.experts.gate_up_proj``
    ``[E, 2I, H]`` / ``down_proj`` (as ``import`` fuses them), then the form's renames applied to every key
    (Mixtral's ``.block_sparse_moe.`` -> ``.mlp.``) and the :data:`KEY_RENAMES` of ``model_type``; anything else as
    it is. Experts of one shape but several
    dtypes fold too (transformers casts them as it loads): the fused tensor carries a dtype other than the config's
    ``want_dtype`` where one expert's is, so the dtype finding names it (not M010 shape errors of right shapes).
    Used by validate's M010 and by export's check against a config (``--model-assets``', or the ``config.json``
    beside a ``save_distributed`` folder's shards)."""
    out = dict(written)
    for form in forms_for(model_type):
        groups: dict[str, dict[str, dict[int, str]]] = {}
        for k in out:
            m = form.pattern.match(k) if ".experts." in k else None
            if m is not None:
                groups.setdefault(m["p"], {}).setdefault(m["proj"], {})[int(m["j"])] = k
        for prefix, projs in groups.items():
            for fused, parts in form.fused():
                got = [projs.get(x, {}) for x in parts]
                n = len(got[0])
                keys = [g[j] for g in got for j in range(n) if j in g]
                if not n or len(keys) != n * len(parts) or len({out[k][0] for k in keys}) != 1:
                    continue  # experts missing or of different shapes: compared as stored (M010 names them)
                (rows, cols), dtype = out[keys[0]]
                dtype = next((d for d in sorted({out[k][1] for k in keys}) if d != want_dtype), dtype)
                for k in keys:
                    del out[k]
                out.setdefault(f"{prefix}.experts.{fused}", ((n, rows * len(parts), cols), dtype))
        if form.renames:
            out = {form.rename(k): v for k, v in out.items()}
    renamed = {model_key(k, model_type): v for k, v in out.items()}  # KEY_RENAMES (GPT-NeoX's embed_out)
    return renamed if len(renamed) == len(out) else out
