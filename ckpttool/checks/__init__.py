"""Validation rules of ``ckpttool validate`` (``docs/rules.md``).

Public API::

    from ckpttool.checks import validate
    res = validate("ckpt/", strict=True, deep=True)
    res.exit_code, [f.to_dict() for f in res.findings]

Each rule is one function registered with a stable code in :data:`RULES`
(families ``S`` storage, ``O`` optimizer state, ``P`` param groups, ``L`` layout,
``M`` model, ``D`` deep); rules are pure functions of a
:class:`~ckpttool.checks.context.Context` and never print.
"""

from __future__ import annotations

from .base import FAMILIES, RULES, Finding, Rule, Severity, select_rules
from .report import junit_xml
from .runner import SCHEMA, RuleStatus, ValidationResult, validate

__all__ = [
    "FAMILIES",
    "RULES",
    "SCHEMA",
    "Finding",
    "Rule",
    "RuleStatus",
    "Severity",
    "ValidationResult",
    "junit_xml",
    "select_rules",
    "validate",
]
