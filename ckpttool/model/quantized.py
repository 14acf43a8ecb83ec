"""Quantized weights beside their scales, found by name, dtype and shape (torch-free; readers of FP8 checkpoints).

The conventions, as the readers that load them pair the keys:

- block FP8 (DeepSeek-V3; torch's ``QuantizedHuggingFaceStorageReader``, transformers'
  ``FineGrainedFP8``): ``x.weight`` ``float8_e4m3fn`` ``[out, in]`` and ``x.weight_scale_inv``
  ``float32`` (or bfloat16 / float16: :data:`SCALE_DTYPES`) ``[ceil(out / B0), ceil(in / B1)]``, ``(B0, B1)`` the config's
  ``quantization_config.weight_block_size`` (default ``128 x 128``); ``q * scale`` dequantizes.
- fused block-FP8 experts (transformers' ``FP8Experts``; what ``export --quantize`` writes for
  fused experts): ``x`` ``float8_e4m3fn`` ``[E, out, in]`` and ``x_scale_inv`` float32 (or
  bfloat16 / float16) ``[E, ceil(out / B0), ceil(in / B1)]``, each expert on its own block grid (kind ``fp8-experts``).
- MXFP4 (gpt-oss; transformers' ``integrations/mxfp4.py``): ``x_blocks`` ``uint8``
  ``[E, N, G, B]`` (two FP4 values a byte) and ``x_scales`` ``uint8`` (or ``float8_e8m0fnu``)
  E8M0 exponents ``[E, N, G]``; dequantized ``x`` is ``[E, G * B * 2, N]`` (transformers'
  ``convert_moe_packed_tensors`` transposes dims 1 and 2).

:func:`scaled_pairs` returns the usable pairs of every convention a ``config.json`` admits and, for each
key that looks quantized but does not fit, one line saying why (the callers raise or report it with their
own code); ``import``, ``inspect``, ``validate`` and ``diff`` pair keys through it alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "CT_SCALE_SUFFIX",
    "FP8_SCALE_SUFFIX",
    "PACKED_DTYPES",
    "QuantKind",
    "QuantPair",
    "SCALE_DTYPES",
    "block_size",
    "block_size_problem",
    "blocks_of_scales",
    "compressed_tensors_block",
    "compressed_tensors_fp8",
    "find_quantized",
    "fused_experts",
    "method_disagreements",
    "packed_integer_weights",
    "per_tensor_fp8",
    "scale_grid",
    "scaled_pairs",
    "scheme_name",
    "unclaimed_scales",
    "unscaled_fused_experts",
    "without_unusable_blocks",
]

FP8_SCALE_SUFFIX = "_scale_inv"
#: dtypes of an FP8 block / channel scale (``x.weight_scale_inv``, fused ``x_scale_inv``, compressed-tensors'
#: ``x.weight_scale``): float32, as DeepSeek-V3 and torch's quantizers store them, or the weight's dtype, as
#: llm-compressor computes them (``calculate_qparams``); every such scale is a float32 value, and ``float32(q) * scale``
#: is exact (torch's ``QuantizedHuggingFaceStorageReader`` multiplies so; compressed-tensors in the scale's dtype,
#: rounding that product once).
SCALE_DTYPES = ("float32", "bfloat16", "float16")
#: A :class:`QuantPair`'s convention (the module docstring; ``fp8-compressed-tensors``: :func:`compressed_tensors_fp8`).
QuantKind = Literal["fp8-block", "fp8-experts", "mxfp4", "fp8-compressed-tensors", "fp8-tensor"]
_MX_BLOCKS, _MX_SCALES = "_blocks", "_scales"
_E8M0 = ("uint8", "float8_e8m0fnu")


@dataclass(frozen=True)
class QuantPair:
    """A quantized weight and its scale."""

    kind: QuantKind
    """``"fp8-block"``, ``"fp8-experts"`` (fused ``[E, out, in]``), ``"mxfp4"``, ``"fp8-compressed-tensors"`` or
    ``"fp8-tensor"`` (:func:`per_tensor_fp8`)."""
    weight: str
    """The stored weight's key (``x.weight``; ``x_blocks`` for MXFP4)."""
    scale: str
    """The stored scale's key (``x.weight_scale_inv``; ``x_scales`` for MXFP4)."""
    name: str
    """The dequantized tensor's key (``x.weight``; ``x`` for MXFP4)."""
    shape: tuple[int, ...]
    """The dequantized shape."""
    stored: tuple[int, ...]
    """The stored weight's shape."""
    block: tuple[int, int]
    """``(B0, B1)`` of block FP8 (``(1, 32)``-like group size for MXFP4: ``(1, 2 * B)``)."""


def block_size(config: Mapping[str, Any] | None) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` of an HF config (two positive ints), else ``(128, 128)``
    (also for a value :func:`block_size_problem` refuses: whoever dequantizes checks that first)."""
    qc = (config or {}).get("quantization_config")
    wbs = qc.get("weight_block_size") if isinstance(qc, dict) else None
    if isinstance(wbs, list) and len(wbs) == 2 and all(type(b) is int and b > 0 for b in wbs):
        return wbs[0], wbs[1]
    return 128, 128


@dataclass(frozen=True)
class ScaleBlocks:
    """The block sizes on which every stored block-FP8 scale fits its weight (:func:`blocks_of_scales`)."""

    ranges: tuple[tuple[int, int | None], tuple[int, int | None]]
    """Per axis (rows, columns), the least and greatest block size that gives each scale's shape (``None``: any
    larger one, where every weight is one block along that axis)."""
    block: tuple[int, int] | None
    """The block the scales name: the only size in range, or the only one in range that tiles a weight exactly
    (``D / n`` of a dimension ``D`` cut into ``n`` blocks: how a quantizer's grid over whole blocks looks); ``None``
    where several fit (dequantizing on another of them gives other values)."""
    example: str
    """A scale key (for messages)."""

    @property
    def named(self) -> str:
        """``16-23 x 16`` (``128+``: any block of at least 128)."""
        return " x ".join(f"{lo}+" if hi is None else (f"{lo}" if lo == hi else f"{lo}-{hi}") for lo, hi in self.ranges)


def _axis_blocks(sizes: list[tuple[int, int]]) -> tuple[tuple[int, int | None], int | None] | None:
    """Block sizes ``B`` with ``ceil(D / B) == n`` for every ``(D, n)``: the range and the one it names, if any."""
    lo, hi = 1, None
    for d, n in sizes:
        if n < 1 or d < 1 or n > d:
            return None
        lo = max(lo, -(-d // n))
        top = -(-d // (n - 1)) - 1 if n > 1 else None  # ceil(d / B) == n  <=>  d / n <= B < d / (n - 1)
        hi = top if hi is None else (hi if top is None else min(hi, top))
    if hi is not None and lo > hi:
        return None
    if hi is None:  # every weight one block along this axis: any B >= lo dequantizes alike; 128 where it fits
        return (lo, None), max(lo, 128)
    exact = {d // n for d, n in sizes if n > 1 and d % n == 0 and lo <= d // n <= hi}
    return (lo, hi), lo if lo == hi else (exact.pop() if len(exact) == 1 else None)


def blocks_of_scales(tensors: Mapping[str, tuple[str, tuple[int, ...]]]) -> ScaleBlocks | None:
    """The block sizes the stored block-FP8 scales (``x.weight_scale_inv`` of a 2-D ``float8_e4m3fn`` weight, fused
    ``x_scale_inv`` ``[E, ...]`` of ``x`` ``[E, out, in]``) fit, read from their shapes alone: what a folder without a
    ``quantization_config.weight_block_size`` can still say of its grid. ``None``: no such scale, or no block size
    fits them all."""
    rows: list[tuple[int, int]] = []
    cols: list[tuple[int, int]] = []
    example = None
    for key, (_, shape) in sorted(tensors.items()):
        w = tensors.get(key[: -len(FP8_SCALE_SUFFIX)]) if key.endswith(FP8_SCALE_SUFFIX) else None
        if w is None or w[0] != "float8_e4m3fn" or len(w[1]) not in (2, 3) or len(shape) != len(w[1]):
            continue
        rows.append((w[1][-2], shape[-2]))
        cols.append((w[1][-1], shape[-1]))
        example = example or key
    r, c = _axis_blocks(rows), _axis_blocks(cols)
    if example is None or r is None or c is None:
        return None
    return ScaleBlocks((r[0], c[0]), (r[1], c[1]) if r[1] is not None and c[1] is not None else None, example)


def block_size_problem(config: Mapping[str, Any] | None) -> str | None:
    """Why the config's ``quantization_config.weight_block_size`` cannot be used (``None``: absent, or two positive
    ints). A value given but unreadable (``[192.0, 192.0]``, ``[0, 0]``, ``"128"``) is not replaced by the
    default: dequantizing on another block grid than the quantizer's gives other values."""
    qc = (config or {}).get("quantization_config")
    if not isinstance(qc, dict) or "weight_block_size" not in qc:
        return None
    wbs = qc["weight_block_size"]
    if isinstance(wbs, list) and len(wbs) == 2 and all(type(b) is int and b > 0 for b in wbs):
        return None
    return f"config.json quantization_config.weight_block_size is {wbs!r:.40}, not two positive integers"


def without_unusable_blocks(
    pairs: list[QuantPair], config: Mapping[str, Any] | None
) -> tuple[list[QuantPair], list[tuple[str, str]]]:
    """``pairs`` less the block-FP8 ones (``fp8-block``, ``fp8-experts``) where :func:`block_size_problem` finds the
    config's ``weight_block_size`` unusable, and ``(scale key, why)`` for each pair left out: their grid is not
    known (read on the default 128x128 one they would dequantize to other values). For the readers that list or
    compare pairs (inspect, diff), as validate's ``M020`` and import's ``E612`` refuse them."""
    why = block_size_problem(config)
    if why is None:
        return pairs, []
    blocks = ("fp8-block", "fp8-experts")
    return [p for p in pairs if p.kind not in blocks], [
        (p.scale, f"{p.scale}: {why}") for p in pairs if p.kind in blocks
    ]


_Spec = tuple[str, tuple[int, ...]]  # (dtype name, shape) of a stored tensor


@dataclass(frozen=True)
class _ScaleRule:
    """What a scale tensor must fit in one convention (the module docstring): its partner (the FP8 weight, the MXFP4
    blocks), the dtypes of both, and the shape check; the phrases name each misfit."""

    missing: str
    """What a scale without its partner is (``a block scale for a missing weight``)."""
    scale_noun: str
    scale_dtypes: tuple[str, ...]
    scale_dtypes_named: str
    """How :attr:`scale_dtypes` is named in a message."""
    partner_noun: str
    partner_dtype: str


_FP8_RULE = _ScaleRule(
    "a block scale for a missing weight",
    "scales are",
    SCALE_DTYPES,
    "float32 (block FP8 stores float32 weight_scale_inv; or bfloat16 / float16)",
    "weight {!r} is",
    "float8_e4m3fn",
)
_MX_RULE = _ScaleRule(
    "MXFP4 scales for missing blocks", "MXFP4 scales are", _E8M0, "uint8 E8M0 exponents", "blocks {!r} are", "uint8"
)


def _scale_problem(key: str, rule: _ScaleRule, scale: _Spec, pkey: str, partner: _Spec | None) -> str | None:
    """Why ``scale`` (at ``key``) does not fit ``partner`` (at ``pkey``) by ``rule``'s dtypes (``None``: they fit; the
    shapes are the caller's check)."""
    if partner is None:
        return f"{key}: {rule.missing} {pkey!r}"
    if scale[0] not in rule.scale_dtypes:
        return f"{key}: {rule.scale_noun} {scale[0]}, not {rule.scale_dtypes_named}"
    if partner[0] != rule.partner_dtype:
        return f"{key}: its {rule.partner_noun.format(pkey)} {partner[0]}, not {rule.partner_dtype}"
    return None


def _fp8_problem(key: str, scale: _Spec, weight: _Spec | None, block: tuple[int, int]) -> str | None:
    wkey = key[: -len(FP8_SCALE_SUFFIX)]
    why = _scale_problem(key, _FP8_RULE, scale, wkey, weight)
    if why is not None or weight is None:
        return why
    ss, ws = scale[1], weight[1]
    if len(ws) != 2 or len(ss) != 2:
        return f"{key}: weight {list(ws)} and scale {list(ss)} are not both 2-D"
    want = [-(-ws[0] // block[0]), -(-ws[1] // block[1])]
    if list(ss) != want:
        return f"{key}: shape {list(ss)}, but weight {list(ws)} in {block[0]}x{block[1]} blocks needs {want}"
    return None


def _mx_problem(key: str, scale: _Spec, blocks: _Spec | None) -> str | None:
    bkey = key[: -len(_MX_SCALES)] + _MX_BLOCKS
    why = _scale_problem(key, _MX_RULE, scale, bkey, blocks)
    if why is not None or blocks is None:
        return why
    ss, bs = scale[1], blocks[1]
    if len(bs) != 4 or tuple(bs[:-1]) != tuple(ss):
        return f"{key}: shape {list(ss)} does not fit blocks {list(bs)} ([E, N, G, B] blocks, [E, N, G] scales)"
    return None


def fused_experts(
    tensors: Mapping[str, tuple[str, tuple[int, ...]]], block: tuple[int, int]
) -> tuple[list[QuantPair], list[tuple[str, str]]]:
    """Fused block-FP8 experts (kind ``fp8-experts``; the module docstring) and ``(scale key, why)`` for a scale of
    such a weight that does not fit it (not one of :data:`SCALE_DTYPES`, not ``[E, ceil(out/B0), ceil(in/B1)]``)."""
    pairs: list[QuantPair] = []
    problems: list[tuple[str, str]] = []
    for key, (dt, shape) in sorted(tensors.items()):
        scale = tensors.get(key + FP8_SCALE_SUFFIX)
        if dt != "float8_e4m3fn" or len(shape) != 3 or scale is None:
            continue
        want = [shape[0], -(-shape[1] // block[0]), -(-shape[2] // block[1])]
        if scale[0] not in SCALE_DTYPES or list(scale[1]) != want:
            problems.append(
                (
                    key + FP8_SCALE_SUFFIX,
                    f"{key}{FP8_SCALE_SUFFIX}: {scale[0]} {list(scale[1])}, but fused experts {list(shape)} in "
                    f"{block[0]}x{block[1]} blocks need float32 {want} (or bfloat16 / float16)",
                )
            )
            continue
        pairs.append(QuantPair("fp8-experts", key, key + FP8_SCALE_SUFFIX, key, tuple(shape), tuple(shape), block))
    return pairs, problems


def find_quantized(
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    block: tuple[int, int] = (128, 128),
    scale_suffix: str = FP8_SCALE_SUFFIX,
) -> tuple[list[QuantPair], list[tuple[str, str]]]:
    """The quantized pairs among ``tensors`` (key -> ``(dtype name, shape)``) and the keys that do not fit
    (``scale_suffix``: the scale a ``float8_e4m3fn`` ``x.weight`` without one is said to lack).

    Returns:
        ``(pairs, problems)``: pairs sorted by weight key; ``(key, why)`` for a scale of a missing
        weight, a scale that is not float32, bfloat16 or float16 (e.g. ``F8_E8M0``) where a float scale is expected, a
        weight of another dtype, shapes other than ``ceil(out / B0) x ceil(in / B1)``, a
        ``float8_e4m3fn`` ``*.weight`` without its scale, MXFP4 blocks without scales or with
        shapes that do not fit; fused experts (``fp8-experts``) after the others, with their problems
        (a 3-D weight with a scale is theirs, not a 2-D problem).
    """
    pairs, problems = _pairs_2d(tensors, block, scale_suffix)
    fused, fused_problems = fused_experts(tensors, block)
    theirs = {k for p in fused for k in (p.weight, p.scale)} | {k for k, _ in fused_problems}
    return pairs + fused, [p for p in problems if p[0] not in theirs] + fused_problems


def _pairs_2d(
    tensors: Mapping[str, tuple[str, tuple[int, ...]]], block: tuple[int, int], scale_suffix: str = FP8_SCALE_SUFFIX
) -> tuple[list[QuantPair], list[tuple[str, str]]]:
    """Block FP8 ``x.weight`` / ``x.weight_scale_inv`` and MXFP4 pairs, and the keys of theirs that do not fit."""
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
            if name in tensors:  # the dequantized tensor would replace (or be replaced by) the stored one
                problems.append((key, f"{key}: MXFP4 {bkey!r} and its scales dequantize to {name!r}, also stored"))
                continue
            pairs.append(QuantPair("mxfp4", bkey, key, name, (e, g * b * 2, n), (e, n, g, b), (1, 2 * b)))
        elif dt == "float8_e4m3fn" and key.endswith(".weight") and key + FP8_SCALE_SUFFIX not in tensors:
            if len(shape) == 2 and key + "_scale" not in tensors:
                problems.append((key, f"{key}: a float8_e4m3fn weight with no {key + scale_suffix!r}"))
        elif key.endswith(_MX_BLOCKS) and dt == "uint8" and key[: -len(_MX_BLOCKS)] + _MX_SCALES not in tensors:
            problems.append((key, f"{key}: MXFP4 blocks with no {key[: -len(_MX_BLOCKS)] + _MX_SCALES!r}"))
    return pairs, problems


CT_SCALE_SUFFIX = "_scale"
#: The column block of a per-channel (one scale per output row) weight: wider than any row; a block of
#: ``WHOLE_ROW`` x ``WHOLE_ROW`` is the whole weight (one scale per tensor).
WHOLE_ROW = 1 << 62
_PER_TENSOR = (WHOLE_ROW, WHOLE_ROW)


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The FP8 scale grid of a weight ``[..., out, in]`` in ``block``: ``[..., ceil(out / B0), ceil(in / B1)]``
    (``[1, 1]`` for one scale per tensor, whose stored shape is ``[]`` or ``[1]``)."""
    *lead, out, inn = shape
    if block == _PER_TENSOR:  # one scale, also of a weight with no rows
        return (*lead, 1, 1)
    return (*lead, -(-out // block[0]), -(-inn // block[1]))


def scheme_name(block: tuple[int, int]) -> str:
    """``tensor``, ``channel`` or ``block B0xB1``: how an FP8 weight's scales cover it."""
    if block == _PER_TENSOR:
        return "tensor"
    return "channel" if block[1] == WHOLE_ROW else f"block {block[0]}x{block[1]}"


def _one_scale(dtype: str, shape: tuple[int, ...], dtypes: tuple[str, ...] = ("float32",)) -> bool:
    """A single scale of one of ``dtypes``, stored as ``[]`` or ``[1]`` (vLLM's and compressed-tensors' per-tensor
    scales)."""
    return dtype in dtypes and len(shape) <= 1 and all(d == 1 for d in shape)


def compressed_tensors_block(config: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """The FP8 block of a compressed-tensors ``quantization_config`` (``None``: not one, or not block/channel FP8).

    ``strategy`` ``block``: its ``block_structure``; ``channel``: one scale per output row (a block of
    one row as wide as the weight, :data:`WHOLE_ROW`); ``tensor`` (llm-compressor's ``FP8`` preset): one
    scale for the whole weight. Every config group must give the same one.
    """
    qc = (config or {}).get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return None
    groups = qc.get("config_groups")
    found: set[tuple[int, int] | None] = set()
    for g in groups.values() if isinstance(groups, dict) else ():
        found.add(_ct_weights_block(g.get("weights") if isinstance(g, dict) else None))
    return found.pop() if len(found) == 1 else None


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _ct_weights_block(w: Any) -> tuple[int, int] | None:
    """The FP8 block of one config group's ``weights`` (``QuantizationArgs``), read as compressed-tensors' validators
    read it: ``type`` and ``strategy`` in any case, ``num_bits`` 8 where missing, a missing ``strategy`` inferred from
    ``group_size`` (``-1``: ``channel``; none: ``tensor``), ``block_structure`` ``[rows, cols]`` or its older string
    form ``"128x128"``. ``None``: not one FP8 block, channel or tensor scheme, or args compressed-tensors refuses."""
    if not isinstance(w, dict) or _lower(w.get("type")) != "float" or w.get("num_bits", 8) != 8:
        return None
    strategy = _lower(w.get("strategy"))
    if strategy is None:
        gs = w.get("group_size")
        strategy = "tensor" if gs is None else "channel" if isinstance(gs, (int, float)) and gs == -1 else None
    if not isinstance(strategy, str):  # a list, a number: compressed-tensors refuses such args
        return None
    bs = w.get("block_structure")
    if bs is not None and strategy != "block":  # compressed-tensors refuses such args
        return None
    if isinstance(bs, str):  # "128x128"; digits past 18 are no block size (and int() refuses over 4300 of them)
        parts = bs.split("x")
        bs = [int(p) for p in parts] if all(p.isascii() and p.isdigit() and len(p) < 19 for p in parts) else None
    if strategy == "block" and isinstance(bs, list) and len(bs) == 2:
        return (bs[0], bs[1]) if all(type(b) is int and b > 0 for b in bs) else None
    return {"channel": (1, WHOLE_ROW), "tensor": _PER_TENSOR}.get(strategy)


def _ct_format(qc: Mapping[str, Any]) -> Any:
    """The compression format of a compressed-tensors ``quantization_config``'s weights: each config group's own
    ``format`` where it gives one (compressed-tensors 0.12+ compresses each module by its scheme's format; the
    top-level ``format`` is then a summary, ``mixed-precision`` where groups differ), else the top-level one. One
    format for every group, else the top-level ``format`` (which names no one of them)."""
    groups = qc.get("config_groups")
    top = qc.get("format")
    found = {
        (g.get("format") or top) if isinstance(g, dict) else top
        for g in (groups.values() if isinstance(groups, dict) else ())
    }
    return found.pop() if len(found) == 1 else top


def compressed_tensors_fp8(
    tensors: Mapping[str, tuple[str, tuple[int, ...]]], config: Mapping[str, Any] | None
) -> tuple[list[QuantPair], list[tuple[str, str]]]:
    """compressed-tensors FP8 weights (kind ``fp8-compressed-tensors``; the module docstring) and ``(key, why)``
    for a weight stored compressed that cannot be dequantized as the config describes.

    Only under a config whose ``quantization_config.quant_method`` is ``compressed-tensors``; every
    ``float8_e4m3fn`` ``x.weight`` with an ``x.weight_scale`` (and no ``x.weight_scale_inv``) is one: a format
    other than ``float-quantized``, config groups that do not give one block, channel or tensor FP8 scheme
    (:func:`compressed_tensors_block`), a weight that is not 2-D, a scale that is not float32 (or bfloat16 / float16: :data:`SCALE_DTYPES`) of the shape
    that scheme gives, or an
    ``x.weight_zero_point`` (asymmetric) is a problem (never a weight imported as its raw FP8 bytes).
    """
    qc = (config or {}).get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return [], []
    block = compressed_tensors_block(config)
    pairs: list[QuantPair] = []
    problems: list[tuple[str, str]] = []
    for key in sorted(tensors):
        skey = key + CT_SCALE_SUFFIX
        dt, ws = tensors[key]
        if (
            not key.endswith(".weight")
            or dt != "float8_e4m3fn"
            or skey not in tensors
            or key + FP8_SCALE_SUFFIX in tensors
        ):
            continue
        sd, ss = tensors[skey]
        want = None if block is None or len(ws) != 2 else list(scale_grid(tuple(ws), block))
        if len(ws) != 2:
            problems.append((skey, f"{skey}: its weight {key!r} is {list(ws)}, not 2-D ([out, in], a linear weight)"))
        elif _ct_format(qc) != "float-quantized":
            why = f"config.json quantization_config is compressed-tensors format {str(_ct_format(qc))[:40]!r}, "
            problems.append((skey, f"{skey}: {why}not float-quantized (FP8 weights times their scale)"))
        elif block is None:
            problems.append(
                (
                    skey,
                    f"{skey}: config.json quantization_config's config_groups give no one block, channel or tensor FP8 scheme",
                )
            )
        elif key + "_zero_point" in tensors:
            problems.append(
                (skey, f"{skey}: {key}_zero_point is stored (asymmetric), which import does not dequantize")
            )
        elif not (sd in SCALE_DTYPES and list(ss) == want) and not (
            block == _PER_TENSOR and _one_scale(sd, tuple(ss), SCALE_DTYPES)
        ):
            need = "one float32" if block == _PER_TENSOR else f"float32 {want}"
            scheme = f"{block[0]}x{block[1]} block" if block[1] != WHOLE_ROW else scheme_name(block)
            problems.append(
                (
                    skey,
                    f"{skey}: {sd} {list(ss)}, but weight {list(ws)} with the config's {scheme} scheme needs {need}"
                    " (or bfloat16 / float16)",
                )
            )
        else:
            pairs.append(QuantPair("fp8-compressed-tensors", key, skey, key, tuple(ws), tuple(ws), block))
    return pairs, problems


def per_tensor_fp8(
    tensors: Mapping[str, tuple[str, tuple[int, ...]]], config: Mapping[str, Any] | None
) -> tuple[list[QuantPair], list[tuple[str, str]]]:
    """Per-tensor FP8 weights of vLLM's ``fp8`` convention (kind ``fp8-tensor``) and ``(key, why)`` for a scale that
    does not fit.

    Only under a config whose ``quantization_config.quant_method`` is ``fp8`` without ``weight_block_size`` (what
    vLLM's ``Fp8Config`` reads and llm-compressor's / AutoFP8's per-tensor checkpoints carry): ``x.weight``
    ``float8_e4m3fn`` 2-D with ``x.weight_scale`` ``float32`` of one element (shape ``[]`` or ``[1]``), the
    multiplier vLLM's ``Fp8LinearMethod`` applies (``q * scale``); a block of the whole weight
    (:data:`WHOLE_ROW` x :data:`WHOLE_ROW`). ``x.input_scale`` (the activations' scale) is left as stored. A scaled
    weight that is not 2-D (0-d, 1-D, 3-D) is a problem.
    """
    qc = (config or {}).get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8" or qc.get("weight_block_size") is not None:
        return [], []
    pairs: list[QuantPair] = []
    problems: list[tuple[str, str]] = []
    for key in sorted(tensors):
        dt, ws = tensors[key]
        skey = key + CT_SCALE_SUFFIX
        if not key.endswith(".weight") or dt != "float8_e4m3fn" or skey not in tensors:
            continue
        if key + FP8_SCALE_SUFFIX in tensors:
            continue  # block FP8 (find_quantized's)
        sd, ss = tensors[skey]
        if len(ws) != 2:
            problems.append((skey, f"{skey}: its weight {key!r} is {list(ws)}, not 2-D ([out, in], a linear weight)"))
            continue
        if not _one_scale(sd, tuple(ss)):
            problems.append(
                (skey, f"{skey}: {sd} {list(ss)}, but a per-tensor FP8 scale (quant_method fp8) is one float32")
            )
            continue
        pairs.append(QuantPair("fp8-tensor", key, skey, key, tuple(ws), tuple(ws), _PER_TENSOR))
    return pairs, problems


def scaled_pairs(
    tensors: Mapping[str, tuple[str, tuple[int, ...]]], config: Mapping[str, Any] | None
) -> tuple[list[QuantPair], list[tuple[str, str]]]:
    """Every quantized pair among ``tensors`` (key -> ``(dtype name, shape)``) under ``config`` (a ``config.json``
    or ``None``), and ``(key, why)`` for each that does not fit.

    Block FP8, fused experts and MXFP4 (:func:`find_quantized`, the block from :func:`block_size`), then
    compressed-tensors FP8 (:func:`compressed_tensors_fp8`) and vLLM's per-tensor FP8
    (:func:`per_tensor_fp8`), which only their ``quantization_config`` admits; block FP8 under a ``quant_method``
    other than ``fp8`` is a problem (:func:`method_disagreements`). The caller checks
    :func:`block_size_problem` first where a wrong grid must not fall back to the default.
    """
    qc = config.get("quantization_config") if isinstance(config, Mapping) else None
    qm, wbs = (qc.get("quant_method"), qc.get("weight_block_size")) if isinstance(qc, dict) else (None, None)
    # compressed-tensors and vLLM's per-tensor FP8 scale x.weight by x.weight_scale: a weight with none lacks that
    per_weight = qm == "compressed-tensors" or (qm == "fp8" and wbs is None)
    pairs, problems = find_quantized(tensors, block_size(config), CT_SCALE_SUFFIX if per_weight else FP8_SCALE_SUFFIX)
    disagree = method_disagreements(pairs, config)
    pairs = [p for p in pairs if p.scale not in dict(disagree)]
    found = [compressed_tensors_fp8(tensors, config), per_tensor_fp8(tensors, config)]
    for more, unfit in found:
        pairs += more
        problems += unfit
    others = unclaimed_scales(tensors, config, found) + unscaled_fused_experts(tensors, config)
    return pairs, problems + others + disagree


def method_disagreements(pairs: list[QuantPair], config: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """``(scale key, why)`` for each block-FP8 pair of ``pairs`` (:func:`find_quantized`'s: ``x.weight_scale_inv``,
    fused ``x_scale_inv``) under a ``quantization_config`` whose ``quant_method`` is not ``fp8``: the config does not
    describe the weights, and the block grid is not known (a compressed-tensors ``block_structure`` of ``[100, 100]``
    gives the ``[3, 2]`` scales of a ``[300, 200]`` weight, as the default 128x128 grid does, dequantizing to other
    values). A config without ``quant_method`` (or without a ``quantization_config``) says nothing against them.
    MXFP4 is not judged so: its groups are the blocks' own shape, whatever the config says."""
    qc = config.get("quantization_config") if isinstance(config, Mapping) else None
    if not isinstance(qc, dict) or "quant_method" not in qc or qc["quant_method"] == "fp8":
        return []
    return [
        (
            p.scale,
            f"{p.scale}: block FP8 scales of {p.weight!r}, but config.json quantization_config's quant_method is "
            f"{qc['quant_method']!r:.40}, not 'fp8': the config does not give their block size",
        )
        for p in pairs
        if p.kind in ("fp8-block", "fp8-experts")
    ]


def unscaled_fused_experts(
    tensors: Mapping[str, tuple[str, tuple[int, ...]]], config: Mapping[str, Any] | None
) -> list[tuple[str, str]]:
    """``(key, why)`` under a block-FP8 ``quantization_config`` (``quant_method`` ``fp8`` with ``weight_block_size``)
    for a fused expert tensor ``x`` ``float8_e4m3fn`` ``[E, out, in]`` with no ``x_scale_inv``, and for an ``x_scale_inv``
    ``[E, ...]`` whose ``x`` is missing: as a 2-D ``x.weight`` with no scale (:func:`find_quantized`), its codes would be
    read as its values (``dcp.load`` casts them), its siblings dequantized. So is a 2-D ``float8_e4m3fn`` tensor not
    named ``*.weight`` (``x.w1``), with or without an ``x_scale_inv`` beside it: block FP8 pairs a scale only with an
    ``x.weight`` or fused experts. Without such a config an unscaled float8 tensor is read as stored (nothing says it is
    quantized)."""
    qc = config.get("quantization_config") if isinstance(config, Mapping) else None
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8" or qc.get("weight_block_size") is None:
        return []
    problems: list[tuple[str, str]] = []
    for key, (dt, shape) in sorted(tensors.items()):
        if dt == "float8_e4m3fn" and len(shape) == 3 and key + FP8_SCALE_SUFFIX not in tensors:
            problems.append(
                (key, f"{key}: a float8_e4m3fn fused expert tensor {list(shape)} with no {key + FP8_SCALE_SUFFIX!r}")
            )
        elif dt == "float8_e4m3fn" and len(shape) == 2 and not key.endswith(".weight"):
            beside = "beside" if key + FP8_SCALE_SUFFIX in tensors else "with no"
            problems.append(
                (
                    key,
                    f"{key}: a float8_e4m3fn tensor {list(shape)} {beside} {key + FP8_SCALE_SUFFIX!r}, under a block-FP8 "
                    "config: block FP8 scales an x.weight (x.weight_scale_inv) or fused experts [E, out, in] "
                    "(x_scale_inv), and its codes would be read as values",
                )
            )
        elif len(shape) == 3 and key.endswith(FP8_SCALE_SUFFIX) and not key.endswith(".weight" + FP8_SCALE_SUFFIX):
            if key[: -len(FP8_SCALE_SUFFIX)] not in tensors:
                problems.append(
                    (key, f"{key}: fused expert scales for a missing weight {key[: -len(FP8_SCALE_SUFFIX)]!r}")
                )
    return problems


def _quant_method(config: Mapping[str, Any] | None) -> str:
    """How the config's ``quantization_config`` reads, for a message (``quant_method 'x'``, not an object)."""
    qc = config.get("quantization_config") if isinstance(config, Mapping) else None
    if not isinstance(qc, dict):
        return f"config.json quantization_config is a {type(qc).__name__}, not an object"
    qm = qc.get("quant_method")
    if qm == "fp8" and qc.get("weight_block_size") is not None:
        return (
            f"config.json quantization_config is quant_method 'fp8' with weight_block_size "
            f"{qc['weight_block_size']!r:.40} (block FP8, whose scales are x.weight_scale_inv)"
        )
    return f"config.json quantization_config's quant_method is {qm!r:.40}"


def unclaimed_scales(
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    config: Mapping[str, Any] | None,
    found: list[tuple[list[QuantPair], list[tuple[str, str]]]] | None = None,
) -> list[tuple[str, str]]:
    """``(scale key, why)`` for an FP8 ``x.weight`` with an ``x.weight_scale`` under a ``quantization_config`` whose
    conventions do not pair it (:func:`compressed_tensors_fp8`, :func:`per_tensor_fp8`), and, under a
    ``quant_method`` ``fp8`` or ``compressed-tensors`` config, for an ``x.weight_scale`` without its weight.

    Without this, such a weight (a ``weight_block_size`` of ``[128]`` beside per-tensor scales, ``quant_method``
    ``FP8``, an e5m2 weight) would be read as its raw FP8 codes, the scale an unrelated tensor beside it. Without
    a ``quantization_config`` nothing says the weight is quantized: it is read as stored. With or without one, an FP8
    weight with both an ``x.weight_scale`` and an ``x.weight_scale_inv`` is a problem: which multiplies is not known
    (block FP8 would take the second, compressed-tensors and vLLM's per-tensor FP8 the first). ``found``: what
    :func:`compressed_tensors_fp8` and :func:`per_tensor_fp8` returned for these tensors, when the caller has it.
    """
    both = [
        (
            k + CT_SCALE_SUFFIX,
            f"{k}{CT_SCALE_SUFFIX}: {k!r} also has {k + FP8_SCALE_SUFFIX!r}: two scales of one FP8 "
            "weight, and which one multiplies it is not known (block FP8 stores weight_scale_inv, compressed-tensors and "
            "vLLM's per-tensor FP8 weight_scale)",
        )
        for k, (dt, _) in sorted(tensors.items())
        if dt.startswith("float8_") and k + CT_SCALE_SUFFIX in tensors and k + FP8_SCALE_SUFFIX in tensors
    ]
    qc = config.get("quantization_config") if isinstance(config, Mapping) else None
    if qc is None:
        return both
    qm = qc.get("quant_method") if isinstance(qc, dict) else None
    claimed: set[str] = set()
    for paired, unfit in found or (compressed_tensors_fp8(tensors, config), per_tensor_fp8(tensors, config)):
        claimed |= {p.scale for p in paired} | {k for k, _ in unfit}
    problems: list[tuple[str, str]] = []
    for skey in sorted(tensors):
        if not skey.endswith(".weight" + CT_SCALE_SUFFIX) or skey in claimed:
            continue
        key = skey[: -len(CT_SCALE_SUFFIX)]
        weight = tensors.get(key)
        if weight is None:
            if key + "_packed" in tensors:
                continue  # compressed-tensors packed: the scale of x.weight_packed (packed_integer_weights')
            if qm in ("fp8", "compressed-tensors"):
                problems.append((skey, f"{skey}: an FP8 weight scale for a missing weight {key!r}"))
            continue
        dt, ws = weight
        if not dt.startswith("float8_") or key + FP8_SCALE_SUFFIX in tensors:
            continue  # a float weight's own scale (not quantized), or block FP8 (find_quantized's)
        if dt != "float8_e4m3fn":
            why = f"its weight {key!r} is {dt}, not float8_e4m3fn (the FP8 that vLLM and compressed-tensors scale)"
        else:
            why = (
                f"no FP8 convention pairs it with its weight {key!r} {list(ws)}: {_quant_method(config)} (one scale "
                "a weight: quant_method 'fp8' without weight_block_size, or compressed-tensors float-quantized)"
            )
        problems.append((skey, f"{skey}: {why}"))
    return both + problems


#: Integer dtypes quantized weights are packed in (AWQ/GPTQ ``qweight``/``qzeros`` int32, bitsandbytes 4-bit and
#: MXFP4 blocks uint8, LLM.int8() int8; torch dtype names); ``int64`` is left out (``position_ids`` buffers). A
#: checkpoint with none of them holds no :func:`packed_integer_weights`; an export that writes none is unquantized.
PACKED_DTYPES = frozenset(("int8", "uint8", "int16", "uint16", "int32", "uint32"))


def packed_integer_weights(tensors: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[tuple[str, str]]:
    """``(weight key, method)`` of each integer-packed quantized weight among ``tensors`` (key -> ``(dtype name,
    shape)``): conventions whose weights are codes in integer words that none of :func:`scaled_pairs`' readers
    dequantizes, found by the names their writers give the pieces.

    - AWQ / GPTQ (AutoAWQ, GPTQModel ``QuantLinear``): ``x.qweight`` int32 (eight 4-bit codes a word) beside
      ``x.qzeros``, ``x.scales`` (GPTQ: ``x.g_idx``); method ``AWQ/GPTQ``.
    - bitsandbytes 4-bit (transformers' ``Bnb4BitHfQuantizer.serialized_names``): ``x.weight`` uint8 ``[n/2, 1]``
      beside ``x.weight.absmax``, ``x.weight.quant_map``, ``x.weight.quant_state.bitsandbytes__nf4`` / ``__fp4``.
    - bitsandbytes 8-bit (LLM.int8, ``Bnb8BitHfQuantizer``): ``x.weight`` int8 beside ``x.SCB`` (one float scale a
      row).
    - compressed-tensors packed formats (``pack-quantized``, NVFP4, MXFP4): ``x.weight_packed`` beside
      ``x.weight_scale``.
    - an integer ``x.weight`` beside an ``x.weight_scale`` (compressed-tensors ``int-quantized``, W8A8 int8).
    - optimum-quanto (``quantize(model, weights=qint8 | qint4); freeze(model)``): ``x.weight._data`` int8 (qint4:
      ``x.weight._data._data`` uint8, two 4-bit codes a byte, beside ``x.weight._shift``) beside
      ``x.weight._scale``.

    Each weight once, in key order; ``import`` refuses them, ``inspect`` lists them, ``validate`` warns (``M026``)
    and ``diff`` notes that it compares them as stored (read as stored they are codes, not values).
    """
    found: dict[str, str] = {}
    for k, (dt, _) in tensors.items():
        if k.endswith(".qweight") and dt in PACKED_DTYPES:
            found.setdefault(k, "AWQ/GPTQ (x.qweight, x.qzeros, x.scales)")
        elif k.endswith((".weight.absmax", ".weight.quant_map")) or ".weight.quant_state.bitsandbytes__" in k:
            found.setdefault(
                k[: k.index(".weight.") + len(".weight")], "bitsandbytes 4-bit (x.weight.absmax, quant_state)"
            )
        elif k.endswith(".SCB"):
            found.setdefault(k.removesuffix("SCB") + "weight", "bitsandbytes 8-bit (LLM.int8: x.weight int8, x.SCB)")
        elif k.endswith(".weight_packed"):
            found.setdefault(k, "compressed-tensors packed (x.weight_packed, x.weight_scale)")
        elif k.endswith(".weight") and dt in PACKED_DTYPES and k + CT_SCALE_SUFFIX in tensors:
            found.setdefault(k, "integer (x.weight int, x.weight_scale: compressed-tensors int-quantized)")
        elif dt in PACKED_DTYPES and k.endswith("._data") and ".weight._data" in k:
            if k[: k.index(".weight._data")] + ".weight._scale" in tensors:  # qint4's x.weight._data._data too
                found.setdefault(k, "optimum-quanto (x.weight._data, x.weight._scale)")
    return sorted(found.items())
