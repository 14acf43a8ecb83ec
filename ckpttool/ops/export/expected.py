"""Expected keys, shapes and dtypes from the real model class, built by transformers from ``config.json`` on the meta device.

The export plan (or a checkpoint's model tensors, ``validate --config``) is compared with the
meta model's ``state_dict()``: ``missing`` (tied weights excepted, as ``save_pretrained``
does), ``unexpected``, ``shape``, and ``dtype`` when the config names one; fused expert tensors
in their fused form. Importing transformers' modeling code is slow, so results are cached in
the user's cache directory (``model-shapes-v1/``, keyed by the config and the installed
transformers/torch versions); an entry is untrusted input (size cap, its own key, every value's
type and range) and anything else is ignored and rebuilt. ``docs/export.md``, "Shape checks
against the model class"; ``docs/security.md``, "The parsed-metadata cache".
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from ckpttool.format.jsonview import json_fields

__all__ = [
    "ModelCheck",
    "MISMATCH_KINDS",
    "check_config_bounds",
    "expected_state_dict",
    "compare_with_model",
    "not_linear_weights",
    "shapes_entry_path",
]

log = logging.getLogger(__name__)

_FOLDER = "model-shapes-v1"
_ENTRY_FORMAT = 4  # 2: ``not_linear``; 3: task-head classes; 4: ``ignored`` (older entries are ignored and rebuilt)
#: ``architectures`` classes built as named, not as the causal LM: their head (``score``, ``classifier``,
#: ``qa_outputs``) replaces ``lm_head``
HEAD_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")
_MAX_ENTRY_BYTES = 64 << 20
_MAX_DIM = 1 << 62
_MAX_NDIM = 64


class Expected(NamedTuple):
    """The model class's state dict, as :func:`expected_state_dict` gives it (and its cache entry holds)."""

    tensors: dict[str, tuple[tuple[int, ...], str]]
    """key -> (shape, dtype name) of ``state_dict()``"""
    optional: set[str]
    """the tied keys ``save_pretrained`` leaves out"""
    model_class: str
    """e.g. ``LlamaForCausalLM``"""
    not_linear: frozenset[str]
    """``<module>.weight`` keys of 2-D weights whose module is no ``torch.nn.Linear`` (GPT-2's ``Conv1D``,
    embeddings): what transformers' FP8 quantizers (``FineGrainedFP8``, compressed-tensors) do not convert"""
    ignored: tuple[str, ...] = ()
    """regular expressions (``re.search``) of keys the class has no tensor for that ``from_pretrained`` drops without
    a word (:func:`_ignored_on_load`): no ``unexpected`` finding"""


#: the kinds of difference, each allowed with ``allow_mismatch`` (``--allow-mismatch``).
MISMATCH_KINDS = ("missing", "unexpected", "shape", "dtype")


@dataclass
class ModelCheck:
    """Result of comparing tensors with the model class built from a config.

    Attributes:
        checked: whether the comparison ran.
        model_class: e.g. ``LlamaForCausalLM``.
        not_checked: why it did not run (transformers missing, unknown ``model_type``), else ``None``.
        findings: kind -> one line per key.
    """

    checked: bool
    model_class: str | None = None
    not_checked: str | None = None
    findings: dict[str, list[str]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return json_fields(self)


def _versions() -> tuple[str, str] | None:
    """The installed transformers and torch versions from their package metadata (no import), or ``None``."""
    from importlib import metadata

    try:
        return metadata.version("transformers"), metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def _entry_key(config: dict[str, Any], versions: tuple[str, str]) -> str | None:
    try:
        text = json.dumps(
            {"config": config, "transformers": versions[0], "torch": versions[1], "format": _ENTRY_FORMAT},
            sort_keys=True,
            ensure_ascii=True,
            allow_nan=False,
        )
    except (TypeError, ValueError):  # a config json.dumps cannot write back (not from JSON): no caching
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def shapes_entry_path(key: str) -> Path:
    """Path of the cache entry with SHA-256 key ``key`` (hex)."""
    from ckpttool.format.cache import cache_dir

    return cache_dir() / _FOLDER / f"{key}.json"


def _load_entry(path: Path, key: str) -> Expected | None:
    """The entry at ``path`` when it is well formed and for ``key``; ``None`` (logged) otherwise."""
    from ckpttool.format.cache import read_entry

    blob = read_entry(path, _MAX_ENTRY_BYTES, logger=log)  # a FIFO or device at the path is not read
    if blob is None:
        return None
    try:
        if len(blob) > _MAX_ENTRY_BYTES:
            raise ValueError("entry too large")
        doc = json.loads(blob)
        if not isinstance(doc, dict) or doc.get("format") != _ENTRY_FORMAT or doc.get("key") != key:
            raise ValueError("format or key differs")
        cls, tensors, optional = doc.get("model_class"), doc.get("tensors"), doc.get("optional")
        not_linear, ignored = doc.get("not_linear"), doc.get("ignored")
        if not isinstance(cls, str) or not cls.isidentifier() or not isinstance(tensors, dict):
            raise ValueError("model_class or tensors malformed")
        out = _entry_tensors(tensors)
        if not isinstance(optional, list) or not all(isinstance(k, str) and k in out for k in optional):
            raise ValueError("optional keys malformed")
        if not isinstance(not_linear, list) or not all(isinstance(k, str) and k in out for k in not_linear):
            raise ValueError("not_linear keys malformed")
        if not isinstance(ignored, list) or len(ignored) > 64 or not all(_is_pattern(p) for p in ignored):
            raise ValueError("ignored patterns malformed")
    except (ValueError, RecursionError) as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        log.info("model shape cache entry %s ignored (%s); building the model again", path, e)
        return None
    return Expected(out, set(optional), cls, frozenset(not_linear), tuple(ignored))


def _is_pattern(p: Any) -> bool:
    """A cache entry's ``ignored`` item: a short string that compiles as a regular expression."""
    if not isinstance(p, str) or len(p) > 512:
        return False
    try:
        re.compile(p)
    except re.error:
        return False
    return True


def _entry_tensors(tensors: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """An entry's ``tensors``, each shape and dtype checked.

    Raises:
        ValueError: naming the first malformed tensor.
    """
    from ckpttool.format.metadata import DTYPE_ITEMSIZE

    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for k, v in tensors.items():
        if not (isinstance(v, list) and len(v) == 2 and isinstance(v[0], list) and isinstance(v[1], str)):
            raise ValueError(f"tensor {k[:80]!r} malformed")
        shape, dtype = v
        if len(shape) > _MAX_NDIM or not all(type(d) is int and 0 <= d <= _MAX_DIM for d in shape):
            raise ValueError(f"tensor {k[:80]!r}: bad shape")
        if dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"tensor {k[:80]!r}: unknown dtype")
        out[k] = (tuple(shape), dtype)
    return out


def _store_entry(path: Path, key: str, got: Expected) -> None:
    """Write the entry (temporary file + rename); any failure is only logged."""
    doc = {
        "format": _ENTRY_FORMAT,
        "key": key,
        "model_class": got.model_class,
        "tensors": {k: [list(shape), dtype] for k, (shape, dtype) in got.tensors.items()},
        "optional": sorted(got.optional),
        "not_linear": sorted(got.not_linear),
        "ignored": list(got.ignored),
    }
    from ckpttool.format.cache import store_entry

    store_entry(path, lambda: json.dumps(doc).encode("ascii"), "model shape cache", logger=log)


def expected_state_dict(config: dict[str, Any]) -> Expected | str:
    """The model's state dict as ``key -> (shape, dtype name)``, its optional (tied) keys, and the class name.

    From the cache entry of this config and these transformers / torch versions when there is
    a valid one (see the module docstring), else built with transformers on the meta device
    (and the entry written).

    Returns:
        the triple, or a string saying why it cannot be built (transformers not installed, a
        ``model_type`` it does not know, a config it rejects).
    """
    mt = config.get("model_type")
    if not isinstance(mt, str):
        return "config.json has no model_type"
    from ckpttool.format.cache import cache_enabled

    versions = _versions()
    if versions is None:
        return "transformers is not installed (pip install 'ckpttool[hf]')"
    key = _entry_key(config, versions) if cache_enabled() else None
    if key is not None:
        path = shapes_entry_path(key)
        hit = _load_entry(path, key)
        if hit is not None:
            log.debug("model shapes of %s from the cache entry %s", hit.model_class, path)
            return hit
    got = _build_expected(config, mt)
    if key is not None and not isinstance(got, str):
        _store_entry(path, key, got)
    return got


def _meta_model(config: dict[str, Any], mt: str) -> tuple[Any, Any] | str:
    """``(model, its config)``: the model transformers builds from ``config`` on the meta device, or why not: the
    causal LM, or the class ``architectures[0]`` names when that is a task head (:data:`HEAD_SUFFIXES`: a
    ``LlamaForSequenceClassification`` has ``score``, no ``lm_head``)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError:
        return "transformers is not installed (pip install 'ckpttool[hf]')"
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    try:
        fields = {k: v for k, v in config.items() if k != "model_type"}
        cfg = AutoConfig.for_model(mt, **fields)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.device("meta"):
                head = _head_class(config)
                if head is not None:
                    return head(cfg), cfg
                return AutoModelForCausalLM.from_config(cfg), cfg  # type: ignore[no-untyped-call]
    except Exception as e:  # a model_type transformers does not know, a config its class rejects
        why = " ".join(str(e).split())[:160]  # one line: pydantic-style errors span several
        return f"transformers cannot build a causal LM from this config ({type(e).__name__}: {why})"


def _head_class(config: dict[str, Any]) -> Any:
    """The transformers class ``architectures[0]`` names when it is a task head (:data:`HEAD_SUFFIXES`), else None."""
    arch = config.get("architectures")
    name = arch[0] if isinstance(arch, list) and arch else None
    if not isinstance(name, str) or not name.endswith(HEAD_SUFFIXES):
        return None
    import transformers

    try:
        return getattr(transformers, name)
    except (AttributeError, ImportError):  # a class this transformers does not have: the causal LM is checked
        return None


def not_linear_weights(config: dict[str, Any], names: list[str]) -> tuple[str, list[str]] | None:
    """Of the ``<module>.weight`` ``names``, those whose module in the config's model class is no ``torch.nn.Linear``
    (:attr:`Expected.not_linear`, from the cache like :func:`expected_state_dict`), with the class's name:
    transformers' FP8 quantizers convert ``nn.Linear`` modules only, so an FP8 weight of any other module loads as
    FP8 values without its scale. Names the class has no module for (per-expert names of fused experts) are not
    judged. ``None``: the class cannot be built (transformers missing, an unknown ``model_type``)."""
    got = expected_state_dict(config)
    if isinstance(got, str):
        return None
    return got.model_class, [n for n in names if n in got.not_linear]


def _build_expected(config: dict[str, Any], mt: str) -> Expected | str:
    """:func:`expected_state_dict` without the cache: transformers builds the model on the meta device."""
    got = _meta_model(config, mt)
    if isinstance(got, str):
        return got
    model, cfg = got
    sd = model.state_dict()
    out = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in sd.items()}
    optional: set[str] = set()
    if getattr(cfg, "tie_word_embeddings", False) or getattr(cfg.get_text_config(), "tie_word_embeddings", False):
        tied = getattr(model, "_tied_weights_keys", None) or {}
        optional.update(tied if isinstance(tied, (dict, list, tuple, set)) else [])
        for name, mod in model.named_modules():
            t = getattr(mod, "_tied_weights_keys", None)
            if t:
                optional.update(f"{name}.{k}" if name else k for k in t)
    import torch

    not_linear = {
        f"{name}.weight" if name else "weight"
        for name, mod in model.named_modules(remove_duplicate=False)
        if not isinstance(mod, torch.nn.Linear)
        and isinstance(mod._parameters.get("weight"), torch.Tensor)
        and mod._parameters["weight"].dim() == 2
    }
    return Expected(
        out,
        {k for k in optional if k in out},
        type(model).__name__,
        frozenset(not_linear & out.keys()),
        _ignored_on_load(model),
    )


def _ignored_on_load(model: Any) -> tuple[str, ...]:
    """The patterns of keys ``from_pretrained`` drops silently (``PreTrainedModel._adjust_missing_and_unexpected_keys``):
    the class's ``_keys_to_ignore_on_load_unexpected``, and ``rotary_emb.inv_freq`` / ``position_ids`` where the model
    has such buffers (non-persistent now; older transformers versions saved them, e.g. Llama's per-layer
    ``self_attn.rotary_emb.inv_freq``)."""
    pats = [p for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [] if _is_pattern(p)]
    buffers = [name for name, _ in model.named_buffers()]
    if any(b.endswith("rotary_emb.inv_freq") for b in buffers):
        pats.append(r"rotary_emb\.inv_freq")
    if any(b.endswith("position_ids") for b in buffers):
        pats.append(r"(^|\.)position_ids$")
    return tuple(sorted(set(pats)))


#: Config fields that count layers, and experts per layer (top level and nested text/decoder configs).
_LAYER_FIELDS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers", "decoder_layers")
_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
#: The bound on the model class a config may ask for: layers (at least one tensor each) at most
#: this or twice the tensors checked, whichever is more; layers x experts at most :data:`MAX_EXPERT_MODULES`.
MAX_LAYERS = 1024
MAX_EXPERT_MODULES = 1 << 20


def _counts(config: dict[str, Any], fields: tuple[str, ...]) -> list[tuple[str, int]]:
    """``(path, value)`` of the int ``fields`` of ``config`` and of its nested configs (two levels)."""
    out: list[tuple[str, int]] = []
    todo: list[tuple[str, Any, int]] = [("", config, 0)]
    while todo:
        where, doc, depth = todo.pop()
        for k, v in doc.items():
            if k in fields and type(v) is int:
                out.append((f"{where}{k}", v))
            elif isinstance(v, dict) and depth < 2:
                todo.append((f"{where}{k}.", v, depth + 1))
    return out


def check_config_bounds(config: dict[str, Any], tensors: int) -> None:
    """Refuse a config whose model class would be absurd to build on the meta device (before building it).

    Transformers builds every module the config asks for: ``num_hidden_layers: 200000`` ran for
    minutes and GBs. A model has at least one tensor per layer, so layers beyond
    ``max(MAX_LAYERS, 2 * tensors)`` (``tensors``: those being checked) cannot describe this
    checkpoint; layers x experts are bounded by :data:`MAX_EXPERT_MODULES`.

    Raises:
        SizeLimitError: ``E307``, naming the field.
    """
    from ckpttool.errors import SizeLimitError

    layer_cap = max(MAX_LAYERS, 2 * tensors)
    layers = _counts(config, _LAYER_FIELDS)
    experts = _counts(config, _EXPERT_FIELDS)
    hint = "pass the config.json of the model this checkpoint was trained as"
    for name, v in layers:
        if v > layer_cap:
            raise SizeLimitError(
                f"config.json: {name} {v:,} is more layers than a model class is built for here "
                f"(at most {layer_cap:,}: {MAX_LAYERS:,} or twice the {tensors:,} tensors checked)",
                hint=hint,
            )
    most_layers = max((v for _, v in layers), default=1)
    for name, v in experts:
        if v > 0 and v * max(most_layers, 1) > MAX_EXPERT_MODULES:
            raise SizeLimitError(
                f"config.json: {name} {v:,} x {max(most_layers, 1):,} layers is more expert modules than a model "
                f"class is built for here (at most {MAX_EXPERT_MODULES:,})",
                hint=hint,
            )


def _floating(dtype: str) -> bool:
    return dtype in ("float32", "float16", "bfloat16", "float64")


def compare_with_model(
    written: dict[str, tuple[tuple[int, ...], str]],
    config: dict[str, Any],
    *,
    loaded_by_hf: bool = True,
) -> ModelCheck:
    """Compare ``written`` (key -> (shape, dtype)) with the model class of ``config`` (see the module docstring).
    ``loaded_by_hf``: the keys ``from_pretrained`` drops without a word (:attr:`Expected.ignored`) are no
    ``unexpected`` finding (an export's files; ``False`` for an import, which ``dcp.load`` reads).

    Raises:
        SizeLimitError: ``E307``, a config past :func:`check_config_bounds` (before anything is built).
    """
    check_config_bounds(config, len(written))
    got = expected_state_dict(config)
    if isinstance(got, str):
        return ModelCheck(False, not_checked=got)
    expected, optional, cls = got.tensors, got.optional, got.model_class
    ignored = re.compile("|".join(f"({p})" for p in got.ignored)) if got.ignored and loaded_by_hf else None
    want_dtype = config.get("dtype") or config.get("torch_dtype")
    findings: dict[str, list[str]] = {}
    for k, (shape, _) in expected.items():
        if k not in written and k not in optional:
            findings.setdefault("missing", []).append(f"{k} {list(shape)}")
    for k, (shape, dtype) in written.items():
        if k not in expected:
            if ignored is None or ignored.search(k) is None:  # else a key from_pretrained drops without a word
                findings.setdefault("unexpected", []).append(f"{k} {list(shape)}")
            continue
        if shape != expected[k][0]:
            findings.setdefault("shape", []).append(f"{k}: {list(shape)}, {cls} has {list(expected[k][0])}")
        if isinstance(want_dtype, str) and _floating(dtype) and _floating(want_dtype) and dtype != want_dtype:
            findings.setdefault("dtype", []).append(f"{k}: {dtype}, config dtype {want_dtype}")
    return ModelCheck(True, model_class=cls, findings=findings)
