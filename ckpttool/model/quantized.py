"""Quantized weights beside their scales, found by name, dtype and shape (torch-free; readers of FP8 checkpoints).

Two conventions, as the readers that load them pair the keys:

- block FP8 (DeepSeek-V3; torch's ``QuantizedHuggingFaceStorageReader``, transformers'
  ``FineGrainedFP8``): ``x.weight`` ``float8_e4m3fn`` ``[out, in]`` and ``x.weight_scale_inv``
  ``float32`` ``[ceil(out / B0), ceil(in / B1)]``, ``(B0, B1)`` the config's
  ``quantization_config.weight_block_size`` (default ``128 x 128``); ``q * scale`` dequantizes.
- MXFP4 (gpt-oss; transformers' ``integrations/mxfp4.py``): ``x_blocks`` ``uint8``
  ``[E, N, G, B]`` (two FP4 values a byte) and ``x_scales`` ``uint8`` (or ``float8_e8m0fnu``)
  E8M0 exponents ``[E, N, G]``; dequantized ``x`` is ``[E, G * B * 2, N]`` (transformers'
  ``convert_moe_packed_tensors`` transposes dims 1 and 2).

:func:`find_quantized` returns the usable pairs and, for each key that looks quantized but does
not fit, one line saying why (the callers raise or report it with their own code).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FP8_SCALE_SUFFIX",
    "QuantPair",
    "block_size",
    "find_quantized",
]

FP8_SCALE_SUFFIX = "_scale_inv"
_MX_BLOCKS, _MX_SCALES = "_blocks", "_scales"
_E8M0 = ("uint8", "float8_e8m0fnu")


@dataclass(frozen=True)
class QuantPair:
    """A quantized weight and its scale.

    Attributes:
        kind: ``"fp8-block"`` or ``"mxfp4"``.
        weight, scale: the stored keys (``x.weight`` / ``x.weight_scale_inv``, ``x_blocks`` / ``x_scales``).
        name: the dequantized tensor's key (``x.weight``; ``x`` for MXFP4).
        shape: the dequantized shape; stored: the stored weight's shape.
        block: ``(B0, B1)`` of block FP8 (``(1, 32)``-like group size for MXFP4: ``(1, 2 * B)``).
    """

    kind: str
    weight: str
    scale: str
    name: str
    shape: tuple[int, ...]
    stored: tuple[int, ...]
    block: tuple[int, int]


def block_size(config: Mapping[str, Any] | None) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` of an HF config (two positive ints), else ``(128, 128)``."""
    qc = (config or {}).get("quantization_config")
    wbs = qc.get("weight_block_size") if isinstance(qc, dict) else None
    if isinstance(wbs, list) and len(wbs) == 2 and all(type(b) is int and b > 0 for b in wbs):
        return wbs[0], wbs[1]
    return 128, 128


def _fp8_problem(
    key: str, scale: tuple[str, tuple[int, ...]], weight: tuple[str, tuple[int, ...]] | None, block: tuple[int, int]
) -> str | None:
    wkey = key[: -len(FP8_SCALE_SUFFIX)]
    if weight is None:
        return f"{key}: a block scale for a missing weight {wkey!r}"
    (sd, ss), (wd, ws) = scale, weight
    if sd != "float32":
        return f"{key}: scales are {sd}, not float32 (block FP8 stores float32 weight_scale_inv)"
    if wd != "float8_e4m3fn":
        return f"{key}: its weight {wkey!r} is {wd}, not float8_e4m3fn"
    if len(ws) != 2 or len(ss) != 2:
        return f"{key}: weight {list(ws)} and scale {list(ss)} are not both 2-D"
    want = [-(-ws[0] // block[0]), -(-ws[1] // block[1])]
    if list(ss) != want:
        return f"{key}: shape {list(ss)}, but weight {list(ws)} in {block[0]}x{block[1]} blocks needs {want}"
    return None


def _mx_problem(key: str, scale: tuple[str, tuple[int, ...]], blocks: tuple[str, tuple[int, ...]] | None) -> str | None:
    bkey = key[: -len(_MX_SCALES)] + _MX_BLOCKS
    if blocks is None:
        return f"{key}: MXFP4 scales for missing blocks {bkey!r}"
    (sd, ss), (bd, bs) = scale, blocks
    if sd not in _E8M0:
        return f"{key}: MXFP4 scales are {sd}, not uint8 E8M0 exponents"
    if bd != "uint8":
        return f"{key}: its blocks {bkey!r} are {bd}, not uint8"
    if len(bs) != 4 or tuple(bs[:-1]) != tuple(ss):
        return f"{key}: shape {list(ss)} does not fit blocks {list(bs)} ([E, N, G, B] blocks, [E, N, G] scales)"
    return None


def find_quantized(
    tensors: Mapping[str, tuple[str, tuple[int, ...]]], block: tuple[int, int] = (128, 128)
) -> tuple[list[QuantPair], list[tuple[str, str]]]:
    """The quantized pairs among ``tensors`` (key -> ``(dtype name, shape)``) and the keys that do not fit.

    Returns:
        ``(pairs, problems)``: pairs sorted by weight key; ``(key, why)`` for a scale of a missing
        weight, a scale that is not float32 (e.g. ``F8_E8M0``) where float32 is expected, a
        weight of another dtype, shapes other than ``ceil(out / B0) x ceil(in / B1)``, a
        ``float8_e4m3fn`` ``*.weight`` without its scale, MXFP4 blocks without scales or with
        shapes that do not fit.
    """
    pairs: list[QuantPair] = []
    problems: list[tuple[str, str]] = []
    for key in sorted(tensors):
        dt, shape = tensors[key]
        if key.endswith(".weight" + FP8_SCALE_SUFFIX):
            wkey = key[: -len(FP8_SCALE_SUFFIX)]
            why = _fp8_problem(key, (dt, tuple(shape)), tensors.get(wkey), block)
            if why is not None:
                problems.append((key, why))
                continue
            ws = tuple(tensors[wkey][1])
            pairs.append(QuantPair("fp8-block", wkey, key, wkey, ws, ws, block))
        elif key.endswith(_MX_SCALES) and (key[: -len(_MX_SCALES)] + _MX_BLOCKS in tensors or dt in _E8M0):
            bkey = key[: -len(_MX_SCALES)] + _MX_BLOCKS
            why = _mx_problem(key, (dt, tuple(shape)), tensors.get(bkey))
            if why is not None:
                problems.append((key, why))
                continue
            e, n, g, b = tensors[bkey][1]
            name = key[: -len(_MX_SCALES)]
            pairs.append(QuantPair("mxfp4", bkey, key, name, (e, g * b * 2, n), (e, n, g, b), (1, 2 * b)))
        elif dt == "float8_e4m3fn" and key.endswith(".weight") and key + FP8_SCALE_SUFFIX not in tensors:
            if len(shape) == 2 and key + "_scale" not in tensors:
                problems.append((key, f"{key}: a float8_e4m3fn weight with no {key + FP8_SCALE_SUFFIX!r}"))
        elif key.endswith(_MX_BLOCKS) and dt == "uint8" and key[: -len(_MX_BLOCKS)] + _MX_SCALES not in tensors:
            problems.append((key, f"{key}: MXFP4 blocks with no {key[: -len(_MX_BLOCKS)] + _MX_SCALES!r}"))
    return pairs, problems
