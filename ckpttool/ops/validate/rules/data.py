"""Deep rules (``D``, need ``--deep``): values read from the data files by :mod:`ckpttool.ops.validate.deep`."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

from ckpttool.errors import CkptError
from ckpttool.format.metadata import TensorMeta
from ckpttool.model.catalog import TensorEntry
from ckpttool.model.schemas.megatron import is_distopt_bucket
from ckpttool.ops.state_checks import MOMENTS, exp_avg_lost, synthesized
from ckpttool.ops.state_checks import step_not_count as why_not_count
from ckpttool.ops.validate.base import rule
from ckpttool.ops.validate.context import Context
from ckpttool.ops.validate.stats import PairStats, TensorStats, second_moment
from ckpttool.optim_state.bounds import adam_ratio_bound, beta1_span


@rule("D001")
def non_finite_values(ctx: Context) -> Iterator[tuple[str, str]]:
    assert ctx.deep_result is not None
    buffers = set(ctx.cat.non_persistent_buffers())  # masks hold -inf by design: M009 reports them
    for key, st in ctx.deep_result.stats.items():
        if st.nonfinite and not key.endswith(".step") and key not in buffers and st.dtype != "float8_e4m3fn":  # M022
            if not _additive_mask(ctx, key, st) and not is_distopt_bucket(key):  # its padding: any bits (K002)
                yield key, f"{key}: {st.nonfinite} {st.of_values()} are NaN or infinite"


#: The last name component of a model buffer that may hold ``-inf`` by design: an additive attention mask.
_MASK_NAME = re.compile(r"(^|[._])\w*mask\w*$", re.IGNORECASE)


def _additive_mask(ctx: Context, key: str, st: TensorStats) -> bool:
    """``key`` is a persistent additive attention mask (``register_buffer("causal_mask", full(-inf).triu(1))``):
    a model tensor named ``*mask*`` without optimizer state (a buffer, not a parameter such as a ``mask_token``)
    whose non-finite values are all ``-inf`` (no NaN, no ``+inf``)."""
    entry = ctx.cat.model.get(key)
    if entry is None or not _MASK_NAME.search(key) or ctx.cat.fqn_of(key) in ctx.cat.optimizer_state:
        return False
    if entry.nbytes > _MASK_READ_BYTES or (ctx.deep_result is not None and key in ctx.deep_result.read_errors):
        return False
    import numpy as np

    from ckpttool.engine.kernels import IEEE_BITS, float_values

    meta = ctx.reader.metadata.entries.get(key)
    if not isinstance(meta, TensorMeta) or meta.dtype.name not in IEEE_BITS:
        return False
    try:  # a mask is small (sequence x sequence): read again to tell -inf from NaN / +inf
        for chunk in meta.chunks:
            loc = ctx.reader.locate(key, chunk)
            if not loc.raw:
                return False
            buf = np.empty(loc.nbytes, np.uint8)
            ctx.reader.fetch(loc.info)  # a remote checkpoint: its window requested now
            ctx.reader.pread_into(loc.info, loc.record.data_offset, buf, key)
            v = float_values(buf, meta.dtype.name)
            if np.isnan(v).any() or np.isposinf(v).any():
                return False
    except CkptError:
        return False
    return True


#: The largest mask ``D001`` reads a second time (a 8192 x 8192 float32 mask).
_MASK_READ_BYTES = 1 << 28


@rule("D002")
def negative_exp_avg_sq(ctx: Context) -> Iterator[tuple[str, str]]:
    assert ctx.deep_result is not None
    for key, st in ctx.deep_result.stats.items():
        if second_moment(key) and st.negative and not is_distopt_bucket(key):  # padding: any bits (K002)
            yield key, f"{key}: {st.negative} {st.of_values()} are negative (min {st.min:.4g})"


@rule("D003")
def step_not_count(ctx: Context) -> Iterator[tuple[str, str]]:
    entries = {ctx.cat.state_key(f, "step"): ps.fields.get("step") for f, ps in ctx.cat.optimizer_state.items()}
    for key, values, item in saved_steps(ctx):
        if values is None:
            yield key, f"{key}: step is a {type(item).__name__}, not a number"
            continue
        t = entries.get(key)
        float32 = t.dtype == "float32" if isinstance(t, TensorEntry) else item is not None  # a number loads as float32
        for v in values:
            why = why_not_count(v, float32)
            if why is not None:
                yield key, f"{key}: step {why}"
                break
    yield from _group_steps_not_count(ctx)


def _group_steps_not_count(ctx: Context) -> Iterator[tuple[str, str]]:
    """The param groups' ``step`` of the trainer's common state (megatron-core's ``DistributedOptimizer`` keeps its
    shared step there and loads it into every parameter's ``step`` as a float32 tensor): the first that is no count,
    per optimizer."""
    name = ctx.ckpt.common_state_file
    try:
        common = ctx.ckpt.common_state() if name is not None else None
    except CkptError:
        return  # R002 names an unreadable common state
    if common is None:
        return
    for chain, groups in enumerate(common.groups):
        optimizer = f"chained optimizer {chain}" if len(common.groups) > 1 else "optimizer"
        for i, g in enumerate(groups):
            if "step" not in g:
                continue
            raw = g["step"]
            item = getattr(raw, "item", None)  # a 0-d tensor
            v = item() if callable(item) and not isinstance(raw, (int, float)) else raw
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                why: str | None = f"is a {type(raw).__name__}, not a number"
            else:
                why = why_not_count(float(v), True)
            if why is not None:
                yield f"{name}:optimizer", f"{name}: {optimizer} param group {i} step {why}"
                break


def saved_steps(ctx: Context) -> Iterator[tuple[str, list[float] | None, object]]:
    """Each saved optimizer ``step``, from the ``--deep`` pass: ``(key, values, byte item)``.

    ``values``: a tensor's values (its statistics), a byte item's number, ``[]`` when none was
    read, ``None`` for a byte item that is not a number (``byte item``: that value, else ``None``).
    """
    dr = ctx.deep_result
    assert dr is not None
    for fqn, ps in ctx.cat.optimizer_state.items():
        if "step" not in ps.fields:
            continue
        t = ps.fields["step"]
        key = ctx.cat.state_key(fqn, "step")
        if t is not None:
            st = dr.stats.get(t.key)
            yield key, st.values if st is not None else [], None
            continue
        v = dr.byte_values.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            yield key, [float(v)], v
        else:
            yield key, None if key in dr.byte_values else [], v


@rule("D004")
def master_divergence(ctx: Context) -> Iterator[tuple[str, str]]:
    assert ctx.deep_result is not None
    for p in ctx.deep_result.pairs:
        if p.kind == "master" and p.compared and p.mismatched:
            yield (
                p.a,
                (
                    f"{p.a}: {p.mismatched} of {p.numel} elements differ from {p.b} cast to the parameter "
                    f"dtype ({p.differences()})"
                ),
            )


@rule("D005")
def synthesized_optimizer_state(ctx: Context) -> Iterator[tuple[str, str]]:
    fqns = synthesized_from_stats(ctx)
    if fqns:
        more = f" and {len(fqns) - 1} more" if len(fqns) > 1 else ""
        yield fqns[0], f"{fqns[0]}{more}: step 1 with all-zero exp_avg and exp_avg_sq ({len(fqns)} parameter(s))"


def synthesized_from_stats(ctx: Context) -> list[str]:
    """Parameters whose state is synthesized, from the statistics of the ``--deep`` pass."""
    cat, deep = ctx.cat, ctx.deep_result
    if deep is None:
        return []
    states: list[tuple[str, float | None, list[bool | None]]] = []
    for fqn, ps in cat.optimizer_state.items():
        step = ps.fields.get("step")
        if not isinstance(step, TensorEntry) or not all(isinstance(ps.fields.get(m), TensorEntry) for m in MOMENTS):
            continue
        st = deep.stats.get(step.key)
        value = st.values[0] if st is not None and len(st.values) == 1 else None
        zeros: list[bool | None] = []
        for m in MOMENTS:
            entry = ps.fields[m]
            assert entry is not None
            ms = deep.stats.get(entry.key)
            zeros.append(ms.zero if ms is not None and ms.covers(entry.numel) else None)
        states.append((fqn, value, zeros))
    return synthesized(states)


def _moment_pairs(ctx: Context) -> dict[str, PairStats]:
    """``exp_avg`` key -> the deep pass's ``moments`` pair of it (compared ones only)."""
    assert ctx.deep_result is not None
    return {p.a: p for p in ctx.deep_result.pairs if p.kind == "moments" and p.compared}


def _step_value(ctx: Context, fqn: str) -> float | None:
    """The saved ``step`` of a parameter (one value), from the deep pass."""
    assert ctx.deep_result is not None
    ps = ctx.cat.optimizer_state.get(fqn)
    t = ps.fields.get("step") if ps is not None else None
    if isinstance(t, TensorEntry):
        st = ctx.deep_result.stats.get(t.key)
        vals = st.values if st is not None else []
    else:
        v = ctx.deep_result.byte_values.get(ctx.cat.state_key(fqn, "step"))
        vals = [float(v)] if isinstance(v, (int, float)) and not isinstance(v, bool) else []
    return vals[0] if len(vals) == 1 and math.isfinite(vals[0]) else None


@rule("D006")
def zero_exp_avg_sq(ctx: Context) -> Iterator[tuple[str, str]]:
    for p in _moment_pairs(ctx).values():
        if not p.mismatched:
            continue
        st = ctx.deep_result.stats.get(p.b) if ctx.deep_result is not None else None
        whole = " (the whole tensor is 0)" if st is not None and st.zero else ""
        yield p.b, f"{p.b}: {p.mismatched} of {p.numel} values are 0 where {p.a} is not{whole}"
    yield from _zero_amsgrad_maximum(ctx)


def _zero_amsgrad_maximum(ctx: Context) -> Iterator[tuple[str, str]]:
    """``D006`` of amsgrad's ``max_exp_avg_sq``, the running maximum of ``exp_avg_sq``: all zero beside an
    ``exp_avg`` that is not (whole tensors, from the deep pass's per-tensor summaries); an FP16 one beside an
    ``exp_avg_sq`` all zero too may have underflowed, and the ``exp_avg``/``exp_avg_sq`` pair judges it."""
    assert ctx.deep_result is not None
    stats = ctx.deep_result.stats
    for ps in ctx.cat.optimizer_state.values():
        m, mx = ps.fields.get("exp_avg"), ps.fields.get("max_exp_avg_sq")
        if not isinstance(m, TensorEntry) or not isinstance(mx, TensorEntry):
            continue
        sm, smx = stats.get(m.key), stats.get(mx.key)
        v = ps.fields.get("exp_avg_sq")
        sv = stats.get(v.key) if isinstance(v, TensorEntry) else None
        if smx is not None and smx.dtype == "float16" and (sv is None or sv.zero):  # FP16 underflow: D006's pair
            continue
        if sm is not None and smx is not None and smx.zero and sm.zero is False and smx.numel:
            yield mx.key, f"{mx.key}: all {smx.numel} values are 0 where {m.key} is not (the whole tensor is 0)"


@rule("D016")
def amsgrad_max_below_exp_avg_sq(ctx: Context) -> Iterator[tuple[str, str]]:
    """amsgrad's ``max_exp_avg_sq`` below ``exp_avg_sq`` (the deep pass's ``amsgrad`` pairs, read chunk by chunk with
    the moments): torch's Adam/AdamW store ``maximum(max_exp_avg_sq, exp_avg_sq)`` after updating ``exp_avg_sq``.
    A ``max_exp_avg_sq`` ``D006`` reports as all zero is left to it, as negative values are to ``D002``."""
    assert ctx.deep_result is not None
    zeroed = {key for key, _ in _zero_amsgrad_maximum(ctx)}
    pairs = {p.a: p for p in ctx.deep_result.pairs if p.kind == "amsgrad" and p.compared}
    for fqn, ps in ctx.cat.optimizer_state.items():
        mx = ps.fields.get("max_exp_avg_sq")
        p = pairs.get(mx.key) if isinstance(mx, TensorEntry) else None
        if p is None or not p.mismatched or p.a in zeroed:
            continue
        at = list(p.worst_at) if p.worst_at is not None else "?"
        yield (
            p.a,
            f"{fqn}: max_exp_avg_sq is below exp_avg_sq at {p.mismatched} of {p.numel} values (worst at {at}: "
            f"max_exp_avg_sq {p.worst_a:.6g} < exp_avg_sq {p.worst_b:.6g})",
        )


#: ``D007``: slack on the moment-ratio bound (moments stored in BF16 round).
RATIO_SLACK = 1.1


def _nonfinite_moments(ctx: Context, p: PairStats) -> str:
    """``D007``'s words on the moments' NaN and infinite values, which its ratio leaves out (``D001`` names them):
    ``"; 3 of 32 values of exp_avg are NaN or infinite, left out (D001)"``, or ``""``."""
    assert ctx.deep_result is not None
    parts = []
    for key, name in ((p.a, "exp_avg"), (p.b, "exp_avg_sq")):
        st = ctx.deep_result.stats.get(key)
        if st is not None and st.nonfinite:
            parts.append(f"{st.nonfinite} of {st.numel} values of {name}")
    return f"; {' and '.join(parts)} are NaN or infinite, left out (D001)" if parts else ""


@rule("D007")
def moments_beyond_adam_bound(ctx: Context) -> Iterator[tuple[str, str]]:
    by_avg = _moment_pairs(ctx)
    for fqn, ps in ctx.cat.optimizer_state.items():
        m = ps.fields.get("exp_avg")
        p = by_avg.get(m.key) if m is not None else None
        if p is None or p.max_diff <= 0:
            continue
        step = _step_value(ctx, fqn)
        if step == 0:  # the bound after no step is 0: both moments start at zero and change only in a step
            yield (
                p.b,
                f"{fqn}: exp_avg and exp_avg_sq are non-zero (max |exp_avg|/sqrt(exp_avg_sq) {p.max_diff:.4g}"
                f"{_nonfinite_moments(ctx, p)}) at step 0, before any Adam step: a step counter reset beside moments "
                "of a real run",
            )
            continue
        group = ctx.cat.group_of(fqn)
        betas = group.values.get("betas") if group is not None else None
        if step is None or step < 1 or not isinstance(betas, (list, tuple)) or len(betas) != 2:
            continue
        try:
            b1, b2 = float(betas[0]), float(betas[1])
        except (TypeError, ValueError):
            continue
        span = beta1_span(group.values) if group is not None else None
        bound = adam_ratio_bound(step, b1, b2, bias_corrected=False, span=span)
        if p.max_diff > bound * RATIO_SLACK:
            cycled = f", betas[0] cycled within [{span[0]:g}, {span[1]:g}]" if span is not None else ""
            yield (
                p.b,
                f"{fqn}: max |exp_avg|/sqrt(exp_avg_sq) is {p.max_diff:.4g}, beyond {bound:.4g}, the most Adam "
                f"allows after step {step:g} with betas ({b1:g}, {b2:g}){cycled}{_nonfinite_moments(ctx, p)}",
            )


@rule("D008")
def zero_moments_after_steps(ctx: Context) -> Iterator[tuple[str, str]]:
    deep = ctx.deep_result
    assert deep is not None
    for fqn, ps in ctx.cat.optimizer_state.items():
        zeros = []
        for f in MOMENTS:
            e = ps.fields.get(f)
            st = deep.stats.get(e.key) if isinstance(e, TensorEntry) else None
            zeros.append(st is not None and st.covers(e.numel) and st.numel > 0 and bool(st.zero))  # type: ignore[union-attr]
        step = _step_value(ctx, fqn)
        if all(zeros) and step is not None and step >= 2:
            yield fqn, f"{fqn}: exp_avg and exp_avg_sq are all zero at step {step:g}"


def _beta1(ctx: Context, fqn: str) -> float | None:
    group = ctx.cat.group_of(fqn)
    betas = group.values.get("betas") if group is not None else None
    if not isinstance(betas, (list, tuple)) or len(betas) != 2:
        return None
    try:
        return float(betas[0])
    except (TypeError, ValueError):
        return None


@rule("D015")
def zero_exp_avg_after_steps(ctx: Context) -> Iterator[tuple[str, str]]:
    deep = ctx.deep_result
    assert deep is not None
    for fqn, ps in ctx.cat.optimizer_state.items():
        zeros: list[bool | None] = []
        for f in MOMENTS:
            e = ps.fields.get(f)
            st = deep.stats.get(e.key) if isinstance(e, TensorEntry) else None
            known = st is not None and e is not None and st.covers(e.numel) and st.numel > 0
            zeros.append(bool(st.zero) if known and st is not None else None)
        step = _step_value(ctx, fqn)
        if exp_avg_lost(step, _beta1(ctx, fqn), *zeros):
            yield (
                ctx.cat.state_key(fqn, "exp_avg"),
                f"{fqn}: exp_avg is all zero but exp_avg_sq is not at step {step:g}",
            )
