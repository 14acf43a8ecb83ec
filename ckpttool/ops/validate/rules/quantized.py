"""Quantized-weight rules (``M020``): block FP8 weights and their ``weight_scale_inv`` (DeepSeek-V3 convention).

A ``x.weight_scale_inv`` (float32 ``[ceil(out / B), ceil(in / B)]``) scales the ``float8_e4m3fn``
``x.weight`` ``[out, in]`` per ``B x B`` block (``q * scale`` dequantizes: torch's
``QuantizedHuggingFaceStorageReader``, transformers' ``FineGrainedFP8``). ``B`` is the
``--config`` ``quantization_config.weight_block_size`` when given, else 128.
"""

from __future__ import annotations

from collections.abc import Iterator

from ckpttool.ops.validate.base import Severity, rule
from ckpttool.ops.validate.context import Context

_SUFFIX = "_scale_inv"


def _block(ctx: Context) -> tuple[int, int]:
    qc = (ctx.config or {}).get("quantization_config")
    wbs = qc.get("weight_block_size") if isinstance(qc, dict) else None
    if isinstance(wbs, list) and len(wbs) == 2 and all(isinstance(b, int) and b > 0 for b in wbs):
        return wbs[0], wbs[1]
    return 128, 128


def _scale_problem(ctx: Context, key: str) -> str | None:
    """What is wrong with scale ``key`` and its weight, or ``None``."""
    scale = ctx.cat.model[key]
    weight = ctx.cat.model.get(key[: -len(_SUFFIX)])
    if weight is None:
        return f"{key}: a block scale for a missing weight {key[: -len(_SUFFIX)]!r}"
    if scale.dtype != "float32":
        return f"{key}: scales are {scale.dtype}, not float32 (DeepSeek block FP8 stores float32 scales)"
    if weight.dtype != "float8_e4m3fn":
        return f"{key}: its weight is {weight.dtype}, not float8_e4m3fn"
    if len(weight.shape) != 2 or len(scale.shape) != 2:
        return f"{key}: weight {list(weight.shape)} and scale {list(scale.shape)} are not both 2-D"
    b0, b1 = _block(ctx)
    want = [-(-weight.shape[0] // b0), -(-weight.shape[1] // b1)]
    if list(scale.shape) != want:
        return f"{key}: shape {list(scale.shape)}, but weight {list(weight.shape)} in {b0}x{b1} blocks needs {want}"
    return None


@rule(
    "M020",
    "fp8-scale-mismatch",
    Severity.error,
    "a block FP8 weight_scale_inv does not fit its weight: no such weight, not float32 (e.g. F8_E8M0), "
    "a weight that is not float8_e4m3fn, or a shape other than ceil(out/B) x ceil(in/B)",
    "re-export with `ckpttool export --quantize fp8-block`, or pass the --config whose "
    "quantization_config.weight_block_size the checkpoint was quantized with",
)
def fp8_scale_mismatch(ctx: Context) -> Iterator[tuple[str, str]]:
    for key in ctx.cat.model:
        if key.endswith(".weight" + _SUFFIX):
            problem = _scale_problem(ctx, key)
            if problem is not None:
                yield key, problem
    for key, t in ctx.cat.model.items():
        if t.dtype == "float8_e4m3fn" and len(t.shape) == 2 and key.endswith(".weight"):
            if key + _SUFFIX not in ctx.cat.model and key + "_scale" not in ctx.cat.model:
                yield key, f"{key}: a float8_e4m3fn weight with no {key + _SUFFIX!r} (nor a per-tensor weight_scale)"
