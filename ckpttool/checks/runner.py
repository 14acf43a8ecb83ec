"""``validate``'s library function: run the selected rules and return a :class:`ValidationResult`.

Exit status (DESIGN.md section 4): 2 when a fatal finding says the input is
unreadable or unsafe, 1 when findings fail the run (errors; warnings too with
``strict``), else 0. Info findings never fail a run.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import data, layout, model, optimizer, storage  # noqa: F401 - register the rules
from .base import RULES, Finding, Rule, Severity, select_rules
from .context import Context, build_context, load_config
from .reference import load_reference

__all__ = ["SCHEMA", "RuleStatus", "ValidationResult", "validate"]

SCHEMA = "ckpttool.validate/1"


@dataclass(frozen=True)
class RuleStatus:
    """How one selected rule ended: ``passed``, ``failed`` (has failing findings), ``reported``
    (non-failing findings only) or ``skipped`` (with ``reason``)."""

    rule: Rule
    status: str
    reason: str | None = None
    findings: tuple[Finding, ...] = ()


@dataclass
class ValidationResult:
    """Outcome of :func:`validate`.

    Attributes:
        path: the checkpoint; strict, deep: the options used.
        findings: every finding, ordered by severity, code and key.
        rules: status of every selected rule, in code order.
        exit_code: 0 clean, 1 failing findings, 2 unreadable/unsafe input.
        seconds: wall time; bytes_read: data bytes read (``--deep``); deep_seconds: time of the deep pass.
    """

    path: Path
    strict: bool
    deep: bool
    findings: list[Finding] = field(default_factory=list)
    rules: list[RuleStatus] = field(default_factory=list)
    exit_code: int = 0
    seconds: float = 0.0
    bytes_read: int = 0
    deep_seconds: float = 0.0

    def fails(self, f: Finding) -> bool:
        """Does this finding fail the run (errors; warnings with ``strict``)?"""
        return f.severity is Severity.error or (self.strict and f.severity is Severity.warning)

    @property
    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in Severity}
        for f in self.findings:
            out[f.severity.value] += 1
        return out

    @property
    def failing(self) -> int:
        return sum(1 for f in self.findings if self.fails(f))

    def to_json(self) -> dict[str, Any]:
        """JSON view, schema ``ckpttool.validate/1`` (``docs/rules.md``)."""
        return {
            "schema": SCHEMA,
            "path": str(self.path),
            "strict": self.strict,
            "deep": self.deep,
            "ok": self.exit_code == 0,
            "exit_code": self.exit_code,
            "counts": self.counts,
            "failing": self.failing,
            "findings": [{**f.to_dict(), "fails": self.fails(f)} for f in self.findings],
            "rules": [
                {"code": s.rule.code, "name": s.rule.name, "severity": s.rule.severity.value, "status": s.status,
                 "reason": s.reason, "findings": len(s.findings)}
                for s in self.rules
            ],
            "stats": {"seconds": round(self.seconds, 4), "bytes_read": self.bytes_read,
                      "deep_seconds": round(self.deep_seconds, 4)},
        }


def _skip_reason(r: Rule, ctx: Context) -> str | None:
    if ctx.cat is None and r.code != "S001":
        return ".metadata is unusable"
    if "deep" in r.needs and not ctx.deep:
        return "needs --deep"
    if "config" in r.needs and ctx.config is None:
        return "needs --config"
    if "against" in r.needs and ctx.reference is None:
        return "needs --against"
    return None


def validate(
    path: str | os.PathLike[str],
    *,
    strict: bool = False,
    deep: bool = False,
    select: list[str] | None = None,
    ignore: list[str] | None = None,
    config: str | os.PathLike[str] | dict[str, Any] | None = None,
    against: str | os.PathLike[str] | None = None,
    source_layout: str | None = None,
    ep_size: int | None = None,
    ep_fsdp_size: int | None = None,
    trust_pickle: bool = False,
    workers: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ValidationResult:
    """Check a DCP checkpoint against the rules of ``docs/rules.md``.

    Args:
        path: checkpoint directory.
        strict: warnings fail the run too (unknown or ambiguous things fail closed).
        deep: also read every data byte once (files in parallel) for the ``D`` rules and others
            marked ``--deep``.
        select, ignore: rule codes or code prefixes (``"S"``, ``"O00"``, ``"D004"``); comma lists allowed.
        config: HF ``config.json`` path (or its dict) for the ``M00x`` config rules.
        against: reference model (HF directory, ``.safetensors``, JSON key list) for ``M005..M008``.
        source_layout, ep_size, ep_fsdp_size: EP layout declaration (``--source-layout`` ...).
        trust_pickle: allow ``torch.load(weights_only=False)`` for byte items / ``extra_state``.
        workers: threads of the deep pass.
        progress: called as ``progress(bytes_done, bytes_total)`` during the deep pass.

    Returns:
        The :class:`ValidationResult` (never raises for a damaged checkpoint: that is findings).

    Raises:
        UsageError: bad invocation (not a directory, unknown rule code, unreadable --config/--against,
            inconsistent layout declaration).
    """
    t0 = time.perf_counter()
    # Rules allocate many small objects and no cycles: pause the cyclic GC (about halves the
    # time on 10^5-entry checkpoints, as for inspect).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _validate(path, t0, strict, deep, select, ignore, config, against, source_layout, ep_size,
                         ep_fsdp_size, trust_pickle, workers, progress)
    finally:
        if gc_was_enabled:
            gc.enable()


def _validate(path: str | os.PathLike[str], t0: float, strict: bool, deep: bool, select: list[str] | None,
              ignore: list[str] | None, config: Any, against: Any, source_layout: str | None, ep_size: int | None,
              ep_fsdp_size: int | None, trust_pickle: bool, workers: int | None,
              progress: Callable[[int, int], None] | None) -> ValidationResult:
    from ..layouts.declare import LayoutDeclaration

    rules = select_rules(select, ignore)
    decl = LayoutDeclaration.from_options(source_layout, ep_size, ep_fsdp_size)
    cfg = config if isinstance(config, dict) or config is None else load_config(config)
    ref = load_reference(against) if against is not None else None
    ctx = build_context(path, deep=deep, strict=strict, config=cfg, reference=ref, declaration=decl,
                        trust_pickle=trust_pickle, workers=workers)
    res = ValidationResult(Path(path), strict, deep)
    try:
        if deep and ctx.cat is not None and any(not _skip_reason(r, ctx) and "deep" in r.needs for r in rules):
            from .deep import run_deep

            ctx.deep_result = run_deep(ctx, workers, progress)
            res.bytes_read = ctx.deep_result.bytes_read
            res.deep_seconds = ctx.deep_result.seconds
        for r in rules:
            reason = _skip_reason(r, ctx)
            if reason is not None:
                res.rules.append(RuleStatus(r, "skipped", reason))
                continue
            found = []
            for out in r.func(ctx):
                found.append(out if isinstance(out, Finding) else r.make(*out))
            failing = any(res.fails(f) for f in found)
            res.rules.append(RuleStatus(r, "failed" if failing else ("reported" if found else "passed"), None,
                                        tuple(found)))
            res.findings.extend(found)
    finally:
        if ctx.reader is not None:
            ctx.reader.close()
    res.findings.sort(key=lambda f: (f.severity.rank, f.code, f.key or ""))
    if any(f.fatal for f in res.findings):
        res.exit_code = 2
    elif res.failing:
        res.exit_code = 1
    res.seconds = time.perf_counter() - t0
    return res
