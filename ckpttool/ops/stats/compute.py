"""Streaming value statistics over a checkpoint's chunks (bounded memory, chunks in parallel).

A chunk is read slice by slice (at most :data:`~ckpttool.engine.io.BLOCK_BYTES` of values at a
time) through the chunk locator: plain C-order records with the engine's read helper (the
record's CRC-32 checked as the bytes pass), every other record (deflated, strided, big-endian)
through :meth:`~ckpttool.format.reader.CheckpointReader.read_chunk`. Each slice goes through the
engine's statistics kernel (:func:`~ckpttool.engine.stats.add_slab`, the one ``validate --deep``
uses): bit-pattern reductions on the stored bytes, the values' sums in their working precision
(float32 for BF16/FP16/FP32 values, float64 for FP64 and integers) in blocks added in float64
(relative error ~1e-7); NaN/inf are counted and left out. Two chunks of the
same geometry can be read in lockstep (AdamW moments for the update size, the same tensor of two
checkpoints for their difference). Performance: docs/performance.md, "ckpttool stats".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ckpttool.engine.crc import crc32
from ckpttool.engine.execute import release_lockstep_buffers, run_item, run_lockstep
from ckpttool.engine.io import BLOCK_BYTES, ShortReadError, read_into
from ckpttool.engine.kernels import FP4_VALUES, IEEE_BITS, float_values
from ckpttool.engine.plan import Crc32, Item, Lockstep, PairKernel, Scan, Stats, Window
from ckpttool.engine.scan import ScanResult, run_scan
from ckpttool.engine.stats import (
    Need,
    SlabStats,
    adam_sizes,
    add_slab,
    block_sum,
    fold_slab,
    native_stats,
    release_scratch,
    sum_squares,
    work_array,
)
from ckpttool.errors import ChunkError
from ckpttool.format.metadata import DTYPE_ITEMSIZE, ChunkMeta

if TYPE_CHECKING:
    from ckpttool.format.reader import CheckpointReader

__all__ = [
    "AdamHyper",
    "Moments",
    "SLICE_VALUES",
    "TINY_ABS_MAX",
    "ValueSums",
    "adam_update",
    "add_moments",
    "block_sum",
    "centered_squares",
    "chunk_slices",
    "chunk_sums",
    "exact_update",
    "expert_nonfinite",
    "expert_sums",
    "pair_slabs",
    "read_pair",
    "release_buffers",
    "ScaledSquares",
    "scaled_expert_squares",
    "scaled_sums",
    "sum_squares",
    "tensor_values",
]

#: Values per slice: one engine block of float64 working values.
SLICE_VALUES = BLOCK_BYTES // 8

#: What ``stats`` asks of the engine's statistics kernel (:func:`~ckpttool.engine.stats.add_slab`); the
#: negative count tells :func:`adam_update` whether a second moment needs its clamp.
_STATS = Need(zeros=True, sums=True)
_SECOND_MOMENT = Need(zeros=True, sums=True, negative=True)

#: A slice: raw bytes (``uint8``, whole values) and their dtype name (an ``IEEE_BITS`` dtype).
Slice = tuple[np.ndarray, str]


@dataclass
class ValueSums:
    """Float64 running sums of one tensor's values (mergeable): the engine's :class:`~ckpttool.engine.stats.SlabStats`
    (``acc``: counts, sums, mean and standard deviation) with the per-expert sums of squares."""

    acc: SlabStats = field(default_factory=SlabStats)
    experts: dict[int, float] = field(default_factory=dict)

    def add_raw(self, raw: np.ndarray, dtype: str, slot: int = 0, *, second_moment: bool = False) -> tuple[Any, Any]:
        """Add a slice of raw bytes of ``dtype`` (:func:`~ckpttool.engine.stats.add_slab`); ``second_moment``:
        also count its negative values (``exp_avg_sq``: whether :func:`adam_update` must clamp).

        Returns:
            ``(values, squares)``: the slice in its working precision (float32 for BF16/FP16/FP32,
            float64 for FP64) with non-finite values set to 0 (positions kept), valid until the
            next call on this thread with the same ``slot``.
        """
        out = add_slab(self.acc, raw, dtype, _SECOND_MOMENT if second_moment else _STATS, slot)
        assert out is not None
        return out

    def add_slice(self, x: np.ndarray, slot: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`add_raw` of a slice of float values (float16, float32 or float64; others as float64)."""
        if x.dtype.name not in IEEE_BITS:
            x = x.astype(np.float64)
        return self.add_raw(np.ascontiguousarray(x).view(np.uint8), x.dtype.name, slot)

    def merge(self, o: ValueSums) -> None:
        self.acc.merge(o.acc)
        for e, v in o.experts.items():
            self.experts[e] = self.experts.get(e, 0.0) + v


@dataclass
class Moments:
    """Running sums of an AdamW update size ``u`` (``numel``, ``sum u^2``, ``max u``)."""

    numel: int = 0
    s2: float = 0.0
    max: float = 0.0

    def merge(self, o: Moments) -> None:
        self.numel += o.numel
        self.s2 += o.s2
        self.max = max(self.max, o.max)


def release_buffers() -> None:
    """Drop every thread's slice and work buffers (pool threads outlive a run)."""
    release_scratch()
    release_lockstep_buffers()


def chunk_slices(
    reader: CheckpointReader, key: str, chunk: ChunkMeta, *, slot: int = 0, parts: bool = False
) -> Iterator[Slice]:
    """The values of one chunk of ``key`` in C order, slices of :data:`SLICE_VALUES` elements as
    ``(raw bytes, dtype)`` (valid until the next slice of this ``slot``): plain records as stored,
    the others (read by torch) as float32 (floats of 4 bytes or less) or float64. A complex chunk
    gives its moduli ``|z|``, or with ``parts`` its real and imaginary parts interleaved (two values
    each: what a difference of two chunks needs, a phase change included).

    Raises:
        ChunkError / ChecksumError / DataFileError: the chunk's record is damaged or does not
            match the metadata (as every reader of the chunk would report it).
    """
    loc = reader.locate(key, chunk)
    dtype = loc.meta.dtype.name
    n = chunk.numel
    if loc.raw and dtype in IEEE_BITS:
        item = DTYPE_ITEMSIZE[dtype]
        fd = reader.fd(loc.info.relative_path)
        buf = work_array(f"raw{slot}", min(n, SLICE_VALUES) * item, np.uint8)  # one per chunk: no lookup per slice
        crc = 0
        for e0 in range(0, n, SLICE_VALUES):
            m = min(SLICE_VALUES, n - e0)
            raw = buf[: m * item]
            try:
                read_into(fd, raw, loc.data_start + e0 * item)
            except ShortReadError:
                raise ChunkError(f"{loc.where}: short read", path=loc.info.relative_path, fqn=key) from None
            crc = crc32(raw, crc)
            reader.count_read(m * item)
            yield raw, dtype
        loc.check_crc(crc)
        return
    t = reader.read_chunk(key, chunk).reshape(-1)
    import torch

    if t.dtype == torch.float4_e2m1fn_x2:  # two E2M1 values per byte, which torch converts to nothing
        b, lut = t.view(torch.uint8).long(), torch.from_numpy(FP4_VALUES)
        t, n = torch.stack((lut[b & 15], lut[b >> 4]), 1).reshape(-1), 2 * n
    elif t.is_complex() and parts:  # a difference: both parts (its L2 is the complex one)
        t, n = torch.view_as_real(t).reshape(-1), 2 * n
    elif t.is_complex():  # RoPE's freqs_cis: the moduli (norm and abs max exact; a cast drops the imaginary part)
        t = t.abs()
    work = torch.float32 if t.is_floating_point() and t.element_size() <= 4 else torch.float64
    name = "float32" if work == torch.float32 else "float64"
    for e0 in range(0, n, SLICE_VALUES):
        yield t[e0 : e0 + SLICE_VALUES].to(work).contiguous().numpy().view(np.uint8), name


def chunk_sums(
    reader: CheckpointReader, key: str, chunk: ChunkMeta, each: Callable[[Any, Any, int], object] | None = None
) -> ValueSums:
    """The statistics of one chunk of ``key``: a plain record through the engine's executor (one
    :class:`~ckpttool.engine.plan.Item` with a ``Crc32`` and a ``Stats`` sink, slabs of
    :data:`SLICE_VALUES` values), any other through :func:`chunk_slices`. ``each(values, squares,
    first)`` after each slab (``first``: its first element's index in the chunk).

    Raises:
        as :func:`chunk_slices`.
    """
    sums = ValueSums()
    if each is None and native_stats():
        scanned = _scan(((reader, key, chunk),), (_STATS,))
        if scanned is not None:
            assert scanned.stats[0] is not None
            sums.acc = scanned.stats[0]
            return sums
    loc = reader.locate(key, chunk)
    dtype = loc.meta.dtype.name
    if loc.raw and dtype in IEEE_BITS:
        length = chunk.numel * DTYPE_ITEMSIZE[dtype]
        fd = reader.fd(loc.info.relative_path)
        item = Item.of(fd, loc.data_start, length, Crc32(), Stats(dtype, _STATS, SLICE_VALUES, each))
        try:
            crc, sums.acc = run_item(item)
        except ShortReadError:
            raise ChunkError(f"{loc.where}: short read", path=loc.info.relative_path, fqn=key) from None
        reader.count_read(length)
        loc.check_crc(crc)
        return sums
    first = 0
    for raw, dt in chunk_slices(reader, key, chunk):
        values, squares = sums.add_raw(raw, dt)
        if each is not None:
            each(values, squares, first)
        first += values.size
    return sums


def centered_squares(reader: CheckpointReader, key: str, chunks: tuple[ChunkMeta, ...], mean: float) -> float:
    """``sum((x - mean)^2)`` over the finite values of ``key``'s ``chunks``, in float64, read again slice by
    slice (:func:`chunk_slices`): the spread of values far larger than it, which ``sum x^2 / n - mean^2`` loses
    to rounding (float64 keeps ~16 digits of ``mean^2``: a spread 1e-7 of the mean, 1e-14 of its square, is
    gone, and an FP32 LayerNorm weight of 1.0 +- 1 ulp reads as std 0).

    Raises:
        as :func:`chunk_slices`.
    """
    total = 0.0
    for chunk in chunks:
        for raw, dt in chunk_slices(reader, key, chunk):
            x = float_values(raw, dt)
            d = x[np.isfinite(x)].astype(np.float64) - mean
            total += sum_squares(d)
    return total


def scaled_sums(
    reader: CheckpointReader, key: str, chunks: tuple[ChunkMeta, ...], scale: float, mean: float | None = None
) -> tuple[float, float]:
    """``(sum y, sum y^2)`` of ``y = x / scale`` (``y = (x - mean) / scale`` with ``mean``) over the finite values
    of ``key``'s ``chunks``, in float64, read again slice by slice (:func:`chunk_slices`): the sums of float64
    values whose own sums overflow (``|x|`` beyond ~1e154 squared is beyond float64's 1.8e308) or underflow (below
    :data:`TINY_ABS_MAX`), with ``scale`` their largest ``|x|``.

    Raises:
        as :func:`chunk_slices`.
    """
    s1 = s2 = 0.0
    for chunk in chunks:
        for raw, dt in chunk_slices(reader, key, chunk):
            x = float_values(raw, dt)
            y = x[np.isfinite(x)].astype(np.float64) / scale
            if mean is not None:
                y -= mean / scale
            s1 += float(y.sum())
            s2 += sum_squares(y)
    return s1, s2


#: A float64 tensor whose largest ``|x|`` is below this (2^-460, ~1e-138) has squares near or below float64's
#: smallest normal (2.2e-308): they lose digits or underflow to 0 (an L2 of 1e-200 values read 0), so its sums are
#: taken of the values divided by their largest ``|x|``, as those of values whose squares overflow.
TINY_ABS_MAX = 2.0**-460

#: The sum of squares of values below :data:`TINY_ABS_MAX`.
_TINY_SQUARES = TINY_ABS_MAX * TINY_ABS_MAX


@dataclass
class ScaledSquares:
    """A float64 ``sum x^2`` kept as ``scale^2 * total`` (mergeable): values whose squares overflow float64 (beyond
    ~1e154) or underflow (float64 values below :data:`TINY_ABS_MAX`) are added divided by their largest ``|x|``;
    otherwise ``scale`` stays 1 and ``total`` is the plain sum."""

    scale: float = 1.0
    total: float = 0.0

    def add(self, total: float, scale: float = 1.0) -> None:
        """Add ``scale^2 * total`` (a sum of no term, or of zeros, leaves the scale as it is)."""
        if total == 0.0:
            return
        if self.total == 0.0:  # nothing yet: a scale below 1 (tiny values) is kept, not multiplied into 0
            self.total, self.scale = total, scale
            return
        big = max(self.scale, scale)
        self.total = self.total * (self.scale / big) ** 2 + total * (scale / big) ** 2
        self.scale = big

    def add_difference(self, x: np.ndarray, y: np.ndarray) -> None:
        """Add ``sum (y - x)^2`` of finite float values (float32 values: each difference taken in float64, exact; in
        float32 it was rounded where the two differ by more than a factor 2)."""
        wide = x.dtype == np.float64 or y.dtype == np.float64
        with np.errstate(over="ignore"):  # float64 values near its range: a difference beyond it, inf
            d = y - x if wide else np.subtract(y, x, out=work_array("diff", x.size, np.float64), dtype=np.float64)
            d2 = sum_squares(d)
        if math.isfinite(d2) and (d2 >= _TINY_SQUARES or not wide):
            self.add(d2)
            return
        if math.isfinite(d2):  # float64 differences whose squares underflow
            self._add_scaled(d)
            return
        m = max(float(np.abs(x).max(initial=0.0)), float(np.abs(y).max(initial=0.0)))
        self.add(sum_squares(y / m - x / m), m)

    def add_values(self, x: np.ndarray, squares: float) -> None:
        """Add ``sum x^2`` of finite float values, ``squares`` as summed already (``inf`` where it overflowed, near
        0 where float64 squares underflowed)."""
        if math.isfinite(squares) and (squares >= _TINY_SQUARES or x.dtype.itemsize < 8):
            self.add(squares)
            return
        self._add_scaled(x)

    def _add_scaled(self, x: np.ndarray) -> None:
        """Add ``sum x^2`` taken of ``x`` divided by its largest ``|x|`` (nothing for all zeros)."""
        m = float(np.abs(x).max(initial=0.0))
        if m > 0.0:
            self.add(sum_squares(x / m), m)

    def merge(self, o: ScaledSquares) -> None:
        self.add(o.total, o.scale)

    def norm(self) -> float:
        """``sqrt(sum x^2)`` (NaN where a NaN was added)."""
        return math.sqrt(self.total) * self.scale


def scaled_expert_squares(
    reader: CheckpointReader, key: str, chunks: tuple[ChunkMeta, ...], dim: int, scale: float
) -> dict[int, float]:
    """Per-expert ``sum y^2`` of ``y = x / scale`` over the finite values of ``key``'s ``chunks`` (experts on
    ``dim``), read again slice by slice: the per-expert norms of float64 values whose squares overflow or underflow, with
    ``scale`` their largest ``|x|`` (:func:`scaled_sums`).

    Raises:
        as :func:`chunk_slices`.
    """
    experts: dict[int, float] = {}
    for chunk in chunks:
        inner, e0 = math.prod(chunk.sizes[dim + 1 :]), 0
        for raw, dt in chunk_slices(reader, key, chunk):
            y = float_values(raw, dt).astype(np.float64) / scale
            y[~np.isfinite(y)] = 0.0
            expert_sums(experts, y * y, e0, inner, chunk.offsets[dim])
            e0 += y.size
    return experts


def expert_nonfinite(reader: CheckpointReader, key: str, chunks: tuple[ChunkMeta, ...], dim: int) -> set[int]:
    """The experts (on ``dim``) of ``key``'s ``chunks`` whose every value is NaN or infinite, read again slice by slice.

    Raises:
        as :func:`chunk_slices`.
    """
    counts: dict[int, float] = {}
    sizes: dict[int, int] = {}
    for chunk in chunks:
        inner, e0 = math.prod(chunk.sizes[dim + 1 :]), 0
        for e in range(chunk.offsets[dim], chunk.offsets[dim] + chunk.sizes[dim]):
            sizes[e] = sizes.get(e, 0) + chunk.numel // max(chunk.sizes[dim], 1)
        for raw, dt in chunk_slices(reader, key, chunk):
            bad = ~np.isfinite(float_values(raw, dt))
            expert_sums(counts, bad.astype(np.float64), e0, inner, chunk.offsets[dim])
            e0 += bad.size
    return {e for e, n in counts.items() if n and n == sizes.get(e)}


def expert_sums(experts: dict[int, float], sq: np.ndarray, e0: int, inner: int, first_expert: int) -> None:
    """Add the squares ``sq`` of a slice starting at chunk element ``e0`` to the per-expert sums ``experts``
    (``inner`` elements per expert in the chunk, the chunk's first expert ``first_expert``)."""
    if inner <= 0 or sq.size == 0:
        return
    first_cut = (-e0) % inner
    cuts = [0] + list(range(first_cut or inner, sq.size, inner))
    seg = np.add.reduceat(sq, cuts)
    for c, v in zip(cuts, seg.tolist()):
        e = first_expert + (e0 + c) // inner
        experts[e] = experts.get(e, 0.0) + v


@dataclass(frozen=True)
class AdamHyper:
    """What the update size needs: ``lr``, ``beta1``, ``beta2``, ``eps`` and the saved ``step``."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    step: float


def adam_update(m: np.ndarray, v: np.ndarray, h: AdamHyper, acc: Moments, v_negative: bool | None = None) -> None:
    """Add the slice's update sizes ``lr * |m_hat| / (sqrt(v_hat) + eps)`` to ``acc`` (in ``m``'s and ``v``'s precision;
    elements whose size is not finite, e.g. ``eps == 0`` with ``v == 0``, are left out).

    Computed as ``c * m / (sqrt(v) + eps * sqrt(bc2))`` with ``c = lr * sqrt(bc2) / bc1`` (the same
    value, four passes: sqrt, add, divide, and the squares of :func:`sum_squares`; ``c`` applied to
    the maximum and the sum); negative ``v`` (a damaged moment) counts as 0. ``v_negative``: whether
    ``v`` holds a negative value, when the caller knows (the statistics kernel's negative count:
    no pass over ``v`` here), else ``None``.
    """
    wide = np.result_type(m.dtype, v.dtype)
    n = m.size
    if n == 0:
        return
    d = work_array("d" + wide.char, n, wide)
    src = v
    if v_negative or (v_negative is None and float(v.min()) < 0):
        src = np.maximum(v, 0.0, out=d)
    np.sqrt(src, out=d)
    r, c = _adam_scale(h)
    d += h.eps * r
    u = work_array("u" + wide.char, n, wide)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        np.divide(m, d, out=u)
    hi, lo = float(u.max()), float(u.min())
    if not (math.isfinite(hi) and math.isfinite(lo)):
        u = u[np.isfinite(u)]
        hi, lo = (float(u.max()), float(u.min())) if u.size else (0.0, 0.0)
    acc.numel += u.size
    acc.s2 += sum_squares(u) * c * c
    acc.max = max(acc.max, max(hi, -lo) * c)


def exact_update(pairs: Iterable[tuple[Slice, Slice]], h: AdamHyper) -> Moments:
    """The update sizes of a parameter whose moments hold NaN or infinity, element by element as torch's step
    computes ``lr * |m_hat| / (sqrt(v_hat) + eps)`` (IEEE: a finite ``m`` over an ``exp_avg_sq`` overflowed to
    ``+inf`` is an update of 0; NaN or an infinite ``m`` makes it ``nan`` or ``inf``), from the slab pairs
    ``pairs`` of raw ``exp_avg`` / ``exp_avg_sq`` bytes (:func:`read_pair`): as :func:`adam_update`'s figures
    (float32 for BF16/FP16/FP32 moments, float64 for FP64; squares summed in float64), with ``s2`` and ``max``
    ``nan`` where any element's size is NaN and ``inf`` where one is infinite.
    """
    acc = Moments()
    r, c = _adam_scale(h)
    for (m_raw, m_dtype), (v_raw, v_dtype) in pairs:
        wide = np.float64 if "float64" in (m_dtype, v_dtype) else np.float32
        m = float_values(m_raw, m_dtype).astype(wide)
        v = float_values(v_raw, v_dtype).astype(wide)
        if m.size == 0:
            continue
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            u = np.abs(m) / (np.sqrt(v) + wide(h.eps * r))
        if np.isnan(u).any():
            return Moments(acc.numel + m.size, math.nan, math.nan)
        acc.numel += u.size
        acc.s2 += float(np.square(u, dtype=np.float64).sum()) * c * c
        acc.max = max(acc.max, float(u.max()) * c)
    return acc


def _adam_scale(h: AdamHyper) -> tuple[float, float]:
    """``(sqrt(bc2), lr * sqrt(bc2) / bc1)`` of the bias corrections ``bc = 1 - beta**step`` (1 at step 0)."""
    bc1 = 1.0 - h.beta1**h.step if h.step > 0 else 1.0
    bc2 = 1.0 - h.beta2**h.step if h.step > 0 else 1.0
    r = math.sqrt(bc2)
    return r, h.lr * r / bc1


def add_moments(m: ValueSums, v: ValueSums, h: AdamHyper | None, upd: Moments, m_slab: Slice, v_slab: Slice) -> None:
    """Fold a slab pair of ``exp_avg`` / ``exp_avg_sq`` raw bytes into their statistics and (``h``) the
    update sizes ``upd`` (:func:`adam_update`'s formula): with the native kernels (one pass per slab and
    one over the pair, no value arrays) where built and the two share a working precision, else numpy's.
    """
    (m_raw, m_dtype), (v_raw, v_dtype) = m_slab, v_slab
    if native_stats() and (m_dtype == "float64") == (v_dtype == "float64"):
        fold_slab(m.acc, m_raw, m_dtype, _STATS)
        fold_slab(v.acc, v_raw, v_dtype, _SECOND_MOMENT)
        if h is not None:
            r, c = _adam_scale(h)
            sizes = adam_sizes(m_raw, m_dtype, v_raw, v_dtype, h.eps * r)
            assert sizes is not None
            upd.numel += sizes[0]
            upd.s2 += sizes[1] * c * c
            upd.max = max(upd.max, sizes[2] * c)
        return
    m64, _ = m.add_raw(m_raw, m_dtype, slot=0)
    negative = v.acc.negative
    v64, _ = v.add_raw(v_raw, v_dtype, slot=1, second_moment=True)
    if h is not None:
        adam_update(m64, v64, h, upd, v_negative=v.acc.negative > negative)


def read_pair(
    a: tuple[CheckpointReader, str, ChunkMeta], b: tuple[CheckpointReader, str, ChunkMeta]
) -> Iterator[tuple[Slice, Slice]]:
    """Slices of two chunks of the same geometry (``(reader, key, chunk)`` each), in lockstep (complex
    ones as their real and imaginary parts)."""
    yield from zip(chunk_slices(*a, slot=0, parts=True), chunk_slices(*b, slot=1, parts=True))


Member = tuple["CheckpointReader", str, ChunkMeta]


def _streams(members: tuple[Member, ...]) -> tuple[list[Any], list[str], tuple[tuple[Window, ...], ...]] | None:
    """The members' locations, dtypes and engine streams; ``None`` unless every one is a plain IEEE float record."""
    locs = [r.locate(k, c) for r, k, c in members]
    dtypes = [loc.meta.dtype.name for loc in locs]
    if not all(loc.raw and d in IEEE_BITS for loc, d in zip(locs, dtypes)):
        return None
    streams = tuple(
        (Window(m[0].fd(loc.info.relative_path), loc.data_start, m[2].numel * DTYPE_ITEMSIZE[d]),)
        for m, loc, d in zip(members, locs, dtypes)
    )
    return locs, dtypes, streams


def _checked(members: tuple[Member, ...], locs: list[Any], dtypes: list[str], crcs: tuple[int | None, ...]) -> None:
    """Count the members' bytes read and check their records' CRC-32s."""
    for m, loc, d, crc in zip(members, locs, dtypes, crcs):
        m[0].count_read(m[2].numel * DTYPE_ITEMSIZE[d])
        loc.check_crc(crc)


def _scan(
    members: tuple[Member, ...], folds: tuple[Need, ...], pairs: tuple[PairKernel, ...] = ()
) -> ScanResult | None:
    """The members' statistics (and ``pairs``) from one native scan of :data:`SLICE_VALUES`-value slabs
    (:func:`~ckpttool.engine.scan.run_scan`), CRC-32s checked; ``None`` where it does not run (the
    kernels not built, a member that is not a plain IEEE float record).

    Raises:
        as :func:`chunk_slices`.
    """
    located = _streams(members)
    if located is None:
        return None
    locs, dtypes, streams = located
    items = tuple(DTYPE_ITEMSIZE[d] for d in dtypes)
    scan = Scan(tuple(dtypes), folds, pairs, crcs=tuple(loc.has_crc for loc in locs))
    ls = Lockstep(streams, items, lambda s, _: None, SLICE_VALUES, scan)
    try:
        res = run_scan(ls)
    except ShortReadError:
        loc = locs[0]
        raise ChunkError(f"{loc.where}: short read", path=loc.info.relative_path, fqn=members[0][1]) from None
    if res is not None:
        _checked(members, locs, dtypes, res.crcs)
    return res


def moment_sums(m: Member, v: Member, h: AdamHyper | None) -> tuple[ValueSums, ValueSums, Moments]:
    """The statistics of an ``exp_avg`` / ``exp_avg_sq`` chunk pair of the same geometry and (``h``) the
    update sizes (:func:`adam_update`'s formula): one native scan where it runs, else :func:`add_moments`
    slab by slab.

    Raises:
        as :func:`chunk_slices`.
    """
    sums, second, upd = ValueSums(), ValueSums(), Moments()
    r, c = _adam_scale(h) if h is not None else (1.0, 0.0)
    pairs = (PairKernel("adam", 0, 1, h.eps * r),) if h is not None else ()
    scanned = None
    wide = [r.metadata.entries[k].dtype.name == "float64" for r, k, _ in (m, v)]  # type: ignore[union-attr]
    if wide[0] == wide[1] and native_stats():  # as add_moments: one working precision
        scanned = _scan((m, v), (_STATS, _SECOND_MOMENT), pairs)
    if scanned is None:
        pair_slabs(m, v, lambda m_slab, v_slab: add_moments(sums, second, h, upd, m_slab, v_slab))
        return sums, second, upd
    assert scanned.stats[0] is not None and scanned.stats[1] is not None
    sums.acc, second.acc = scanned.stats[0], scanned.stats[1]
    if pairs:
        p = scanned.pairs[0]
        upd.numel, upd.s2, upd.max = p.count, p.s2 * c * c, max(0.0, p.top * c)
    return sums, second, upd


def pair_slabs(a: Member, b: Member, each: Callable[[Slice, Slice], object]) -> None:
    """``each(slab_a, slab_b)`` for the slabs of :data:`SLICE_VALUES` values of two chunks of the same geometry
    (``(reader, key, chunk)`` each), in order: two plain records through the engine's
    :class:`~ckpttool.engine.plan.Lockstep` (both CRC-32s checked), any other pair through :func:`read_pair`.

    Raises:
        as :func:`chunk_slices`.
    """
    located = _streams((a, b))
    if located is None:
        for sa, sb in read_pair(a, b):
            each(sa, sb)
        return
    locs, dtypes, streams = located
    items = tuple(DTYPE_ITEMSIZE[d] for d in dtypes)
    ls = Lockstep(streams, items, lambda s, _: each((s[0], dtypes[0]), (s[1], dtypes[1])), SLICE_VALUES)
    try:
        crcs = run_lockstep(ls)
    except ShortReadError:
        loc = locs[0]
        raise ChunkError(f"{loc.where}: short read", path=loc.info.relative_path, fqn=a[1]) from None
    _checked((a, b), locs, dtypes, crcs)


def tensor_values(reader: CheckpointReader, key: str) -> Any:
    """A whole tensor as a flat float64 numpy array (the fallback of differently sharded pairs); a complex
    one as its real and imaginary parts interleaved (as :func:`read_pair`)."""
    import torch

    t = reader.read_tensor(key)
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.reshape(-1).to(torch.float64).numpy().copy()
