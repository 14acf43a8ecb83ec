"""Value comparison of two tensors of one shape, block by block (bitwise, cast, or within a tolerance).

Bitwise equality compares bit patterns (``-0.0 != 0.0``, a NaN equals the same NaN), as
``torch.equal`` on integer views of the bytes. With ``as_dtype`` both sides are cast first
(``Tensor.to``: round to nearest even, as ckpttool's export and ``torch`` cast). With a
tolerance an element is *outside* when ``|a - b| > atol + rtol * |b|`` (``numpy.isclose``
with B the reference; NaN equals NaN, an infinity equals the same infinity only).

Work is done on flat blocks of :data:`BLOCK_ELEMENTS` elements, so the only memory beyond
the two tensors is a few blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["BLOCK_ELEMENTS", "ValueDiff", "compare_tensors", "same_bytes", "unravel"]

BLOCK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class ValueDiff:
    """How two tensors' values differ.

    Attributes:
        mismatched: elements that differ (bitwise) or lie outside the tolerance.
        first: flat index of the first such element (``None``: none).
        max_abs_error, max_rel_error: over all elements (floating/integer values; ``None`` when
            equal or not computed), the relative error against ``|b|``.
        a_value, b_value: the two values at ``first`` (as Python numbers).
    """

    mismatched: int
    first: int | None
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    a_value: float | int | bool | None = None
    b_value: float | int | bool | None = None


def unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    """The index in ``shape`` (C order) of flat element ``flat``."""
    out = []
    for s in reversed(shape):
        flat, r = divmod(flat, s) if s else (flat, 0)
        out.append(r)
    return out[::-1]


_memcmp: Any = None


def same_bytes(a: Any, b: Any) -> bool:
    """Whether two contiguous CPU tensors of one dtype and shape hold the same bytes.

    libc ``memcmp`` through ``ctypes`` (the GIL released): several times faster than ``torch.equal``
    on integer views or numpy's ``==`` (``docs/performance.md``).
    """
    global _memcmp
    import torch

    if not (a.is_contiguous() and b.is_contiguous()) or a.device.type != "cpu" or b.device.type != "cpu":
        return bool(torch.equal(_int_view(a), _int_view(b)))
    n = a.numel() * a.element_size()
    if n == 0:
        return True
    if _memcmp is None:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        fn = libc.memcmp
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        _memcmp = fn
    return bool(_memcmp(a.data_ptr(), b.data_ptr(), n) == 0)


def _int_view(t: Any) -> Any:
    import torch

    size = t.element_size()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])


def _py(v: Any) -> float | int | bool:
    x = v.item()
    return float(x) if isinstance(x, float) and not math.isfinite(x) else x


def _errors(a: Any, b: Any) -> tuple[Any, Any, Any]:
    """``|a-b|`` (0 where equal, NaN where exactly one is NaN), ``|b|``, and ``both NaN`` (float64)."""
    import torch

    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    diff = (a64 - b64).abs()
    same = a64 == b64  # equal infinities
    both_nan = a64.isnan() & b64.isnan()
    diff = torch.where(same | both_nan, torch.zeros_like(diff), diff)
    return diff, b64.abs(), both_nan


def compare_tensors(
    a: Any,
    b: Any,
    *,
    as_dtype: Any = None,
    rtol: float | None = None,
    atol: float | None = None,
) -> ValueDiff:
    """Compare two tensors of the same shape (see the module docstring).

    Args:
        a, b: CPU tensors of one shape (contiguous or not); same dtype unless ``as_dtype``
            or a tolerance is given.
        as_dtype: a ``torch.dtype`` both are cast to first.
        rtol, atol: tolerance comparison (either may be ``None`` = 0); both ``None``: bitwise.

    Returns:
        :class:`ValueDiff`.
    """
    import torch

    assert tuple(a.shape) == tuple(b.shape), "compare_tensors needs tensors of one shape"
    tolerant = rtol is not None or atol is not None
    if not tolerant and as_dtype is None and a.dtype == b.dtype and same_bytes(a, b):
        return ValueDiff(0, None)  # the common case in one call
    fa, fb = a.reshape(-1), b.reshape(-1)
    n = fa.numel()
    rt, at = rtol or 0.0, atol or 0.0
    mismatched, first = 0, None
    max_abs = max_rel = 0.0
    a_val = b_val = None
    numeric = (fa.dtype.is_floating_point or not fa.dtype == torch.bool) and fa.dtype != torch.bool
    for start in range(0, n, BLOCK_ELEMENTS):
        xa = fa[start : start + BLOCK_ELEMENTS]
        xb = fb[start : start + BLOCK_ELEMENTS]
        if as_dtype is not None:
            xa, xb = xa.to(as_dtype), xb.to(as_dtype)
        found = _block_mismatch(xa, xb, tolerant, rt, at, numeric)
        if found is None:
            continue
        cnt, ne, diff, ref = found
        if numeric:
            max_abs, max_rel = _error_bounds(diff, ref, max_abs, max_rel)
        if cnt:
            if first is None:
                i = int(ne.nonzero()[0, 0])
                first = start + i
                a_val, b_val = _py(xa[i]), _py(xb[i])
            mismatched += cnt
    if mismatched == 0 and not tolerant:
        return ValueDiff(0, None)
    return ValueDiff(
        mismatched,
        first,
        max_abs if numeric else None,
        max_rel if numeric else None,
        a_val,
        b_val,
    )


def _block_mismatch(
    xa: Any, xb: Any, tolerant: bool, rt: float, at: float, numeric: bool
) -> tuple[int, Any, Any, Any] | None:
    """``(mismatched count, mask, |a-b|, |b|)`` of one block (the errors ``None`` unless numeric).

    ``None``: a bitwise comparison found the block equal (nothing to add).
    """
    diff = ref = None
    if not tolerant:
        if xa.dtype == xb.dtype and same_bytes(xa, xb):
            return None
        ne = _int_view(xa) != _int_view(xb) if xa.dtype == xb.dtype else xa != xb
        cnt = int(ne.sum())
        if not cnt:
            return None
        if numeric:
            diff, ref, _ = _errors(xa, xb)
        return cnt, ne, diff, ref
    diff, ref, both_nan = _errors(xa, xb)
    bad = (diff > at + rt * ref) | (diff.isnan() & ~both_nan)
    return int(bad.sum()), bad, diff, ref


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
