"""The ``--against`` reference of ``ckpttool validate``: expected model keys, shapes and dtypes.

A reference is one of:

- an HF model directory: ``model.safetensors.index.json`` (its ``weight_map`` names the
  shards) or every ``*.safetensors`` file in it; ``config.json`` beside it gives
  ``tie_word_embeddings`` (or its ``model_type``'s default: ``model.hfconfig.tie_word_embeddings``);
- a ``.safetensors`` file;
- a JSON file: a list of keys, ``{"keys": [...]}``, an index with ``weight_map``, or
  ``{key: {"shape": [...], "dtype": "bfloat16"}}``.

Keys are HF names (``model.layers.0.mlp.down_proj.weight``, ``lm_head.weight``): the
checkpoint key ``model.<name>``. Only safetensors *headers* are read (format: 8-byte
little-endian header length, then a JSON header; huggingface/safetensors ``README``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttool.errors import CkptError, PathEscapeError, UsageError
from ckpttool.format.files import hub_hint, read_regular, resolve_inside, unexpanded_tilde_hint
from ckpttool.format.jsonfile import DuplicateKeyError, json_error, parse_json
from ckpttool.format.limits import current
from ckpttool.format.safetensors import SAFETENSORS_TAGS, HeaderError, read_header
from ckpttool.model.hfconfig import tie_word_embeddings

__all__ = ["RefTensor", "Reference", "load_reference"]


@dataclass(frozen=True)
class RefTensor:
    """Expected shape and dtype of one key (``None``: not given by the reference)."""

    shape: tuple[int, ...] | None = None
    dtype: str | None = None


@dataclass
class Reference:
    """Expected model tensors: HF key -> :class:`RefTensor`; ``tie_word_embeddings`` from its config
    (``config_problem``: why the ``config.json`` beside it could not be read, ``None`` when read or absent);
    ``config``: that ``config.json`` (``None``: absent or unreadable), the dimensions a model adapter maps
    a checkpoint's names to HF's with."""

    source: str
    tensors: dict[str, RefTensor] = field(default_factory=dict)
    tie_word_embeddings: bool | None = None
    config_problem: str | None = None
    config: dict[str, Any] | None = None


def _bad(p: Path, why: str, hint: str | None = None) -> UsageError:
    return UsageError(
        f"`against` {p}: {why}",
        path=p,
        hint=hint or "pass an HF model directory (safetensors + index), a .safetensors file or a JSON key list",
    )


_HEADER_WORDS = {
    "short": "not a safetensors file (shorter than 8 bytes)",
    "too_long": "safetensors header of {length} bytes is implausible",
    "past_end": "safetensors header of {length} bytes runs past the end of the file ({size} bytes)",
    "truncated": "safetensors header of {length} bytes runs past the end of the file ({size} bytes)",
    "not_object": "safetensors header is not a JSON object",
}


def _header_error(p: Path, e: HeaderError) -> CkptError:
    if e.kind != "not_json":
        return _bad(p, e.reason(_HEADER_WORDS))
    if isinstance(e.cause, DuplicateKeyError):
        return _bad(p, f"safetensors header holds a {e.cause}")
    assert e.cause is not None
    return json_error(e.cause, str(p)) or _bad(p, "safetensors header is not JSON")


def _safetensors_header(p: Path) -> dict[str, RefTensor]:
    try:
        header, _ = read_header(p)
    except OSError as e:
        raise _bad(p, f"cannot read ({e.strerror})") from e
    except HeaderError as e:
        raise _header_error(p, e) from None
    out = {}
    for k, v in header.items():
        if k == "__metadata__" or not isinstance(v, dict):
            continue
        shape = v.get("shape")
        if isinstance(shape, list) and not all(type(s) is int and 0 <= s < 1 << 62 for s in shape):
            raise _bad(p, f"tensor {k!r:.80}: shape is not a list of sizes")
        out[str(k)] = RefTensor(
            tuple(shape) if isinstance(shape, list) else None,
            SAFETENSORS_TAGS.get(str(v.get("dtype")), str(v.get("dtype")).lower() if v.get("dtype") else None),
        )
    return out


def _from_index(p: Path, obj: dict[str, Any], folder: Path | None = None) -> dict[str, RefTensor]:
    """``folder``: where the shards are (default the index's own; a hub snapshot's index resolves into ``blobs/``,
    its shards are beside the link)."""
    folder = p.parent if folder is None else folder
    wm = obj.get("weight_map")
    if not isinstance(wm, dict):
        raise _bad(p, "index has no weight_map object")
    out: dict[str, RefTensor] = {}
    shards = sorted({str(s) for s in wm.values()})
    found = [(s, resolve_inside(folder, s, what="weight_map file")) for s in shards]  # PathEscapeError outside
    missing = [s for s, sp in found if not sp.exists()]
    if missing and len(missing) < len(found):  # some shards here, some not: the shapes of part of the model only
        raise _bad(
            p,
            f"weight_map names {len(missing)} of {len(found)} shards that are not in {folder} "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): an incomplete download or copy",
        )
    for _, sp in found:
        if sp.exists():
            out.update(_safetensors_header(sp))
    for k in wm:
        out.setdefault(str(k), RefTensor())
    return out


def _from_json(p: Path, folder: Path | None = None) -> dict[str, RefTensor]:
    try:
        obj = parse_json(read_regular(p, current().max_object_bytes, what="reference"), str(p))
    except OSError as e:
        raise _bad(p, f"cannot read ({e.strerror})") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _bad(p, f"not valid JSON ({e})") from e
    if isinstance(obj, dict) and "weight_map" in obj:
        return _from_index(p, obj, folder)
    if isinstance(obj, dict) and isinstance(obj.get("keys"), list):
        obj = obj["keys"]
    if isinstance(obj, list):
        if not all(isinstance(k, str) for k in obj):
            raise _bad(p, "key list holds non-strings")
        return {k: RefTensor() for k in obj}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(v, dict):
                raise _bad(p, f"entry {k!r} is not an object with shape/dtype")
            shape = v.get("shape")
            if isinstance(shape, list) and not all(type(s) is int and 0 <= s < 1 << 62 for s in shape):
                raise _bad(p, f"entry {k!r:.80}: shape is not a list of sizes")
            out[str(k)] = RefTensor(
                tuple(shape) if isinstance(shape, list) else None,
                _json_dtype(str(v["dtype"])) if v.get("dtype") else None,
            )
        return out
    raise _bad(p, f"expected a list or an object, got {type(obj).__name__}")


def _json_dtype(name: str) -> str:
    """A dtype of a JSON reference as torch names it: ``bfloat16``, ``torch.bfloat16`` or the safetensors tag ``BF16``
    (what a header or ``safe_open(...).get_slice(k).get_dtype()`` gives)."""
    return SAFETENSORS_TAGS.get(name) or name.removeprefix("torch.")


def _with_config(source: str, tensors: dict[str, RefTensor], config_path: Path | None) -> Reference:
    """The reference, with the ``config.json`` beside it read (``None``: there is none) and, where it cannot be
    read, why."""
    if config_path is None:
        return Reference(source, tensors)
    try:
        cfg = parse_json(read_regular(config_path, current().max_object_bytes, what="config.json"), str(config_path))
    except OSError as e:
        return Reference(source, tensors, config_problem=f"{config_path}: cannot read ({e.strerror or e})")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return Reference(source, tensors, config_problem=f"{config_path}: not valid JSON ({e})")
    if not isinstance(cfg, dict):
        return Reference(source, tensors, config_problem=f"{config_path}: not a JSON object ({type(cfg).__name__})")
    return Reference(source, tensors, tie_word_embeddings(cfg), config=cfg)


def load_reference(path: str | os.PathLike[str]) -> Reference:
    """Load an ``--against`` reference (see module docstring).

    Raises:
        UsageError: missing, unreadable or not a reference.
    """
    try:
        ref = _load(Path(path))
    except PathEscapeError as e:  # the default hint speaks of a checkpoint's files
        e.hint = (
            "a reference folder's files are read only inside it (a Hugging Face hub snapshot's also in its repository's "
            "blobs/): pass a .safetensors file itself, or a copy with the links resolved (cp -rL DIR REF)"
        )
        raise
    if not ref.tensors:  # every checkpoint key would be "unexpected" and nothing "missing": a reference of nothing
        raise _bad(Path(path), "names no tensor")
    return ref


def _load(p: Path) -> Reference:
    if p.is_dir():
        index = p / "model.safetensors.index.json"
        if index.exists():
            tensors = _from_json(resolve_inside(p, index.name, what="reference file"), p)
        else:
            files = sorted(p.glob("*.safetensors"))
            if not files and (p / ".metadata").is_file():  # comparing two checkpoints is `diff`'s work
                raise UsageError(
                    f"`against` {p}: a DCP checkpoint (.metadata), not a reference model; `against` reads the names, "
                    "shapes and dtypes of an HF model folder",
                    path=p,
                    hint=f"compare two checkpoints with `ckpttool diff CHECKPOINT {p}`, or pass `against` an export "
                    f"of it (`ckpttool export {p} OUT`)",
                )
            if not files:
                raise _bad(p, "directory holds no model.safetensors.index.json and no *.safetensors", hub_hint(p))
            tensors = {}
            for f in files:
                tensors.update(_safetensors_header(resolve_inside(p, f.name, what="reference file")))
        cfg = p / "config.json"
        return _with_config(
            str(p), tensors, resolve_inside(p, cfg.name, what="reference file") if cfg.exists() else None
        )
    if not p.exists():
        raise _bad(p, "no such file or directory", unexpanded_tilde_hint(p))
    if p.suffix == ".safetensors":
        tensors = _safetensors_header(p)
    else:
        tensors = _from_json(p)
    cfg = p.parent / "config.json"
    return _with_config(str(p), tensors, cfg if cfg.is_file() else None)
