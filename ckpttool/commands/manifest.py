"""``ckpttool manifest DIR``: write manifest.json, a digest of every stored chunk (verify with validate --manifest)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ckpttool.errors import UsageError
from ckpttool.ui.options import CheckpointArg, JsonOpt, StepOpt, TrustPickleOpt, examples, manifest_file, selection
from ckpttool.ui.output import Output, command_boundary

if TYPE_CHECKING:
    from ckpttool.ops.manifest import ManifestCheck, ManifestResult


#: ``--output FILE``: an empty path is refused (it read as the current directory).
OutputOpt = Annotated[
    Path | None,
    typer.Option(
        "--output",
        "-o",
        help="Write the manifest here instead of CHECKPOINT/manifest.json.",
        show_default=False,
        parser=manifest_file,
        metavar="FILE",
    ),
]


#: What a manifest is written with when ``--hash`` / ``--covers`` are not given.
DEFAULT_HASH = "xxh3-128"
DEFAULT_COVERS = "window"


def _refuse_writing_options(hash_name: str | None, covers: str | None) -> None:
    """``--verify`` checks with the algorithm and coverage its manifest records: a ``--hash`` or ``--covers``
    given with it would be ignored (``--verify --hash blake3`` over an xxh3-128 manifest reads as a
    cryptographic check it is not; a typo, ``--hash md6``, as accepted).

    Raises:
        UsageError: either was given.
    """
    given = [f"{flag} {value}" for flag, value in (("--hash", hash_name), ("--covers", covers)) if value is not None]
    if given:
        raise UsageError(
            f"{' and '.join(given)} given with --verify, which checks with the digest and coverage its manifest records",
            hint="drop it: `ckpttool manifest DIR --verify` reads them from the manifest "
            "(--json: its algorithm); --hash/--covers choose them when writing one",
        )


@command_boundary
def manifest_command(
    checkpoint: CheckpointArg,
    output: OutputOpt = None,
    hash_name: Annotated[
        str | None,
        typer.Option(
            "--hash",
            metavar="ALGO",
            help="Digest: xxh3-128 (fast, detects damage), blake3 or blake2b-256 (cryptographic).  [default: xxh3-128]",
            show_default=False,  # None tells a --hash given from none (refused with --verify); shown as written
        ),
    ] = None,
    covers: Annotated[
        str | None,
        typer.Option(
            "--covers",
            metavar="<window|record>",
            help="window: each chunk's whole stored window; record: its raw storage record only (what reshard digests while writing).  [default: window]",
            show_default=False,
        ),
    ] = None,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="Check CHECKPOINT against its manifest (CHECKPOINT/manifest.json or --output) instead of writing one: a DCP checkpoint or a safetensors export made with a manifest. Exit 1 names each changed, missing or added chunk or byte range.",
        ),
    ] = False,
    json_output: JsonOpt = False,
    trust_pickle: TrustPickleOpt = False,
    step: StepOpt = None,
) -> None:
    """Digest every chunk and byte item (each byte read once) into manifest.json beside .metadata.

    Adds only that file. `ckpttool validate --manifest FILE` later names any chunk that is missing,
    added or changed.
    """
    from ckpttool.model.checkpoint import OpenOptions
    from ckpttool.ops.manifest import ManifestOptions, write_manifest
    from ckpttool.ui.render import PhaseProgress

    opening = OpenOptions(trust_pickle=trust_pickle, selection=selection(step))
    enabled = not json_output and sys.stderr.isatty()
    if verify:
        from ckpttool.ops.manifest import check_against_manifest

        _refuse_writing_options(hash_name, covers)

        # reading the manifest, opening, then the byte bar of the verifying from its total on
        with PhaseProgress.on_stderr("manifest --verify", enabled, bar_text="verifying") as shown:
            checked = check_against_manifest(
                checkpoint,
                output,
                opening=opening,
                progress=shown.progress if shown is not None else None,
                phase=shown.phase if shown is not None else None,
            )
        out = Output(json_output)
        for line in checked.warnings:
            out.warning(line)
        out.result(checked, _render_check)
        if checked.problems:
            raise typer.Exit(1)
        return
    # opening, planning, then the byte bar of the hashing from its total on, then writing the file
    with PhaseProgress.on_stderr("manifest", enabled) as shown:
        if shown is not None:
            shown.phase(f"opening {checkpoint}")
        res = write_manifest(
            checkpoint,
            ManifestOptions(out=output, algorithm=hash_name or DEFAULT_HASH, covers=covers or DEFAULT_COVERS),
            opening=opening,
            progress=shown.progress if shown is not None else None,
            phase=shown.phase if shown is not None else None,
        )
    out = Output(json_output)
    for line in res.warnings:  # validate's R001: a newer step's save did not finish, an older step was digested
        out.warning(line)
    out.result(res, _render)


#: Problems printed one by one; the rest are counted by kind.
SHOWN_PROBLEMS = 50


def _render_check(res: ManifestCheck) -> None:
    from ckpttool.ui.render import plural, stdout_console

    con = stdout_console()
    for p in res.problems[:SHOWN_PROBLEMS]:
        con.print(f"{p.kind:8} {p.message}")
    if len(res.problems) > SHOWN_PROBLEMS:
        kinds = ", ".join(f"{k} {n:,}" for k, n in sorted(res.counts().items()))
        con.print(f"... and {len(res.problems) - SHOWN_PROBLEMS:,} more ({kinds} in all; --json lists the first 1,000)")
    verdict = "matches" if not res.problems else "differs from"
    problems = f": {plural(len(res.problems), 'problem')}" if res.problems else ""
    if len(res.warnings) > res.newer_incomplete:  # what "matches" does not cover: said on stdout too, beside stderr's
        problems += "; files beside the data or bytes after it not checked (see the warning)"
    if res.newer_incomplete:  # R001: the step verified is not the run's newest save
        problems += "; a newer step's save did not finish (see the warning)"
    con.print(
        f"{res.path} ({res.folder or res.kind}) {verdict} its manifest {res.manifest} "
        f"({plural(res.entries, 'entry', 'entries')}){problems}"
    )


def _render(res: ManifestResult) -> None:
    from ckpttool.ui.render import fmt_rate, fmt_seconds, human_bytes, plural, stdout_console

    stdout_console().print(  # the rate of the hashing alone
        f"wrote {res.path}: {plural(res.entries, 'entry', 'entries')}, {human_bytes(res.bytes_hashed)} hashed "
        f"({res.algorithm}; {fmt_seconds(res.seconds)} in all; hashed in {fmt_seconds(res.hash_seconds)}, "
        f"{fmt_rate(res.bytes_hashed, res.hash_seconds)}); manifest {res.algorithm} {res.digest}"
    )


EPILOG = examples(
    "ckpttool manifest ckpt/",
    "ckpttool validate ckpt/ --manifest ckpt/manifest.json",
    "ckpttool manifest hf/ --verify            # an export made with a manifest, or a checkpoint",
)
