"""Optimizer-state rules (``O``) and param-group rules (``P``).

State fields and dtypes per optimizer type come from
:mod:`ckpttool.optim_state.schema`: ``adamw`` saves ``step``
(0-d float32), ``exp_avg`` and ``exp_avg_sq`` (param dtype); the FP32-master
variants add a float32 ``master_weight`` and keep moments as configured. The type
is the one declared by the layout record's ``optimizer.type`` when present, else the
one implied by the fields.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterator
from itertools import filterfalse
from typing import Any

from ckpttool.errors import CkptError, short_key
from ckpttool.format.metadata import FLOAT8_DTYPES, dtype_name
from ckpttool.model.catalog import TensorEntry, alike_groups, dtype_refuted_by, listed_twice, lost_state
from ckpttool.model.wrappers import strip_wrapper_segments
from ckpttool.ops.validate.base import rule
from ckpttool.ops.validate.context import Context
from ckpttool.optim_state.known import (
    ADAMW,
    KNOWN_OPTIMIZERS,
    SCALAR_FIELDS,
    field_shape,
    known_optimizers_of,
    known_state_fields,
    saved_by,
    saved_by_adamw,
)
from ckpttool.optim_state.schema import (
    OPTIMIZER_TYPES,
    STATE_FIELDS,
    expected_state_dtypes,
    hyperparameter_problems,
    hyperparameter_value,
    infer_optimizer_type,
    step_dtype_ok,
)

LOW_PRECISION = ("bfloat16", "float16", *FLOAT8_DTYPES)
_CORE = ("step", "exp_avg", "exp_avg_sq")
#: The running maximum of ``exp_avg_sq`` that ``torch.optim.Adam``/``AdamW`` keep with ``amsgrad=True``
#: (``torch/optim/adam.py``: ``torch.zeros_like(p)``, as ``exp_avg_sq``).
AMSGRAD_FIELD = "max_exp_avg_sq"


def _amsgrad(ctx: Context, fqn: str) -> bool:
    """The parameter's param group was saved with ``amsgrad=True`` (its state then holds :data:`AMSGRAD_FIELD`)."""
    g = ctx.cat.group_of(fqn)
    return g is not None and g.values.get("amsgrad") is True


def _states(ctx: Context) -> Iterator[tuple[str, dict[str, TensorEntry | None], TensorEntry | None]]:
    """``(fqn, fields, model entry)`` of every parameter with state that is in the model; the ``max_exp_avg_sq``
    of a parameter of an ``amsgrad`` group is left out of ``fields`` (:func:`_amsgrad_problems` checks it)."""
    for fqn, ps in ctx.cat.optimizer_state.items():
        if ps.fields and ps.in_model:
            fields = ps.fields
            if AMSGRAD_FIELD in fields and _amsgrad(ctx, fqn):
                fields = {k: v for k, v in fields.items() if k != AMSGRAD_FIELD}
            yield fqn, fields, ctx.cat.model_entry(fqn)


def _amsgrad_problems(ctx: Context, fqn: str, what: str) -> Iterator[tuple[str, str]]:
    """The ``max_exp_avg_sq`` of a parameter of an ``amsgrad`` group against ``exp_avg_sq`` (torch creates both
    with ``zeros_like(p)``): ``what`` is ``present`` (O001), ``shape`` (O004: a tensor of its shape) or ``dtype``
    (O005: its dtype)."""
    fields = ctx.cat.optimizer_state[fqn].fields
    if not _amsgrad(ctx, fqn) or "exp_avg_sq" not in fields:
        return
    key = ctx.cat.state_key(fqn, AMSGRAD_FIELD)
    t, v = fields.get(AMSGRAD_FIELD), fields["exp_avg_sq"]
    if what == "present" and AMSGRAD_FIELD not in fields:
        yield fqn, f"{fqn}: optimizer state lacks {AMSGRAD_FIELD}, which its amsgrad=True param group keeps"
    elif AMSGRAD_FIELD not in fields or v is None:
        return
    elif what == "shape" and (t is None or t.shape != v.shape):
        yield (
            key,
            (
                f"{key}: saved as a Python object, not a tensor"
                if t is None
                else f"{key}: shape {list(t.shape)} differs from exp_avg_sq's {list(v.shape)}"
            ),
        )
    elif what == "dtype" and t is not None and t.dtype != v.dtype:
        yield key, f"{key}: {t.dtype} but exp_avg_sq is {v.dtype} (amsgrad keeps their running maximum in its dtype)"


def _group_view(ctx: Context, fqn: str) -> dict[str, Any] | None:
    """The parameter's param group as hyperparameter name -> saved value (``None`` where unread), or ``None``."""
    g = ctx.cat.group_of(fqn)
    return None if g is None else {**dict.fromkeys(g.keys), **g.values}


def _other_optimizer(ctx: Context, fqn: str, fields: dict[str, TensorEntry | None]) -> tuple[str, ...]:
    """The known optimizers other than AdamW (:mod:`ckpttool.optim_state.known`) whose state the fields are for
    the parameter's group (``()`` for AdamW's): Lion's lone ``exp_avg`` is complete state, not AdamW state that
    lost a moment."""
    if saved_by_adamw(fields):
        return ()  # AdamW's own fields: no group to build (every parameter of a large checkpoint asks)
    names = known_optimizers_of(fields, _group_view(ctx, fqn))
    return () if ADAMW in names else names


def _shape_problem(name: str, shape: tuple[int, ...], want: tuple[int, ...] | None, param: tuple[int, ...]) -> str:
    """What is wrong with a state field of ``shape`` that torch saves as ``want`` (``None``: saves none) for a
    parameter of shape ``param``, said for an O004 message."""
    if want is None:
        return f"{name} of shape {list(shape)}, which torch saves for no parameter of shape {list(param)}"
    if want == param:
        return f"shape {list(shape)} differs from the parameter's {list(param)}"
    return (
        f"shape {list(shape)} differs from {list(want)}, the {name} torch saves for a parameter of shape {list(param)}"
    )


def _no_momentum(ctx: Context, fqn: str, name: str) -> bool:
    """A ``momentum_buffer`` saved as ``None`` in a group of ``momentum`` 0: older releases of torch's SGD stored
    the ``None`` buffer of every stepped parameter (torch 2.13's keeps no state at momentum 0), not a lost tensor."""
    group = _group_view(ctx, fqn) if name == "momentum_buffer" else None
    return group is not None and group.get("momentum") == 0


def _membership_known(ctx: Context) -> bool:
    """Every nested group's ``params`` list was read (else group membership is unknown)."""
    return not any(g.flavor == "nested" and g.keys.get("params") in ctx.byte_item_errors for g in ctx.cat.param_groups)


def _declared(ctx: Context) -> tuple[str | None, dict[str, Any]]:
    rec = ctx.layout.record if ctx.layout is not None else None
    if rec is None or not rec.optimizer:
        return None, {}
    t = rec.optimizer.get("type")
    return (str(t) if t is not None else None), dict(rec.optimizer)


@rule("O001")
def partial_state(ctx: Context) -> Iterator[tuple[str, str]]:
    for fqn, fields, _ in _states(ctx):
        if set(fields) - set(STATE_FIELDS) or _other_optimizer(ctx, fqn, fields):
            yield from _lacking_fields(ctx, fqn, fields)  # another optimizer's (unknown ones: O008)
            continue
        missing = [f for f in _CORE if f not in fields]
        if missing:
            yield fqn, f"{fqn}: optimizer state lacks {', '.join(missing)} (has {', '.join(sorted(fields))})"
        else:
            yield from _amsgrad_problems(ctx, fqn, "present")


def _lacking_fields(ctx: Context, fqn: str, fields: dict[str, TensorEntry | None]) -> Iterator[tuple[str, str]]:
    """The fields the known optimizer whose state ``fields`` are reads in the step its param group configures
    and the state lacks (RMSprop's ``momentum_buffer`` where ``momentum > 0``: :meth:`KnownOptimizer.lacks`)."""
    group = _group_view(ctx, fqn)
    for k in KNOWN_OPTIMIZERS:
        if k.needed_when and k.saves(fields, group):
            for name, when in k.lacks(fields, group):
                yield (
                    fqn,
                    f"{fqn}: optimizer state lacks {name}, which {k.saved_by} reads in a param group with {when} "
                    f"(has {', '.join(sorted(fields))}): a resume fails on it (dcp.load: missing key; "
                    "load_state_dict: KeyError at the first step)",
                )
            return


@rule("O002")
def no_state_no_hyperparameters(ctx: Context) -> Iterator[tuple[str, str]]:
    if not ctx.has_optimizer or not _membership_known(ctx):
        return
    if ctx.cat.params_listed_in_order():
        return  # every parameter has its group's hyperparameters
    state, groups = ctx.cat.optimizer_state, ctx.cat.group_index()
    for fqn in filterfalse(groups.__contains__, ctx.cat.param_fqns):  # grouped ones have hyperparameters
        ps = state.get(fqn)
        if ps is not None and ps.fields:
            continue
        if ctx.lost_hyperparameters(fqn):
            yield (
                fqn,
                (
                    f"{fqn}: parameter has no optimizer state and no param-group hyperparameters "
                    "(its lr/weight_decay would reset to the optimizer defaults on resume)"
                ),
            )


@rule("O003")
def orphan_state(ctx: Context) -> Iterator[tuple[str, str]]:
    cat = ctx.cat
    if not cat.model or cat.schema.optimizer_keying == "index":
        return  # K004 / K003: one finding, not one per parameter
    wrapped: dict[str, str] | None = None
    for fqn, ps in cat.optimizer_state.items():
        if not ps.in_model and not ps.stored_as:
            if wrapped is None:  # model keys by their name without wrapper segments (_orig_mod., ...), once
                wrapped = {n: k for k in cat.model if (n := strip_wrapper_segments(k)[0]) != k}
            stored = wrapped.get(cat.model_key(fqn))
            yield (
                fqn,
                f"{cat.state_key(fqn, '*')}: {fqn!r} is not a model tensor (fields {', '.join(sorted(ps.fields))})"
                + (
                    ""
                    if stored is None
                    else f"; the model stores it as {stored!r}, with wrapper segments the optimizer's names leave out "
                    "(a compiled or checkpoint-wrapped block's state_dict() saved beside get_optimizer_state_dict), "
                    "but another model key or optimizer fqn has that name without them too, so ckpttool cannot pair "
                    "them; save the model with get_model_state_dict, which removes them"
                ),
            )


@rule("O004")
def state_shape_mismatch(ctx: Context) -> Iterator[tuple[str, str]]:
    for fqn, fields, param in _states(ctx):
        other = _other_optimizer(ctx, fqn, fields)  # its fields are checked too (known.field_shape)
        for name, t in fields.items():
            if name not in STATE_FIELDS and not other:
                continue
            if t is None:
                if name not in SCALAR_FIELDS and not _no_momentum(ctx, fqn, name):
                    key = ctx.cat.state_key(fqn, name)
                    yield key, f"{key}: saved as a Python object, not a tensor"
                continue
            if name in SCALAR_FIELDS:
                if t.numel != 1:
                    yield t.key, f"{t.key}: {name} has shape {list(t.shape)}, expected a 0-d tensor"
            elif param is not None and t.shape != (want := field_shape(other, name, param.shape)):
                yield t.key, f"{t.key}: {_shape_problem(name, t.shape, want, param.shape)}"
        yield from _amsgrad_problems(ctx, fqn, "shape")
    for ps in ctx.cat.optimizer_state.values():
        if not ps.stored_as:
            continue
        parts = [ctx.cat.model[k] for k in ps.stored_as]
        rows = sum(p.shape[0] for p in parts if p.shape)
        want = (rows, *parts[0].shape[1:]) if parts[0].shape else ()
        for name, t in ps.fields.items():
            if t is not None and name in STATE_FIELDS and name != "step" and t.shape != want:
                shape, stacked = list(t.shape), ", ".join(ps.stored_as)
                yield t.key, f"{t.key}: shape {shape} differs from its parts {stacked} stacked ({list(want)})"


@rule("O005")
def state_dtype_policy(ctx: Context) -> Iterator[tuple[str, str]]:
    declared, cfg = _declared(ctx)
    if declared is not None and declared not in OPTIMIZER_TYPES:
        return  # O008
    any_master = any("master_weight" in fields for _, fields, _ in _states(ctx))
    spec = ctx.cat.schema.spec
    own_moment_dtype = (
        spec is not None and spec.skip_step_groups is not None and spec.skip_step_groups(ctx.cat.param_groups)
    )
    for fqn, fields, param in _states(ctx):
        if set(fields) - set(STATE_FIELDS) or any(f not in fields for f in _CORE):
            continue  # O008 / O001
        dts = {k: d for k, d in ctx.cat.optimizer_state[fqn].field_dtypes.items() if d != "bytes" and k in fields}
        if "step" not in dts:
            continue
        yield from _amsgrad_problems(ctx, fqn, "dtype")
        check_step = dts["step"] not in LOW_PRECISION  # P003 reports low-precision steps
        policy = _dtype_policy(fqn, dts, param, declared, cfg, own_moment_dtype=own_moment_dtype)
        if isinstance(policy, str):
            yield fqn, policy
            continue
        want, source = policy
        bad = _policy_violations(dts, want, source, check_step=check_step, any_master=any_master)
        if bad:
            yield fqn, _untrainable(fqn, fields, param) or f"{fqn}: {'; '.join(bad)} ({source})"


def _untrainable(fqn: str, fields: dict[str, TensorEntry | None], param: TensorEntry | None) -> str | None:
    """The message for a parameter stored in a dtype no optimizer steps (an integer, bool) beside a floating
    moment of its shape (:func:`~ckpttool.model.catalog.dtype_refuted_by`): the parameter's dtype record is
    what is wrong, not its state's; else ``None``."""
    refuted = dtype_refuted_by(param, fields)
    if refuted is None or param is None:
        return None
    name, t = refuted
    return (
        f"{fqn}: the parameter {param.key} is stored as {param.dtype}, a dtype no optimizer steps, while its "
        f"{name} is {t.dtype}: the parameter's dtype record is wrong (a changed header?)"
    )


def _dtype_policy(
    fqn: str,
    dts: dict[str, str],
    param: TensorEntry | None,
    declared: str | None,
    cfg: dict[str, Any],
    *,
    own_moment_dtype: bool = False,
) -> tuple[dict[str, str], str] | str:
    """``(expected dtype per field, where the type came from)``, or the problem when none can be derived.

    The declared type's policy; else the type the dtypes imply (``step`` read as float32). ``own_moment_dtype``:
    the trainer's own skip-step AdamW (``SchemaSpec.skip_step_groups``: OLMo-core's ``SkipStepAdamW(dtype=...)``)
    keeps both moments in one configured dtype, whatever the parameter's.
    """
    if declared is not None:
        try:
            want = {
                k: dtype_name(v)
                for k, v in expected_state_dtypes(
                    declared, cfg, param.dtype if param is not None else "float32", fqn=fqn
                ).items()
            }
        except CkptError as e:
            return f"{fqn}: cannot derive the dtype policy of {declared!r}: {e.message}"
        source = f"declared type {declared}"
    else:
        probe = {k: ("float32" if k == "step" else v) for k, v in dts.items()}
        try:
            implied = infer_optimizer_type(probe)
        except CkptError as e:
            return f"{fqn}: state dtypes {_fmt(dts)} match no optimizer type ({e.message})"
        pdt = param.dtype if param is not None else dts.get("exp_avg", "float32")
        want = {k: dtype_name(v) for k, v in expected_state_dtypes(implied, {}, pdt, fqn=fqn).items()}
        if implied == "master_fp32_adamw" or (implied == "adamw" and own_moment_dtype):
            want["exp_avg"] = want["exp_avg_sq"] = dts["exp_avg"]  # moments of a configured dtype
        source = f"implied type {implied}"
    return want, source


def _policy_violations(
    dts: dict[str, str], want: dict[str, str], source: str, *, check_step: bool, any_master: bool
) -> list[str]:
    """The saved dtypes of one parameter's state that break the policy ``want``, in field order."""
    bad = [
        f"{k} is {dts[k]} (expected {want[k]})"
        for k in STATE_FIELDS
        if k in want and k in dts and dts[k] != want[k] and (k != "step" or check_step and not _step_ok(dts[k], want))
    ]
    extra = [k for k in dts if k not in want]
    bad += [f"{k} present but {source} has none" for k in extra]
    if "master_weight" in want and "master_weight" not in dts and not any_master:
        bad.append("master_weight missing (no parameter has one)")  # partial coverage: O006
    return bad


def _step_ok(dtype: str, want: dict[str, str]) -> bool:
    """A saved step of ``dtype`` fits the policy ``want`` (torch.optim.AdamW's float64 step: no master_weight)."""
    return step_dtype_ok("adamw" if "master_weight" not in want else "master", dtype)


def _fmt(d: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(d.items()))


@rule("O006")
def master_weight_partial(ctx: Context) -> Iterator[tuple[str, str]]:
    state = ctx.cat.optimizer_state
    if not state:
        return  # no parameter has state
    sets = ctx.group_sets() or [("checkpoint", list(state))]
    for label, fqns in sets:
        with_state = [f for f in filter(state.__contains__, fqns) if state[f].fields]
        have = [f for f in with_state if "master_weight" in state[f].fields]
        lack = [f for f in with_state if "master_weight" not in state[f].fields]
        if have and lack:
            yield (
                lack[0],
                (f"{label}: {len(have)} parameter(s) have master_weight, {len(lack)} do not (e.g. {lack[0]})"),
            )


@rule("O007")
def step_counters_disagree(ctx: Context) -> Iterator[tuple[str, str]]:
    steps = step_values(ctx)
    for label, fqns in ctx.group_sets():
        vals = {f: steps[f] for f in fqns if f in steps}
        counts = Counter(vals.values())
        if len(counts) > 1:
            common = counts.most_common(1)[0][0]
            odd = sorted(f for f, v in vals.items() if v != common)
            desc = ", ".join(f"{n} at {_num(v)}" for v, n in counts.most_common(4))
            yield odd[0], f"{label}: step counters disagree ({desc}; e.g. {odd[0]} at {_num(vals[odd[0]])})"


def _num(v: float) -> str:
    return str(int(v)) if math.isfinite(v) and v == int(v) else repr(v)


def step_values(ctx: Context) -> dict[str, float]:
    """fqn -> saved ``step`` value (deep pass; tensors and old Python-number items)."""
    out: dict[str, float] = {}
    dr = ctx.deep_result
    if dr is None:
        return out
    for fqn, ps in ctx.cat.optimizer_state.items():
        t = ps.fields.get("step", "absent")
        if t == "absent":
            continue
        if t is None:
            v = dr.byte_values.get(ctx.cat.state_key(fqn, "step"))
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[fqn] = float(v)
        elif isinstance(t, TensorEntry):
            st = dr.stats.get(t.key)
            if st is not None and len(st.values) == 1:
                out[fqn] = st.values[0]
    return out


@rule("O008")
def unrecognized_state(ctx: Context) -> Iterator[tuple[str, str]]:
    declared, _ = _declared(ctx)
    if declared is not None and declared not in OPTIMIZER_TYPES:
        yield "layout", f"layout record: optimizer.type {declared!r} is not one of {', '.join(OPTIMIZER_TYPES)}"
    known = known_state_fields()
    fields_seen: dict[str, list[str]] = defaultdict(list)
    sets_seen: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for fqn, fields, _ in _states(ctx):
        if set(fields) <= set(STATE_FIELDS):
            continue  # AdamW's fields: O001 / O005 judge them
        if known_optimizers_of(fields, _group_view(ctx, fqn)):
            continue  # another optimizer's state (optim_state.known), not checked further
        unknown = set(fields) - known
        for f in unknown:
            fields_seen[f].append(fqn)
        if not unknown:
            sets_seen[tuple(sorted(fields))].append(fqn)
    for f, fqns in sorted(fields_seen.items()):
        yield fqns[0], f"{len(fqns)} parameter(s) have unknown state field {f!r} (e.g. {fqns[0]})"
    for names, fqns in sorted(sets_seen.items()):
        yield (
            fqns[0],
            f"{len(fqns)} parameter(s) have state fields {', '.join(names)}, which no known optimizer saves together "
            f"(e.g. {fqns[0]})",
        )
    yield from _groups_of_two_optimizers(ctx)


def _groups_of_two_optimizers(ctx: Context) -> Iterator[tuple[str, str]]:
    """Param groups whose parameters hold the state of different known optimizers (AdamW's ``exp_avg_sq`` beside
    Adamax's ``exp_inf`` or SGD's lone ``momentum_buffer``): one ``torch.optim`` optimizer steps every parameter of
    its group by one algorithm, and its resume raises ``KeyError`` on the state the other saved. Parameters whose
    fields no known optimizer saves are the per-parameter findings above. One answer per group and field set."""
    if not ctx.cat.param_groups or not _membership_known(ctx):
        return
    index = ctx.cat.group_index()
    fit: dict[tuple[int, tuple[str, ...]], frozenset[str]] = {}
    first: dict[int, tuple[str, frozenset[str], dict[str, TensorEntry | None]]] = {}
    reported: set[int] = set()
    for fqn, fields, _ in _states(ctx):
        g = index.get(fqn)
        if g is None or id(g) in reported:
            continue
        k = (id(g), tuple(fields))
        names = fit.get(k)
        if names is None:
            view = _group_view(ctx, fqn)  # classes, not entries: Adafactor's factored and 1-D state are one's
            names = fit[k] = frozenset(o.saved_by for o in KNOWN_OPTIMIZERS if o.saves(fields, view))
        if not names:
            continue  # no known optimizer's: the per-parameter findings
        if id(g) not in first:
            first[id(g)] = (fqn, names, fields)
            continue
        other, common, other_fields = first[id(g)]
        if common & names:
            first[id(g)] = (other, common & names, other_fields)
            continue
        reported.add(id(g))
        yield (
            fqn,
            f"param group {g.group_id}: {fqn}'s state ({', '.join(sorted(fields))}) was saved by "
            f"{_saved_by(ctx, fqn, fields)}, {other}'s ({', '.join(sorted(other_fields))}) by "
            f"{_saved_by(ctx, other, other_fields)}: one optimizer steps every parameter of a group by one algorithm, "
            "so its resume raises KeyError on the other's state",
        )


def _saved_by(ctx: Context, fqn: str, fields: dict[str, TensorEntry | None]) -> str:
    g = ctx.cat.group_of(fqn)
    return saved_by(fields, None if g is None else g.keys, None if g is None else g.values).removeprefix("ambiguous: ")


# ------------------------------------------------------------------------------------------ param groups
@rule("P001")
def group_missing_hyperparameter(ctx: Context) -> Iterator[tuple[str, str]]:
    for g in ctx.cat.param_groups:
        missing = ctx.cat.missing_hyperparameters(g)
        if missing:
            yield (
                ctx.cat.group_key(g.group_id),
                (
                    f"param group {g.group_id}: missing {', '.join(missing)} (has {', '.join(sorted(g.keys)) or 'nothing'})"
                ),
            )


def _same_lr(a: object, b: object) -> bool:
    """``lr == initial_lr`` for numbers and 0-d tensors (a scheduler that has not moved the LR yet)."""
    x, y = hyperparameter_value(a), hyperparameter_value(b)
    if x is not None and y is not None:
        return x == y
    return repr(a) == repr(b)


@rule("P002")
def scheduler_initial_lr(ctx: Context) -> Iterator[tuple[str, str]]:
    yield from alike_groups(
        (
            g.group_id,
            ctx.cat.group_key(g.group_id),
            f"initial_lr {g.values.get('initial_lr')!r}, lr {g.values.get('lr')!r}",
        )
        for g in ctx.cat.param_groups
        if "initial_lr" in g.values and not _same_lr(g.values.get("initial_lr"), g.values.get("lr"))
    )


@rule("P003")
def step_low_precision(ctx: Context) -> Iterator[tuple[str, str]]:
    bad = [
        (fqn, step)
        for fqn, fields, _ in _states(ctx)
        if isinstance(step := fields.get("step"), TensorEntry) and step.dtype in LOW_PRECISION
    ]
    for _, t in bad[:1]:
        more = f" ({len(bad) - 1} more parameters too)" if len(bad) > 1 else ""
        yield t.key, f"{t.key}: step stored as {t.dtype}{more}"


@rule("P004")
def state_without_group(ctx: Context) -> Iterator[tuple[str, str]]:
    if not ctx.cat.param_groups:
        if ctx.cat.optimizer_state:
            yield ctx.cat.group_key("*"), "optimizer state is saved but no param groups at all"
        return
    if not _membership_known(ctx):
        return  # S011 reports why
    spec = ctx.cat.schema.spec
    if spec is not None and spec.group_members is not None:
        return  # members inferred, not saved (Megatron's common.pt): its trainer's load rebuilds the groups
    for fqn, _, _ in _states(ctx):
        if ctx.group_of(fqn) is None:
            yield fqn, f"{fqn}: has optimizer state but is in no param group"


@rule("P005")
def param_listed_twice(ctx: Context) -> Iterator[tuple[str, str]]:
    if not _membership_known(ctx):
        return  # S011 reports why
    yield from listed_twice(ctx.cat)


@rule("P007")
def group_members_unknown(ctx: Context) -> Iterator[tuple[str, str]]:
    unknown = [g for g in ctx.cat.param_groups if not g.members_known]
    if not unknown:
        return
    spec = ctx.cat.schema.spec
    where = spec.common_state_file if spec is not None and spec.common_state_file else "the common state"
    grouped = {f for g in ctx.cat.param_groups for f in g.params}
    orphans = [fqn for fqn, _, _ in _states(ctx) if fqn not in grouped]
    ids = ", ".join(str(g.group_id) for g in unknown)
    example = f" (e.g. {short_key(orphans[0])})" if orphans else ""
    yield (
        ctx.cat.group_key(unknown[0].group_id),
        f"{where}: param groups {ids} are saved without their parameters and are not the trainer's standard "
        f"grouping, so which of the {len(orphans)} parameter(s) with state{example} each holds is unknown: their "
        "hyperparameters are not checked against the state",
    )


@rule("P008")
def groups_indistinct_on_load(ctx: Context) -> Iterator[tuple[str, str]]:
    spec = ctx.cat.schema.spec
    if spec is None or spec.group_load_problems is None:
        return
    try:
        common = ctx.ckpt.common_state()
    except CkptError:
        return  # named by the rules that read it
    if common is not None:
        yield from spec.group_load_problems(common)


@rule("P006")
def group_hyperparameter_invalid(ctx: Context) -> Iterator[tuple[str, str]]:
    yield from alike_groups(
        (g.group_id, ctx.cat.group_key(g.group_id), problem)
        for g in ctx.cat.param_groups
        for _, problem in hyperparameter_problems(g.values)
    )


@rule("O009")
def state_lost_in_stepped_group(ctx: Context) -> Iterator[tuple[str, str]]:
    if not _membership_known(ctx):
        return  # S011 reports why
    lost = lost_state(ctx.cat)
    by_leaf: dict[str, list[str]] = defaultdict(list)
    for fqn, label in lost.items():
        by_leaf[label].append(fqn)
    for label, fqns in by_leaf.items():
        more = f" and {len(fqns) - 1} more" if len(fqns) > 1 else ""
        yield fqns[0], f"{label}: {fqns[0]}{more} ha{'ve' if fqns[1:] else 's'} no optimizer state, the group stepped"
