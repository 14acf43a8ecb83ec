"""What ``replay-step`` replays: parameters, hyperparameters, optimizer type and memory batches.

Decisions only, from the catalog; no tensor is read, torch is not imported. Optimizer type,
first that applies: ``--optimizer``; the layout record's ``optimizer.type``; the saved state
fields (:func:`ckpttool.optim_state.schema.infer_optimizer_type`). Every saved field is checked
against :func:`~ckpttool.optim_state.schema.expected_state_dtypes` before anything is read (exit
2). A parameter without state starts from fresh state only when no parameter of its leaf (a
nested param group, or equal saved hyperparameters in the flattened flavor) has state.
``docs/replay.md``, "What it does".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttool.errors import (
    HyperparameterError,
    IndexedOptimizerStateError,
    LostStateError,
    MemoryBudgetError,
    OptimStateError,
    StateDtypeError,
    StateFieldsError,
    StateShapeError,
    UsageError,
    shell_arg,
)
from ckpttool.format.metadata import dtype_name
from ckpttool.layouts.record import LayoutRecord
from ckpttool.model.catalog import (
    Catalog,
    TensorEntry,
    bare_glob_hint,
    frozen_params,
    leaf_key,
    listed_twice,
    lost_state,
    match_filter,
)
from ckpttool.model.schemas.base import canonical_model_key
from ckpttool.optim_state.known import saved_by
from ckpttool.optim_state.schema import (
    OPTIMIZER_TYPES,
    STATE_FIELDS,
    expected_state_dtypes,
    hyperparameter_problems,
    hyperparameter_value,
    infer_optimizer_type,
    lion_group,
    other_adam_family,
    step_dtype_ok,
)

__all__ = [
    "Hyper",
    "ParamPlan",
    "ReplayPlan",
    "plan_replay",
    "make_batches",
    "bytes_per_element",
    "split_qkv",
    "ITEMSIZE",
]

ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
_FP32_MASTER_TYPES = ("full_fp32_adamw", "master_fp32_adamw", "cpu_offload_adamw")
# torch.optim.AdamW switches that change the arithmetic; replay-step replays the default.
_UNSUPPORTED_SWITCHES = ("amsgrad", "maximize")
#: The param-group keys of torch.optim.Adam/AdamW (torch 2.13): a switch set beside them is no AdamW's.
_ADAMW_GROUP_KEYS = frozenset(
    "lr betas eps weight_decay amsgrad decoupled_weight_decay foreach maximize capturable differentiable fused".split()
)
#: Switches a trainer tags its groups with that the optimizer's step never reads: Megatron-core's
#: (``megatron/core/optimizer/__init__.py``: ``is_expert_parallel``, ``default_config``, ``is_decoupled_lr``),
#: DeepSpeed's and InternLM's MoE grouping (``moe``, ``norm``, ``gate``); and apex's / DeepSpeed's ``FusedAdam``
#: ``bias_correction=True``, the bias correction AdamW applies.
_GROUP_TAGS = frozenset(
    ("is_expert_parallel", "default_config", "is_decoupled_lr", "moe", "norm", "gate", "bias_correction")
)


@dataclass(frozen=True)
class Hyper:
    """Param-group hyperparameters of one parameter (as saved).

    Attributes:
        group_id: nested group index, or the leaf's first fqn (flattened flavor).
        lr, beta1, beta2, eps, weight_decay: Python floats.
        extra: other saved group entries (``amsgrad``, ``foreach``, ...), JSON-able.
        lr_dtype: the dtype of ``lr`` where the group saved it as a tensor
            (``torch.optim.AdamW(lr=torch.tensor(...))``), else ``None``: ``torch.optim.AdamW`` computes its step
            with a tensor ``lr`` in that dtype, so the replay of an ``adamw`` parameter passes it as one.
        betas_dtype: likewise the dtype of ``betas`` where the group saved them as one-element tensors
            (``torch.optim.AdamW(betas=(torch.tensor(0.9), torch.tensor(0.999)))``), else ``None``.
    """

    group_id: int | str
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    extra: tuple[tuple[str, Any], ...] = ()
    lr_dtype: str | None = None
    betas_dtype: str | None = None

    def as_kwargs(self) -> dict[str, Any]:
        """Constructor keywords of every ckpttool optimizer: ``lr, betas, eps, weight_decay``."""
        return {"lr": self.lr, "betas": (self.beta1, self.beta2), "eps": self.eps, "weight_decay": self.weight_decay}


@dataclass
class ParamPlan:
    """One parameter to replay.

    Attributes:
        fqn: optimizer fqn (model key without ``model.``), e.g. ``model.layers.0.mlp.experts.down_proj``.
        key: model key (``model.<fqn>``).
        shape, dtype, numel: global shape, stored dtype name, element count.
        hyper: its param group's hyperparameters.
        optimizer_type: one of ``OPTIMIZER_TYPES``.
        state: saved state entries by field (empty: fresh state).
        fresh: no saved state and its leaf never stepped.
        offloaded: ``cpu_offload_adamw`` keeps its master and moments on the CPU.
        moment_dtype: dtype name of ``exp_avg``/``exp_avg_sq`` (saved, or what fresh state gets).
        shared_step: the step saved once for its whole optimizer instead of per parameter
            (Megatron-core's ``common_step`` in ``common.pt``: its param group's ``step``), or saved as a
            Python number instead of a tensor (``object_steps`` of :func:`plan_replay`), else ``None``.
        parts: model keys of a parameter the optimizer steps fused while the model stores it
            split (torchtitan's ``wqkv`` as ``wq``/``wk``/``wv``; ``key`` then names no stored
            tensor); empty otherwise.
        part_groups: the fused rows interleave the parts in this many equal row groups
            (torchtitan's ``FusedQKVLinear``: per KV head ``[q rows of its heads, k rows, v rows]``,
            ``n_kv_heads = wk rows / head_dim``); 1 is plain concatenation along dim 0.
    """

    fqn: str
    key: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    hyper: Hyper
    optimizer_type: str
    state: dict[str, TensorEntry] = field(default_factory=dict)
    fresh: bool = False
    offloaded: bool = False
    moment_dtype: str = "float32"
    shared_step: float | None = None
    parts: tuple[str, ...] = ()
    part_groups: int = 1


@dataclass
class ReplayPlan:
    """The parameters to replay and why the optimizer was chosen.

    Attributes:
        params: selected parameters, in checkpoint order.
        optimizer_type: the type, or ``"mixed"`` when inferred per parameter and they differ.
        reason: one line saying where the type came from.
        config: constructor keywords beyond the hyperparameters, per type
            (``{"master_fp32_adamw": {"moment_dtype": "bfloat16"}, ...}``).
        notes: facts worth telling the user (fresh leaves, skipped buffers, overrides).
        skipped: selected parameters with saved optimizer state that are not replayed (state
            for an fqn the model does not hold, fused state whose parts do not stack): a
            replay that skips a stepped parameter is never OK.
        frozen: selected parameters known never stepped (:func:`~ckpttool.model.catalog.frozen_params`:
            no optimizer state, ``requires_grad=False``, as the checkpoint's format shows or as the
            frozen base weights of an adapter setup), not replayed.
    """

    params: list[ParamPlan]
    optimizer_type: str
    reason: str
    config: dict[str, dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- helpers
def _number(value: Any, what: str, fqn: str) -> float:
    """A hyperparameter :func:`~ckpttool.optim_state.schema.hyperparameter_problems` found no problem with, as a
    float: a number, or a one-element tensor.

    Raises:
        HyperparameterError (E514): no number; unreached where ``hyperparameter_problems`` named none, kept so that a
            value it lets through never reaches the optimizer as something else.
    """
    x = hyperparameter_value(value)
    if x is None:
        raise HyperparameterError(
            f"param group of {fqn}: {what} is {value!r:.40}, expected a number",
            fqn=fqn,
            hint="replay-step replays AdamW, which takes one number for each of lr, betas[0], betas[1], eps and "
            "weight_decay",
        )
    return x


def _betas_dtype(betas: Sequence[Any]) -> str | None:
    """The dtype of the saved ``betas`` where torch saved them as one-element tensors of one dtype
    (``torch.optim.AdamW`` accepts ``betas`` as two tensors and keeps them so: ``dcp.save`` stores the pair as a
    byte item of two tensors), else ``None``."""
    if all(callable(getattr(b, "numel", None)) and callable(getattr(b, "item", None)) for b in betas):
        dtypes = {str(b.dtype).removeprefix("torch.") for b in betas}
        if len(dtypes) == 1 and all(b.numel() == 1 for b in betas):
            return dtypes.pop()
    return None


#: Optimizers whose groups and state are Adam's or AdamW's (SparseAdam, NAdam and RAdam are told by their groups
#: below), so that only another optimizer's state beside Adam-like keys (Adamax's ``exp_inf``) is refused by name.
_ADAM_LIKE = tuple("torch.optim." + n for n in ("AdamW", "Adam", "SparseAdam", "NAdam", "RAdam"))

_ANY_OPTIMIZER = (
    "replay-step replays AdamW steps only; `ckpttool validate` and `ckpttool inspect` read checkpoints of any optimizer"
)


def _refuse_non_adam(group: Any, fqn: str, missing: list[str], state_fields: Iterable[str]) -> None:
    """Refuse (E514) a param group saved by an optimizer outside the Adam family: Lion's (``betas`` without ``eps``
    over one moment, :func:`~ckpttool.optim_state.schema.lion_group`), SparseAdam's (no ``weight_decay``) or one
    without ``betas`` (SGD, RMSprop, ...), named as :func:`~ckpttool.optim_state.known.saved_by` tells it."""
    keys = ", ".join(sorted(group.keys))
    fields = sorted(state_fields)
    if lion_group(group.values, fields):
        raise HyperparameterError(
            f"param group of {fqn} has betas and no eps (keys {keys}) and its state "
            f"{', '.join(fields)} has no exp_avg_sq: it was saved by Lion (sign momentum), not Adam/AdamW",
            fqn=fqn,
            hint=_ANY_OPTIMIZER,
        )
    who = saved_by(fields, group.keys, group.values)
    if "betas" not in missing and who not in _ADAM_LIKE and who != "unknown" and not who.startswith("ambiguous"):
        raise HyperparameterError(  # Adamax: betas, eps and weight_decay as Adam's, exp_inf for exp_avg_sq
            f"param group of {fqn} (keys {keys}) and its state {', '.join(fields)}: it was saved by {who}, "
            "not Adam/AdamW",
            fqn=fqn,
            hint=_hint_for(who),
        )
    if "betas" not in missing and who != "torch.optim.SparseAdam":
        return
    state = f"state {', '.join(fields)}" if fields else "no state"
    if who == "unknown":  # every Adam-family group saves betas: this one was saved by another optimizer
        said = f"it is not an Adam/AdamW group ({state}, which no optimizer ckpttool knows saves together)"
    else:
        said = f"it was saved by {who.removeprefix('ambiguous: ')} ({state}), not Adam/AdamW"
    raise HyperparameterError(
        f"param group of {fqn} has {'no betas' if 'betas' in missing else 'no weight_decay'} (keys {keys}): {said}",
        fqn=fqn,
        hint=_hint_for(who),
    )


def _hint_for(who: str) -> str:
    """The hint of a refusal of another optimizer's group: Muon, which steps the hidden matrices beside an AdamW
    for the rest, asks for a selection of those; the others for the commands that read their state."""
    if "Muon" in who:
        return (
            _ANY_OPTIMIZER
            + "; where AdamW steps the other parameters (Muon beside AdamW), select those (`filter_glob`)"
        )
    if who == "unknown":
        return _ANY_OPTIMIZER
    return (
        f"replay-step replays AdamW steps only; `ckpttool validate` checks the {who.removeprefix('ambiguous: ')} "
        "state's fields and shapes, `ckpttool inspect` shows them"
    )


def _refuse_unknown_switches(values: Mapping[str, Any], fqn: str) -> None:
    """Refuse (E514) a group with a switch set that AdamW has not (``nesterov=True``, ``centered=True``, a custom
    AdamW's own ``use_kahan=True``): torch.optim.AdamW ignores it, so its step is no proof of the step the run
    took (another optimizer's, or a subclass's that reads it). Trainers' group tags (:data:`_GROUP_TAGS`) pass."""
    unknown = [f"{k}=True" for k, v in sorted(values.items()) if v is True and k not in _ADAMW_GROUP_KEYS | _GROUP_TAGS]
    unknown += ["bias_correction=False"] if values.get("bias_correction") is False else []  # FusedAdam without it
    if unknown:
        more = f" (+{len(unknown) - 3:,} more)" if len(unknown) > 3 else ""  # a group's keys are the checkpoint's own
        raise HyperparameterError(
            f"param group of {fqn} was saved with {', '.join(unknown[:3])}{more}, "
            "which torch.optim.AdamW has not; replay-step replays plain AdamW and cannot tell what the run's "
            "optimizer did with it",
            fqn=fqn,
            hint="replay only parameters of groups without it (`filter_glob`); `ckpttool inspect` shows the group",
        )


def _hyper(
    group: Any, fqn: str, group_id: int | str, lr_dtype: str | None = None, state_fields: Iterable[str] = ()
) -> Hyper:
    values = group.values
    missing = [h for h in ("lr", "betas", "eps", "weight_decay") if h not in values]
    _refuse_non_adam(group, fqn, missing, state_fields)
    if missing:
        raise HyperparameterError(
            f"param group of {fqn} lacks {', '.join(missing)} (keys {', '.join(sorted(group.keys))})",
            fqn=fqn,
            hint="the checkpoint must save lr, betas, eps and weight_decay for every param group",
        )
    problems = hyperparameter_problems(values)  # validate's P006: the one place of the domain checks
    if problems:
        raise HyperparameterError(
            f"param group of {fqn}: {problems[0][1]}",
            fqn=fqn,
            hint="run `ckpttool validate --strict` on the checkpoint to see every problem (P006)",
        )
    betas = values["betas"]
    for switch in _UNSUPPORTED_SWITCHES:
        if values.get(switch):
            raise HyperparameterError(
                f"param group of {fqn} was saved with {switch}=True; replay-step replays plain AdamW",
                fqn=fqn,
                hint=f"replay only parameters of groups without {switch} (`filter_glob`)",
            )
    _refuse_unknown_switches(values, fqn)
    other = other_adam_family(values)
    if other is not None:
        raise HyperparameterError(
            f"param group of {fqn} was saved by torch.optim.{other} (decoupled_weight_decay without amsgrad; "
            f"keys {', '.join(sorted(group.keys))}); replay-step replays AdamW",
            fqn=fqn,
            hint=_ANY_OPTIMIZER,
        )
    if values.get("decoupled_weight_decay") is False and values.get("weight_decay"):
        raise HyperparameterError(
            f"param group of {fqn} uses L2 weight decay (torch.optim.Adam); replay-step replays AdamW",
            fqn=fqn,
            hint="replay only groups with weight_decay 0 or decoupled weight decay",
        )
    extra = tuple(
        sorted(
            (k, v)
            for k, v in values.items()
            if k not in ("lr", "betas", "eps", "weight_decay", "params", "param_names")
            and isinstance(v, (bool, int, float, str, type(None)))
        )
    )
    return Hyper(
        group_id,
        _number(values["lr"], "lr", fqn),
        _number(betas[0], "betas[0]", fqn),
        _number(betas[1], "betas[1]", fqn),
        _number(values["eps"], "eps", fqn),
        _number(values["weight_decay"], "weight_decay", fqn),
        extra,
        lr_dtype,
        _betas_dtype(betas),
    )


def _shared_step(group: Any) -> float | None:
    """The step a param group carries for all its parameters (Megatron's ``common_step``), else ``None``."""
    v = group.values.get("step") if group is not None else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _number_step(cat: Catalog, fqn: str, object_steps: Mapping[str, float]) -> float | None:
    """A step saved as a number, not a per-parameter tensor: its group's shared step, else its own byte item's."""
    shared = _shared_step(cat.group_of(fqn))
    return shared if shared is not None else object_steps.get(fqn)


def _saved_dtypes(state: dict[str, TensorEntry | None], fqn: str, shared_step: float | None = None) -> dict[str, str]:
    out = {}
    for f, entry in state.items():
        if entry is None and f == "step" and shared_step is not None:
            out[f] = "float32"  # saved once per optimizer as a float (Megatron's common_step)
            continue
        if entry is None:
            raise StateDtypeError(
                f"optimizer state {fqn}.{f} is saved as a Python object, not a tensor",
                fqn=fqn,
                hint="run `ckpttool validate --strict` on the checkpoint to see every problem",
            )
        out[f] = entry.dtype
    return out


def _record_config(record_opt: dict[str, Any]) -> dict[str, Any]:
    """The layout record's ``optimizer`` object in ``expected_state_dtypes`` form."""
    return {k: v for k, v in record_opt.items() if k != "type"}


def _constructor_config(type_name: str, cfg: dict[str, Any], chunk_size: int | None) -> dict[str, Any]:
    """``build_optimizer`` keywords (beyond hyperparameters) for a type and a record-style config."""
    moment_dtypes = cfg.get("moment_dtypes") or {}
    if type_name == "master_fp32_adamw":
        return {"moment_dtype": dtype_name(cfg.get("moment_dtype") or moment_dtypes.get("resident") or "bfloat16")}
    if type_name == "cpu_offload_adamw":
        patterns = list(cfg.get("cpu_offload_param_patterns") or cfg.get("offload_patterns") or [])
        out: dict[str, Any] = {
            "resident_moment_dtype": dtype_name(
                cfg.get("resident_moment_dtype") or moment_dtypes.get("resident") or "float32"
            ),
            "cpu_moment_dtype": dtype_name(cfg.get("cpu_moment_dtype") or moment_dtypes.get("cpu") or "float32"),
            "cpu_offload": bool(patterns) and bool(cfg.get("cpu_offload", True)),
            "cpu_offload_param_patterns": patterns or ["(?!)"],  # matches nothing: all resident
        }
        if chunk_size is not None:
            out["chunk_size"] = chunk_size
        return out
    return {}


def _offloaded(cfg: dict[str, Any], fqn: str) -> bool:
    return bool(cfg.get("cpu_offload")) and any(re.search(p, fqn) for p in cfg.get("cpu_offload_param_patterns", []))


def _moment_dtype_for(type_name: str, cfg: dict[str, Any], param_dtype: str, fqn: str) -> str:
    if type_name == "adamw":
        return param_dtype
    if type_name == "full_fp32_adamw":
        return "float32"
    # ``cfg`` is a ``_constructor_config`` result: its moment dtypes are canonical dtype names.
    moment_dtype: str
    if type_name == "master_fp32_adamw":
        moment_dtype = cfg["moment_dtype"]
    else:
        moment_dtype = cfg["cpu_moment_dtype"] if _offloaded(cfg, fqn) else cfg["resident_moment_dtype"]
    return moment_dtype


def _refuse_own_moment_dtype(p: ParamPlan, expected: dict[str, str], saved: dict[str, str]) -> None:
    """Refuse (E511) plain-AdamW state whose two moments share a dtype other than the parameter's: an optimizer
    configured with its own moment dtype (OLMo-core's ``SkipStepAdamW(dtype=...)``, which ``validate`` accepts),
    not a violated policy; torch's AdamW, which replay-step replays, keeps them in the parameter's dtype."""
    got = saved.get("exp_avg")
    if p.optimizer_type != "adamw" or got is None or got == expected.get("exp_avg") or saved.get("exp_avg_sq") != got:
        return
    raise StateDtypeError(
        f"optimizer state of {p.fqn} keeps both moments in {got} for a {p.dtype} parameter: an optimizer "
        "configured with its own moment dtype (as OLMo-core's SkipStepAdamW dtype=...), not torch's AdamW, which "
        "keeps them in the parameter's dtype",
        fqn=p.fqn,
        hint="replay-step replays torch's AdamW (moments in the parameter's dtype) and the master-weight types; "
        "`ckpttool validate --deep` checks this state",
    )


def _check_policy(p: ParamPlan, cfg: dict[str, Any], saved: dict[str, str]) -> None:
    """Saved fields, dtypes and shapes of ``p`` against its optimizer type (raises on a violation)."""
    expected = {f: dtype_name(d) for f, d in expected_state_dtypes(p.optimizer_type, cfg, p.dtype, fqn=p.fqn).items()}
    missing = [f for f in expected if f not in saved]
    extra = [f for f in saved if f not in expected]
    if missing or extra:
        parts = ([f"lacks {', '.join(missing)}"] if missing else []) + (
            [f"has unexpected {', '.join(extra)}"] if extra else []
        )
        raise StateFieldsError(
            f"optimizer state of {p.fqn} {'; '.join(parts)} for {p.optimizer_type} (which saves {', '.join(expected)})",
            fqn=p.fqn,
            hint="the state is incomplete or was saved by another optimizer (`optimizer`); "
            "run `ckpttool validate --strict` to see every problem",
        )
    _refuse_own_moment_dtype(p, expected, saved)
    for f, want in expected.items():
        if saved[f] != want and not (f == "step" and step_dtype_ok(p.optimizer_type, saved[f])):
            raise StateDtypeError(
                f"optimizer state {p.fqn}.{f} is {saved[f]} but {p.optimizer_type} saves {want} "
                f"(dtype policy violated; the parameter is {p.dtype})",
                fqn=p.fqn,
                hint="run `ckpttool validate --strict` on the checkpoint; pass `optimizer` if the layout record is wrong",
            )
        entry = p.state.get(f)
        if entry is None:  # the shared step (ParamPlan.shared_step): a number, no shape
            continue
        want_shape = () if f == "step" else p.shape
        if tuple(entry.shape) != tuple(want_shape):
            raise StateShapeError(
                f"optimizer state {p.fqn}.{f} has shape {list(entry.shape)}, the parameter needs {list(want_shape)}",
                fqn=p.fqn,
                hint="run `ckpttool validate --strict` on the checkpoint",
            )


# ----------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class _Membership:
    """Param-group membership of the model tensors (the catalog's one fqn -> group index)."""

    grouped: set[str]
    params_in_model: list[str]
    group_of: dict[str, Any]
    hypers: dict[str, Hyper]
    fused: dict[str, tuple[tuple[str, ...], int]] = field(default_factory=dict)
    stepped_orphans: list[str] = field(default_factory=list)

    def leaf_of(self, fqn: str) -> str:
        return leaf_key(self.group_of[fqn])  # the catalog's leaves: a nested group, or equal flattened values


@dataclass(frozen=True)
class _TypeChoice:
    """The optimizer type, why, the record-style base configuration and the record's ``fused``."""

    type_name: str
    reason: str
    per_param_type: dict[str, str]
    base_cfg: dict[str, Any]
    fused: bool


def _check_arguments(
    cat: Catalog, select: str | None, optimizer: str, offload_patterns: Sequence[str] | None
) -> re.Pattern[str] | None:
    """Arguments and the checkpoint's optimizer state usable at all; the compiled ``select``."""
    if optimizer != "auto" and optimizer not in OPTIMIZER_TYPES:
        raise UsageError(f"unknown optimizer {optimizer!r}", hint=f"use auto or one of {', '.join(OPTIMIZER_TYPES)}")
    try:
        rx = re.compile(select) if select else None
    except re.error as e:
        raise UsageError(
            f"`select` {select!r} is not a valid regular expression ({e})", hint="use Python re syntax"
        ) from e
    for pat in offload_patterns or ():
        try:
            re.compile(pat)
        except re.error as e:
            raise UsageError(f"`offload_patterns` {pat!r} is not a valid regular expression ({e})") from e
    if cat.schema.optimizer_keying == "index":
        raise IndexedOptimizerStateError(
            f"{cat.path}: the optimizer state under {cat.schema.optimizer_prefix!r} is keyed by parameter index "
            "(a plain optimizer.state_dict()), so no state can be matched to a parameter"
        )
    if not cat.param_groups:
        from ckpttool.format.storage import is_url
        from ckpttool.model.beside import unpaired_optimizer

        here = Path(str(cat.path))
        opt = None if is_url(str(cat.path)) else unpaired_optimizer(here, here)  # NeMo's optim/ beside model/
        per_param = cat.per_parameter_optimizer_state()
        if per_param:
            raise HyperparameterError(
                f"{cat.path}: the optimizer state is saved per parameter (e.g. {per_param[0]!r}: one optimizer per "
                "parameter, as torchtune's OptimizerInBackwardWrapper saves with optimizer_in_bwd) in a layout "
                "replay-step does not read (it reads torchtune's own, state.0 of one parameter per optimizer); nothing "
                "to replay",
                hint="replay a save with one optimizer (torchtune: optimizer_in_bwd False)",
            )
        raise HyperparameterError(
            f"{cat.path}: the checkpoint holds no optimizer param groups; nothing to replay",
            hint=f"its optimizer folder {shell_arg(opt)} lies beside it: pass the step directory {shell_arg(here.parent)}, which holds both"
            if opt is not None
            else "replay-step needs a checkpoint saved with its optimizer: pass its optimizer checkpoint with "
            "`optimizer_dir`, or the folder holding both (`ckpttool inspect` shows what it holds)",
        )
    return rx


def _ungrouped(
    cat: Catalog,
    model_fqns: Sequence[str],
    parts_of_fused: set[str],
    notes: list[str],
    wanted: Callable[[str], bool] | None,
) -> list[str]:
    """Notes the selected model tensors in no param group; returns those with saved state (stepped).

    A tensor in no param group but with saved state was stepped: never passed over as a buffer
    (validate's ``P004``; Megatron's chained optimizer whose groups ckpttool cannot assign).
    """
    ungrouped = [
        f
        for f in model_fqns
        if cat.group_of(f) is None and cat.model_key(f) not in parts_of_fused and (wanted is None or wanted(f))
    ]
    stepped = [f for f in ungrouped if (ps := cat.optimizer_state.get(f)) is not None and ps.fields]
    if len(ungrouped) > len(stepped):
        notes.append(
            f"{len(ungrouped) - len(stepped)} model tensor(s) in no param group (buffers, frozen parameters) are not replayed"
        )
    if stepped:
        notes.append(
            f"{len(stepped)} parameter(s) with saved optimizer state are in no param group, so their "
            f"hyperparameters are unknown: not replayed, e.g. {stepped[0]} (validate: P004)"
        )
    return stepped


def _stray_state(cat: Catalog, grouped: set[str], notes: list[str], wanted: Callable[[str], bool] | None) -> list[str]:
    """Notes and returns the fqns with saved state that neither the model nor any param group holds (validate's
    ``O003``): stepped, and not replayable (a renamed or removed parameter); never passed over."""
    stray = sorted(
        f
        for f, ps in cat.optimizer_state.items()
        if ps.fields and not ps.in_model and not ps.stored_as and f not in grouped and (wanted is None or wanted(f))
    )
    if stray:
        notes.append(
            f"{len(stray)} parameter(s) with saved optimizer state are neither model tensors nor in a param group: "
            f"not replayed, e.g. {stray[0]} (validate: O003)"
        )
    return stray


def _membership(
    cat: Catalog,
    notes: list[str],
    head_dim: int | None = None,
    wanted: Callable[[str], bool] | None = None,
    config_head_dim: int | None = None,
) -> _Membership:
    """Group membership and hyperparameters of the model tensors; notes what is not replayed (of the
    tensors ``wanted`` keeps: the selection)."""
    model_fqns = cat.param_fqns
    grouped = {p for g in cat.param_groups for p in g.params}
    params_in_model = [f for f in model_fqns if cat.group_of(f) is not None]
    orphans = sorted(f for f in grouped if cat.model_key(f) not in cat.model)
    # the parts of a parameter stepped fused (wq/wk/wv of wqkv) are told apart by the fused notes below
    parts_of_fused = {k for f in orphans if (ps := cat.optimizer_state.get(f)) for k in ps.stored_as}
    ungrouped_stepped = _ungrouped(cat, model_fqns, parts_of_fused, notes, wanted)
    fused: dict[str, tuple[tuple[str, ...], int]] = {}
    unknown: list[str] = []
    for f in orphans:
        parts = _stackable_parts(cat, f)
        if parts:
            groups = _part_groups(cat, f, parts, head_dim, config_head_dim)
            if groups is None:
                unknown.append(f)
            else:
                fused[f] = (parts, groups)
    if fused:
        f0 = next(iter(fused))
        notes.append(
            f"{len(fused)} parameter(s) are stepped fused but stored split in the model (e.g. {f0} as "
            f"{', '.join(fused[f0][0])}): replayed on their parts assembled as the model fuses them"
        )
    if unknown:
        rows_k = cat.model[_stackable_parts(cat, unknown[0])[1]].shape[0]
        if head_dim is not None:
            why = f"`head_dim` {head_dim} does not divide their k rows ({rows_k})"
        elif config_head_dim is not None:
            why = f"the head dim {config_head_dim} of the config.json saved with it does not divide their k rows ({rows_k})"
        else:
            why = "the head dim is not in the checkpoint (no q_norm/k_norm beside them, no config.json saved with it)"
        notes.append(
            f"{len(unknown)} fused parameter(s) (e.g. {unknown[0]}) interleave their parts per KV head, and {why}: "
            "not replayed; pass `head_dim` N (the model's hidden size / attention heads)"
        )
    other_orphans = [f for f in orphans if f not in fused]
    stepped = [f for f in other_orphans if (ps := cat.optimizer_state.get(f)) is not None and ps.fields]
    stepped += ungrouped_stepped
    stepped += _stray_state(cat, grouped, notes, wanted)
    other_orphans = [f for f in other_orphans if f not in unknown]
    if other_orphans:
        notes.append(
            f"{len(other_orphans)} param-group parameter(s) are not model tensors and are skipped, e.g. {other_orphans[0]}"
            " (validate: O003)"
        )
    params = params_in_model + list(fused)
    group_of = {f: g for f in params if (g := cat.group_of(f)) is not None}
    hypers = {
        f: _hyper(group_of[f], f, group_of[f].group_id, _lr_dtype(cat, group_of[f]), _state_fields(cat, f))
        for f in params
        if wanted is None or wanted(f)  # another optimizer's groups beside AdamW's (Muon's) are not asked
    }
    for f in hypers:
        _refuse_half_weight_decay(cat, group_of[f], f)
    _check_listed_once(cat, hypers, wanted)
    notes.extend(_adam_or_adamw(group_of, hypers))
    return _Membership(grouped, params, group_of, hypers, fused, stepped)


def _check_listed_once(cat: Catalog, hypers: dict[str, Hyper], wanted: Callable[[str], bool] | None) -> None:
    """Refuse a selected parameter listed more than once in the param groups (E514; ``validate``'s ``P005``:
    :func:`~ckpttool.model.catalog.listed_twice`)."""
    for f, message in listed_twice(cat):
        if f in hypers and (wanted is None or wanted(f)):
            raise HyperparameterError(
                message,
                fqn=f,
                hint="the param groups were merged or edited wrongly; leave the parameter out with `filter_glob`",
            )


def _adam_or_adamw(group_of: Mapping[str, Any], hypers: Mapping[str, Hyper]) -> list[str]:
    """A warning where torch's Adam and AdamW cannot be told apart: groups of ``torch.optim`` before 2.7 (``amsgrad``
    saved, ``decoupled_weight_decay`` not: torch 2.7 made AdamW a subclass of Adam and saves it in both) with a
    non-zero ``weight_decay``: ``torch.optim.Adam`` (L2 weight decay added to the gradient, another step) saves
    the same entries as ``AdamW``. With ``weight_decay`` 0 their steps are the same."""
    unsure = [  # the replayed parameters (`filter_glob`): those ``hypers`` holds
        f
        for f, h in hypers.items()
        if "amsgrad" in (keys := group_of[f].keys) and "decoupled_weight_decay" not in keys and h.weight_decay != 0.0
    ]
    if not unsure:
        return []
    return [
        f"warning: {len(unsure)} parameter(s) (e.g. {unsure[0]}) are in param groups saved by torch before 2.7 with "
        f"weight_decay {hypers[unsure[0]].weight_decay:g} and no decoupled_weight_decay entry: torch.optim.Adam (L2 "
        "weight decay, another step) saves the same entries as AdamW; replayed as AdamW, which the run must have used"
    ]


def _lr_dtype(cat: Catalog, group: Any) -> str | None:
    """The dtype of the group's ``lr`` where it is saved as a one-element tensor (``Catalog.group_tensors``)."""
    entry = cat.group_tensors.get(group.keys.get("lr", ""))
    return str(entry.dtype) if entry is not None else None


def _refuse_half_weight_decay(cat: Catalog, group: Any, fqn: str) -> None:
    """Refuse (E514) a ``weight_decay`` saved as a BF16/FP16 tensor (made under a half-precision default dtype) in a
    group not stepped fused: torch forms the decay factor ``1 - lr * weight_decay`` in that dtype (8 or 11 bits:
    1 - 0.01 * 0.1 is 1.0 in BF16, no decay at all), which the replay, taking the number, does not."""
    entry = cat.group_tensors.get(group.keys.get("weight_decay", ""))
    dtype = str(entry.dtype).removeprefix("torch.") if entry is not None else ""
    if dtype in ("bfloat16", "float16") and group.values.get("fused") is not True:
        raise HyperparameterError(
            f"param group of {fqn}: weight_decay is saved as a {dtype} tensor; torch forms the decay factor "
            f"1 - lr * weight_decay in {dtype}, and replay-step replays it from the number, which is not the run's step",
            fqn=fqn,
            hint="replay only parameters of other groups (`filter_glob`); `ckpttool inspect` shows the group",
        )


def split_qkv(parts: tuple[str, ...]) -> bool:
    """``parts`` (the stored keys of a parameter stepped fused) are q/k/v projections stored split (torchtitan's
    ``wq``/``wk``/``wv`` of a fused ``wqkv``), whose rows interleave per KV head (:func:`_part_groups`)."""
    return len(parts) == 3 and parts[0].rsplit(".", 2)[-2].endswith("wq")


def _part_groups(
    cat: Catalog, fqn: str, parts: tuple[str, ...], head_dim: int | None, config_head_dim: int | None = None
) -> int | None:
    """How many row groups the parts of a fused ``q/k/v`` parameter interleave in (``None``: unknown).

    torchtitan's ``FusedQKVLinear`` (``torchtitan/models/common/attention.py``, ``_merge_qkv_on_load``)
    orders the fused rows per KV head: ``wq.reshape(n_kv, hpk, hd)``, ``wk``/``wv``
    ``.reshape(n_kv, 1, hd)``, concatenated on dim 1. ``hd`` is the size of the ``q_norm.weight`` (or
    ``k_norm.weight``) beside the projection (Qwen3-style models), else ``head_dim``, else ``config_head_dim`` (the
    ``config.json`` saved with the checkpoint).
    Parts not named ``wq``/``wk``/``wv`` are plain concatenation (1 group).
    """
    if not split_qkv(parts):
        return 1
    rows_k = cat.model[parts[1]].shape[0]
    hd = head_dim if head_dim is not None else config_head_dim
    attn = fqn.rsplit(".", 3)[0]  # layers.0.attention(.qkv_linear.wqkv.weight)
    for norm in ("q_norm", "k_norm"):
        e = cat.model_entry(f"{attn}.{norm}.weight")
        if e is not None and len(e.shape) == 1:
            if head_dim is not None and head_dim != e.shape[0]:  # the checkpoint's own head dim wins over a flag
                raise UsageError(
                    f"`head_dim` {head_dim} contradicts the checkpoint: {attn}.{norm}.weight, the per-head norm "
                    f"beside {fqn}, has {e.shape[0]} elements (the head dim); assembled with the wrong head dim, the "
                    "fused rows would not line up with their saved state",
                    param="head_dim",
                    hint=f"leave out `head_dim` (the checkpoint tells it), or pass `head_dim` {e.shape[0]}",
                )
            hd = e.shape[0]
            break
    if hd is None or hd <= 0 or rows_k % hd:
        return None
    return rows_k // hd


def _state_fields(cat: Catalog, fqn: str) -> tuple[str, ...]:
    """The state fields ``fqn`` saved (none where it has no state)."""
    ps = cat.optimizer_state.get(fqn)
    return tuple(ps.fields) if ps is not None else ()


def _stackable_parts(cat: Catalog, fqn: str) -> tuple[str, ...]:
    """The model keys a fused parameter is stored as, when they stack along dim 0 into its state's shape."""
    ps = cat.optimizer_state.get(fqn)
    if ps is None or not ps.stored_as or not all(k in cat.model for k in ps.stored_as):
        return ()
    parts = [cat.model[k] for k in ps.stored_as]
    if any(not p.shape or p.dtype != parts[0].dtype or tuple(p.shape[1:]) != tuple(parts[0].shape[1:]) for p in parts):
        return ()
    want = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    avg = ps.fields.get("exp_avg")
    if avg is None or tuple(avg.shape) != want:
        return ()
    return tuple(ps.stored_as)


def _glob_matches(cat: Catalog, fqn: str, filter_glob: str) -> bool:
    """``filter_glob`` matches the canonical key of ``fqn``, or of the name the model stores it under where that
    adds wrapper segments (``model.layers.0._orig_mod.attn.q.weight``: ``Catalog.wrapped``)."""
    if match_filter(canonical_model_key(fqn), filter_glob):
        return True
    stored = cat.wrapped.get(fqn)
    return stored is not None and match_filter(canonical_model_key(stored), filter_glob)


def _select(
    cat: Catalog,
    members: _Membership,
    rx: re.Pattern[str] | None,
    select: str | None,
    filter_glob: str | None,
) -> list[str]:
    """The selected parameters (``select`` and ``filter_glob``); raises when nothing is selected."""
    params_in_model = members.params_in_model
    selected = [
        f
        for f in params_in_model
        if (rx is None or rx.search(f))
        and (filter_glob is None or _glob_matches(cat, f, filter_glob))  # the canonical key
    ]
    if not params_in_model:
        if members.grouped and all(f.isdecimal() for f in members.grouped):  # params [0, 1, ...]
            raise HyperparameterError(
                f"{cat.path}: the param groups list their {len(members.grouped)} parameter(s) by index (a plain "
                "optimizer.state_dict()), which no command can match to the model tensors; nothing to replay",
                hint="re-save the optimizer with torch.distributed.checkpoint.state_dict.get_optimizer_state_dict"
                "(model, optimizer), which names each parameter by its fqn",
            )
        spec = cat.schema.spec
        if not members.grouped and cat.param_groups and spec is not None and spec.group_members is not None:
            raise HyperparameterError(  # the trainer saved its groups without their params lists
                f"{cat.path}: the {len(cat.param_groups)} param groups of {spec.common_state_file} are not the "
                "trainer's default grouping (custom overrides, a decoupled_lr group without the saved args that "
                "name it, or a group that held no parameter where it was saved), so which parameters each holds is "
                "not known; nothing to replay",
                hint="the groups' hyperparameters are listed by `ckpttool inspect` (validate: P007); a replay needs "
                "the default grouping (docs/frameworks.md)",
            )
        from ckpttool.model.beside import model_folder_hint

        ungrouped = [f for f in members.stepped_orphans if f not in members.grouped and cat.model_key(f) in cat.model]
        if ungrouped:  # the state names model tensors; the groups do not list them
            raise HyperparameterError(
                f"{cat.path}: none of the {len(members.grouped)} parameter(s) of the param groups is a model tensor "
                f"of the checkpoint, while {len(ungrouped)} model tensor(s) with optimizer state are in "
                f"no param group (e.g. {ungrouped[0]}; validate: P004), so their hyperparameters are "
                "unknown; nothing to replay",
                hint="save each param group's params list with the state (get_optimizer_state_dict names them)",
            )
        raise HyperparameterError(
            f"{cat.path}: none of the {len(members.grouped)} parameter(s) of the param groups is a model tensor "
            "of the checkpoint; nothing to replay",
            hint="the optimizer state does not name this checkpoint's model tensors (`ckpttool inspect` shows both)"
            if cat.model
            else model_folder_hint(
                cat.path, "it holds optimizer state only: pass the folder holding model and optimizer"
            ),
        )
    if not selected:
        example = params_in_model[0]
        if filter_glob is not None:
            raise UsageError(
                f"`filter_glob` {filter_glob!r} matches none of the {len(params_in_model)} parameter(s)"
                + (f" (with `select` {select!r})" if select else ""),
                param="filter_glob",
                hint=(
                    None
                    if select
                    else bare_glob_hint(
                        filter_glob, lambda g: sum(_glob_matches(cat, f, g) for f in params_in_model), "parameter"
                    )
                )
                or cat.state_only_hint((filter_glob,))
                or f"globs match checkpoint keys with or without 'model.', e.g. '*experts*' or '{example}'",
            )
        raise UsageError(
            f"`select` {select!r} matches none of the {len(params_in_model)} parameter(s) (e.g. {params_in_model[0]})",
            param="select",
            hint=f"patterns are re.search over fqns such as {example}",
        )
    return selected


def _record_base(cat: Catalog, record: LayoutRecord | None, optimizer: str) -> tuple[str | None, dict[str, Any], bool]:
    """The layout record's usable optimizer type, its configuration and its ``fused`` switch."""
    record_opt = dict(record.optimizer) if record is not None else {}
    record_type = record_opt.get("type")
    if record_type is not None and record_type not in OPTIMIZER_TYPES:
        if optimizer == "auto":
            raise HyperparameterError(
                f"{cat.path}: layout record names optimizer type {record_type!r}, unknown to replay-step",
                hint=f"pass `optimizer` {'|'.join(OPTIMIZER_TYPES)}",
            )
        record_type = None
    base_cfg = _record_config(record_opt) if record_type else {}
    # The implementation the run used (torch's fused AdamW kernel or the foreach ops) is replayed as recorded.
    fused = record_opt.get("fused", False)
    if not isinstance(fused, bool):
        raise HyperparameterError(
            f"{cat.path}: layout record optimizer.fused is {fused!r:.40}, not true or false",
            hint="fix the layout record (`ckpttool stamp`), or remove the field (foreach)",
        )
    base_cfg.pop("fused", None)
    return record_type, base_cfg, fused


def _fields_hint(cat: Catalog, fqn: str, fields: set[str]) -> str:
    """The hint of state fields no AdamW variant saves (Muon's ``momentum_buffer``, amsgrad's ``max_exp_avg_sq``):
    no declared type replays them, so it names the optimizer where the state tells it; else the declared type."""
    if fields <= set(STATE_FIELDS):
        return "run `ckpttool validate --strict` on the checkpoint; pass `optimizer` to declare the type"
    group = cat.group_of(fqn)
    who = saved_by(sorted(fields), *((group.keys, group.values) if group is not None else ()))
    said = "" if who == "unknown" else f" (saved by {who.removeprefix('ambiguous: ')})"
    return f"state no AdamW variant saves{said}: {_ANY_OPTIMIZER}"


def _infer_type(
    cat: Catalog, selected: list[str], offload_patterns: Sequence[str] | None, object_steps: Mapping[str, float]
) -> tuple[str, str, dict[str, str]]:
    """Type, reason and per-parameter types inferred from the saved state fields (no record, ``auto``)."""
    inferred: dict[str, str] = {}
    for f in selected:
        ps = cat.optimizer_state.get(f)
        if ps is not None and ps.fields:
            saved = _saved_dtypes(ps.fields, f, _number_step(cat, f, object_steps))
            try:
                inferred[f] = infer_optimizer_type(saved)
            except OptimStateError as e:
                # a missing or unknown field is E510, as against a declared type (_check_policy); a dtype E511
                keys = set(saved)
                fields_wrong = not {"step", "exp_avg", "exp_avg_sq"} <= keys or not keys <= set(STATE_FIELDS)
                raise (StateFieldsError if fields_wrong else StateDtypeError)(
                    f"optimizer state of {f}: {e.message}",
                    fqn=f,
                    hint=_fields_hint(cat, f, keys),
                ) from e
    kinds = sorted(set(inferred.values()))
    per_param_type: dict[str, str] = {}
    if offload_patterns and kinds and all(k in _FP32_MASTER_TYPES for k in kinds):
        type_name = "cpu_offload_adamw"
        reason = "state fields (FP32 master_weight) and --offload-patterns"
    elif len(kinds) > 1:
        type_name = "mixed"
        reason = f"state fields per parameter ({', '.join(kinds)}); no layout record"
        per_param_type = inferred
    elif kinds:
        type_name = kinds[0]
        reason = "state fields" + (
            " (cpu_offload_adamw saves the same fields as full_fp32_adamw; pass --optimizer-type or stamp a record to use it)"
            if type_name == "full_fp32_adamw"
            else ""
        )
    else:
        type_name = "adamw"
        reason = "no state saved for the selected parameters and no layout record: torch.optim.AdamW"
    return type_name, reason, per_param_type


def _choose_type(
    cat: Catalog,
    record: LayoutRecord | None,
    optimizer: str,
    selected: list[str],
    offload_patterns: Sequence[str] | None,
    notes: list[str],
    object_steps: Mapping[str, float],
) -> _TypeChoice:
    """The optimizer type: ``--optimizer``, else the record's, else the saved state fields."""
    record_type, base_cfg, fused = _record_base(cat, record, optimizer)
    per_param_type: dict[str, str] = {}
    if optimizer != "auto":
        type_name = optimizer
        reason = "--optimizer"
        if record_type and record_type != optimizer:
            notes.append(f"--optimizer-type {optimizer} overrides the layout record's optimizer type {record_type}")
            base_cfg = {}
    elif record_type:
        type_name = record_type
        reason = "layout record optimizer.type"
    else:
        type_name, reason, per_param_type = _infer_type(cat, selected, offload_patterns, object_steps)
    if offload_patterns:
        base_cfg = dict(base_cfg, offload_patterns=list(offload_patterns))
        base_cfg.pop("cpu_offload_param_patterns", None)
    return _TypeChoice(type_name, reason, per_param_type, base_cfg, fused)


def _saved_moment(cat: Catalog, selected: list[str], pred: Any) -> str | None:
    """The saved ``exp_avg`` dtype of the first selected parameter ``pred`` accepts that has one."""
    for f in selected:
        ps = cat.optimizer_state.get(f)
        if pred(f) and ps is not None and ps.fields.get("exp_avg") is not None:
            return ps.fields["exp_avg"].dtype  # type: ignore[union-attr]
    return None


def _type_config(
    cat: Catalog, selected: list[str], t: str, choice: _TypeChoice, chunk_size: int | None
) -> dict[str, Any]:
    """Constructor configuration of type ``t``: record values win; else the saved dtypes decide."""
    per_param_type = choice.per_param_type
    cfg = dict(choice.base_cfg)
    if t == "master_fp32_adamw" and not (cfg.get("moment_dtype") or (cfg.get("moment_dtypes") or {}).get("resident")):
        cfg["moment_dtype"] = _saved_moment(cat, selected, lambda f, t=t: per_param_type.get(f, t) == t) or "bfloat16"
    if t == "cpu_offload_adamw":
        probe = _constructor_config(t, cfg, chunk_size)
        md = dict(cfg.get("moment_dtypes") or {})
        if "resident" not in md and "resident_moment_dtype" not in cfg:
            md["resident"] = _saved_moment(cat, selected, lambda f, probe=probe: not _offloaded(probe, f)) or "float32"
        if "cpu" not in md and "cpu_moment_dtype" not in cfg:
            md["cpu"] = _saved_moment(cat, selected, lambda f, probe=probe: _offloaded(probe, f)) or "float32"
        cfg["moment_dtypes"] = md
    return _constructor_config(t, cfg, chunk_size)


def _configs(
    cat: Catalog, selected: list[str], choice: _TypeChoice, chunk_size: int | None, notes: list[str]
) -> dict[str, dict[str, Any]]:
    """Constructor configuration per type used (:func:`_type_config`); notes ``fused`` and no offload."""
    type_name, per_param_type, fused = choice.type_name, choice.per_param_type, choice.fused
    types_used = set(per_param_type.values()) if type_name == "mixed" else {type_name}
    if type_name == "mixed":
        types_used |= {"adamw"} if len(per_param_type) < len(selected) else set()
    config: dict[str, dict[str, Any]] = {}
    for t in types_used:
        config[t] = _type_config(cat, selected, t, choice, chunk_size)
        if fused:
            config[t]["fused"] = True
    if fused:
        notes.append("the run used the fused AdamW kernel (layout record optimizer.fused): replayed with fused=True")
    if "cpu_offload_adamw" in config and not config["cpu_offload_adamw"]["cpu_offload"]:
        notes.append(
            "cpu_offload_adamw without offload patterns (record or --offload-patterns): every parameter resident"
        )
    unused = [
        name
        for name, given in (
            ("`offload_patterns`", choice.base_cfg.get("offload_patterns")),
            ("`chunk_size`", chunk_size),
        )
        if given is not None and given != [] and "cpu_offload_adamw" not in config
    ]
    if unused:
        notes.append(
            f"warning: {' and '.join(unused)} ignored: options of cpu_offload_adamw, and the replay runs "
            f"{', '.join(sorted(types_used))} (from {choice.reason}); `optimizer` cpu_offload_adamw replays with them"
        )
    return config


def _param_plans(
    cat: Catalog,
    selected: list[str],
    members: _Membership,
    choice: _TypeChoice,
    config: dict[str, dict[str, Any]],
    lost: dict[str, str],
    notes: list[str],
    object_steps: Mapping[str, float],
) -> list[ParamPlan]:
    """One checked :class:`ParamPlan` per selected parameter; notes the leaves replayed from fresh state."""
    type_name, per_param_type, hypers = choice.type_name, choice.per_param_type, members.hypers
    plans: list[ParamPlan] = []
    fresh_leaves: set[Any] = set()
    for f in selected:
        parts, part_groups = members.fused.get(f, ((), 1))
        ps = cat.optimizer_state.get(f)
        fields = dict(ps.fields) if ps is not None else {}
        t = per_param_type.get(f, "adamw") if type_name == "mixed" else type_name
        cfg = config[t]
        if parts:  # the fused parameter: its parts' dtype, its state's shape (checked to stack)
            avg = fields["exp_avg"]
            assert avg is not None
            key, shape, dtype, numel = cat.model_key(f), tuple(avg.shape), cat.model[parts[0]].dtype, avg.numel
        else:
            entry = cat.model[cat.model_key(f)]
            key, shape, dtype, numel = entry.key, tuple(entry.shape), entry.dtype, entry.numel
        p = ParamPlan(f, key, shape, dtype, numel, hypers[f], t, parts=parts, part_groups=part_groups)
        p.offloaded = t == "cpu_offload_adamw" and _offloaded(cfg, f)
        p.moment_dtype = _moment_dtype_for(t, cfg, dtype, f)
        if fields:
            p.shared_step = _number_step(cat, f, object_steps) if fields.get("step", 0) is None else None
            saved = _saved_dtypes(fields, f, p.shared_step)
            p.state = {k: v for k, v in fields.items() if v is not None}
            _check_policy(p, cfg, saved)
        else:
            leaf = members.leaf_of(f)
            if f in lost:
                raise LostStateError(
                    f"parameter {f} has no optimizer state although other parameters of its param group "
                    f"(group {hypers[f].group_id}) have state: its leaf stepped",
                    fqn=f,
                    hint="the state of this parameter was lost (or it never received a gradient); "
                    "leave it out with `filter_glob`, and run `ckpttool validate --strict`",
                )
            p.fresh = True
            fresh_leaves.add(leaf)
        if dtype not in ITEMSIZE:
            raise StateDtypeError(
                f"parameter {f} is {dtype}; replay-step replays floating-point parameters ({', '.join(ITEMSIZE)})",
                fqn=f,
            )
        plans.append(p)
    for leaf in sorted(fresh_leaves, key=str):
        members_of_leaf = [p for p in plans if p.fresh and members.leaf_of(p.fqn) == leaf]
        notes.append(
            f"{len(members_of_leaf)} parameter(s) of a leaf that never stepped (e.g. {members_of_leaf[0].fqn}, lr "
            f"{members_of_leaf[0].hyper.lr:g}) replay from fresh state: step 0, zero moments, master = parameter"
        )
    return plans


def plan_replay(
    cat: Catalog,
    record: LayoutRecord | None = None,
    *,
    select: str | None = None,
    optimizer: str = "auto",
    offload_patterns: Sequence[str] | None = None,
    chunk_size: int | None = None,
    filter_glob: str | None = None,
    head_dim: int | None = None,
    object_steps: Mapping[str, float] | None = None,
    config_head_dim: int | None = None,
) -> ReplayPlan:
    """Choose the parameters, hyperparameters and optimizer configuration of a replay.

    Args:
        cat: the catalog with param-group values loaded (:meth:`~ckpttool.model.checkpoint.Checkpoint.param_groups`).
        record: the checkpoint's layout record, if any (its ``optimizer`` object and type).
        select: ``re.search`` pattern over parameter fqns; ``None`` selects every parameter
            (the older spelling of ``filter_glob``; both given: a parameter must match both).
        optimizer: ``auto`` or one of ``OPTIMIZER_TYPES``.
        offload_patterns: ``cpu_offload_adamw`` patterns (override the record's ``offload_patterns``).
        chunk_size: ``cpu_offload_adamw`` staging chunk size in elements (``None``: its default).
        filter_glob: ``fnmatch`` glob over the checkpoint key ``model.<fqn>``, with or without its
            ``model.`` prefix (:func:`~ckpttool.model.catalog.match_filter`, as inspect and export):
            ``'*experts*'``, ``'model.layers.0.*'``; ``None`` selects every parameter.
        head_dim: attention head dim, to assemble fused ``wqkv`` parameters whose parts
            interleave per KV head (:func:`_part_groups`); ``None``: from ``q_norm``/``k_norm``, else
            ``config_head_dim``.
        object_steps: fqn -> ``step`` saved as a Python number (a byte item), which ``torch.optim.AdamW``
            turns into a float32 tensor as it loads the state; the replay does the same.
        config_head_dim: the head dim of the ``config.json`` saved with the checkpoint (``head_dim`` agrees with it).

    Returns:
        The :class:`ReplayPlan`.

    Raises:
        UsageError: bad ``--select``/``--optimizer``/pattern, or nothing selected.
        OptimStateError: no param groups, hyperparameters missing, a parameter without state in
            a leaf that stepped (E513), saved fields/dtypes/shapes that violate the type (E510-E512).
    """
    rx = _check_arguments(cat, select, optimizer, offload_patterns)
    notes: list[str] = []

    def wanted(f: str) -> bool:  # the selection: select's regex and filter_glob over the canonical key
        return (rx is None or rx.search(f) is not None) and (filter_glob is None or _glob_matches(cat, f, filter_glob))

    members = _membership(cat, notes, head_dim, wanted, config_head_dim)
    lost = lost_state(cat)  # the one check behind validate's O009
    selected = _select(cat, members, rx, select, filter_glob)
    known_frozen = frozen_params(cat)
    frozen = [f for f in selected if f in known_frozen]
    if frozen:
        selected = [f for f in selected if f not in known_frozen]
        notes.append(
            f"{len(frozen)} frozen parameter(s) not replayed (no optimizer state, requires_grad=False: "
            f"a step leaves them unchanged): {', '.join(frozen[:4])}{' ...' if len(frozen) > 4 else ''}"
        )
        if not selected:
            raise UsageError(
                "only frozen parameters selected: they have no optimizer state and a step does not change them",
                param="select",
            )
    steps = object_steps or {}
    choice = _choose_type(cat, record, optimizer, selected, offload_patterns, notes, steps)
    config = _configs(cat, selected, choice, chunk_size, notes)
    plans = _param_plans(cat, selected, members, choice, config, lost, notes, steps)
    _inferred_membership_note(cat, selected, notes)
    skipped = [f for f in members.stepped_orphans if wanted(f)]
    return ReplayPlan(plans, choice.type_name, choice.reason, config, notes, skipped, frozen)


def _inferred_membership_note(cat: Catalog, selected: list[str], notes: list[str]) -> None:
    """Say so when the replayed parameters' groups were not saved but inferred: Megatron's ``common.pt`` keeps its
    param groups without ``params``, and the members follow megatron's default rule
    (:func:`ckpttool.model.schemas.megatron.assign_groups`), which a run with its own ``no_weight_decay_cond`` or
    ``config_overrides`` did not use; where the groups differ in hyperparameters, those of a parameter are then
    not certain to be the run's (the schema's ``SchemaSpec.inferred_groups_note``)."""
    spec = cat.schema.spec
    if spec is None or spec.inferred_groups_note is None or not selected:
        return
    chosen = set(selected)
    used = [g for g in cat.param_groups if chosen.intersection(g.params)]
    differ = sorted({k for g in used for k, v in g.leaf_values.items() if any(o.leaf_values.get(k) != v for o in used)})
    differ = [k for k in differ if k in ("lr", "weight_decay", "betas", "eps")]
    if len(used) < 2 or not differ:
        return
    notes.append(spec.inferred_groups_note(used, chosen, differ))


def bytes_per_element(p: ParamPlan, reference_itemsize: int = 8, steps: int = 1) -> int:
    """Estimated peak host+device bytes per element of ``p`` while it is replayed.

    What a resumed run holds: the parameter (and its device copy), the loaded state (adopted
    by the optimizer, updated in place), one gradient per replayed step plus its FP32
    generation buffer, and the foreach step's full-size FP32 temporaries (widened gradient,
    denominator). The reference and the comparison run on slabs of
    ``ckpttool.ops.replay.run.REFERENCE_SLAB`` elements (a fixed few tens of MiB, whatever the
    model size; ``reference_itemsize`` only scales that).
    """
    ip = ITEMSIZE.get(p.dtype, 4)
    im = ITEMSIZE.get(p.moment_dtype, 4)
    master = 0 if p.optimizer_type == "adamw" else 4
    return 2 * ip + steps * ip + 4 + master + 2 * im + 8


def make_batches(
    params: list[ParamPlan], max_memory: int, reference_itemsize: int = 8, *, steps: int = 1
) -> list[list[ParamPlan]]:
    """Split parameters into consecutive batches whose estimated peak memory fits ``max_memory``.

    Args:
        params: the plan's parameters.
        max_memory: bytes, > 0.
        reference_itemsize: 8 (float64 reference) or 4 (float32).
        steps: replayed steps (one gradient is kept per step).

    Returns:
        Non-empty batches, in order.

    Raises:
        UsageError (E130): one parameter alone needs more than ``max_memory``.
    """
    batches: list[list[ParamPlan]] = []
    cur: list[ParamPlan] = []
    used = 0
    for p in params:
        need = max(p.numel, 1) * bytes_per_element(p, reference_itemsize, steps)
        if need > max_memory:
            raise MemoryBudgetError(
                f"replaying {p.fqn} ({p.numel:,} elements) needs about {need:,} bytes, more than `max_memory` {max_memory:,}",
                fqn=p.fqn,
                hint="raise `max_memory`, or leave the parameter out with `filter_glob`",
            )
        if cur and used + need > max_memory:
            batches.append(cur)
            cur, used = [], 0
        cur.append(p)
        used += need
    if cur:
        batches.append(cur)
    return batches
