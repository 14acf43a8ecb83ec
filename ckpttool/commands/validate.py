"""``ckpttool validate DIR [--strict] [--deep]``: rule checks with stable codes (``docs/rules.md``).

Exit codes: 0 clean; 1 findings that fail the run (errors; warnings too with
``--strict``); 2 unreadable/unsafe input or bad invocation.
"""

from __future__ import annotations

import sys
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Annotated

import typer

from ckpttool.ui import options as opt
from ckpttool.ui.options import IgnoreOpt, SelectOpt, declaration, examples, selection
from ckpttool.ui.output import Output, command_boundary, print_error, with_flags

if TYPE_CHECKING:
    from collections.abc import Callable

    from ckpttool.model.discovery import CheckpointSelection
    from ckpttool.ops.validate import ValidationResult
    from ckpttool.ui.render import PhaseProgress


def _render(res: ValidationResult) -> None:
    from ckpttool.ui.render import (
        STYLES,
        fmt_rate,
        fmt_seconds,
        human_bytes,
        plural,
        print_findings,
        stdout_console,
        verdict,
    )

    con = stdout_console()
    con.print(f"checkpoint  {res.path}")
    for sev in ("error", "warning", "info"):
        rows = [f for f in res.findings if f.severity.value == sev]
        if not rows:
            continue
        title = {
            "error": "errors",
            "warning": "warnings" + ("" if res.strict else " (do not fail without --strict)"),
            "info": "info",
        }[sev]
        print_findings(con, f"{title} ({len(rows)})", rows, STYLES.get(sev), with_flags)
    c = res.counts
    ran = sum(1 for s in res.rules if s.status != "skipped")
    skipped = [s for s in res.rules if s.status == "skipped"]
    reasons = sorted({s.reason or "" for s in skipped})
    skip_txt = f", {len(skipped)} skipped ({'; '.join(reasons)})" if skipped else ""
    # a rule that ran in part (R002 without --deep: Megatron's common.pt only) never reads as a full check
    part = [f"{s.rule.code} {s.reason}" for s in res.rules if s.status != "skipped" and s.reason]
    part_txt = f" ({len(part)} in part: {'; '.join(part)})" if part else ""
    word = {0: "OK", 1: "FAILED", 2: "UNREADABLE"}[res.exit_code]
    deep = (  # the rate of the deep pass alone
        f", read {human_bytes(res.bytes_read)} ({fmt_seconds(res.deep_seconds)}, "
        f"{fmt_rate(res.bytes_read, res.deep_seconds)})"
        if res.deep
        else ""
    )
    con.print(
        verdict(
            word,
            f": {plural(c['error'], 'error')}, {plural(c['warning'], 'warning')}, {c['info']} info; "
            f"{plural(ran, 'rule')} run{part_txt}{skip_txt}{deep} in {res.seconds:.2f} s"
            + (" [strict]" if res.strict else ""),
        )
    )


_JUNIT_HINT = (
    "--junit takes the path of a file in an existing, writable directory outside the checkpoint "
    "(a JUnit report ckpttool wrote there before is replaced), e.g. --junit reports/validate.xml"
)


def _junit_file(junit: str) -> Path:
    """The ``--junit`` path; one ending in ``/`` names a directory, where a report file was meant to go.

    ``file:///r/v.xml`` is the local file ``/r/v.xml`` (as a checkpoint's ``file://`` URL and ``--plot``'s are).

    Raises:
        OutputError (E600): an empty path (``Path("")`` is ``.``, reported as a directory); ``-`` (read as standard
            output, where the report of the run itself goes: it would have written a file named ``-``); a path ending
            in a separator (``--junit reports/`` would have written a file ``reports``).
        UsageError (E100): a URL (``s3://b/v.xml`` was the local path ``s3:/b/v.xml``: 'directory s3:/b does not
            exist'), as ``--plot`` and ``manifest --output`` refuse one.
    """
    import os

    from ckpttool.errors import OutputError, UsageError
    from ckpttool.format.storage import is_url, local_path

    if not junit:
        raise OutputError("--junit '': the path is empty", path=junit, hint=f"name the report file: {_JUNIT_HINT}")
    if junit == "-":
        raise OutputError(
            "--junit -: the report is not written to standard output (the validate report goes there); "
            "--junit takes the path of the report file",
            path=junit,
            hint="name the file, e.g. --junit validate.xml (a file named '-': --junit ./-)",
        )
    junit = os.fspath(local_path(junit))
    if is_url(junit):
        raise UsageError(
            f"--junit {junit}: a URL; --junit writes a local file only",
            hint="give a local file name and copy the report to object storage yourself",
        )
    if junit.endswith(("/", os.sep)):
        raise OutputError(
            f"--junit {junit}: names a directory; --junit takes the path of the report file",
            path=junit,
            hint=f"name the file, e.g. --junit {junit}validate.xml",
        )
    return Path(junit)


def _check_junit_path(
    junit: Path, checkpoint: PurePath, sel: CheckpointSelection | None, against: Path | None
) -> tuple[Path, ...]:
    """Refuse a ``--junit`` path that cannot or must not be written, before any checking is done.

    Returns:
        The directories read (checked again just before the report is written).

    Raises:
        OutputError (E600): a ``~`` the shell did not expand; a missing parent directory; a symbolic link, a
        directory or non-regular file; a path inside the directory given, the checkpoint it resolves to (model and
        optimizer folders) or ``--against``; an existing file that is not a JUnit report of ``ckpttool validate``
        (:func:`~ckpttool.format.atomic.check_file_target`).
    """
    from ckpttool.errors import CkptError, OutputError
    from ckpttool.format.atomic import check_file_target
    from ckpttool.format.files import refuse_unexpanded_tilde_output

    refuse_unexpanded_tilde_output(junit, "--junit")  # not "create ~ first"
    parent = junit.parent
    if not parent.is_dir():
        raise OutputError(
            f"--junit {junit}: directory {parent} does not exist",
            path=junit,
            hint=f"create {parent} first, or {_JUNIT_HINT}",
        )
    sources: list[Path] = [against] if against is not None else []
    if isinstance(checkpoint, Path):  # the directory given (a run root: every step in it) and what it resolves to
        sources.append(checkpoint)
        from ckpttool.model.discovery import locate

        try:
            found = locate(checkpoint, sel)
            sources += [found.model, *([found.optimizer] if found.optimizer is not None else [])]
        except CkptError:  # the run reports it
            pass
        if sel is not None and sel.optimizer_dir is not None:
            sources.append(Path(sel.optimizer_dir))
    check_file_target(junit, option="--junit", hint=_JUNIT_HINT, sources=tuple(sources), owned=_is_junit_report)
    return tuple(sources)


def _is_junit_report(head: bytes) -> bool:
    """Whether a file's first bytes are those every report of :func:`~ckpttool.ops.validate.junit_xml` starts with."""
    return head.startswith(b'<?xml version="1.0" encoding="UTF-8"?>\n<testsuites name="ckpttool validate">')


StrictOpt = Annotated[
    bool, typer.Option("--strict", help="Warnings fail the run too; unknown or ambiguous things fail closed.")
]
DeepOpt = Annotated[
    bool,
    typer.Option(
        "--deep",
        help="Also read every data byte once (files in parallel): non-finite values, negative exp_avg_sq, step values, master/param divergence, tied head, corrupt chunks.",
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="HF config.json of the model: layer and expert coverage, tied lm_head rules.",
        parser=opt.given_path,
    ),
]
AgainstOpt = Annotated[
    Path | None,
    typer.Option(
        "--against",
        help="Reference model (HF directory with safetensors/index, a .safetensors file, or a JSON key list): missing/unexpected keys, shapes, dtypes.",
        parser=opt.given_path,
    ),
]
ManifestOpt = Annotated[
    str | None,
    typer.Option(
        "--manifest",
        metavar="[FILE|DIR]",
        help="Verify every chunk against this manifest.json (ckpttool manifest), DIR/manifest.json of a directory, "
        "or without a value the checkpoint's own: names missing, added and changed chunks.",
    ),
]
JunitOpt = Annotated[
    str | None,
    typer.Option(
        "--junit", metavar="FILE", help="Also write a JUnit XML report (one test case per rule) to this file."
    ),
]
WorkersOpt = Annotated[
    int | None,
    typer.Option(
        "--workers", min=1, help="Reader threads for --deep (default: CPU count, 2..8); no effect without --deep."
    ),
]
ListRulesOpt = Annotated[
    bool,
    typer.Option(
        "--list-rules", help="List the rules (code, severity, what they check; those --select/--ignore name) and exit."
    ),
]
#: validate's own --optimizer-dir (old spelling --optimizer, hidden; says "validated" where the shared one says "read").
ValidateOptimizerDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--optimizer-dir",
        "--optimizer",
        help="A separate optimizer checkpoint (e.g. checkpoint-N/optimizer_0) validated together with CHECKPOINT's model.",
        show_default=False,
        parser=opt.given_path,
    ),
]


@command_boundary
def validate_command(
    checkpoint: opt.CheckpointArg = None,  # type: ignore[assignment]
    strict: StrictOpt = False,
    deep: DeepOpt = False,
    select: SelectOpt = None,
    ignore: IgnoreOpt = None,
    config: ConfigOpt = None,
    against: AgainstOpt = None,
    manifest: ManifestOpt = None,
    json_output: opt.JsonOpt = False,
    junit: JunitOpt = None,
    source_layout: opt.SourceLayoutOpt = None,
    ep_size: opt.EpSizeOpt = None,
    ep_fsdp_size: opt.EpFsdpSizeOpt = None,
    trust_pickle: opt.TrustPickleOpt = False,
    workers: WorkersOpt = None,
    list_rules: ListRulesOpt = False,
    no_ep: opt.NoEpOpt = False,
    step: opt.StepOpt = None,
    optimizer_dir: ValidateOptimizerDirOpt = None,
    schema: opt.SchemaOpt = None,
    model_prefix: opt.ModelPrefixOpt = None,
    optimizer_prefix: opt.OptimizerPrefixOpt = None,
) -> None:
    """Check a checkpoint with rules that have stable codes; exit 1 on findings that fail the run."""
    from ckpttool.errors import UsageError

    if list_rules:
        _list_rules(checkpoint, junit, select, ignore, json_output)
        return
    if checkpoint is None and manifest:  # `validate --manifest DIR`: the option took the checkpoint as its value
        checkpoint, manifest = opt.location(manifest), ""
    if checkpoint is None:
        raise UsageError(
            "Missing argument 'CHECKPOINT'.",
            hint="ckpttool validate CHECKPOINT [--strict] [--deep], or ckpttool validate --list-rules; see "
            "`ckpttool validate --help`",
        )
    from ckpttool.model.checkpoint import OpenOptions
    from ckpttool.ops.entry import run_validate, validation_error
    from ckpttool.ops.validate import ValidateOptions
    from ckpttool.ui.render import PhaseProgress

    decl = declaration(source_layout, ep_size, ep_fsdp_size, no_ep)
    sel = selection(step, optimizer_dir, schema, model_prefix, optimizer_prefix)
    junit_file, sources = _junit_target(junit, checkpoint, sel, against)
    _note_unused_workers(workers, deep, json_output)
    options = ValidateOptions(
        strict=strict,
        deep=deep,
        select=tuple(select or ()),
        ignore=tuple(ignore or ()),
        config=config,
        against=against,
        workers=workers,
        manifest=manifest,
    )

    def report(res: ValidationResult) -> None:
        if junit_file is not None:
            _write_junit(junit_file, res, sources)
        Output(json_output).result(res, _render)
        _note_against(res, checkpoint, against, json_output)

    # --deep: phases named on stderr (opening, planning the deep pass, ...); the byte bar of the reading from its total on
    enabled = deep and not json_output and sys.stderr.isatty()
    with PhaseProgress.on_stderr("validate --deep", enabled, bar_text="reading") as shown:
        res = run_validate(
            checkpoint,
            options,
            opening=OpenOptions(declaration=decl, trust_pickle=trust_pickle, selection=sel),
            progress=shown.progress if shown is not None else None,
            report=lambda r: _after(shown, report, r),
            phase=shown.phase if shown is not None else None,
        )
    fatal = validation_error(res)
    if fatal is not None:
        print_error(fatal)
    raise typer.Exit(res.exit_code)


def _junit_target(
    junit: str | None, checkpoint: PurePath, sel: CheckpointSelection | None, against: Path | None
) -> tuple[Path | None, tuple[Path, ...]]:
    """The ``--junit`` file (``None``: not asked) and the directories it must stay out of, checked before the run."""
    if junit is None:
        return None, ()
    junit_file = _junit_file(junit)
    return junit_file, _check_junit_path(junit_file, checkpoint, sel, against)


def _note_against(res: ValidationResult, checkpoint: PurePath, against: Path | None, json_output: bool) -> None:
    """An OK against another step's export is no claim of equal weights: say so, where ``--against`` compared
    anything (its rules are skipped where a model adapter's names cannot be mapped to the reference's)."""
    ran = {s.rule.code for s in res.rules if s.status != "skipped"}
    what = [
        w
        for codes, w in ((("M005", "M006"), "names"), (("M007",), "shapes"), (("M008",), "dtypes"))
        if ran & set(codes)
    ]
    if against is None or res.exit_code == 2:
        return
    if what:
        listed = what[0] if len(what) == 1 else f"{', '.join(what[:-1])} and {what[-1]}"
        Output(json_output).note(
            f"--against compared {listed}, not values: `ckpttool diff {checkpoint} {against}` compares the values"
        )
        return
    why = next((s.reason for s in res.rules if s.rule.code == "M005" and s.reason), None)
    if why is not None:  # the OK above is no word on the reference: say that nothing was compared, and why
        Output(json_output).note(f"--against compared nothing: {why}")


def _note_unused_workers(workers: int | None, deep: bool, json_output: bool) -> None:
    """A note for ``--workers`` without ``--deep``: only the deep pass reads data, so it neither speeds up nor widens
    the check."""
    if workers is not None and not deep:
        Output(json_output).note(f"--workers {workers} has no effect without --deep: it sets --deep's reader threads")


def _list_rules(
    checkpoint: object, junit: str | None, select: list[str] | None, ignore: list[str] | None, json_output: bool
) -> None:
    """``--list-rules``: the rules ``select``/``ignore`` name; a warning for CHECKPOINT and ``--junit`` given with it."""
    from ckpttool.commands.rules import print_rules

    if checkpoint is not None:  # the listing checks nothing: never let it pass for a check of CHECKPOINT
        Output(json_output).warning(f"{checkpoint} was not checked: --list-rules lists the rules and exits")
    if junit is not None:  # nor let a CI job look for a report that was never written
        Output(json_output).warning(f"--junit {junit} was not written: --list-rules lists the rules and exits")
    print_rules(json_output, select or (), ignore or ())


def _after(shown: PhaseProgress | None, report: Callable[[ValidationResult], None], res: ValidationResult) -> None:
    """``report(res)`` once the progress lines are gone (a bar drawn under the table would garble it)."""
    if shown is not None:
        shown.close()
    report(res)


def _write_junit(junit: Path, res: ValidationResult, sources: tuple[Path, ...]) -> None:
    """The JUnit XML report of ``res`` written to ``junit`` (checked again, then atomically; the hint of a failure
    names --junit)."""
    from ckpttool.errors import OutputError
    from ckpttool.format.atomic import atomic_write_text, check_file_target
    from ckpttool.ops.validate import junit_xml

    check_file_target(junit, option="--junit", hint=_JUNIT_HINT, sources=sources, owned=_is_junit_report)
    try:
        atomic_write_text(junit, junit_xml(res))
    except OutputError as e:
        e.hint = _JUNIT_HINT
        raise


EPILOG = examples(
    "ckpttool validate ckpt/",
    "ckpttool validate ckpt/ --strict --deep",
    "ckpttool validate ckpt/ --select O,L --ignore O004 --json",
    "ckpttool validate ckpt/ --config hf/config.json --against hf/ --junit report.xml",
    "ckpttool validate --list-rules",
)
