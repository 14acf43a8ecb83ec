"""A serving-ready ``config.json`` for an export: what ``save_pretrained`` would have written beside the weights.

``export --model-assets DIR`` copies ``DIR/config.json``; when the weights it wrote disagree with the
config, the copy is edited (``docs/export.md``, "config.json"):

- ``torch_dtype`` (and ``dtype`` when present: transformers >= 4.56 writes ``dtype``, and both are
  read by ``from_pretrained(..., dtype="auto")``) name the floating dtype of the written weights.
  transformers' ``save_pretrained`` writes ``model.dtype``, the dtype of the first floating
  parameter (``modeling_utils.PreTrainedModel.dtype``); for a mixed export (``--save-dtype
  preserve`` of FP32 norms beside BF16 matrices) the dtype holding the most bytes is written,
  the one ``dtype="auto"`` should build the model in. FP8/FP4 tensors (quantized weights) do not
  count, as in transformers' ``get_state_dict_dtype``.
- ``architectures``, when the config has none (a config saved from a bare ``XConfig``, not from a model), names
  the class the export was checked against (``export``'s model check): vLLM picks the model from it and
  refuses a config without one; ``save_pretrained`` always writes it.
- ``tie_word_embeddings`` is made explicit when the config leaves it to the model class's
  default: ``false`` when ``lm_head`` was written, ``true`` when only the embedding was (so the
  class never builds an untrained ``lm_head``, nor ties away the one written), unless ``--filter`` left
  tensors out (the checkpoint's own, untied head may be one of them: ``true`` would have ``from_pretrained``
  use the embedding as the head and report nothing missing).

Anything the config already says right is left byte-for-byte as given.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ckpttool.format.jsonfile import parse_json
from ckpttool.format.metadata import DTYPE_ITEMSIZE
from ckpttool.format.safetensors import is_narrowing
from ckpttool.model.quantized import PACKED_DTYPES

__all__ = ["PACKED_DTYPES", "TOKENIZER_FILES", "dominant_dtype", "rounded_on_load", "serving_config", "tokenizer_note"]

#: Files a tokenizer is loaded from (``AutoTokenizer``: a fast tokenizer's JSON, or a slow one's vocabulary).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)
_FLOATING = ("float64", "float32", "float16", "bfloat16")


def dominant_dtype(entries: Iterable[Any]) -> str | None:
    """The floating dtype holding the most bytes among ``entries`` (objects with ``dtype`` and ``shape``:
    :class:`~ckpttool.format.safetensors.HeaderEntry`), ties to the first seen; ``None`` without one.
    FP8/FP4 and integer tensors do not count."""
    total: dict[str, int] = {}
    for e in entries:
        if e.dtype in _FLOATING:
            n = DTYPE_ITEMSIZE[e.dtype]
            for d in e.shape:
                n *= d
            total[e.dtype] = total.get(e.dtype, 0) + n
    if not total:
        return None
    return max(total, key=lambda k: total[k])  # max keeps the first of equal counts


def rounded_on_load(dtype: str | None, entries: Iterable[Any]) -> str | None:
    """A note when the config's ``dtype`` (:func:`dominant_dtype` of a mixed export) cannot hold every tensor written.

    ``from_pretrained(dtype="auto")`` builds the whole model in the config's dtype, so a float32 tensor written
    beside bfloat16 ones (``--save-dtype preserve`` of FP32 norms) is rounded when loaded: the export is bit-exact, the
    loaded model is not. ``None`` when every floating tensor converts to ``dtype`` exactly. The float32
    ``x_scale_inv`` of a float8 ``x`` (block FP8) is loaded as float32 and does not count.
    """
    if dtype is None:
        return None
    entries = list(entries)
    # block FP8 scales: transformers' FP8Linear / FP8Experts allocate them float32 whatever the dtype (vLLM too)
    kept = {e.name + "_scale_inv" for e in entries if e.dtype.startswith("float8")}
    lost: dict[str, list[str]] = {}
    for e in entries:
        if e.dtype in _FLOATING and is_narrowing(e.dtype, dtype) and e.name not in kept:
            lost.setdefault(e.dtype, []).append(e.name)
    if not lost:
        return None
    parts = "; ".join(
        f"{len(ks)} {d} tensor(s) ({', '.join(ks[:2])}{f', +{len(ks) - 2} more' if len(ks) > 2 else ''})"
        for d, ks in lost.items()
    )
    first = next(iter(lost))
    return (
        f"config.json names {dtype}, the dtype of most of the weights, beside {parts}: from_pretrained(..., "
        f'dtype="auto") loads every tensor as {dtype}, rounding those; load with dtype=torch.{first} '
        f"to keep them, or export one dtype with --save-dtype"
    )


def serving_config(
    data: bytes,
    source: str,
    *,
    dtype: str | None,
    lm_head_written: bool,
    embedding_written: bool,
    architecture: str | None = None,
    quantized_written: bool = True,
    filtered: bool = False,
) -> tuple[bytes, dict[str, list[Any]]]:
    """``config.json`` bytes as they should be beside the written weights, and what was changed.

    Args:
        data: the ``config.json`` to copy (as given, or as the output format edited it).
        source: its path, for messages.
        dtype: :func:`dominant_dtype` of the written tensors (``None``: leave the dtype keys).
        lm_head_written: the export wrote the output-embedding tensor (``lm_head.weight``).
        embedding_written: it wrote the input embedding.
        filtered: ``--filter`` left model tensors out: without a written ``lm_head`` the config's tie is then not
            made ``true`` (the head left out may be the checkpoint's own, untied one).
        architecture: the model class the tensors were checked against (``None``: not checked), written as
            ``architectures`` when the config names none.
        quantized_written: the export wrote quantized tensors (float8, or packed integers: AWQ/GPTQ ``qweight``
            int32, bitsandbytes/MXFP4 uint8, :data:`PACKED_DTYPES`); without them a ``quantization_config`` of any
            ``quant_method`` (``fp8``, ``compressed-tensors``, ``awq``, ``gptq``, ``bitsandbytes``, ...: a quantized
            base model's config given as ``--model-assets``, a QLoRA run's) is removed: vLLM and transformers would
            read the written BF16/FP32 weights as that method's packed weights and scales (transformers refuses to
            load without the method's kernels installed).

    Returns:
        ``(bytes, edits)``: ``data`` itself when nothing changes (``edits`` ``{}``), else the edited
        document (2-space indent, key order kept) and ``key -> [old, new]``.

    Raises:
        JsonDepthError, IntegerRangeError: (the config was already read once, so only if it changed).
    """
    doc = parse_json(data, source)
    if not isinstance(doc, dict):
        return data, {}
    edits: dict[str, list[Any]] = {}

    def put(scope: dict[str, Any], key: str, value: Any, where: str = "") -> None:
        if scope.get(key) != value:
            edits[where + key] = [scope.get(key), value]
            scope[key] = value

    if dtype is not None:
        put(doc, "torch_dtype", dtype)
        if "dtype" in doc:
            put(doc, "dtype", dtype)
        text = doc.get("text_config")
        if isinstance(text, dict):  # a multimodal config's language model (HF sets sub-configs' dtype too)
            for key in ("torch_dtype", "dtype"):
                if key in text:
                    put(text, key, dtype, "text_config.")
    qc = doc.get("quantization_config")
    if not quantized_written and isinstance(qc, dict) and isinstance(qc.get("quant_method"), str):
        edits["quantization_config"] = [qc, None]
        del doc["quantization_config"]
    if architecture is not None and not doc.get("architectures"):
        put(doc, "architectures", [architecture])
    text = doc.get("text_config")
    scopes = [doc, *([text] if isinstance(text, dict) else [])]
    if all(s.get("tie_word_embeddings") is None for s in scopes):
        if lm_head_written:
            put(doc, "tie_word_embeddings", False)
        elif embedding_written and not filtered:
            put(doc, "tie_word_embeddings", True)
    if not edits:
        return data, {}
    return (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode(), edits


def tokenizer_note(asset_names: Iterable[str], assets_dir: str) -> str | None:
    """A note when ``--model-assets`` holds no tokenizer (the export then loads as a model only)."""
    names = set(asset_names)
    if any(n in names for n in TOKENIZER_FILES):
        return None
    return (
        f"{assets_dir} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...): the export loads with "
        "from_pretrained but AutoTokenizer cannot; copy the base model's tokenizer files into the export"
    )
