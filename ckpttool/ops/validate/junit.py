"""JUnit XML of a :class:`~ckpttool.ops.validate.runner.ValidationResult`, for CI systems.

One ``<testcase>`` per selected rule (``classname`` ``ckpttool.validate.<family>``,
``name`` ``<code> <rule name>``): a ``<failure>`` when the rule has findings that fail
the run (its message the first finding, its text all of them), ``<skipped>`` when the
rule could not run (``needs --deep``, ...), and non-failing findings (warnings without
``--strict``, infos) in ``<system-out>``. Format: the JUnit XML schema as read by
Jenkins/GitLab/GitHub (``testsuites/testsuite/testcase``).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckpttool.ops.validate.runner import ValidationResult

__all__ = ["junit_xml"]


def _line(f: object) -> str:
    from ckpttool.ops.validate.base import Finding

    assert isinstance(f, Finding)
    err = f" [{f.error_code}]" if f.error_code else ""
    return f"{f.severity.value} {f.code}{err} {f.key or '-'}: {f.message} (hint: {f.hint})"


def junit_xml(res: ValidationResult) -> str:
    """The JUnit XML document (UTF-8 text with an XML declaration) of a validation result."""
    suites = ET.Element("testsuites", name="ckpttool validate")
    failures = sum(1 for s in res.rules if s.status == "failed")
    skipped = sum(1 for s in res.rules if s.status == "skipped")
    suite = ET.SubElement(
        suites,
        "testsuite",
        name=f"ckpttool.validate {res.path}",
        tests=str(len(res.rules)),
        failures=str(failures),
        errors="0",
        skipped=str(skipped),
        time=f"{res.seconds:.3f}",
    )
    props = ET.SubElement(suite, "properties")
    for k, v in (
        ("path", str(res.path)),
        ("strict", str(res.strict).lower()),
        ("deep", str(res.deep).lower()),
        ("exit_code", str(res.exit_code)),
    ):
        ET.SubElement(props, "property", name=k, value=v)
    for s in res.rules:
        case = ET.SubElement(
            suite,
            "testcase",
            classname=f"ckpttool.validate.{s.rule.family.split()[0]}",
            name=f"{s.rule.code} {s.rule.name}",
            time="0",
        )
        failing = [f for f in s.findings if res.fails(f)]
        other = [f for f in s.findings if not res.fails(f)]
        if s.status == "skipped":
            ET.SubElement(case, "skipped", message=s.reason or "skipped")
        elif failing:
            el = ET.SubElement(case, "failure", message=failing[0].message, type=failing[0].severity.value)
            el.text = "\n".join(_line(f) for f in failing)
        # a rule that ran in part (R002 without --deep: common.pt only) says so: a pass is not a full check
        part = [f"ran in part: {s.reason}"] if s.status != "skipped" and s.reason else []
        if other or part:
            ET.SubElement(case, "system-out").text = "\n".join(part + [_line(f) for f in other])
    ET.indent(suites)
    text = ET.tostring(suites, encoding="unicode")
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + _NOT_XML.sub(_escaped, text) + "\n"


#: Characters XML 1.0 does not allow in a document (ElementTree writes them as they are: a key or path holding one
#: made the report unparsable for CI), and lone surrogates (undecodable bytes of a file name), which UTF-8 cannot hold.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _escaped(m: re.Match[str]) -> str:
    """``\\xNN`` / ``\\uNNNN`` for a character XML cannot hold (a surrogate-escaped byte as the byte)."""
    c = ord(m.group())
    if 0xDC80 <= c <= 0xDCFF:
        return f"\\x{c - 0xDC00:02x}"
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"
