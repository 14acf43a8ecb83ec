"""``import`` of a quantized HF checkpoint: block FP8 and MXFP4 weights dequantized to a BF16 or FP32 DCP.

Which keys pair up: :func:`ckpttool.model.quantized.scaled_pairs`. The values are those of
the references, bit for bit:

- block FP8: ``float32(q) * scale`` per element, then rounded to ``--dtype`` (nearest even),
  as torch's ``QuantizedHuggingFaceStorageReader._dequantize_tensor`` (``torch 2.13``); fused
  experts ``[E, out, in]`` with scales ``[E, ceil(out / B0), ceil(in / B1)]`` (transformers'
  ``FP8Experts``) the same per expert, as transformers' load-time ``Fp8Dequantize`` (and its
  ``_dequantize_fp8_weight`` in float32: with a BF16 dtype it rounds the scale to BF16 first);
- compressed-tensors FP8 (``x.weight_scale``, block, channel or tensor as the config's weight scheme says):
  ``float32(q) * scale``, rounded to ``--dtype``, as its decompression;
- per-tensor FP8 of vLLM's ``fp8`` convention (``quant_method`` ``fp8`` without ``weight_block_size``: one
  float32 ``x.weight_scale``): ``float32(q) * scale``, rounded to ``--dtype``, as vLLM's ``Fp8LinearMethod``;
- MXFP4: ``FP4_VALUES[nibble] * 2^(e - 127)`` (float32, exact), rounded to ``--dtype``, dims 1
  and 2 transposed, as transformers' ``convert_moe_packed_tensors`` (the gpt-oss model's layout).

The scales are not imported. Each dequantized tensor is staged in an anonymous in-memory file
(``memfd``) when the import first reads it and dropped after the tensor is written, so the
import's memory is bounded by the largest dequantized tensor. Refused (E612, nothing
published): a scale that does not fit its weight (missing weight, not float32, bfloat16 or float16
(:data:`~ckpttool.model.quantized.SCALE_DTYPES`), shape other than
``ceil(out / B0) x ceil(in / B1)``), a NaN / infinite / negative scale, a zero scale of a block that is not all
zero, NaN bytes in an FP8 weight, an MXFP4 exponent ``0xFF``, block-FP8 scales under a ``quant_method`` other than
``fp8`` (:func:`~ckpttool.model.quantized.method_disagreements`: the config does not give their grid), finite pieces whose product is beyond the range of ``--dtype`` (torch's reader would load infinity there).
``docs/import.md``, "Quantized checkpoints".
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.errors import QuantizedSourceError, UsageError
from ckpttool.format.files import open_regular, resolve_inside
from ckpttool.model.quantized import (
    FP8_SCALE_SUFFIX,
    QuantKind,
    QuantPair,
    block_size,
    block_size_problem,
    blocks_of_scales,
    find_quantized,
    method_disagreements,
    packed_integer_weights,
    scale_grid,
    scaled_pairs,
)

__all__ = ["DEQUANT_DTYPES", "STAGED_PREFIX", "Dequantized", "StagedFds", "plan_dequantize"]

#: ``--dtype`` choices: what dequantized weights are written as.
DEQUANT_DTYPES = ("bfloat16", "float32")
#: File names of staged (dequantized) tensors: never names of real files (a NUL byte).
STAGED_PREFIX = "\0dequantized:"


@dataclass(frozen=True)
class Dequantized:
    """One planned dequantization: the pair, where its stored pieces are and the output dtype."""

    pair: QuantPair
    weight_at: tuple[str, int]  # (file, absolute data offset)
    scale_at: tuple[str, int]
    scale_dtype: str
    dtype: str


@dataclass(frozen=True)
class Cast:
    """An unquantized float tensor staged in the dequantized dtype: a per-expert part beside dequantized parts of the
    same fused tensor (one expert kept BF16 among FP8 experts, imported with ``--dtype float32``), whose bytes must
    have the dtype of the others to be fused."""

    key: str
    at: tuple[str, int]  # (file, absolute data offset)
    src_dtype: str
    shape: tuple[int, ...]
    dtype: str


#: Stored dtypes a :class:`Cast` reads.
CASTABLE = ("bfloat16", "float16", "float32")


def _bad(msg: str, key: str, hint: str | None = None) -> QuantizedSourceError:
    return QuantizedSourceError(
        msg,
        fqn=key,
        hint=hint
        or "the quantized checkpoint is damaged or of another convention; check it with `ckpttool validate --deep`",
    )


def _unconfigured_blocks(
    tensors: dict[str, tuple[str, tuple[int, ...]]], config: dict[str, Any] | None, key: str
) -> tuple[str, str] | None:
    """What is missing when a block-FP8 scale (``key``) misfits the default 128x128 grid of a folder whose config
    has no ``quantization_config`` (an export as stored without ``--model-assets``; a DCP's FP8 weights): the
    block size, which the scales' shapes may name. ``(message tail, hint)``; ``None`` where a config gives one."""
    if not key.endswith(FP8_SCALE_SUFFIX) or isinstance((config or {}).get("quantization_config"), dict):
        return None
    fit = blocks_of_scales(tensors)
    where = "config.json has" if config is not None else "the folder has no config.json, so"
    tail = f"; {where} no quantization_config.weight_block_size, and 128x128 was assumed"
    example = '{"quant_method": "fp8", "weight_block_size": [B0, B1]}'
    if fit is None:
        return tail, f"no block size fits every scale stored: pass `config` a config.json with {example}"
    if fit.block is None:
        return tail, (
            f"the scales' shapes fit blocks of {fit.named} (rows x columns), which dequantize differently: pass "
            f"`config` the model's config.json with the quantization_config it was quantized with ({example})"
        )
    qc = json.dumps({"quant_method": "fp8", "weight_block_size": list(fit.block)})
    return tail, (
        f"the scales fit weight_block_size {list(fit.block)} (blocks of {fit.named} fit their shapes): pass `config` "
        f"the model's config.json with \"quantization_config\": {qc} added (the quantizer's own block size where "
        "it is known)"
    )


def plan_dequantize(
    sources: dict[str, Any], config: dict[str, Any] | None, dtype: str | None
) -> tuple[dict[str, Dequantized], list[str]]:
    """The quantized pairs among ``sources`` (key -> an object with ``file``, ``offset``, ``dtype``, ``shape``).

    Returns:
        ``(dequantized name -> plan, keys consumed)``: the scale keys (and MXFP4 ``_blocks``) the
        import leaves out.

    Raises:
        UsageError: ``dtype`` not one of :data:`DEQUANT_DTYPES`.
        QuantizedSourceError (E612): a key that looks quantized but does not fit (see the module docstring).
            Integer-packed weights of conventions not dequantized here (:func:`_refuse_packed`).
    """
    out_dtype = dtype or "bfloat16"
    if out_dtype not in DEQUANT_DTYPES:
        raise UsageError(f"`dtype` {dtype!r} is not one of {', '.join(DEQUANT_DTYPES)}", param="dtype")
    tensors = {k: (s.dtype, tuple(s.shape)) for k, s in sources.items()}
    _refuse_packed(tensors)
    why = block_size_problem(config)
    scale = next((k for k in sorted(tensors) if k.endswith(FP8_SCALE_SUFFIX)), None)
    if why is not None and scale is not None:  # the block grid is unknown: never the default in its place
        raise _bad(
            f"{scale}: {why}",
            scale,
            hint="write the block size the weights were quantized with, e.g. [128, 128], into config.json "
            "(or pass a corrected `config`)",
        )
    pairs, problems = scaled_pairs(tensors, config)
    if problems:
        key, why = problems[0]
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        unconfigured = _unconfigured_blocks(tensors, config, key)
        if unconfigured is not None:
            raise _bad(why + more + unconfigured[0], key, hint=unconfigured[1])
        if dict(method_disagreements(find_quantized(tensors, block_size(config))[0], config)).get(key) == why:
            raise _bad(
                why + more,
                key,
                hint="pass `config` a config.json with the quantization_config the weights were quantized with "
                '(block FP8: {"quant_method": "fp8", "weight_block_size": [B0, B1]}), or correct the folder\'s',
            )
        raise _bad(why + more, key)
    plans: dict[str, Dequantized] = {}
    consumed: list[str] = []
    for p in pairs:
        w, s = sources[p.weight], sources[p.scale]
        plans[p.name] = Dequantized(p, (w.file, w.offset), (s.file, s.offset), s.dtype, out_dtype)
        consumed.append(p.scale)
        if p.weight != p.name:
            consumed.append(p.weight)
    return plans, consumed


def _refuse_packed(tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """Integer-packed quantized weights (:func:`~ckpttool.model.quantized.packed_integer_weights`: AWQ/GPTQ,
    bitsandbytes, compressed-tensors packed or int) are refused: imported as stored, their integer codes would load
    into the model's weights as values (``dcp.load`` casts), with or without a config to compare with.

    Raises:
        QuantizedSourceError (E612): naming the first such weight and its method.
    """
    packed = packed_integer_weights(tensors)
    if packed:
        key, method = packed[0]
        more = f" (+{len(packed) - 1} more)" if len(packed) > 1 else ""
        raise _bad(
            f"{key}{more}: an integer-packed {method} quantized weight: import dequantizes block FP8, FP8 with a "
            "weight_scale and MXFP4 only, and its packed codes are not the model's weights",
            key,
            hint=f"dequantize it with {_dequantizer(method)} and save the plain weights (save_pretrained), then "
            "import that folder; or import the unquantized model it was made from",
        )


#: who dequantizes each packed-integer method (by the start of its name in ``packed_integer_weights``): only
#: bitsandbytes has transformers' ``model.dequantize()`` (its quantizers' ``_dequantize``)
_DEQUANTIZERS = (
    ("bitsandbytes", "transformers (model.dequantize(), bitsandbytes installed)"),
    ("optimum-quanto", "optimum-quanto (each quantized weight's .dequantize())"),
    ("AWQ/GPTQ", "the library that quantized it (AutoAWQ, GPTQModel)"),
    ("compressed-tensors", "compressed-tensors (ModelCompressor.decompress_model)"),
    ("integer", "compressed-tensors (ModelCompressor.decompress_model)"),
)


def _dequantizer(method: str) -> str:
    """Who can dequantize weights of ``method`` (a name from ``packed_integer_weights``), for E612's hint."""
    return next((who for start, who in _DEQUANTIZERS if method.startswith(start)), "its quantization library")


class StagedFds(dict[str, int]):
    """File name -> open descriptor; a :data:`STAGED_PREFIX` name stages its dequantized tensor on first use.

    Args:
        src_dir: the HF directory (the stored pieces' files are opened inside it).
        plans: dequantized name -> :class:`Dequantized` (or a :class:`Cast` part of fused experts).
    """

    def __init__(self, src_dir: Path, plans: dict[str, Dequantized | Cast]) -> None:
        super().__init__()
        self.src_dir, self.plans = src_dir, plans
        self.staged: set[str] = set()

    def source_fd(self, name: str) -> int:
        if name not in self:
            self[name] = open_regular(resolve_inside(self.src_dir, name, what="safetensors file"))
        return self[name]

    def __missing__(self, name: str) -> int:
        if not name.startswith(STAGED_PREFIX):
            raise KeyError(name)
        plan = self.plans[name[len(STAGED_PREFIX) :]]
        fd = _anonymous_file()
        try:
            if isinstance(plan, Cast):
                _stage_cast(self, plan, fd)
            else:
                _STAGERS[plan.pair.kind](self, plan, fd)
        except BaseException:
            os.close(fd)
            raise
        self[name] = fd
        self.staged.add(name)
        return fd

    def release(self) -> None:
        """Close the staged tensors (the next use stages them again)."""
        for name in self.staged:
            os.close(self.pop(name))
        self.staged.clear()


def _anonymous_file() -> int:
    if hasattr(os, "memfd_create"):
        return os.memfd_create("ckpttool-dequantized", getattr(os, "MFD_CLOEXEC", 0))
    f = tempfile.TemporaryFile()  # the descriptor is duplicated: it outlives the file object
    fd = os.dup(f.fileno())
    f.close()
    return fd


def _read(fds: StagedFds, at: tuple[str, int], offset: int, nbytes: int) -> Any:
    import numpy as np

    from ckpttool.engine.io import read_exact

    return np.frombuffer(read_exact(fds.source_fd(at[0]), nbytes, at[1] + offset), dtype=np.uint8)


def _encode(vals: Any, dtype: str) -> Any:
    """float32 values as the bytes of ``dtype`` (bfloat16: nearest even, as ``Tensor.to``)."""
    import numpy as np

    from ckpttool.engine.kernels import f32_to_bf16

    flat = np.ascontiguousarray(vals, dtype=np.float32).reshape(-1)
    if dtype == "float32":
        return flat.view(np.uint8)
    out = np.empty(flat.size, dtype=np.uint16)
    f32_to_bf16(flat.view(np.uint32), out)
    return out.view(np.uint8)


def _overflow_check(encoded: Any, dtype: str, p: QuantPair, where: str, first: int, shape: tuple[int, ...]) -> None:
    """Refuse dequantized values that are infinite in ``dtype``: finite pieces whose product overflows it.

    Args:
        encoded: the ``uint8`` bytes :func:`_encode` made of one band (``shape``: its ``[rows, cols]``).
        first: the band's first row in the tensor (for the message).

    Raises:
        QuantizedSourceError (E612): a value beyond the dtype's range (torch's reader gives infinity there).
    """
    import numpy as np

    if dtype == "float32":
        bad = np.flatnonzero((encoded.view(np.uint32) & 0x7F800000) == 0x7F800000)
    else:
        bad = np.flatnonzero((encoded.view(np.uint16) & 0x7F80) == 0x7F80)
    if not bad.size:
        return
    r, c = divmod(int(bad[0]), shape[-1])
    raise _bad(
        f"{p.weight}: {bad.size} value(s) of {where}rows {first}..{first + shape[0] - 1} dequantize beyond the "
        f"{dtype} range (infinity), e.g. row {first + r}, column {c}: a scale too large for its values",
        p.weight,
    )


def read_scales(fds: StagedFds, plan: Dequantized) -> Any:
    """The whole scale tensor, checked: finite and >= 0 (FP8; as float32), exponents other than ``0xFF`` (MXFP4).

    Raises:
        QuantizedSourceError (E612): a NaN, infinite or negative scale; an E8M0 ``0xFF`` (NaN) exponent.
    """
    import numpy as np

    p = plan.pair
    n = 1
    for d in p.stored[:-1] if p.kind == "mxfp4" else _scale_shape(p):
        n *= d
    if p.kind == "mxfp4":
        e = _read(fds, plan.scale_at, 0, n)
        bad = np.flatnonzero(e == 0xFF)
        if bad.size:
            raise _bad(
                f"{p.scale}: {bad.size} E8M0 exponent(s) are 0xFF (NaN), e.g. at flat index {int(bad[0])}", p.scale
            )
        return e
    s = _scales_f32(_read(fds, plan.scale_at, 0, _SCALE_ITEMSIZE[plan.scale_dtype] * n), plan.scale_dtype)
    s = s.reshape(_scale_shape(p))
    where = np.argwhere(~np.isfinite(s) | (s < 0))
    if where.size:
        at = tuple(int(x) for x in where[0])
        block = ", ".join(str(x) for x in at)
        raise _bad(
            f"{p.scale}: {len(where)} scale(s) are NaN, infinite or negative, e.g. block ({block}) = {float(s[at])!r}",
            p.scale,
        )
    return s


#: bytes of a stored FP8 scale by dtype (bfloat16 / float16: compressed-tensors' scales of a BF16 / FP16 model).
_SCALE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _scales_f32(raw: Any, dtype: str) -> Any:
    """The stored scale bytes ``raw`` (``uint8``) of ``dtype`` as float32 values (exact: every bfloat16 / float16 is a
    float32), so ``float32(q) * scale`` is the product compressed-tensors' decompression rounds to its dtype."""
    import numpy as np

    if dtype == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return raw.view(np.float16 if dtype == "float16" else np.float32).astype(np.float32)


def _scale_shape(p: QuantPair) -> tuple[int, ...]:
    """``[ceil(out / B0), ceil(in / B1)]``, with the experts' dim in front for ``fp8-experts``."""
    return scale_grid(p.shape, p.block)


def _stage_fp8(fds: StagedFds, plan: Dequantized, fd: int) -> None:
    """Dequantize a block-FP8 weight band by band (``B0`` rows) into ``fd``."""
    import numpy as np

    from ckpttool.engine.io import write_all
    from ckpttool.engine.kernels import e4m3fn_nan_count, fp8_rows_dequantize

    p = plan.pair
    scale = read_scales(fds, plan)
    *lead, rows, cols = p.shape
    b0, b1 = p.block
    item = 2 if plan.dtype == "bfloat16" else 4
    experts = lead[0] if lead else 1  # fused experts ``fp8-experts``: each expert on its own grid
    band = b0 if b0 < rows else 128  # one block over every row (a per-tensor scale): bands of 128 rows of it
    for e in range(experts):
        s_e, at, where = (scale[e], e * rows * cols, f"expert {e} ") if lead else (scale, 0, "")
        for r0 in range(0, rows, band):
            n = min(band, rows - r0)
            q = _read(fds, plan.weight_at, at + r0 * cols, n * cols).reshape(n, cols)
            nan = e4m3fn_nan_count(q)
            if nan:
                raise _bad(f"{p.weight}: {nan} NaN byte(s) (0x7F / 0xFF) in {where}rows {r0}..{r0 + n - 1}", p.weight)
            zero = np.flatnonzero(s_e[r0 // b0] == 0)
            for j in zero:  # a zero scale is only right for a block of zeros (+0 / -0)
                if (q[:, j * b1 : (j + 1) * b1] & 0x7F).any():
                    raise _bad(
                        f"{p.scale}: {where}block ({r0 // b0}, {int(j)}) has scale 0 but non-zero values", p.scale
                    )
            vals = _encode(fp8_rows_dequantize(q, s_e, r0, p.block), plan.dtype)
            _overflow_check(vals, plan.dtype, p, where, r0, (n, cols))
            write_all(fd, vals, (at + r0 * cols) * item)


def _stage_mxfp4(fds: StagedFds, plan: Dequantized, fd: int) -> None:
    """Dequantize MXFP4 blocks expert by expert into ``fd``, ``[N, G * 2B]`` transposed to ``[G * 2B, N]``."""
    from ckpttool.engine.io import write_all
    from ckpttool.engine.kernels import mxfp4_dequantize

    p = plan.pair
    e, n, g, b = p.stored
    exps = read_scales(fds, plan).reshape(e, n * g)
    item = 2 if plan.dtype == "bfloat16" else 4
    per = n * g * b
    for j in range(e):
        blocks = _read(fds, plan.weight_at, j * per, per).reshape(n * g, b)
        vals = _encode(mxfp4_dequantize(blocks, exps[j]).reshape(n, g * 2 * b).T, plan.dtype)
        _overflow_check(vals, plan.dtype, p, f"expert {j} ", 0, (g * 2 * b, n))
        write_all(fd, vals, j * n * g * 2 * b * item)


def _stage_cast(fds: StagedFds, plan: Cast, fd: int) -> None:
    """Write the stored float tensor as ``plan.dtype`` (float32: exact; bfloat16: nearest even, as ``Tensor.to``).

    Raises:
        QuantizedSourceError (E612): a finite float32 value that rounds to a bfloat16 infinity (from 3.39618e38).
    """
    import numpy as np

    from ckpttool.engine.io import write_all
    from ckpttool.engine.kernels import bf16_overflow_at

    n = math.prod(plan.shape)
    raw = _read(fds, plan.at, 0, n * {"bfloat16": 2, "float16": 2, "float32": 4}[plan.src_dtype])
    if plan.src_dtype == "bfloat16":
        vals = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        vals = raw.view(np.float16 if plan.src_dtype == "float16" else np.float32).astype(np.float32)
    encoded = _encode(vals, plan.dtype)
    if plan.dtype == "bfloat16":
        bad = bf16_overflow_at(vals.reshape(-1).view(np.uint32))  # float32 values, contiguous
        if bad.size:
            at = [int(i) for i in np.unravel_index(int(bad[0]), plan.shape)]
            raise _bad(
                f"{plan.key}: {bad.size} finite {plan.src_dtype} value(s) beyond bfloat16's range (+-3.39e38) would "
                f"be written as infinity, e.g. {float(vals.reshape(-1)[bad[0]]):g} at {at}",
                plan.key,
                hint="import with --dtype float32 (the stored values, exact)",
            )
    write_all(fd, encoded, 0)


_STAGERS: dict[QuantKind, Callable[[StagedFds, Dequantized, int], None]] = {
    "fp8-block": _stage_fp8,
    "fp8-experts": _stage_fp8,
    "fp8-compressed-tensors": _stage_fp8,
    "fp8-tensor": _stage_fp8,
    "mxfp4": _stage_mxfp4,
}
