"""Hugging Face ``config.json``: reading it, and looking up fields the way transformers does.

Multimodal configs keep the language model's fields under ``text_config``
(``transformers.PretrainedConfig.get_text_config``); :func:`config_value` looks there too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ckpttool.errors import PathEscapeError, UsageError
from ckpttool.format import limits

__all__ = ["read_hf_config", "config_value"]


def read_hf_config(path: str | os.PathLike[str], *, param: str = "config") -> dict[str, Any]:
    """Read an HF ``config.json`` (a file, or a directory holding one).

    Args:
        path: the file or its directory.
        param: the library parameter that named it (for the error message).

    Raises:
        UsageError: missing, unreadable or not a JSON object.
        PathEscapeError: ``path`` is a directory whose ``config.json`` is a symlink out of it.
        NotRegularFileError, SizeLimitError, JsonDepthError, IntegerRangeError: a FIFO or device,
            too large, nested too deeply, an impossible number.
    """
    from ckpttool.format.files import read_regular, resolve_inside
    from ckpttool.format.jsonfile import parse_json

    p = Path(path)
    if p.is_dir():
        try:
            p = resolve_inside(p, "config.json", what=f"`{param}` file")
        except PathEscapeError as e:  # the default hint speaks of a checkpoint's files
            e.hint = (
                f"a folder's config.json is read only inside it; name the file you mean: `{param}` {p / 'config.json'}"
            )
            raise
    try:
        obj = parse_json(read_regular(p, limits.current().max_object_bytes, what="config.json"), str(p))
    except OSError as e:
        raise UsageError(
            f"`{param}` {p}: cannot read ({e.strerror})",
            path=p,
            param=param,
            hint="pass the model's config.json (or the directory holding it)",
        ) from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(
            f"`{param}` {p}: not valid JSON ({e})", path=p, param=param, hint="pass an HF config.json"
        ) from e
    if not isinstance(obj, dict):
        raise UsageError(
            f"`{param}` {p}: expected a JSON object, got {type(obj).__name__}",
            path=p,
            param=param,
            hint="pass an HF config.json",
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
