"""Deep rules (``D``, need ``--deep``): values read from the data files by :mod:`ckpttool.ops.validate.deep`."""

from __future__ import annotations

import math
from collections.abc import Iterator

from ckpttool.model.catalog import TensorEntry
from ckpttool.ops.state_checks import MOMENTS, is_synthesized
from ckpttool.ops.validate.base import Severity, rule
from ckpttool.ops.validate.context import Context
from ckpttool.ops.validate.rules.optimizer import _num


@rule(
    "D001",
    "non-finite-values",
    Severity.error,
    "a floating tensor (parameter, buffer, optimizer state other than step) holds NaN or +-inf",
    "training diverged before the save; resume from an earlier checkpoint",
    needs=("deep",),
)
def non_finite_values(ctx: Context) -> Iterator[tuple[str, str]]:
    assert ctx.deep_result is not None
    buffers = set(ctx.cat.non_persistent_buffers())  # masks hold -inf by design: M009 reports them
    for key, st in ctx.deep_result.stats.items():
        if st.nonfinite and not key.endswith(".step") and key not in buffers:
            yield key, f"{key}: {st.nonfinite} of {st.numel} values are NaN or infinite"


@rule(
    "D002",
    "negative-exp-avg-sq",
    Severity.error,
    "an exp_avg_sq (Adam second moment, a running mean of squares) holds negative values",
    "the state is corrupt (bit flips, a bad conversion); resume from an earlier checkpoint",
    needs=("deep",),
)
def negative_exp_avg_sq(ctx: Context) -> Iterator[tuple[str, str]]:
    assert ctx.deep_result is not None
    for key, st in ctx.deep_result.stats.items():
        if key.endswith(".exp_avg_sq") and st.negative:
            yield key, f"{key}: {st.negative} of {st.numel} values are negative (min {st.min:.4g})"


@rule(
    "D003",
    "step-not-count",
    Severity.error,
    "an optimizer step is not a non-negative integer value (NaN, negative or fractional)",
    "the step counter is corrupt; Adam's bias correction would be wrong: restore it from the training step",
    needs=("deep",),
)
def step_not_count(ctx: Context) -> Iterator[tuple[str, str]]:
    assert ctx.deep_result is not None
    dr = ctx.deep_result
    for fqn, ps in ctx.cat.optimizer_state.items():
        if "step" not in ps.fields:
            continue
        t = ps.fields["step"]
        key = ctx.cat.state_key(fqn, "step")
        if t is None:
            v = dr.byte_values.get(key)
            values = [float(v)] if isinstance(v, (int, float)) and not isinstance(v, bool) else None
            if values is None and key in dr.byte_values:
                yield key, f"{key}: step is a {type(v).__name__}, not a number"
                continue
        else:
            st = dr.stats.get(t.key)
            values = st.values if st is not None else None
        for v in values or ():
            if not (math.isfinite(v) and v >= 0 and v == int(v)):
                yield key, f"{key}: step value {_num(v)} is not a non-negative integer"
                break


@rule(
    "D004",
    "master-divergence",
    Severity.error,
    "a BF16/FP16 parameter differs from master_weight.to(param dtype): the model and its FP32 master copy diverged",
    "the save wrote parameters and masters from different steps (or a cast was skipped); resume from the "
    "master_weight (export --weights master) or an earlier checkpoint",
    needs=("deep",),
)
def master_divergence(ctx: Context) -> Iterator[tuple[str, str]]:
    assert ctx.deep_result is not None
    for p in ctx.deep_result.pairs:
        if p.kind == "master" and p.compared and p.mismatched:
            yield (
                p.a,
                (
                    f"{p.a}: {p.mismatched} of {p.numel} elements differ from {p.b} cast to the parameter "
                    f"dtype (max |diff| {p.max_diff:.4g})"
                ),
            )


@rule(
    "D005",
    "synthesized-optimizer-state",
    Severity.warning,
    "optimizer state that torch made up rather than a step: step = 1 with all-zero exp_avg and exp_avg_sq "
    "(get_optimizer_state_dict / torchtitan's init_optim_state on an optimizer that never stepped)",
    "the optimizer had not stepped when it was saved; a resume would bias-correct as if one step had run: save "
    "after the first real step, or drop the optimizer state of these parameters",
    needs=("deep",),
)
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
    out = []
    for fqn, ps in cat.optimizer_state.items():
        step = ps.fields.get("step")
        if not isinstance(step, TensorEntry) or not all(isinstance(ps.fields.get(m), TensorEntry) for m in MOMENTS):
            continue
        st = deep.stats.get(step.key)
        value = st.values[0] if st is not None and len(st.values) == 1 else None
        zeros = []
        for m in MOMENTS:
            entry = ps.fields[m]
            assert entry is not None
            ms = deep.stats.get(entry.key)
            zeros.append(ms.zero if ms is not None and ms.numel == entry.numel else None)
        if is_synthesized(value, zeros):
            out.append(fqn)
    return out
