"""``ckpttool rules``: the validation rules (code, severity, what each checks); ``--json`` is ``ckpttool.rules/1``.

``ckpttool validate --list-rules`` prints the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ckpttool.ui.options import IgnoreOpt, JsonOpt, SelectOpt, examples
from ckpttool.ui.output import command_boundary, emit_json, writing_stdout

RULES_SCHEMA = "ckpttool.rules/1"


def rules_document(select: Sequence[str] = (), ignore: Sequence[str] = ()) -> dict[str, Any]:
    """The ``ckpttool.rules/1`` document: every rule of ``validate`` (those ``select``/``ignore`` name), by code."""
    from ckpttool.ops.validate.base import listed_rules

    return {
        "schema": RULES_SCHEMA,
        "rules": [
            {
                "code": r.code,
                "name": r.name,
                "severity": r.severity.value,
                "family": r.family,
                "needs": sorted(r.needs),
                "fatal": r.fatal,
                "summary": r.summary,
                "hint": r.hint,
            }
            for r in listed_rules(select, ignore)
        ],
    }


def print_rules(json_output: bool, select: Sequence[str] = (), ignore: Sequence[str] = ()) -> None:
    """Print the rules (those ``select``/``ignore`` name) as a table, or the ``ckpttool.rules/1`` JSON document."""
    with writing_stdout():
        doc = rules_document(select, ignore)
        if json_output:
            emit_json(doc)
            return
        from ckpttool.ui.render import Col, print_table, stdout_console

        print_table(
            stdout_console(),
            "rules",
            [
                Col("code", "code"),
                Col("name", "code", drop=2),
                Col("severity", "code"),
                Col("needs", "code", drop=1),
                Col("checks", "text"),
            ],
            [[r["code"], r["name"], r["severity"], ",".join(r["needs"]) or "-", r["summary"]] for r in doc["rules"]],
        )


@command_boundary
def rules_command(select: SelectOpt = None, ignore: IgnoreOpt = None, json_output: JsonOpt = False) -> None:
    """List the rules of `ckpttool validate`: code, severity, what each checks (select them with --select/--ignore)."""
    print_rules(json_output, select or (), ignore or ())


EPILOG = examples(
    "ckpttool rules",
    "ckpttool rules --json",
    "ckpttool rules --select O,P --ignore O004",
    "ckpttool validate ckpt/ --select O,L --ignore O004",
)
