"""Value comparison of two tensors of one shape, block by block (bitwise, cast, or within a tolerance).

Bitwise equality compares bit patterns (``-0.0 != 0.0``, a NaN equals the same NaN), as
``torch.equal`` on integer views of the bytes. With ``as_dtype`` both sides are cast first
(``Tensor.to``: round to nearest even, as ckpttool's export and ``torch`` cast). With a
tolerance an element is *outside* when ``|a - b| > atol + rtol * |b|`` (``numpy.isclose``
with B the reference; NaN equals NaN, an infinity equals the same infinity only; int64 values exactly, not as
float64 rounds them).

Besides the verdict, :class:`Metrics` (``max |a-b|``, relative L2 ``||a-b|| / ||b||``,
cosine) come from float64 sums (``sum (a-b)^2``, ``sum a^2``, ``sum b^2``, ``sum a*b``)
accumulated block by block; a block equal on both sides adds one dot product.

Work is done on flat blocks of :data:`BLOCK_ELEMENTS` elements, so the only memory beyond
the two tensors is a few blocks (float64 copies of one block at a time).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckpttool.engine.memcmp import memcmp
from ckpttool.format.tiling import unravel

__all__ = [
    "BLOCK_ELEMENTS",
    "IDENTICAL",
    "Metrics",
    "Tolerance",
    "ValueCompare",
    "ValueDiff",
    "compare_tensors",
    "same_bytes",
    "unravel",
]

BLOCK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Metrics:
    """Whole-tensor metrics of two values, from float64 sums accumulated block by block.

    ``sum_dd`` is ``sum (a-b)^2`` with an element counted 0 where both are equal (equal
    infinities, a NaN against the same NaN, as the bitwise comparison); ``sum_aa``, ``sum_bb``,
    ``sum_ab`` are ``sum a^2``, ``sum b^2``, ``sum a*b`` (``None``: not computed, the values are
    identical). Values as compared (after an ``as_dtype`` cast).
    """

    max_abs: float
    sum_dd: float
    sum_aa: float | None = None
    sum_bb: float | None = None
    sum_ab: float | None = None

    @property
    def rel_l2(self) -> float:
        """``||a-b|| / ||b||`` (0 when every element is equal; ``inf`` when ``b`` is 0 and ``a`` is not)."""
        if self.sum_dd == 0:
            return 0.0
        if self.sum_bb is None or self.sum_bb == 0:
            return math.inf if not math.isnan(self.sum_dd) else math.nan
        return math.sqrt(self.sum_dd) / math.sqrt(self.sum_bb)

    @property
    def cosine(self) -> float | None:
        """``a.b / (||a|| ||b||)`` in ``[-1, 1]``: 1 when every element is equal; ``None`` when one side is all zero
        and they differ. The float64 sums of two nearly equal tensors can give ``1 + 2^-52``: that is 1."""
        if self.sum_dd == 0:
            return 1.0
        if self.sum_aa is None or self.sum_bb is None or self.sum_ab is None:
            return None
        if self.sum_aa == 0 or self.sum_bb == 0:
            return None
        cos = self.sum_ab / (math.sqrt(self.sum_aa) * math.sqrt(self.sum_bb))
        return cos if math.isnan(cos) else min(1.0, max(-1.0, cos))


#: The metrics of two identical tensors (no element read).
IDENTICAL = Metrics(0.0, 0.0)


@dataclass(frozen=True)
class ValueDiff:
    """How two tensors' values differ.

    Attributes:
        mismatched: elements that differ (bitwise) or lie outside the tolerance.
        first: flat index of the first such element (``None``: none).
        max_abs_error, max_rel_error: over all elements (floating/integer values; ``None`` when
            equal or not computed), the relative error against ``|b|``.
        a_value, b_value: the two values at ``first`` (as Python numbers).
        metrics: :class:`Metrics` of the whole tensors (``None``: booleans).
        rows: ``(sum (a-b)^2, sum b^2)`` of each block of ``rows`` elements along the flat values (a tensor of
            stacked layers ``[L, ...]``: each layer's), when asked for and the values were decoded; else ``()``.
        not_bitwise: values of one stored dtype whose stored bits differ where every element is within the
            tolerance and no sum tells (``-0.0`` against ``0.0``, NaNs of other payloads: ``|a-b|`` 0 there), or is
            equal only after the ``as_dtype`` cast (float32 step counters 1001 and 1002 are both 1000 as bfloat16).
    """

    mismatched: int
    first: int | None
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    a_value: float | int | bool | None = None
    b_value: float | int | bool | None = None
    metrics: Metrics | None = IDENTICAL
    rows: tuple[tuple[float, float], ...] = ()
    not_bitwise: bool = False


def same_bytes(a: Any, b: Any) -> bool:
    """Whether two contiguous CPU tensors of one dtype and shape hold the same bytes.

    libc ``memcmp`` (:mod:`ckpttool.engine.memcmp`, the GIL released): several times faster than
    ``torch.equal`` on integer views or numpy's ``==`` (``docs/performance.md``).
    """
    import torch

    if not (a.is_contiguous() and b.is_contiguous()) or a.device.type != "cpu" or b.device.type != "cpu":
        return bool(torch.equal(_int_view(a), _int_view(b)))
    n = a.numel() * a.element_size()
    return n == 0 or memcmp(a.data_ptr(), b.data_ptr(), n) == 0


def _int_view(t: Any) -> Any:
    import torch

    size = t.element_size()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])


def _py(v: Any) -> float | int | bool:
    import torch

    x = v.view(torch.uint8).item() if v.dtype == torch.float4_e2m1fn_x2 else v.item()  # FP4: the byte of two codes
    return float(x) if isinstance(x, float) and not math.isfinite(x) else x


class _Sums:
    """Running float64 sums of :class:`Metrics` and the error bounds, block by block; with ``rows`` (elements per
    row block, 0: none) also ``sum (a-b)^2`` and ``sum b^2`` of each row block (:attr:`ValueDiff.rows`)."""

    def __init__(self, rows: int = 0) -> None:
        self.dd = self.aa = self.bb = self.ab = 0.0
        self.max_abs = self.max_rel = 0.0
        self.rows = rows
        self.per_row: dict[int, list[float]] = {}

    def add(self, a64: Any, b64: Any, diff: Any, start: int = 0, errors: tuple[Any, Any] | None = None) -> None:
        """``errors``: ``(|a-b|, |b|)`` per element where ``diff`` and ``b64`` are not (complex values as pairs: the
        moduli); default ``(diff, |b64|)``."""
        import torch

        self.dd += float(torch.dot(diff, diff))
        self.aa += float(torch.dot(a64, a64))
        self.bb += float(torch.dot(b64, b64))
        self.ab += float(torch.dot(a64, b64))
        err, ref = errors if errors is not None else (diff, b64.abs())
        self.max_abs, self.max_rel = _error_bounds(err, ref, self.max_abs, self.max_rel)
        for r, lo, hi in self._row_spans(start, diff.numel()):
            acc = self.per_row.setdefault(r, [0.0, 0.0])
            acc[0] += float(torch.dot(diff[lo:hi], diff[lo:hi]))
            acc[1] += float(torch.dot(b64[lo:hi], b64[lo:hi]))

    def add_equal(self, a64: Any, start: int = 0) -> None:
        """A block equal on both sides (bitwise): ``a == b``, so one dot product gives the three sums."""
        import torch

        sq = float(torch.dot(a64, a64))
        self.aa += sq
        self.bb += sq
        self.ab += sq
        for r, lo, hi in self._row_spans(start, a64.numel()):
            self.per_row.setdefault(r, [0.0, 0.0])[1] += float(torch.dot(a64[lo:hi], a64[lo:hi]))

    def _row_spans(self, start: int, n: int) -> list[tuple[int, int, int]]:
        """``(row block, lo, hi)`` of the block's elements ``[lo, hi)`` (block-relative) in each row block."""
        if not self.rows:
            return []
        out, pos = [], start
        while pos < start + n:
            r = pos // self.rows
            end = min(start + n, (r + 1) * self.rows)
            out.append((r, pos - start, end - start))
            pos = end
        return out

    def row_sums(self) -> tuple[tuple[float, float], ...]:
        return tuple((d, b) for _, (d, b) in sorted(self.per_row.items()))

    def metrics(self) -> Metrics:
        return Metrics(self.max_abs, self.dd, self.aa, self.bb, self.ab)


def _pairs(t: Any) -> Any:
    """A (complex or real) 1-d block as float64 ``(real, imaginary)`` pairs, flattened."""
    import torch

    return torch.view_as_real(t.to(torch.complex128)).reshape(-1)


def _modulus(pairs: Any) -> Any:
    """The modulus ``|z|`` of each ``(real, imaginary)`` pair of a flat float64 block (NaN where a part is NaN and
    the other is not infinite)."""
    import torch

    z = pairs.view(-1, 2)
    return torch.hypot(z[:, 0], z[:, 1])


def _errors(a: Any, b: Any) -> tuple[Any, Any, Any, Any]:
    """``a`` and ``b`` as float64, ``|a-b|`` (0 where equal, NaN where exactly one is NaN), ``both NaN``."""
    import torch

    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    diff = (a64 - b64).abs()
    same = a64 == b64  # equal infinities
    if a.dtype == b.dtype == torch.int64:  # float64 holds 53 bits: 2**60 + 1 and 2**60 would be 0 apart
        exact = (a - b).abs().to(torch.float64)  # no int64 overflow where the float64 difference is below 2**62
        diff, same = torch.where(diff < 2.0**62, exact, diff), a == b
    both_nan = a64.isnan() & b64.isnan()
    diff = torch.where(same | both_nan, torch.zeros_like(diff), diff)
    return a64, b64, diff, both_nan


#: ``atol(positions)``: the absolute tolerance of each element at those flat positions of the tensor
#: (int64 tensor in, float64 tensor out).
AtolAt = Callable[[Any], Any]


@dataclass(frozen=True)
class Tolerance:
    """How two values are compared (:func:`compare_tensors`, :class:`ValueCompare`); the default: bitwise."""

    as_dtype: Any = None
    """A ``torch.dtype`` both sides are cast to first (``None``: none)."""
    rtol: float | None = None
    """Relative tolerance (``None`` = 0; ``rtol`` and ``atol`` both ``None``: bitwise)."""
    atol: float | AtolAt | None = None
    """Absolute tolerance (``None`` = 0), or an :data:`AtolAt`: one value per element (a block-FP8 side:
    each block's own scale)."""
    rows: int | None = None
    """Elements per row block whose own sums :attr:`ValueDiff.rows` gives (stacked layers: one layer's)."""

    @property
    def tolerant(self) -> bool:
        """A tolerance is given (else the comparison is bitwise)."""
        return self.rtol is not None or self.atol is not None


#: Bitwise, no cast.
EXACT = Tolerance()


def compare_tensors(a: Any, b: Any, how: Tolerance = EXACT) -> ValueDiff:
    """Compare two tensors of the same shape (see the module docstring).

    Besides the mismatch count, the :class:`Metrics` of the two (``max |a-b|``, relative L2,
    cosine) are accumulated in float64 block by block (:class:`ValueCompare`): each block is
    converted once, no whole-tensor copy is made.

    Args:
        a, b: CPU tensors of one shape (contiguous or not); same dtype unless ``how`` casts or
            has a tolerance.
        how: the :class:`Tolerance` (default bitwise).

    Returns:
        :class:`ValueDiff` (``metrics`` :data:`IDENTICAL` when the bytes are equal, ``None`` for booleans).
    """
    assert tuple(a.shape) == tuple(b.shape), "compare_tensors needs tensors of one shape"
    if how.as_dtype is None and a.dtype == b.dtype and same_bytes(a, b):
        return ValueDiff(0, None)  # the common case in one call
    fa, fb = a.reshape(-1), b.reshape(-1)
    acc = ValueCompare(fa.dtype, fb.dtype, how)
    for start in range(0, fa.numel(), BLOCK_ELEMENTS):
        acc.add(fa[start : start + BLOCK_ELEMENTS], fb[start : start + BLOCK_ELEMENTS], start)
    return acc.result()


class ValueCompare:
    """The running comparison of two flat values, fed block by block in order (:func:`compare_tensors`).

    Blocks are cut at multiples of :data:`BLOCK_ELEMENTS` from the first element (the float64
    sums, hence the metrics, depend on the cut); ``diff`` feeds it the blocks of two stored
    streams from the engine (:class:`~ckpttool.engine.plan.PairedSlabs`), or of two values in memory.

    Args:
        a_dtype, b_dtype: the ``torch.dtype`` of each side's blocks.
        how: the :class:`Tolerance` (default bitwise).
    """

    def __init__(self, a_dtype: Any, b_dtype: Any, how: Tolerance = EXACT) -> None:
        import torch

        self.as_dtype = how.as_dtype
        self.same_dtype = a_dtype == b_dtype
        self.same_bytes = True  # every block so far bitwise equal (as compared: after the cast)
        self.stored_same = True  # every block so far bitwise equal as stored (one dtype; else never read)
        self.tolerant = how.tolerant
        self.rt, self.at = how.rtol or 0.0, how.atol or 0.0
        # bool, and packed FP4 (which torch converts to nothing): compared by value codes, no float metrics
        self.numeric = not {a_dtype, b_dtype} & {torch.bool, torch.float4_e2m1fn_x2}
        complex_ = a_dtype.is_complex or b_dtype.is_complex  # (real, imaginary) pairs: no row blocks
        self.sums = _Sums(0 if complex_ or not how.rows else how.rows)
        self.mismatched = 0
        self.first: int | None = None
        self.values: tuple[Any, Any] = (None, None)

    def add(self, xa: Any, xb: Any, start: int) -> None:
        """Fold one block: ``xa``, ``xb`` the 1-d elements ``[start, start + len)`` of each side."""
        if self.as_dtype is not None:
            if self.same_dtype and self.stored_same:  # the cast can make stored values that differ equal
                self.stored_same = same_bytes(xa, xb)
            xa, xb = xa.to(self.as_dtype), xb.to(self.as_dtype)
        at = self.at if not callable(self.at) else (lambda i: self.at(i + start))  # type: ignore[operator]
        cnt, ne = _block_mismatch(xa, xb, self.tolerant, self.rt, at, self.numeric, self.sums, start)
        self.same_bytes = self.same_bytes and ne is None
        self.stored_same = self.stored_same and (self.as_dtype is not None or ne is None)
        if cnt:
            if self.first is None:
                i = int(ne.nonzero()[0, 0])
                self.first = start + i
                self.values = (_py(xa[i]), _py(xb[i]))
            self.mismatched += cnt

    def result(self) -> ValueDiff:
        """The :class:`ValueDiff` of everything added."""
        sums, numeric = self.sums, self.numeric
        if self.same_bytes and self.same_dtype and self.as_dtype is None:
            return ValueDiff(0, None)  # as compare_tensors' first check: the bytes are equal
        met = sums.metrics() if numeric else None
        rows = sums.row_sums() if numeric else ()
        not_bitwise = self.same_dtype and not self.stored_same
        if self.mismatched == 0 and not self.tolerant:
            return ValueDiff(0, None, metrics=met, rows=rows, not_bitwise=not_bitwise)
        return ValueDiff(
            self.mismatched,
            self.first,
            sums.max_abs if numeric else None,
            sums.max_rel if numeric else None,
            *self.values,
            met,
            rows,
            not_bitwise,
        )


def _block_mismatch(
    xa: Any, xb: Any, tolerant: bool, rt: float, at: float | AtolAt, numeric: bool, sums: _Sums, start: int = 0
) -> tuple[int, Any]:
    """``(mismatched count, mask)`` of one block (``None``: equal bytes); a numeric block's sums are added to ``sums``.
    ``at``: a number, or an :data:`AtolAt` of the block's element positions (asked only for the elements
    outside ``rt`` alone)."""
    import torch

    cx = xa.is_complex() or xb.is_complex()  # (real, imaginary) pairs: a cast to float would drop the imaginary parts
    if xa.dtype == xb.dtype and same_bytes(xa, xb):
        if numeric:
            sums.add_equal(_pairs(xa) if cx else xa.to(torch.float64), start)
        return 0, None
    if numeric:
        a64, b64, diff, both_nan = _errors(_pairs(xa), _pairs(xb)) if cx else _errors(xa, xb)
        # a complex element's error is the modulus |a-b| against |b|, as numpy.isclose and torch.isclose take it (the
        # parts each within atol left |a-b| up to sqrt(2) atol: 0.0008+0.0008j against 0 was within --atol 1e-3)
        err, ref = (_modulus(diff), _modulus(b64)) if cx else (diff, b64.abs())
        sums.add(a64, b64, diff, start, (err, ref))
        if tolerant:
            # an infinity is within only against the same infinity (diff 0 there): ``at + rt * |inf|`` is inf or
            # NaN and would let any value, the other infinity included, compare within (numpy.isclose's rule)
            inf, ne, nan_off = a64.isinf() | b64.isinf(), diff != 0, diff.isnan() & ~both_nan
            if cx:  # per element: an infinite part in a or b makes the whole element compare exactly (torch.isclose)
                inf, ne, nan_off = (t.view(-1, 2).any(1) for t in (inf, ne, nan_off))
            off = (inf & ne) | nan_off
            if callable(at):  # per-element atol (real values only: a dequantized side is float32)
                bad = err > rt * ref
                near = (bad & err.isfinite()).nonzero().flatten()
                if near.numel():
                    bad[near] = err[near] > at(near) + rt * ref[near]
                bad = bad | off
            else:
                bad = (err > at + rt * ref) | off
            return int(bad.sum()), bad
    ne = _int_view(xa) != _int_view(xb) if xa.dtype == xb.dtype else xa != xb
    return int(ne.sum()), ne


def _error_bounds(diff: Any, ref: Any, max_abs: float, max_rel: float) -> tuple[float, float]:
    """The running maximum absolute and relative errors with one block's (infinite once any is inf or NaN)."""
    finite = diff[diff.isfinite()]
    if finite.numel():
        max_abs = max(max_abs, float(finite.max()))
        rel = finite / ref[diff.isfinite()]
        rel = rel[~rel.isnan()]
        if rel.numel():
            max_rel = max(max_rel, float(rel.max()))
    if bool((diff.isinf() | diff.isnan()).any()):
        max_abs = max_rel = math.inf
    return max_abs, max_rel
