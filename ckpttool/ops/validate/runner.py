"""``validate``: run the selected rules over an opened checkpoint and return a :class:`ValidationResult`.

Exit status (``docs/errors.md``): 2 when a fatal finding says the input is unreadable or
unsafe, 1 when findings fail the run (errors; warnings too with ``strict``), else 0.
Info findings never fail a run.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ckpttool import errors
from ckpttool.errors import at_least
from ckpttool.format.storage import check_url_key, is_url, url_path
from ckpttool.model.checkpoint import Checkpoint, CheckpointOrPath, OpenOptions, check_source, gc_held, open_checkpoint
from ckpttool.model.hfconfig import read_hf_config
from ckpttool.ops.fields import Hooks, ProgressFn, Unpack, hooks_of, options_of
from ckpttool.ops.validate import rules as _rules  # noqa: F401 - registers the rules
from ckpttool.ops.validate.base import (
    RULES,
    Finding,
    Rule,
    RuleSkipped,
    Severity,
    listed_rules,
    select_rules,
    split_codes,
)
from ckpttool.ops.validate.context import Context
from ckpttool.ops.validate.reference import load_reference

if TYPE_CHECKING:
    from ckpttool.model.discovery import Located
    from ckpttool.ops.manifest import Manifest

__all__ = ["SCHEMA", "RuleStatus", "ValidateOptions", "ValidationResult", "validate"]
log = logging.getLogger(__name__)

SCHEMA = "ckpttool.validate/1"


@dataclass(frozen=True)
class ValidateOptions:
    """What ``validate`` checks.

    Attributes:
        strict: warnings fail the run too (unknown or ambiguous things fail closed).
        deep: also read every data byte once (files in parallel) for the ``D`` rules and others
            marked ``--deep``.
        select, ignore: rule codes or code prefixes (``"S"``, ``"O00"``, ``"D004"``); comma lists allowed.
        config: HF ``config.json`` (path, or its dict) for the ``M00x`` config rules.
        against: reference model (HF directory, ``.safetensors``, JSON key list) for ``M005..M008``.
        workers: threads of the deep pass (``None``: ``min(8, max(2, CPU count))``).
        manifest: an integrity manifest (``ckpttool manifest``) to verify every chunk against (``S015``):
            its file, a directory holding ``manifest.json``, or ``""`` for the checkpoint's own (the
            ``manifest.json`` beside the opened checkpoint's ``.metadata``; a local checkpoint only).
    """

    strict: bool = False
    deep: bool = False
    select: Sequence[str] = ()
    ignore: Sequence[str] = ()
    config: str | os.PathLike[str] | dict[str, Any] | None = None
    against: str | os.PathLike[str] | None = None
    workers: int | None = field(default=None, metadata=at_least(1))
    manifest: str | os.PathLike[str] | None = None


@dataclass(frozen=True)
class RuleStatus:
    """How one selected rule ended: ``passed``, ``failed`` (has failing findings), ``reported``
    (non-failing findings only) or ``skipped`` (with ``reason``); a rule that ran in part without ``--deep``
    (:attr:`~ckpttool.ops.validate.base.Rule.shallow`) says what it checked in ``reason``."""

    rule: Rule
    status: str
    reason: str | None = None
    findings: tuple[Finding, ...] = ()


@dataclass(frozen=True)
class ValidationResult:
    """Outcome of :func:`validate` (``--json``: :meth:`to_dict`, schema ``ckpttool.validate/1``).

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
    findings: tuple[Finding, ...] = ()
    rules: tuple[RuleStatus, ...] = ()
    exit_code: int = 0
    seconds: float = 0.0
    bytes_read: int = 0
    deep_seconds: float = 0.0

    def fails(self, f: Finding) -> bool:
        """Does this finding fail the run (errors; warnings with ``strict``)?"""
        return _fails(f, self.strict)

    @property
    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in Severity}
        for f in self.findings:
            out[f.severity.value] += 1
        return out

    @property
    def failing(self) -> int:
        return sum(1 for f in self.findings if self.fails(f))

    @property
    def fatal(self) -> Finding | None:
        """The first finding that makes the input unusable (exit 2), if any."""
        return next((f for f in self.findings if f.fatal), None)

    def to_dict(self) -> dict[str, Any]:
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
                {
                    "code": s.rule.code,
                    "name": s.rule.name,
                    "severity": s.rule.severity.value,
                    "status": s.status,
                    "reason": s.reason,
                    "findings": len(s.findings),
                }
                for s in self.rules
            ],
            "stats": {
                "seconds": round(self.seconds, 4),
                "bytes_read": self.bytes_read,
                "deep_seconds": round(self.deep_seconds, 4),
            },
        }


def _fails(f: Finding, strict: bool) -> bool:
    return f.severity is Severity.error or (strict and f.severity is Severity.warning)


def _skip_reason(r: Rule, ctx: Context) -> str | None:
    if "deep" in r.needs and not ctx.deep and not _shallow(r, ctx):
        return "needs --deep"
    if "config" in r.needs and ctx.config is None:
        return "needs --config"
    if "against" in r.needs and ctx.reference is None:
        return "needs --against"
    if "manifest" in r.needs and ctx.manifest is None:
        return "needs --manifest"
    if r.code.startswith("O") and _model_only(ctx):  # never "passed" over state that is not there
        if ctx.cat.per_parameter_optimizer_state():  # there, in a form not read: K002 names it
            return "optimizer state saved per parameter, not read (K002)"
        return "no optimizer state (model weights only)"
    return None


def _shallow(r: Rule, ctx: Context) -> bool:
    """Rule ``r`` checks part of what it checks without ``--deep`` on this checkpoint (:attr:`Rule.shallow`): its key
    schema declares a common state."""
    return r.shallow is not None and ctx.ckpt.common_state_file is not None


def _model_only(ctx: Context) -> bool:
    """Model tensors, and neither optimizer state nor param groups (a model-only save: nothing to resume from)."""
    cat = ctx.cat
    return bool(cat.model) and not cat.optimizer_state and not cat.param_groups


def _finish(
    path: Path,
    options: ValidateOptions,
    statuses: list[RuleStatus],
    t0: float,
    bytes_read: int = 0,
    deep_seconds: float = 0.0,
) -> ValidationResult:
    findings = sorted((f for s in statuses for f in s.findings), key=lambda f: (f.severity.rank, f.code, f.key or ""))
    code = 2 if any(f.fatal for f in findings) else 1 if any(_fails(f, options.strict) for f in findings) else 0
    return ValidationResult(
        path,
        options.strict,
        options.deep,
        tuple(findings),
        tuple(statuses),
        code,
        time.perf_counter() - t0,
        bytes_read,
        deep_seconds,
    )


def _validate_open(
    ckpt: Checkpoint,
    opts: ValidateOptions,
    progress: ProgressFn | None,
    say: Callable[[str], None] = lambda text: None,
) -> ValidationResult:
    """Check an opened checkpoint against the rules (see :func:`validate`)."""
    t0 = time.perf_counter()
    rules = select_rules(opts.select, opts.ignore)
    cfg = opts.config if isinstance(opts.config, dict) or opts.config is None else read_hf_config(opts.config)
    if cfg is None:
        cfg = _shards_config(ckpt)
    ref = load_reference(opts.against) if opts.against is not None else None
    man = None
    if opts.manifest is not None:
        from ckpttool.ops.manifest import check_manifest_kind, load_manifest

        man = _load_manifest_of(opts.manifest, ckpt)
        if man is None:
            where = _manifest_file(opts.manifest, Path(ckpt.located.model))
            man = load_manifest(where, written_by=_manifest_command(ckpt.located, opts.manifest, where))
        check_manifest_kind(ckpt.reader, man)  # one error before any rule (or the deep pass) runs
    say("reading param groups and extra state")
    ckpt.param_groups()
    ckpt.extra_state()
    ctx = Context(ckpt, deep=opts.deep, strict=opts.strict, config=cfg, reference=ref, manifest=man)
    _refuse_selection_that_cannot_run(rules, ctx, opts)
    bytes_read, deep_seconds = 0, 0.0
    if opts.deep and any(not _skip_reason(r, ctx) and "deep" in r.needs for r in rules):
        from ckpttool.ops.validate.deep import run_deep

        say("planning the deep pass")
        ctx.deep_result = run_deep(ctx, opts.workers, progress)
        bytes_read, deep_seconds = ctx.deep_result.bytes_read, ctx.deep_result.seconds
        rules = _with_read_error_rules(rules, ctx.deep_result.read_errors, opts.ignore)
        log.info("deep pass: read %d bytes in %.3f s", bytes_read, deep_seconds)
    say("checking rules")
    statuses: list[RuleStatus] = []
    for r in rules:
        reason = _skip_reason(r, ctx)
        if reason is not None:
            statuses.append(RuleStatus(r, "skipped", reason))
            log.debug("%s %s: skipped (%s)", r.code, r.name, reason)
            continue
        t_rule = time.perf_counter()
        try:
            found = [out if isinstance(out, Finding) else r.make(*out) for out in r.func(ctx)]
        except RuleSkipped as e:  # the rule found it cannot check this checkpoint: never "passed"
            statuses.append(RuleStatus(r, "skipped", e.reason))
            log.debug("%s %s: skipped (%s)", r.code, r.name, e.reason)
            continue
        log.debug("%s %s: %d finding(s) in %.1f ms", r.code, r.name, len(found), (time.perf_counter() - t_rule) * 1e3)
        failing = any(_fails(f, opts.strict) for f in found)
        partly = f"without --deep: {r.shallow} only" if "deep" in r.needs and not ctx.deep else None
        status = "failed" if failing else ("reported" if found else "passed")
        statuses.append(RuleStatus(r, status, partly, tuple(found)))
    _refuse_when_nothing_selected_ran(statuses, ctx, opts)
    return _finish(ckpt.path, opts, statuses, t0, bytes_read, deep_seconds)


def _refuse_when_nothing_selected_ran(statuses: list[RuleStatus], ctx: Context, opts: ValidateOptions) -> None:
    """Every rule ``select`` named was skipped by the rule itself (``--select M010`` with a config transformers cannot
    build): the run checked nothing asked; said as :func:`_refuse_selection_that_cannot_run` says it before the run.

    Raises:
        UsageError (E100): naming the reasons.
    """
    sel = split_codes(opts.select)
    named = {r.code for r in listed_rules(opts.select, opts.ignore)} if sel else set()
    asked = [s for s in statuses if s.rule.code in named]
    if not asked or any(s.status != "skipped" for s in asked) or any(s.findings for s in statuses):
        return
    codes = ", ".join(s.rule.code for s in asked[:6]) + (f" and {len(asked) - 6} more" if len(asked) > 6 else "")
    raise errors.UsageError(
        f"`select` {', '.join(sel)}: the selected rules ({codes}) could not run on {ctx.cat.path}: "
        f"{'; '.join(sorted({s.reason or 'skipped' for s in asked}))}; nothing was checked",
        param="select",
        hint="fix what the reason names (the --config, the reference), or select rules that run here",
    )


def _shards_config(ckpt: Checkpoint) -> dict[str, Any] | None:
    """The ``config.json`` saved with the per-rank shards of a ``save_distributed`` folder that nothing else proves
    complete (its own, or NeMo Automodel's ``.hf_metadata/``: :meth:`Checkpoint.hf_config_beside`): the config rules
    (``M010``: shapes against the model class) check it as if given with ``--config``, so a shortfall is an error
    and a match proves the shapes (``S017``); ``None`` for any other checkpoint, or an unreadable config (``S017``
    then says the shapes are not proven)."""
    try:
        folder = ckpt.hf_config_beside() if ckpt.unproven_shards() is not None else None
        return read_hf_config(folder, param=None) if folder is not None else None
    except errors.CkptError:
        return None


def _refuse_selection_that_cannot_run(rules: list[Rule], ctx: Context, opts: ValidateOptions) -> None:
    """``select`` names rules and every one of them needs an option not given (``--select D001`` without ``--deep``)
    or has nothing to check here (``--select O`` on model weights only): the run would check nothing that was asked
    and still say OK.

    Raises:
        UsageError (E100): naming the options the selected rules need.
    """
    sel = split_codes(opts.select)
    if not sel:
        return
    named = {r.code for r in listed_rules(opts.select, opts.ignore)}
    asked = [r for r in rules if r.code in named]
    if not asked:  # every selected rule is ignored (the fatal ones run anyway)
        raise errors.UsageError(
            f"`ignore` {', '.join(split_codes(opts.ignore))} leaves none of the rules `select` "
            f"{', '.join(sel)} chose: nothing would be checked",
            param="select",
            hint="drop the `ignore` codes that cover the selection, or select other rules",
        )
    reasons = [_skip_reason(r, ctx) for r in asked]
    if any(why is None for why in reasons):
        return
    codes = ", ".join(r.code for r in asked[:6]) + (f" and {len(asked) - 6} more" if len(asked) > 6 else "")
    if all(cast("str", why).startswith("needs --") for why in reasons):
        given = {"deep": ctx.deep, "config": ctx.config, "against": ctx.reference, "manifest": ctx.manifest}
        need = sorted({f"--{n}" for r in asked for n in r.needs if not given[n]})
        raise errors.UsageError(
            f"`select` {', '.join(sel)}: the selected rules ({codes}) need {' and '.join(need)}, not given: "
            "nothing would be checked",
            param="select",
            hint=f"add {' '.join(need)} (docs/rules.md), or select rules that run without it",
        )
    raise errors.UsageError(  # e.g. --select O on model weights only: no optimizer state to check
        f"`select` {', '.join(sel)}: the selected rules ({codes}) cannot run on {ctx.cat.path}: "
        f"{'; '.join(sorted({cast('str', why) for why in reasons}))}; nothing would be checked",
        param="select",
        hint="select rules for what this checkpoint holds (`ckpttool inspect` shows it)",
    )


def _with_read_error_rules(rules: list[Rule], read_errors: dict[str, Any], ignore: Sequence[str] | None) -> list[Rule]:
    """``rules`` with ``S010`` / ``S014`` where the deep pass could not read a chunk, whatever ``select`` chose
    (unless ``ignore`` names them): a selected rule (``D001``) passes over a chunk it could not read, and the run
    would say OK of data it never saw."""
    ign = split_codes(ignore)
    want = {"S014" if isinstance(e, errors.ChecksumError) else "S010" for e in read_errors.values()}
    add = [RULES[c] for c in sorted(want) if RULES[c] not in rules and not any(c.startswith(p) for p in ign)]
    return sorted([*rules, *add], key=lambda r: r.code) if add else rules


def validate(
    source: CheckpointOrPath, options: ValidateOptions | None = None, **hooks: Unpack[Hooks]
) -> ValidationResult:
    """Check a checkpoint against the rules of ``docs/rules.md`` (a damaged one gives findings).

    An unusable ``.metadata`` (missing, garbage, unsafe pickle) of a path is the fatal finding
    ``S001`` (exit 2), not an exception.

    Args:
        source: an opened :class:`~ckpttool.model.checkpoint.Checkpoint` (opened with
            ``record_problems=True``, else a damaged byte item raises instead of becoming a
            finding), or its path/URL, opened with ``opening`` (and ``record_problems=True``).
        options: see :class:`ValidateOptions`.
        progress: called as ``progress(bytes_done, bytes_total)`` during the deep pass, first with
            ``(0, bytes_total)``.
        phase: ``phase(text)`` as each step starts: ``opening PATH``, ``reading param groups and extra
            state``, ``planning the deep pass`` (``--deep``), ``checking rules``.

    Returns:
        The :class:`ValidationResult`.

    Raises:
        UsageError: ``source`` is not a directory, an unknown rule code, a ``select`` whose every rule needs an option
            not given (or is ignored), unreadable ``config``/``against``, an ``against`` that names no tensor.
        AmbiguousCheckpointError, StepNotFoundError: which checkpoint below ``source`` is not clear.
        SchemaError: a key-schema override that matches nothing.
    """
    opening, progress, phase = hooks_of("validate", hooks)
    opts = options_of(options, ValidateOptions)
    opening = check_source(source, opening)
    say = phase or (lambda text: None)
    with gc_held():  # one pause for open + rules: each re-enable triggers a full collection
        if isinstance(source, Checkpoint):
            return _validate_open(source, opts, progress, say)
        return _validate_path(source, opts, opening, progress, say)


def _load_manifest_of(manifest: str | os.PathLike[str], ckpt: Checkpoint) -> Manifest | None:
    """The manifest of :attr:`ValidateOptions.manifest` in object storage: for ``""`` (no value) the remote
    checkpoint's own ``URL/manifest.json`` (what ``manifest URL`` writes), a URL of a file that object
    (``URL/DIR``: the object, else ``URL/DIR/manifest.json``, as for a local directory); ``None``: a local file."""
    from ckpttool.ops.manifest import load_manifest, remote_manifest

    if manifest == "" and ckpt.reader.remote is not None:
        return load_manifest(*remote_manifest(ckpt.reader.path))
    if is_url(manifest):
        where = url_path(manifest)
        check_url_key(where)  # s3://b//run/manifest.json is no object of s3://b/run
        return load_manifest(*remote_manifest(where.parent, where.name))
    return None


def _manifest_command(located: Located, manifest: str | os.PathLike[str], where: Path) -> str:
    """The ``ckpttool manifest`` command line that writes the manifest file ``where`` (a hint to paste)."""
    from ckpttool.errors import shell_arg

    step = located.step if located.given != located.model and located.optimizer is None else None
    return (
        f"ckpttool manifest {shell_arg(located.given)}"
        + (f" --step {step}" if step is not None else "")
        + (f" --output {shell_arg(where)}" if manifest != "" else "")
    )


def _manifest_file(manifest: str | os.PathLike[str], checkpoint_dir: Path) -> Path:
    """The manifest file of :attr:`ValidateOptions.manifest`: a file; ``DIR/manifest.json`` of a directory; for
    ``""``, the one in ``checkpoint_dir`` (the opened checkpoint's, the step ``selection`` chose in a run root)."""
    from ckpttool.ops.manifest import MANIFEST_NAME, own_manifest

    if manifest == "":
        return own_manifest(checkpoint_dir / MANIFEST_NAME)
    path = Path(manifest)
    return path / MANIFEST_NAME if path.is_dir() else path


def _unusable(where: Path | None) -> str:
    """Why the rules were skipped beside ``S001``: the file its error names is unusable (``.metadata``, or a
    safetensors file or index of a folder that has no ``.metadata``; a directory: the checkpoint in it)."""
    if where is None or where.name == ".metadata":
        return ".metadata is unusable"
    return "the checkpoint is unusable" if os.path.isdir(where) else f"{where.name} is unusable"


def _validate_path(
    path: str | os.PathLike[str],
    opts: ValidateOptions,
    opening: OpenOptions,
    progress: ProgressFn | None,
    say: Callable[[str], None],
) -> ValidationResult:
    t0 = time.perf_counter()
    say(f"opening {path}")
    try:
        ckpt = open_checkpoint(
            path,
            declaration=opening.declaration,
            trust_pickle=opening.trust_pickle,
            record_problems=True,
            selection=opening.selection,
        )
    except (errors.AmbiguousCheckpointError, errors.StepNotFoundError, errors.SchemaError):
        raise  # which checkpoint, or how to read its keys: the user's to say, not a finding
    except errors.MetadataError as e:  # includes unsafe pickles and incomplete saves
        rules = select_rules(opts.select, opts.ignore)
        s001 = RULES["S001"]
        # an unfinished save is named by its directory (it may hold no .metadata to blame); another error by
        # the file it names (a safetensors shard, a per-rank file), not ".metadata" for every format
        unfinished = isinstance(e, errors.IncompleteCheckpointError)
        where = (cast(Path, url_path(e.path)) if is_url(e.path) else Path(e.path)) if e.path else None
        if unfinished and where is not None and where.name == ".metadata":  # the missing file: its directory
            where = where.parent
        key = (str(where) if unfinished else where.name) if where is not None else ".metadata"
        # a shard an HF folder lists (or a hub snapshot's link) without its file: a file missing, not a save cut off
        skipped = (
            "a file of the model is missing"
            if unfinished and where is not None and where.name.endswith((".safetensors", ".safetensors.index.json"))
            else "the save did not finish"
            if unfinished
            else _unusable(where)
        )
        statuses = [
            RuleStatus(r, "failed", None, (s001.make(key or ".metadata", e.message, e.hint or None, e.code),))
            if r is s001
            else RuleStatus(r, "skipped", skipped)
            for r in rules
        ]
        shown = cast(Path, url_path(path)) if is_url(path) else Path(path)  # a UrlPath prints as the URL
        return _finish(shown, opts, statuses, t0)
    with ckpt:
        return _validate_open(ckpt, opts, progress, say)
