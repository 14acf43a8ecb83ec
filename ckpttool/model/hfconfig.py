"""Hugging Face ``config.json``: reading it, and looking up fields the way transformers does.

Multimodal configs keep the language model's fields under ``text_config``
(``transformers.PretrainedConfig.get_text_config``); :func:`config_value` looks there too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Container, Iterable
from pathlib import Path
from typing import Any

from ckpttool.errors import PathEscapeError, UsageError
from ckpttool.format import limits

__all__ = [
    "read_hf_config",
    "config_value",
    "tie_word_embeddings",
    "tied_embedding_key",
    "untied_embedding_key",
    "TIED_EMBEDDING_OF_MODEL_TYPE",
    "TIE_DEFAULTS",
    "TIED_EMBEDDING_KEYS",
]

#: The input embedding a tied ``lm_head.weight`` shares, as transformers' model classes name it
#: (``_tied_weights_keys``: ``{"lm_head.weight": <one of these>}``): Llama-like, multimodal (Gemma3, Qwen2-VL,
#: Llava, Mistral3), GPT-2 / GPT-J / BigCode, OPT, GPT-NeoX, BLOOM / Falcon.
TIED_EMBEDDING_KEYS: tuple[str, ...] = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "transformer.wte.weight",
    "model.decoder.embed_tokens.weight",
    "gpt_neox.embed_in.weight",
    "transformer.word_embeddings.weight",
)


def tied_embedding_key(names: Container[str], candidates: Iterable[str] = TIED_EMBEDDING_KEYS) -> str | None:
    """The one key of ``candidates`` (the model classes' own: :data:`TIED_EMBEDDING_KEYS`) that ``names`` holds: the
    embedding a tied ``lm_head.weight`` shares; ``None`` where ``names`` holds none of them, or several (which one the
    head is tied to is then not known)."""
    found = [k for k in candidates if k in names]
    return found[0] if len(found) == 1 else None


#: The embedding of :data:`TIED_EMBEDDING_KEYS` that the model class of a ``model_type`` ties ``lm_head.weight`` to,
#: for the families whose candidates lie equally deep (``transformer.wte`` beside ``transformer.word_embeddings``).
TIED_EMBEDDING_OF_MODEL_TYPE: dict[str, str] = {
    "gpt2": "transformer.wte.weight",
    "gptj": "transformer.wte.weight",
    "gpt_bigcode": "transformer.wte.weight",
    "bloom": "transformer.word_embeddings.weight",
    "falcon": "transformer.word_embeddings.weight",
}


def untied_embedding_key(
    names: Collection[str], candidates: Iterable[str] = TIED_EMBEDDING_KEYS, model_type: str | None = None
) -> str | None:
    """The embedding a tied ``lm_head.weight`` stands for in a folder that stores the head and none of ``candidates``
    (safetensors' ``save_model`` keeps the first name of shared tensors in sorted order: ``lm_head.weight``): the
    candidate whose module (its key less the last two names: ``model.decoder.`` of OPT's) holds keys of ``names``,
    the deepest (OPT's ``model.decoder.`` before Llama's ``model.``); ``None`` where none does or several at one depth
    (GPT-2's ``transformer.wte`` beside BLOOM's ``transformer.word_embeddings``), unless the config's ``model_type``
    names one of them (:data:`TIED_EMBEDDING_OF_MODEL_TYPE`; a ``model_type`` not a string, as an untrusted config.json
    may hold, names none)."""
    hits = [
        c for c in candidates if any(n.startswith(c.rsplit(".", 2)[0] + ".") for n in names if n != "lm_head.weight")
    ]
    if not hits:
        return None
    depth = max(c.count(".") for c in hits)
    deepest = [c for c in hits if c.count(".") == depth]
    if len(deepest) == 1:
        return deepest[0]
    named = TIED_EMBEDDING_OF_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    return named if named in deepest else None


#: The ``tie_word_embeddings`` default of transformers' config class for each ``model_type`` (what
#: ``from_pretrained`` uses when ``config.json`` leaves the key out, as older hub configs do). The classes differ:
#: ``LlamaConfig`` says ``False``, ``GemmaConfig`` and ``GPT2Config`` ``True``. Checked against the installed
#: transformers' own config classes by ``tests/model/test_hfconfig_tie.py``; a ``model_type`` not listed is
#: asked of transformers when it is installed.
TIE_DEFAULTS: dict[str, bool] = {
    "bloom": True,
    "cohere": True,
    "cohere2": True,
    "deepseek_v2": False,
    "deepseek_v3": False,
    "ernie4_5": True,
    "ernie4_5_moe": True,
    "exaone4": False,
    "falcon": True,
    "gemma": True,
    "gemma2": True,
    "gemma3": True,
    "gemma3_text": True,
    "glm": False,
    "glm4": False,
    "glm4_moe": False,
    "gpt2": True,
    "gpt_neox": False,
    "gpt_oss": False,
    "gptj": False,
    "granite": False,
    "granitemoe": False,
    "jamba": False,
    "llama": False,
    "llama4": False,
    "llama4_text": False,
    "minimax": False,
    "mistral": False,
    "mistral3": True,
    "mixtral": False,
    "nemotron": False,
    "olmo": False,
    "olmo2": False,
    "olmo3": False,
    "olmoe": False,
    "opt": True,
    "phi": False,
    "phi3": False,
    "phimoe": False,
    "qwen2": False,
    "qwen2_5_vl": False,
    "qwen2_moe": False,
    "qwen2_vl": False,
    "qwen3": False,
    "qwen3_moe": False,
    "qwen3_next": False,
    "qwen3_vl": False,
    "qwen3_vl_moe": False,
    "smollm3": True,
    "stablelm": False,
    "starcoder2": True,
}


def read_hf_config(path: str | os.PathLike[str], *, param: str | None = "config") -> dict[str, Any]:
    """Read an HF ``config.json`` (a file, or a directory holding one).

    Args:
        path: the file or its directory.
        param: the library parameter that named it (for the error message); ``None``: no option named it, it is
            the config.json in the folder read (an HF folder's own), and the message names it so.

    Raises:
        UsageError: missing, unreadable or not a JSON object.
        PathEscapeError: ``path`` is a directory whose ``config.json`` is a symlink out of it.
        NotRegularFileError, SizeLimitError, JsonDepthError, IntegerRangeError: a FIFO or device,
            too large, nested too deeply, an impossible number.
    """
    from ckpttool.format.files import (
        hub_hint,
        read_regular,
        refuse_link_to_nothing,
        resolve_inside,
        unexpanded_tilde_hint,
    )
    from ckpttool.format.jsonfile import parse_json

    p = Path(path)
    named = f"`{param}` file" if param is not None else "config.json"
    hub = hub_hint(p) if p.is_dir() else None  # a hub repository folder or cache: config.json is in a snapshot
    if p.is_dir():
        try:
            p = resolve_inside(p, "config.json", what=named)
        except PathEscapeError as e:  # the default hint speaks of a checkpoint's files
            if param is not None:
                e.hint = f"a folder's config.json is read only inside it; name the file you mean: `{param}` {p / 'config.json'}"
            raise
        refuse_link_to_nothing(Path(path) / "config.json", param)
    who = f"`{param}` {p}" if param is not None else f"{p} (the folder's own config.json)"
    fix = (
        "pass an HF config.json"
        if param is not None
        else "the folder's config.json is damaged: restore it (the model's dimensions and quantization are read from it)"
    )
    try:
        obj = parse_json(read_regular(p, limits.current().max_object_bytes, what="config.json"), str(p))
    except OSError as e:
        raise UsageError(
            f"{who}: cannot read ({e.strerror})",
            path=p,
            param=param,
            hint=hub
            or unexpanded_tilde_hint(p)
            or ("pass the model's config.json (or the directory holding it)" if param is not None else fix),
        ) from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{who}: not valid JSON ({e})", path=p, param=param, hint=fix) from e
    if not isinstance(obj, dict):
        raise UsageError(
            f"{who}: expected a JSON object, got {type(obj).__name__}",
            path=p,
            param=param,
            hint=fix,
        )
    return obj


def config_value(cfg: dict[str, Any] | None, *names: str) -> Any:
    """First of ``names`` set in ``cfg`` or its ``text_config`` (multimodal HF configs), else ``None``."""
    if not cfg:
        return None
    text = cfg.get("text_config")
    for scope in (cfg, text if isinstance(text, dict) else None):
        if scope:
            for n in names:
                if scope.get(n) is not None:
                    return scope[n]
    return None


def _class_default(model_type: str) -> bool | None:
    """The ``tie_word_embeddings`` default of transformers' config class for ``model_type``: :data:`TIE_DEFAULTS`,
    else the installed transformers' class (imported only then); ``None`` when neither knows it."""
    if model_type in TIE_DEFAULTS:
        return TIE_DEFAULTS[model_type]
    return _transformers_default(model_type)


_ASKED: dict[str, bool | None] = {}


def _transformers_default(model_type: str) -> bool | None:
    if model_type not in _ASKED:
        v: Any = None
        try:
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            cfg = CONFIG_MAPPING[model_type]()
            v = getattr(cfg, "tie_word_embeddings", None)
            if v is None:  # a multimodal class that leaves it to its language model's config
                v = getattr(cfg.get_text_config(), "tie_word_embeddings", None)
        except Exception:  # transformers missing, or no class for this model_type: not known
            v = None
        _ASKED[model_type] = v if isinstance(v, bool) else None
    return _ASKED[model_type]


def tie_word_embeddings(cfg: dict[str, Any] | None) -> bool | None:
    """The ``tie_word_embeddings`` transformers uses for ``cfg``: the value it sets (or its ``text_config`` sets),
    else the default of the config class of its ``model_type`` (``text_config``'s when the top level's class has
    none); ``None`` when the config sets none and no ``model_type`` says (a bare dict, an unknown model type)."""
    v = config_value(cfg, "tie_word_embeddings")
    if v is not None:
        return bool(v) if isinstance(v, (bool, int)) else None
    if not cfg:
        return None
    text = cfg.get("text_config")
    for scope in (cfg, text if isinstance(text, dict) else None):
        mt = scope.get("model_type") if scope else None
        if isinstance(mt, str):
            d = _class_default(mt)
            if d is not None:
                return d
    return None
