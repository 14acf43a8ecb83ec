"""The ``--deep`` pass: read every data byte once, files in parallel, and summarise the values.

Each chunk is located and checked by the chunk locator, its raw record read block by block
with the engine's read helper (:mod:`ckpttool.engine.io`) and summarised on its IEEE bit
patterns by the engine's statistics kernel (:mod:`ckpttool.engine.stats`, the one ``stats``
uses; torch-free): non-finite and negative counts, all-zero tensors, values beyond a bound and
subnormals, ``step`` values (non-negative integers), and pairs that must agree read together (a BF16/FP16
parameter equals ``master_weight.to(param dtype)`` bitwise; a tied ``lm_head.weight`` equals
the embedding). Chunks the locator does not map and dtypes without a bit-pattern path go
through torch (``read_chunk``). Chunks with broken storage are skipped: the storage rules
report them. Rules: ``docs/rules.md`` (``D`` family); ``docs/design.md`` §5.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpttool.engine.crc import crc32
from ckpttool.engine.execute import release_lockstep_buffers, run_lockstep
from ckpttool.engine.io import BLOCK_BYTES, ShortReadError
from ckpttool.engine.kernels import IEEE_BITS, Scratch, f32_to_bf16, f32_to_f16, float_values
from ckpttool.engine.plan import Lockstep, PairKernel, Scan, Window
from ckpttool.engine.pool import map_ordered
from ckpttool.engine.scan import ScanResult, run_scan
from ckpttool.engine.stats import (
    SUBNORMAL_DTYPES,
    SUBNORMAL_STRIDE,
    Need,
    SlabStats,
    fold_slab,
    moment_ratio,
    native_stats,
    release_scratch,
)
from ckpttool.errors import ChunkError, CkptError
from ckpttool.format.metadata import DTYPE_ITEMSIZE, BytesMeta, ChunkMeta, TensorMeta
from ckpttool.format.tiling import tiling_problem, unravel
from ckpttool.layouts.record import LAYOUT_KEY
from ckpttool.model.hfconfig import tie_word_embeddings
from ckpttool.ops import distributed
from ckpttool.ops.fields import ProgressFn
from ckpttool.ops.validate.stats import UNINIT_BOUND, DeepResult, PairStats, TensorStats, second_moment

if TYPE_CHECKING:
    import torch

    from ckpttool.ops.validate.context import Context

__all__ = ["SUBNORMAL_DTYPES", "SUBNORMAL_STRIDE", "TensorStats", "PairStats", "DeepResult", "run_deep"]

_AMINMAX_DTYPES = {"bfloat16", "float16", "float32", "float64"}
_MOMENT_DTYPES = ("bfloat16", "float16", "float32", "float64")
#: The smallest normal FP16 value: a second moment below it is subnormal, rounded to a multiple of 2**-24.
FP16_NORMAL = 2.0**-14
#: The largest ``|exp_avg|`` beside an FP16 ``exp_avg_sq`` that underflowed to 0: every ``(1 - beta2) * g**2`` was
#: below 2**-25 (half the smallest subnormal), so ``|exp_avg| <= max |g| < sqrt(2**-25 / (1 - beta2))``, here
#: for ``beta2`` up to 0.9999.
FP16_UNDERFLOW_EXP_AVG = math.sqrt(2.0**-25 / 1e-4)
#: The dtype of a complex tensor's real and imaginary parts (``torch.view_as_real``).
_COMPLEX_PARTS = {"complex32": "float16", "complex64": "float32", "complex128": "float64"}


def _is_step(key: str) -> bool:
    # An optimizer state `step` under any schema's prefix (optimizer.state.<fqn>.step, app.optim.state.<fqn>.step).
    return key.endswith(".step") and ".state." in key


def _summarise(
    key: str, t: torch.Tensor, dtype: str, need_negative: bool, keep_values: bool, magnitudes: bool = False
) -> TensorStats:
    import torch

    stored = dtype
    if t.is_complex():  # its real and imaginary parts, as torch's optimizers step a complex parameter
        t, dtype = torch.view_as_real(t), _COMPLEX_PARTS[dtype]
    st = TensorStats(key, stored, numel=t.numel())
    # packed E2M1 pairs: torch converts them to nothing, and they hold no NaN or inf
    if t.numel() == 0 or dtype == "float4_e2m1fn_x2":
        return st
    if keep_values:
        st.values = [float(v) for v in t.reshape(-1)[:64].tolist()]
    if not t.is_floating_point():
        if need_negative and t.dtype not in (torch.bool, torch.uint8):
            st.negative = int((t < 0).sum())
        return st
    flat = t.reshape(-1)
    if dtype in IEEE_BITS and flat.is_contiguous():  # IEEE bit patterns: numpy reductions, vectorised and GIL-free
        _bit_stats(st, flat.view(torch.uint8).numpy(), dtype, need_negative, magnitudes)
        return st
    if dtype in _AMINMAX_DTYPES:
        mn, mx = torch.aminmax(flat)
        lo, hi = float(mn), float(mx)
    else:  # float8: no vectorised reductions; widen in slices
        lo, hi = math.inf, -math.inf
        for s in range(0, flat.numel(), 1 << 22):
            mn, mx = torch.aminmax(flat[s : s + (1 << 22)].float())
            a, b = float(mn), float(mx)
            if math.isnan(a) or math.isnan(b):
                lo = hi = math.nan
                break
            lo, hi = min(lo, a), max(hi, b)
    st.min, st.max = lo, hi
    st.zero = lo == 0 and hi == 0
    if not (math.isfinite(lo) and math.isfinite(hi)):
        st.nonfinite = int((~torch.isfinite(flat.float())).sum())
    if need_negative and (math.isnan(lo) or lo < 0):
        st.negative = int((flat < 0).sum())
    return st


def _compare(pair: PairStats, a: torch.Tensor, b: torch.Tensor, chunk: ChunkMeta | None = None) -> None:
    """Compare ``a`` with ``b`` as ``pair.kind`` says (torch path: whole tensors, or one chunk ``chunk`` of each)."""
    import torch

    pair.compared = True
    if pair.kind == "amsgrad":  # the numpy comparison of the streamed path, on the values widened exactly
        count = _PairCount()
        count.numel = a.numel()
        if a.numel():
            _amsgrad_np(count, a.reshape(-1).double().numpy(), b.reshape(-1).double().numpy(), 0)
        _add_count(pair, count, chunk, tuple(a.shape))
        return
    if a.is_complex():  # real and imaginary parts (the moments of a complex parameter: each part its own)
        a = torch.view_as_real(a)
    if b.is_complex():
        b = torch.view_as_real(b)
    pair.numel += a.numel()
    if a.numel() == 0:
        return
    if pair.kind == "moments":
        fp16 = b.dtype == torch.float16
        m, v = a.reshape(-1).double(), b.reshape(-1).double()
        pair.mismatched += int(((v == 0) & ~(m.abs() < (FP16_UNDERFLOW_EXP_AVG if fp16 else 0.0))).sum())
        pos = v >= FP16_NORMAL if fp16 else v > 0
        if bool(pos.any()):
            r = float(torch.nan_to_num(m[pos].abs() / v[pos].sqrt(), nan=0.0).max())
            pair.max_diff = max(pair.max_diff, r)
        return
    bc = b.to(a.dtype) if b.dtype != a.dtype else b
    if torch.equal(a, bc):
        return
    ne = a != bc
    ne &= ~(torch.isnan(a) & torch.isnan(bc))
    n = int(ne.sum())
    if n:
        wide = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
        d = (a[ne].to(wide) - b[ne].to(wide)).abs()
        nan = torch.isnan(d)
        pair.nan_mismatched += int((torch.isnan(a[ne]) != torch.isnan(bc[ne])).sum())
        d = d[~nan]
        pair.mismatched += n
        if d.numel():
            pair.max_diff = max(pair.max_diff, float(d.max()))


_NP_INT = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool"}
#: float8 dtypes summarised on their bytes (NaN count; all zero): quantized weights, ``validate`` rule M022.
_NP_F8 = {"float8_e4m3fn"}


def _summarise_f8(key: str, raw: Any) -> TensorStats:
    """A ``float8_e4m3fn`` slice: NaN bytes (``0x7F`` / ``0xFF``; no infinity) as ``nonfinite``, and ``zero``."""
    from ckpttool.engine.kernels import e4m3fn_nan_count

    st = TensorStats(key, "float8_e4m3fn", numel=raw.size)
    if raw.size:
        st.nonfinite = e4m3fn_nan_count(raw)
        st.zero = not bool((raw & 0x7F).any())
    return st


def _summarise_np(
    key: str, raw: Any, dtype: str, need_negative: bool, keep_values: bool, magnitudes: bool = False
) -> TensorStats | None:
    """:func:`_summarise` on a slice of raw bytes with numpy; ``None`` for dtypes it has no path for."""
    import numpy as np

    if dtype in _NP_F8:
        return _summarise_f8(key, raw)
    if dtype not in IEEE_BITS and dtype not in _NP_INT:
        return None
    item = DTYPE_ITEMSIZE[dtype]
    st = TensorStats(key, dtype, numel=raw.size // item)
    if st.numel == 0:
        return st
    if dtype not in IEEE_BITS:
        arr = raw.view(np.bool_ if dtype == "bool" else dtype)
        if keep_values:
            st.values = [float(v) for v in arr[:64].tolist()]
        if need_negative and dtype.startswith("int"):
            st.negative = int(np.count_nonzero(arr < 0))
        return st
    if keep_values:
        st.values = [float(v) for v in float_values(raw[: 64 * item], dtype).tolist()]
    _bit_stats(st, raw, dtype, need_negative, magnitudes)  # zero: D005 (synthesized state)
    return st


_DEEP = {
    (neg, mag): Need(negative=neg, bound=UNINIT_BOUND if mag else None)
    for neg in (False, True)
    for mag in (False, True)
}


def _bit_stats(st: TensorStats, raw: Any, dtype: str, need_negative: bool, magnitudes: bool) -> None:
    """Summarise raw bytes of an :data:`IEEE_BITS` dtype (at least one value) into ``st`` with the engine's
    statistics kernel (:func:`~ckpttool.engine.stats.fold_slab`): all ``±0`` (``D005``), non-finite and
    (``need_negative``) negative counts and the smallest negative, and for model tensors
    (``magnitudes``) the values beyond :data:`UNINIT_BOUND` and the subnormals (``D013``)."""
    acc = SlabStats()
    fold_slab(acc, raw, dtype, _DEEP[need_negative, magnitudes])
    st.zero = acc.all_zero
    st.nonfinite = acc.nonfinite
    st.negative = acc.negative
    if acc.neg_min is not None:
        st.min = acc.neg_min
    st.beyond, st.beyond_max, st.subnormal = acc.beyond, acc.beyond_max, acc.subnormal


def _new_scratch() -> Scratch:
    return Scratch(BLOCK_BYTES // 2)


_scratch = _new_scratch()


class _PairCount:
    """A pair's comparison counts of one work item (merged into the shared :class:`PairStats` once); ``worst_at``:
    the item-local flat index of an ``"amsgrad"`` pair's worst element (``-1``: none), values ``worst_a``/``worst_b``."""

    __slots__ = ("numel", "mismatched", "max_diff", "nan_mismatched", "worst_at", "worst_a", "worst_b")

    def __init__(self) -> None:
        self.numel = 0
        self.mismatched = 0
        self.max_diff = 0.0
        self.nan_mismatched = 0
        self.worst_at = -1
        self.worst_a = self.worst_b = 0.0


def _amsgrad_np(count: _PairCount, a: Any, b: Any, e0: int) -> None:
    """Count the elements of one slice where amsgrad's ``max_exp_avg_sq`` ``a`` is below ``exp_avg_sq`` ``b``
    (values of one dtype, compared as stored; a negative ``a`` is ``D002``'s, NaN compares false: ``D001``'s),
    and keep the worst (largest ``b - a`` in float64) at flat index ``e0 + i``."""
    import numpy as np

    with np.errstate(invalid="ignore"):
        below = a < b
        if not below.any():
            return
        below &= ~(a < 0)
    idx = np.flatnonzero(below)
    if not idx.size:
        return
    d = b[idx].astype(np.float64) - a[idx].astype(np.float64)
    j = int(np.argmax(d))
    count.mismatched += int(idx.size)
    if count.worst_at < 0 or float(d[j]) > count.max_diff:
        count.max_diff = float(d[j])
        count.worst_at = e0 + int(idx[j])
        count.worst_a, count.worst_b = float(a[idx[j]]), float(b[idx[j]])


def _add_count(pair: PairStats, c: _PairCount, chunk: ChunkMeta | None, sizes: tuple[int, ...]) -> None:
    """Merge one item's counts into ``pair`` (the caller holds the run's lock); an ``"amsgrad"`` worst element's
    item-local flat index becomes its global index: in the chunk ``chunk`` (``None``: the whole tensor of ``sizes``)."""
    pair.compared = True
    pair.numel += c.numel
    pair.mismatched += c.mismatched
    pair.nan_mismatched += c.nan_mismatched
    if c.worst_at >= 0:
        shape = tuple(chunk.sizes) if chunk is not None else sizes
        offsets = tuple(chunk.offsets) if chunk is not None else (0,) * len(shape)
        _take_worst(
            pair, tuple(o + i for o, i in zip(offsets, unravel(c.worst_at, shape))), c.max_diff, c.worst_a, c.worst_b
        )
    pair.max_diff = max(pair.max_diff, c.max_diff)


def _take_worst(pair: PairStats, at: tuple[int, ...], diff: float, a: float, b: float) -> None:
    """Keep ``at`` (a global index) as ``pair``'s worst element where its difference is larger, or as large at a
    smaller index: the same element whatever order the items (threads, ranks) are merged in."""
    if pair.worst_at is None or diff > pair.max_diff or (diff == pair.max_diff and at < pair.worst_at):
        pair.worst_at, pair.worst_a, pair.worst_b = at, a, b


def _compare_np(
    count: _PairCount, kind: str, a_raw: Any, a_dtype: str, b_raw: Any, b_dtype: str, b_finite: bool, e0: int = 0
) -> None:
    """Compare slice ``a`` with slice ``b`` cast to ``a``'s dtype, bitwise (NaN equals NaN), as :func:`_compare`.

    ``b`` is rounded into a scratch array and xor-ed with ``a``: every step runs in place on
    cache-resident arrays; only a slice with a difference (or non-finite values in ``b``,
    ``b_finite`` false) is examined element by element. ``"moments"``: :func:`_moments_np`; ``"amsgrad"``:
    :func:`_amsgrad_np` (the slice's first element at ``e0`` of the item).
    """
    import numpy as np

    n = a_raw.size // DTYPE_ITEMSIZE[a_dtype]
    count.numel += n
    if n == 0:
        return
    if kind == "amsgrad":
        _amsgrad_np(count, float_values(a_raw, a_dtype), float_values(b_raw, b_dtype), e0)
        return
    if kind == "moments":
        top = moment_ratio(a_raw, a_dtype, b_raw, b_dtype)  # the native kernel, or None
        if top is None or top == math.inf:  # not built, float16, or a zero / overflowing moment: numpy's exact path
            _moments_np(count, float_values(a_raw, a_dtype), float_values(b_raw, b_dtype))
        elif top > 0:
            count.max_diff = max(count.max_diff, math.sqrt(top))
        return
    ua = a_raw.view(IEEE_BITS[a_dtype][1]) if a_dtype in IEEE_BITS else a_raw
    if a_dtype == b_dtype:
        rounded = b_raw.view(ua.dtype)
    elif a_dtype == "bfloat16":  # a NaN master's pattern is left as the rounding makes it: NaNs are tested below
        rounded = _scratch.get("rounded", "uint16", n)
        f32_to_bf16(b_raw.view(np.uint32), rounded, canonical_nan=False)
    else:  # float16 <- float32: round to nearest even, overflow to inf (as torch)
        rounded = _scratch.get("rounded16", "float16", n)
        f32_to_f16(b_raw.view(np.float32), rounded)
        rounded = rounded.view(np.uint16)
    x = _scratch.get("xor", "uint8", n * ua.dtype.itemsize).view(ua.dtype)
    np.bitwise_xor(ua, rounded, out=x)
    if b_finite and not x.any():
        return
    fa = float_values(a_raw, a_dtype) if a_dtype in IEEE_BITS else ua
    fb = float_values(b_raw, b_dtype) if b_dtype in IEEE_BITS else b_raw.view(ua.dtype)
    ne = x != 0
    if a_dtype in IEEE_BITS:
        # a NaN master rounds to some NaN pattern: NaN against NaN is equal, whatever the payload
        both_nan = np.isnan(fa) & np.isnan(fb)
        ne |= np.isnan(fb) & ~np.isnan(fa)
        ne &= ~both_nan
    k = int(np.count_nonzero(ne))
    if k:
        wide = np.float64 if "float64" in (a_dtype, b_dtype) else np.float32
        with np.errstate(invalid="ignore", over="ignore"):
            d = np.abs(fa[ne].astype(wide) - fb[ne].astype(wide))
        if a_dtype in IEEE_BITS:  # NaN on one side only (NaN against NaN is equal): no |diff| measures it
            count.nan_mismatched += int(np.count_nonzero(np.isnan(fa[ne]) != np.isnan(fb[ne])))
        d = d[~np.isnan(d)]
        count.mismatched += k
        if d.size:
            count.max_diff = max(count.max_diff, float(d.max()))


_MOMENT_SUB = 1 << 15


def _moments_np(count: _PairCount, m: Any, v: Any) -> None:
    """Count ``v == 0 and m != 0`` and take ``max |m| / sqrt(v)`` over ``v > 0`` (NaN ignored) of one slice.

    In-place passes over cache-sized sub-slices of a scratch array: ``m * m / v`` (``inf``
    exactly where ``v`` is 0 and ``m`` is not, NaN where both are, negative where ``v`` is), then
    a NaN-ignoring maximum; only a slice whose maximum is ``inf`` is examined element by element.
    """
    import numpy as np

    n = m.size
    if n == 0:
        return
    if v.dtype == np.float16:
        _moments_fp16(count, m, v)
        return
    wide = np.float64 if np.float64 in (m.dtype, v.dtype) else np.float32
    sub = min(n, _MOMENT_SUB)
    r = _scratch.get(f"ratio_{np.dtype(wide).name}", np.dtype(wide).name, sub)
    top = -np.inf
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for a in range(0, n, sub):  # sub-slices that stay in the L2 cache across the three passes
            b = min(n, a + sub)
            t = r[: b - a]
            np.multiply(m[a:b], m[a:b], out=t)
            np.divide(t, v[a:b], out=t)
            top = max(top, float(np.fmax.reduce(t)))
    if top == np.inf:  # a zero second moment, or an overflow of m * m: element by element
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            r = np.square(m.astype(wide)) / v
        zero_v = (v == 0) & (m != 0)
        count.mismatched += int(np.count_nonzero(zero_v))
        r[zero_v] = 0.0
        overflow = np.isinf(r)  # m * m overflowed: the ratio itself is finite
        if overflow.any():
            with np.errstate(invalid="ignore", divide="ignore"):
                top_of = float(
                    np.fmax.reduce(np.abs(m[overflow]).astype(np.float64) / np.sqrt(v[overflow].astype(np.float64)))
                )
            r[overflow] = 0.0
            count.max_diff = max(count.max_diff, top_of if top_of == top_of else 0.0)
        top = float(np.fmax.reduce(r))
    if top == top and top > 0:
        count.max_diff = max(count.max_diff, math.sqrt(top))


def _moments_fp16(count: _PairCount, m: Any, v: Any) -> None:
    """:func:`_moments_np` of an FP16 ``exp_avg_sq``, whose small values underflow: a 0 counts only beside an
    ``|exp_avg|`` of :data:`FP16_UNDERFLOW_EXP_AVG` or more, and the ratio is taken where ``v`` is a normal number
    (a subnormal one is rounded by up to half its value)."""
    import numpy as np

    mw, vw = m.astype(np.float32), v.astype(np.float32)
    with np.errstate(invalid="ignore"):
        count.mismatched += int(np.count_nonzero((vw == 0) & ~(np.abs(mw) < FP16_UNDERFLOW_EXP_AVG)))
        normal = vw >= FP16_NORMAL
        if normal.any():
            top = float(np.fmax.reduce(np.abs(mw[normal]) / np.sqrt(vw[normal])))
            if top == top and top > 0:
                count.max_diff = max(count.max_diff, top)


_NP_PAIRS = {("bfloat16", "float32"), ("float16", "float32")}


def _np_comparable(a_dtype: str, b_dtype: str) -> bool:
    return (a_dtype, b_dtype) in _NP_PAIRS or (a_dtype == b_dtype and (a_dtype in IEEE_BITS or a_dtype in _NP_INT))


def _release_buffers() -> None:
    """Drop every thread's scratch and slice buffers (pool threads outlive a run; a later run allocates anew)."""
    global _scratch
    _scratch = _new_scratch()
    release_scratch()
    release_lockstep_buffers()


def _streamable(dtypes: list[str], metas: dict[str, TensorMeta], pairs: list[PairStats]) -> bool:
    """Every member has a numpy path, and every pair a numpy comparison."""
    if any(d not in IEEE_BITS and d not in _NP_INT and d not in _NP_F8 for d in dtypes):
        return False
    for p in pairs:
        a, b = metas[p.a].dtype.name, metas[p.b].dtype.name
        if not _np_comparable(a, b) and not (p.kind in ("moments", "amsgrad") and a in IEEE_BITS and b in IEEE_BITS):
            return False
    return True


def _stream_item(
    ctx: Context,
    keys: tuple[str, ...],
    chunk: ChunkMeta,
    metas: dict[str, TensorMeta],
    pairs: list[PairStats],
) -> tuple[dict[str, TensorStats], dict[int, _PairCount], int] | None:
    """Summarise one chunk of every key in ``keys`` slice by slice (and compare the pairs among them).

    The chunk of each key is located and checked by the chunk locator (dtype, shape, record
    inside its window) exactly as for every other read, and its CRC-32 is computed slice by
    slice as the bytes pass (``ChecksumError`` on a mismatch).

    Returns:
        ``(stats per key, counts per index into pairs, bytes read)``, or ``None`` when some member
        needs the torch path (a chunk that is not plain C-order values, a dtype without a numpy path).

    Raises:
        CkptError: an archive is corrupt or disagrees with the metadata.
    """
    dtypes = [metas[k].dtype.name for k in keys]
    if not _streamable(dtypes, metas, pairs):
        return None
    locs = [ctx.reader.locate(k, chunk) for k in keys]
    if any(not loc.raw for loc in locs):
        return None
    n = chunk.numel
    digs = [_digest_plan(ctx, k, metas[k], chunk) for k in keys]
    items = [DTYPE_ITEMSIZE[d] for d in dtypes]
    slot = {k: i for i, k in enumerate(keys)}
    stats: dict[str, TensorStats] = {k: TensorStats(k, d) for k, d in zip(keys, dtypes)}
    counts = {i: _PairCount() for i in range(len(pairs))}

    def each(raws: list[Any], e0: int) -> None:
        finite = []
        for k, d, raw, item, dg in zip(keys, dtypes, raws, items, digs):
            if dg is not None and dg.seg:
                dg.add(raw, e0, item)
            st = _summarise_np(k, raw, d, second_moment(k), _is_step(k) and e0 == 0, k in ctx.cat.model)
            assert st is not None
            stats[k].add(st)
            finite.append(st.nonfinite == 0)
        for j, p in enumerate(pairs):
            ia, ib = slot[p.a], slot[p.b]
            _compare_np(counts[j], p.kind, raws[ia], dtypes[ia], raws[ib], dtypes[ib], finite[ib], e0)

    streams = tuple(
        (Window(ctx.reader.fd(loc.info.relative_path), loc.data_start, n * item),) for loc, item in zip(locs, items)
    )
    ls = Lockstep(streams, tuple(items), each, max(1, BLOCK_BYTES // max(items)))
    crcs: tuple[int | None, ...] | None = None
    if native_stats():
        crcs = _scanned(ctx, ls, keys, dtypes, digs, pairs, stats, counts, locs)
    if crcs is None:
        crcs = _lockstep(ls, locs[0])
    read = n * sum(items)
    for loc, crc in zip(locs, crcs):
        loc.check_crc(crc)
    for k, dg, crc in zip(keys, digs, crcs):
        if dg is not None:
            assert crc is not None
            stats[k].digests = dg.finish(n, crc)
    return stats, counts, read


#: The native scan's pair kernel of each pair kind (:class:`~ckpttool.engine.plan.PairKernel`; others: ``"equal"``).
_PAIR_KERNELS = {"moments": "ratio", "amsgrad": "below"}


def _scanned(
    ctx: Context,
    ls: Lockstep,
    keys: tuple[str, ...],
    dtypes: list[str],
    digs: list[_Digest | None],
    pairs: list[PairStats],
    stats: dict[str, TensorStats],
    counts: dict[int, _PairCount],
    locs: list[Any],
) -> tuple[int | None, ...] | None:
    """The chunk's members through the native scan (:func:`~ckpttool.engine.scan.run_scan`): the same slabs,
    folds and comparisons as ``_stream_item``'s ``each``, one C call per window; a slab a comparison cannot
    settle there (a difference, a non-finite master, a zero second moment) goes through :func:`_compare_np`.

    Returns:
        The members' CRC-32s (``None`` for a member whose record stores none and that has no digest: not
        computed), or ``None`` where the scan does not apply (integer or float8 members, ``step``
        values kept, fused expert digests, float16 moments, or the kernels not built).
    """
    if any(d not in IEEE_BITS for d in dtypes) or any(_is_step(k) for k in keys):
        return None
    if any(dg is not None and dg.seg for dg in digs):
        return None
    slot = {k: i for i, k in enumerate(keys)}
    kernels = []
    for p in pairs:
        ia, ib = slot[p.a], slot[p.b]
        if p.kind == "moments" and "float16" in (dtypes[ia], dtypes[ib]):
            return None
        kernels.append(PairKernel(_PAIR_KERNELS.get(p.kind, "equal"), ia, ib))
    folds = tuple(_DEEP[second_moment(k), k in ctx.cat.model] for k in keys)

    def exact(raws: list[Any], e0: int, which: int) -> None:
        for j, p in enumerate(pairs):
            if which >> j & 1:
                ia, ib, c = slot[p.a], slot[p.b], _PairCount()
                _compare_np(c, p.kind, raws[ia], dtypes[ia], raws[ib], dtypes[ib], False, e0)
                counts[j].mismatched += c.mismatched
                counts[j].nan_mismatched += c.nan_mismatched
                if c.worst_at >= 0 and (counts[j].worst_at < 0 or c.max_diff > counts[j].max_diff):
                    counts[j].worst_at, counts[j].worst_a, counts[j].worst_b = c.worst_at, c.worst_a, c.worst_b
                counts[j].max_diff = max(counts[j].max_diff, c.max_diff)

    wanted = tuple(loc.has_crc or dg is not None for loc, dg in zip(locs, digs))
    scan = Scan(tuple(dtypes), folds, tuple(kernels), exact, wanted)
    try:
        res = run_scan(Lockstep(ls.streams, ls.itemsizes, ls.each, ls.slab, scan))
    except ShortReadError:
        loc = locs[0]
        raise ChunkError(f"{loc.where}: short read", path=loc.info.relative_path, fqn=loc.key) from None
    if res is None:
        return None
    _fold_scan(res, ls.numel, keys, pairs, stats, counts)
    return res.crcs


def _fold_scan(
    res: ScanResult,
    n: int,
    keys: tuple[str, ...],
    pairs: list[PairStats],
    stats: dict[str, TensorStats],
    counts: dict[int, _PairCount],
) -> None:
    """A native scan's per-member statistics and pair results (``n`` values each) into ``stats``/``counts``."""
    for k, acc in zip(keys, res.stats):
        assert acc is not None
        st = stats[k]
        st.numel, st.zero, st.nonfinite, st.negative = n, (acc.all_zero if n else None), acc.nonfinite, acc.negative
        st.min = acc.neg_min
        st.beyond, st.beyond_max, st.subnormal = acc.beyond, acc.beyond_max, acc.subnormal
    for j, (p, r) in enumerate(zip(pairs, res.pairs)):
        counts[j].numel += n
        if p.kind == "moments" and r.top > 0:
            counts[j].max_diff = max(counts[j].max_diff, math.sqrt(r.top))


class _Digest:
    """The ``(global flat start, length, CRC-32)`` runs of one chunk (see :attr:`TensorStats.digests`).

    A chunk that spans whole rows (every dim but 0 complete) is one run of global C order;
    with ``seg`` (elements per expert of a fused expert tensor) the runs are cut at the expert
    boundaries, each with its own CRC (computed while the slice is in the CPU cache). A fused
    expert chunk cut on dim 1 too (EP-FSDP on dim 1: ``[e, i, H]`` of ``[E, I, H]``) is one run
    per expert it holds: ``seg`` is then that run's length in the chunk and ``stride`` the
    elements per expert (a run starting at chunk element ``p`` is at global
    ``base + p // seg * stride``).
    """

    __slots__ = ("base", "seg", "stride", "runs", "start", "length", "crc")

    def __init__(self, base: int, seg: int, stride: int = 0) -> None:
        self.base, self.seg, self.stride = base, seg, stride
        self.runs: list[tuple[int, int, int]] = []
        self.start, self.length, self.crc = (0 if stride else base), 0, 0

    def _at(self, p: int) -> int:
        """Global flat start of the run whose first element is ``p`` (global, or chunk-local with ``stride``)."""
        return self.base + p // self.seg * self.stride if self.stride else p

    def add(self, raw: Any, e0: int, item: int) -> None:
        pos, n = 0, raw.size // item
        while pos < n:
            g = (0 if self.stride else self.base) + e0 + pos
            take = min(n - pos, self.seg - g % self.seg)
            self.crc = crc32(raw[pos * item : (pos + take) * item], self.crc)
            self.length += take
            pos += take
            if (g + take) % self.seg == 0:
                self.runs.append((self._at(self.start), self.length, self.crc))
                self.start, self.length, self.crc = g + take, 0, 0

    def finish(self, n: int, chunk_crc: int) -> list[tuple[int, int, int]]:
        if not self.seg:
            return [(self.base, n, chunk_crc)]
        if self.length:
            self.runs.append((self._at(self.start), self.length, self.crc))
        return self.runs


def _contiguous_start(size: tuple[int, ...], chunk: ChunkMeta) -> int | None:
    """The global flat index of the chunk's first element where the chunk is one contiguous run of the tensor's
    C order (every dim before its last partial one of size 1, every dim after it complete), else ``None``."""
    partial = [d for d in range(len(size)) if chunk.sizes[d] != size[d]]
    j = partial[-1] if partial else 0
    if any(chunk.sizes[d] != 1 for d in range(j)):
        return None
    start, stride = 0, 1
    for d in reversed(range(len(size))):
        start += chunk.offsets[d] * stride
        stride *= size[d]
    return start


def _digest_plan(ctx: Context, key: str, meta: TensorMeta, chunk: ChunkMeta) -> _Digest | None:
    """A :class:`_Digest` for a chunk that spans whole rows of a floating model tensor or of a parameter's master
    weight or moments (of fused experts: whole rows of each expert's matrix, dims 2.. complete), else ``None``."""
    if (
        (key not in ctx.cat.model and key not in ctx.state_tensor_keys())
        or meta.dtype.name not in IEEE_BITS
        or not meta.size
    ):
        return None
    size = tuple(meta.size)
    layers, e = ctx.expert_grid(key, size)
    if key in ctx.stacked_keys() and e:
        # experts of stacked layers ``[L, E, ...]``: the tensor as ``[L*E, ...]`` (the same C order), its chunk there
        if chunk.sizes[0] == 1:
            flat = (chunk.offsets[0] * e + chunk.offsets[1],), (chunk.sizes[1],)
        elif chunk.sizes[1] == e:
            flat = (chunk.offsets[0] * e,), (chunk.sizes[0] * e,)
        else:
            return None  # several layers, part of their experts: no run lies inside one expert
        size = (layers * e, *size[2:])
        chunk = ChunkMeta(flat[0] + tuple(chunk.offsets[2:]), flat[1] + tuple(chunk.sizes[2:]))
        e *= layers
    row = meta.numel // size[0] if size[0] else 0
    if tuple(chunk.sizes[1:]) != size[1:] or any(chunk.offsets[1:]):
        start = None if e else _contiguous_start(size, chunk)
        if start is not None:  # one contiguous run all the same (megatron's one-layer chunk of a half of fc1)
            return _Digest(start, 0)
        if not e or tuple(chunk.sizes[2:]) != size[2:] or any(chunk.offsets[2:]):
            return None
        row2 = row // size[1] if size[1] else 0
        if not chunk.sizes[1] * row2:
            return None
        return _Digest(chunk.offsets[0] * row + chunk.offsets[1] * row2, chunk.sizes[1] * row2, row)
    return _Digest(chunk.offsets[0] * row, meta.numel // e if e else 0)


def _lockstep(ls: Lockstep, loc: Any) -> tuple[int, ...]:
    """:func:`~ckpttool.engine.execute.run_lockstep` of a chunk's members (``loc``: the first one's location).

    Raises:
        ChunkError: a file ends first (it changed since the locator checked it).
    """
    try:
        return run_lockstep(ls)
    except ShortReadError:
        raise ChunkError(f"{loc.where}: short read", path=loc.info.relative_path, fqn=loc.key) from None


class _Buffers(threading.local):
    """Per-thread whole-chunk tensors of the torch path."""

    def __init__(self) -> None:
        self.bufs: list[torch.Tensor | None] = []

    def view(self, slot: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        import torch

        while len(self.bufs) <= slot:
            self.bufs.append(None)
        buf = self.bufs[slot]
        if buf is None or buf.numel() < nbytes:
            buf = self.bufs[slot] = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8)
        return buf[:nbytes].view(dtype).view(shape)


@dataclass
class _Item:
    keys: tuple[str, ...]
    chunk: ChunkMeta | None  # None: read the keys whole
    order: tuple[str, int]
    nbytes: int


def _evict(reader: Any, keys: tuple[str, ...], chunk: ChunkMeta) -> None:
    infos = []
    for k in keys:
        try:
            infos.append(reader.storage_info(k, chunk))
        except CkptError:  # reported by the read already
            pass
    reader.evict(infos)


def _pairs(ctx: Context) -> list[PairStats]:
    out = []
    for fqn, ps in ctx.cat.optimizer_state.items():
        mw = ps.fields.get("master_weight")
        param = ctx.cat.model_entry(fqn)
        if mw is None or param is None or param.dtype not in ("bfloat16", "float16") or mw.shape != param.shape:
            continue
        out.append(PairStats(param.key, mw.key, "master"))
    for ps in ctx.cat.optimizer_state.values():
        m, v = ps.fields.get("exp_avg"), ps.fields.get("exp_avg_sq")
        if (
            m is not None
            and v is not None
            and m.shape == v.shape
            and m.dtype in _MOMENT_DTYPES
            and v.dtype in _MOMENT_DTYPES
        ):
            out.append(PairStats(m.key, v.key, "moments"))
        mx = ps.fields.get("max_exp_avg_sq")  # amsgrad's running maximum of exp_avg_sq, in its dtype (D016)
        if (
            mx is not None
            and v is not None
            and mx.shape == v.shape
            and mx.dtype == v.dtype
            and v.dtype in _MOMENT_DTYPES
        ):
            out.append(PairStats(mx.key, v.key, "amsgrad"))
    if ctx.config is not None and bool(tie_word_embeddings(ctx.config)):
        head, emb = ctx.cat.tied_keys()
        if head and emb and ctx.cat.model[head].shape == ctx.cat.model[emb].shape:
            out.append(PairStats(head, emb, "tied"))
    return out


def _readable(ctx: Context, key: str, meta: TensorMeta) -> bool:
    if tiling_problem(meta) is not None:
        return False
    try:
        ctx.reader.check_allocation(key, meta)
    except CkptError:
        return False
    return all(ctx.storage_ok(key, c) for c in meta.chunks if c.numel > 0)


def _merge_ranks(
    group: distributed.Group, partial: dict[str, TensorStats], failed: set[str], res: DeepResult, nbytes: int
) -> int:
    """Merge every rank's summaries, pair comparisons and read errors into this rank's (in place).

    Returns:
        The data bytes read by all ranks together.
    """
    pairs = [
        (p.compared, p.numel, p.mismatched, p.max_diff, p.nan_mismatched, p.worst_at, p.worst_a, p.worst_b)
        for p in res.pairs
    ]
    errs = {k: distributed.pack_error(e) for k, e in res.read_errors.items()}
    parts = group.gather((partial, sorted(failed), pairs, errs, nbytes))
    partial.clear()
    failed.clear()
    res.read_errors.clear()
    for p in res.pairs:
        p.compared, p.numel, p.mismatched, p.max_diff, p.nan_mismatched = False, 0, 0, 0.0, 0
        p.worst_at, p.worst_a, p.worst_b = None, 0.0, 0.0
    total = 0
    for part, fail, prs, er, n in parts:
        for k, st in part.items():
            if k in partial:
                partial[k].add(st)
            else:
                partial[k] = st
        failed.update(fail)
        for p, (compared, numel, mismatched, max_diff, nan_mismatched, worst_at, wa, wb) in zip(res.pairs, prs):
            p.compared = p.compared or compared
            p.numel += numel
            p.mismatched += mismatched
            if worst_at is not None:
                _take_worst(p, worst_at, max_diff, wa, wb)
            p.max_diff = max(p.max_diff, max_diff)
            p.nan_mismatched += nan_mismatched
        for k, packed in er.items():
            res.read_errors.setdefault(k, distributed.unpack_error(packed))
        total += n
    return total


def run_deep(ctx: Context, workers: int | None = None, progress: ProgressFn | None = None) -> DeepResult:
    """Read every tensor chunk (and byte item) of the checkpoint once and summarise it.

    Args:
        ctx: a context with an open reader and catalog.
        workers: threads (default ``min(8, max(2, cpu_count))``).
        progress: called as ``progress(0, bytes_total)`` once planned, then ``progress(bytes_done,
            bytes_total)`` after each work item.

    Returns:
        The :class:`DeepResult`.

    Raises:
        Exception: the first exception of a work item, in item order, other than a ``CkptError`` (a chunk
            whose read raises one is recorded in ``read_errors``, a finding); the items not started are
            skipped. Under torchrun every rank agrees on it (:meth:`~ckpttool.ops.distributed.Group.agree`).
    """
    reader = ctx.reader
    t0 = time.perf_counter()
    start_bytes = reader.bytes_read
    res = DeepResult()
    metas = {k: m for k, m in reader.metadata.entries.items() if isinstance(m, TensorMeta)}
    ok = {k for k, m in metas.items() if _readable(ctx, k, m)}
    res.pairs = [p for p in _pairs(ctx) if p.a in ok and p.b in ok]
    items = _plan_items(ctx, metas, ok, res)
    group = distributed.current()  # torchrun: each rank reads (and CRC-checks) its share of the chunks
    if group.active:
        owners = group.share([it.nbytes for it in items])
        items = [it for it, r in zip(items, owners) if group.owns(r)]
    run = _DeepRun(ctx, metas, res, sum(it.nbytes for it in items), progress)
    if progress is not None:  # the total, before the first byte is read
        progress(0, run.total)
    error = _run_workers(run, items, workers, res)
    streamed = run.streamed_bytes
    if group.active:
        group.agree(error)
        merged = _merge_ranks(group, run.partial, run.failed, res, reader.bytes_read - start_bytes + streamed)
        streamed = merged - (reader.bytes_read - start_bytes)
    elif error is not None:
        raise error
    for k, st in run.partial.items():
        if k not in run.failed:
            res.stats[k] = st
    for p in res.pairs:
        if p.a in run.failed or p.b in run.failed:
            p.compared = False
    _read_byte_items(ctx, res)
    res.bytes_read = reader.bytes_read - start_bytes + streamed
    res.seconds = time.perf_counter() - t0
    return res


def _plan_items(ctx: Context, metas: dict[str, TensorMeta], ok: set[str], res: DeepResult) -> list[_Item]:
    """The work items over the readable tensors ``ok``, in storage order.

    Keys of a pair (and pairs sharing a key) form one group: with the same chunking one item
    per chunk of all members, else one item reading the members whole. A group with no
    non-empty chunk gets its (empty) statistics in ``res.stats`` here.
    """
    md = ctx.reader.metadata
    parent: dict[str, str] = {}  # union of keys that must be read together

    def find(k: str) -> str:
        while parent.get(k, k) != k:
            k = parent[k]
        return k

    for p in res.pairs:
        ra, rb = find(p.a), find(p.b)
        if ra != rb:
            parent[rb] = ra
    groups: dict[str, list[str]] = {}
    for k in metas:
        if k in ok:
            groups.setdefault(find(k), []).append(k)
    items: list[_Item] = []
    for members in groups.values():
        first = metas[members[0]]
        tiles = [c for c in first.chunks if c.numel > 0]
        same = all(
            sorted((c.offsets, c.sizes) for c in metas[k].chunks if c.numel > 0)
            == sorted((c.offsets, c.sizes) for c in tiles)
            for k in members[1:]
        )
        if same:
            for c in tiles:
                info = md.storage_for(members[0], c)
                assert info is not None
                nb = sum(c.numel * metas[k].dtype.itemsize for k in members)
                items.append(_Item(tuple(members), c, (info.relative_path, info.offset), nb))
            if not tiles:
                for k in members:
                    res.stats[k] = TensorStats(k, metas[k].dtype.name)
        else:
            info = md.storage_for(members[0], tiles[0]) if tiles else None
            order = (info.relative_path, info.offset) if info else ("", 0)
            items.append(_Item(tuple(members), None, order, sum(metas[k].nbytes for k in members)))
    items.sort(key=lambda it: it.order)
    return items


def _merge_stats(into: dict[str, TensorStats], stats: dict[str, TensorStats]) -> None:
    for k, st in stats.items():
        if k in into:
            into[k].add(st)
        else:
            into[k] = st


class _DeepRun:
    """The shared state of one pass's workers: summaries, failures, pair counts and progress (under ``lock``).

    Attributes:
        partial: key -> summary of the chunks read so far; failed: keys with a read error.
        streamed_bytes: data bytes read by the numpy path (the torch path counts in the reader).
    """

    def __init__(
        self,
        ctx: Context,
        metas: dict[str, TensorMeta],
        res: DeepResult,
        total: int,
        progress: ProgressFn | None,
    ) -> None:
        self.ctx, self.reader, self.metas, self.res = ctx, ctx.reader, metas, res
        self.pairs_by_key: dict[str, list[PairStats]] = {}
        for p in res.pairs:
            self.pairs_by_key.setdefault(p.a, []).append(p)
        self.lock = threading.Lock()
        self.bufs = _Buffers()
        self.partial: dict[str, TensorStats] = {}
        self.failed: set[str] = set()
        self.done, self.total = 0, total
        self.progress = progress
        self.streamed_bytes = 0

    def work(self, it: _Item) -> None:
        try:
            self._work_on(it)
        finally:
            if it.chunk is not None:  # a remote checkpoint: the chunk's windows leave the spool once checked
                _evict(self.reader, it.keys, it.chunk)

    def _work_on(self, it: _Item) -> None:
        if it.chunk is not None:
            item_pairs = [p for k in it.keys for p in self.pairs_by_key.get(k, ()) if p.b in it.keys]
            try:
                streamed = _stream_item(self.ctx, it.keys, it.chunk, self.metas, item_pairs)
            except CkptError as e:
                self._fail(it, e)
                return
            if streamed is not None:
                self._add_streamed(it, item_pairs, *streamed)
                return
        try:
            tensors = self._read_tensors(it)
        except CkptError as e:
            self._fail(it, e)
            return
        local = {
            k: _summarise(k, t, self.metas[k].dtype.name, second_moment(k), _is_step(k), k in self.ctx.cat.model)
            for k, t in tensors.items()
        }
        with self.lock:
            _merge_stats(self.partial, local)
        for k in it.keys:
            for p in self.pairs_by_key.get(k, ()):
                if p.b in tensors:
                    with self.lock:
                        _compare(p, tensors[p.a], tensors[p.b], it.chunk)
        if self.progress is not None:
            with self.lock:
                self._advance(it)

    def _read_tensors(self, it: _Item) -> dict[str, torch.Tensor]:
        """The torch path: every member's chunk (into this thread's buffers) or whole tensor."""
        tensors: dict[str, torch.Tensor] = {}
        for slot, k in enumerate(it.keys):
            meta = self.metas[k]
            if it.chunk is None:
                tensors[k] = self.reader.read_tensor(k)
            else:
                out = self.bufs.view(slot, it.chunk.numel * meta.dtype.itemsize, meta.dtype.to_torch(), it.chunk.sizes)
                tensors[k] = self.reader.read_chunk(k, it.chunk, out=out)
        return tensors

    def _fail(self, it: _Item, e: CkptError) -> None:
        if len(it.keys) > 1:
            # keys read together (a moment pair, a parameter and its master weight): the error is one key's, so each
            # is read again alone, and only the ones that fail are reported (an intact exp_avg_sq beside a corrupt
            # exp_avg is not "unreadable", and its values are still checked); their pair is not compared
            for k in it.keys:
                self._work_on(_Item((k,), it.chunk, it.order, 0))
            return
        with self.lock:
            for k in it.keys:
                self.res.read_errors.setdefault(k, e)
                self.failed.add(k)

    def _add_streamed(
        self,
        it: _Item,
        item_pairs: list[PairStats],
        stats: dict[str, TensorStats],
        counts: dict[int, _PairCount],
        nb: int,
    ) -> None:
        with self.lock:
            self.streamed_bytes += nb
            _merge_stats(self.partial, stats)
            for j, c in counts.items():
                _add_count(item_pairs[j], c, it.chunk, tuple(self.metas[item_pairs[j].a].size))
            if self.progress is not None:
                self._advance(it)

    def _advance(self, it: _Item) -> None:
        """Count ``it`` done and report progress (the caller holds ``lock``)."""
        assert self.progress is not None
        self.done += it.nbytes
        self.progress(self.done, self.total)


def _run_workers(run: _DeepRun, items: list[_Item], workers: int | None, res: DeepResult) -> Exception | None:
    """Run ``run.work`` over ``items`` on ``res.workers`` threads of the shared pool; the first error, in item order.

    After an error the items not started are skipped (the running ones end first); Ctrl-C does
    the same, then propagates. The threads' slice buffers are released at the end.
    """
    n = workers or min(8, max(2, os.cpu_count() or 2))
    n = max(1, min(n, len(items))) if items else 1
    res.workers = n
    try:
        map_ordered(run.work, items, workers=n)
    except Exception as e:  # returned, not swallowed: every rank agrees on it, then the caller raises it
        return e
    finally:
        _release_buffers()
    return None


def _read_byte_items(ctx: Context, res: DeepResult) -> None:
    """Byte items not read yet: loadable safely? (``step`` items of old optimizers keep their value.)"""
    reader = ctx.reader
    known = set(ctx.byte_item_errors)
    for g in ctx.cat.param_groups:
        known.update(g.keys.values())  # read (or recorded as unreadable) with the param groups
    if ctx.layout is None or not ctx.layout.foreign_item:  # a trainer's own 'layout' item is read as any other
        known.add(LAYOUT_KEY)
    for key, meta in reader.metadata.entries.items():
        if not isinstance(meta, BytesMeta) or key in known or not ctx.storage_ok(key):
            continue
        try:
            value = reader.read_object(key)
        except CkptError as e:
            ctx.byte_item_errors[key] = e
            continue
        if _is_step(key):
            res.byte_values[key] = value
