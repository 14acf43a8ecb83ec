"""Shared CLI options (one help string per concept) and the parsers of option values.

Sizes and dtypes are parsed here and nowhere else:

- :func:`parse_size`: ``5GB`` = 5*10^9 bytes (decimal ``KB/MB/GB/TB``, the Hugging Face
  convention for ``--shard-size``), ``2GiB`` = 2*2^30 (binary ``KiB/MiB/GiB/TiB``), bare
  ``K/M/G/T`` binary as in ``dd``/``ls -h``, or a plain byte count;
- :func:`parse_dtype`: ``bfloat16``/``bf16``, ``float16``/``fp16``/``half``, ``float32``/``fp32``/``float``;
- :func:`parse_tolerance`: ``rtol,atol``.

One vocabulary across commands: ``--filter GLOB`` selects keys everywhere (inspect, export,
replay-step); ``--select/--ignore`` are rule codes (validate only); ``--json`` documents are
described by ``ckpttool schema CMD``.
"""

from __future__ import annotations

import os
import re
from enum import Enum
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Annotated

import typer

from ckpttool.errors import UsageError
from ckpttool.format.metadata import dtype_aliases, dtype_name
from ckpttool.model.schemas import registry as schema_registry

if TYPE_CHECKING:
    from ckpttool.layouts.declaration import LayoutDeclaration
    from ckpttool.model.discovery import CheckpointSelection

__all__ = [
    "CheckpointArg",
    "EpFsdpSizeOpt",
    "EpSizeOpt",
    "FilterOpt",
    "JsonOpt",
    "ModelPrefixOpt",
    "NoEpOpt",
    "OptimizerDirOpt",
    "OptimizerPrefixOpt",
    "SchemaOpt",
    "StepOpt",
    "OverwriteOpt",
    "SourceLayout",
    "SourceLayoutOpt",
    "TrustPickleOpt",
    "VerifyCrcOpt",
    "declaration",
    "examples",
    "parse_dtype",
    "parse_size",
    "parse_tolerance",
    "selection",
]


class SourceLayout(str, Enum):
    """EP layout of the source checkpoint (``docs/layouts.md``)."""

    legacy = "legacy"
    canonical = "canonical"


def location(value: str | PurePath) -> PurePath:
    """A path argument that may also be an fsspec URL (``s3://bucket/prefix``: a ``UrlPath``; docs/storage.md).

    Raises:
        typer.BadParameter (E100): an empty string (``Path("")`` is the current directory: an unset shell
            variable, ``"$CKPT"``, would read or write there).
        RemoteStorageError (E140): a URL whose key has a ``..``, ``.`` or empty component.
    """
    if isinstance(value, PurePath):
        return value
    if not value:
        raise typer.BadParameter("an empty path (an unset shell variable?); pass '.' for the current directory")
    from ckpttool.format.storage import check_url_key, is_url, local_path, url_path

    if not is_url(value):
        return Path(local_path(value))
    path = url_path(value)
    check_url_key(path)  # here, while the URL is as given: s3://b//run prints (and is passed on) as s3://b/run
    return path


def given_path(value: str | PurePath) -> Path:
    """A local file or directory option (``--model-assets DIR``, ``--config FILE``, ``--against REF``): an empty
    string is refused, as :func:`location` refuses it (``Path("")`` is the current directory: an unset shell
    variable, ``--model-assets "$ASSETS"``, would read, or copy into an export, whatever the current directory holds).

    Raises:
        typer.BadParameter (E100): an empty string; a URL (other than ``file://``).
    """
    if isinstance(value, PurePath):
        return Path(value)
    if not value:
        raise typer.BadParameter("an empty path (an unset shell variable?); name the file or directory")
    from ckpttool.format.storage import is_url, local_path

    value = os.fspath(local_path(value))  # file:///a/b is /a/b
    if is_url(value):  # Path() of it was the local path 's3:/bucket/...': "not a directory"
        raise typer.BadParameter(f"{value}: a URL; this option takes a local file or directory (copy it here first)")
    return Path(value)


def given_output_file(value: str | PurePath) -> Path:
    """A local output file option (``--plot FILE``): an empty string is refused as :func:`given_path` refuses it; a
    URL is left to the command, whose check of the target says that it writes local files only.

    Raises:
        typer.BadParameter (E100): an empty string.
    """
    from ckpttool.format.storage import is_url, local_path

    if isinstance(value, str) and value and is_url(os.fspath(local_path(value))):
        return Path(value)
    return given_path(value)


def output_location(value: str | PurePath) -> PurePath:
    """:func:`location` for an output: an empty string is refused with a hint that names a directory to write (the
    current directory, ``.``, is itself refused as an output: the shell would be left in a removed directory).

    Raises:
        typer.BadParameter (E100): an empty string.
    """
    if not isinstance(value, PurePath) and not value:
        raise typer.BadParameter("an empty path (an unset shell variable?); name the output directory (e.g. ./out)")
    return location(value)


def local_output_location(value: str | PurePath) -> PurePath:
    """An output directory that is local only (``sample DIR``): :func:`output_location`, whose URL (kept whole: typer's
    ``Path(value)`` made ``s3://b/k`` the local folder ``s3:/b/k``) the command refuses. Not one of the parsers that
    give a command the remote storage options (``ckpttool.cli.app``).

    Raises:
        typer.BadParameter (E100): an empty string.
    """
    return output_location(value)


def manifest_file(value: str | PurePath) -> Path:
    """``manifest --output FILE`` (the manifest written, or read with ``--verify``): an empty string is refused
    (``Path("")`` is the current directory, which was then named as the manifest: "manifest .: is a directory").

    Raises:
        typer.BadParameter (E100): an empty string.
    """
    if isinstance(value, PurePath):
        return Path(value)
    if not value:
        raise typer.BadParameter(
            "an empty path (an unset shell variable?); name the manifest file (e.g. ./manifest.json), "
            "or leave --output out for CHECKPOINT/manifest.json"
        )
    from ckpttool.format.storage import is_url, local_path

    value = os.fspath(local_path(value))  # file:///a/m.json is /a/m.json
    if is_url(value):  # Path() of it was a local ./s3:/bucket/... file
        raise typer.BadParameter(
            f"{value}: a URL; --output is a local file (a checkpoint in object storage gets its manifest.json "
            "beside .metadata without --output)"
        )
    return Path(value)


# PurePath, not Path: typer converts a ``Path`` annotation with ``Path(value)``, which would turn
# ``s3://b/k`` into ``s3:/b/k``; ``location`` returns a ``Path`` or a ``UrlPath``.
CheckpointArg = Annotated[
    PurePath,
    typer.Argument(
        help="DCP checkpoint directory (holds .metadata and __R_N.distcp files), or a directory above it "
        "(a run's checkpoint root, step-N/, checkpoint-N/ with model and optimizer folders); or the URL of "
        "a checkpoint prefix (s3://bucket/run/step-100, any fsspec URL).",
        show_default=False,
        parser=location,
        metavar="CHECKPOINT",
    ),
]
OutputArg = Annotated[
    PurePath,
    typer.Argument(
        help="Output directory (written beside itself, renamed when complete), or a URL prefix (s3://bucket/out: "
        "uploaded under a temporary prefix, published when complete; docs/storage.md).",
        show_default=False,
        parser=output_location,
        metavar="OUT",
    ),
]


def _json_value(value: bool) -> bool:
    """``--json`` given to the command or before it (``ckpttool --json CMD``)."""
    from ckpttool.ui.render import UI

    return value or UI.json


JsonOpt = Annotated[
    bool,
    typer.Option(
        "--json",
        callback=_json_value,
        help="Write one JSON document to stdout (its JSON Schema: `ckpttool schema CMD`).",
    ),
]

#: ``--select`` / ``--ignore`` of the rules (``validate`` runs them, ``rules`` / ``validate --list-rules`` list them).
SelectOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--select",
        help="Only rules whose code starts with one of these (comma list or repeated): S, O00, D004.",
    ),
]
IgnoreOpt = Annotated[
    list[str] | None,
    typer.Option("--ignore", help="Leave out rules whose code starts with one of these (comma list or repeated)."),
]
FilterOpt = Annotated[
    str | None,
    typer.Option(
        "--filter",
        metavar="GLOB",
        help="Only keys matching this glob (fnmatch: * also matches dots), with or without the 'model.' prefix.",
    ),
]
TrustPickleOpt = Annotated[
    bool,
    typer.Option(
        "--trust-pickle",
        help="Allow torch.load(weights_only=False) for byte items/extra_state that need it. "
        "Runs code from the checkpoint: only for checkpoints you trust.",
    ),
]
VerifyCrcOpt = Annotated[
    bool,
    typer.Option(
        "--verify-crc/--no-verify-crc",
        help="Check each stored record's CRC-32 while copying it (~10% of a warm-cache run; docs/performance.md).",
    ),
]
#: ``--hash`` of the commands that write an output (export, reshard): the manifest's and the
#: source identity's digest.
OutputHashOpt = Annotated[
    str,
    typer.Option(
        "--hash",
        metavar="ALGO",
        help="Digest of the manifest and of the source identity: xxh3-128, blake3 or blake2b-256.",
    ),
]
#: ``--fsync`` of the commands that write a DCP output directory (import, reshard).
FsyncOpt = Annotated[
    bool,
    typer.Option(
        "--fsync/--no-fsync",
        help="fsync the output files before moving the directory into place (survives a power loss).",
    ),
]
OverwriteOpt = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="Replace an earlier output of ckpttool in the output directory once the new output is complete "
        "(never a directory ckpttool did not write: E606).",
    ),
]
DryRunOpt = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="Plan and check everything (also whether OUT may be written), print the plan; write nothing.",
    ),
]
SourceLayoutOpt = Annotated[
    SourceLayout | None,
    typer.Option(
        "--source-layout",
        help="Declare the EP layout of an unversioned checkpoint: legacy (FSDP-outer/EP-inner) or canonical.",
    ),
]
EpSizeOpt = Annotated[
    int | None, typer.Option("--ep-size", min=1, help="EP size P of the saving mesh (with --source-layout).")
]
EpFsdpSizeOpt = Annotated[
    int | None, typer.Option("--ep-fsdp-size", min=1, help="EP-FSDP size F of the saving mesh (with --source-layout).")
]

NoEpOpt = Annotated[
    bool,
    typer.Option(
        "--no-ep", help="The checkpoint was saved without expert parallelism (plain FSDP): experts are in true order."
    ),
]


if TYPE_CHECKING:

    class SchemaChoice(str, Enum):
        """The registered key schemas (``docs/design.md`` §2): ``--schema``."""

    class ImportSchemaChoice(str, Enum):
        """The key schemas ``ckpttool import`` writes: its ``--schema``."""

else:  # generated from the registry: one member per registered spec, in priority order
    SchemaChoice = Enum("SchemaChoice", [(s.choice, s.name) for s in schema_registry.specs()], type=str)
    ImportSchemaChoice = Enum(
        "ImportSchemaChoice", [(s.choice, s.name) for s in schema_registry.import_targets()], type=str
    )
#: ``ckpttool import --schema``'s default: the first schema it writes.
IMPORT_SCHEMA_DEFAULT = ImportSchemaChoice(schema_registry.import_targets()[0].name)
#: ``ckpttool import --schema``'s help: what each schema it writes holds.
IMPORT_SCHEMA_HELP = "; ".join(f"{s.name}: {s.import_help}" for s in schema_registry.import_targets()) + "."


StepOpt = Annotated[
    str | None,
    typer.Option(
        "--step",
        metavar="N|latest",
        help="With a directory of several checkpoints: the step to use (N or latest).",
        show_default=False,
    ),
]
OptimizerDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--optimizer-dir",
        help="A separate optimizer checkpoint (e.g. checkpoint-N/optimizer_0) read together with CHECKPOINT's model.",
        show_default=False,
        parser=given_path,
    ),
]
SchemaOpt = Annotated[
    SchemaChoice | None,
    typer.Option("--schema", help="Key schema instead of the detected one (inspect shows which and why)."),
]
ModelPrefixOpt = Annotated[
    str | None,
    typer.Option("--model-prefix", help="Prefix of the model keys ('' = top level), overriding the schema."),
]
OptimizerPrefixOpt = Annotated[
    str | None,
    typer.Option("--optimizer-prefix", help="Prefix of the optimizer keys (e.g. 'app.optim.'), overriding the schema."),
]

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}  # fmt: skip
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str | int, flag: str) -> int:
    """Bytes of a size: ``5GB`` (10^9), ``2GiB`` (2^30), ``512M`` (2^20) or a byte count.

    Raises:
        UsageError: not a positive size (the message names ``flag``).
    """
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.fullmatch(text)
        unit = m.group(2).lower() if m else ""
        if m is None or unit not in _SIZE_UNITS:
            raise UsageError(
                f"{flag} {text!r} is not a size", hint="use e.g. 5GB (10^9 bytes), 2GiB, 512M or a byte count"
            )
        number = float(m.group(1)) * _SIZE_UNITS[unit]  # float() reads any number of digits (inf past its range)
        if number >= 2**63:
            shown = repr(text) if len(text) <= 40 else f"{text[:20]!r}... ({len(text):,} characters)"
            raise UsageError(
                f"{flag} {shown} is larger than any file (2^63 bytes)", hint="use e.g. 5GB, 2GiB or a byte count"
            )
        value = int(number)
    if value <= 0:
        raise UsageError(f"{flag} {text!r} must be a positive size", hint="use e.g. 5GB, 2GiB or a byte count")
    return value


_FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")
_ALIASES = {"bfloat16": "bf16", "float16": "fp16/half", "float32": "fp32/float", "float64": "fp64/double"}


#: An FP8 dtype as a user types it: ``fp8``, ``float8``, ``float8_e4m3fn``, ``fp8_e5m2``, ``e4m3``.
_FLOAT8 = re.compile(r"(?:fp8|float8|e4m3|e5m2)")


def parse_dtype(
    text: str,
    flag: str,
    allowed: tuple[str, ...] = _FLOAT_DTYPES,
    extra: tuple[str, ...] = (),
    float8_hint: str | None = None,
) -> str:
    """Canonical dtype name of ``text`` (``bf16`` -> ``bfloat16``, ``torch.float32`` -> ``float32``), one of ``allowed``.

    Aliases (case-insensitive, optional ``torch.`` prefix): ``bf16``; ``fp16``/``half``;
    ``fp32``/``float``; ``fp64``/``double``. ``extra`` words (``preserve``) are returned as given.
    The refusal's hint names the aliases of ``allowed`` only; for an FP8 dtype (``fp8``, ``float8_e4m3fn``), the
    option that writes one instead, ``float8_hint``, where given (export's ``--quantize``).

    Raises:
        UsageError: not one of ``allowed`` (the message names ``flag``).
    """
    word = text.strip().lower()
    if word in extra:
        return word
    name = dtype_name(word) if word else ""
    if name not in allowed:
        aliases = [_ALIASES[a] for a in _FLOAT_DTYPES if a in allowed]  # of the dtypes this option takes only
        hint = f"dtype aliases: {', '.join(aliases)}" if aliases else None
        if float8_hint is not None and _FLOAT8.match(name.removeprefix("torch.")):
            hint = float8_hint
        raise UsageError(f"{flag} {text!r} is not one of {', '.join((*extra, *allowed))}", hint=hint)
    return name


def dtype_aliases_help(allowed: tuple[str, ...]) -> str:
    """The aliases :func:`parse_dtype` accepts for ``allowed``, from the alias table, as ``--help`` words:
    ``"aliases bf16; fp16, f16, half; any case, torch. prefix optional"``."""
    words = "; ".join(", ".join(a) for a in map(dtype_aliases, allowed) if a)
    return f"aliases {words}; any case, torch. prefix optional"


def examples(*lines: str) -> str:
    """A ``--help`` epilog of example command lines, printed as written (click's ``\\b``)."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


def parse_tolerance(text: str) -> tuple[float, float]:
    """``"1e-5,1e-8"`` -> ``(rtol, atol)``.

    Raises:
        UsageError: not two finite non-negative numbers (``inf``/``nan`` would make the check pass always).
    """
    from ckpttool.ops.replay.run import check_tolerance  # replay-step imports torch anyway; other commands do not

    parts = text.split(",")
    try:
        rtol, atol = (float(x) for x in parts)
    except ValueError as e:
        raise UsageError(f"--tolerance {text!r} is not 'rtol,atol'", hint="e.g. --tolerance 1e-5,1e-8") from e
    check_tolerance(rtol, atol, text)
    return rtol, atol


def declaration(
    source_layout: SourceLayout | str | None, ep_size: int | None, ep_fsdp_size: int | None, no_ep: bool = False
) -> LayoutDeclaration | None:
    """The layout declaration of ``--source-layout/--ep-size/--ep-fsdp-size`` or ``--no-ep`` (``None``: none given)."""
    from ckpttool.layouts.declaration import LayoutDeclaration

    layout = source_layout.value if isinstance(source_layout, SourceLayout) else source_layout
    return LayoutDeclaration.from_options(layout, ep_size, ep_fsdp_size, no_ep)


def selection(
    step: str | None = None,
    optimizer_dir: Path | None = None,
    schema: SchemaChoice | str | None = None,
    model_prefix: str | None = None,
    optimizer_prefix: str | None = None,
) -> CheckpointSelection | None:
    """What ``--step/--optimizer-dir/--schema/--model-prefix/--optimizer-prefix`` select (``None``: nothing)."""
    from ckpttool.model.discovery import CheckpointSelection
    from ckpttool.model.schemas.keyschema import SchemaOverride

    name = schema.value if isinstance(schema, SchemaChoice) else schema
    override = SchemaOverride.from_options(name, model_prefix, optimizer_prefix)
    return CheckpointSelection.from_options(step, optimizer_dir, override)
