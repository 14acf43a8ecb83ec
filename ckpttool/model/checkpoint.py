"""The opened checkpoint: one reader, one catalog, one resolved layout, built once per command.

Every command opens its input with :func:`open_checkpoint` (``ckpt.located``, ``ckpt.catalog``,
``ckpt.layout``, ``ckpt.param_groups()``, ``ckpt.reader``). With ``record_problems=True``
(validate, inspect) an invalid layout record, an unreadable param-group item or ``extra_state``
file is recorded on the handle instead of raised, so it becomes a finding; an unusable
``.metadata`` is raised in both modes. ``docs/design.md`` §5, "One handle".
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeAlias, cast

from ckpttool.errors import (
    CkptError,
    MetadataError,
    NotRegularFileError,
    PathEscapeError,
    TrustRequiredError,
    UsageError,
    check_field_types,
    check_path,
)
from ckpttool.format import limits
from ckpttool.format.directory import checkpoints_below_url
from ckpttool.format.mdstorage import referenced_paths
from ckpttool.format.metadata import CheckpointMetadata, TensorMeta
from ckpttool.format.perrank import PerRankError, PerRankReader
from ckpttool.format.perrank_formats import detect_layout, layout_in_listing
from ckpttool.format.reader import CheckpointReader, load_saved_object
from ckpttool.format.storage import RemoteStore, is_url, url_path
from ckpttool.format.tiling import tiling_problem
from ckpttool.format.unpickler import gc_paused
from ckpttool.layouts.declaration import LayoutDeclaration, ResolvedLayout, resolve_layout
from ckpttool.model.beside import hf_config_beside, unpaired_optimizer, unread_beside, unread_in_listing
from ckpttool.model.catalog import Catalog, ExtraStateFile, ParamGroup, build_catalog, load_param_groups
from ckpttool.model.discovery import CheckpointSelection, Located, compose_pair, locate
from ckpttool.model.schemas.base import CommonState
from ckpttool.model.schemas.keyschema import SchemaOverride

__all__ = [
    "Checkpoint",
    "CheckpointOrPath",
    "CheckpointSelection",
    "ExtraState",
    "OpenOptions",
    "gc_held",
    "open_checkpoint",
    "check_source",
    "open_source",
]

_STEP_KEYS = ("global_step", "step", "curr_step")
log = logging.getLogger(__name__)


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
        replica_error: per-rank files whose replicated shards differ between ranks
            (``record_problems`` mode; validate's ``D014``, others raise it).
        tiling_error: per-rank files whose shards do not tile their tensors, such as a rank file
            copied over another's (``record_problems`` mode; validate's ``S004``, others raise it).
        record_problems: the mode it was opened in.
        located: which directory (or model/optimizer pair) was opened, and why.
    """

    def __init__(
        self,
        reader: CheckpointReader,
        *,
        declaration: LayoutDeclaration | None = None,
        record_problems: bool = False,
        selection: CheckpointSelection | None = None,
        located: Located | None = None,
    ) -> None:
        self.reader = reader
        self.path = reader.path
        self.declaration = declaration
        self.record_problems = record_problems
        self.located = located or Located(reader.path, reader.path)
        self.catalog: Catalog = build_catalog(reader, selection.schema if selection is not None else None)
        self.catalog.frozen = frozenset(getattr(getattr(reader, "assembled", None), "frozen", ()))
        self.byte_item_errors: dict[str, CkptError] = {}
        self.layout_error: CkptError | None = None
        self.replica_error: PerRankError | None = None
        self.tiling_error: PerRankError | None = None
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

    def output_sources(self) -> tuple[Path, ...]:
        """The directories an output written from this checkpoint may not overlap.

        The checkpoint's folder; for a model and an optimizer checkpoint given apart (``--optimizer-dir``), each of
        the two: the folder the reader reads them from is their common parent, which may hold anything (``/`` for
        two file systems), and an output beside them is none of the checkpoint's.
        """
        if is_url(os.fspath(self.reader.path)):  # a UrlPath, kept: Path() of it drops the scheme's second slash
            return (self.reader.path,)
        root = Path(self.reader.path)
        where = self.located
        if where.optimizer is None:
            return (root,)
        given = Path(where.given).resolve()
        if root.resolve() == given or given in root.resolve().parents:
            return (root,)  # a pair found in the directory given (checkpoint-N/model + optimizer): that directory
        return (Path(where.model), Path(where.optimizer))

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
            # keys and the step are all it needs: tensors (RNG states) are described, not loaded (no torch import)
            data = self.reader.read_file(f.relative_path, limits.current().max_object_bytes, what="extra_state file")
            obj = load_saved_object(data, str(p), trust_pickle=self.reader.trust_pickle, tensors="describe")
        except (CkptError, TrustRequiredError) as e:
            return ExtraState(f, error=e)
        if not isinstance(obj, dict):
            return ExtraState(f)
        step = next((obj[k] for k in _STEP_KEYS if type(obj.get(k)) is int), None)
        return ExtraState(f, tuple(sorted(map(str, obj))), step)

    @property
    def common_state_file(self) -> str | None:
        """The file its key schema reads the trainer's common state from (``common.pt``), ``None``: none."""
        spec = self.catalog.schema.spec
        return None if spec is None or spec.read_common_state is None else spec.common_state_file

    def common_state(self) -> CommonState | None:
        """The trainer's common state beside the opened checkpoint folder (:meth:`Catalog.common_state`), read once.

        Raises:
            CkptError: the file is unreadable, needs ``--trust-pickle``, or is over the caps.
        """
        return self.catalog.common_state(self.located.model)

    def unread_beside(self) -> tuple[str, ...]:
        """Training state saved beside this checkpoint that ckpttool does not read (its own data files
        excluded; :func:`ckpttool.model.beside.unread_beside`), relative to the directory given."""
        remote = getattr(self.reader, "remote", None)
        if remote is not None:  # an object-store prefix: its one listing, not a directory scan
            return unread_in_listing(list(remote.sizes()), self._files_read())
        model, given = Path(self.located.model), Path(self.located.given)
        # the optimizer folder of a model folder opened alone (NeMo's optim/ beside model/): not read with it
        opt = unpaired_optimizer(model, given) if self.located.optimizer is None else None
        paired = (opt,) if opt is not None else ()
        if not unread_beside(model, given):  # the usual case: no candidate, the storage's paths not listed
            return paired
        return (*unread_beside(model, given, [Path(self.path) / rel for rel in self._files_read()]), *paired)

    def _files_read(self) -> set[str]:
        """The files of this checkpoint's folder it reads, relative to it: the data files, a per-rank save's rank
        files (replicas too) and its metadata, and the files its key schema reads (``SchemaSpec.files_read``, its
        ``common_state_file``)."""
        from ckpttool.model.schemas import registry

        read = set(referenced_paths(self.metadata.storage))
        assembled = getattr(self.reader, "assembled", None)
        if assembled is not None:
            from ckpttool.format.perrank_formats import TC_METADATA

            read.update((*assembled.files, TC_METADATA))
        spec = registry.find(self.catalog.schema.id)
        if spec is not None:  # a schema given by its prefixes alone reads no files of its own
            read.update(spec.files_read)
            if spec.common_state_file is not None:
                read.add(spec.common_state_file)
        return read

    @property
    def local_folder(self) -> Path | None:
        """The checkpoint's folder on this machine (the model folder of a pair); ``None`` for a URL, whose
        neighbours are not fetched (``Path("s3://b/ck")`` would name the local folder ``s3:/b/ck``)."""
        return None if is_url(str(self.located.model)) else Path(self.located.model)

    def hf_config_beside(self) -> Path | None:
        """The folder of the model's ``config.json`` the trainer saved beside this checkpoint (NeMo
        Automodel's ``consolidated/``, verl's ``huggingface/``; :func:`ckpttool.model.beside.hf_config_beside`),
        ``None`` for none or a URL.

        Raises:
            PathEscapeError: (E101) that ``config.json``, or its folder, is a symlink out of the checkpoint's folder.
        """
        folder = self.local_folder
        return None if folder is None else hf_config_beside(folder)

    def unproven_shards(self) -> str | None:
        """Why this checkpoint cannot be known complete, where it is a ``HuggingFaceStorageWriter(save_distributed=True)``
        folder whose shapes no consolidated copy proved (:class:`~ckpttool.format.metadata.RankShards`): one line naming
        the folder, the ranks present and what to pass; ``None`` otherwise (a ``.metadata`` records every global shape).
        A config checked against the model class proves it too: validate's rule ``S017`` asks that itself."""
        shards = getattr(self.metadata, "shards", None)
        if shards is None or shards.verified_by is not None:
            return None
        n = len(shards.ranks)
        gaps = "".join(
            f"; rank {r} wrote no model-{i:05d} file while other ranks did" for r, i in shards.index_gaps[:3]
        )
        unread = None
        try:
            beside = self.hf_config_beside()
            if beside is not None:
                from ckpttool.model.hfconfig import read_hf_config

                read_hf_config(beside, param=None)  # validate and export check only a config they can read
        except CkptError as e:  # a config.json linked out of the folder, a FIFO, malformed, too large
            beside, unread = None, e.message
        fix = (
            f"check them against the model class of {beside / 'config.json'} (`ckpttool validate` and `export` do)"
            if beside is not None
            else f"the config.json beside them was not read, so it proves nothing ({unread}): restore it, or pass the "
            "model's config.json (--config / --model-assets) or use torch's consolidated copy "
            "(enable_consolidation=True) to prove them"
            if unread is not None
            else "pass the model's config.json (--config / --model-assets, or keep it beside the shards) or use "
            "torch's consolidated copy (enable_consolidation=True) to prove them"
        )
        return (
            f"{self.located.model}: the shard files of {n} writing rank(s) (HuggingFaceStorageWriter "
            "save_distributed) record neither the world size nor the full shapes: the shapes are those of the pieces "
            f"present, so a last rank's files missing would not show{gaps}; {fix}"
        )

    def own_hf_config(self) -> dict[str, Any] | None:
        """The ``config.json`` in the checkpoint's own folder (a Hugging Face safetensors folder's, with its
        ``quantization_config``), read capped; ``None`` when there is none, or for a URL.

        Raises:
            UsageError, NotRegularFileError, SizeLimitError, PathEscapeError: as
            :func:`~ckpttool.model.hfconfig.read_hf_config`.
        """
        where = self.local_folder
        if where is None or not os.path.lexists(where / "config.json"):  # unreadable: refused by the read
            return None
        from ckpttool.model.hfconfig import read_hf_config

        return read_hf_config(where, param=None)  # the directory: a config.json symlinked out of it is E101

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called: an operation given it, or a read of a data file, is ``UsageError``."""
        return bool(getattr(self.reader, "closed", False))

    def close(self) -> None:
        """Close the data files. Idempotent; reading them afterwards is ``UsageError`` (E100). A handle dropped
        unclosed closes them (and deletes a remote checkpoint's spool) when it is collected."""
        self.reader.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _locate(path: str | os.PathLike[str], selection: CheckpointSelection | None) -> Located:
    """:func:`locate`, or a remote URL opened at its own prefix (no step discovery or pairs remotely)."""
    if not is_url(path):
        return locate(path, selection)
    sel = selection or CheckpointSelection()
    if sel.step is not None or sel.optimizer_dir is not None:
        # a run root's steps are named (one listing), so that `--step latest` on one says which prefix to pass
        param = "step" if sel.step is not None else "optimizer_dir"
        below = checkpoints_below_url(path) if param == "step" else None
        raise UsageError(
            f"{path}: `{param}` is not supported for a URL (step discovery and model/optimizer pairs are for "
            "local directories)",
            param=param,
            hint=below or "pass the URL of the checkpoint prefix itself (the one holding .metadata)",
        )
    p = url_path(path)
    return Located(cast(Path, p), cast(Path, p), None)


def open_checkpoint(
    path: str | os.PathLike[str],
    *,
    declaration: LayoutDeclaration | None = None,
    trust_pickle: bool = False,
    record_problems: bool = False,
    selection: CheckpointSelection | None = None,
) -> Checkpoint:
    """Open a DCP checkpoint directory: ``.metadata``, catalog and layout, each built once.

    ``path`` may also be a training run's checkpoint root, a step directory, or the parent of a
    model folder and its optimizer folder (:func:`~ckpttool.model.discovery.locate`); a pair (or
    ``selection.optimizer_dir``) opens as one checkpoint over both folders.

    Args:
        path: the checkpoint directory (or a directory above it).
        selection: ``step``, a separate ``optimizer`` directory, a key-schema override.
        declaration: an EP layout declared by the user (:meth:`LayoutDeclaration.from_options`).
        trust_pickle: allow ``torch.load(weights_only=False)`` for byte items, ``extra_state`` files and the
            trainer's common state (Megatron's ``common.pt``) that need it (runs code from the checkpoint).
        record_problems: record layout and byte-item problems on the handle instead of raising.

    Returns:
        The open :class:`Checkpoint`.

    Raises:
        UsageError: ``path`` is not a directory.
        MetadataError, UnsafePickleError, IncompleteCheckpointError: ``.metadata`` unusable.
        AmbiguousCheckpointError, StepNotFoundError: several checkpoints below ``path``, or no
            checkpoint of ``selection.step``.
        SchemaError: a schema override that matches nothing; a pair that cannot be composed.
        LayoutError: invalid or conflicting layout record, a contradicting declaration
            (not with ``record_problems``).
    """
    check_path(path, "path")
    with gc_paused():  # ~10 objects per metadata entry, all acyclic: the cyclic GC would rescan them
        t0 = time.perf_counter()
        where = _locate(path, selection)
        perrank = (
            None
            if is_url(path) or where.optimizer is not None
            else _open_perrank(where, trust_pickle, selection, record_problems)
        )
        problems: tuple[PerRankError | None, PerRankError | None] = (None, None)
        if perrank is not None:
            reader, selection, where, problems = perrank
        elif where.optimizer is None:
            reader = _open_reader(where.model, trust_pickle, remote=is_url(path))
        else:
            with CheckpointReader(where.model) as m, CheckpointReader(where.optimizer) as o:
                root, md, parts = compose_pair(where.model, m.metadata, where.optimizer, o.metadata)
            reader = CheckpointReader(root, trust_pickle=trust_pickle, metadata=md, parts=parts)
        t1 = time.perf_counter()
        try:
            ckpt = Checkpoint(
                reader, declaration=declaration, record_problems=record_problems, selection=selection, located=where
            )
            ckpt.replica_error, ckpt.tiling_error = problems
        except BaseException:
            reader.close()
            raise
    if log.isEnabledFor(logging.INFO):
        _log_opened(ckpt, t1 - t0, time.perf_counter() - t1)
    return ckpt


def _open_reader(model: Path, trust_pickle: bool, *, remote: bool) -> CheckpointReader:
    """A DCP reader of ``model``; below a URL without ``.metadata``, a per-rank checkpoint there is named.

    Raises:
        PerRankError (E280): a URL prefix holding a per-rank checkpoint (read from a local directory only).
        MetadataError and the rest: as :class:`CheckpointReader`.
    """
    try:
        return CheckpointReader(model, trust_pickle=trust_pickle)
    except MetadataError:
        if remote:
            _refuse_remote_perrank(model)
        raise


def _refuse_remote_perrank(url: Path) -> None:
    """Raise :class:`PerRankError` naming the per-rank format a folder below ``url`` holds (one listing)."""
    found = layout_in_listing(list(RemoteStore(url).sizes()))
    if found is None:
        return
    folder, lay, files = found
    where = f"{url}/{folder}" if folder else str(url)
    shown = ", ".join(f.relative_path for f in files[:3]) + (" ..." if len(files) > 3 else "")
    raise PerRankError(
        f"{where}: a {lay.name} per-rank checkpoint ({shown}); per-rank formats are read from a local "
        "directory only, not from a URL",
        path=where,
        hint=f"copy the prefix to a local directory (e.g. `aws s3 cp --recursive {where} DIR`) and pass DIR",
    ) from None


def _open_perrank(
    where: Located, trust_pickle: bool, selection: CheckpointSelection | None, record_problems: bool = False
) -> tuple[CheckpointReader, CheckpointSelection, Located, tuple[PerRankError | None, PerRankError | None]] | None:
    """A per-rank checkpoint (verl FSDP, torch-checkpointing: :mod:`ckpttool.format.perrank`) assembled
    into a reader, read with its format's key schema, and the errors ``(replicated shards that differ
    between ranks, shards that do not tile their tensors)`` when ``record_problems`` (else raised);
    ``None`` when ``where`` is not one.

    Raises:
        PerRankError: the rank files do not fit together, replicated shards differ between ranks, or
            the shards leave a gap in (or overlap within) a tensor (the last two not with ``record_problems``).
        IncompleteCheckpointError, UnsafePickleError, DataFileError: as the format reads its files.
    """
    found = detect_layout(where.model)
    if found is None:
        return None
    layout, files = found
    assembled = layout.assemble(where.model, files)
    reader = PerRankReader(where.model, assembled, trust_pickle=trust_pickle)
    try:
        bad = reader.check_replicas()
    except BaseException:
        reader.close()
        raise
    replica_error = None
    if bad:
        replica_error = PerRankError(
            f"{where.model}: replicated shards differ between ranks: {bad[0]}"
            + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""),
            path=where.model,
            hint="a replicated value must be equal on every rank; the save is inconsistent or a file was damaged",
        )
        if not record_problems:
            reader.close()
            raise replica_error
    tiling_error = _perrank_tiling(where.model, reader)
    if tiling_error is not None and not record_problems:
        reader.close()
        raise tiling_error
    sel = selection or CheckpointSelection()
    if sel.schema is None:
        sel = replace(sel, schema=SchemaOverride(schema=layout.schema, by=f"{layout.name} per-rank files"))
    read = f"{layout.name} per-rank files: " + "; ".join(assembled.notes)
    return reader, sel, replace(where, format_note=read), (replica_error, tiling_error)


def _perrank_tiling(model: Path, reader: PerRankReader) -> PerRankError | None:
    """The error of per-rank shards that do not tile their tensors (``None``: every tensor is covered once).

    Each rank file's DTensor names its own mesh coordinate; a rank file copied over another's (or
    renamed) repeats a coordinate, so one shard is held twice and another by no file.
    """
    bad = {
        key: problem
        for key, meta in reader.metadata.entries.items()
        if isinstance(meta, TensorMeta) and (problem := tiling_problem(meta)) is not None
    }
    if not bad:
        return None
    first = next(iter(bad))
    held_twice = sorted(
        {f"{a.relative_path} and {b.relative_path}" for key, _, a, b in reader.assembled.replicas if key in bad}
    )
    return PerRankError(
        f"{model}: the rank files' shards do not tile {len(bad)} tensor(s): {first}: {bad[first]}"
        + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
        + (f"; {held_twice[0]} hold the same shards" if held_twice else ""),
        path=model,
        fqn=first,
        hint="each rank's file must hold its own shard: a rank file was copied over another's, renamed, or "
        "comes from another save; restore the files of one save",
    )


def _log_opened(ckpt: Checkpoint, read_s: float, model_s: float) -> None:
    """What was read and decided when opening (``-v``): sizes, key schema, layout."""
    cat = ckpt.catalog
    log.info(
        "%s: .metadata read and checked in %.3f s (%d entries, %d data file(s)); catalog and layout in %.3f s",
        ckpt.path,
        read_s,
        len(ckpt.metadata.entries),
        len(cat.data_files),
        model_s,
    )
    log.info(
        "key schema %s (%s): %d model keys, optimizer state for %d params, %d param groups (%s flavor), "
        "%d byte items, %d other tensors",
        cat.schema.id,
        cat.schema.source,
        len(cat.model),
        len(cat.optimizer_state),
        len(cat.param_groups),
        cat.optimizer_flavor or "no",
        len(cat.byte_items),
        len(cat.other_tensors),
    )
    lay = ckpt.layout
    if lay is not None:
        sizes = ", ".join(f"{n} {v}" for n, v in (("ep_size", lay.ep_size), ("ep_fsdp_size", lay.ep_fsdp_size)) if v)
        log.info(
            "EP layout: %s from %s (%s), %d EP tensors%s",
            lay.layout_name or "unversioned",
            lay.source,
            sizes or "EP sizes not set",
            len(lay.ep_tensors),
            f", {len(lay.ambiguous)} ambiguous" if lay.ambiguous else "",
        )
    elif ckpt.layout_error is not None:
        log.info("EP layout not resolved: [%s] %s", ckpt.layout_error.code, ckpt.layout_error.message)


@dataclass(frozen=True)
class OpenOptions:
    """How an operation opens its source when given a path or URL (:func:`open_checkpoint`'s parameters).

    Attributes:
        declaration: an EP layout declared by the user (:meth:`LayoutDeclaration.from_options`).
        trust_pickle: allow ``torch.load(weights_only=False)`` for byte items, ``extra_state`` files and the
            trainer's common state (Megatron's ``common.pt``).
        selection: a step of a checkpoint root, a separate optimizer directory, a key-schema override.
    """

    declaration: LayoutDeclaration | None = None
    trust_pickle: bool = False
    selection: CheckpointSelection | None = None


#: What every operation takes as its source: an opened :class:`Checkpoint`, or its path or URL
#: (opened with the operation's :class:`OpenOptions` by :func:`open_source`).
CheckpointOrPath: TypeAlias = "Checkpoint | str | os.PathLike[str]"


def check_source(source: object, opening: object) -> OpenOptions:
    """The :class:`OpenOptions` an operation opens ``source`` with (``OpenOptions()`` for ``None``).

    Raises:
        UsageError (E100): ``source`` is no :class:`Checkpoint`, path or URL; ``opening`` is no
            :class:`OpenOptions` (or ``trust_pickle`` in it is no bool); ``source`` is a closed :class:`Checkpoint`; or ``opening`` other than
            the default ``OpenOptions()`` is given with an already opened checkpoint (its
            declaration, ``trust_pickle`` and selection were fixed when it was opened).
    """
    if not isinstance(source, (Checkpoint, str, os.PathLike)):
        raise UsageError(
            f"`source` must be an opened Checkpoint, a path or a URL, got {type(source).__name__} {source!r:.80}",
            param="source",
            hint="pass the checkpoint directory, or what ckpttool.open_checkpoint returned",
        )
    if opening is not None and not isinstance(opening, OpenOptions):
        raise UsageError(
            f"`opening` must be an OpenOptions, got {type(opening).__name__} {opening!r:.80}",
            param="opening",
            hint="pass ckpttool.OpenOptions(declaration=..., trust_pickle=..., selection=...)",
        )
    if opening is not None:
        opening = check_field_types(opening)
    if isinstance(source, Checkpoint) and source.closed:
        raise UsageError(
            f"{source.path}: the checkpoint was closed",
            path=source.path,
            param="source",
            hint="run the operation inside its `with ckpttool.open_checkpoint(...)` block, or pass the path",
        )
    if isinstance(source, Checkpoint) and opening is not None and opening != OpenOptions():
        raise UsageError(
            f"{source.path}: declaration/trust_pickle/selection apply when opening a path; this Checkpoint is "
            "open already",
            param="opening",
            hint="drop `opening`, or pass them to ckpttool.open_checkpoint",
        )
    return opening or OpenOptions()


@contextmanager
def open_source(
    source: CheckpointOrPath,
    opening: OpenOptions | None = None,
    *,
    record_problems: bool = False,
) -> Iterator[Checkpoint]:
    """``source`` itself when it is an opened :class:`Checkpoint`, else the path opened with ``opening``
    (and closed after). How every operation accepts either: ``with open_source(src, opening) as ckpt: ...``.

    Raises:
        UsageError (E100): see :func:`check_source`.
        plus those of :func:`open_checkpoint`.
    """
    o = check_source(source, opening)
    if isinstance(source, Checkpoint):
        yield source
        return
    with open_checkpoint(
        source,
        declaration=o.declaration,
        trust_pickle=o.trust_pickle,
        record_problems=record_problems,
        selection=o.selection,
    ) as ckpt:
        yield ckpt


#: Whether the collector was enabled when the outermost :func:`gc_held` began (one entry per open hold).
_held_was: list[bool] = []


@contextmanager
def gc_held() -> Iterator[Callable[[], None]]:
    """Keep the open's and the operation's objects out of the cyclic GC while an operation runs.

    The one GC policy of the operations (the open itself pauses it too): the collector is paused
    for the body. The body may call the yielded ``resume()`` before a long phase that allocates
    (export's writes): everything alive is then frozen (``gc.freeze``, acyclic and long-lived:
    no collection rescans it) and the collector resumes. At exit the collector is restored and
    what was frozen here unfrozen; a caller's own earlier freeze is left to it. Nested holds
    resume as the outermost one would; the outermost restores (a command's hold around an operation's).
    """
    was = _held_was[0] if _held_was else gc.isenabled()
    _held_was.append(was)
    gc.disable()
    froze = False

    def resume() -> None:
        nonlocal froze
        froze = froze or gc.get_freeze_count() == 0
        gc.freeze()
        if was:
            gc.enable()

    try:
        yield resume
    finally:
        _held_was.pop()
        if froze:
            gc.unfreeze()
        if was and not _held_was:
            gc.enable()
