"""``validate``: rule checks with stable codes (``docs/rules.md``).

Public API::

    from ckpttool.ops.validate import ValidateOptions, validate
    res = validate("ckpt/", ValidateOptions(strict=True, deep=True))
    res.exit_code, [f.to_dict() for f in res.findings]

Each rule is one function registered with a stable code in :data:`RULES` (families
``S`` storage, ``O`` optimizer state, ``P`` param groups, ``L`` layout, ``M`` model,
``K`` key schema, ``D`` deep, ``R`` resume safety; modules under :mod:`.rules`); rules are pure functions of a
:class:`~ckpttool.ops.validate.context.Context` and never print.
"""

from __future__ import annotations

from ckpttool.ops.validate.base import FAMILIES, RULES, Finding, Rule, Severity, select_rules
from ckpttool.ops.validate.junit import junit_xml
from ckpttool.ops.validate.runner import (
    SCHEMA,
    RuleStatus,
    ValidateOptions,
    ValidationResult,
    validate,
)

__all__ = [
    "FAMILIES",
    "RULES",
    "SCHEMA",
    "Finding",
    "Rule",
    "RuleStatus",
    "Severity",
    "ValidateOptions",
    "ValidationResult",
    "junit_xml",
    "select_rules",
    "validate",
]
