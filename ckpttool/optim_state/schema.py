"""Optimizer state schema: which fields each optimizer type saves, with which dtypes.

The single source of the table in ``docs/optim_state.md`` ("State schema") and
``docs/design.md`` §3: ``step`` float32 0-d for every type; ``master_weight`` float32 except for
``adamw``; moments in the parameter dtype (``adamw``), float32 (``full_fp32_adamw``), the
configured moment dtype (``master_fp32_adamw``, bfloat16 default), or the resident/CPU moment
dtype (``cpu_offload_adamw``). Works on dtype names and never imports torch, so metadata-only
readers and the optimizers share it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ckpttool.errors import OptimStateError, UsageError
from ckpttool.format.metadata import DTYPE_ITEMSIZE, dtype_name

__all__ = [
    "OPTIMIZER_TYPES",
    "STATE_FIELDS",
    "HYPERPARAMETERS",
    "expected_state_dtypes",
    "hyperparameter_problems",
    "hyperparameter_value",
    "infer_optimizer_type",
    "lion_group",
    "missing_hyperparameters",
    "other_adam_family",
    "sparse_adam_group",
    "step_dtype_ok",
    "torch_optimizers_group",
]


def step_dtype_ok(type_name: str, dtype: str) -> bool:
    """Whether a saved ``step`` of ``dtype`` (a name) fits optimizer type ``type_name``: float32, or for plain
    ``adamw`` float64 too (``torch.optim`` makes its step counter in float64 when the run's default dtype is
    float64: ``_get_scalar_dtype`` in ``torch/optim/optimizer.py``)."""
    return dtype == "float32" or (type_name == "adamw" and dtype == "float64")


#: Type names accepted by ``build_optimizer`` and written into the layout record.
OPTIMIZER_TYPES: tuple[str, ...] = ("adamw", "full_fp32_adamw", "master_fp32_adamw", "cpu_offload_adamw")

#: Saved per-parameter fields, in save order.
STATE_FIELDS: tuple[str, ...] = ("step", "master_weight", "exp_avg", "exp_avg_sq")

#: Param-group hyperparameters every ckpttool optimizer saves (torch's AdamW saves more).
HYPERPARAMETERS: tuple[str, ...] = ("lr", "betas", "eps", "weight_decay")

#: Param-group keys of torch's Rprop and LBFGS, which have no ``weight_decay``.
_NO_WEIGHT_DECAY_KEYS = frozenset(("etas", "step_sizes", "max_iter", "history_size", "line_search_fn"))
#: State fields of torch's Rprop (no ``weight_decay`` in its group).
_NO_WEIGHT_DECAY_FIELDS = frozenset(("prev", "step_size"))
#: Param-group keys of torch's non-Adam optimizers (SGD, RMSprop, Adagrad, Adadelta, ASGD, Adafactor, Rprop,
#: LBFGS); no Adam-family group has them.
_OTHER_OPTIMIZER_KEYS = _NO_WEIGHT_DECAY_KEYS | frozenset(
    ("momentum", "dampening", "nesterov", "alpha", "centered", "lr_decay", "initial_accumulator_value", "rho")
    + ("lambd", "t0", "beta2_decay", "d")
)


def lion_group(keys: Iterable[str], state_fields: Iterable[str]) -> bool:
    """Whether a param group saved with ``keys``, whose parameters saved the state ``state_fields``, is Lion's
    (sign momentum: OLMo-core's ``Lion``/``SkipStepLion``, lion-pytorch): ``betas`` and no ``eps`` in the group,
    one moment ``exp_avg`` and no second moment ``exp_avg_sq`` in the state. An Adam-family group always has
    ``eps`` and its state both moments."""
    have, fields = set(keys), set(state_fields)
    return "betas" in have and "eps" not in have and "exp_avg" in fields and "exp_avg_sq" not in fields


def sparse_adam_group(keys: Iterable[str]) -> bool:
    """Whether a param group saved with ``keys`` is torch's SparseAdam's (``lr``, ``betas``, ``eps``, ``maximize``:
    ``torch/optim/sparse_adam.py``): ``betas`` and ``maximize`` without ``weight_decay``, which every other torch
    Adam-family group holds, nor their ``amsgrad``/``decoupled_weight_decay``."""
    have = set(keys)
    return {"betas", "maximize"} <= have and not {"weight_decay", "amsgrad", "decoupled_weight_decay"} & have


def missing_hyperparameters(keys: Iterable[str], state_fields: Iterable[str] = ()) -> list[str]:
    """The :data:`HYPERPARAMETERS` a param group saved with ``keys`` lacks, in that order.

    A group of another torch optimizer (SGD, RMSprop, Adagrad, ...: one of its own keys saved) has no
    ``betas``/``eps`` to lack, and Rprop's and LBFGS's no ``weight_decay``: only ``lr`` (and
    ``weight_decay``) are asked of those, and of a group that lost every key beside ``state_fields`` no Adam-family
    optimizer saves (``exp_avg`` absent: Rprop's ``prev``, Adafactor's ``row_var``, ...). Lion (:func:`lion_group`, told by the group's ``state_fields``) has
    no ``eps``, SparseAdam (:func:`sparse_adam_group`) no ``weight_decay``.
    """
    have = set(keys)
    missing = [h for h in HYPERPARAMETERS if h not in have]
    if lion_group(have, state_fields):
        return [h for h in missing if h != "eps"]
    if sparse_adam_group(have):
        return [h for h in missing if h != "weight_decay"]
    fields = set(state_fields)
    # a group that names no optimizer (every hyperparameter gone) of state no Adam-family optimizer saves
    # (Rprop's prev, Adafactor's row_var, SGD's momentum_buffer, ...): that optimizer's, not AdamW's, are asked
    by_state = bool(fields) and "exp_avg" not in fields
    if "betas" in missing and (by_state or not _OTHER_OPTIMIZER_KEYS.isdisjoint(have)):
        no_decay = not _NO_WEIGHT_DECAY_KEYS.isdisjoint(have) or not _NO_WEIGHT_DECAY_FIELDS.isdisjoint(fields)
        asked = ("lr",) if no_decay else ("lr", "weight_decay")
        missing = [h for h in missing if h in asked]
    return missing


def _name(dtype: Any) -> str:
    name = dtype_name(dtype)
    if name not in DTYPE_ITEMSIZE:
        raise UsageError(f"unknown dtype {dtype!r}", hint="use float32 or bfloat16")
    return name


def _moment_dtype_cfg(cfg: Mapping[str, Any], *keys: str, default: str) -> Any:
    for key in keys:
        if key in cfg and cfg[key] is not None:
            return cfg[key]
    return default


def _offload_patterns(cfg: Mapping[str, Any]) -> Sequence[str]:
    patterns = cfg.get("cpu_offload_param_patterns", cfg.get("offload_patterns"))
    return list(patterns or [])


def expected_state_dtypes(
    type_name: str,
    cfg: Mapping[str, Any] | None,
    param_dtype: Any,
    *,
    fqn: str | None = None,
) -> dict[str, str]:
    """Fields and dtype names one parameter's saved state has for an optimizer type and configuration.

    Args:
        type_name: one of ``adamw | full_fp32_adamw | master_fp32_adamw | cpu_offload_adamw``.
        cfg: the optimizer configuration, either the constructor keywords
            (``moment_dtype``; ``resident_moment_dtype``, ``cpu_moment_dtype``,
            ``cpu_offload_param_patterns``, ``cpu_offload``) or the layout record's ``optimizer`` object
            (``moment_dtypes: {"resident": ..., "cpu": ...}``, ``offload_patterns``).
            Dtypes as ``torch.dtype`` or names. ``None`` means defaults.
        param_dtype: dtype of the model parameter (matters for ``adamw`` only).
        fqn: the parameter's fully qualified name; needed for ``cpu_offload_adamw`` only when
            its resident and CPU moment dtypes differ (the offload patterns decide).

    Returns:
        ``{field: dtype name}`` in the order of :data:`STATE_FIELDS`; ``step`` is a 0-d
        float32 tensor, every other field has the parameter's shape.

    Raises:
        UsageError: unknown type name or dtype, or ``fqn`` missing where it decides.
    """
    cfg = dict(cfg or {})
    f32 = "float32"
    if type_name == "adamw":
        pdt = _name(param_dtype)
        return {"step": f32, "exp_avg": pdt, "exp_avg_sq": pdt}
    if type_name == "full_fp32_adamw":
        return {"step": f32, "master_weight": f32, "exp_avg": f32, "exp_avg_sq": f32}
    moment_dtypes = cfg.get("moment_dtypes") or {}
    if type_name == "master_fp32_adamw":
        mdt = _name(_moment_dtype_cfg(cfg, "moment_dtype", default=moment_dtypes.get("resident", "bfloat16")))
        return {"step": f32, "master_weight": f32, "exp_avg": mdt, "exp_avg_sq": mdt}
    if type_name == "cpu_offload_adamw":
        resident = _name(_moment_dtype_cfg(cfg, "resident_moment_dtype", default=moment_dtypes.get("resident", f32)))
        cpu = _name(_moment_dtype_cfg(cfg, "cpu_moment_dtype", default=moment_dtypes.get("cpu", f32)))
        if resident == cpu:
            mdt = resident
        elif fqn is None:
            raise UsageError(
                f"cpu_offload_adamw moment dtype depends on the parameter (resident {resident}, cpu {cpu}) "
                "but no fqn was given",
                hint="pass fqn= so the offload patterns can decide",
            )
        else:
            offloaded = bool(cfg.get("cpu_offload", True)) and any(re.search(p, fqn) for p in _offload_patterns(cfg))
            mdt = cpu if offloaded else resident
        return {"step": f32, "master_weight": f32, "exp_avg": mdt, "exp_avg_sq": mdt}
    raise UsageError(
        f"unknown optimizer type {type_name!r}",
        hint=f"use one of {', '.join(OPTIMIZER_TYPES)}",
    )


def hyperparameter_value(v: Any) -> float | None:
    """A hyperparameter's value as a float: a Python int/float (not a bool) or a one-element tensor (torch takes
    ``lr`` and ``betas`` as tensors); ``None`` for anything else."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    numel, item = getattr(v, "numel", None), getattr(v, "item", None)
    if callable(numel) and callable(item):
        try:
            return float(item()) if numel() == 1 else None
        except Exception:  # an object of the checkpoint's whose numel/item are no tensor's
            return None
    return None


#: Param-group numbers ``torch.optim``'s constructors bound, name -> ``(low, high)``, both inclusive (``inf``:
#: unbounded): ``lr``, ``eps``, ``weight_decay`` of every optimizer; ``momentum`` (SGD, RMSprop, Muon), ``alpha``
#: (RMSprop; ASGD's power), ``lr_decay`` and ``initial_accumulator_value`` (Adagrad), ``momentum_decay`` (NAdam),
#: ``rho`` (Adadelta), ``d`` and ``beta2_decay`` (Adafactor); SGD's ``dampening`` and ASGD's ``lambd``/``t0`` are
#: any finite number.
_NUMBERS: dict[str, tuple[float, float]] = {
    **dict.fromkeys(("lr", "eps", "weight_decay", "momentum", "alpha", "lr_decay"), (0.0, math.inf)),
    **dict.fromkeys(("initial_accumulator_value", "momentum_decay"), (0.0, math.inf)),
    "rho": (0.0, 1.0),
    "d": (1.0, math.inf),
    "beta2_decay": (-math.inf, 0.0),
    **dict.fromkeys(("dampening", "lambd", "t0"), (-math.inf, math.inf)),
}
#: Param-group switches ``torch.optim`` reads by truth value (``if group["amsgrad"]:``: a string ``"False"`` steps as
#: ``True``) or passes to kernels that take a bool; ``None`` reads as ``False`` (``foreach``/``fused``: torch picks).
_SWITCHES = frozenset(
    ("amsgrad", "maximize", "nesterov", "centered", "capturable", "differentiable", "decoupled_weight_decay")
    + ("foreach", "fused")
)


#: The param-group keys of each ``torch.optim`` optimizer (its constructor's defaults, torch 2.13; earlier torch
#: versions saved subsets): Adadelta, Adafactor, Adagrad, Adam/AdamW, SparseAdam, Adamax, ASGD, LBFGS, NAdam, RAdam,
#: RMSprop, Rprop, SGD, Muon. A group holding no key outside one of these (beside :data:`_GROUP_EXTRAS`) is that
#: optimizer's, and its constructor's bounds apply; a group of another optimizer (Prodigy's ``d`` below 1, SAM's
#: ``rho`` of 2, AdEMAMix's three ``betas``, CAME's ``eps`` pair) is checked for what every optimizer needs only.
_TORCH_GROUP_KEYS: tuple[frozenset[str], ...] = tuple(
    frozenset(keys.split())
    for keys in (
        "lr rho eps weight_decay foreach capturable maximize differentiable",
        "lr beta2_decay eps d weight_decay foreach maximize",
        "lr lr_decay weight_decay initial_accumulator_value eps foreach maximize differentiable fused",
        "lr betas eps weight_decay amsgrad decoupled_weight_decay foreach maximize capturable differentiable fused",
        "lr betas eps maximize",
        "lr betas eps weight_decay foreach maximize differentiable capturable",
        "lr lambd alpha t0 weight_decay foreach maximize differentiable capturable",
        "lr max_iter max_eval tolerance_grad tolerance_change history_size line_search_fn",
        "lr betas eps weight_decay momentum_decay decoupled_weight_decay foreach maximize capturable differentiable",
        "lr betas eps weight_decay decoupled_weight_decay foreach maximize capturable differentiable",
        "lr alpha eps weight_decay momentum centered capturable foreach maximize differentiable",
        "lr etas step_sizes capturable foreach maximize differentiable",
        "lr momentum dampening weight_decay nesterov maximize foreach differentiable fused",
        "lr weight_decay momentum nesterov ns_coefficients eps ns_steps adjust_lr_fn",
    )
)
#: Group items that are no optimizer's hyperparameter: the members (``params``, torch 2.6+'s ``param_names``) and
#: what ``torch.optim.lr_scheduler`` adds (``initial_lr``; OneCycleLR's and CyclicLR's ``max_lr``, ``min_lr``,
#: ``max_momentum``, ``base_momentum``).
_GROUP_EXTRAS = frozenset(("params", "param_names", "initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum"))
#: Numbers every optimizer's group means the same by (a step size, an epsilon, a decay: finite, >= 0).
_COMMON_NUMBERS = frozenset(("lr", "eps", "weight_decay"))


def torch_optimizers_group(group: Mapping[str, Any]) -> bool:
    """Whether ``group`` (param-group key -> saved value) holds no key outside one ``torch.optim`` optimizer's
    (:data:`_TORCH_GROUP_KEYS`, beside the members and LR schedulers' keys): the group of a torch optimizer, whose
    constructor's bounds apply to its values."""
    keys = group.keys() - _GROUP_EXTRAS
    return any(keys <= known for known in _TORCH_GROUP_KEYS)


def _domain(name: str, low: float, high: float, below: bool) -> str:
    """``lr >= 0``, ``0 <= rho <= 1``, ``0 <= betas[0] < 1`` (``below``: ``high`` excluded), ``d >= 1``, ..."""
    if math.isinf(low) and math.isinf(high):
        return f"a finite {name}"
    if math.isinf(high):
        return f"{name} >= {low:g}"
    if math.isinf(low):
        return f"{name} <= {high:g}"
    return f"{low:g} <= {name} {'<' if below else '<='} {high:g}"


def hyperparameter_problems(group: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(name, problem)`` for each of a param group's saved hyperparameters that the optimizer cannot step with, or
    steps with as another value, in saved order: a number of :data:`_NUMBERS` (``lr``, ``eps``, ``weight_decay``,
    ``momentum``, ``rho``, ...) that is no number (a string, a list, ``None``, a complex; a one-element tensor is a
    number), not finite, or outside the domain ``torch.optim``'s constructors enforce (``lr``, ``eps``,
    ``weight_decay``, ``momentum`` >= 0; ``rho`` in [0, 1]; ...); ``betas`` not two numbers in [0, 1) (in [0, 1] for
    a group without ``eps``, Lion's); Rprop's ``etas`` not two numbers with ``0 < etas[0] < 1 < etas[1]``, its
    ``step_sizes`` not two finite numbers; SGD's ``nesterov`` without ``momentum > 0`` and ``dampening == 0``; a
    switch (``amsgrad``, ``maximize``, ``nesterov``, ``centered``, ``foreach``, ...) not ``True``, ``False`` or
    ``None``. ``eps`` as a pair in a group without ``betas`` (Adafactor's ``(None, 1e-3)``) is checked element by
    element, ``None`` allowed; ``lr`` ``None`` where ``relative_step`` is true (transformers' Adafactor computes
    it). The constructor's bounds (and the pairs, and ``nesterov``) apply to a group of a ``torch.optim``
    optimizer (:func:`torch_optimizers_group`); another package's group is checked for ``lr``, ``eps`` and
    ``weight_decay`` (finite, >= 0; an ``eps`` tuple element by element), ``betas`` (numbers in [0, 1]) and the
    switches only. Hyperparameters not saved are not named (:func:`missing_hyperparameters` does). The one answer
    of ``validate`` (``P006``) and ``replay-step`` (``E514``). Source: the ``ValueError`` checks of the ``torch/optim/<name>.py`` constructors
    (torch 2.x), which ``load_state_dict`` does not repeat."""
    torch = torch_optimizers_group(group)
    problems = [p for name, v in group.items() for p in _problems_of(name, v, group, torch)]
    return problems + (_nesterov_problem(group) if torch else [])


def _problems_of(name: str, v: Any, group: Mapping[str, Any], torch: bool) -> list[tuple[str, str]]:
    """:func:`hyperparameter_problems` of the saved value ``v`` of ``name`` in ``group``; ``torch``: the group is a
    ``torch.optim`` optimizer's (:func:`torch_optimizers_group`), whose constructor's bounds apply."""
    if name == "eps" and isinstance(v, (list, tuple)) and not (torch and "betas" in group):
        if torch and len(v) != 2:  # Adafactor's (eps1, eps2); another optimizer's tuple (CAME's) of any length
            return [(name, f"eps is {v!r:.40}, not a number or a pair")]
        return [p for i, e in enumerate(v) if e is not None for p in _number_problem(f"eps[{i}]", e)]
    if name in _NUMBERS and (torch or name in _COMMON_NUMBERS):
        relative = name == "lr" and v is None and group.get("relative_step") is True  # transformers' Adafactor
        return [] if relative else _number_problem(name, v, *_NUMBERS[name])
    if name in _SWITCHES:
        return [] if isinstance(v, (bool, type(None))) else [(name, f"{name} is {v!r:.40}, not True, False or None")]
    if name == "betas" and not torch:  # another optimizer's: numbers in [0, 1], as many as it takes (AdEMAMix 3)
        if not isinstance(v, (list, tuple)) or not v:
            return [(name, f"betas is {v!r:.40}, not numbers")]
        return [p for i, x in enumerate(v) for p in _number_problem(f"betas[{i}]", x, 0.0, 1.0)]
    return _pair_problems(name, v, group) if torch and name in ("betas", "etas", "step_sizes") else []


def _pair_problems(name: str, v: Any, group: Mapping[str, Any]) -> list[tuple[str, str]]:
    """:func:`hyperparameter_problems` of a torch optimizer's pair ``betas``, Rprop's ``etas`` or ``step_sizes``."""
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        return [(name, f"{name} is {v!r:.40}, not two numbers")]
    if name == "etas":  # Rprop's (etaminus, etaplus)
        low, high = (hyperparameter_value(e) for e in v)
        if low is None or high is None or not 0.0 < low < 1.0 < high:
            return [(name, f"etas is {v!r:.40}; the optimizer needs 0 < etas[0] < 1 < etas[1]")]
        return []
    bounds = (0.0, 1.0, "eps" in group) if name == "betas" else (-math.inf, math.inf, False)
    return [p for i, x in enumerate(v) for p in _number_problem(f"{name}[{i}]", x, *bounds)]


def _number_problem(
    name: str, v: Any, low: float = 0.0, high: float = math.inf, below: bool = False
) -> list[tuple[str, str]]:
    """``[(name, problem)]`` where ``v`` is no finite number in ``[low, high]`` (``[low, high)`` where ``below``)."""
    x = hyperparameter_value(v)
    if x is None:
        return [(name, f"{name} is {v!r:.40}, not a number")]
    if not math.isfinite(x):
        return [(name, f"{name} is {x!r}, not a finite number")]
    if x < low or x > high or (below and x >= high):
        return [(name, f"{name} is {x!r}; the optimizer needs {_domain(name, low, high, below)}")]
    return []


def _nesterov_problem(group: Mapping[str, Any]) -> list[tuple[str, str]]:
    """SGD's ``nesterov=True`` with ``momentum <= 0`` or ``dampening != 0``, which its constructor refuses
    (``torch/optim/sgd.py``); numbers that are none are named by :func:`hyperparameter_problems` itself."""
    if group.get("nesterov") is not True or "dampening" not in group:
        return []
    momentum, dampening = hyperparameter_value(group.get("momentum")), hyperparameter_value(group["dampening"])
    if momentum is None or dampening is None or (momentum > 0 and dampening == 0):
        return []
    return [
        (
            "nesterov",
            f"nesterov is True with momentum {momentum:g} and dampening {dampening:g}; "
            "the optimizer needs momentum > 0 and dampening 0",
        )
    ]


def other_adam_family(group: Mapping[str, Any]) -> str | None:
    """The torch optimizer of the Adam family other than Adam/AdamW whose param group ``group`` (key -> saved
    value) is: ``"NAdam"`` (it saves ``momentum_decay``) or ``"RAdam"`` (``decoupled_weight_decay`` without
    ``amsgrad``, which every Adam and AdamW group holds: ``torch/optim/adam.py``, ``radam.py``, ``nadam.py``
    defaults); ``None`` otherwise. Their moments are AdamW's fields, their step is not."""
    if "decoupled_weight_decay" not in group:
        return None
    if "momentum_decay" in group:
        return "NAdam"
    return "RAdam" if "amsgrad" not in group else None


def infer_optimizer_type(fields: Mapping[str, Any]) -> str:
    """Name the optimizer type that saves these per-parameter fields and dtypes.

    Decision table (``docs/design.md`` §3): only ``step``/``exp_avg``/``exp_avg_sq`` ->
    ``adamw``; ``master_weight`` f32 with f32 moments -> ``full_fp32_adamw``;
    ``master_weight`` f32 with bf16 moments -> ``master_fp32_adamw``.

    ``cpu_offload_adamw`` saves exactly what ``full_fp32_adamw`` saves with its default f32
    moments (offload is placement policy and is not serialized), so it can never be
    told apart by fields; such state is reported as ``full_fp32_adamw`` (read the layout
    record's ``optimizer.type`` for the real name). Likewise a ``cpu_offload_adamw`` run
    with bf16 moments reads as ``master_fp32_adamw``.

    Args:
        fields: ``{field: dtype}`` for one parameter; dtypes as ``torch.dtype`` or names
            (``"torch.float32"``, ``"bfloat16"``). Torch is not imported.

    Returns:
        ``"adamw"``, ``"full_fp32_adamw"`` or ``"master_fp32_adamw"``.

    Raises:
        OptimStateError: fields missing, unknown, or a dtype combination no ckpttool
            optimizer writes (e.g. a BF16 ``master_weight``, moments of different dtypes).
    """
    names = {k: dtype_name(v) for k, v in fields.items()}
    unknown = sorted(set(names) - set(STATE_FIELDS))
    if unknown:
        raise OptimStateError(
            f"unknown optimizer state field(s) {', '.join(unknown)}; known: {', '.join(STATE_FIELDS)}"
        )
    missing = [f for f in ("step", "exp_avg", "exp_avg_sq") if f not in names]
    if missing:
        raise OptimStateError(f"optimizer state lacks field(s) {', '.join(missing)} (have {', '.join(sorted(names))})")
    if not step_dtype_ok("adamw" if "master_weight" not in names else "master", names["step"]):
        raise OptimStateError(
            f"step is {names['step']}, every AdamW variant saves a float32 step (torch.optim.AdamW a float64 one "
            "under a float64 default dtype)"
        )
    m, v = names["exp_avg"], names["exp_avg_sq"]
    if m != v:
        raise OptimStateError(f"exp_avg is {m} but exp_avg_sq is {v}; no ckpttool optimizer mixes moment dtypes")
    if "master_weight" not in names:
        return "adamw"
    if names["master_weight"] != "float32":
        raise OptimStateError(f"master_weight is {names['master_weight']}; master weights are always float32")
    if m == "float32":
        return "full_fp32_adamw"
    if m == "bfloat16":
        return "master_fp32_adamw"
    raise OptimStateError(f"moments of dtype {m} with a float32 master_weight match no optimizer type")
