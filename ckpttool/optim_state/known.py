"""The per-parameter state fields of the optimizers users run, beside ckpttool's AdamW family.

One table (:data:`KNOWN_OPTIMIZERS`), read by ``validate`` (``docs/rules.md``): a parameter's saved fields that
one of these optimizers saves together are known state, not ``O008``'s "unknown state fields", and ``O004``
checks their shapes (:func:`field_shape`); nothing more of them (values, dtypes) is checked, and
``replay-step`` replays AdamW state only, refusing the others by name. ``inspect`` names the optimizer the fields
imply (:func:`saved_by`). Each entry was read off the optimizer's own source:
``torch/optim/<name>.py`` (``state["..."] =`` in ``_init_group`` / ``step``, torch 2.13) and
``olmo_core/optim/lion.py`` (OLMo-core 3.0). Torch-free."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ckpttool.optim_state.schema import (
    STATE_FIELDS,
    hyperparameter_value,
    lion_group,
    other_adam_family,
    sparse_adam_group,
)

__all__ = [
    "ADAMW",
    "KNOWN_OPTIMIZERS",
    "SCALAR_FIELDS",
    "KnownOptimizer",
    "known_optimizers_of",
    "field_shape",
    "known_state_fields",
    "saved_by",
    "saved_by_adamw",
]

#: The name of ckpttool's own AdamW family's entry (the state ``O001``/``O004``/``O005`` check).
ADAMW = "AdamW"

#: What a param group (hyperparameter name -> saved value; ``None`` where unread) must show for an entry to apply
#: (``KnownOptimizer.group``), or shows of the one optimizer among several that save the same fields that saved
#: them (``KnownOptimizer.told_by``). Every torch Adam/AdamW group holds ``amsgrad`` (and, since torch 2.7,
#: ``decoupled_weight_decay``: ``False`` for Adam, ``True`` for AdamW); RAdam's holds ``decoupled_weight_decay``
#: without ``amsgrad``; SparseAdam's ``betas`` and ``maximize`` without ``weight_decay``; SGD's ``dampening``;
#: torch's Muon ``ns_steps``, Keller Jordan's ``use_muon``.
_GROUP_TESTS: dict[str, Callable[[Mapping[str, Any], frozenset[str]], bool]] = {
    "amsgrad=True": lambda group, _fields: group.get("amsgrad") is True,
    "betas without eps": lambda group, fields: lion_group(group, fields),
    "Adam's, not AdamW's": lambda group, _fields: (
        "amsgrad" in group and group.get("decoupled_weight_decay") is not True
    ),
    "decoupled_weight_decay=False": lambda group, _fields: group.get("decoupled_weight_decay") is False,
    "decoupled_weight_decay=True": lambda group, _fields: group.get("decoupled_weight_decay") is True,
    "RAdam's": lambda group, _fields: other_adam_family(group) == "RAdam",
    "SparseAdam's": lambda group, _fields: sparse_adam_group(group),
    "dampening": lambda group, _fields: "dampening" in group,
    "ns_steps or use_muon": lambda group, _fields: "ns_steps" in group or "use_muon" in group,
    "momentum > 0": lambda group, _fields: _positive(group.get("momentum")),
    "centered=True": lambda group, _fields: group.get("centered") is True,
}


def _positive(v: Any) -> bool:
    """A saved number above zero (a one-element tensor too; anything else is not)."""
    x = hyperparameter_value(v)
    return x is not None and x > 0


@dataclass(frozen=True)
class KnownOptimizer:
    """An optimizer's per-parameter state: ``required`` fields it always saves once it stepped, ``optional``
    ones its configuration adds; ``group``: what its param group must show for the entry to apply (a key of
    :data:`_GROUP_TESTS`: ``amsgrad=True``, Lion's ``betas without eps``), or ``None``; ``saved_by``: the class
    users build (``torch.optim.RMSprop``); ``told_by``: what its param group shows that picks it among entries
    saving the same fields (SGD's ``dampening`` beside Muon's ``momentum_buffer``), or ``None``; ``scalars``: its
    fields saved as one number (a 0-d tensor, ``torch.tensor(...)``); ``reduced``: fields saved as their
    parameter's shape with one dimension kept as 1 (Adafactor's factored ``row_var``/``col_var``: ``new_zeros``
    of the gradient's shape with dim -1 / -2 set to 1); every other field has its parameter's shape
    (``zeros_like(p)``, ``full_like(p)``, a clone of the gradient)."""

    name: str
    required: frozenset[str]
    optional: frozenset[str] = frozenset()
    group: str | None = None
    saved_by: str = ""
    told_by: str | None = None
    scalars: frozenset[str] = frozenset(("step",))
    reduced: tuple[tuple[str, int], ...] = ()
    needed_when: tuple[tuple[str, str], ...] = ()

    def lacks(self, fields: Iterable[str], group: Mapping[str, Any] | None) -> list[tuple[str, str]]:
        """``(field, condition)`` of each optional field its step reads (``state["..."]``: ``KeyError`` where
        missing) that the param group ``group`` asks for and ``fields`` lack (RMSprop's ``momentum_buffer`` where
        ``momentum > 0``, ``grad_avg`` where ``centered``); ``[]`` where ``group`` is unread."""
        have = frozenset(fields)
        if group is None:
            return []
        return [(f, when) for f, when in self.needed_when if f not in have and _GROUP_TESTS[when](group, have)]

    def saves(self, fields: Iterable[str], group: Mapping[str, Any] | None = None) -> bool:
        """Whether this optimizer saves exactly ``fields`` for one parameter of the param group ``group``
        (hyperparameter name -> saved value, ``None`` where unread; ``None`` where the parameter has none)."""
        have = frozenset(fields)
        if self.group is not None and (group is None or not _GROUP_TESTS[self.group](group, have)):
            return False
        return self.required <= have <= self.required | self.optional

    def told(self, fields: Iterable[str], group: Mapping[str, Any] | None) -> bool:
        """Whether the param group ``group`` shows this optimizer (its ``group`` or ``told_by`` test)."""
        tests = [t for t in (self.group, self.told_by) if t is not None]
        return group is not None and bool(tests) and all(_GROUP_TESTS[t](group, frozenset(fields)) for t in tests)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "saved_by": self.saved_by,
            "required": sorted(self.required),
            "optional": sorted(self.optional),
            "group": self.group,
            "told_by": self.told_by,
        }


def _k(
    name: str,
    saved_by: str,
    required: str,
    optional: str = "",
    group: str | None = None,
    *,
    told_by: str | None = None,
    scalars: str = "step",
    reduced: tuple[tuple[str, int], ...] = (),
    needed_when: tuple[tuple[str, str], ...] = (),
) -> KnownOptimizer:
    return KnownOptimizer(
        name,
        frozenset(required.split()),
        frozenset(optional.split()),
        group,
        saved_by,
        told_by,
        frozenset(scalars.split()),
        reduced,
        needed_when,
    )


_ADAMW = "step exp_avg exp_avg_sq"
_T = "torch.optim."

#: The optimizers whose saved state ``validate`` knows and ``inspect`` names, in the order ``docs/rules.md`` lists
#: them (``torch.optim.LBFGS`` is not among them: its state is lists of flat tensors over all parameters, kept on
#: the first one).
KNOWN_OPTIMIZERS: tuple[KnownOptimizer, ...] = (
    _k(ADAMW, _T + "AdamW", _ADAMW, " ".join(f for f in STATE_FIELDS if f not in _ADAMW.split())),  # master_weight
    _k("Adam", _T + "Adam", _ADAMW, group="Adam's, not AdamW's", told_by="decoupled_weight_decay=False"),
    _k(
        "AdamW amsgrad",
        _T + "AdamW",
        _ADAMW + " max_exp_avg_sq",
        group="amsgrad=True",
        told_by="decoupled_weight_decay=True",
    ),
    _k(
        "Adam amsgrad",
        _T + "Adam",
        _ADAMW + " max_exp_avg_sq",
        group="amsgrad=True",
        told_by="decoupled_weight_decay=False",
    ),
    _k("SGD", _T + "SGD", "momentum_buffer", told_by="dampening"),  # momentum > 0; momentum 0 saves no state
    _k("Adagrad", _T + "Adagrad", "step sum"),
    _k(
        "RMSprop",
        _T + "RMSprop",
        "step square_avg",
        "momentum_buffer grad_avg",
        needed_when=(("momentum_buffer", "momentum > 0"), ("grad_avg", "centered=True")),  # torch/optim/rmsprop.py
    ),
    _k("Adamax", _T + "Adamax", "step exp_avg exp_inf"),
    _k("NAdam", _T + "NAdam", "step mu_product exp_avg exp_avg_sq", scalars="step mu_product"),
    _k("RAdam", _T + "RAdam", _ADAMW, group="RAdam's"),
    _k("SparseAdam", _T + "SparseAdam", _ADAMW, group="SparseAdam's"),  # step: a Python int
    _k("Adadelta", _T + "Adadelta", "step square_avg acc_delta"),
    _k("Adafactor", _T + "Adafactor", "step row_var col_var", reduced=(("row_var", -1), ("col_var", -2))),  # 2+-D
    _k("Adafactor 1-D", _T + "Adafactor", "step variance"),  # a parameter of one dimension (or none)
    _k("Rprop", _T + "Rprop", "step prev step_size"),
    _k("ASGD", _T + "ASGD", "step eta mu ax", scalars="step eta mu"),
    _k("Muon", _T + "Muon", "momentum_buffer", told_by="ns_steps or use_muon"),
    _k(
        "Lion", "Lion", "exp_avg", "step_factor", group="betas without eps", scalars="step step_factor"
    ),  # OLMo-core's Lion (step_factor), SkipStepLion, lion-pytorch
)

#: The fields some optimizer above saves as one number (a 0-d tensor: ``torch.tensor(...)``).
SCALAR_FIELDS: frozenset[str] = frozenset().union(*(k.scalars for k in KNOWN_OPTIMIZERS))


def field_shape(optimizers: Iterable[str], name: str, param_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape torch gives the state field ``name`` of a parameter of ``param_shape`` in the state of the
    :data:`KNOWN_OPTIMIZERS` named ``optimizers`` (:func:`known_optimizers_of`): ``()`` for a scalar field, the
    parameter's shape with one dimension 1 for a reduced one (Adafactor's, of a parameter of 2+ dimensions; ``None``
    for one of fewer, which torch's Adafactor keeps as ``variance``), else the parameter's shape."""
    if name in SCALAR_FIELDS:
        return ()
    for k in KNOWN_OPTIMIZERS:
        dim = dict(k.reduced).get(name) if k.name in optimizers else None
        if dim is not None:
            if len(param_shape) < 2:
                return None
            shape = list(param_shape)
            shape[dim] = 1
            return tuple(shape)
    return param_shape


def known_optimizers_of(fields: Iterable[str], group: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """The names of the :data:`KNOWN_OPTIMIZERS` that save exactly ``fields`` for a parameter of ``group``."""
    have = frozenset(fields)
    return tuple(k.name for k in KNOWN_OPTIMIZERS if k.saves(have, group))


def saved_by_adamw(fields: Iterable[str]) -> bool:
    """Whether ckpttool's own AdamW family (the first entry of :data:`KNOWN_OPTIMIZERS`) saves exactly ``fields``: told
    without the param group, so the common case never builds one (validate asks it of every parameter)."""
    return KNOWN_OPTIMIZERS[0].saves(fields)


def known_state_fields() -> frozenset[str]:
    """Every field some :data:`KNOWN_OPTIMIZERS` entry saves (a field outside it is no known optimizer's)."""
    out: frozenset[str] = frozenset()
    for k in KNOWN_OPTIMIZERS:
        out |= k.required | k.optional
    return out


#: The param-group values a test of :data:`_GROUP_TESTS` reads (``is True`` / ``is False``); the others read which
#: keys the group holds.
_READ_VALUES = ("amsgrad", "decoupled_weight_decay")


def saved_by(fields: Iterable[str], keys: Iterable[str] | None = None, values: Mapping[str, Any] | None = None) -> str:
    """The optimizer that saved ``fields`` for a parameter whose param group holds ``keys`` with the saved
    ``values`` (``None``: no group): its class (``torch.optim.RMSprop``), ``ambiguous: A or B`` where the fields fit
    several entries of :data:`KNOWN_OPTIMIZERS` and the group tells none of them (``momentum_buffer`` in a group of
    neither SGD's nor Muon's keys), or ``unknown`` where they fit none. An entry whose group shows it
    (:meth:`KnownOptimizer.told`) is preferred; with no fields (a parameter that has no state: SGD at momentum 0)
    only the group can tell. Cached: one answer per field set and group shape."""
    vals = values or {}
    amsgrad, decoupled = vals.get("amsgrad"), vals.get("decoupled_weight_decay")  # _READ_VALUES
    read = (amsgrad if isinstance(amsgrad, bool) else None, decoupled if isinstance(decoupled, bool) else None)
    return _saved_by(tuple(fields), None if keys is None else tuple(keys), read)


@lru_cache(maxsize=4096)
def _saved_by(names: tuple[str, ...], keys: tuple[str, ...] | None, read: tuple[bool | None, ...]) -> str:
    fields = frozenset(names)
    group = None
    if keys is not None:
        group = {**dict.fromkeys(keys), **{k: v for k, v in zip(_READ_VALUES, read, strict=True) if k in keys}}
    fit = [k for k in KNOWN_OPTIMIZERS if fields and k.saves(fields, group)]
    told = [k for k in (fit if fields else KNOWN_OPTIMIZERS) if k.told(fields, group)]
    labels = list(dict.fromkeys(k.saved_by for k in (told or fit)))
    if not labels:
        return "unknown"
    return labels[0] if len(labels) == 1 else "ambiguous: " + " or ".join(labels)
