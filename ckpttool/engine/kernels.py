"""The numeric kernels of the byte engine: casts, bit-pattern tests and run-map placement, numpy (and native casts).

In place on the callers' cache-sized numpy slabs, GIL released inside numpy and native calls, torch
never imported: float32/bfloat16/float16 casts bit-exact with torch's ``Tensor.to`` (round to nearest
even) for every non-NaN value (bfloat16 held as ``uint16`` bit patterns; float32 -> bfloat16 and
float16 by the one-pass native kernels where built, ``engine/native/cast.c``, else float32 ->
bfloat16 by torch's own one-pass kernel when the process has imported torch already); float8
(``float8_e4m3fn`` saturating, ``float8_e5m2``) with ``c10::Float8_*``'s rounding and overflow
rules; IEEE bit-pattern views (the statistics kernel over them: :mod:`ckpttool.engine.stats`); run maps
(``out[dst:dst+n] = src[s:s+n]``, :func:`place_runs`, :func:`scatter_rows`). Scratch arrays are
per thread. ``docs/design.md`` §5, "The byte engine".
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from ckpttool.engine import native
from ckpttool.engine.io import BLOCK_BYTES

__all__ = [
    "BF16_NAN",
    "FAST_CASTS",
    "Scratch",
    "F8_FORMATS",
    "IEEE_BITS",
    "E4M3FN_MAX",
    "E4M3FN_VALUES",
    "bf16_overflow_at",
    "bf16_overflows",
    "bf16_to_f32",
    "cast",
    "f32_to_bf16",
    "f32_to_f16",
    "f32_to_f8",
    "loaded_torch",
    "fp8_block_dequantize",
    "fp8_block_error",
    "fp8_block_quantize",
    "fp8_channel_dequantize",
    "fp8_channel_error",
    "fp8_channel_quantize",
    "float_values",
    "place_runs",
    "scatter_rows",
    "to_f32",
]

#: The bfloat16 pattern a NaN rounds to: the canonical quiet NaN of ``c10::BFloat16``'s scalar conversion.
BF16_NAN = 0x7FC0

#: dtype pairs :func:`cast` converts (torch dtype names, ``(source, output)``).
FAST_CASTS = frozenset(
    {
        ("float32", "bfloat16"),
        ("float16", "bfloat16"),
        ("bfloat16", "float32"),
        ("bfloat16", "float16"),
        ("float32", "float16"),
        ("float16", "float32"),
    }
)

_NUMPY_FLOAT = {"float32": "float32", "float16": "float16", "float64": "float64"}


class Scratch(threading.local):
    """Per-thread scratch arrays by name, reused across slabs (no allocation, no page faults per slab).

    Args:
        min_items: the smallest array allocated, in elements (a block's worth for the callers).
    """

    def __init__(self, min_items: int = BLOCK_BYTES // 4) -> None:
        self.min_items = min_items
        self.arrays: dict[str, Any] = {}

    def get(self, name: str, dtype: Any, n: int) -> Any:
        """This thread's array ``name`` of ``dtype``, its first ``n`` elements (grown when smaller)."""
        a = self.arrays.get(name)
        if a is None or a.size < n:
            a = self.arrays[name] = np.empty(max(n, self.min_items), dtype=dtype)
        return a[:n]


_scratch = Scratch()


# ---------------------------------------------------------------------------------------------- casts


#: Elements per ``Tensor.copy_`` call of :func:`f32_to_bf16`'s torch path: torch's grain size
#: (``at::internal::GRAIN_SIZE``), below which a copy never starts intra-op threads (the engine's
#: workers are the parallelism).
_TORCH_PIECE = 32768


def loaded_torch() -> Any:
    """The ``torch`` module when this process has finished importing it, else ``None`` (never imports it)."""
    torch = sys.modules.get("torch")
    if torch is None or getattr(getattr(torch, "__spec__", None), "_initializing", False):
        return None  # not imported, or being imported by another thread right now
    return torch


def f32_to_bf16(
    src_u32: np.ndarray, out_u16: np.ndarray, *, canonical_nan: bool = True, use_torch: bool | None = None
) -> bool:
    """Round float32 bit patterns to bfloat16, to nearest even (``c10::BFloat16``'s ``round_to_nearest_even``).

    The native one-pass kernel where built (``engine/native/cast.c``), else, when torch is
    imported already, torch's one-pass ``Tensor.copy_`` (the same integer rounding,
    ``ATen/cpu/vec``'s ``cvtfp32_bf16``), else five numpy passes over the slab
    (``docs/performance.md``); the bytes are the same every way.

    Args:
        src_u32: ``uint32`` float32 bit patterns; ``out_u16``: ``uint16``, as many elements.
        canonical_nan: write :data:`BF16_NAN` for every NaN (as torch's scalar conversion); without
            it a NaN's pattern is whatever the rounding carries its payload into (an infinity, the
            sign bit, another NaN): for callers that test NaNs themselves.
        use_torch: ``None``: the native kernel where built, else torch's when :func:`loaded_torch`;
            ``False``: numpy's; ``True``: torch's (``RuntimeError`` when torch is not imported).

    Returns:
        Whether a finite value may have rounded to infinity (a magnitude from ``0x7F7F8000``, 3.39618e38, up to
        float32's largest): the native kernel's flag, a running maximum in its one pass, is also raised by an
        infinity or a NaN (the caller looks for a finite one then); the other paths test exactly
        (:func:`bf16_overflows`).
    """
    if use_torch is None:
        overflow = _native_cast("ckpt_f32_to_bf16", src_u32, out_u16, int(canonical_nan))
        if overflow is not None:
            return overflow
    torch = None if use_torch is False else loaded_torch()
    if use_torch and torch is None:
        raise RuntimeError("f32_to_bf16(use_torch=True): torch is not imported")
    if torch is not None:
        _f32_to_bf16_torch(torch, src_u32, out_u16, canonical_nan)
        return bf16_overflows(src_u32)
    t = _scratch.get("round", np.uint32, src_u32.size)
    np.right_shift(src_u32, 16, out=t)
    np.bitwise_and(t, 1, out=t)
    np.add(t, 0x7FFF, out=t)
    np.add(t, src_u32, out=t)
    np.right_shift(t, 16, out=out_u16, casting="unsafe")
    if canonical_nan:
        f = src_u32.view(np.float32)
        if np.isnan(f).any():  # the rounding above would carry a NaN's payload into inf or the sign bit
            out_u16[np.isnan(f)] = BF16_NAN
    return bf16_overflows(src_u32)


def bf16_overflows(src_u32: np.ndarray) -> bool:
    """Whether float32 bit patterns hold a finite value that rounds to bfloat16 infinity (magnitude bits 15..30
    ``0xFEFF``: ``0x7F7F8000`` up to float32's largest, ``0x7F7FFFFF``; infinity and NaN are above)."""
    return bool(_bf16_overflow_mask(src_u32).any())


def bf16_overflow_at(src_u32: np.ndarray) -> np.ndarray:
    """The flat indices (``int64``, ascending) of the float32 bit patterns ``src_u32`` that :func:`bf16_overflows`
    finds: finite values from 3.39618e38 that rounding to bfloat16 makes infinite (as torch's ``to``)."""
    return np.flatnonzero(_bf16_overflow_mask(src_u32))


def _bf16_overflow_mask(src_u32: np.ndarray) -> np.ndarray:
    """Per element of ``src_u32`` (float32 bit patterns): whether it rounds to bfloat16 infinity from a finite
    value (a view of a scratch buffer: valid until the next call)."""
    t = _scratch.get("overflow", np.uint32, src_u32.size)
    np.bitwise_and(src_u32, 0x7FFFFFFF, out=t)
    np.right_shift(t, 15, out=t)
    mask: np.ndarray = t == 0xFEFF
    return mask


def _f32_to_bf16_torch(torch: Any, src_u32: np.ndarray, out_u16: np.ndarray, canonical_nan: bool) -> None:
    """:func:`f32_to_bf16` by ``Tensor.copy_``, in pieces of :data:`_TORCH_PIECE` unless torch runs one thread.

    torch writes ``0xFFFF`` (vectorised) or ``0x7FC0`` (scalar tail) for a NaN: found by two maximum
    reductions over the output (a pattern above ``0x7F80`` with or without the sign bit) and, with
    replaced by what the numpy path writes (:data:`BF16_NAN`, or without ``canonical_nan`` the rounded payload).
    """
    s = torch.from_numpy(src_u32.view(np.float32))
    o = torch.from_numpy(out_u16.view(np.int16)).view(torch.bfloat16)
    n = src_u32.size
    if torch.get_num_threads() == 1 or n <= _TORCH_PIECE:
        o.copy_(s)
    else:
        for a in range(0, n, _TORCH_PIECE):
            o[a : a + _TORCH_PIECE].copy_(s[a : a + _TORCH_PIECE])
    if n and (int(out_u16.view(np.int16).max()) > 0x7F80 or int(out_u16.max()) > 0xFF80):
        nan = np.isnan(src_u32.view(np.float32))
        if canonical_nan:
            out_u16[nan] = BF16_NAN
        else:  # the numpy path's bytes: the payload rounded as any other pattern
            u = src_u32[nan].astype(np.uint64)
            out_u16[nan] = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


@cache
def _native_kernel(name: str) -> Any:
    """A native cast ``(src, dst, n[, canonical_nan])``, or ``None`` where the native kernels are unavailable
    (``ckpt_f32_to_bf16`` returns its flag, :func:`f32_to_bf16`'s, ``ckpt_f32_to_f16`` nothing)."""
    bf16 = name == "ckpt_f32_to_bf16"
    extra = (ctypes.c_int32,) if bf16 else ()
    return native.function(
        name, ctypes.c_int32 if bf16 else None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, *extra
    )


def _native_cast(name: str, src: np.ndarray, out: np.ndarray, *extra: int) -> bool | None:
    """Run the native cast ``name`` over contiguous ``src`` into ``out``: ``None`` (nothing done) where it cannot,
    else its flag (``ckpt_f32_to_bf16``: a finite value may have rounded to infinity; ``False`` for the others)."""
    fn = _native_kernel(name)
    if fn is None or not (src.flags.c_contiguous and out.flags.c_contiguous) or src.size != out.size:
        return None
    if src.itemsize != 4 or out.itemsize != 2:  # the kernels read float32 patterns and write 16-bit ones
        return None
    return bool(fn(src.ctypes.data, out.ctypes.data, src.size, *extra))


def bf16_to_f32(src_u16: np.ndarray, out_u32: np.ndarray) -> None:
    """Widen bfloat16 bit patterns to float32 ones (exact: the pattern shifted into the upper half)."""
    np.left_shift(src_u16, 16, out=out_u32, dtype=np.uint32)


def f32_to_f16(src_f32: np.ndarray, out_f16: np.ndarray, *, use_native: bool = True) -> None:
    """float32 to float16, round to nearest even, beyond float16's range to infinity (as torch); NaN stays NaN.

    numpy's cast, or the native one-pass kernel where built (``use_native``), with numpy's bytes
    for every input (a NaN keeps its sign and the top 10 bits of its payload, ``0x7C01`` where
    those are zero).
    """
    if use_native and _native_cast("ckpt_f32_to_f16", src_f32, out_f16) is not None:
        return
    with np.errstate(over="ignore", invalid="ignore"):
        np.copyto(out_f16, src_f32, casting="unsafe")


def cast(src: np.ndarray, out: np.ndarray, src_dtype: str, out_dtype: str) -> bool:
    """Cast the values in ``src`` to ``out_dtype`` into ``out`` (one pair of :data:`FAST_CASTS`).

    Args:
        src: ``uint8``, ``n * itemsize(src_dtype)`` bytes; ``out``: ``uint8``, ``n * itemsize(out_dtype)``.
        src_dtype, out_dtype: torch dtype names.

    Returns:
        float32 -> bfloat16: :func:`f32_to_bf16`'s flag (a finite value may have rounded to infinity); the other
        pairs ``False`` (the callers test float16's narrower range themselves).

    Raises:
        KeyError: a pair not in :data:`FAST_CASTS`.
    """
    if (src_dtype, out_dtype) not in FAST_CASTS:
        raise KeyError((src_dtype, out_dtype))
    if src_dtype == "bfloat16":
        if out_dtype == "float32":
            bf16_to_f32(src.view(np.uint16), out.view(np.uint32))
            return False
        wide = _scratch.get("wide", np.uint32, src.size // 2)
        bf16_to_f32(src.view(np.uint16), wide)
        f32_to_f16(wide.view(np.float32), out.view(np.float16))
        return False
    if out_dtype == "bfloat16":
        if src_dtype == "float32":
            return f32_to_bf16(src.view(np.uint32), out.view(np.uint16))
        wide = _scratch.get("wide", np.uint32, src.size // 2)
        np.copyto(wide.view(np.float32), src.view(np.float16), casting="unsafe")
        f32_to_bf16(wide, out.view(np.uint16))  # float16's values are far inside bfloat16's range
        return False
    with np.errstate(over="ignore"):
        np.copyto(out.view(_NUMPY_FLOAT[out_dtype]), src.view(_NUMPY_FLOAT[src_dtype]), casting="unsafe")
    return False


@dataclass(frozen=True)
class _F8:
    """One float8 format's constants (``c10/util/Float8_e4m3fn.h``, ``Float8_e5m2.h``)."""

    mant: int  # mantissa bits
    bias: int  # exponent bias
    overflow: int  # float32 magnitude pattern from which the result is ``overflow_to``
    min_normal: int  # float32 magnitude pattern of the smallest normal
    denorm: int  # float32 pattern of 2^k whose ulp is the format's smallest subnormal
    overflow_to: int  # magnitude pattern of an overflow or infinity (e4m3fn: 448, saturated; e5m2: infinity)


#: torch dtype name -> format constants of the float8 formats :func:`f32_to_f8` writes.
F8_FORMATS = {
    "float8_e4m3fn": _F8(3, 7, 0x43E80000, 121 << 23, 141 << 23, 0x7E),  # 464: rounds to 448 or beyond
    "float8_e5m2": _F8(2, 15, 143 << 23, 113 << 23, 134 << 23, 0x7C),
}


def f32_to_f8(src_u32: np.ndarray, out_u8: np.ndarray, dtype: str) -> None:
    """Round float32 bit patterns to float8, to nearest even, as torch's ``Tensor.to`` (``c10/util/Float8_*.h``).

    ``float8_e4m3fn`` has no infinity and saturates: ``|x| >= 464`` (everything that rounds past
    448, the largest finite value) and infinities give ``±448`` (``0x7E``). ``float8_e5m2``:
    ``|x| >= 65536`` and infinities give infinity (``0x7C``). NaNs give ``0x7F`` in both. The
    sign is kept in every case. Subnormal results are rounded by one float32 addition (round
    to nearest even), as c10 does.

    Args:
        src_u32: ``uint32`` float32 bit patterns; ``out_u8``: ``uint8``, as many elements.
        dtype: ``float8_e4m3fn`` or ``float8_e5m2``.
    """
    f = F8_FORMATS[dtype]
    shift = 23 - f.mant
    mag = _scratch.get("f8_mag", np.uint32, src_u32.size)
    t = _scratch.get("f8_t", np.uint32, src_u32.size)
    np.bitwise_and(src_u32, 0x7FFFFFFF, out=mag)
    # normal results: re-bias the exponent, round the mantissa to nearest even
    np.right_shift(mag, shift, out=t)
    np.bitwise_and(t, 1, out=t)
    np.add(t, (((f.bias - 127) << 23) + (1 << (shift - 1)) - 1) & 0xFFFFFFFF, out=t)  # uint32 wrap, as c10
    np.add(t, mag, out=t)
    np.right_shift(t, shift, out=t)
    small = mag < f.min_normal
    if small.any():  # subnormal results: the float32 sum with 2^k rounds at the subnormal step
        sub = mag[small].view(np.float32) + np.float32(np.uint32(f.denorm).view(np.float32))
        t[small] = sub.view(np.uint32) - np.uint32(f.denorm)
    big = mag >= f.overflow
    if big.any():
        t[big] = f.overflow_to
        t[big & (mag > 0x7F800000)] = 0x7F  # NaN
    np.bitwise_or(t, np.right_shift(src_u32, 24) & 0x80, out=t)
    np.copyto(out_u8, t, casting="unsafe")


# ---------------------------------------------------------------------------------------------- bit patterns

#: dtype name -> (signed int view, unsigned int view, all-ones exponent, sign bit) of the IEEE float formats.
IEEE_BITS = {
    "bfloat16": ("int16", "uint16", 0x7F80, 1 << 15),
    "float16": ("int16", "uint16", 0x7C00, 1 << 15),
    "float32": ("int32", "uint32", 0x7F800000, 1 << 31),
    "float64": ("int64", "uint64", 0x7FF0000000000000, 1 << 63),
}


def float_values(raw: np.ndarray, dtype: str) -> np.ndarray:
    """The values of raw bytes of an :data:`IEEE_BITS` dtype as a numpy float array (bfloat16 widened exactly to float32)."""
    if dtype == "bfloat16":
        return np.left_shift(raw.view(np.uint16), 16, dtype=np.uint32).view(np.float32)
    return raw.view(dtype)


# ---------------------------------------------------------------------------------------------- run maps


def scatter_rows(src2d: np.ndarray, dst_rows: np.ndarray, out2d: np.ndarray, *, permutation: bool = False) -> None:
    """``out2d[dst_rows[i]] = src2d[i]`` for every row ``i`` of ``src2d`` (distinct destination rows).

    A permutation of all of ``out2d``'s rows runs as one ``np.take`` of the inverse
    permutation into ``out2d`` (no temporary); other destinations as a fancy-index assignment.
    ``permutation``: the caller knows ``dst_rows`` is such a permutation (skips the check).
    """
    if permutation or (len(dst_rows) == len(out2d) and np.array_equal(np.sort(dst_rows), np.arange(len(out2d)))):
        np.take(src2d, np.argsort(dst_rows), axis=0, out=out2d)  # output row k = the source row headed for k
        return
    out2d[dst_rows] = src2d


def place_runs(src: np.ndarray, out: np.ndarray, runs: Sequence[tuple[int, int, int]]) -> None:
    """Place elements of ``src`` into ``out`` by a run map: ``out[dst:dst+n] = src[s:s+n]`` per run ``(s, n, dst)``.

    Both are 1-d arrays of one dtype; runs are non-overlapping in ``out``. Runs of one length
    ``n`` with ``s`` and ``dst`` multiples of ``n`` (row moves: RoPE rows, expert slabs) run as
    one row gather and :func:`scatter_rows`; others one slice copy each.
    """
    if not runs:
        return
    size = runs[0][1]
    if len(runs) > 1 and size > 0 and all(n == size and s % size == 0 and d % size == 0 for s, n, d in runs):
        src_rows = np.fromiter((s // size for s, _, _ in runs), dtype=np.int64, count=len(runs))
        dst_rows = np.fromiter((d // size for _, _, d in runs), dtype=np.int64, count=len(runs))
        rows = src.reshape(-1, size)
        picked = rows if np.array_equal(src_rows, np.arange(len(rows))) else rows[src_rows]
        scatter_rows(picked, dst_rows, out.reshape(-1, size))
        return
    for s, n, d in runs:
        out[d : d + n] = src[s : s + n]


# ---------------------------------------------------------------------------------------------- block FP8


def _e4m3fn_table() -> np.ndarray:
    """float32 value of each ``float8_e4m3fn`` byte (``c10/util/Float8_e4m3fn.h``: bias 7, no infinity,
    ``0x7F`` / ``0xFF`` NaN, subnormals ``m * 2^-9``)."""
    b = np.arange(256, dtype=np.int64)
    exp, mant = (b >> 3) & 0xF, (b & 7).astype(np.float64)
    mag = np.where(exp == 0, mant * 2.0**-9, (1.0 + mant / 8.0) * np.exp2(exp - 7.0))
    vals = np.where(b & 0x80, -mag, mag)
    vals[(b & 0x7F) == 0x7F] = np.nan
    return vals.astype(np.float32)


#: float32 value of every ``float8_e4m3fn`` bit pattern (exact: every e4m3fn value is a float32).
E4M3FN_VALUES = _e4m3fn_table()

#: The largest finite ``float8_e4m3fn`` value.
E4M3FN_MAX = 448.0


def to_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Raw ``uint8`` bytes of ``float32`` / ``bfloat16`` / ``float16`` values as a new float32 array (exact).

    Raises:
        KeyError: another dtype.
    """
    if dtype == "float32":
        return np.array(raw.view(np.float32), dtype=np.float32)
    if dtype == "bfloat16":
        return np.left_shift(raw.view(np.uint16), 16, dtype=np.uint32).view(np.float32)
    if dtype == "float16":
        return raw.view(np.float16).astype(np.float32)
    raise KeyError(dtype)


def _block_max(a: np.ndarray, block: int) -> np.ndarray:
    """Max of ``a`` (``[rows <= block, cols]``, non-negative) over each column block: ``[ceil(cols / block)]``."""
    rows, cols = a.shape
    nb = -(-cols // block)
    pad = nb * block - cols
    if pad:  # padded with zeros in the scale computation only
        a = np.concatenate([a, np.zeros((rows, pad), dtype=a.dtype)], axis=1)
    return np.asarray(a.reshape(rows, nb, block).max(axis=(0, 2)))


def fp8_block_quantize(band: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize one band of rows (``[rows <= block, cols]`` float32) to ``float8_e4m3fn`` per ``block`` x ``block`` block.

    DeepSeek-V3's block FP8 (``weight_scale_inv``): per block ``scale = amax / 448`` (float32;
    an all-zero block gets ``scale = 1``), ``q = e4m3fn(w / scale)`` rounded to nearest even and
    saturated to ±448 (:func:`f32_to_f8`, as ``torch.Tensor.to``); ``q * scale`` dequantizes.

    Returns:
        ``(q, scale, amax)``: ``uint8`` ``[rows, cols]`` e4m3fn bytes, float32 ``[ceil(cols / block)]``
        scales and the float32 block amax (NaN when the block holds a NaN: the caller refuses it).
    """
    rows, cols = band.shape
    with np.errstate(invalid="ignore"):
        amax = _block_max(np.abs(band), block).astype(np.float32)
    scale = amax / np.float32(E4M3FN_MAX)
    scale[amax == 0] = np.float32(1.0)
    col_scale = np.repeat(scale, min(block, cols))[:cols]  # a block wider than the band: one scale for all of it
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        scaled = np.ascontiguousarray(band / col_scale, dtype=np.float32)
    q = np.empty((rows, cols), dtype=np.uint8)
    f32_to_f8(scaled.view(np.uint32).reshape(-1), q.reshape(-1), "float8_e4m3fn")
    return q, scale, amax


def fp8_block_dequantize(q: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    """``float32(q) * scale`` of one band (``q`` ``uint8`` e4m3fn ``[rows, cols]``, ``scale`` ``[ceil(cols / block)]``).

    The product is one float32 multiplication per element, as torch's ``QuantizedHuggingFaceStorageReader``.
    A ``block`` wider than the band (a config's ``2**40``) repeats its one scale ``cols`` times, no more.
    A product beyond float32 is infinity, and an infinite scale times a zero code NaN, as torch's (the callers
    refuse or report them; numpy's warnings would reach the command line's stderr).
    """
    cols = q.shape[1]
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(E4M3FN_VALUES[q] * np.repeat(scale, min(block, cols))[:cols], dtype=np.float32)


def fp8_block_error(band: np.ndarray, deq: np.ndarray, amax: np.ndarray, block: int) -> tuple[float, float]:
    """``(max |deq - band|, max over blocks of max |deq - band| / amax)`` of one band (zero blocks: 0)."""
    err = np.abs(deq - band)
    worst = _block_max(err, block)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(amax > 0, worst / amax, 0.0)
    return float(worst.max(initial=0.0)), float(rel.max(initial=0.0))


# ---------------------------------------------------------------------------------------------- per-channel FP8


def fp8_channel_quantize(band: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize rows (``[rows, cols]`` float32) to ``float8_e4m3fn`` with one scale per row (output channel).

    compressed-tensors' ``channel`` strategy (llm-compressor ``FP8_DYNAMIC`` weights): per row
    ``scale = amax / 448`` (float32; an all-zero row gets ``scale = 1``), ``q = e4m3fn(w / scale)``
    rounded to nearest even and saturated to ±448 (:func:`f32_to_f8`); ``q * scale`` dequantizes.

    Returns:
        ``(q, scale, amax)``: ``uint8`` ``[rows, cols]`` e4m3fn bytes, float32 ``[rows]`` scales and
        the float32 row amax (NaN when the row holds a NaN: the caller refuses it).
    """
    rows, cols = band.shape
    with np.errstate(invalid="ignore"):
        amax = np.abs(band).max(axis=1).astype(np.float32)
    scale = amax / np.float32(E4M3FN_MAX)
    scale[amax == 0] = np.float32(1.0)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        scaled = np.ascontiguousarray(band / scale[:, None], dtype=np.float32)
    q = np.empty((rows, cols), dtype=np.uint8)
    f32_to_f8(scaled.view(np.uint32).reshape(-1), q.reshape(-1), "float8_e4m3fn")
    return q, scale, amax


def fp8_channel_dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``float32(q) * scale[row]`` (``q`` ``uint8`` e4m3fn ``[rows, cols]``, ``scale`` float32 ``[rows]``), one float32
    multiplication per element as compressed-tensors' ``dequantize`` (beyond float32: infinity; ``inf * 0``: NaN)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(E4M3FN_VALUES[q] * scale[:, None], dtype=np.float32)


def fp8_channel_error(band: np.ndarray, deq: np.ndarray, amax: np.ndarray) -> tuple[float, float]:
    """``(max |deq - band|, max over rows of max |deq - band| / amax)`` (zero rows: 0)."""
    worst = np.abs(deq - band).max(axis=1, initial=0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(amax > 0, worst / amax, 0.0)
    return float(worst.max(initial=0.0)), float(rel.max(initial=0.0))


# ---------------------------------------------------------------------------------------------- reading quantized weights


def e4m3fn_nan_count(raw: np.ndarray) -> int:
    """NaN bytes (``0x7F`` / ``0xFF``: ``float8_e4m3fn`` has no infinity) among raw ``uint8`` e4m3fn bytes."""
    t = _scratch.get("f8_nan", np.uint8, raw.size)
    np.bitwise_and(raw.reshape(-1), 0x7F, out=t)
    return int(np.count_nonzero(t == 0x7F))


def fp8_rows_dequantize(q: np.ndarray, scale: np.ndarray, row0: int, block: tuple[int, int]) -> np.ndarray:
    """Dequantize rows ``[row0, row0 + len(q))`` of a block-FP8 weight: float32 ``q * scale`` per element.

    Args:
        q: ``uint8`` e4m3fn bytes ``[rows, cols]``.
        scale: the whole float32 scale ``[ceil(out / block[0]), ceil(cols / block[1])]``.
        row0: the first row's index in the weight.
        block: ``(block rows, block cols)`` (``quantization_config.weight_block_size``).

    The product is one float32 multiplication of the exact e4m3fn value by the scale, as torch's
    ``QuantizedHuggingFaceStorageReader._dequantize_tensor`` computes it (``weight.to(float32) * scale``).
    """
    rows, cols = q.shape
    out = np.empty((rows, cols), dtype=np.float32)
    r = 0
    while r < rows:
        i = (row0 + r) // block[0]
        n = min(rows - r, (i + 1) * block[0] - row0 - r)
        out[r : r + n] = fp8_block_dequantize(q[r : r + n], scale[i], block[1])
        r += n
    return out


#: The 16 FP4 (E2M1) values of an MXFP4 nibble (OCP Microscaling spec; ``FP4_VALUES`` of transformers'
#: ``integrations/mxfp4.py`` and torch's ``QuantizedHuggingFaceStorageReader``).
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)


def mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 groups to float32: ``[R, B]`` packed ``uint8`` (low nibble first) and ``[R]`` E8M0 exponents -> ``[R, 2B]``.

    Value ``FP4_VALUES[nibble] * 2^(e - 127)`` in float32, as transformers' ``convert_moe_packed_tensors``
    and torch's reader compute it (``torch.ldexp`` of the FP4 value: a float32 product, exact for
    every finite result). Exponent ``0xFF`` gives infinity times the value (the callers refuse it).
    """
    r, b = blocks.shape
    out = np.empty((r, 2 * b), dtype=np.float32)
    out[:, 0::2] = FP4_VALUES[blocks & 0x0F]
    out[:, 1::2] = FP4_VALUES[blocks >> 4]
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127).astype(np.float32)
        np.multiply(out, p.reshape(r, 1), out=out)
    return out
