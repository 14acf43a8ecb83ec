"""The per-parameter state fields of the optimizers users run, beside ckpttool's AdamW family.

One table (:data:`KNOWN_OPTIMIZERS`), read by ``validate`` (``docs/rules.md``): a parameter's saved fields that
one of these optimizers saves together are known state, not ``O008``'s "unknown state fields", and ``O004``
checks their shapes (:data:`SCALAR_FIELDS`); nothing more of them (values, dtypes) is checked, and
``replay-step`` still replays AdamW state only. Each entry was read off the optimizer's own source:
``torch/optim/<name>.py`` (``state["..."] =`` in ``_init_group`` / ``step``, torch 2.13) and
``olmo_core/optim/lion.py`` (OLMo-core 3.0). Torch-free."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckpttool.optim_state.schema import STATE_FIELDS, lion_group

__all__ = [
    "ADAMW",
    "KNOWN_OPTIMIZERS",
    "SCALAR_FIELDS",
    "KnownOptimizer",
    "known_optimizers_of",
    "known_state_fields",
    "saved_by_adamw",
]

#: The name of ckpttool's own AdamW family's entry (the state ``O001``/``O004``/``O005`` check).
ADAMW = "AdamW"

#: The fields the optimizers below save as one number (a 0-d tensor: ``torch.tensor(...)``); every other field of
#: theirs is a tensor of its parameter's shape (``zeros_like(p)``, ``full_like(p)``, a clone of the gradient).
SCALAR_FIELDS: frozenset[str] = frozenset(("step", "step_factor", "mu_product"))

#: What a param group (hyperparameter name -> saved value; ``None`` where unread) must show for an entry to apply.
_GROUP_TESTS: dict[str, Callable[[Mapping[str, Any], frozenset[str]], bool]] = {
    "amsgrad=True": lambda group, _fields: group.get("amsgrad") is True,
    "betas without eps": lambda group, fields: lion_group(group, fields),
}


@dataclass(frozen=True)
class KnownOptimizer:
    """An optimizer's per-parameter state: ``required`` fields it always saves once it stepped, ``optional``
    ones its configuration adds; ``group``: what its param group must show for the entry to apply (a key of
    :data:`_GROUP_TESTS`: ``amsgrad=True``, Lion's ``betas without eps``), or ``None``."""

    name: str
    required: frozenset[str]
    optional: frozenset[str] = frozenset()
    group: str | None = None

    def saves(self, fields: Iterable[str], group: Mapping[str, Any] | None = None) -> bool:
        """Whether this optimizer saves exactly ``fields`` for one parameter of the param group ``group``
        (hyperparameter name -> saved value, ``None`` where unread; ``None`` where the parameter has none)."""
        have = frozenset(fields)
        if self.group is not None and (group is None or not _GROUP_TESTS[self.group](group, have)):
            return False
        return self.required <= have <= self.required | self.optional

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "required": sorted(self.required),
            "optional": sorted(self.optional),
            "group": self.group,
        }


def _k(name: str, required: str, optional: str = "", group: str | None = None) -> KnownOptimizer:
    return KnownOptimizer(name, frozenset(required.split()), frozenset(optional.split()), group)


_ADAMW = "step exp_avg exp_avg_sq"

#: The optimizers whose saved state ``validate`` knows, in the order ``docs/rules.md`` lists them.
KNOWN_OPTIMIZERS: tuple[KnownOptimizer, ...] = (
    _k(ADAMW, _ADAMW, " ".join(f for f in STATE_FIELDS if f not in _ADAMW.split())),  # and master_weight
    _k("Adam/AdamW amsgrad", "step exp_avg exp_avg_sq max_exp_avg_sq", group="amsgrad=True"),
    _k("SGD", "momentum_buffer"),  # momentum > 0; momentum 0 saves no state
    _k("Adagrad", "step sum"),
    _k("RMSprop", "step square_avg", "momentum_buffer grad_avg"),  # momentum > 0; centered
    _k("Adamax", "step exp_avg exp_inf"),
    _k("NAdam", "step mu_product exp_avg exp_avg_sq"),
    _k("RAdam", "step exp_avg exp_avg_sq"),
    _k("Adadelta", "step square_avg acc_delta"),
    _k("Muon", "momentum_buffer"),  # torch.optim.Muon
    _k(
        "Lion", "exp_avg", "step_factor", group="betas without eps"
    ),  # OLMo-core's Lion (step_factor), SkipStepLion, lion-pytorch
)


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
