"""The statistics slab kernel of the byte engine: one accumulator for ``stats`` and ``validate --deep``.

:func:`add_slab` folds one slab of raw IEEE float bytes (bfloat16, float16, float32, float64)
into a :class:`SlabStats`; each caller asks (:class:`Need`) for what it reports, and pays for
nothing else. The kernel starts from the slab's bit patterns, as stored (a bfloat16 slab is
reduced on its 16-bit patterns, half the bytes of its float32 values): the signed and the
unsigned maximum give the largest ``|x|``, whether the slab is all ``±0`` and whether it holds
a NaN/infinity or a negative value; exact counts (non-finite, negative, ``-0.0``) run only when
those reductions find some. On request: zeros (``count_nonzero`` of the patterns), the finite
values' sum and sum of squares (added in float64, :func:`block_sum`; the squares of float32 values
taken in float64, exact: no overflow, underflow or rounding), and for ``D013`` the values beyond a
bound and the subnormals. numpy only, GIL released
inside numpy, per-thread work arrays (:class:`~ckpttool.engine.kernels.Scratch`).
``docs/design.md`` §5, "The byte engine"; ``docs/performance.md``, "ckpttool stats".
"""

from __future__ import annotations

import ctypes
import functools
import math
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckpttool.engine import native
from ckpttool.engine.io import BLOCK_BYTES
from ckpttool.engine.kernels import IEEE_BITS, Scratch

__all__ = [
    "NATIVE_DTYPE",
    "CStats",
    "SUBNORMAL_DTYPES",
    "SUBNORMAL_STRIDE",
    "SUM_BLOCK",
    "Need",
    "SlabStats",
    "add_slab",
    "adam_sizes",
    "block_sum",
    "c_flags",
    "fold_slab",
    "merge_c",
    "moment_ratio",
    "native_stats",
    "release_scratch",
    "sum_squares",
    "use_native",
    "work_array",
]

#: Values per partial sum of :func:`block_sum` (float64 partial sums of float64 and integer arrays).
SUM_BLOCK = 1024

#: dtypes whose subnormals are counted (8 or 11 exponent bits: no weight comes near 1e-38;
#: float16's subnormals, below 6.1e-5, are ordinary small weights).
SUBNORMAL_DTYPES = ("bfloat16", "float32", "float64")

#: Every ``SUBNORMAL_STRIDE``-th value of a slab is tested for subnormals first: odd, so coprime
#: to the 2-, 4- and 8-value periods of heap words read as floats.
SUBNORMAL_STRIDE = 61

_MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23, "float64": 52}
_SIGNED_MIN = {"bfloat16": -(1 << 15), "float16": -(1 << 15), "float32": -(1 << 31), "float64": -(1 << 63)}


class _Scratch:
    """The per-thread work arrays (replaced as a whole by :func:`release_scratch`)."""

    arrays = Scratch(BLOCK_BYTES // 4)


def release_scratch() -> None:
    """Drop every thread's work arrays (pool threads outlive a run; a later run allocates anew)."""
    _Scratch.arrays = Scratch(BLOCK_BYTES // 4)


def work_array(name: str, n: int, dtype: Any) -> np.ndarray:
    """This thread's work array ``name`` (one per dtype: the name should say it), its first ``n`` elements."""
    arr: np.ndarray = _Scratch.arrays.get(name, dtype, n)
    return arr


def block_sum(x: np.ndarray) -> float:
    """``sum(x)`` of a 1-D array in float64: a float32 (or narrower) array widened exactly and added by numpy's
    pairwise float64 sum; float64 and integer arrays in partial sums of :data:`SUM_BLOCK` values
    (``np.einsum``'s vectorised loop, no BLAS: its thread pool would fight the engine's workers), added in
    float64. A float32 sum rounded in float32 would lose ~1e-7 of ``sum |x|``: a mean far from 0 then costs a
    standard deviation much smaller than it all its digits."""
    if x.dtype.kind == "f" and x.dtype.itemsize < 8:
        return float(np.add.reduce(x, dtype=np.float64))
    n = x.size
    k = n - n % SUM_BLOCK
    total = 0.0
    if k:
        part = np.einsum("ij->i", x[:k].reshape(-1, SUM_BLOCK))
        total = float(np.add.reduce(part, dtype=np.float64))
    if k < n:
        total += float(np.add.reduce(x[k:], dtype=np.float64))
    return total


def sum_squares(x: np.ndarray) -> float:
    """``sum(x * x)`` of a 1-D float array in float64 (squares in a per-thread float64 work array, then
    :func:`block_sum`): a float32 value's square is exact in float64 (no overflow beyond ``FLT_MAX``, no
    underflow below ``sqrt(FLT_MIN)`` ~1e-19, where float32 squares made a finite norm inf or 0)."""
    with np.errstate(over="ignore", under="ignore"):  # float64 arrays: squares beyond its range, inf as the values say
        sq = np.multiply(x, x, out=work_array("ss", x.size, np.float64), dtype=np.float64)
    return block_sum(sq)


@dataclass(frozen=True, slots=True)
class Need:
    """What :func:`add_slab` computes beyond the numel, non-finite count, all-zero flag and ``|x|`` maximum.

    Attributes:
        zeros: count the ``±0`` values.
        negative: count the values ``< 0`` (``-0.0`` not counted) and keep the smallest.
        sums: the finite values' sum and sum of squares (and return the values and squares).
        bound: count the finite ``|x| > bound`` and, for :data:`SUBNORMAL_DTYPES`, the subnormals.
    """

    zeros: bool = False
    negative: bool = False
    sums: bool = False
    bound: float | None = None


@dataclass(slots=True)
class SlabStats:
    """Running statistics of one tensor's values, slab by slab (mergeable with :meth:`merge`).

    Attributes:
        numel: values seen; nonfinite: NaN and infinity count; all_zero: every value is ``±0``.
        abs_max: the largest finite ``|x|`` (0.0: none).
        zeros: ``±0`` values (:attr:`Need.zeros`).
        negative: values ``< 0`` and neg_min the smallest (``None``: none) (:attr:`Need.negative`).
        s1, s2: float64 sums of the finite values and of their squares (:attr:`Need.sums`).
        beyond: finite ``|x| > bound``, beyond_max the largest such ``|x|``; subnormal: subnormal
            values (:attr:`Need.bound`).
    """

    numel: int = 0
    nonfinite: int = 0
    all_zero: bool = True
    abs_max: float = 0.0
    zeros: int = 0
    negative: int = 0
    neg_min: float | None = None
    s1: float = 0.0
    s2: float = 0.0
    beyond: int = 0
    beyond_max: float = 0.0
    subnormal: int = 0

    @property
    def finite(self) -> int:
        """Finite values seen."""
        return self.numel - self.nonfinite

    @property
    def mean(self) -> float:
        """The finite values' mean (NaN: none; needs :attr:`Need.sums`)."""
        return self.s1 / self.finite if self.finite else math.nan

    @property
    def std(self) -> float:
        """The finite values' population standard deviation (NaN: none; needs :attr:`Need.sums`)."""
        if not self.finite:
            return math.nan
        m = self.mean
        return math.sqrt(max(self.s2 / self.finite - m * m, 0.0))

    def merge(self, o: SlabStats) -> None:
        """Add another accumulator of the same tensor (other slabs, another chunk)."""
        self.numel += o.numel
        self.nonfinite += o.nonfinite
        self.all_zero = self.all_zero and o.all_zero
        self.abs_max = max(self.abs_max, o.abs_max)
        self.zeros += o.zeros
        self.negative += o.negative
        if o.neg_min is not None:
            self.neg_min = o.neg_min if self.neg_min is None else min(self.neg_min, o.neg_min)
        self.s1 += o.s1
        self.s2 += o.s2
        self.beyond += o.beyond
        self.beyond_max = max(self.beyond_max, o.beyond_max)
        self.subnormal += o.subnormal


@dataclass(frozen=True)
class _Format:
    """What the kernel needs of one IEEE format: its bit views, constants, work-array names and value decoder."""

    signed: np.dtype[Any]
    unsigned: np.dtype[Any]
    exp_all: int  # the all-ones exponent (a magnitude pattern >= it is NaN or infinity)
    sign: int
    signed_min: int  # -0.0's pattern as a signed int
    work: np.dtype[Any]  # the working precision of the sums
    decode: Callable[[bytes], tuple[float]]  # struct unpacking of a magnitude pattern's bytes
    width: int  # bytes of the decoded pattern
    shift: int  # left shift of a pattern before decoding (bfloat16: to float32's)
    overflow: int  # magnitude patterns below it square without overflow in float64


def _format(dtype: str) -> _Format:
    signed, unsigned, exp_all, sign = IEEE_BITS[dtype]
    work = np.dtype(np.float64 if dtype == "float64" else np.float32)
    code, width, shift = {"bfloat16": ("<f", 4, 16), "float16": ("<e", 2, 0), "float32": ("<f", 4, 0)}.get(
        dtype, ("<d", 8, 0)
    )
    # float64: a square above sqrt(DBL_MAX) overflows; a float32 value's square never does (nor underflows)
    overflow = int(np.array(np.sqrt(np.finfo(np.float64).max)).view(np.uint64)) if dtype == "float64" else exp_all
    return _Format(
        np.dtype(signed),
        np.dtype(unsigned),
        exp_all,
        sign,
        -sign,
        work,
        struct.Struct(code).unpack,
        width,
        shift,
        overflow,
    )


_FORMATS = {name: _format(name) for name in IEEE_BITS}


def _values(raw: np.ndarray, dtype: str, slot: int) -> np.ndarray:
    """The slab's values: float32/float64 as stored (a view), bfloat16/float16 widened exactly to float32
    in this thread's work array ``slot``."""
    if dtype == "float32" or dtype == "float64":
        return raw.view(dtype)
    n = raw.size // 2
    wide = work_array(_WIDE[slot], n, np.uint32)
    if dtype == "bfloat16":  # widened in place (a cast, then a shift: faster than one shift with a cast)
        np.copyto(wide, raw.view(np.uint16))
        np.left_shift(wide, 16, out=wide)
        return wide.view(np.float32)
    out = wide.view(np.float32)
    out[...] = raw.view(np.float16)
    return out


_WIDE = tuple(f"w{slot}" for slot in range(10))
_SQUARES = tuple(f"sq{slot}" for slot in range(10))


def _decode(f: _Format, pattern: int) -> float:
    """The value of a magnitude bit pattern (sign clear)."""
    return f.decode((pattern << f.shift).to_bytes(f.width, "little"))[0]


@functools.cache
def _pattern(value: float, dtype: str) -> int:
    """The bit pattern of the largest ``|x| <= value`` of ``dtype`` (bfloat16: float32's, truncated)."""
    if dtype == "bfloat16":
        return int(np.array(value, np.float32).view(np.uint32)) >> 16
    return int(np.array(value, dtype).view(IEEE_BITS[dtype][1]))


def _beyond(acc: SlabStats, bits: np.ndarray, raw: np.ndarray, dtype: str, top: int, bound: float) -> None:
    """Add the slab's counts of finite ``|x| > bound`` and of subnormals to ``acc``.

    ``top`` (the largest magnitude pattern) tells whether any value is beyond the bound: only then
    are they counted exactly. Subnormals are looked for in every :data:`SUBNORMAL_STRIDE`-th value
    (a strided view, ~1.6% of the slab, already in the CPU cache); only a slab whose sample holds
    one is counted exactly. A slab of trained weights has none: the exact passes run on damaged
    slabs only.
    """
    unsigned, exp_all = IEEE_BITS[dtype][1], IEEE_BITS[dtype][2]
    limit = _pattern(bound, dtype)
    if top > limit:
        t = np.left_shift(bits, 1, out=work_array("mag" + unsigned, bits.size, unsigned))
        big = (t > limit << 1) & (t < exp_all << 1)  # finite and beyond the bound
        k = int(np.count_nonzero(big))
        if k:
            acc.beyond += k
            acc.beyond_max = max(acc.beyond_max, float(np.abs(_values(raw, dtype, 9)[big]).max()))
    if dtype in SUBNORMAL_DTYPES:
        lim = (2 << _MANTISSA_BITS[dtype]) - 1  # 2 * (smallest normal pattern) - 1
        sample = np.left_shift(bits[::SUBNORMAL_STRIDE], 1)
        sample -= 1  # +-0 wraps to the top, a subnormal p lands in [1, 2 * min_normal - 3]
        if sample.size and int(sample.min()) < lim:
            t = np.left_shift(bits, 1, out=work_array("mag" + unsigned, bits.size, unsigned))
            np.subtract(t, 1, out=t)
            acc.subnormal += int(np.count_nonzero(t < lim))


def _finite_copy(acc: SlabStats, w: np.ndarray, slot: int) -> np.ndarray:
    """``w`` with its non-finite values set to 0, in a work array; their count added to ``acc``,
    the largest finite ``|x|`` to ``acc.abs_max`` (the rare path: a slab holding a NaN/infinity)."""
    finite = np.isfinite(w)
    acc.nonfinite += w.size - int(np.count_nonzero(finite))
    cleaned = work_array(f"c{slot}{w.dtype.char}", w.size, w.dtype)
    cleaned.fill(0.0)
    np.copyto(cleaned, w, where=finite)
    if cleaned.size:
        acc.abs_max = max(acc.abs_max, float(np.abs(cleaned).max()))
    return cleaned


def _shifted(acc: SlabStats, bits: np.ndarray, f: _Format, negative: bool) -> tuple[int, int]:
    """The magnitude patterns ``bits << 1`` (sign shifted out) in a work array: their maximum is the largest
    magnitude, their non-zero count the non-zeros (``-0.0`` a zero); the unsigned maximum only for
    ``negative`` (else 0). Three passes on 32/64-bit patterns, fewer than :func:`_reduced`'s four.

    Returns:
        ``(largest magnitude pattern, unsigned maximum)``.
    """
    t = np.left_shift(bits, 1, out=_Scratch.arrays.get(f.unsigned.char, f.unsigned, bits.size))
    top = int(t.max()) >> 1
    acc.zeros += bits.size - int(np.count_nonzero(t))
    return top, (int(bits.max()) if negative else 0)


def _reduced(acc: SlabStats, bits: np.ndarray, f: _Format, zeros: bool) -> tuple[int, int]:
    """The signed and unsigned maxima of the patterns (no write): the largest magnitude is the larger of the
    signed maximum and the unsigned one less the sign bit; with ``zeros`` the ``+0.0`` count
    (``count_nonzero``) and the ``-0.0`` count (exactly, only when the signed minimum is ``-0.0``'s pattern).

    Returns:
        ``(largest magnitude pattern, unsigned maximum)``.
    """
    sign = f.sign
    signed = bits.view(f.signed)
    smax = int(signed.max())
    umax = int(bits.max())
    if zeros:
        z = bits.size - int(np.count_nonzero(bits))  # +0.0
        if umax >= sign and int(signed.min()) == f.signed_min:  # -0.0: the smallest signed pattern
            z += int(np.count_nonzero(bits == sign))
        acc.zeros += z
    return max(smax, umax - sign, 0), umax  # positive patterns as they are; negative ones less the sign bit


def _negatives(acc: SlabStats, raw: np.ndarray, dtype: str, slot: int) -> None:
    """Count the slab's values ``< 0`` and keep the smallest (the slab holds a negative pattern)."""
    vals = _values(raw, dtype, slot)
    neg = vals < 0
    k = int(np.count_nonzero(neg))
    if k:
        acc.negative += k
        lo = float(vals[neg].min())
        acc.neg_min = lo if acc.neg_min is None else min(acc.neg_min, lo)


def add_slab(
    acc: SlabStats, raw: np.ndarray, dtype: str, need: Need, slot: int = 0
) -> tuple[np.ndarray, np.ndarray] | None:
    """Fold one slab of raw bytes (``uint8``, whole values of ``dtype``, an :data:`~ckpttool.engine.kernels.IEEE_BITS`
    dtype) into ``acc``.

    Args:
        need: what to compute beyond the numel, non-finite count, all-zero flag and ``|x|`` maximum.
        slot: which work arrays to use (0-8; lockstep slabs of one thread use different slots).

    Returns:
        With ``need.sums``: ``(values, squares)``, the values in the working precision (float32 for
        bfloat16/float16/float32, float64 for float64), the squares in float64 (exact for float32 values),
        non-finite values set to 0 (positions kept), valid until the next call of this thread with the
        same ``slot``; else ``None``.
    """
    f = _FORMATS[dtype]
    bits = raw.view(f.unsigned)
    n = bits.size
    acc.numel += n
    if n == 0:
        return (raw.view(np.float32), raw.view(np.float32)) if need.sums else None
    if need.zeros and f.unsigned.itemsize >= 4:
        top, umax = _shifted(acc, bits, f, need.negative)
    else:
        top, umax = _reduced(acc, bits, f, need.zeros)
    if top:
        acc.all_zero = False
    if need.negative and umax > f.sign:
        _negatives(acc, raw, dtype, slot)
    if need.bound is not None:
        _beyond(acc, bits, raw, dtype, top, need.bound)
    nonfinite = top >= f.exp_all
    w = _values(raw, dtype, slot) if need.sums or nonfinite else raw
    if nonfinite:
        w = _finite_copy(acc, w, slot)
    elif top:
        value = _decode(f, top)
        if value > acc.abs_max:
            acc.abs_max = value
    if not need.sums:
        return None
    acc.s1 += block_sum(w)
    sq = _Scratch.arrays.get(_SQUARES[slot], np.float64, n)
    if top < f.overflow:
        np.multiply(w, w, out=sq, dtype=np.float64)
    else:
        with np.errstate(over="ignore"):  # float64 squares beyond its range: inf in the sum, as the values say
            np.multiply(w, w, out=sq, dtype=np.float64)
    acc.s2 += block_sum(sq)
    return w, sq


# ------------------------------------------------------------------------------------------- native kernels

#: The native kernels' dtype codes (``DT_*`` of ``engine/native/stats.h``).
NATIVE_DTYPE = {"bfloat16": 0, "float16": 1, "float32": 2, "float64": 3}
_NEED_ZEROS, _NEED_NEGATIVE, _NEED_SUMS, _NEED_BOUND, _NEED_SUBNORMAL = 1, 2, 4, 8, 16


class CStats(ctypes.Structure):
    """``ckpt_slab_stats`` of ``engine/native/stats.c``: the native kernel's accumulator."""

    _fields_ = [
        (name, ctypes.c_int64)
        for name in ("numel", "nonfinite", "zeros", "negative", "beyond", "subnormal", "nonzero", "has_neg")
    ] + [(name, ctypes.c_double) for name in ("abs_max", "neg_min", "beyond_max", "s1", "s2")]


class _Native:
    """The native statistics kernels (``engine/native/stats.c``) with their ctypes signatures."""

    def __init__(self) -> None:
        vp, i32, size = ctypes.c_void_p, ctypes.c_int32, ctypes.c_size_t
        self.slab = native.function(
            "ckpt_stats_slab", i32, ctypes.POINTER(CStats), vp, size, i32, i32, ctypes.c_uint64, ctypes.c_uint64
        )
        self.adam = native.function("ckpt_adam_update", i32, vp, i32, vp, i32, size, ctypes.c_double, vp)
        self.ratio = native.function("ckpt_moment_ratio", ctypes.c_double, vp, i32, vp, i32, size)


@functools.cache
def _load() -> _Native | None:
    k = _Native()
    return k if k.slab is not None and k.adam is not None and k.ratio is not None else None


class _Kernels:
    """Which statistics kernels run: ``native`` the compiled ones, ``None`` numpy's (tests switch it)."""

    native: _Native | None | bool = True  # True: load on first use


def _kernels() -> _Native | None:
    if _Kernels.native is True:
        _Kernels.native = _load()
    k = _Kernels.native
    return k if isinstance(k, _Native) else None


def native_stats() -> bool:
    """Whether :func:`fold_slab`, :func:`adam_sizes` and :func:`moment_ratio` run the native kernels."""
    return _kernels() is not None


def use_native(on: bool) -> None:
    """Run the native kernels where built (``True``, the default) or numpy's everywhere (``False``)."""
    _Kernels.native = True if on else None


class _CLocal(threading.local):
    def __init__(self) -> None:
        self.acc = CStats()
        self.out = (ctypes.c_double * 3)()


_c_local = _CLocal()


def c_flags(need: Need, dtype: str) -> tuple[int, int, int]:
    """``(NEED_* flags, the bound's magnitude pattern, the subnormal stride)`` of ``need`` for the native kernels."""
    flags = (_NEED_ZEROS if need.zeros else 0) | (_NEED_NEGATIVE if need.negative else 0)
    flags |= _NEED_SUMS if need.sums else 0
    limit = 0
    if need.bound is not None:
        flags |= _NEED_BOUND | (_NEED_SUBNORMAL if dtype in SUBNORMAL_DTYPES else 0)
        limit = _pattern(need.bound, dtype)
    return flags, limit, SUBNORMAL_STRIDE


def merge_c(acc: SlabStats, c: CStats) -> None:
    """Add a native accumulator (``ckpt_slab_stats``) to ``acc``."""
    acc.numel += c.numel
    acc.nonfinite += c.nonfinite
    acc.all_zero = acc.all_zero and not c.nonzero
    acc.abs_max = max(acc.abs_max, c.abs_max)
    acc.zeros += c.zeros
    if c.has_neg:
        acc.negative += c.negative
        acc.neg_min = c.neg_min if acc.neg_min is None else min(acc.neg_min, c.neg_min)
    acc.s1 += c.s1
    acc.s2 += c.s2
    if c.beyond:
        acc.beyond += c.beyond
        acc.beyond_max = max(acc.beyond_max, c.beyond_max)
    acc.subnormal += c.subnormal


def fold_slab(acc: SlabStats, raw: np.ndarray, dtype: str, need: Need) -> None:
    """:func:`add_slab` without the value arrays: one fused native pass (``engine/native/stats.c``) where
    built and zeros or sums are asked for, else :func:`add_slab`.

    Counts, flags and maxima equal :func:`add_slab`'s exactly. ``s1``/``s2``: each value (float32 for
    bfloat16/float16/float32, float64 for float64) and its square rounded in that precision, as
    :func:`add_slab` has them, but added in float64 (numpy: float32 blocks of :data:`SUM_BLOCK`): the
    two agree to a relative 1e-6 of ``sum |x|`` (``s1``) and of ``s2``.

    Args:
        raw: ``uint8``, whole values of ``dtype`` (an :data:`~ckpttool.engine.kernels.IEEE_BITS` dtype).
    """
    k = _kernels()
    if k is None or not (need.sums or need.zeros):  # bit-pattern maxima alone: numpy's two reductions are as fast
        add_slab(acc, raw, dtype, need)
        return
    flags, limit, stride = c_flags(need, dtype)
    c = _c_local.acc
    ctypes.memset(ctypes.addressof(c), 0, ctypes.sizeof(c))
    n = raw.nbytes // _ITEMSIZE[dtype]
    k.slab(c, raw.ctypes.data, n, NATIVE_DTYPE[dtype], flags, limit, stride)
    merge_c(acc, c)


def adam_sizes(
    m_raw: np.ndarray, m_dtype: str, v_raw: np.ndarray, v_dtype: str, eps_r: float
) -> tuple[int, float, float] | None:
    """The AdamW update sizes ``u = m / (sqrt(max(v, 0)) + eps_r)`` of a slab pair of raw ``exp_avg`` /
    ``exp_avg_sq`` bytes (the same number of values; non-finite ``m``, ``v`` read as 0; non-finite ``u``
    left out), natively: ``(count, sum u^2, max |u|)``, or ``None`` (not built, or working precisions
    that differ: the caller's numpy path). ``u`` in float32 for bfloat16/float16/float32 pairs (``eps_r``
    rounded to float32, as numpy's in-place add does), float64 for float64 pairs, bit for bit numpy's where
    ``m`` and ``v`` are finite (numpy's path leaves an element with a non-finite moment out; ``stats`` reports
    such a parameter's size as ``nan`` either way); ``sum u^2`` in float64, each square too (as numpy's
    :func:`sum_squares`: within a relative 1e-12).
    """
    k = _kernels()
    if k is None or (m_dtype == "float64") != (v_dtype == "float64"):
        return None
    n = m_raw.size // _ITEMSIZE[m_dtype]
    out = _c_local.out
    k.adam(m_raw.ctypes.data, NATIVE_DTYPE[m_dtype], v_raw.ctypes.data, NATIVE_DTYPE[v_dtype], n, eps_r, out)
    return int(out[0]), out[1], out[2]


def moment_ratio(m_raw: np.ndarray, m_dtype: str, v_raw: np.ndarray, v_dtype: str) -> float | None:
    """``max m * m / v`` over a slab pair of raw moments (NaN ignored; ``-inf`` when none), natively, as
    numpy computes it on :func:`~ckpttool.engine.kernels.float_values` (the square in ``m``'s precision,
    the quotient in the wider one): bit for bit. ``None``: not built, or a float16 member (numpy squares
    those in float16)."""
    k = _kernels()
    if k is None or m_dtype == "float16" or v_dtype == "float16":
        return None
    n = m_raw.size // _ITEMSIZE[m_dtype]
    return float(k.ratio(m_raw.ctypes.data, NATIVE_DTYPE[m_dtype], v_raw.ctypes.data, NATIVE_DTYPE[v_dtype], n))


_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
