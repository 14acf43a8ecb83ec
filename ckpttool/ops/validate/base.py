"""Rule registry, findings and severities of ``ckpttool validate``.

A rule is one function with a stable code (``S002``) and a row of ``rules.json`` (name, severity,
summary, fix hint, what it needs); it receives the :class:`~ckpttool.ops.validate.context.Context`
and yields ``(key, message)`` (or with a hint, or a :class:`Finding`). Families: ``S`` storage, ``O`` optimizer state,
``P`` param groups, ``L`` layout, ``M`` model, ``K`` key schema, ``D`` deep. Fatal rules
(unreadable or unsafe input) always run and make the command exit 2. ``docs/rules.md``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.errors import UsageError

if TYPE_CHECKING:
    from ckpttool.ops.validate.context import Context

__all__ = [
    "Severity",
    "Finding",
    "Rule",
    "RULES",
    "FAMILIES",
    "rule",
    "RuleSkipped",
    "select_rules",
    "listed_rules",
    "split_codes",
]


class RuleSkipped(Exception):
    """Raised by a rule function that found it cannot check this checkpoint (what it needs is not there): the
    run reports the rule ``skipped`` with ``reason``, never ``passed`` over a check that did not run."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Severity(str, Enum):
    """How bad a finding is. Errors always fail a run; warnings fail it with ``--strict``; infos never."""

    error = "error"
    warning = "warning"
    info = "info"

    @property
    def rank(self) -> int:
        return {"error": 0, "warning": 1, "info": 2}[self.value]


FAMILIES = {
    "S": "storage",
    "O": "optimizer state",
    "P": "param groups",
    "L": "layout",
    "M": "model",
    "K": "key schema",
    "D": "deep (data)",
    "R": "resume safety",
}


@dataclass(frozen=True)
class Finding:
    """One problem found by one rule.

    Attributes:
        code: the rule code (``S002``).
        severity: the rule's severity.
        key: checkpoint key, data file or group the finding is about (``None``: the checkpoint).
        message: one line naming the key or file.
        hint: one line saying how to fix it.
        error_code: the :class:`~ckpttool.errors.CkptError` code of the underlying
            failure when there is one (``E300`` for a missing file), else ``None``.
        fatal: the input is unreadable or unsafe (exit 2).
    """

    code: str
    severity: Severity
    key: str | None
    message: str
    hint: str
    error_code: str | None = None
    fatal: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON view (schema ``ckpttool.validate/1``, ``docs/rules.md``)."""
        return {
            "code": self.code,
            "severity": self.severity.value,
            "key": self.key,
            "message": self.message,
            "hint": self.hint,
            "error_code": self.error_code,
            "fatal": self.fatal,
        }


RuleOutput = tuple[Any, ...] | Finding


@dataclass(frozen=True)
class Rule:
    """A registered rule.

    Attributes:
        code: stable code, family letter + 3 digits.
        name: kebab-case name (``data-file-missing``).
        severity: severity of its findings.
        summary: what it checks (one line, used in ``docs/rules.md`` and JUnit).
        hint: default fix hint of its findings.
        needs: options it needs to run: subset of ``{"deep", "config", "against", "manifest"}``.
        shallow: what the rule checks without ``--deep`` although it needs it for the rest, from the trainer's
            common state of a checkpoint whose key schema declares one (``SchemaSpec.common_state_file``; ``R002``:
            Megatron's ``common.pt``, read anyway); ``None``: skipped without ``--deep``. The function reads
            ``ctx.deep`` to tell.
        fatal: findings mean unreadable/unsafe input (exit 2); always runs.
        func: ``func(ctx) -> iterable of (key, message[, hint]) or Finding``.
    """

    code: str
    name: str
    severity: Severity
    summary: str
    hint: str
    func: Callable[[Context], Iterable[RuleOutput]]
    needs: frozenset[str] = field(default_factory=frozenset)
    fatal: bool = False
    error_code: str | None = None
    shallow: str | None = None

    @property
    def family(self) -> str:
        return FAMILIES[self.code[0]]

    def make(self, key: str | None, message: str, hint: str | None = None, error_code: str | None = None) -> Finding:
        """A finding of this rule (single-line message and hint)."""
        return Finding(
            self.code,
            self.severity,
            key,
            " ".join(str(message).split()),
            " ".join(str(hint if hint is not None else self.hint).split()),
            error_code or self.error_code,
            self.fatal,
        )


RULES: dict[str, Rule] = {}


#: code -> the rule's declaration: name, severity, summary, hint, needs, fatal, error_code (``rules.json``)
_TABLE: dict[str, dict[str, Any]] = json.loads((Path(__file__).parent / "rules.json").read_text(encoding="utf-8"))


def rule(code: str) -> Callable[[Callable[[Context], Iterable[RuleOutput]]], Callable[[Context], Iterable[RuleOutput]]]:
    """Register a rule function under ``code``, declared by its row of ``rules.json`` (see :class:`Rule`).

    The table is the one place a rule's name, severity, summary, hint, needs, fatality and error
    code are written (``docs/rules.md`` shows them); the function holds only the check.
    """

    def deco(func: Callable[[Context], Iterable[RuleOutput]]) -> Callable[[Context], Iterable[RuleOutput]]:
        assert code not in RULES, f"duplicate rule code {code}"
        assert code[0] in FAMILIES and len(code) == 4 and code[1:].isdigit(), code
        row = _TABLE[code]
        RULES[code] = Rule(
            code,
            row["name"],
            Severity(row["severity"]),
            row["summary"],
            row["hint"],
            func,
            frozenset(row.get("needs", ())),
            row.get("fatal", False),
            row.get("error_code"),
            row["shallow"]["checks"] if "shallow" in row else None,
        )
        return func

    return deco


def split_codes(values: Iterable[str] | None) -> list[str]:
    """``--select``/``--ignore`` values as codes or code prefixes: comma lists or repeated, upper-cased."""
    out: list[str] = []
    for v in values or ():
        out.extend(p.strip().upper() for p in str(v).split(",") if p.strip())
    return out


def select_rules(select: Iterable[str] | None = None, ignore: Iterable[str] | None = None) -> list[Rule]:
    """Rules chosen by ``--select``/``--ignore`` codes or code prefixes (``S``, ``O00``, ``D004``).

    Like linters: a rule runs when it matches a ``select`` prefix (all rules when none is
    given) and no ``ignore`` prefix. Fatal rules always run.

    Raises:
        UsageError: a code or prefix that matches no rule.
    """
    sel, ign = split_codes(select), split_codes(ignore)
    for name, codes in (("select", sel), ("ignore", ign)):
        for p in codes:
            if not any(c.startswith(p) for c in RULES):
                raise UsageError(
                    f"`{name}` {p!r} matches no rule code",
                    param=name,
                    hint=f"codes start with one of {', '.join(FAMILIES)} "
                    "(see docs/rules.md or `ckpttool validate --list-rules`)",
                )
    return [RULES[c] for c in sorted(RULES) if _chosen(c, sel, ign) or RULES[c].fatal]


def _chosen(code: str, sel: list[str], ign: list[str]) -> bool:
    """Rule ``code`` matches a ``select`` prefix (any, when none is given) and no ``ignore`` prefix."""
    return (not sel or any(code.startswith(p) for p in sel)) and not any(code.startswith(p) for p in ign)


def listed_rules(select: Iterable[str] | None = None, ignore: Iterable[str] | None = None) -> list[Rule]:
    """The rules ``select``/``ignore`` name, by code, without the fatal rules a run adds (``--list-rules``).

    Raises:
        UsageError: a code or prefix that matches no rule, or ``ignore`` leaves none of the rules ``select`` chose (as
            a run refuses it: ``rules --select O --ignore O`` listed no rule, exit 0).
    """
    select_rules(select, ignore)  # the codes checked as a run checks them
    sel, ign = split_codes(select), split_codes(ignore)
    listed = [RULES[c] for c in sorted(RULES) if _chosen(c, sel, ign)]
    if sel and not listed:
        raise UsageError(
            f"`ignore` {', '.join(ign)} leaves none of the rules `select` {', '.join(sel)} chose: nothing would be "
            "checked",
            param="select",
            hint="drop the `ignore` codes that cover the selection, or select other rules",
        )
    return listed
