"""How many values of two stored tensors differ, streamed on the engine (no whole tensor in memory).

One side is read as a stream, the other's elements beside each slab (:class:`~ckpttool.engine.plan.PairedSlabs`).
A slab whose bytes are equal (one dtype) is skipped at ``memcmp`` speed; the others are compared on their values:

- one integer or bool dtype: bit for bit (``int64`` values above 2**53 are never rounded);
- one floating dtype: as values, floats narrower than 4 bytes (FP8, bfloat16, float16) widened to float32, which
  holds them exactly, and complex32 to complex64 (so ``-0.0`` equals ``0.0``);
- two dtypes: both widened to float64, or complex128 where one is complex (its imaginary part never dropped).

NaN against NaN is alike, NaN against a number differs. Used where one stored tensor is checked against another
(a tied ``lm_head.weight`` and its embedding at import, two ranks' copies of one replicated chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckpttool.engine.execute import run_item
from ckpttool.engine.io import BLOCK_BYTES
from ckpttool.engine.memcmp import first_difference
from ckpttool.engine.plan import Item, PairedSlabs, Window

__all__ = ["ValueDifference", "differing_values"]


@dataclass(frozen=True, slots=True)
class ValueDifference:
    """What differs between two tensors of ``numel`` elements each.

    ``count``: elements whose values differ; ``max_abs``: the largest ``|a - b|`` over them where finite (0.0 where
    none is); ``first``: the index of the first differing element (``None``: none differs) and ``first_values`` its
    ``(a, b)`` values (Python ``int``, ``float``, ``bool`` or ``complex``).
    """

    numel: int
    count: int = 0
    max_abs: float = 0.0
    first: int | None = None
    first_values: tuple[Any, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        vals = None if self.first_values is None else [_json_value(v) for v in self.first_values]
        return {
            "numel": self.numel,
            "count": self.count,
            "max_abs": self.max_abs,
            "first": self.first,
            "first_values": vals,
        }


def _json_value(v: Any) -> Any:
    return [v.real, v.imag] if isinstance(v, complex) else v


def _decoded(t: Any) -> Any:
    """``t`` in a dtype that torch compares and subtracts exactly (narrow floats widened, integers as they are)."""
    import torch

    if t.dtype == torch.complex32:
        return t.to(torch.complex64)
    if t.is_floating_point() and t.element_size() < 4:
        return t.to(torch.float32)
    return t


def differing_values(
    a: Window, a_dtype: Any, b: Window, b_dtype: Any, *, slab_bytes: int = BLOCK_BYTES
) -> ValueDifference:
    """Compare the values of the tensors stored raw in windows ``a`` and ``b`` (little-endian, C order), element by
    element; ``a_dtype`` / ``b_dtype`` are torch dtypes (``float4_e2m1fn_x2`` is compared as its bytes).

    ``slab_bytes``: bytes of the wider side compared at a time.

    Raises:
        ValueError: the windows do not hold the same number of elements.
        ShortReadError: a file ends before its window does.
    """
    import torch

    ia, ib = a_dtype.itemsize, b_dtype.itemsize
    numel = a.length // ia
    if a.length % ia or b.length % ib or b.length // ib != numel:
        raise ValueError(f"{a.length} bytes of {a_dtype} against {b.length} bytes of {b_dtype}")
    same = a_dtype == b_dtype
    exact = same and not (a_dtype.is_floating_point or a_dtype.is_complex)
    if same and a_dtype == torch.float4_e2m1fn_x2:
        a_dtype = b_dtype = torch.uint8  # two E2M1 values per byte that torch converts to nothing: their bits
        exact = True
    acc: dict[str, Any] = {"count": 0, "max_abs": 0.0, "first": None, "values": None}

    def fold(mine: memoryview, theirs: memoryview, first: int) -> None:
        if same and first_difference(mine, theirs) is None:
            return
        ta = _decoded(torch.frombuffer(mine, dtype=a_dtype))
        tb = _decoded(torch.frombuffer(theirs, dtype=b_dtype))
        if exact and ta.dtype != torch.bool:
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[ta.element_size()]
            ne = ta.view(bits) != tb.view(bits)
        else:
            if not same:
                wide = torch.complex128 if ta.is_complex() or tb.is_complex() else torch.float64
                ta, tb = ta.to(wide), tb.to(wide)
            ne = ta != tb
            if ta.is_floating_point() or ta.is_complex():
                ne &= ~(torch.isnan(ta) & torch.isnan(tb))
        at = torch.nonzero(ne).reshape(-1)
        if not at.numel():
            return
        acc["count"] += int(at.numel())
        da, db = ta[at], tb[at]
        wide = torch.complex128 if da.is_complex() or db.is_complex() else torch.float64
        d = (da.to(wide) - db.to(wide)).abs()
        if exact and da.dtype != torch.bool:  # integers: exact where the difference fits (float64 rounds above 2**53)
            d = torch.where(d < 2.0**62, (da.to(torch.int64) - db.to(torch.int64)).abs().to(torch.float64), d)
        d = d[torch.isfinite(d)]
        if d.numel():
            acc["max_abs"] = max(acc["max_abs"], float(d.max()))
        if acc["first"] is None:
            i = int(at[0])
            acc["first"], acc["values"] = first + i, (ta[i].item(), tb[i].item())

    if numel:
        slab = max(1, slab_bytes // max(ia, ib))
        run_item(Item.of(a.fd, a.offset, a.length, PairedSlabs((b,), ia, ib, slab, fold)))
    return ValueDifference(numel, acc["count"], acc["max_abs"], acc["first"], acc["values"])
