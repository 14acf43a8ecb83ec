"""Quantized-weight rules (``M020``): block FP8 weights and their ``weight_scale_inv`` (DeepSeek-V3 convention).

A ``x.weight_scale_inv`` (float32 ``[ceil(out / B), ceil(in / B)]``) scales the ``float8_e4m3fn``
``x.weight`` ``[out, in]`` per ``B x B`` block (``q * scale`` dequantizes: torch's
``QuantizedHuggingFaceStorageReader``, transformers' ``FineGrainedFP8``). ``B`` is the
``quantization_config.weight_block_size`` of ``--config`` when given, else of the folder's own
``config.json``, else 128. Fused experts
``x`` ``[E, out, in]`` with ``x_scale_inv`` ``[E, ceil(out / B), ceil(in / B)]`` (transformers'
``FP8Experts``, what ``export --quantize`` writes) are checked the same, expert by expert.

With ``--deep``: ``M021`` reads the scales (a small fraction of the data; a weight again only
where a scale is 0, to see that its block is all zero), ``M022`` takes the NaN-byte count of every
``float8_e4m3fn`` tensor from the deep pass (:mod:`ckpttool.ops.validate.deep`, one read of the
weights). ``M023``: MXFP4 ``x_blocks`` / ``x_scales`` pairs (gpt-oss) that do not fit. ``M024``: float8 weights with an
``x.weight_scale`` and no ``quantization_config`` at all (nothing says how the scale applies). compressed-tensors
FP8 ``x.weight_scale`` (under its ``quantization_config``) is checked as ``import`` checks it: ``M020`` its
shape and scheme (:func:`~ckpttool.model.quantized.compressed_tensors_fp8`), ``M021`` its values; so is
vLLM's per-tensor FP8 ``x.weight_scale`` (one float32 a weight under ``quant_method`` ``fp8`` without
``weight_block_size``: :func:`~ckpttool.model.quantized.per_tensor_fp8`). ``M026``: integer-packed quantized weights
(AWQ/GPTQ, bitsandbytes, compressed-tensors packed or int: :func:`~ckpttool.model.quantized.packed_integer_weights`),
whose codes no rule reads as values.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ckpttool.errors import CkptError
from ckpttool.model.quantized import (
    SCALE_DTYPES,
    QuantPair,
    block_size,
    block_size_problem,
    compressed_tensors_fp8,
    find_quantized,
    fused_experts,
    method_disagreements,
    packed_integer_weights,
    per_tensor_fp8,
    scale_grid,
    scaled_pairs,
    unclaimed_scales,
    unscaled_fused_experts,
)
from ckpttool.ops.validate.base import rule
from ckpttool.ops.validate.context import Context

_SUFFIX = "_scale_inv"


def _tensors(ctx: Context) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The model tensors as ``key -> (dtype name, shape)``, the view the :mod:`~ckpttool.model.quantized` readers
    take; built once per validation for the rules below (one entry per tensor)."""
    built: dict[str, tuple[str, tuple[int, ...]]] = ctx.once(
        "quantized.tensors", lambda: {k: (t.dtype, tuple(t.shape)) for k, t in ctx.cat.model.items()}
    )
    return built


def _scale_problem(ctx: Context, key: str) -> str | None:
    """What is wrong with scale ``key`` and its weight, or ``None``."""
    scale = ctx.cat.model[key]
    weight = ctx.cat.model.get(key[: -len(_SUFFIX)])
    if weight is None:
        return f"{key}: a block scale for a missing weight {key[: -len(_SUFFIX)]!r}"
    if scale.dtype not in SCALE_DTYPES:
        return f"{key}: scales are {scale.dtype}, not float32 (DeepSeek block FP8 stores float32 scales; or bfloat16 / float16)"
    if weight.dtype != "float8_e4m3fn":
        return f"{key}: its weight is {weight.dtype}, not float8_e4m3fn"
    if len(weight.shape) != 2 or len(scale.shape) != 2:
        return f"{key}: weight {list(weight.shape)} and scale {list(scale.shape)} are not both 2-D"
    b0, b1 = block_size(ctx.quant_config)
    want = [-(-weight.shape[0] // b0), -(-weight.shape[1] // b1)]
    if list(scale.shape) != want:
        return f"{key}: shape {list(scale.shape)}, but weight {list(weight.shape)} in {b0}x{b1} blocks needs {want}"
    return None


@rule("M020")
def fp8_scale_mismatch(ctx: Context) -> Iterator[tuple[str, str]]:
    tensors = _tensors(ctx)
    why = block_size_problem(ctx.quant_config)
    if why is not None:
        scale = next((k for k in sorted(ctx.cat.model) if k.endswith(_SUFFIX)), None)
        if scale is not None:  # the block grid is unknown: no scale shape can be checked against it
            yield scale, f"{scale}: {why}"
            return
    fused, fused_problems = fused_experts(tensors, block_size(ctx.quant_config))
    theirs = {k for p in fused for k in (p.weight, p.scale)} | {k for k, _ in fused_problems}
    for key in ctx.cat.model:
        if key.endswith(".weight" + _SUFFIX) and key not in theirs:
            problem = _scale_problem(ctx, key)
            if problem is not None:
                yield key, problem
    for key, t in ctx.cat.model.items():
        if t.dtype == "float8_e4m3fn" and len(t.shape) == 2 and key.endswith(".weight"):
            if key + _SUFFIX not in ctx.cat.model and key + "_scale" not in ctx.cat.model:
                yield key, f"{key}: a float8_e4m3fn weight with no {key + _SUFFIX!r} (nor a per-tensor weight_scale)"
    yield from fused_problems
    block_pairs = find_quantized(tensors, block_size(ctx.quant_config))[0]
    yield from method_disagreements(block_pairs, ctx.quant_config)  # block FP8 under another quant_method
    found = [compressed_tensors_fp8(tensors, ctx.quant_config), per_tensor_fp8(tensors, ctx.quant_config)]
    for _, unfit in found:
        yield from unfit
    yield from unclaimed_scales(tensors, ctx.quant_config, found)
    yield from unscaled_fused_experts(tensors, ctx.quant_config)
    yield from _scales_without_config(ctx, tensors)


def _scales_without_config(ctx: Context, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> Iterator[tuple[str, str]]:
    """One finding when the folder's own ``config.json`` cannot be read and float8 weights have an ``x.weight_scale``:
    only its ``quantization_config`` says whether and how they scale (``import`` and ``inspect`` refuse the config)."""
    err = ctx.own_config_error
    if err is not None:
        yield from _one_finding(
            _float8_weight_scales(tensors), f"the folder's config.json cannot be read: {err.message}"
        )


def _float8_weight_scales(tensors: dict[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """The ``x.weight_scale`` keys of float8 weights without an ``x.weight_scale_inv`` (not block FP8), sorted."""
    return [
        k
        for k in sorted(tensors)
        if k.endswith(".weight_scale")
        and tensors.get(k[: -len("_scale")], ("",))[0].startswith("float8_")
        and k[: -len("_scale")] + _SUFFIX not in tensors
    ]


def _one_finding(scales: list[str], why: str) -> Iterator[tuple[str, str]]:
    """One finding for ``scales`` (the first named, the others counted): they scale float8 weights, and ``why``
    nothing says how."""
    if scales:
        more = f" (and {len(scales) - 1} more)" if len(scales) > 1 else ""
        yield scales[0], f"{scales[0]}{more}: scales a float8 weight, but no quantization_config says how: {why}"


def _pairs(ctx: Context) -> tuple[list[QuantPair], list[tuple[str, str]]]:
    """Every scaled pair import dequantizes (:func:`~ckpttool.model.quantized.scaled_pairs`)."""
    return scaled_pairs(_tensors(ctx), ctx.quant_config)


def _read(ctx: Context, key: str) -> Any | None:
    """The tensor as a numpy array (``None`` when it cannot be read: the storage and deep rules report why)."""
    if ctx.deep_result is not None and key in ctx.deep_result.read_errors:
        return None
    try:
        t = ctx.reader.read_tensor(key)
    except CkptError:
        return None
    import torch

    if t.dtype in (torch.bfloat16, torch.float16):  # compressed-tensors' scales of a BF16 / FP16 model: as float32
        return t.float().numpy()
    return t.view(torch.uint8).numpy() if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu) else t.numpy()


def _fp8_scale_values(ctx: Context, p: QuantPair) -> str | None:
    import numpy as np

    from ckpttool.engine.kernels import E4M3FN_MAX, E4M3FN_VALUES

    s = _read(ctx, p.scale)
    if s is None:
        return None
    s = s.reshape(scale_grid(p.shape, p.block))  # one scale per tensor ([] or [1]): a grid of one block
    bad = np.argwhere(~np.isfinite(s) | (s < 0))
    if bad.size:
        at = tuple(int(x) for x in bad[0])
        return f"{p.scale}: {len(bad)} scale(s) NaN, infinite or negative, e.g. block {at} = {float(s[at])!r}"
    zero = np.argwhere(s == 0)
    huge = np.argwhere(s > np.finfo(np.float32).max / E4M3FN_MAX)  # only these can overflow: |q| <= 448
    if not zero.size and not huge.size:
        return None
    q = _read(ctx, p.weight)  # read again only for such scales (a zero scale must scale a zero block)
    if q is None:
        return None
    b0, b1 = p.block

    def codes(z: Any) -> Any:  # the block's codes: (i, j), or (expert, i, j) of fused experts
        return q[tuple(z[:-2]) + (slice(z[-2] * b0, (z[-2] + 1) * b0), slice(z[-1] * b1, (z[-1] + 1) * b1))]

    nonzero = [tuple(int(x) for x in z) for z in zero if (codes(z) & 0x7F).any()]
    if nonzero:
        return f"{p.scale}: {len(nonzero)} block(s) have scale 0 but non-zero values, e.g. block {nonzero[0]}"
    with np.errstate(over="ignore"):
        over = [
            tuple(int(x) for x in z)
            for z in huge
            if np.isinf(E4M3FN_VALUES[codes(z)].astype(np.float32) * np.float32(s[tuple(z)])).any()
        ]
    if over:
        return (
            f"{p.scale}: {len(over)} block(s) whose values times the scale overflow float32 (torch's reader loads "
            f"infinity there), e.g. block {over[0]} = {float(s[over[0]])!r}"
        )
    return None


def _mxfp4_scale_values(ctx: Context, p: QuantPair) -> str | None:
    import numpy as np

    e = _read(ctx, p.scale)
    if e is None:
        return None
    e = e.view(np.uint8)
    n = int(np.count_nonzero(e == 0xFF))
    if n:
        return f"{p.scale}: {n} E8M0 exponent(s) are 0xFF (NaN)"
    big = np.flatnonzero(e.reshape(-1) >= 253)  # 2^126 and up: an FP4 value of 2 or more overflows float32 (6 * 2^126)
    if not big.size:
        return None
    blocks = _read(ctx, p.weight)
    if blocks is None:
        return None
    from ckpttool.engine.kernels import mxfp4_dequantize

    groups = blocks.reshape(-1, blocks.shape[-1])[big]
    over = np.isinf(mxfp4_dequantize(groups, e.reshape(-1)[big])).any(axis=1)
    if not over.any():
        return None
    at = tuple(int(x) for x in np.unravel_index(int(big[np.argmax(over)]), e.shape))
    return (
        f"{p.scale}: {int(over.sum())} group(s) whose FP4 values times 2^(e-127) overflow float32 (infinity), "
        f"e.g. group {at} with exponent {int(e[at])}"
    )


@rule("M021")
def quant_scale_values(ctx: Context) -> Iterator[tuple[str, str]]:
    pairs, _ = _pairs(ctx)
    for p in pairs:
        why = _fp8_scale_values(ctx, p) if p.kind != "mxfp4" else _mxfp4_scale_values(ctx, p)
        if why is not None:
            yield p.scale, why


@rule("M024")
def fp8_scales_unconfigured(ctx: Context) -> Iterator[tuple[str, str]]:
    cfg = ctx.quant_config
    if ctx.own_config_error is not None or (isinstance(cfg, dict) and cfg.get("quantization_config") is not None):
        return  # read under its quantization_config (M020 / M021), or the unreadable config is M020's finding
    where = "no config.json in the folder, no --config" if cfg is None else "the config has none"
    tensors = _tensors(ctx)
    yield from _one_finding(_float8_weight_scales(tensors), f"{where}; the weights were read as their stored FP8 codes")


@rule("M026")
def packed_integer(ctx: Context) -> Iterator[tuple[str, str]]:
    """One finding a method of integer-packed quantized weights (:func:`~ckpttool.model.quantized.packed_integer_weights`),
    naming its first weight in key order and counting the others: their values are codes no rule can judge."""
    found: dict[str, list[str]] = {}
    for key, method in packed_integer_weights(_tensors(ctx)):
        found.setdefault(method, []).append(key)
    for method, keys in found.items():
        more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
        yield (
            keys[0],
            f"{keys[0]}{more}: an integer-packed {method} quantized weight: its stored integers are codes, not "
            "values, and were not checked as weights (ckpttool dequantizes none of these; import refuses them, E612)",
        )


#: The ``quantization_config`` lists of modules an FP8 reader leaves unconverted: vLLM's ``Fp8Config`` reads
#: ``ignored_layers``, else ``modules_to_not_convert``; transformers' ``FineGrainedFP8`` the latter.
_NOT_CONVERTED = ("ignored_layers", "modules_to_not_convert")


def _kept_by(module: str, patterns: Any) -> str | None:
    """The entry of ``patterns`` that leaves ``module`` unconverted, as transformers' ``should_convert_module`` matches
    a plain name: from the start up to a module boundary (``layers.1`` keeps ``layers.1.attn``, not ``layers.11``), or
    as a suffix. Entries are read literally (a regex one is not evaluated: an untrusted config's pattern)."""
    for pat in patterns if isinstance(patterns, list) else ():
        if isinstance(pat, str) and pat and (module == pat or module.startswith(pat + ".") or module.endswith(pat)):
            return pat
    return None


def _ct_ignored(ctx: Context, qc: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """FP8 weights with their ``x.weight_scale`` whose module a compressed-tensors config's ``ignore`` names exactly
    (compressed-tensors' ``match_name`` of a plain entry: the whole module name; ``re:`` entries are not evaluated, an
    untrusted config's pattern): no quantization scheme is applied to that module, so transformers' default load
    builds it unquantized (``nn.Linear``), loads the FP8 codes as its values and leaves the scale unread (its
    ``dequantize=True`` load and ``import`` scale them: the readers disagree)."""
    ignore = qc.get("ignore")
    names = {e for e in ignore if isinstance(e, str)} if isinstance(ignore, list) else set()
    if not names:
        return
    for p in _pairs(ctx)[0]:
        module = ctx.cat.fqn_of(p.weight).removesuffix(".weight")
        if p.kind == "fp8-compressed-tensors" and module in names:
            yield (
                p.weight,
                f"{p.weight} is stored FP8 with its scale {p.scale!r}, but quantization_config.ignore entry "
                f"{module!r} leaves that module unquantized: transformers' compressed-tensors load builds it unquantized, "
                "reads its FP8 codes as values and leaves the scale unread",
            )


@rule("M027")
def fp8_weights_listed_unconverted(ctx: Context) -> Iterator[tuple[str, str]]:
    """FP8 weights (with their scales) whose module a ``quant_method: fp8`` config lists as not converted, or a
    compressed-tensors config's ``ignore`` names: its readers build that module unquantized (``nn.Linear``), load the
    FP8 codes into it as values and leave the scale unread. One finding a weight."""
    cfg = ctx.quant_config
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors":
        yield from _ct_ignored(ctx, qc)
        return
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        return
    pairs, _ = _pairs(ctx)
    for p in pairs:
        if p.kind not in ("fp8-block", "fp8-tensor", "fp8-experts"):
            continue
        module = p.weight.removesuffix(".weight") if p.kind != "fp8-experts" else p.weight.rpartition(".")[0]
        hit = next(((n, pat) for n in _NOT_CONVERTED if (pat := _kept_by(module, qc.get(n))) is not None), None)
        if hit is not None:
            yield (
                p.weight,
                f"{p.weight} is stored FP8 with its scale {p.scale!r}, but quantization_config.{hit[0]} entry "
                f"{hit[1]!r} leaves module {module!r} unconverted: vLLM and transformers' FineGrainedFP8 (loading "
                "FP8 layers) build it unquantized, read its FP8 codes as values and leave the scale unread",
            )


@rule("M022")
def fp8_nan_bytes(ctx: Context) -> Iterator[tuple[str, str]]:
    assert ctx.deep_result is not None
    for key, st in ctx.deep_result.stats.items():
        if st.dtype == "float8_e4m3fn" and st.nonfinite:
            yield key, f"{key}: {st.nonfinite} of {st.numel} float8_e4m3fn bytes are NaN (0x7F / 0xFF)"


@rule("M023")
def mxfp4_scale_mismatch(ctx: Context) -> Iterator[tuple[str, str]]:
    _, problems = _pairs(ctx)
    for key, why in problems:
        if key.endswith(("_blocks", "_scales")):
            yield key, why
