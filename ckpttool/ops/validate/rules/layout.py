"""Layout rules (``L``): the layout record and the EP layout of expert tensors (``docs/layouts.md``).

Built on the checkpoint's resolved layout (:func:`~ckpttool.layouts.declaration.resolve_layout`:
record, sidecar, declaration) and its chunk geometry
(:meth:`~ckpttool.layouts.declaration.ResolvedLayout.geometry`, metadata only).
"""

from __future__ import annotations

from collections.abc import Iterator

from ckpttool.errors import (
    AmbiguousLayoutError,
    LayoutConflictError,
    LayoutContradictionError,
)
from ckpttool.layouts.geometry import EPGeometry
from ckpttool.ops.validate.base import RULES, Finding, rule
from ckpttool.ops.validate.context import Context


def _geometry(ctx: Context) -> list[EPGeometry]:
    if ctx.layout is None:
        return []
    return ctx.layout.geometry(ctx.cat)


def _shape_problems(g: EPGeometry, ep_size: int | None) -> list[str]:
    """The shape/expert-count part of a geometry's problems (the rest is chunk geometry: L005)."""
    if not g.shape:
        return ["named by the layout record but not in the checkpoint"]
    out = []
    if not 0 <= g.ep_dim < len(g.shape):
        return [f"ep_dim {g.ep_dim} is not a dim of shape {list(g.shape)}"]
    if g.shape[g.ep_dim] != g.num_experts:
        out.append(f"dim {g.ep_dim} has {g.shape[g.ep_dim]} entries but num_experts is {g.num_experts}")
    if ep_size is not None and g.num_experts % ep_size:
        out.append(f"num_experts {g.num_experts} is not divisible by ep_size {ep_size}")
    return out


@rule("L001")
def layout_record_invalid(ctx: Context) -> Iterator[Finding]:
    e = ctx.layout_error
    if e is not None and not isinstance(e, (LayoutConflictError, LayoutContradictionError, AmbiguousLayoutError)):
        yield RULES["L001"].make("layout", e.message, e.hint or None, e.code)


@rule("L002")
def layout_record_conflict(ctx: Context) -> Iterator[Finding]:
    e = ctx.layout_error
    if e is not None and isinstance(e, LayoutConflictError):
        yield RULES["L002"].make("layout.json", e.message, e.hint or None, e.code)


@rule("L003")
def ep_layout_ambiguous(ctx: Context) -> Iterator[tuple[str, str, str]]:
    if ctx.layout is None:
        return
    amb = ctx.layout.ambiguous
    if amb:
        more = f" and {len(amb) - 1} more EP tensors" if len(amb) > 1 else ""
        pairs = sorted({pf for k in amb for pf in ctx.layout.candidates.get(k, ())})
        fits = ", ".join(f"ep_size {p} x ep_fsdp_size {f}" for p, f in pairs[:6])
        yield (
            amb[0],
            (
                f"{amb[0]}{more}: the expert dim is split into blocks that EP and EP-FSDP may both have sharded "
                f"({fits or 'sizes unknown'}) and there is no layout record; the stored expert order is unknown"
            ),
            ctx.layout.ambiguity_hint()
            .replace("`source_layout`", "--source-layout")
            .replace("`ep_size`", "--ep-size")
            .replace("`ep_fsdp_size`", "--ep-fsdp-size")
            .replace("`no_ep`", "--no-ep"),
        )


@rule("L004")
def ep_shape_inconsistent(ctx: Context) -> Iterator[tuple[str, str]]:
    if ctx.layout is None:
        return
    for g in _geometry(ctx):
        for p in _shape_problems(g, ctx.layout.ep_size):
            yield g.key, f"{g.key}: {p}"


@rule("L005")
def ep_geometry_mismatch(ctx: Context) -> Iterator[Finding | tuple[str, str]]:
    e = ctx.layout_error
    if e is not None and isinstance(e, LayoutContradictionError):
        yield RULES["L005"].make(e.fqn or "layout", e.message, e.hint or None, e.code)
        return
    if ctx.layout is None:
        return
    for g in _geometry(ctx):
        shape_part = set(_shape_problems(g, ctx.layout.ep_size))
        if shape_part:
            continue  # L004; the geometry is meaningless for a wrong shape
        for p in g.problems:
            yield g.key, f"{g.key}: {p}"
            break
