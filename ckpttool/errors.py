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

from os import PathLike

__all__ = [
    "CkptError",
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
    """

    code: str = "E000"
    exit_code: int = 2
    default_hint: str = ""

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        path: str | PathLike[str] | None = None,
        fqn: str | None = None,
        param: str | None = None,
    ) -> None:
        # Keep messages single-line whatever the caller passed in.
        self.message = " ".join(str(message).split())
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


# --------------------------------------------------------------------------- E1xx invocation
class UsageError(CkptError):
    """Bad invocation: conflicting options, a path that is not a directory, a bad value."""

    code = "E100"
    default_hint = "run the command with --help"


class PathEscapeError(CkptError):
    """A ``relative_path`` or symlink resolves outside the checkpoint directory."""

    code = "E101"
    default_hint = "the checkpoint references files outside its directory; do not trust it"


class NotRegularFileError(CkptError):
    """A path ckpttool would read or copy is a device, FIFO, socket or directory, not a regular file."""

    code = "E102"
    default_hint = "only regular files are read or copied; replace the special file by the real data"


class GradientsError(UsageError):
    """``replay-step`` gradients file: missing, unreadable, a missing gradient, wrong shape or dtype."""

    code = "E120"
    default_hint = "pass a safetensors file of gradients keyed by parameter fqn"


class DeviceUnavailableError(UsageError):
    """The requested device (``cuda``, ``npu``) is not available on this machine."""

    code = "E121"
    default_hint = "use --device auto or --device cpu"


class MemoryBudgetError(UsageError):
    """A memory budget too small for a single unit of work."""

    code = "E130"
    default_hint = "raise --max-memory, or leave the parameter out with --filter"


class RemoteStorageError(CkptError):
    """A URL cannot be used: fsspec or its backend missing, unknown scheme, bad ``--storage-option``, a failed request."""

    code = "E140"
    default_hint = "check the URL and --storage-option (docs/storage.md); pip install 'ckpttool[s3]' for s3://"


class RemoteNotFoundError(RemoteStorageError):
    """An object or bucket of a remote checkpoint does not exist."""

    code = "E141"
    default_hint = "check the URL: the bucket and prefix of the checkpoint directory"


class RemotePermissionError(RemoteStorageError):
    """The store refused a request: credentials missing, wrong or without the needed permission."""

    code = "E142"
    default_hint = "check the credentials (environment, config files, --storage-option) and the bucket policy"


class RemoteThrottledError(RemoteStorageError):
    """The store kept throttling requests (SlowDown / 429 / 503) through every retry."""

    code = "E143"
    default_hint = "retry later, or lower --remote-workers"


class RemoteTransientError(RemoteStorageError):
    """A request kept failing with transient errors (connection reset, timeout, 5xx) through every retry."""

    code = "E144"
    default_hint = "check the network and the endpoint, then run again (--remote-retries raises the attempts)"


class RankLostError(CkptError):
    """torchrun: another rank left the run mid-way (killed, out of memory, its node lost); nothing was published."""

    code = "E150"
    default_hint = "see torchrun's failure summary for the rank that died, then run again"


# --------------------------------------------------------------------------- E2xx .metadata
class MetadataError(CkptError):
    """``.metadata`` missing, empty, truncated, garbage or of the wrong shape."""

    code = "E200"
    default_hint = "re-save the checkpoint or restore .metadata from a good copy"


class UnsafePickleError(MetadataError):
    """A pickle names a global outside ckpttool's allow-list."""

    code = "E201"
    default_hint = "the file may run code when loaded by torch; do not load it with torch.load(weights_only=False)"


class IncompleteCheckpointError(MetadataError):
    """Data files without ``.metadata``: a save that did not finish."""

    code = "E202"
    default_hint = "the save did not finish (crashed or async save still running); use an earlier checkpoint"


class AmbiguousCheckpointError(MetadataError):
    """A directory without ``.metadata`` holding several checkpoints below it: which one is not clear."""

    code = "E204"
    default_hint = "pass one of the listed directories, or pick a step with --step N|latest"


class StepNotFoundError(MetadataError):
    """``--step N`` names a step that no checkpoint below the directory has."""

    code = "E205"
    default_hint = "pass one of the listed steps, or --step latest"


class SchemaError(MetadataError):
    """The key schema cannot be used: an override prefix that matches nothing, or keys no command can map."""

    code = "E250"
    default_hint = "`ckpttool inspect` shows the keys; give the prefixes with --model-prefix/--optimizer-prefix"


class IndexedOptimizerStateError(SchemaError):
    """Optimizer state keyed by parameter index (a plain ``optimizer.state_dict()``): it cannot be mapped to parameters."""

    code = "E251"
    default_hint = (
        "re-save the optimizer with torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizer), "
        "which keys state by parameter fqn"
    )


class PerRankError(MetadataError):
    """Per-rank shards (verl FSDP, torch-checkpointing) that cannot be assembled into their global tensors."""

    code = "E280"
    default_hint = (
        "the per-rank files do not fit together (placements, shapes, replicas): re-save, or pass one save's files"
    )


class FormatVersionError(MetadataError):
    """A checkpoint format version ckpttool does not know (named): refused, never guessed."""

    code = "E281"
    default_hint = "upgrade ckpttool, or convert the checkpoint with its framework's own tools"


class IntegerRangeError(MetadataError):
    """An integer (size, offset, length, hyperparameter) beyond what torch's int64 and float fields can hold."""

    code = "E206"
    default_hint = "the checkpoint holds impossible numbers; it is damaged or was crafted"


class PlannerDataError(MetadataError):
    """``planner_data`` paths whose items are not plain ``str``/``int`` (unhashable or mixed-type group ids)."""

    code = "E207"
    default_hint = "re-save the checkpoint with torch's DefaultSavePlanner, or remove the broken planner_data"


# --------------------------------------------------------------------------- E3xx data
class DataFileError(CkptError):
    """A data file is missing, unreadable, or shorter than the metadata says."""

    code = "E300"
    default_hint = "the checkpoint is incomplete; copy it again or use an earlier checkpoint"


class ChunkError(CkptError):
    """A stored chunk is corrupt or disagrees with its metadata (shape, dtype, bytes)."""

    code = "E301"
    default_hint = "the data file is damaged or does not belong to this .metadata"


class TransformError(CkptError):
    """A chunk uses a stream transform (compression, ...) that cannot be decoded here."""

    code = "E302"
    default_hint = "install the package the transform needs (e.g. zstandard) or re-save without it"


class AllocationError(CkptError):
    """Declared sizes are impossible or would exceed the stored bytes / memory budget."""

    code = "E303"
    default_hint = "the metadata declares sizes that the data files cannot hold; the checkpoint is damaged"


class TrustRequiredError(CkptError):
    """An object cannot be loaded with ``torch.load(weights_only=True)``."""

    code = "E304"
    default_hint = "pass --trust-pickle only if you trust where this checkpoint came from"


class StorageTupleError(ChunkError):
    """A chunk archive's ``data.pkl`` rebuilds its tensor from fields of the wrong types."""

    code = "E305"
    default_hint = "the chunk's data.pkl was not written by torch.save; the checkpoint is damaged or crafted"


class ObjectGraphError(CkptError):
    """An unpickled object exceeds the walk bounds: too many nodes counted as a tree, or nested too deeply."""

    code = "E306"
    default_hint = "the object is a pickle bomb (shared or deeply nested containers); do not load it with torch"


class SizeLimitError(CkptError):
    """A file, item or decompressed member is larger than ckpttool's cap for it (checked before reading)."""

    code = "E307"
    default_hint = (
        "raise the cap with `ckpttool --max-object-size SIZE` / `--max-metadata-size SIZE` if the input is trusted"
    )


class ChecksumError(ChunkError):
    """A stored record's bytes do not match the CRC-32 of its zip entry (bit rot, a damaged copy)."""

    code = "E308"
    default_hint = "the data file is damaged; copy it again or use an earlier checkpoint"


class JsonDepthError(CkptError):
    """A JSON file (``layout.json``, ``config.json``, a reference) nested deeper or larger than the cap."""

    code = "E309"
    default_hint = "the JSON file is not what it claims to be; fix or remove it"


# --------------------------------------------------------------------------- E4xx layout
class ManifestError(CkptError):
    """An integrity manifest (``manifest.json``) that cannot be used: not JSON, wrong format or version, malformed."""

    code = "E260"
    default_hint = "write the manifest again with `ckpttool manifest DIR` from a checkpoint known to be good"


class LayoutError(CkptError):
    """Layout record malformed, or an incomplete layout declaration."""

    code = "E400"
    default_hint = "declare the layout with --source-layout legacy|canonical --ep-size P --ep-fsdp-size F"


class LayoutFormatError(LayoutError):
    """A layout record with an unknown ``format`` or an invalid ``version``."""

    code = "E401"
    default_hint = "this record was not written by ckpttool; remove or fix it"


class LayoutVersionError(LayoutError):
    """A layout record ``version`` newer than this ckpttool supports."""

    code = "E402"
    default_hint = "upgrade ckpttool"


class LayoutConflictError(LayoutError):
    """The embedded ``layout`` item and the sidecar ``layout.json`` disagree."""

    code = "E403"
    default_hint = "remove the stale layout.json (the embedded record was written with the save)"


class LayoutContradictionError(LayoutError):
    """A layout declaration contradicts the layout record or the chunk geometry."""

    code = "E404"
    default_hint = "check the mesh sizes of the job that saved the checkpoint (`ckpttool inspect` shows the chunks)"


class AmbiguousLayoutError(LayoutError):
    """An unversioned EP tensor sharded by EP and EP-FSDP on one dim: its expert order is unknown."""

    code = "E405"
    default_hint = (
        "declare it with --source-layout legacy|canonical --ep-size P --ep-fsdp-size F "
        "(or record it once with `ckpttool stamp`)"
    )


class LayoutSizeError(LayoutError):
    """EP / EP-FSDP sizes that do not divide the expert count (or a dim) into equal blocks."""

    code = "E406"
    default_hint = "the expert count must be a multiple of ep_size * ep_fsdp_size"


# --------------------------------------------------------------------------- E5xx optimizer state
class OptimStateError(CkptError):
    """Optimizer state that does not match the optimizer configuration (on restore)."""

    code = "E500"
    default_hint = "run `ckpttool validate --strict` on the checkpoint to see every problem"


class StateFieldsError(OptimStateError):
    """A parameter's saved state lacks a field its optimizer type saves, or has an unexpected one."""

    code = "E510"


class StateDtypeError(OptimStateError):
    """A saved state field violates the dtype policy of its optimizer type."""

    code = "E511"


class StateShapeError(OptimStateError):
    """A saved state tensor's shape differs from its parameter's."""

    code = "E512"


class LostStateError(OptimStateError):
    """No state for a parameter whose param group (leaf) did step: the state was lost."""

    code = "E513"


class HyperparameterError(OptimStateError):
    """Param-group hyperparameters missing or unusable (non-numeric lr, amsgrad, no groups at all)."""

    code = "E514"


# --------------------------------------------------------------------------- E6xx outputs
class OutputError(CkptError):
    """An output target that cannot be written (exists, not writable, write failed)."""

    code = "E600"
    default_hint = "choose another output directory or pass --overwrite"


class ForeignOutputError(OutputError):
    """``--overwrite`` refused: the target is not provably a ckpttool output (no marker, or one that disagrees)."""

    code = "E606"
    default_hint = (
        "ckpttool replaces only a directory it wrote itself; choose another output directory, "
        "or remove this one yourself if it is no longer needed"
    )


class ExportError(CkptError):
    """An export that cannot be done as asked (missing masters, tied mismatch, ...)."""

    code = "E601"
    default_hint = "see `ckpttool export --help`"


class ExportNamingError(ExportError):
    """Model tensors whose names have no Hugging Face mapping (torchtitan naming needs an adapter)."""

    code = "E603"
    default_hint = "keep the DCP checkpoint, or convert the names with a model-specific adapter first"


class ExportAccountingError(ExportError):
    """A tensor that export would neither write nor list as skipped with a reason."""

    code = "E604"
    default_hint = "this is a ckpttool bug: report it with `ckpttool inspect --json` of the checkpoint"


class ModelMismatchError(ExportError):
    """Tensors that do not fit the model class built from ``config.json`` (missing, unexpected, shape, dtype)."""

    code = "E605"
    default_hint = (
        "pass the config.json of the model this checkpoint was trained as, or allow the kind with --allow-mismatch"
    )


class QuantizationError(ExportError):
    """A quantized export whose values fail the check: a non-finite block, a zero scale, an error above the bound."""

    code = "E607"
    default_hint = (
        "leave the tensor unquantized with --quantize-skip, or check the source with `ckpttool validate --deep`"
    )


class QuantizedSourceError(ExportError):
    """A quantized checkpoint read (``import``) whose scales do not fit or hold bad values (block FP8, MXFP4)."""

    code = "E612"
    default_hint = (
        "the quantized checkpoint is damaged or of another convention; check it with `ckpttool validate --deep`"
    )


class ReshardError(CkptError):
    """A reshard that cannot be done as asked."""

    code = "E602"
    default_hint = "see `ckpttool reshard --help`"


class DiffError(CkptError):
    """``diff`` cannot compare its inputs as asked (an input of no known kind, no common naming)."""

    code = "E610"
    default_hint = "see `ckpttool diff --help` and docs/diff.md"


class NothingComparedError(DiffError):
    """``diff`` compared no tensor value and found no difference: it cannot say "equal" (fail closed).

    Both sides hold no tensors of the kind asked for (a state pickled into byte items), no name
    in common, or ``--filter`` left nothing; the message says what each side holds.
    """

    code = "E611"
    default_hint = "compare what the checkpoints hold: see `ckpttool inspect` of each side and docs/diff.md"


# --------------------------------------------------------------------------- E7xx results
class ReplayMismatchError(CkptError):
    """replay-step ran and found results beyond tolerance (exit 1)."""

    code = "E700"
    exit_code = 1
    default_hint = "the saved optimizer state does not reproduce the next step; run `ckpttool validate --strict --deep`"


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
