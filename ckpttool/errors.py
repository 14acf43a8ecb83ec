"""Error hierarchy of ckpttool: one class per error code (``docs/errors.md`` lists every code).

Every failure a user can cause is a :class:`CkptError` subclass with a stable ``code``, the
offending ``path`` and/or ``fqn``, the library ``param`` (the CLI names it by its flag), a
one-line ``hint`` and an ``exit_code`` (2 unusable input, 1 problems found); the CLI prints
``error: [CODE] message`` / ``hint: ...``. Programmer errors stay ordinary exceptions. Code
families: E1xx invocation and paths, E2xx ``.metadata``, E3xx data files and chunks, E4xx
layout record and EP layouts, E5xx optimizer state, E6xx outputs, E7xx replay results.
``docs/design.md`` §8.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from dataclasses import dataclass
from os import PathLike
from pathlib import Path, PurePath
from typing import Generic, TypeVar

#: A run of whitespace in an error message (squashed to one space, as ``str.split`` would split it).
_SPACES = re.compile(r"\s+")


def _folded(text: str, path: str) -> str:
    """``text`` on one line, runs of whitespace as one space, but ``path`` and its folders (where their names hold
    whitespace other than single spaces) kept as they are."""
    kept = [a for a in (path, *(str(p) for p in PurePath(path).parents)) if a and a != " ".join(a.split())]
    kept = [a for a in sorted(set(kept), key=len, reverse=True) if a in text]
    if not kept:
        return " ".join(text.split())
    parts = re.split("(" + "|".join(map(re.escape, kept)) + ")", text)
    return "".join(part if i % 2 else _SPACES.sub(" ", part) for i, part in enumerate(parts)).strip()


#: :func:`short_key`: a key longer than this is shown by its start and end in a message.
KEY_SHOWN_CHARS = 200


def short_key(key: str) -> str:
    """``key`` as a message names it: whole up to :data:`KEY_SHOWN_CHARS` characters, else its first 120 and last
    60 characters around ``...`` and its length (``a.a.a...a.a.weight (200,007 characters)``): a message stays one
    readable line, and the end (the parameter's own name) is kept."""
    if len(key) <= KEY_SHOWN_CHARS:
        return key
    return f"{key[:120]}...{key[-60:]} ({len(key):,} characters)"


def shell_arg(path: str | PathLike[str]) -> str:
    """``path`` as one shell argument to paste from a hint (POSIX shells; bash and zsh for ``$'...'``).

    ``shlex.quote``'s form (``'it'"'"'s'``, ``'a b'``), but a relative path starting with ``-`` gets ``./``
    (not read as an option), and a name with whitespace other than single spaces, control characters,
    undecodable bytes (surrogates) or a backtick (the CLI reads `` `step` `` in a message as a parameter) is ANSI-C
    quoted with escapes (``$'we\\nird'``, ``\\x60``): the hint stays one line with nothing folded away, and pastes
    as that very path.
    """
    text = str(path)
    if text.startswith("-"):
        text = "./" + text
    if text.isprintable() and "  " not in text and "`" not in text:
        import shlex

        return shlex.quote(text)
    out = []
    for c in text:
        if c in "\\'":
            out.append("\\" + c)
        elif c == "`":  # literal in a shell's quotes, but a message's `param` to the CLI's output
            out.append("\\x60")
        elif c == " " or c.isprintable():
            out.append(c if c != " " else "\\x20")
        elif 0xDC80 <= ord(c) <= 0xDCFF:  # an undecodable byte of the name (os.fsdecode's surrogateescape)
            out.append(f"\\x{ord(c) - 0xDC00:02x}")
        elif c in "\n\t\r":
            out.append({"\n": "\\n", "\t": "\\t", "\r": "\\r"}[c])
        elif ord(c) < 0x80:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}")
    return "$'" + "".join(out) + "'"


__all__ = [
    "CkptError",
    "Refusal",
    "PerRankError",
    "FormatVersionError",
    "UsageError",
    "RankLostError",
    "PathEscapeError",
    "NotRegularFileError",
    "RemoteStorageError",
    "RemoteNotFoundError",
    "RemotePermissionError",
    "RemoteThrottledError",
    "RemoteTransientError",
    "GradientsError",
    "DeviceUnavailableError",
    "MemoryBudgetError",
    "MetadataError",
    "UnsafePickleError",
    "IncompleteCheckpointError",
    "AmbiguousCheckpointError",
    "StepNotFoundError",
    "SchemaError",
    "IndexedOptimizerStateError",
    "IntegerRangeError",
    "PlannerDataError",
    "DataFileError",
    "ChunkError",
    "TransformError",
    "AllocationError",
    "TrustRequiredError",
    "StorageTupleError",
    "ObjectGraphError",
    "SizeLimitError",
    "ChecksumError",
    "JsonDepthError",
    "ManifestError",
    "DiffError",
    "NothingComparedError",
    "LayoutError",
    "LayoutFormatError",
    "LayoutVersionError",
    "LayoutConflictError",
    "LayoutContradictionError",
    "AmbiguousLayoutError",
    "LayoutSizeError",
    "OptimStateError",
    "StateFieldsError",
    "StateDtypeError",
    "StateShapeError",
    "LostStateError",
    "HyperparameterError",
    "OutputError",
    "ForeignOutputError",
    "ExportError",
    "ExportNamingError",
    "ExportAccountingError",
    "ModelMismatchError",
    "QuantizationError",
    "QuantizedSourceError",
    "ReshardError",
    "ReplayMismatchError",
    "error_class",
    "shell_arg",
    "short_key",
    "check_bool",
    "check_field_types",
    "check_path",
    "at_least",
]


class CkptError(Exception):
    """Root of all user-facing ckpttool errors.

    Args:
        message: one line saying what is wrong; names the file/key when known.
        hint: one line saying how to fix it (default: the class's ``default_hint``).
        path: the file or directory concerned, if any.
        fqn: the checkpoint key concerned, if any.
        param: the library parameter concerned (``"filter_glob"``); the CLI replaces it by
            the command's flag (``--filter``) in the message and the hint.

    A subclass declares its code (and an exit code other than 2) in its class line,
    ``class ChunkError(CkptError, code="E301"):``; its ``default_hint`` is the code's row of
    ``_HINTS`` (a code without a row inherits its parent's hint).
    """

    code: str = "E000"
    exit_code: int = 2
    default_hint: str = ""

    def __init_subclass__(cls, *, code: str | None = None, exit_code: int | None = None) -> None:
        super().__init_subclass__()
        cls.code = code or cls.code
        cls.exit_code = exit_code or cls.exit_code
        cls.default_hint = _HINTS.get(cls.code, cls.default_hint)

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        path: str | PathLike[str] | None = None,
        fqn: str | None = None,
        param: str | None = None,
    ) -> None:
        # Keep messages single-line whatever the caller passed in, but name ``path`` as it is: a path holding a
        # newline or runs of spaces stays that path (the output escapes its control characters as \x0a).
        # Its folders are kept as they are too: a message names the run root of a step directory it is about.
        self.message = _folded(str(message), str(path) if path is not None else "")
        self.hint = " ".join(str(hint if hint is not None else self.default_hint).split())
        self.path = str(path) if path is not None else None
        self.fqn = fqn
        self.param = param
        super().__init__(self.message)

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"

    def to_dict(self) -> dict[str, object]:
        """JSON-ready view: ``code``, ``message``, ``hint``, ``path``, ``fqn``, ``exit_code``."""
        return {k: getattr(self, k) for k in ("code", "message", "hint", "path", "fqn", "exit_code")}


# The one-line fix printed as `hint:` for each code (the class's ``default_hint``).
_HINTS: dict[str, str] = {
    "E100": "run the command with --help",
    "E101": "the checkpoint references files outside its directory; do not trust it",
    "E102": "only regular files are read or copied; replace the special file by the real data",
    "E120": "pass a safetensors file of gradients keyed by parameter fqn",
    "E121": "use --device auto or --device cpu",
    "E130": "raise --max-memory, or leave the parameter out with --filter",
    "E140": "check the URL and --storage-option (docs/storage.md)",
    "E141": "check the URL: its bucket and prefix (the checkpoint read, or the output written)",
    "E142": "check the credentials (environment, config files, --storage-option) and the bucket policy",
    "E143": "retry later, or lower --remote-workers",
    "E144": "check the network and the endpoint, then run again (--remote-retries raises the attempts)",
    "E150": "see torchrun's failure summary for the rank that died, then run again",
    "E200": "re-save the checkpoint or restore .metadata from a good copy",
    "E201": "the file may run code when loaded by torch; do not load it with torch.load(weights_only=False)",
    "E202": "the save did not finish (crashed or async save still running); use an earlier checkpoint",
    "E204": "pass one of the listed directories, or pick a step with --step latest or --step N",
    "E205": "pass one of the listed steps, or --step latest",
    "E206": "the checkpoint holds impossible numbers; it is damaged or was crafted",
    "E207": "re-save the checkpoint with torch's DefaultSavePlanner, or remove the broken planner_data",
    "E250": "`ckpttool inspect` shows the keys; give the prefixes with --model-prefix/--optimizer-prefix",
    "E251": "re-save the optimizer with torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizer), which keys state by parameter fqn",
    "E260": "write the manifest again with `ckpttool manifest DIR` from a checkpoint known to be good",
    "E280": "the per-rank files do not fit together (placements, shapes, replicas): re-save, or pass one save's files",
    "E281": "upgrade ckpttool, or convert the checkpoint with its framework's own tools",
    "E300": "the checkpoint is incomplete; copy it again or use an earlier checkpoint",
    "E301": "the data file is damaged or does not belong to this .metadata",
    "E302": "install the package the transform needs (e.g. zstandard) or re-save without it",
    "E303": "the metadata declares sizes that the data files cannot hold; the checkpoint is damaged",
    "E304": "pass --trust-pickle only if you trust where this checkpoint came from",
    "E305": "the chunk's data.pkl was not written by torch.save; the checkpoint is damaged or crafted",
    "E306": "the object is a pickle bomb (shared or deeply nested containers); do not load it with torch",
    "E307": "raise the cap with `ckpttool --max-object-size SIZE` / `--max-metadata-size SIZE` if the input is trusted",
    "E308": "the data file is damaged; copy it again or use an earlier checkpoint",
    "E309": "the JSON file is not what it claims to be; fix or remove it",
    "E400": "declare the layout with --source-layout legacy|canonical --ep-size P --ep-fsdp-size F",
    "E401": "this record was not written by ckpttool; remove or fix it",
    "E402": "upgrade ckpttool",
    "E403": "remove the stale layout.json (the embedded record was written with the save)",
    "E404": "check the mesh sizes of the job that saved the checkpoint (`ckpttool inspect` shows the chunks)",
    "E405": "declare it with --source-layout legacy|canonical --ep-size P --ep-fsdp-size F (or record it once with `ckpttool stamp`)",
    "E406": "the expert count must be a multiple of ep_size * ep_fsdp_size",
    "E500": "run `ckpttool validate --strict` on the checkpoint to see every problem",
    "E600": "choose another output directory or pass --overwrite",
    "E601": "see `ckpttool export --help`",
    "E602": "see `ckpttool reshard --help`",
    "E603": "keep the DCP checkpoint, or convert the names with a model-specific adapter first",
    "E604": "this is a ckpttool bug: report it with `ckpttool inspect --json` of the checkpoint",
    "E605": "pass the config.json of the model this checkpoint was trained as, or allow the kind with --allow-mismatch",
    "E606": "ckpttool replaces only a directory it wrote itself; choose another output directory, or remove this one yourself if it is no longer needed",
    "E607": "leave the tensor unquantized with --quantize-skip, or check the source with `ckpttool validate --deep`",
    "E610": "see `ckpttool diff --help` and docs/diff.md",
    "E611": "compare what the checkpoints hold: see `ckpttool inspect` of each side and docs/diff.md",
    "E612": "the quantized checkpoint is damaged or of another convention; check it with `ckpttool validate --deep`",
    "E700": "the saved optimizer state does not reproduce the next step; run `ckpttool validate --strict --deep`",
}


# --------------------------------------------------------------------------- E1xx invocation
class UsageError(CkptError, code="E100"):
    """Bad invocation: conflicting options, a path that is not a directory, a bad value."""


class PathEscapeError(CkptError, code="E101"):
    """A ``relative_path`` or symlink resolves outside the checkpoint directory."""


class NotRegularFileError(CkptError, code="E102"):
    """A path ckpttool would read or copy is a device, FIFO, socket or directory, not a regular file."""


class GradientsError(UsageError, code="E120"):
    """``replay-step`` gradients file: missing, unreadable, a missing gradient, wrong shape or dtype."""


class DeviceUnavailableError(UsageError, code="E121"):
    """The requested device (``cuda``, ``npu``) is not available on this machine."""


class MemoryBudgetError(UsageError, code="E130"):
    """A memory budget too small for a single unit of work."""


class RemoteStorageError(CkptError, code="E140"):
    """A URL cannot be used: fsspec or its backend missing, unknown scheme, bad ``--storage-option``, a failed request."""


class RemoteNotFoundError(RemoteStorageError, code="E141"):
    """An object or bucket of a remote checkpoint does not exist."""


class RemotePermissionError(RemoteStorageError, code="E142"):
    """The store refused a request: credentials missing, wrong or without the needed permission."""


class RemoteThrottledError(RemoteStorageError, code="E143"):
    """The store kept throttling requests (SlowDown / 429 / 503) through every retry."""


class RemoteTransientError(RemoteStorageError, code="E144"):
    """A request kept failing with transient errors (connection reset, timeout, 5xx) through every retry."""


class RankLostError(CkptError, code="E150"):
    """torchrun: another rank left the run mid-way (killed, out of memory, its node lost); nothing was published."""


# --------------------------------------------------------------------------- E2xx .metadata
class MetadataError(CkptError, code="E200"):
    """``.metadata`` missing, empty, truncated, garbage or of the wrong shape."""


class UnsafePickleError(MetadataError, code="E201"):
    """A pickle names a global outside ckpttool's allow-list."""


class IncompleteCheckpointError(MetadataError, code="E202"):
    """Data files without ``.metadata``: a save that did not finish."""


class AmbiguousCheckpointError(MetadataError, code="E204"):
    """A directory without ``.metadata`` holding several checkpoints below it: which one is not clear.

    ``steps``: the complete steps' directories below it, ``(step, directory)`` in step order (a command that reads
    several checkpoints names them in its hint)."""

    steps: tuple[tuple[int, str], ...] = ()


class StepNotFoundError(MetadataError, code="E205"):
    """``--step N`` names a step that no checkpoint below the directory has."""


class SchemaError(MetadataError, code="E250"):
    """The key schema cannot be used: an override prefix that matches nothing, or keys no command can map."""


class IndexedOptimizerStateError(SchemaError, code="E251"):
    """Optimizer state keyed by parameter index (a plain ``optimizer.state_dict()``): it cannot be mapped to parameters."""


class PerRankError(MetadataError, code="E280"):
    """Per-rank shards (verl FSDP, torch-checkpointing) that cannot be assembled into their global tensors."""


class FormatVersionError(MetadataError, code="E281"):
    """A checkpoint format version ckpttool does not know (named): refused, never guessed."""


class IntegerRangeError(MetadataError, code="E206"):
    """An integer (size, offset, length, hyperparameter) beyond what torch's int64 and float fields can hold."""


class PlannerDataError(MetadataError, code="E207"):
    """``planner_data`` paths whose items are not plain ``str``/``int`` (unhashable or mixed-type group ids)."""


# --------------------------------------------------------------------------- E3xx data
class DataFileError(CkptError, code="E300"):
    """A data file is missing, unreadable, or shorter than the metadata says."""


class ChunkError(CkptError, code="E301"):
    """A stored chunk is corrupt or disagrees with its metadata (shape, dtype, bytes)."""


class TransformError(CkptError, code="E302"):
    """A chunk uses a stream transform (compression, ...) that cannot be decoded here."""


class AllocationError(CkptError, code="E303"):
    """Declared sizes are impossible or would exceed the stored bytes / memory budget."""


class TrustRequiredError(CkptError, code="E304"):
    """An object cannot be loaded with ``torch.load(weights_only=True)``."""


class StorageTupleError(ChunkError, code="E305"):
    """A chunk archive's ``data.pkl`` rebuilds its tensor from fields of the wrong types."""


class ObjectGraphError(CkptError, code="E306"):
    """An unpickled object exceeds the walk bounds: too many nodes counted as a tree, or nested too deeply."""


class SizeLimitError(CkptError, code="E307"):
    """A file, item or decompressed member is larger than ckpttool's cap for it (checked before reading)."""


class ChecksumError(ChunkError, code="E308"):
    """A stored record's bytes do not match the CRC-32 of its zip entry (bit rot, a damaged copy)."""


class JsonDepthError(CkptError, code="E309"):
    """A JSON file (``layout.json``, ``config.json``, a reference) nested deeper or larger than the cap."""


# --------------------------------------------------------------------------- E4xx layout
class ManifestError(CkptError, code="E260"):
    """An integrity manifest (``manifest.json``) that cannot be used: not JSON, wrong format or version, malformed."""


class LayoutError(CkptError, code="E400"):
    """Layout record malformed, or an incomplete layout declaration."""


class LayoutFormatError(LayoutError, code="E401"):
    """A layout record with an unknown ``format`` or an invalid ``version``."""


class LayoutVersionError(LayoutError, code="E402"):
    """A layout record ``version`` newer than this ckpttool supports."""


class LayoutConflictError(LayoutError, code="E403"):
    """The embedded ``layout`` item and the sidecar ``layout.json`` disagree."""


class LayoutContradictionError(LayoutError, code="E404"):
    """A layout declaration contradicts the layout record or the chunk geometry."""


class AmbiguousLayoutError(LayoutError, code="E405"):
    """An unversioned EP tensor sharded by EP and EP-FSDP on one dim: its expert order is unknown."""


class LayoutSizeError(LayoutError, code="E406"):
    """EP / EP-FSDP sizes that do not divide the expert count (or a dim) into equal blocks."""


# --------------------------------------------------------------------------- E5xx optimizer state
class OptimStateError(CkptError, code="E500"):
    """Optimizer state that does not match the optimizer configuration (on restore)."""


class StateFieldsError(OptimStateError, code="E510"):
    """A parameter's saved state lacks a field its optimizer type saves, or has an unexpected one."""


class StateDtypeError(OptimStateError, code="E511"):
    """A saved state field violates the dtype policy of its optimizer type (``replay-step``), or a parameter's
    stored dtype is one its floating optimizer state refutes (``export``)."""


class StateShapeError(OptimStateError, code="E512"):
    """A saved state tensor's shape differs from its parameter's."""


class LostStateError(OptimStateError, code="E513"):
    """No state for a parameter whose param group (leaf) did step: the state was lost."""


class HyperparameterError(OptimStateError, code="E514"):
    """Param-group hyperparameters missing or unusable (non-numeric lr, amsgrad, no groups at all)."""


# --------------------------------------------------------------------------- E6xx outputs
class OutputError(CkptError, code="E600"):
    """An output target that cannot be written (exists, not writable, write failed)."""


class ForeignOutputError(OutputError, code="E606"):
    """``--overwrite`` refused: the target is not provably a ckpttool output (no marker, or one that disagrees)."""


class ExportError(CkptError, code="E601"):
    """An export that cannot be done as asked (missing masters, tied mismatch, ...)."""


class ExportNamingError(ExportError, code="E603"):
    """Model tensors whose names have no Hugging Face mapping (torchtitan naming needs an adapter)."""


class ExportAccountingError(ExportError, code="E604"):
    """A tensor that export would neither write nor list as skipped with a reason."""


class ModelMismatchError(ExportError, code="E605"):
    """Tensors that do not fit the model class built from ``config.json`` (missing, unexpected, shape, dtype)."""


class QuantizationError(ExportError, code="E607"):
    """A quantized export whose values fail the check: a non-finite block, a zero scale, an error above the bound."""


class QuantizedSourceError(ExportError, code="E612"):
    """A quantized checkpoint read (``import``) whose scales do not fit or hold bad values (block FP8, MXFP4), or whose
    weights are integer-packed codes it does not dequantize (AWQ/GPTQ, bitsandbytes, compressed-tensors packed)."""


class ReshardError(CkptError, code="E602"):
    """A reshard that cannot be done as asked."""


class DiffError(CkptError, code="E610"):
    """``diff`` cannot compare its inputs as asked (an input of no known kind, no common naming)."""


class NothingComparedError(DiffError, code="E611"):
    """``diff`` compared no tensor value nor hyperparameter and found no difference: it cannot say "equal" (fail closed).

    Both sides hold no tensors of the kind asked for (a state pickled into byte items), no name
    in common, or ``--filter`` left nothing; the message says what each side holds.
    """


# --------------------------------------------------------------------------- E7xx results
class ReplayMismatchError(CkptError, code="E700", exit_code=1):
    """replay-step ran and found results beyond tolerance (exit 1)."""


def _all_classes() -> list[type[CkptError]]:
    out: list[type[CkptError]] = []
    stack: list[type[CkptError]] = [CkptError]
    while stack:
        cls = stack.pop()
        out.append(cls)
        stack.extend(cls.__subclasses__())
    return out


def error_class(code: str) -> type[CkptError]:
    """The class that raises error ``code`` (``"E301"`` -> :class:`ChunkError`); :class:`CkptError` if none."""
    for cls in _all_classes():
        if cls.code == code and cls is not CkptError:
            return cls
    return CkptError


E = TypeVar("E", bound=CkptError)


@dataclass(frozen=True)
class Refusal(Generic[E]):
    """A module's one wording of its refusals of a file: ``refusal(path, why)`` builds the error.

    ``Refusal(MetadataError, "{path}: not a valid X ({why})", hint="...")``: ``template`` is
    formatted with ``path`` and ``why``; the error names ``path``; ``hint`` ``None`` keeps the
    class's default hint.
    """

    error: type[E]
    template: str
    hint: str | None = None

    def __call__(self, path: str | PathLike[str], why: str) -> E:
        return self.error(self.template.format(path=path, why=why), path=path, hint=self.hint)


# --------------------------------------------------------------------------- option types
#: The hint of a bool parameter whose wrong value is a hazard of its own (by name); else "pass True or False".
_BOOL_HINTS = {"trust_pickle": "pass trust_pickle=True only for a checkpoint you trust (it runs code from it)"}


def _numpy_bool(value: object) -> bool:
    """``value`` is a NumPy bool scalar (``np.True_``: what a comparison or a mask element gives)."""
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


def check_bool(value: object, param: str) -> None:
    """Refuse a bool parameter that is not ``True``/``False`` or a NumPy bool (``"no"`` is truthy, ``None`` and
    ``0`` falsy).

    Raises:
        UsageError (E100): naming ``param``.
    """
    if not isinstance(value, bool) and not _numpy_bool(value):
        raise UsageError(
            f"`{param}` must be True or False, got {type(value).__name__} {value!r:.40}",
            param=param,
            hint=_BOOL_HINTS.get(param, "pass True or False"),
        )


def _as_int(value: object) -> int | None:
    """``value`` as an ``int``: an int or an integer scalar that says it is one (``__index__``: a NumPy
    ``int64``), not a bool (NumPy's either) nor a float or string; else ``None``."""
    if isinstance(value, bool) or _numpy_bool(value) or not hasattr(type(value), "__index__"):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


Opts = TypeVar("Opts")


def at_least(minimum: int) -> dict[str, int]:
    """The ``dataclasses.field`` metadata of an ``int`` (``int | None``) options field whose value must be
    ``>= minimum`` (``workers``, ``depth``, ``steps``): :func:`check_field_types` holds every options class to it."""
    return {"at_least": minimum}


#: The annotations of an options field that holds several strings (a glob, a rule code each).
_STRING_SEQUENCES = ("tuple[str, ...]", "Sequence[str]", "Sequence[str] | None")
#: What the strings of such a field are, by field name, for its message (default: strings).
_SEQUENCE_NOUNS = {"select": "rule codes", "ignore": "rule codes", "filters": "globs", "quantize_skip": "globs"}


def check_field_types(options: Opts) -> Opts:
    """Refuse an options dataclass whose ``bool`` field is not a bool, whose ``int`` (``int | None``)
    field is a bool or not an int (``"2"``, ``2.0``, ``True``), whose ``Path`` or ``str | os.PathLike[str]``
    field (each ``| None``) is no ``str`` or ``os.PathLike`` (a config field: nor a dict), or whose ``str``
    (``str | None``) field is a list, tuple or set (``filter_glob`` takes one glob), or whose sequence of strings
    (``ignore``, ``filters``) is one string, or whose ``int`` field is below its :func:`at_least` bound: the one
    type check of every options class.

    Returns:
        ``options``, or a copy with a NumPy bool or integer (``np.True_``, ``np.int64(4)``) given as the
        Python ``bool``/``int`` of the same value (so results and JSON documents hold plain values), and a
        ``Path`` field given as a string or another ``os.PathLike`` as its ``Path``.

    Raises:
        UsageError (E100): naming the first such field.
    """
    plain: dict[str, object] = {}
    for f in dataclasses.fields(options):  # type: ignore[arg-type]
        value = getattr(options, f.name)
        if f.type in ("bool", bool):
            check_bool(value, f.name)
            if not isinstance(value, bool):
                plain[f.name] = bool(value)
        elif f.type in ("int", int, "int | None") and not (value is None and f.type == "int | None"):
            number = _as_int(value)
            if number is None:
                raise UsageError(
                    f"`{f.name}` must be an integer, got {type(value).__name__} {value!r:.40}",
                    param=f.name,
                    hint=f"pass a Python int{' or None' if f.type == 'int | None' else ''}",
                )
            if number < f.metadata.get("at_least", number):
                raise UsageError(
                    f"`{f.name}` must be an integer >= {f.metadata['at_least']}, got {value!r:.40}",
                    param=f.name,
                    hint=f"pass {f.name}={f.metadata['at_least']} or more"
                    + (", or None for the default" if f.type == "int | None" else ""),
                )
            if type(value) is not int:
                plain[f.name] = number
        elif f.type in ("Path", "Path | None") and value is not None and not isinstance(value, Path):
            check_path(value, f.name)
            plain[f.name] = Path(value)
        elif (
            isinstance(f.type, str)
            and f.type.startswith("str | os.PathLike[str]")
            and value is not None
            and not isinstance(value, (str, PathLike))
            and not ("dict" in f.type and isinstance(value, dict))
        ):
            raise UsageError(
                f"`{f.name}` must be a path{' or a dict' if 'dict' in f.type else ''}, got {type(value).__name__} "
                f"{value!r:.40}",
                param=f.name,
                hint="pass a str or a pathlib.Path",
            )
        else:
            _check_strings(f.name, f.type, value)
    return dataclasses.replace(options, **plain) if plain else options  # type: ignore[type-var]


def check_path(value: object, name: str) -> None:
    """Refuse a path argument (a source, an output directory, a field of an options class) that is no ``str`` or
    ``os.PathLike``: ``bytes``, ``None``, a number.

    Raises:
        UsageError (E100): naming ``name``.
    """
    if not isinstance(value, (str, PathLike)):
        raise UsageError(
            f"`{name}` must be a path, got {type(value).__name__} {value!r:.40}",
            param=name,
            hint="pass a str or a pathlib.Path",
        )


def _check_strings(name: str, annotation: object, value: object) -> None:
    """:func:`check_field_types` of a field of one string or of several: a list for one, a string for several.

    Raises:
        UsageError (E100): naming the field.
    """
    if annotation in _STRING_SEQUENCES and isinstance(value, (str, bytes)):
        noun = _SEQUENCE_NOUNS.get(name, "strings")
        raise UsageError(
            f"`{name}` {value!r:.60} is not a sequence of non-empty {noun} (one string is read as its characters)",
            param=name,
            hint=f"pass a list or tuple of them: {name}=[{value!r:.40}]",
        )
    if annotation in ("str", "str | None") and isinstance(value, (list, tuple, set, frozenset)):
        raise UsageError(
            f"`{name}` must be one string, got {type(value).__name__} {value!r:.40}",
            param=name,
            hint="pass one glob; fnmatch's [qk] matches q or k" if "glob" in name else "pass one string",
        )
