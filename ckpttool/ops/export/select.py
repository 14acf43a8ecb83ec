"""Selection: which model tensors an export writes, and their output keys (metadata only).

:func:`select_model` walks the model tensors once (wrapper segments removed, ``filter_glob``,
``--weights master``) and asks a key map for each one's output key: :class:`RuleKeys` (the YAML
key rules), :class:`AdapterKeys` (a model adapter's HF names and layouts) or :class:`LoraKeys`
(PEFT LoRA adapter keys). A key map records what it leaves out in ``skipped`` and adds its
warnings once the walk is done. The output formats (:mod:`ckpttool.ops.export.formats`) choose one.
"""

from __future__ import annotations

import math
import re
from typing import Any, NoReturn, Protocol

from ckpttool.errors import ExportError, ExportNamingError
from ckpttool.model.adapters import AdapterConfig, HFTensor, ModelAdapter, Skip
from ckpttool.model.catalog import Catalog, TensorEntry
from ckpttool.model.schemas.base import CANONICAL_MODEL_PREFIX
from ckpttool.model.wrappers import strip_wrapper_segments, wrapper_segments_of
from ckpttool.ops.export.plan import (
    SKIP_EXTRA_STATE,
    SKIP_FILTERED,
    SKIP_OUTSIDE_SCHEMA,
    SKIP_TRAINING_STATE,
    Origin,
    Selected,
    SelectResult,
    filtered,
)
from ckpttool.ops.export.rules import ExportRules

__all__ = [
    "CONFIG_TO_CHECK",
    "KeyMap",
    "RuleKeys",
    "AdapterKeys",
    "LoraKeys",
    "peft_saved_form",
    "select_model",
    "skip_other_tensors",
    "shown",
]

#: Where the warning on keys outside the HF naming says the model's config.json comes from (``diff``, which reads
#: the one in the safetensors folder, says that instead).
CONFIG_TO_CHECK = "pass the config with `model_assets`"

#: torchtitan's LoRA adapter tensors (``torchtitan/components/lora.py``: ``<linear>.lora_a`` / ``.lora_b``).
_TITAN_LORA_RE = re.compile(r"\.lora_[ab]\.weight$")

#: One model tensor's output key: the key alone, or ``(output key, adapter placement or None, tag or None)``
#: (``tag``: a LoRA adapter name); the key alone (no tuple built) is the rules' common case.
Mapped = str | tuple[str, HFTensor | None, str | None]


class KeyMap(Protocol):
    """A model tensor's output key; keys it leaves out go to ``skipped`` (reason -> keys, in walk order)."""

    skipped: dict[str, list[str]]

    def __call__(self, key: str, fqn: str, canonical: str, entry: TensorEntry) -> Mapped | None: ...

    def finish(self, cat: Catalog, filter_glob: str | None, warnings: list[str]) -> None:
        """After the walk: refuse (``ExportNamingError``) or add warnings."""


def shown(items: list[str], n: int) -> str:
    """The first ``n`` of ``items``, comma-joined, with ``(+K more)``."""
    return ", ".join(items[:n]) + (f" (+{len(items) - n} more)" if len(items) > n else "")


class RuleKeys:
    """The YAML key rules: the first matching rule's template (``to: null`` skips; ``warn`` reports the rename)."""

    def __init__(self, rules: ExportRules, model_config: dict[str, Any] | None = None) -> None:
        self.map_key = rules.key_mapper()
        self.model_config = model_config
        self.skipped: dict[str, list[str]] = {}
        self.renamed: list[tuple[str, str]] = []  # (checkpoint key, output key) of the rules with `warn`
        self.as_stored: list[str] = []  # written under the fqn the checkpoint stores

    def __call__(self, key: str, fqn: str, canonical: str, entry: TensorEntry) -> Mapped | None:
        out, matched, warn = self.map_key(canonical)
        if not matched:
            self.skipped.setdefault("no key rule matches", []).append(key)
            return None
        if out is None:
            self.skipped.setdefault("skipped by a key rule", []).append(key)
            return None
        if warn:
            self.renamed.append((key, out))
        if out == fqn:
            self.as_stored.append(out)
        return out

    def finish(self, cat: Catalog, filter_glob: str | None, warnings: list[str]) -> None:
        spec = cat.schema.spec
        if self.renamed and spec is not None and spec.own_names_warning:  # OLMo-core's names are not HF's
            # every key, whatever a default rule made of it (lm_head.w_out.weight is no HF name either)
            warnings.append(spec.own_names_warning.format(count=len(self.as_stored), shown=shown(self.as_stored, 3)))
            return
        outside, cls = self.outside_the_model_class(len(cat.model))
        if outside:
            pairs = shown([f"{key} -> {out}" for key, out in outside], 5)
            fix = "map these with `rules` FILE.yaml (docs/export.md, 'Keys') or a model adapter (`adapter`)"
            if cls is not None:
                warnings.append(
                    f"{len(outside)} key(s) that are no names of {cls} (the config's model class) were exported as "
                    f"their fqn: {pairs}; transformers and vLLM will not load them: {fix}"
                )
            else:
                warnings.append(
                    f"{len(outside)} key(s) outside the model.* / lm_head.* naming were exported as their fqn, not "
                    f"checked against a model class (no config.json, or transformers cannot build its class): {pairs}; "
                    f"transformers and vLLM load only its names (GPT-2's transformer.h.N... are): {CONFIG_TO_CHECK} "
                    f"to check them, or {fix}"
                )

    def outside_the_model_class(self, tensors: int) -> tuple[list[tuple[str, str]], str | None]:
        """The renamed keys less those the model class of ``model_config`` holds (``transformer.h.0.attn.c_attn.weight``
        is GPT-2's own name, ``gpt_neox.embed_in.weight`` GPT-NeoX's), and the class's name; all of them and
        ``None`` without a config, or where transformers cannot build its class.

        Raises:
            SizeLimitError: ``E307``, a config past :func:`~.expected.check_config_bounds`.
        """
        if not self.renamed or self.model_config is None:
            return self.renamed, None
        from ckpttool.ops.export.expected import check_config_bounds, expected_state_dict

        check_config_bounds(self.model_config, tensors)
        got = expected_state_dict(self.model_config)
        if isinstance(got, str):
            return self.renamed, None
        own, cls = got.tensors, got.model_class
        return [(key, out) for key, out in self.renamed if out not in own], cls


class AdapterKeys:
    """A model adapter's HF names and element layouts (:meth:`ModelAdapter.to_hf`); unknown keys are reported."""

    def __init__(self, adapter: ModelAdapter, config: AdapterConfig | None) -> None:
        self.adapter = adapter
        self.config = config or AdapterConfig()
        self.skipped: dict[str, list[str]] = {}
        self.unknown: list[str] = []

    def __call__(self, key: str, fqn: str, canonical: str, entry: TensorEntry) -> Mapped | None:
        conv = self.adapter.to_hf(fqn, entry.shape, self.config)
        if conv is None:
            self.unknown.append(key)
            self.skipped.setdefault(f"no key map of adapter {self.adapter.name}", []).append(key)
            return None
        if isinstance(conv, Skip):
            self.skipped.setdefault(conv.reason, []).append(key)
            return None
        return conv.key, conv, None

    def finish(self, cat: Catalog, filter_glob: str | None, warnings: list[str]) -> None:
        """Raises ExportNamingError (E603): torchtitan LoRA tensors the export would drop (no ``filter_glob``)."""
        unknown = self.unknown
        if not unknown:
            return
        lora = [k for k in unknown if _TITAN_LORA_RE.search(k)]
        if lora and filter_glob is None:
            raise ExportNamingError(
                f"{cat.path}: {len(lora)} torchtitan LoRA adapter tensor(s) (e.g. {lora[0]!r}) have no HF mapping; "
                "the export would write the base weights without the fine-tune",
                fqn=lora[0],
                hint="merge the LoRA adapters into the weights in torchtitan before saving, or export the base "
                "model on purpose with `filter_glob` selecting its other keys",
            )
        warnings.append(
            f"{len(unknown)} model tensor(s) unknown to adapter {self.adapter.name} are not exported: {shown(unknown, 3)}"
        )


#: A PEFT ``modules_to_save`` copy (a module trained in full beside the LoRA factors, e.g. ``lm_head``):
#: ``peft.get_peft_model_state_dict`` saves it with ``modules_to_save.<adapter>.`` removed.
_MODULES_TO_SAVE_RE = re.compile(
    r"^model\.(?P<module>base_model\.model\..+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<name>[^.]+)$"
)


#: PEFT's trainable tokens (``LoraConfig(trainable_token_indices=...)``): the new rows of an embedding, saved with
#: the adapter name removed (``<module>.token_adapter.trainable_tokens_delta``).
_TRAINABLE_TOKENS_RE = re.compile(
    r"^model\.(?P<module>base_model\.model\..+\.token_adapter\.trainable_tokens_delta)\.(?P<adapter>[^.]+)$"
)
#: PEFT's saved adapter names (``peft.get_peft_model_state_dict``): ``base_model.model.<module>.lora_A.weight``.
_PEFT_PREFIX = "base_model.model."
_CANONICAL_PEFT_PREFIX = CANONICAL_MODEL_PREFIX + _PEFT_PREFIX
#: DoRA's magnitude (``lora_magnitude_vector.<adapter>.weight`` in the model, a ``DoraLayer``): PEFT's save keeps the
#: checkpoint format of before that refactor, ``<module>.lora_magnitude_vector`` (``LoraModel._get_adapter_state_dict``).
_DORA_MODULE_WEIGHT = ".lora_magnitude_vector.weight"
#: The wrapped-module segments of a whole ``PeftModel`` state dict (absent from PEFT's saved adapter, bar biases).
_WHOLE_MODEL_RE = re.compile(r"\.(?:base_layer|original_module|modules_to_save)\.")
#: The biases PEFT trains and saves beside the adapter (``LoraConfig(bias=...)``, ``BaseTuner._get_learnable_bias_state_dict``):
#: ``"all"`` every bias of the model, ``"lora_only"`` those of the adapted layers (``<module>.base_layer.bias``).
_PEFT_BIAS_SUFFIX = {"all": ".bias", "lora_only": ".base_layer.bias"}


class LoraKeys:
    """PEFT LoRA adapter keys (the rules' ``lora`` pattern), ``modules_to_save`` copies and trainable tokens, tagged
    with their adapter name, and the biases PEFT saves with ``bias`` ``"all"`` / ``"lora_only"`` (kept under their own name).

    A checkpoint of PEFT's saved names (:func:`peft_saved_form`) holds the adapter alone: its other tensors under
    ``base_model.model.`` (``modules_to_save`` copies, trainable tokens, saved without their adapter name) are the
    adapter's too and keep their names."""

    def __init__(self, rules: ExportRules, bias: str = "none", *, saved_form: bool = False) -> None:
        self.lora_output_key = rules.lora_output_key
        self.skipped: dict[str, list[str]] = {}
        self.bias_suffix = _PEFT_BIAS_SUFFIX.get(bias)
        self.saved_form = saved_form

    def __call__(self, key: str, fqn: str, canonical: str, entry: TensorEntry) -> Mapped | None:
        if key.startswith(_PEFT_PREFIX) and not canonical.startswith(_CANONICAL_PEFT_PREFIX):
            # PEFT's saved names at the top level (NeMo Automodel's adapter_model.safetensors), read under a model
            # prefix inside `base_model.model.` so that the fqns are the optimizer's: the module path is PEFT's again
            canonical = _CANONICAL_PEFT_PREFIX + canonical[len(CANONICAL_MODEL_PREFIX) :]
        hit = self.lora_output_key(canonical)
        if hit is None and ".modules_to_save." in canonical:
            m = _MODULES_TO_SAVE_RE.fullmatch(canonical)
            if m is not None:
                return f"{m.group('module')}.{m.group('name')}", None, m.group("adapter")
        if hit is None and ".trainable_tokens_delta." in canonical:
            t = _TRAINABLE_TOKENS_RE.fullmatch(canonical)
            if t is not None:
                return t.group("module"), None, t.group("adapter")
        if hit is None and self.bias_suffix is not None and canonical.endswith(self.bias_suffix):
            out = canonical[len(CANONICAL_MODEL_PREFIX) :]
            if out.startswith("base_model.model.") and ".original_module." not in out:
                return out
        if hit is None and self.saved_form and canonical.startswith(_CANONICAL_PEFT_PREFIX):
            # PEFT's saved adapter alone: e.g. its modules_to_save copy base_model.model.lm_head.weight
            return canonical[len(CANONICAL_MODEL_PREFIX) :]
        if hit is None:
            self.skipped.setdefault("not a LoRA adapter tensor", []).append(key)
            return None
        out = hit[0]
        if out.endswith(_DORA_MODULE_WEIGHT):  # PEFT saves DoRA's magnitude without the DoraLayer's ".weight"
            out = out[: -len(".weight")]
        return out, None, hit[1]

    def finish(self, cat: Catalog, filter_glob: str | None, warnings: list[str]) -> None:
        pass


def peft_saved_form(cat: Catalog, rules: ExportRules) -> bool:
    """Whether the model tensors are PEFT's saved adapter (``peft.get_peft_model_state_dict``; NeMo Automodel's PEFT
    save): LoRA factors without an adapter name, and no ``base_layer`` / ``original_module`` / ``modules_to_save``
    weight of a whole ``PeftModel`` state dict (their biases are ones PEFT saves with LoraConfig ``bias`` ``"all"`` /
    ``"lora_only"``: ``<module>.base_layer.bias``, and a ``modules_to_save`` module's ``original_module.bias``)."""
    named = False
    for fqn in cat.param_fqns:
        if _WHOLE_MODEL_RE.search(fqn) and not fqn.endswith(".bias"):  # a bias: one PEFT's `bias` option saves
            return False
        hit = rules.lora_output_key(CANONICAL_MODEL_PREFIX + fqn)
        if hit is not None:
            if hit[1] is not None:
                return False
            named = True
    return named


def select_model(cat: Catalog, keys: KeyMap, *, weights: str, filter_glob: str | None) -> SelectResult:
    """Walk the model tensors in order and select those ``keys`` maps (see :func:`~.plan.select_sources`).

    Raises:
        ExportError: ``weights`` master with no master weight, a master whose shape differs from its
            parameter, two keys mapping to one output key, a fused tensor with parts left out.
        ExportNamingError: from ``keys.finish``.
    """
    selected: list[Selected] = []
    warnings: list[str] = []
    skipped = keys.skipped
    tags: dict[str, str] = {}
    unwrapped: list[str] = []
    segments: set[str] = set()
    masters_found = 0
    prefix = cat.schema.model_prefix
    master = weights == "master"
    add = selected.append
    map_one = keys.__call__  # a bound method: the fast call path, 10^6 times
    wrappers = wrapper_segments_of(cat.optimizer_state, cat.param_fqns)  # a "module" the names keep is real
    # 10^6 keys: the fqns come from the catalog's shared list (KeySchema.fqn_of of every model key, in order)
    for (key, entry), param_fqn in zip(cat.model.items(), cat.param_fqns):
        fqn = param_fqn
        canonical = CANONICAL_MODEL_PREFIX + fqn  # canonical_model_key: rules match the torch-native model.<fqn>
        # "module" / "_orig_mod" cannot straddle "model." and the fqn: the test strip_wrapper_segments starts with
        if "module" in fqn or "_orig_mod" in fqn:
            canonical, removed = strip_wrapper_segments(canonical, wrappers)  # _orig_mod., module., ... anywhere
            if removed:
                unwrapped.append(key)
                segments.update(removed)
                fqn = strip_wrapper_segments(fqn, wrappers)[0]
        if fqn.endswith("_extra_state") and (fqn == "_extra_state" or fqn.endswith("._extra_state")):
            skipped.setdefault(SKIP_EXTRA_STATE, []).append(key)  # a module's extra state saved as a tensor
            continue
        mapped = map_one(key, fqn, canonical, entry)
        if mapped is None:
            continue
        hf: HFTensor | None
        tag: str | None
        if isinstance(mapped, str):
            out_key, hf, tag = mapped, None, None
        else:
            out_key, hf, tag = mapped
        if filter_glob and filtered(key, canonical, out_key, filter_glob, prefix):
            skipped.setdefault(SKIP_FILTERED, []).append(key)
            continue
        if tag is not None:
            tags[out_key] = tag
        origin: Origin
        source, origin = entry, "params"
        if master:
            mw = _master_weight(cat, param_fqn, entry)
            if mw is not None:
                source, origin = mw, "master"
                masters_found += 1
        add(Selected(key, out_key, source, origin, hf))
    if master and masters_found == 0 and selected:  # none selected: the caller's "matched none" error
        _no_masters(cat, selected, filter_glob)
    if unwrapped:
        warnings.append(
            f"wrapper segment(s) {', '.join(sorted(segments))} removed from {len(unwrapped)} key(s): {shown(unwrapped, 3)}"
        )
    keys.finish(cat, filter_glob, warnings)
    skip_other_tensors(cat, skipped)
    outside = skipped.get(SKIP_OUTSIDE_SCHEMA)
    if outside:
        warnings.append(
            f"{len(outside)} tensor(s) outside the {cat.schema.id} key schema are not exported: {shown(outside, 3)}"
        )
    _check_unique(selected)
    return selected, warnings, skipped, tags


def _no_masters(cat: Catalog, selected: list[Selected], filter_glob: str | None) -> NoReturn:
    """Refuse `weights` master where none of the ``selected`` tensors has a ``master_weight``.

    Raises:
        ExportError: always (its hint says whether other parameters have masters).
    """
    if filter_glob and selected and any("master_weight" in ps.fields for ps in cat.optimizer_state.values()):
        raise ExportError(
            f"{cat.path}: `weights` master but none of the {len(selected)} tensor(s) `filter_glob` "
            f"{filter_glob!r} selects has an optimizer.state.<fqn>.master_weight (e.g. {selected[0].model_key})",
            param="filter_glob",
            hint="the checkpoint keeps FP32 masters for other parameters (a frozen parameter or buffer has none; "
            "a tied lm_head's master is kept under the embedding's fqn): export these with `weights` params, "
            "or widen `filter_glob`",
        )
    raise ExportError(
        f"{cat.path}: `weights` master but no parameter has an optimizer.state.<fqn>.master_weight",
        hint="this checkpoint's optimizer keeps no FP32 masters (e.g. torch AdamW); export with `weights` params",
    )


def _master_weight(cat: Catalog, param_fqn: str, entry: TensorEntry) -> TensorEntry | None:
    """The parameter's optimizer ``master_weight`` entry, if any.

    Raises:
        ExportError: its shape differs from the parameter's.
    """
    ps = cat.optimizer_state.get(param_fqn)
    mw = ps.fields.get("master_weight") if ps is not None else None
    if mw is not None and mw.shape != entry.shape:
        raise ExportError(
            f"{mw.key}: master_weight shape {list(mw.shape)} differs from the parameter's {list(entry.shape)}",
            fqn=mw.key,
            hint="the optimizer state does not belong to this model; export with `weights` params",
        )
    return mw


def skip_other_tensors(cat: Catalog, skipped: dict[str, list[str]]) -> None:
    """List the non-model tensors in ``skipped`` (training state, or outside the key schema)."""
    for key in cat.other_tensors:
        reason = SKIP_TRAINING_STATE if cat.category(key) == "training_state" else SKIP_OUTSIDE_SCHEMA
        skipped.setdefault(reason, []).append(key)


def _check_unique(selected: list[Selected]) -> None:
    """Refuse two sources of one output key (a fused tensor's parts count apart) and fused tensors missing a part.

    Raises:
        ExportError: a duplicate output key, or a fused tensor not every part of which is exported.
    """
    any_hf = any(s.hf is not None for s in selected)
    if not any_hf and len({s.out_key for s in selected}) == len(selected):
        return  # every output key unique, no fused parts: nothing below raises
    seen: dict[str, str] = {}
    for s in selected:
        ident = _ident(s)
        if ident in seen:
            wrapped = strip_wrapper_segments(seen[ident])[0] == strip_wrapper_segments(s.model_key)[0]
            raise ExportError(
                f"{seen[ident]} and {s.model_key} both map to the output key {ident!r}",
                fqn=s.model_key,
                hint=(
                    "the checkpoint holds one parameter under a wrapped and an unwrapped name (a model saved with and "
                    "without its wrapper): keep one with `filter_glob`, or map one to another output key with `rules`"
                    if wrapped
                    else "fix the key rules (`rules`) so every output key is unique"
                ),
            )
        seen[ident] = s.model_key
    fused: dict[str, set[int]] = {}
    for s in selected:
        if s.hf is not None and s.hf.nparts > 1:
            fused.setdefault(s.out_key, set()).add(s.hf.part)
    for key, parts in fused.items():
        n = next(s.hf.nparts for s in selected if s.hf is not None and s.out_key == key)
        if len(parts) != n:
            have = next(s.model_key for s in selected if s.out_key == key)
            raise ExportError(
                f"{key}: fused from {n} source tensors but only {have} is exported (parts {sorted(parts)} of {n})",
                fqn=have,
                hint="export every part (check `filter_glob`), or use `experts` per-expert",
            )
    _check_shared_complete(selected)


def _ident(s: Selected) -> str:
    """The output a source writes: its key, with the part of a fused tensor (or the elements of a shared piece)."""
    if s.hf is not None and s.hf.shared:
        return f"{s.out_key} (elements from {s.hf.runs[0][3]})"
    return s.out_key if s.hf is None or s.hf.nparts == 1 else f"{s.out_key} (part {s.hf.part})"


def _check_shared_complete(selected: list[Selected]) -> None:
    """Refuse a tensor written in parts by several sources (an adapter's ``shared`` pieces) whose parts do not fill it.

    Raises:
        ExportError: a shared tensor some of whose elements no exported source writes.
    """
    written: dict[str, list[tuple[str, HFTensor]]] = {}
    for s in selected:
        if s.hf is not None and s.hf.shared:
            written.setdefault(s.hf.pieces[0][0], []).append((s.model_key, s.hf))
    for key, sources in written.items():
        numel = math.prod(sources[0][1].pieces[0][1])
        have = sum(r[1] for _, hf in sources for r in hf.runs)
        if have != numel:
            first = sources[0][0]
            raise ExportError(
                f"{key}: written in parts by {len(sources)} source tensors (e.g. {first}), which fill "
                f"{have} of its {numel} elements",
                fqn=first,
                hint="export every part (check `filter_glob`); the checkpoint may lack a part (`ckpttool validate`)",
            )
