"""``adapter_config.json`` for ``export --format lora`` (PEFT LoRA adapters).

Taken from ``--adapter-config FILE``, else ``--model-assets``, else inferred from the adapter
tensors: ``r`` from dim 0 of ``lora_A`` (others in ``rank_pattern``), ``target_modules``,
``use_dora``, ``task_type``; ``lora_alpha`` is not recoverable, so ``--lora-alpha`` is required.
Key convention: ``peft.utils.save_and_load.get_peft_model_state_dict``
(``base_model.model.<module>.lora_A.weight``). ``docs/export.md``, "LoRA adapters".
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

from ckpttool.errors import ExportError, UsageError, shell_arg
from ckpttool.format.unpickler import short_repr
from ckpttool.model.catalog import Catalog
from ckpttool.model.hfconfig import tie_word_embeddings
from ckpttool.model.schemas.base import canonical_model_key
from ckpttool.model.wrappers import strip_wrapper_segments
from ckpttool.ops.export.plan import SKIP_FILTERED, ExportPlan

__all__ = ["INFERRED_SCALING", "adapter_config", "check_lora_alpha", "read_adapter_config"]

#: The warning of a LoRA export or merge whose scaling comes from ``lora_alpha`` alone (no adapter config):
#: rsLoRA's ``alpha / sqrt(r)`` and an ``alpha_pattern`` leave no trace in the tensors.
INFERRED_SCALING = (
    "no adapter config given: the LoRA scaling is `lora_alpha` / r; if training used use_rslora (alpha / sqrt(r)) "
    "or an alpha_pattern, the adapter computes other logits: pass that run's adapter_config.json as `adapter_config`"
)

_PEFT_PREFIX = "base_model.model."
_FACTOR_RE = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B)(?:\.weight)?$")
_BIAS_RE = re.compile(r"\.lora_B\.bias$")
_TOKENS = ".token_adapter.trainable_tokens_delta"
_NOT_COPIES = (".bias", _TOKENS)  # output keys of a module that are not a modules_to_save copy
#: PEFT's ``EMBEDDING_LAYER_NAMES``: the module names ``ensure_weight_tying`` takes for the input embedding
_EMBEDDING_NAMES = ("embed_tokens", "lm_head")
#: the module transformers' causal LM classes tie to the input embedding (``_tied_weights_keys``), which
#: ``ensure_weight_tying`` gives the embedding's adapter or ``modules_to_save`` copy
_TIED_HEAD = "lm_head"
_ADAPTER_PART_RE = re.compile(
    r"\.(?:lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)(?:\.weight)?$"
)


def read_adapter_config(path: Path) -> dict[str, Any]:
    """Load and sanity-check an adapter config JSON file.

    Raises:
        UsageError: unreadable, not a JSON object, or not a LoRA config.
    """
    from ckpttool.format.files import read_regular, refuse_directory
    from ckpttool.format.jsonfile import parse_json
    from ckpttool.format.limits import current

    refuse_directory(path, "adapter_config", "an adapter_config.json file")
    try:
        data = parse_json(read_regular(path, current().max_object_bytes, what="adapter config"), str(path))
    except OSError as e:
        raise UsageError(
            f"{path}: cannot read adapter config ({e.strerror})",
            path=path,
            hint="pass the adapter_config.json that PEFT wrote for this adapter, or leave `adapter_config` out "
            "to take the one in `model_assets` or one inferred from the tensors",
        ) from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(
            f"{path}: adapter config is not valid JSON ({e})",
            path=path,
            hint="pass the adapter_config.json that PEFT wrote for this adapter",
        ) from e
    if not isinstance(data, dict):
        raise UsageError(f"{path}: adapter config must be a JSON object", path=path)
    peft_type = str(data.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise UsageError(f"{path}: peft_type is {data.get('peft_type')!r}; `fmt` lora writes LoRA adapters", path=path)
    _check_values(path, data)
    return data


def _is_alpha(v: Any) -> bool:
    """A usable LoRA alpha: a finite number above 0 (not a bool). 0 makes the adapter a no-op, NaN / infinity make
    every adapted output NaN, a negative one flips the delta's sign: none is a trained adapter's alpha."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(float(v)) and v > 0
    except OverflowError:  # an integer beyond float range
        return False


def _is_rank(v: Any) -> bool:
    """A LoRA rank as PEFT takes it: an integer above 0 (not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _bad_regex(text: str) -> bool:
    try:
        re.compile(text)
    except re.error:
        return True
    return False


def check_lora_alpha(value: float | None) -> None:
    """Raises UsageError: ``lora_alpha`` (the option) NaN, infinite, 0 or negative."""
    if value is not None and not _is_alpha(value):
        raise UsageError(
            f"`lora_alpha` {value!r} is not a finite number above 0",
            param="lora_alpha",
            hint="pass the LoraConfig lora_alpha used in training (e.g. 16)",
        )


def _check_values(path: Path, data: dict[str, Any]) -> None:
    """Refuse the adapter config values that would give a wrong adapter or merge (PEFT takes them unchecked).

    Raises:
        UsageError: ``lora_alpha`` / an ``alpha_pattern`` value not a finite number above 0, ``r`` / a
            ``rank_pattern`` value not an integer above 0, a pattern not an object or with a key that is not a
            regular expression, ``target_modules`` not a regular expression or a list of strings,
            ``modules_to_save`` not a list of strings, ``bias`` not ``none`` / ``all`` / ``lora_only``.
    """
    problem = _scalar_problem(data) or _pattern_problem(data) or _modules_problem(data)
    if problem is not None:
        raise UsageError(
            f"{path}: adapter config {problem}",
            path=path,
            hint="pass the adapter_config.json that PEFT wrote for this adapter",
        )


def _scalar_problem(data: dict[str, Any]) -> str | None:
    if "lora_alpha" in data and not _is_alpha(data["lora_alpha"]):
        return f"lora_alpha {short_repr(data['lora_alpha'])} is not a finite number above 0"
    if "r" in data and not _is_rank(data["r"]):
        return f"r {short_repr(data['r'])} is not an integer above 0"
    if data.get("bias", "none") not in ("none", "all", "lora_only"):
        return f"bias {short_repr(data['bias'])} is not one of 'none', 'all', 'lora_only'"
    return None


def _pattern_problem(data: dict[str, Any]) -> str | None:
    for name, ok, what in (
        ("alpha_pattern", _is_alpha, "a finite number above 0"),
        ("rank_pattern", _is_rank, "an integer above 0"),
    ):
        pattern = data.get(name)
        if pattern is None:
            continue
        if not isinstance(pattern, dict):
            return f"{name} is not an object of module name -> value"
        for k, v in pattern.items():
            if not ok(v):
                return f"{name}[{short_repr(k)}] {short_repr(v)} is not {what}"
            if _bad_regex(k):
                return f"{name} key {short_repr(k)} is not a regular expression"
    return None


def _modules_problem(data: dict[str, Any]) -> str | None:
    target, saved = data.get("target_modules"), data.get("modules_to_save")
    if isinstance(target, str):
        if _bad_regex(target):
            return f"target_modules {short_repr(target)} is not a regular expression"
    elif not (target is None or (isinstance(target, list) and all(isinstance(t, str) for t in target))):
        return f"target_modules {short_repr(target)} is not a string (a regex) or a list of module names"
    if not (saved is None or (isinstance(saved, list) and all(isinstance(t, str) for t in saved))):
        return f"modules_to_save {short_repr(saved)} is not a list of module names"
    for name in ("exclude_modules", "layers_pattern"):
        value = data.get(name)
        if isinstance(value, str):
            if _bad_regex(value):
                return f"{name} {short_repr(value)} is not a regular expression"
        elif not (value is None or (isinstance(value, list) and all(isinstance(t, str) for t in value))):
            return f"{name} {short_repr(value)} is not a string or a list of strings"
    layers = data.get("layers_to_transform")
    if not (layers is None or _is_index(layers) or (isinstance(layers, list) and all(_is_index(i) for i in layers))):
        return f"layers_to_transform {short_repr(layers)} is not a layer index or a list of them"
    return None


def _is_index(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def adapter_config(
    plan: ExportPlan,
    cat: Catalog,
    *,
    given: dict[str, Any] | None,
    lora_alpha: float | None,
    model_config: dict[str, Any] | None,
    beside: Path | None = None,
) -> dict[str, Any]:
    """The ``adapter_config.json`` content for a LoRA export.

    Args:
        plan: the LoRA export plan (output keys ``base_model.model.<module>.lora_*``).
        cat: the catalog (base-layer keys tell which same-named modules have no adapter).
        given: a config from ``--adapter-config`` / ``--model-assets``, used as is after a
            rank check; ``None`` to infer one.
        lora_alpha: ``--lora-alpha`` (overrides ``given``'s).
        model_config: the base model's ``config.json`` (``task_type``, ``base_model_name_or_path``).
        beside: an ``adapter_config.json`` saved with the checkpoint, which the error without ``lora_alpha`` names.

    Raises:
        ExportError: no ``lora_alpha`` anywhere, or ``given["r"]`` disagreeing with the tensors.
    """
    ranks, dora = _ranks(plan, cat)
    _refuse_parameter_targets(cat, ranks)
    saved = _modules_to_save(plan, ranks)
    biased = sorted(p.name for t in plan.tasks for p in t.pieces if _BIAS_RE.search(p.name))
    bias = _trained_bias(plan, saved)
    _check_trainable_tokens(plan, given)
    if given is not None:
        if bool(given.get("use_dora")) != dora:
            raise ExportError(
                f"{cat.path}: the adapter config sets use_dora {bool(given.get('use_dora'))} but the checkpoint holds "
                + ("DoRA magnitude vectors (lora_magnitude_vector)" if dora else "no DoRA magnitude vector")
                + ": PEFT would load the adapter "
                + ("without them (plain LoRA)" if dora else "with magnitudes computed from the base weights"),
                hint="pass the adapter_config.json that belongs to this checkpoint, or leave `adapter_config` out "
                "to infer one",
            )
        _check_lora_bias(given, biased)
        _check_given_bias(given, bias)
        checked = _checked_given(given, ranks, lora_alpha, saved, _tied_by_peft(given, model_config))
        if not plan.skipped.get(SKIP_FILTERED):  # a `filter_glob` export leaves adapters out on purpose
            _refuse_untrained_targets(cat, given)
        else:  # ... but the given config, written as is, must not name what it left out
            _refuse_filtered_targets(cat, given, ranks, saved)
        return checked
    if lora_alpha is None:
        raise _alpha_unknown(cat, beside)
    _warn_inferred(plan, cat, bias[0])
    common_r = Counter(ranks.values()).most_common(1)[0][0]
    modules = sorted(ranks)
    _check_peft_matches(modules, None)
    rel = [m[len(_PEFT_PREFIX) :] if m.startswith(_PEFT_PREFIX) else m for m in modules]
    rank_pattern = {r_mod: ranks[m] for m, r_mod in zip(modules, rel) if ranks[m] != common_r}
    task_type = None
    archs = (model_config or {}).get("architectures") or []
    if any(isinstance(a, str) and a.endswith("ForCausalLM") for a in archs):
        task_type = "CAUSAL_LM"
    return {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": (model_config or {}).get("_name_or_path") or None,
        "r": common_r,
        "lora_alpha": lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": _target_modules(cat, rel),
        "bias": bias[0],
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": dora,
        "lora_bias": bool(biased),
        "modules_to_save": saved or None,
        "rank_pattern": rank_pattern,
        "alpha_pattern": {},
        "init_lora_weights": True,
        "inference_mode": True,
    }


def _alpha_unknown(cat: Catalog, beside: Path | None) -> ExportError:
    """E601: no ``lora_alpha`` given; the hint names the adapter config saved with the checkpoint, if any, else the
    ``lora_alpha`` verl's ``lora_train_meta.json`` beside it records."""
    hint = "pass `lora_alpha` A (the LoraConfig lora_alpha used in training) or `adapter_config` FILE"
    if beside is not None:
        hint = f"pass `adapter_config` {shell_arg(beside)} (the adapter config saved with the checkpoint) or `lora_alpha` A"
    else:
        hint = verl_alpha_hint(cat.path) or hint
    return ExportError(f"{cat.path}: lora_alpha cannot be inferred from the adapter weights", hint=hint)


def verl_alpha_hint(path: Any) -> str | None:
    """The hint of an unknown ``lora_alpha`` that names the one verl's :data:`_VERL_LORA_META` in checkpoint folder
    ``path`` records (``None``: no such file, or not one that holds ``r`` and ``lora_alpha``)."""
    meta = _verl_lora_meta(path)
    if meta is None:
        return None
    return (
        f"pass `lora_alpha` {meta[1]:g} (verl's {_VERL_LORA_META} beside the checkpoint records r {meta[0]}, "
        f"lora_alpha {meta[1]:g}) or `adapter_config` FILE"
    )


#: verl's FSDP checkpoint manager writes the PEFT model's ``{"r", "lora_alpha", "task_type"}`` here, in the checkpoint
#: folder (``FSDPCheckpointManager._save_lora_train_meta``).
_VERL_LORA_META = "lora_train_meta.json"


def _verl_lora_meta(path: Any) -> tuple[int, float] | None:
    """``(r, lora_alpha)`` from verl's :data:`_VERL_LORA_META` in local checkpoint folder ``path``; ``None`` when there
    is none, it is not JSON or it does not hold both as numbers (it is a hint's source, never an error's)."""
    from ckpttool.errors import CkptError
    from ckpttool.format.files import read_regular
    from ckpttool.format.jsonfile import parse_json

    if not isinstance(path, Path) or not (path / _VERL_LORA_META).is_file():
        return None
    try:
        doc = parse_json(read_regular(path / _VERL_LORA_META, 1 << 16), str(path / _VERL_LORA_META))
    except (CkptError, OSError, ValueError):  # ValueError: not JSON (empty, cut short by a killed save), not UTF-8
        return None
    r, alpha = (doc.get("r"), doc.get("lora_alpha")) if isinstance(doc, dict) else (None, None)
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        return None
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        return None
    return r, float(alpha)


def _trained_bias(plan: ExportPlan, saved: list[str]) -> tuple[str, str | None]:
    """The ``bias`` option the written biases stand for, and one such bias: ``("all", key)`` where a bias of a layer
    without an adapter is written (``...k_proj.bias``), ``("lora_only", key)`` where only adapted layers' are
    (``...q_proj.base_layer.bias``), else ``("none", None)``. A ``lora_B`` bias (``lora_bias``) and a bias of a
    ``modules_to_save`` copy are not such biases. They are written where a given config's ``bias`` selects them, or
    where the checkpoint is PEFT's saved adapter (:func:`~ckpttool.ops.export.select.peft_saved_form`), which holds
    only what training saved: ``get_peft_model_state_dict`` with that ``bias``."""
    copies = {_PEFT_PREFIX + m for m in saved}
    found: str | None = None
    for task in plan.tasks:
        for p in task.pieces:
            if not p.name.endswith(".bias") or _BIAS_RE.search(p.name) or p.name.rsplit(".", 1)[0] in copies:
                continue
            if not p.name.endswith(".base_layer.bias"):
                return "all", p.name
            found = found or p.name
    return ("lora_only", found) if found is not None else ("none", None)


def _check_given_bias(given: dict[str, Any], bias: tuple[str, str | None]) -> None:
    """Raises ExportError: the written biases need a ``bias`` option the given config does not set (``none``, or
    ``lora_only`` beside the bias of a layer without an adapter): the adapter would say it trained no such bias."""
    want, key = bias
    have = given.get("bias", "none")
    if key is None or have == "all" or (have == "lora_only" and want == "lora_only"):
        return
    raise ExportError(
        f"{key}: the checkpoint holds the biases PEFT saves with LoraConfig bias {want!r} but the adapter config sets "
        f"bias {have!r}: the adapter would not say which biases it trained",
        fqn=key,
        hint="pass the adapter_config.json that belongs to this checkpoint, or leave `adapter_config` out to infer one",
    )


def _warn_inferred(plan: ExportPlan, cat: Catalog, bias: str) -> None:
    """The warnings of an inferred adapter config: the scaling it assumes, and the biases it leaves out (the tensors
    of a whole model's state dict cannot tell a bias trained with PEFT's ``bias`` ``all`` / ``lora_only`` from the
    base model's; PEFT's saved adapter holds only trained ones, written with their ``bias``)."""
    plan.warnings.append(INFERRED_SCALING)
    adapted_bias = next((k for k in cat.model if k.endswith(".base_layer.bias")), None)
    if adapted_bias is not None and bias == "none":
        plan.warnings.append(
            f"the adapted layers have biases ({adapted_bias}, ...): an inferred config has bias 'none' and writes "
            "none of them; if training used LoraConfig bias 'all' or 'lora_only', pass that run's adapter_config.json "
            "as `adapter_config` (PEFT saves the trained biases with the adapter)"
        )


def _check_trainable_tokens(plan: ExportPlan, given: dict[str, Any] | None) -> None:
    """Raises ExportError: the adapter holds trainable tokens (``trainable_tokens_delta``) but no given config says
    which token ids they are (``trainable_token_indices``: PEFT would load the adapter without them), or a list of
    indices whose count is not the delta's rows, or a given config naming trainable tokens the checkpoint does not
    hold (PEFT's load fails on the missing ``trainable_tokens_delta``: KeyError)."""
    wanted = (given or {}).get("trainable_token_indices")
    if wanted and not any(p.name.endswith(_TOKENS) for task in plan.tasks for p in task.pieces):
        raise ExportError(
            f"the adapter config sets trainable_token_indices {short_repr(wanted, 60)} but the checkpoint holds no "
            "trainable tokens (token_adapter.trainable_tokens_delta): PEFT cannot load such an adapter",
            hint="pass the adapter_config.json that belongs to this checkpoint (or remove its trainable_token_indices)",
        )
    for task in plan.tasks:
        for p in task.pieces:
            if not p.name.endswith(_TOKENS):
                continue
            if not wanted:
                raise ExportError(
                    f"{p.name}: the checkpoint holds trainable tokens (LoraConfig trainable_token_indices) but "
                    + (
                        "no adapter config is given"
                        if given is None
                        else "the adapter config has no trainable_token_indices"
                    )
                    + ": which token ids they replace cannot be read from the tensors, and PEFT would load the "
                    "adapter without them",
                    fqn=p.name,
                    hint="pass the run's adapter_config.json with `adapter_config` (or in `model_assets`)",
                )
            if isinstance(wanted, list) and len(wanted) != p.shape[0]:
                raise ExportError(
                    f"{p.name}: {p.shape[0]} trainable token row(s) but the adapter config's trainable_token_indices "
                    f"lists {len(wanted)}",
                    fqn=p.name,
                    hint="pass the adapter_config.json that belongs to this checkpoint",
                )


def _ranks(plan: ExportPlan, cat: Catalog) -> tuple[dict[str, int], bool]:
    """Module -> rank (dim 0 of its ``lora_A`` / ``lora_embedding_A``), and whether DoRA magnitudes are present.

    Every module's factors are checked as PEFT would need them: both ``A`` and ``B`` (PEFT loads a missing one
    freshly initialised, with at most a warning), 2-D, ``B [out, r]`` and ``A [r, in]`` of one rank, and, where
    the checkpoint holds the module's ``base_layer.weight``, ``[out, in]`` its shape (or ``[in, out]``: a Conv1D weight,
    which PEFT adapts with ``fan_in_fan_out``).

    Raises:
        ExportError: no ``lora_A`` / ``lora_embedding_A`` tensor, an incomplete pair, or factor shapes that do not fit.
    """
    factors: dict[str, dict[str, tuple[int, ...]]] = {}
    dora = False
    for task in plan.tasks:
        for p in task.pieces:
            m = _FACTOR_RE.match(p.name)
            if m:
                factors.setdefault(m.group("module"), {})[m.group("part")] = tuple(p.shape)
            if ".lora_magnitude_vector" in p.name:
                dora = True
    if not any(part in parts for parts in factors.values() for part in ("lora_A", "lora_embedding_A")):
        raise ExportError(
            f"{cat.path}: no lora_A / lora_embedding_A tensor among the adapter keys",
            hint="the checkpoint has no complete LoRA adapter; check `filter_glob`",
        )
    bases = _base_shapes(cat)
    ranks: dict[str, int] = {}
    for module, parts in sorted(factors.items()):
        kind = "lora_embedding_" if any(k.startswith("lora_embedding_") for k in parts) else "lora_"
        a, b = parts.get(kind + "A"), parts.get(kind + "B")
        if a is None or b is None or len(parts) != 2:
            have = ", ".join(sorted(parts))
            missing = ", ".join(sorted({kind + "A", kind + "B"} - set(parts))) or "a pair of one kind"
            raise ExportError(
                f"{module}: has {have} but no {missing}: PEFT would load the adapter with the missing factor freshly "
                "initialised (a wrong or no-op adapter)",
                fqn=module,
                hint="export a checkpoint that holds both LoRA factors of every module (check `filter_glob`)",
            )
        base = bases.get(module)
        # an embedding is [in, out]; so is a Conv1D weight (GPT-2's), whose LoRA PEFT runs with fan_in_fan_out
        wants = () if base is None else ((base, base[::-1]) if kind == "lora_" else (base[::-1],))
        if len(a) != 2 or len(b) != 2 or b[1] != a[0] or (wants and (b[0], a[1]) not in wants):
            raise ExportError(
                f"{module}: {kind}B {list(b)} and {kind}A {list(a)} do not form a LoRA pair B [out, r] @ A [r, in]"
                + ("" if base is None else f" of its base weight {list(base)}"),
                fqn=module,
                hint="the lora_A / lora_B tensors do not belong together; export the checkpoint they were trained in",
            )
        ranks[module] = a[0]
    return ranks, dora


def _refuse_parameter_targets(cat: Catalog, ranks: dict[str, int]) -> None:
    """Raises ExportError: a LoRA module that wraps parameters rather than a layer's ``weight`` (PEFT's
    ``target_parameters``, a ``ParamWrapper``: ``experts.lora_A`` beside ``experts.base_layer.base_layer.down_proj``),
    whose factors hold ``r`` rows per expert and whose config keys no writer here produces."""
    prefix = canonical_model_key("")
    wrapped: set[str] = set()
    for key in cat.model:
        canonical = strip_wrapper_segments(cat.schema.canonical_key(key))[0]
        if (
            not canonical.startswith(prefix)
            or ".base_layer." not in canonical
            or canonical.endswith((".base_layer.weight", ".base_layer.bias"))  # a layer's (a bias PEFT's `bias` saves)
        ):
            continue
        parts = canonical[len(prefix) :].split(".base_layer.")
        wrapped.update(".base_layer.".join(parts[:i]) for i in range(1, len(parts)))
    bases = _base_shapes(cat)
    for module in sorted(ranks):
        if module in wrapped and module not in bases:
            raise ExportError(
                f"{module}: LoRA on a parameter (LoraConfig target_parameters, e.g. fused MoE experts), not on a "
                "layer's weight: its adapter export is not implemented",
                fqn=module,
                hint="save the adapter with PEFT's save_pretrained, or leave these modules out with `filter_glob`",
            )


def _check_lora_bias(given: dict[str, Any], biased: list[str]) -> None:
    """Raises ExportError: the checkpoint holds ``lora_B`` biases (``biased``) and ``given`` does not set ``lora_bias``."""
    if biased and not given.get("lora_bias"):
        raise ExportError(
            f"{biased[0]}: the checkpoint holds lora_B biases (LoraConfig lora_bias=True) but the adapter config "
            "does not set lora_bias: PEFT would load the adapter without them",
            fqn=biased[0],
            hint="pass the adapter_config.json that belongs to this checkpoint, or leave `adapter_config` out "
            "to infer one",
        )


def _refuse_untrained_targets(cat: Catalog, given: dict[str, Any]) -> None:
    """Refuse a given adapter config that targets modules the checkpoint holds no adapter for: PEFT would put a
    freshly initialised adapter on each (random ``lora_B`` too with ``init_lora_weights: false``: other logits
    than the trained model's), and the config would name modules that were never trained.

    The modules looked at are the checkpoint's un-adapted 2-D ``<module>.weight`` under ``base_model.model.``
    (layers PEFT can wrap; norms are 1-D); an ``all-linear`` or ``target_parameters`` config is not checked
    (which of them PEFT takes depends on the layer classes, which the checkpoint does not record), nor one without
    ``target_modules`` (PEFT fills them from its own per-model table).

    Raises:
        ExportError (E601): such a module, naming it and the settings that match it.
    """
    if given.get("target_modules") in (None, "all-linear") or given.get("target_parameters"):
        return
    prefix = canonical_model_key(_PEFT_PREFIX)
    bad: list[str] = []
    for key, entry in cat.model.items():
        canonical = strip_wrapper_segments(cat.schema.canonical_key(key))[0]
        if (
            not canonical.startswith(prefix)
            or not canonical.endswith(".weight")
            or len(entry.shape) != 2
            or ".base_layer." in canonical
            or ".lora_" in canonical
            or _ADAPTER_PART_RE.search(canonical)
        ):
            continue
        module = canonical[len(prefix) : -len(".weight")]
        if peft_target_matches(module, given):
            bad.append(module)
    if bad:
        shown = ", ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")
        raise ExportError(
            f"the adapter config targets {len(bad)} module(s) the checkpoint holds no LoRA adapter for ({shown}): "
            f"PEFT would give each an untrained adapter; {_matching_settings(given)}",
            fqn=_PEFT_PREFIX + bad[0],
            hint="pass the adapter_config.json that belongs to this checkpoint, or leave `adapter_config` out to "
            "infer one",
        )


_LORA_A_SEGMENT_RE = re.compile(r"\.(?:lora_A|lora_embedding_A)(?:\.|$)")


def _refuse_filtered_targets(cat: Catalog, given: dict[str, Any], ranks: dict[str, int], saved: list[str]) -> None:
    """Refuse a given adapter config, written as is, that names modules whose tensors ``filter_glob`` left out.

    The checkpoint holds the module's adapter (a ``lora_A`` / ``lora_embedding_A``) or ``modules_to_save`` copy, the
    given config targets it (or lists it in ``modules_to_save``), and the export does not write it: PEFT would give the
    module an untrained adapter (random ``lora_B`` too with ``init_lora_weights: false``), and fails to load
    (``KeyError``) a ``modules_to_save`` module whose copy is missing. ``ranks`` are the modules written (under
    ``base_model.model.``), ``saved`` the copies written (without it).

    Raises:
        ExportError (E601): such modules, naming them and the settings that name them.
    """
    prefix = canonical_model_key(_PEFT_PREFIX)
    written = {m.removeprefix(_PEFT_PREFIX) for m in ranks} | set(saved)
    copies = {m for m in given.get("modules_to_save") or [] if isinstance(m, str)}
    left: set[str] = set()
    for key in cat.model:
        canonical = strip_wrapper_segments(cat.schema.canonical_key(key))[0]
        if not canonical.startswith(prefix):
            continue
        path = canonical[len(prefix) :]
        factor = _LORA_A_SEGMENT_RE.search(path)
        if factor is not None:
            module = path[: factor.start()]
            if module not in written and peft_target_matches(module, given):
                left.add(module)
        elif ".modules_to_save." in path:
            module = path.split(".modules_to_save.", 1)[0]
            if module not in written and _names_suffix(module, copies):
                left.add(module)
    if left:
        bad = sorted(left)
        shown = ", ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")
        raise ExportError(
            f"`filter_glob` left out {len(bad)} module(s) the adapter config names ({shown}): written with that "
            "config, PEFT would give each an untrained adapter, or fail to load a modules_to_save module without its "
            f"copy; {_matching_settings(given)}",
            fqn=_PEFT_PREFIX + bad[0],
            hint="keep them in `filter_glob`, or leave `adapter_config` out to infer a config of the modules kept "
            "(with `lora_alpha`), or pass a config that names only those",
        )


def _names_suffix(module: str, names: set[str]) -> bool:
    """Whether ``module`` is one of ``names`` or ends with ``.`` and one of them (PEFT's ``modules_to_save`` match),
    by its dot-suffixes: linear in the module's depth whatever the number of ``names``."""
    parts = module.split(".")
    return any(".".join(parts[i:]) in names for i in range(len(parts)))


def _base_shapes(cat: Catalog) -> dict[str, tuple[int, ...]]:
    """``base_model.model.<module>`` -> the shape of its ``base_layer.weight`` in the checkpoint (PEFT's wrapped layer)."""
    prefix = canonical_model_key("")
    out: dict[str, tuple[int, ...]] = {}
    for key, entry in cat.model.items():
        canonical = strip_wrapper_segments(cat.schema.canonical_key(key))[0]
        if canonical.startswith(prefix) and canonical.endswith(".base_layer.weight"):
            out[canonical[len(prefix) : -len(".base_layer.weight")]] = tuple(entry.shape)
    return out


def _modules_to_save(plan: ExportPlan, ranks: dict[str, int]) -> list[str]:
    """The paths (under ``base_model.model.``) of the ``modules_to_save`` copies written: the output modules that are
    not LoRA modules (``base_model.model.lm_head.weight`` -> ``lm_head``); a bias alone is one PEFT's ``bias``
    ``all`` / ``lora_only`` saves, not a copy (a copy has its weight)."""
    out: set[str] = set()
    for task in plan.tasks:
        for p in task.pieces:
            if _ADAPTER_PART_RE.search(p.name) or ".lora_" in p.name or p.name.endswith(_NOT_COPIES):
                continue
            module = p.name.rsplit(".", 1)[0]
            if module not in ranks and module.startswith(_PEFT_PREFIX):
                out.add(module[len(_PEFT_PREFIX) :])
    return sorted(out)


def _tied_by_peft(cfg: dict[str, Any], model_config: dict[str, Any] | None) -> tuple[str, str]:
    """What PEFT adds to the embedding's adapter under ``ensure_weight_tying`` (``LoraModel._check_tied_modules``) when
    the base model ties its head to the input embedding (``tie_word_embeddings`` of ``model_config``): ``("saved",
    head)`` when ``modules_to_save`` names an embedding (PEFT then saves the head as a tied copy too, though its
    saved config lists the embedding alone), ``("target", head)`` when ``target_modules`` does (the head gets a LoRA
    tied to the embedding's); ``("", "")`` otherwise; the kind is prefixed ``?`` where ``model_config`` does not
    say whether the head is tied (none given, or one that leaves it to an unknown model class)."""
    tied = tie_word_embeddings(model_config)
    if not cfg.get("ensure_weight_tying") or tied is False:
        return ("", "")
    known = "" if tied else "?"
    if any(isinstance(m, str) and m.split(".")[-1] in _EMBEDDING_NAMES for m in cfg.get("modules_to_save") or []):
        return (known + "saved", _TIED_HEAD)
    target = cfg.get("target_modules")
    if isinstance(target, str):
        embedded = any(re.fullmatch(target, m) for m in _EMBEDDING_NAMES)
    else:
        embedded = any(isinstance(m, str) and m.split(".")[-1] in _EMBEDDING_NAMES for m in target or [])
    return (known + "target", _TIED_HEAD) if embedded else ("", "")


def _checked_given(
    given: dict[str, Any],
    ranks: dict[str, int],
    lora_alpha: float | None,
    saved: list[str],
    tied: tuple[str, str] = ("", ""),
) -> dict[str, Any]:
    """A given adapter config, checked against the tensors' ranks and modules, ``lora_alpha`` applied; ``tied``: what
    PEFT ties to the embedding's adapter (:func:`_tied_by_peft`), a module it loads whatever the config lists.

    Raises:
        ExportError: its ``r`` disagrees with a module's rank (no ``rank_pattern``), PEFT would not
            load a module (a LoRA module outside ``target_modules``, a ``modules_to_save`` copy outside
            ``modules_to_save``), or no ``lora_alpha`` anywhere.
    """
    cfg = dict(given)
    if tied[0].startswith("?") and any(_in_list(m.removeprefix(_PEFT_PREFIX), [tied[1]]) for m in [*saved, *ranks]):
        raise ExportError(
            f"the adapter config sets ensure_weight_tying and the checkpoint holds {tied[1]!r} "
            f"({'a modules_to_save copy' if tied[0] == '?saved' else 'a LoRA'}): PEFT loads it tied to the "
            "embedding's only where the base model ties its embeddings, which no config.json says here",
            fqn=_PEFT_PREFIX + tied[1],
            hint="pass the base model's folder (its config.json) as `model_assets`",
        )
    listed = cfg.get("modules_to_save") or []
    listed = [*listed, tied[1]] if tied[0] == "saved" else listed
    unlisted = [m for m in saved if not any(isinstance(t, str) and (m == t or m.endswith("." + t)) for t in listed)]
    if unlisted:
        raise ExportError(
            f"the adapter config's modules_to_save {cfg.get('modules_to_save')!r} does not name {unlisted[0]!r}, "
            "whose trained copy the checkpoint holds: PEFT would load the adapter without it",
            fqn=_PEFT_PREFIX + unlisted[0],
            hint="pass the adapter_config.json that belongs to this checkpoint (PEFT lists modules_to_save there), "
            "or leave `adapter_config` out to infer one",
        )
    r = cfg.get("r", 8)  # PEFT's LoraConfig default
    pattern = cfg.get("rank_pattern") or {}
    for module, rank in ranks.items():
        key = pattern_key(pattern, module[len(_PEFT_PREFIX) :] if module.startswith(_PEFT_PREFIX) else module)
        want = r if key is None else pattern[key]
        if want != rank:
            where = "r" if key is None else f"rank_pattern[{key!r}]"
            raise ExportError(
                f"adapter config says {where}={want} but {module}.lora_A has rank {rank}",
                fqn=module,
                hint="pass the adapter_config.json that belongs to this checkpoint",
            )
    _check_peft_matches(sorted(ranks), cfg, tied[1] if tied[0] == "target" else None)
    if lora_alpha is not None:
        cfg["lora_alpha"] = lora_alpha
    if "lora_alpha" not in cfg:
        raise ExportError("the adapter config has no lora_alpha", hint="pass `lora_alpha` A")
    cfg.setdefault("peft_type", "LORA")
    return cfg


def pattern_key(pattern: dict[str, Any], module: str) -> str | None:
    """The ``rank_pattern`` / ``alpha_pattern`` key PEFT uses for ``module`` (a path in the base model), or ``None``.

    As ``peft.utils.other.get_pattern_key``: the first key ``k`` with ``re.match(rf"(.*\\.)?({k})$", module)``.
    """
    for k in pattern:
        if re.match(rf"(.*\.)?({k})$", module):
            return k
    return None


def _target_modules(cat: Catalog, rel: list[str]) -> Any:
    """``target_modules``: the module names of ``rel`` (paths under ``base_model.model.``), or an anchored
    regex of the exact paths when a same-named module has no adapter (``<module>.weight``, no base_layer)."""
    names = sorted({m.rsplit(".", 1)[-1] for m in rel})
    targeted = set(rel)
    untargeted = False
    prefix = canonical_model_key(_PEFT_PREFIX)
    for key in map(cat.schema.canonical_key, cat.model):  # the torch-native spelling model.<fqn>
        if not key.startswith(prefix) or ".base_layer." in key or _ADAPTER_PART_RE.search(key) or ".lora_" in key:
            continue
        module = key[len(prefix) :].rsplit(".", 1)[0]
        if module.rsplit(".", 1)[-1] in names and module not in targeted:
            untargeted = True
            break
    if untargeted:
        return "^(?:" + "|".join(re.escape(m) for m in rel) + ")$"
    return names


def peft_target_matches(module: str, config: dict[str, Any] | None) -> bool:
    """Whether PEFT would put an adapter on ``module`` (a path in the base model) for adapter config ``config``.

    As ``peft.tuners.tuners_utils.check_target_module_exists``: a module ``exclude_modules`` names (a regex string:
    ``re.fullmatch``; a list: equal or ending with ``"." + entry``) or inside a ``modules_to_save`` module gets none;
    a ``target_modules`` string is a regex matched against the whole path (``"all-linear"``: every module but
    ``lm_head``); a list matches a path equal to an entry, or ending with ``"." + entry`` and, with
    ``layers_to_transform``, whose layer index (after ``layers_pattern``, else the first numbered segment) is listed.
    ``None`` (no config, or no ``target_modules``) matches everything (PEFT fills it per model). A module whose
    ``weight`` ``target_parameters`` names (``"gate.weight"``: PEFT's ``ParamWrapper``, which PEFT also makes of a
    ``target_modules`` entry naming a module that is no layer it knows, such as Qwen3-MoE's router) is matched too:
    as ``_inject_parameters``, the ``<module>.<parameter>`` path equal to an entry or ending with ``"." + entry``.
    """
    cfg = config or {}
    exclude = cfg.get("exclude_modules")
    if isinstance(exclude, str) and re.fullmatch(exclude, module):
        return False
    if isinstance(exclude, list) and _in_list(module, exclude):
        return False
    if any(isinstance(m, str) and re.match(rf"(^|.*\.){m}($|\..*)", module) for m in cfg.get("modules_to_save") or []):
        return False
    params = cfg.get("target_parameters")
    if isinstance(params, list) and _in_list(f"{module}.weight", params):
        return True  # a ParamWrapper on a module's own 2-D `weight` (a router's): its factors are a Linear's
    target = cfg.get("target_modules")
    if target is None:
        return not params
    if isinstance(target, str):
        if target == "all-linear":
            return module.rsplit(".", 1)[-1] != "lm_head"
        return re.fullmatch(target, module) is not None
    if module in target:
        return True
    if not _in_list(module, target):
        return False
    layers = cfg.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    patterns = cfg.get("layers_pattern")
    if isinstance(patterns, str):
        patterns = [patterns]
    match = None
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
    else:
        for pattern in patterns:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module)
            if match is not None:
                break
    if match is None:
        return False
    index = int(match.group("idx"))
    return index == layers if isinstance(layers, int) else index in layers


def _in_list(module: str, names: list[Any]) -> bool:
    return any(isinstance(t, str) and (module == t or module.endswith("." + t)) for t in names)


def _check_peft_matches(modules: list[str], config: dict[str, Any] | None, tied: str | None = None) -> None:
    """Refuse LoRA output modules that PEFT would not load (``set_peft_model_state_dict`` drops them silently);
    ``tied``: a module PEFT adapts as the embedding's tied partner (:func:`_tied_by_peft`).

    Raises:
        ExportError: a module outside ``base_model.model.`` or one the config's ``target_modules``,
            ``exclude_modules``, ``layers_to_transform`` / ``layers_pattern`` or ``modules_to_save`` leave out.
    """
    bad = []
    for m in modules:
        if not m.startswith(_PEFT_PREFIX):
            bad.append(f"{m} (not under {_PEFT_PREFIX})")
        elif not peft_target_matches(m[len(_PEFT_PREFIX) :], config) and not (
            tied and _in_list(m[len(_PEFT_PREFIX) :], [tied])
        ):
            bad.append(f"{m} (not matched by the adapter config)")
    if bad:
        shown = "; ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")
        settings = _matching_settings(config)
        raise ExportError(
            f"{len(bad)} LoRA module(s) would not be loaded by PEFT: {shown}" + (f"; {settings}" if settings else ""),
            fqn=modules[0],
            hint="PEFT loads base_model.model.<module path>.lora_A.weight for the modules target_modules names; "
            "fix the adapter config's target_modules (exclude_modules, layers_to_transform) or the key rules (`rules`)",
        )


def _matching_settings(config: dict[str, Any] | None) -> str:
    """The config settings that choose PEFT's modules, for a message."""
    cfg = config or {}
    names = ("target_modules", "exclude_modules", "layers_to_transform", "layers_pattern", "modules_to_save")
    return ", ".join(f"{n} {short_repr(cfg[n])}" for n in names if cfg.get(n) not in (None, [], ""))
