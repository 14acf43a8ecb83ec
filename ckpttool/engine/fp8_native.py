"""FP8 quantization of bands of rows with the native kernel (``engine/native/fp8.c``), checked as it goes.

:func:`quantize_band` computes, for one band of rows, what :func:`~ckpttool.engine.kernels.fp8_block_quantize`
(or ``fp8_channel_quantize``), the dequantization and ``fp8_block_error`` (``fp8_channel_error``)
compute in numpy, bit for bit, in one C call: per 128-column block (or row) one read for the amax,
then one cache-resident pass that divides by the scale, rounds to ``float8_e4m3fn``, writes the
bytes and measures ``| |q| * scale - |w| |``. ctypes releases the GIL, so the engine's workers
quantize several bands at once; torch is not imported. Where the extension is not built (or
``CKPTTOOL_NATIVE=0``), :func:`available` is false and the caller uses the torch kernel
(:mod:`ckpttool.engine.fp8`), which gives the same bytes.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from ckpttool.engine import native
from ckpttool.engine.kernels import Scratch

__all__ = ["BandResult", "BandsResult", "available", "quantize_band", "quantize_bands"]


@dataclass(frozen=True)
class BandResult:
    """One quantized band (the arrays are this thread's scratch: valid until its next ``quantize_band``).

    Attributes:
        q: ``uint8`` ``[rows, cols]`` e4m3fn bytes.
        scale: float32 scales, ``[ceil(cols / block)]`` per block or ``[rows]`` per channel
            (``amax / 448``; ``1`` for an all-zero block / row).
        amax: float32 ``max |w|`` per block / row (NaN where it holds a NaN).
        worst: ``max |q * scale - w|`` over the band.
        rel: the largest ``max |q * scale - w| / amax`` of a block / row (0 for zero ones).
    """

    q: np.ndarray
    scale: np.ndarray
    amax: np.ndarray
    worst: float
    rel: float


@dataclass(frozen=True)
class BandsResult:
    """Consecutive quantized bands (:func:`quantize_bands`; this thread's scratch, valid until its next call).

    Attributes:
        q: ``uint8`` ``[rows, cols]`` e4m3fn bytes.
        scale: float32 scales, band after band: ``ceil(cols / block)`` per band, or one per row.
        amax: float32 ``max |w|`` per block / row, as ``scale``.
        worst: float64 ``[bands]``: each band's ``max |q * scale - w|``.
        rel: float64 ``[bands]``: each band's largest ``max |q * scale - w| / amax`` of a block / row.
    """

    q: np.ndarray
    scale: np.ndarray
    amax: np.ndarray
    worst: np.ndarray
    rel: np.ndarray


_scratch = Scratch(min_items=1)


@cache
def _kernel() -> Any:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    return native.function("ckpt_fp8_bands", None, p, ctypes.c_int32, i64, i64, i64, i64, p, p, p, p)


def available() -> bool:
    """Whether the native kernel is built and turned on (``CKPTTOOL_NATIVE`` not ``0``)."""
    return _kernel() is not None


def quantize_band(
    band: np.ndarray, block: int | None, q: np.ndarray | None = None, scale: np.ndarray | None = None
) -> BandResult:
    """Quantize one band (``[rows, cols]``) to ``float8_e4m3fn`` and measure its error, with the native kernel.

    Args:
        band: the source rows (read only): float32, float16, or ``uint16`` bfloat16 bit patterns
            (float16 is widened to float32 first, exactly).
        block: ``B`` of ``B x B`` blocks (the band holds at most ``B`` rows: one scale per column
            block, DeepSeek-V3 ``weight_scale_inv``); ``None``: one scale per row (compressed-tensors
            ``channel``).

    Returns:
        :class:`BandResult`, bitwise equal to the numpy kernels' (``docs/export.md``, "Quantized export").

    Raises:
        RuntimeError: the native kernel is not available (check :func:`available` first).
    """
    r = quantize_bands(band, block, max(1, band.shape[0]), q, scale)
    return BandResult(r.q, r.scale, r.amax, float(r.worst[0]), float(r.rel[0]))


def quantize_bands(
    rows: np.ndarray, block: int | None, band_rows: int, q: np.ndarray | None = None, scale: np.ndarray | None = None
) -> BandsResult:
    """Quantize ``rows`` (``[n, cols]``) as bands of ``band_rows`` rows (the last may be shorter), in one native call.

    Each band is what :func:`quantize_band` of it gives, bit for bit: one call per run of bands saves the
    per-call Python work of a band.

    Args:
        rows: the source rows (read only): float32, float16 (widened to float32 first, exactly), or
            ``uint16`` bfloat16 bit patterns.
        block: ``B`` (``band_rows <= B``) or ``None`` (one scale per row), as for :func:`quantize_band`.
        band_rows: rows per band (> 0).
        q, scale: where to write the bytes (``uint8``, ``n * cols``) and the scales (float32, ``bands *
            ceil(cols / B)`` or ``n``), C-contiguous; default: this thread's scratch.

    Returns:
        :class:`BandsResult`.

    Raises:
        RuntimeError: the native kernel is not available (check :func:`available` first).
        ValueError: ``q`` or ``scale`` has the wrong dtype, size or layout.
    """
    fn = _kernel()
    if fn is None:
        raise RuntimeError("the native FP8 kernel is not built or is turned off (CKPTTOOL_NATIVE=0)")
    n, cols = rows.shape
    if rows.dtype == np.float16:  # widened exactly
        wide = _scratch.get("wide", np.float32, rows.size).reshape(n, cols)
        np.copyto(wide, rows)
        rows = wide
    elif rows.dtype not in (np.float32, np.uint16):
        raise TypeError(f"band of {rows.dtype}: float32, float16 or uint16 (bfloat16 bits)")
    rows = np.ascontiguousarray(rows)
    bands = -(-n // band_rows)
    per = n if block is None else bands * -(-cols // block)
    q = _scratch.get("q", np.uint8, n * cols) if q is None else _out(q, np.uint8, n * cols)
    q = q.reshape(n, cols)
    scale = _scratch.get("scale", np.float32, per) if scale is None else _out(scale, np.float32, per)
    amax = _scratch.get("amax", np.float32, per)
    fig = _scratch.get("figures", np.float64, 2 * bands).reshape(-1, 2)
    out = (q.ctypes.data, scale.ctypes.data, amax.ctypes.data, fig.ctypes.data)
    fn(rows.ctypes.data, int(rows.dtype == np.uint16), n, cols, block or 0, band_rows, *out)
    return BandsResult(q, scale, amax, fig[:, 0], fig[:, 1])


def _out(a: np.ndarray, dtype: Any, n: int) -> np.ndarray:
    """``a`` as ``n`` elements of ``dtype`` the kernel may write; raises ValueError for any other array."""
    if a.dtype != dtype or a.size != n or not a.flags.c_contiguous or not a.flags.writeable:
        raise ValueError(f"output of {a.dtype} x {a.size}: the kernel writes {n} C-contiguous {np.dtype(dtype)}")
    return a.reshape(-1)
