"""Error hierarchy of ckpttool.

Every failure that a user can cause (bad invocation, unreadable or unsafe input,
a refused output) is a :class:`CkptError` subclass carrying a stable ``code``,
the offending ``path`` and/or ``fqn``, and a one-line ``hint``. The CLI renders
it as two lines on stderr (``error: [CODE] message`` / ``hint: ...``) and exits
with ``exit_code`` (DESIGN.md section 4: 2 for unusable input, 1 for a command
that ran and found problems). Programmer errors stay ordinary exceptions.

Code families (stable; documented in ``docs/errors.md``):

=======  ==========================================================
E1xx     invocation and paths (not a directory, escaping path, ...)
E2xx     ``.metadata``: missing, unreadable, unsafe pickle, bad type
E3xx     data files and chunks: missing, short, corrupt, bad transform
E4xx     layout record and EP layout declarations
E5xx     optimizer state and optimizers
E6xx     outputs (export / reshard / stamp targets)
E7xx     replay-step results
=======  ==========================================================
"""

from __future__ import annotations

from os import PathLike

__all__ = [
    "CkptError",
    "UsageError",
    "PathEscapeError",
    "MetadataError",
    "UnsafePickleError",
    "IncompleteCheckpointError",
    "DataFileError",
    "ChunkError",
    "TransformError",
    "AllocationError",
    "TrustRequiredError",
    "LayoutError",
    "OptimStateError",
    "OutputError",
    "ExportError",
    "ReshardError",
    "ReplayMismatchError",
]


class CkptError(Exception):
    """Root of all user-facing ckpttool errors.

    Args:
        message: one line saying what is wrong; names the file/key when known.
        hint: one line saying how to fix it.
        path: the file or directory concerned, if any.
        fqn: the checkpoint key concerned, if any.
        code: overrides the class default code.
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
        code: str | None = None,
    ) -> None:
        # Keep messages single-line whatever the caller passed in.
        self.message = " ".join(str(message).split())
        self.hint = " ".join(str(hint if hint is not None else self.default_hint).split())
        self.path = str(path) if path is not None else None
        self.fqn = fqn
        if code is not None:
            self.code = code
        super().__init__(self.message)

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"

    def to_dict(self) -> dict[str, object]:
        """JSON-ready view: ``code``, ``message``, ``hint``, ``path``, ``fqn``, ``exit_code``."""
        return {
            "code": self.code,
            "message": self.message,
            "hint": self.hint,
            "path": self.path,
            "fqn": self.fqn,
            "exit_code": self.exit_code,
        }


class UsageError(CkptError):
    """Bad invocation: conflicting options, a path that is not a directory, ..."""

    code = "E100"
    default_hint = "run the command with --help"


class PathEscapeError(CkptError):
    """A ``relative_path`` or symlink resolves outside the checkpoint directory."""

    code = "E101"
    default_hint = "the checkpoint references files outside its directory; do not trust it"


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


class LayoutError(CkptError):
    """Layout record invalid, conflicting, or an EP layout that must be declared."""

    code = "E400"
    default_hint = "declare the layout with --source-layout legacy|canonical --ep-size P --ep-fsdp-size F"


class OptimStateError(CkptError):
    """Optimizer state that does not match the optimizer configuration."""

    code = "E500"
    default_hint = "run `ckpttool validate --strict` on the checkpoint to see every problem"


class OutputError(CkptError):
    """An output target that cannot be written (exists, not writable, write failed)."""

    code = "E600"
    default_hint = "choose another output directory or pass --overwrite"


class ExportError(CkptError):
    """An export that cannot be done as asked (missing masters, tied mismatch, ...)."""

    code = "E601"
    default_hint = "see `ckpttool export --help`"


class ReshardError(CkptError):
    """A reshard that cannot be done as asked."""

    code = "E602"
    default_hint = "see `ckpttool reshard --help`"


class ReplayMismatchError(CkptError):
    """replay-step ran and found results beyond tolerance (exit 1)."""

    code = "E700"
    exit_code = 1
    default_hint = "the saved optimizer state does not reproduce the next step; run `ckpttool validate --strict --deep`"
