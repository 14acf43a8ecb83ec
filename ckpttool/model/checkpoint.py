"""The opened checkpoint: one reader, one catalog, one resolved layout, built once per command.

Every command opens its input with :func:`open_checkpoint`::

    with open_checkpoint("ckpt/", declaration=decl) as ckpt:
        ckpt.catalog.model              # metadata only
        ckpt.layout.ep_tensors          # record, sidecar or declaration
        ckpt.param_groups()             # reads the small param-group byte items once
        ckpt.reader.read_tensor(key)    # tensor data (imports torch)

With ``record_problems=True`` (``validate``) problems met while gathering the facts (an
invalid layout record, an unreadable param-group item or ``extra_state`` file) are
recorded on the handle instead of raised, so that they become findings; an unusable
``.metadata`` is raised in both modes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ckpttool.errors import CkptError, NotRegularFileError, PathEscapeError, TrustRequiredError
from ckpttool.format import limits
from ckpttool.format.metadata import CheckpointMetadata
from ckpttool.format.reader import CheckpointReader, load_saved_object
from ckpttool.format.unpickler import gc_paused
from ckpttool.model.catalog import Catalog, ExtraStateFile, ParamGroup, build_catalog, load_param_groups
from ckpttool.model.declaration import LayoutDeclaration, ResolvedLayout, resolve_layout

__all__ = ["Checkpoint", "ExtraState", "open_checkpoint", "opened"]

_STEP_KEYS = ("global_step", "step", "curr_step")


@dataclass(frozen=True)
class ExtraState:
    """One ``extra_state/*.pt`` file, loaded with ``torch.load(weights_only=True)`` semantics.

    Attributes:
        file: the catalog entry (path relative to the checkpoint, size, rank).
        keys: top-level keys of the saved dict (empty when it is not a dict or unreadable).
        global_step: the saved ``global_step``/``step``/``curr_step``, if an int.
        error: why it could not be loaded (``TrustRequiredError``: needs ``trust_pickle``).
    """

    file: ExtraStateFile
    keys: tuple[str, ...] = ()
    global_step: int | None = None
    error: CkptError | None = None


class Checkpoint:
    """An opened DCP checkpoint (see the module docstring); close it, or use it as a context manager.

    Attributes:
        path: the checkpoint directory as given.
        reader: the format-layer reader (descriptors, chunks, byte items).
        catalog: the typed view of ``.metadata``.
        declaration: the layout declaration it was opened with, if any.
        layout: the resolved EP layout (``None`` only when ``layout_error`` was recorded).
        layout_error: why the layout could not be resolved (``record_problems`` mode).
        byte_item_errors: byte-item key -> error met while reading it (``record_problems`` mode).
        record_problems: the mode it was opened in.
    """

    def __init__(
        self,
        reader: CheckpointReader,
        *,
        declaration: LayoutDeclaration | None = None,
        record_problems: bool = False,
    ) -> None:
        self.reader = reader
        self.path = reader.path
        self.declaration = declaration
        self.record_problems = record_problems
        self.catalog: Catalog = build_catalog(reader)
        self.byte_item_errors: dict[str, CkptError] = {}
        self.layout_error: CkptError | None = None
        self.layout: ResolvedLayout | None = None
        self._groups_loaded = False
        self._extra_state: list[ExtraState] | None = None
        try:
            self.layout = resolve_layout(self.catalog, reader, declaration)
        except CkptError as e:
            # A record that would be read from outside the checkpoint, or from a device, is refused, never recorded.
            if not record_problems or isinstance(e, (PathEscapeError, NotRegularFileError)):
                raise
            self.layout_error = e

    @property
    def metadata(self) -> CheckpointMetadata:
        """The validated ``.metadata``."""
        return self.reader.metadata

    def require_layout(self) -> ResolvedLayout:
        """The resolved layout.

        Raises:
            CkptError: the error recorded while resolving it (``record_problems`` mode).
        """
        if self.layout is None:
            assert self.layout_error is not None
            raise self.layout_error
        return self.layout

    def param_groups(self) -> list[ParamGroup]:
        """The catalog's param groups with their hyperparameter values loaded (read once).

        Raises:
            CkptError: a param-group byte item cannot be read safely (unless ``record_problems``).
        """
        if not self._groups_loaded:
            load_param_groups(self.catalog, self.reader, self.byte_item_errors if self.record_problems else None)
            self._groups_loaded = True
        return self.catalog.param_groups

    def extra_state(self) -> list[ExtraState]:
        """Every ``extra_state/*.pt`` file, loaded once (never raises: errors are recorded per file)."""
        if self._extra_state is None:
            self._extra_state = [self._load_extra(f) for f in self.catalog.extra_state]
        return self._extra_state

    def _load_extra(self, f: ExtraStateFile) -> ExtraState:
        p = self.path / f.relative_path
        try:
            data = self.reader.read_file(f.relative_path, limits.current().max_object_bytes, what="extra_state file")
            obj = load_saved_object(data, str(p), trust_pickle=self.reader.trust_pickle)
        except (CkptError, TrustRequiredError) as e:
            return ExtraState(f, error=e)
        if not isinstance(obj, dict):
            return ExtraState(f)
        step = next((obj[k] for k in _STEP_KEYS if type(obj.get(k)) is int), None)
        return ExtraState(f, tuple(sorted(map(str, obj))), step)

    def close(self) -> None:
        """Close the data files. Idempotent."""
        self.reader.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_checkpoint(
    path: str | os.PathLike[str],
    *,
    declaration: LayoutDeclaration | None = None,
    trust_pickle: bool = False,
    record_problems: bool = False,
) -> Checkpoint:
    """Open a DCP checkpoint directory: ``.metadata``, catalog and layout, each built once.

    Args:
        path: the checkpoint directory.
        declaration: an EP layout declared by the user (:meth:`LayoutDeclaration.from_options`).
        trust_pickle: allow ``torch.load(weights_only=False)`` for byte items and ``extra_state``
            files that need it (runs code from the checkpoint).
        record_problems: record layout and byte-item problems on the handle instead of raising.

    Returns:
        The open :class:`Checkpoint`.

    Raises:
        UsageError: ``path`` is not a directory.
        MetadataError, UnsafePickleError, IncompleteCheckpointError: ``.metadata`` unusable.
        LayoutError: invalid or conflicting layout record, a contradicting declaration
            (not with ``record_problems``).
    """
    with gc_paused():  # ~10 objects per metadata entry, all acyclic: the cyclic GC would rescan them
        reader = CheckpointReader(Path(path), trust_pickle=trust_pickle)
        try:
            return Checkpoint(reader, declaration=declaration, record_problems=record_problems)
        except BaseException:
            reader.close()
            raise


@contextmanager
def opened(
    source: Checkpoint | str | os.PathLike[str],
    *,
    declaration: LayoutDeclaration | None = None,
    trust_pickle: bool = False,
    record_problems: bool = False,
) -> Iterator[Checkpoint]:
    """``source`` itself when it is an opened :class:`Checkpoint`, else the directory opened (and closed after).

    How every operation accepts either: ``with opened(src, declaration=decl) as ckpt: ...``.

    Raises:
        ValueError: open options given with an already opened checkpoint (they were fixed when it was opened).
        plus those of :func:`open_checkpoint`.
    """
    if isinstance(source, Checkpoint):
        if declaration is not None or trust_pickle:
            raise ValueError("declaration/trust_pickle apply when opening a path; this Checkpoint is open already")
        yield source
        return
    with open_checkpoint(
        source, declaration=declaration, trust_pickle=trust_pickle, record_problems=record_problems
    ) as ckpt:
        yield ckpt
