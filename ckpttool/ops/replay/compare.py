"""Element-wise comparison of replayed values with the reference, with dtype-aware tolerance.

For a field stored in dtype ``D`` computed in dtype ``A`` an element passes when
``|actual - ref| <= atol + rtol_eff * scale``, ``scale = |ref_0| + sum_k |ref_k - ref_{k-1}|``,
``rtol_eff = max(rtol, 2 * eps(D), 4 * eps(A))``; with K > 1 steps the master adds
``2 * eps(moment dtype)`` of the path after the first step, and a low-precision value stored
between steps (no master) ``2 * (K - 1) * eps(D) * |ref|``. ``eps`` is ``torch.finfo(dtype).eps``.
Derivation: ``docs/replay.md``, "Tolerance".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpttool.format.jsonview import json_fields, json_number

if TYPE_CHECKING:
    import torch

__all__ = [
    "FieldError",
    "compare_field",
    "effective_rtol",
    "count_unequal",
    "count_unequal_nan_equal",
    "machine_eps",
    "merge_field_errors",
]

_CHUNK = 1 << 22
_EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}


def machine_eps(dtype: str) -> float:
    """Machine epsilon of a dtype name (0 for unknown names)."""
    return _EPS.get(dtype, 0.0)


def effective_rtol(rtol: float, stored: str, arithmetic: str) -> float:
    """``max(rtol, 2 * eps(stored), 4 * eps(arithmetic))`` (see module docstring)."""
    return max(rtol, 2 * _EPS.get(stored, 0.0), 4 * _EPS.get(arithmetic, 0.0))


@dataclass(frozen=True)
class FieldError:
    """How far one replayed field is from the reference.

    Attributes:
        max_abs: ``max |actual - ref|``.
        max_rel: ``max |actual - ref| / |ref|`` over elements with ``ref != 0`` (0 when none).
        ratio: ``max |actual - ref| / allowed``; the field passes when ``ratio <= 1``.
        bad: elements beyond tolerance.
        rtol: the effective relative tolerance used.
    """

    max_abs: float
    max_rel: float
    ratio: float
    bad: int
    rtol: float

    @property
    def ok(self) -> bool:
        return self.bad == 0

    def to_dict(self) -> dict[str, Any]:
        """The fields (a non-finite one as ``"inf"`` / ``"nan"``: a NaN saved value makes the errors infinite)."""
        return {k: json_number(v) for k, v in json_fields(self).items()}


def compare_field(
    actual: torch.Tensor,
    ref: torch.Tensor,
    scale: torch.Tensor,
    *,
    rtol: float,
    atol: float,
    stored: str,
    arithmetic: str,
    late_path: torch.Tensor | None = None,
    late_rtol: float = 0.0,
    carry_rtol: float = 0.0,
) -> FieldError:
    """Compare ``actual`` (any float dtype, CPU) with ``ref`` (reference dtype, CPU).

    Args:
        actual: replayed values, the field's shape.
        ref: reference values, same shape (float64 or float32).
        scale: ``|ref_0| + sum |ref_k - ref_{k-1}|``, same shape and dtype as ``ref``.
        rtol, atol: user tolerance (``--tolerance``).
        stored: dtype name ``actual`` is stored in.
        arithmetic: dtype name the optimizer computed in.
        late_path: ``sum_{k>=2} |ref_k - ref_{k-1}|`` (K > 1), or ``None``.
        late_rtol: relative allowance on ``late_path`` (``2 * eps(moment dtype)`` for the master).
        carry_rtol: relative allowance on ``|ref|`` for per-step storage rounding (``2 * (K - 1) * eps(D)``).

    Returns:
        The :class:`FieldError`.
    """
    import torch

    r = effective_rtol(rtol, stored, arithmetic)
    n = actual.numel()
    if n == 0:
        return FieldError(0.0, 0.0, 0.0, 0, r)
    a, rf, sc = actual.reshape(-1), ref.reshape(-1), scale.reshape(-1)
    lp = late_path.reshape(-1) if late_path is not None and late_rtol > 0 else None
    tiny = torch.finfo(ref.dtype).tiny
    max_abs = max_rel = ratio = 0.0
    bad = 0
    for lo in range(0, n, _CHUNK):  # bounded temporaries: a few chunk-sized reference-dtype tensors
        hi = min(lo + _CHUNK, n)
        r_chunk = rf[lo:hi]
        d = a[lo:hi].to(ref.dtype).sub_(r_chunk).abs_()
        allowed = sc[lo:hi].mul(r).add_(atol)
        if lp is not None:
            allowed.add_(lp[lo:hi], alpha=late_rtol)
        r_abs = r_chunk.abs()
        if carry_rtol > 0:
            allowed.add_(r_abs, alpha=carry_rtol)
        bad += int((~(d <= allowed)).sum().item())  # NaN compares false: counted as bad
        m = float(d.max().item())
        max_abs = max(max_abs, m if m == m else float("inf"))
        q = float(d.div(allowed.clamp_min_(tiny)).max().item())
        ratio = max(ratio, q if q == q else float("inf"))
        rel = d.div_(r_abs).masked_fill_(r_abs == 0, 0.0)
        q = float(rel.max().item())
        max_rel = max(max_rel, q if q == q else float("inf"))
    return FieldError(max_abs, max_rel, ratio, bad, r)


def merge_field_errors(parts: list[FieldError]) -> FieldError:
    """One field's :class:`FieldError` from those of its slabs (maxima of the maxima, sum of the counts)."""
    return FieldError(
        max(e.max_abs for e in parts),
        max(e.max_rel for e in parts),
        max(e.ratio for e in parts),
        sum(e.bad for e in parts),
        parts[0].rtol,
    )


def count_unequal(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements where ``a`` and ``b`` differ bitwise-in-value (both the same dtype; NaN counts as unequal)."""
    return int((a != b).sum().item())


def count_unequal_nan_equal(a: torch.Tensor, b: torch.Tensor) -> int:
    """As :func:`count_unequal`, but an element NaN on both sides counts as equal.

    For the comparison with ``torch.optim.AdamW`` on the same saved state: a NaN saved value makes both steps NaN
    at the same elements, which is the replay reproducing torch, not differing from it.
    """
    differ = a != b
    if a.is_floating_point():
        differ &= ~(a.isnan() & b.isnan())
    return int(differ.sum().item())
