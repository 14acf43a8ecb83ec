"""Finding the checkpoint a user means: checkpoint roots, step directories, model/optimizer pairs.

:func:`locate` turns ``DIR`` into the checkpoint to open: itself when it holds ``.metadata`` (or
``HuggingFaceStorageWriter`` safetensors files), else the DCP checkpoints below it (at most
:data:`MAX_DEPTH` levels, symlinked directories not followed unless named as a step directory): the only one, a model folder
paired with its optimizer folder, or the one of ``step`` (``N`` or ``latest``); several and no
``step`` is an error listing them. The trainers' layouts come from the key schemas' discovery
patterns. :func:`compose_pair` merges a model and an optimizer checkpoint into one metadata over
their common parent, each path confined to its part. Torch-free. ``docs/design.md`` §2;
``docs/inspect.md``.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from ckpttool.errors import (
    AmbiguousCheckpointError,
    IncompleteCheckpointError,
    MetadataError,
    NotRegularFileError,
    PathEscapeError,
    SchemaError,
    StepNotFoundError,
    UsageError,
    shell_arg,
)
from ckpttool.format.directory import DATA_FILE_RE, METADATA_NAME, data_file_ranks
from ckpttool.format.files import (
    file_kind,
    hub_blobs,
    hub_hint,
    hub_main_not_in_cache,
    hub_snapshot,
    hub_unfinished_download,
    open_regular,
    resolve_inside,
)
from ckpttool.format.hf_storage import hf_storage_files
from ckpttool.format.metadata import CheckpointMetadata, StorageInfo
from ckpttool.format.perrank_formats import detect_layout, staging_of, unfinished_layout
from ckpttool.format.rank_local import rank_metadata_names, ranks_without_metadata
from ckpttool.model.schemas import registry
from ckpttool.model.schemas.base import SchemaSpec
from ckpttool.model.schemas.keyschema import SchemaOverride

__all__ = [
    "EPOCH_DIR",
    "MAX_DEPTH",
    "NEWER_INCOMPLETE",
    "CheckpointSelection",
    "IncompleteStep",
    "Located",
    "compose_pair",
    "find_checkpoints",
    "find_incomplete",
    "is_checkpoint_dir",
    "locate",
    "named_step",
    "step_given_hint",
    "step_of",
    "unfinished_save_hint",
    "unpublished",
]

#: How deep below ``DIR`` checkpoints are searched (``DIR/run/step-3/model`` is depth 3).
MAX_DEPTH = 3
_MAX_DIRS = 10_000
#: The most digits of a ``--step`` (a folder name holds 255 bytes; ``int()`` reads at most 4,300 digits).
_MAX_STEP_DIGITS = 255


@dataclass(frozen=True)
class CheckpointSelection:
    """What to open besides the directory: a step, a separate optimizer checkpoint, a key schema.

    Attributes:
        step: ``None``, a step number, or ``"latest"`` (a ``latest`` file, else the highest step).
        optimizer_dir: a separate optimizer checkpoint directory (paired with the model checkpoint).
        schema: a key-schema override (:class:`~ckpttool.model.schemas.keyschema.SchemaOverride`).
    """

    step: int | str | None = None
    optimizer_dir: Path | None = None
    schema: SchemaOverride | None = None

    @classmethod
    def from_options(
        cls,
        step: str | int | None = None,
        optimizer_dir: str | os.PathLike[str] | None = None,
        schema: SchemaOverride | None = None,
    ) -> CheckpointSelection | None:
        """From ``--step/--optimizer-dir`` (and a schema override); ``None`` when nothing is given.

        Raises:
            UsageError: ``step`` is neither a non-negative integer nor ``latest``.
        """
        if step is None and optimizer_dir is None and schema is None:
            return None
        if isinstance(step, str):
            text = step.strip().lower()
            if text == "latest":
                step = "latest"
            elif text.isdecimal() and len(text) <= _MAX_STEP_DIGITS:  # what int() reads (not a superscript '²')
                step = int(text)
            else:
                raise UsageError(
                    f"`step` {step!r} is not a step number or 'latest'"
                    if len(step) <= 80
                    else f"`step` {step[:40]!r}... ({len(step):,} characters) is not a step number or 'latest'",
                    param="step",
                    hint=_bad_step_hint(text),
                )
        return cls(step, Path(optimizer_dir) if optimizer_dir is not None else None, schema)


def _bad_step_hint(text: str) -> str:
    """The hint for ``--step`` ``text`` (lower-cased) that is neither a number nor ``latest``: a step directory's name
    (``step-200``, letters before its number) hints its number, never a number in another notation (``1e3`` is no
    step 3); ``-1`` (torchtitan's ``load_step`` for its newest step) hints ``latest``, never step 1; anything else
    (``10.0``) an example."""
    digits = re.search(rf"(?<!\d)(\d{{1,{_MAX_STEP_DIGITS}}})$", text)  # a step directory's name (step-200)
    # letters before the number name a step directory; a number in another notation (1e3, 0x10) begins with a digit
    if digits and not text[:1].isdigit() and re.search(r"[^\W\d]", text[: digits.start()]):
        return f"give the step's number, `step` {int(digits.group(1))}, or pass that directory itself"
    if re.fullmatch(r"-\d+", text):
        return (
            "a step number is 0 or more (torchtitan's load_step -1 means its newest step): `step` latest for the "
            "newest complete step, or e.g. `step` 200"
        )
    return "e.g. `step` 200, or `step` latest for the newest complete step"


#: How :meth:`Located.newer_incomplete_note` begins (a run root's newer step whose save did not finish).
NEWER_INCOMPLETE = "a newer step's save did not finish"


@dataclass(frozen=True)
class IncompleteStep:
    """A step directory below a run root whose save did not finish.

    Attributes:
        step: its step number; path: the directory with the unfinished save.
        reason: what is there (``"3 data file(s), no .metadata"``, ``".metadata.tmp, no .metadata"``).
    """

    step: int
    path: Path
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "path": str(self.path), "reason": self.reason}


@dataclass(frozen=True)
class Located:
    """The checkpoint :func:`locate` chose.

    Attributes:
        given: the directory the user passed.
        model: the checkpoint directory (the model folder of a pair).
        optimizer: the optimizer folder of a pair, or ``None``.
        step: the step of a step directory, if known.
        how: one line saying how it was chosen.
        format_note: what the format's reader found there (per-rank files: their ranks, mesh, items read);
            :attr:`described` (shown by ``inspect``) is ``how`` and this.
        newer_incomplete: step directories newer than the chosen step whose save did not finish
            (data files or ``.metadata.tmp`` without ``.metadata``), newest first; validate's
            ``R001`` reports them.
    """

    given: Path
    model: Path
    optimizer: Path | None = None
    step: int | None = None
    how: str = "the directory given"
    newer_incomplete: tuple[IncompleteStep, ...] = ()
    format_note: str = ""

    @property
    def described(self) -> str:
        """How it was chosen and what its format's reader found there (``inspect``'s ``opened`` line)."""
        return f"{self.how}; {self.format_note}" if self.format_note else self.how

    def to_dict(self) -> dict[str, Any]:
        """JSON view (``inspect --json`` ``location``)."""
        return {
            "given": str(self.given),
            "model": str(self.model),
            "optimizer": str(self.optimizer) if self.optimizer is not None else None,
            "step": self.step,
            "how": self.described,
            "newer_incomplete": [i.to_dict() for i in self.newer_incomplete],
        }

    def newer_incomplete_note(self, done: str) -> str | None:
        """validate's ``R001`` in one line for a command that read the chosen step (``done``: ``exported``,
        ``measured``, ...): the newest step above it whose save did not finish; ``None`` when there is none."""
        if not self.newer_incomplete:
            return None
        inc = self.newer_incomplete[0]
        # a checkpoint in no step directory (run/final/, Megatron's release/) is named by its folder, as R001 does
        chosen = f"step {self.step}" if self.step is not None else f"checkpoint {self.model} (in no step directory)"
        return (
            f"{NEWER_INCOMPLETE}: step {inc.step} ({inc.path}: {inc.reason}) is newer than the {done} {chosen}; "
            "`ckpttool validate` reports it (R001)"
        )

    def chosen_note(self) -> str | None:
        """The checkpoint folder chosen below the directory given and how (``--step latest: step 2 (...)``), for
        the commands that do not name it otherwise; ``None`` when the directory given is the checkpoint."""
        if self.model == self.given:
            return None
        return f"source {self.model} ({self.how})"


#: Within one :func:`locate` (:func:`_one_look`): what :func:`is_checkpoint_dir` and :func:`_unfinished_checkpoint`
#: said of each directory, so that the walks for the checkpoints and for the unfinished saves look at each step
#: directory once (and both see the same answer).
_LOOKED: ContextVar[dict[tuple[str, Path], Any] | None] = ContextVar("_LOOKED", default=None)


@contextmanager
def _one_look() -> Iterator[None]:
    """:data:`_LOOKED` for the calls inside (nested: the outer one's)."""
    if _LOOKED.get() is not None:
        yield
        return
    token = _LOOKED.set({})
    try:
        yield
    finally:
        _LOOKED.reset(token)


def _looked(what: str, path: Path, look: Callable[[Path], Any]) -> Any:
    """``look(path)``, once per ``(what, path)`` within :func:`_one_look`."""
    seen = _LOOKED.get()
    if seen is None:
        return look(path)
    key = (what, path)
    if key not in seen:
        seen[key] = look(path)
    return seen[key]


def is_checkpoint_dir(path: Path) -> bool:
    """``path`` holds ``.metadata`` (or rank-local ``__0.metadata``), the safetensors files of a
    ``HuggingFaceStorageWriter`` save, or the rank files of a per-rank format
    (:func:`~ckpttool.format.perrank_formats.detect_layout`)."""
    return bool(_looked("checkpoint", path, _is_checkpoint_dir))


def _is_checkpoint_dir(path: Path) -> bool:
    """:func:`is_checkpoint_dir`, looked at now."""
    try:
        # __0.metadata: a dcp.save(use_collectives=False) save (rank-local metadata, ckpttool.format.rank_local)
        return (
            (path / METADATA_NAME).is_file()
            or (path / "__0.metadata").is_file()
            or bool(hf_storage_files(path))
            or detect_layout(path) is not None
        )
    except OSError:
        return False


def step_of(name: str) -> int | None:
    """The step number in a step directory's name (``step-100``, ``checkpoint-100``, ``global_step100``,
    ``iter_0000100``, NeMo Automodel's ``epoch_0_step_100``)."""
    d = registry.derived()
    m = d.step_re.match(name)
    if m:
        return int(m.group(1))
    for pat in d.discovery.step_patterns:
        m = pat.match(name)
        if m:
            return int(m.group("step"))
    return None


def step_given_hint(root: Path, param: str) -> str:
    """The hint of a ``param`` (``step``, ``a_step``) given with ``root``, a checkpoint itself: where ``root`` is a
    step directory (``run/checkpoint/step-20``), the run's root above it is named, the directory the step is picked
    below (``run/checkpoint``; ``.`` given inside a step directory: its absolute parent)."""
    absolute = Path(os.path.abspath(root))
    if step_of(absolute.name) is None:
        return f"pass the directory that holds the step directories, or drop `{param}`"
    shown = root.parent if root.name not in ("", ".", "..") and str(root.parent) != "." else absolute.parent
    return f"drop `{param}`, or give `{param}` with the directory above this step directory: {shell_arg(shown)}"


def named_step(located: Located) -> tuple[int | None, bool]:
    """``(step, named by no step)`` of the nearest step-named directory from the checkpoint up to the directory
    given (its parent when the checkpoint folder of a step directory is given itself: verl's ``actor/``). Paths are
    made absolute lexically first (links kept): ``.`` given inside ``checkpoint-100/`` is named by ``checkpoint-100``;
    where those names hold no step, the paths with links resolved (``run/latest`` -> ``checkpoint-100``). A
    directory named by an epoch (torchtune's ``dist_epoch_N``, :data:`EPOCH_DIR`) or by a save index (Accelerate's
    ``checkpoints/checkpoint_N``, :data:`SAVE_INDEX_DIR`) gives ``(None, True)``."""
    for absolute in (os.path.abspath, os.path.realpath):
        found = _step_named(*(PurePath(absolute(p)) for p in (located.given, located.model)))
        if found != (None, False):
            return found
    return None, False


def _step_named(given: PurePath, q: PurePath) -> tuple[int | None, bool]:
    """:func:`named_step` of absolute paths ``given`` and checkpoint folder ``q``."""
    d = registry.derived()
    if given == q and (
        any(folder == q.name for folder, _ in d.discovery.step_folders)
        or any(p.model.match(q.name) for p in d.discovery.folder_pairs)
    ):
        given = q.parent
    while q.is_relative_to(given):
        if (s := step_of(q.name)) is not None:
            return (None, True) if EPOCH_DIR.match(q.name) or _save_index_dir(q) else (s, False)
        if q == given or q == q.parent:
            break
        q = q.parent
    return None, False


def _epoch_of(name: str) -> int:
    """The epoch in a step directory's name (``epoch_3_step_100``: 3), ``-1`` when it names none."""
    for pat in registry.derived().discovery.step_patterns:
        m = pat.match(name)
        if m and "epoch" in pat.groupindex:
            return int(m.group("epoch"))
    return -1


def _marker(path: Path) -> str | None:
    """The in-progress marker a trainer left in ``path`` (NeMo Automodel's ``.incomplete``), else ``None``."""
    for name in registry.derived().discovery.incomplete_markers:
        if os.path.lexists(path / name):
            return name
    return None


def _renamed_to(path: Path) -> str | None:
    """The step directory's name that the trainer gives directory ``path`` when its save finishes:
    ``path`` is named ``<step directory><suffix>`` for a schema's ``staging_suffixes`` (OLMo-core's
    ``stepN-tmp``, renamed to ``stepN`` after every rank has written) or ``<prefix><step directory>`` for its
    ``staging_prefixes`` (HF Trainer's ``tmp-checkpoint-N``, transformers 4.36-4.38), else ``None``."""
    d, name = registry.derived(), path.name
    finals = [name[: -len(x)] for x in d.discovery.staging_suffixes if name.endswith(x)]
    finals += [
        name[len(x) :] for x, words in d.staging_prefixes if name.startswith(x) and _has_word(name[len(x) :], words)
    ]
    return next((f for f in finals if f and step_of(f) is not None), None)


def _has_word(name: str, words: tuple[str, ...]) -> bool:
    """Whether step directory name ``name`` starts with one of ``words`` (case-insensitive, as :func:`step_of`)."""
    return name.lower().startswith(tuple(w.lower() for w in words))


def _walk(
    root: Path,
    max_depth: int,
    visit: Callable[[Path], bool],
    whole: bool = False,
    dangling: Callable[[Path], None] | None = None,
) -> None:
    """Visit the directories below ``root`` breadth first, sorted by name; descend into those for
    which ``visit(path)`` is true. Hidden and symlinked directories are skipped, but for a link named as a step
    directory (``checkpoint-300 -> /scratch/run/checkpoint-300``: the trainers' resume lists it as any step; a
    ``latest`` link is :func:`_latest_step`'s); at most 10,000 directories are visited. ``dangling`` (when given)
    is called for each link named as a step directory whose target does not exist.

    Raises:
        AmbiguousCheckpointError (E204): with ``whole``, more directories than that below ``root`` (the newest step
            could be among those not seen: the walk picks none rather than a step that is not the newest).
    """
    level = [root]
    visited = 0
    for _ in range(max_depth):
        nxt: list[Path] = []
        for d in level:
            try:
                entries = sorted(os.scandir(d), key=lambda e: e.name)
            except OSError:
                continue
            for e in entries:
                if e.name.startswith(".") or not _followed(e):
                    if dangling is not None and _dangling_step(e):
                        dangling(Path(e.path))
                    continue
                visited += 1
                if visited > _MAX_DIRS:
                    if whole:
                        raise AmbiguousCheckpointError(
                            f"{root}: more than {_MAX_DIRS:,} directories in the {max_depth} levels below it; "
                            "the search for the checkpoint stopped before seeing them all",
                            path=root,
                            hint="pass the checkpoint's own directory (the step directory: DIR/checkpoint-N), "
                            "or move older steps out of the run's folder",
                        )
                    return
                p = Path(e.path)
                if visit(p):
                    nxt.append(p)
        level = nxt


def _followed(e: os.DirEntry[str]) -> bool:
    """Whether :func:`_walk` visits directory entry ``e``: a directory, or a link to one named as a step directory
    that is not the folder holding it or one above (``step-1 -> .``, ``checkpoint-1 -> ..``: a loop, the run seen
    again as a series of its own)."""
    try:
        if e.is_symlink():
            if step_of(e.name) is None or not e.is_dir():
                return False
            target, here = Path(os.path.realpath(e.path)), Path(os.path.realpath(os.path.dirname(e.path)))
            return not here.is_relative_to(target)
        return e.is_dir()
    except OSError:
        return False


def _no_target(p: Path) -> str:
    """Why link ``p`` leads nowhere: links that lead back to themselves (``step-3 -> step-3``), or a missing target."""
    try:
        os.stat(p)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "which only leads back to itself (a symlink loop, no directory at its end)"
    return "which does not exist (storage removed or not mounted)"


def _dangling_step(e: os.DirEntry[str]) -> bool:
    """Whether directory entry ``e`` is a link named as a step directory whose target does not exist."""
    try:
        return e.is_symlink() and step_of(e.name) is not None and not os.path.exists(e.path)
    except OSError:
        return False


def find_checkpoints(root: Path, max_depth: int = MAX_DEPTH, whole: bool = False) -> list[Path]:
    """DCP checkpoint directories below ``root`` (not ``root`` itself), breadth first, sorted.

    A checkpoint's own subdirectories are not searched (``HuggingFaceStorageWriter``'s
    ``sharded/``); hidden and symlinked directories are skipped (not a link named as a step directory,
    ``checkpoint-300 -> /scratch/...``); at most 10,000 directories are visited (more: E204 with ``whole``,
    else those found in the first 10,000).
    """
    found: list[Path] = []

    def visit(p: Path) -> bool:
        if _renamed_to(p) is not None:  # OLMo-core's stepN-tmp: find_incomplete's
            return False
        if is_checkpoint_dir(p):
            # torch-checkpointing's tmp_ dir, a Megatron iter_N without metadata.json: find_incomplete's
            if staging_of(p) is None and _unfinished_checkpoint(p) is None:
                found.append(p)
            return False
        return True

    _walk(root, max_depth, visit, whole)
    return found


def older_steps(step_dir: Path) -> list[tuple[int, Path]]:
    """The finished checkpoints beside step directory ``step_dir`` with a lower step, newest first (none when its
    name holds no step); unfinished saves are left out as :func:`find_checkpoints` leaves them."""
    step = step_of(step_dir.name)
    if step is None:
        return []
    try:
        entries = list(os.scandir(step_dir.parent))
    except OSError:
        return []
    found = []
    for e in entries:
        s = step_of(e.name)
        if s is None or s >= step or not _followed(e):
            continue
        p = Path(e.path)
        if is_checkpoint_dir(p) and staging_of(p) is None and _unfinished_checkpoint(p) is None:
            found.append((s, p))
    return sorted(found, key=lambda sp: sp[0], reverse=True)


#: Names an unfinished save leaves: torch's ``FileSystemWriter`` writes ``.metadata`` to this
#: name first and renames it when every rank has finished (``torch/distributed/checkpoint/filesystem.py``).
_METADATA_TMP = METADATA_NAME + ".tmp"


def _unpublished(path: Path, names: list[str] | None = None) -> str | None:
    """What shows that the trainer has not published the save in ``path``: it holds every name of a
    schema's ``publish_markers`` entry but not the file the trainer writes last (OLMo-core's
    ``.metadata.json`` beside ``model_and_optim/`` and ``train/``; megatron-core's ``metadata.json``
    beside ``common.pt``), or only some of those names and no checkpoint among them or in ``path``
    itself (OLMo-core's async save: ``train/`` written, ``model_and_optim/`` not yet), else ``None``."""
    if names is None:
        try:
            names = os.listdir(path)
        except OSError:
            return None
    for last, holds in registry.derived().discovery.publish_markers:
        present = [h for h in holds if h in names]
        if last in names or not present:
            continue
        # a part of the save only: unless it is itself a checkpoint (or ``path`` is), ``path`` is not another
        # framework's step directory that happens to hold a folder of that name
        if len(present) < len(holds) and (is_checkpoint_dir(path) or any(is_checkpoint_dir(path / h) for h in present)):
            continue
        held = ", ".join(h + "/" if (path / h).is_dir() else h for h in present)
        return f"{held} but no {last} (the trainer writes it last, when the save is complete)"
    return None


def _unfinished_checkpoint(path: Path) -> str | None:
    """What shows that the checkpoint folder ``path`` (:func:`is_checkpoint_dir`) holds a save that did not finish:
    its trainer has not published it (:func:`_unpublished`), a per-rank format's rank file is missing
    (:func:`~ckpttool.format.perrank_formats.unfinished_layout`), or a ``dcp.save(use_collectives=False)`` rank
    wrote data files (or ``__R.metadata.tmp``) but not yet its ``__R.metadata``; else ``None``."""
    return _looked(  # type: ignore[no-any-return]
        "unfinished", path, lambda p: _unpublished(p) or unfinished_layout(p) or _rank_local_unfinished(p)
    )


def _rank_local_unfinished(path: Path) -> str | None:
    """The ranks of a rank-local save (``__R.metadata`` per rank, no ``.metadata``) that have not written their
    ``__R.metadata`` yet (torch writes it last, through ``__R.metadata.tmp``), else ``None``."""
    try:
        names = os.listdir(path)
    except OSError:
        return None
    if METADATA_NAME in names or not rank_metadata_names(names):
        return None
    lacking = ranks_without_metadata(names, data_file_ranks(names))
    if not lacking:
        return None
    shown = ", ".join(f"__{r}.metadata" for r in lacking[:4]) + (", ..." if len(lacking) > 4 else "")
    return f"no {shown} (a use_collectives=False save: each rank writes its own last)"


def unpublished(path: Path) -> str | None:
    """What shows that the step directory ``path`` holds a save its trainer has not published (the file the
    trainer writes last missing, :func:`_unpublished`; its staging directory, :func:`_renamed_to`), else ``None``."""
    final = _renamed_to(path)
    if final is not None:
        return f"the trainer's staging files, not renamed to {final}"
    return _unpublished(path)


def _unfinished(path: Path) -> str | None:
    """What shows that the save in ``path`` did not finish (data files or ``.metadata.tmp``, no ``.metadata``;
    a trainer's in-progress marker, or the file it writes last missing); a step directory that cannot be listed
    (permissions) is not known to be finished either: said so, never passed over in silence."""
    try:
        names = os.listdir(path)
    except PermissionError as e:
        if step_of(path.name) is None:
            return None
        return f"no listing this user may read ({e.strerror}), so whether its save finished is not known"
    except OSError:
        return None
    marker = next((m for m in registry.derived().discovery.incomplete_markers if m in names), None)
    if marker is not None:
        return f"{marker} (the trainer's marker of a save not yet published)"
    unpublished = _unpublished(path, names)
    if unpublished is not None:
        return unpublished
    if METADATA_NAME in names:
        if os.path.isfile(path / METADATA_NAME) or step_of(path.name) is None:
            return None
        # a FIFO, a folder, a dangling link: no checkpoint (is_checkpoint_dir), and not passed over in silence
        return f"{METADATA_NAME} that is not a regular file (a FIFO, a folder or a dangling link)"
    data = sum(1 for n in names if DATA_FILE_RE.match(n))
    tmp = _METADATA_TMP in names
    if not data and not tmp:
        # a step directory the save created and then wrote nothing into (DCP's writer makes the folder first)
        return _EMPTY_STEP if step_of(path.name) is not None and _holds_no_file(path) else None
    parts = [f"{data} data file(s)"] if data else []
    if tmp:
        parts.append(_METADATA_TMP)
    return f"{', '.join(parts)}, no {METADATA_NAME}"


_EMPTY_STEP = "no file (the save created the directory and wrote nothing into it)"


def _holds_no_file(path: Path, limit: int = 64) -> bool:
    """Whether ``path`` and the folders below it hold no file at all (at most ``limit`` folders are
    looked at; more counts as holding files). Symlinks count as files."""
    todo = [path]
    seen = 0
    while todo:
        seen += 1
        if seen > limit:
            return False
        try:
            entries = list(os.scandir(todo.pop()))
        except OSError:
            return False
        for e in entries:
            if not e.is_dir(follow_symlinks=False):
                return False
            todo.append(Path(e.path))
    return True


def find_incomplete(root: Path, max_depth: int = MAX_DEPTH, whole: bool = False) -> list[IncompleteStep]:
    """Step directories below ``root`` holding a save that did not finish, by step.

    A directory counts when it (or one of its folders, ``step-8/model``) holds ``__R_N.distcp``
    files or ``.metadata.tmp`` but no ``.metadata``, or a trainer's marker of an unpublished save
    (a file it leaves until the save is published, or lacks the file it writes last: a schema's
    ``incomplete_markers`` / ``publish_markers``), and a step-named directory is on its path
    below ``root``; or it is torch-checkpointing's ``tmp_<name>`` staging directory, ``<name>``
    naming the step (:func:`~ckpttool.format.perrank_formats.staging_of`). Hidden and symlinked directories are
    skipped (not a link named as a step directory); at most 10,000 are visited (more: E204 with ``whole``).
    """
    found: dict[int, IncompleteStep] = {}
    root_step = step_of(root.name)  # a step directory given itself: what is unfinished below it is of its step

    def near(p: Path) -> int | None:
        s = _step_near(p, root)
        return root_step if s is None else s

    def visit(p: Path) -> bool:
        final = staging_of(p)
        if final is not None:
            step = _step_near(p.parent / final, root)
            if step is not None:
                found.setdefault(step, IncompleteStep(step, p, "torch-checkpointing's staging files, not renamed"))
            return False
        final = _renamed_to(p)
        if final is not None:
            step = _step_near(p.parent / final, root)
            # the step's directory there too: a save renamed into it, the staging one a leftover the trainer's
            # resume never lists (HF Trainer's get_last_checkpoint resumes checkpoint-N beside tmp-checkpoint-N)
            if step is not None and not (p.parent / final).is_dir():
                found.setdefault(step, IncompleteStep(step, p, f"the trainer's staging files, not renamed to {final}"))
            return False
        if is_checkpoint_dir(p):
            # a Megatron iter_N whose metadata.json was never written; verl's actor/ missing a rank's file
            why = _unfinished_checkpoint(p)
            step = near(p)
            if why is not None and step is not None:
                found.setdefault(step, IncompleteStep(step, p, why))
            return False
        why = _unfinished(p)
        step = _step_near(p, root)
        staged = _suffixed_step(p, root) if why is not None and step is None else None
        if staged is not None:  # step-3.tmp: a save staged under its step directory's name and a suffix
            step, why = staged[0], f"{why}, not renamed to {staged[2]}"
        if why is not None and step is not None:
            found.setdefault(step, IncompleteStep(step, p, why))
            return False
        return True

    def dangling(p: Path) -> None:  # checkpoint-300 -> /scratch/run/checkpoint-300, that storage gone or unmounted
        step = _step_near(p, root)
        if step is not None:
            why = f"no target: it links to {os.readlink(p)!r}, {_no_target(p)}"
            found.setdefault(step, IncompleteStep(step, p, f"{why}, so whether its save finished is not known"))

    _walk(root, max_depth, visit, whole, dangling)
    return sorted(found.values(), key=lambda i: i.step)


@dataclass(frozen=True)
class _Unit:
    model: Path
    optimizer: Path | None
    step: int | None
    epoch: int = -1

    def label(self, root: Path) -> str:
        rel = _rel(self.model, root)
        if self.optimizer is not None:
            return f"{rel} + {_rel(self.optimizer, root)}"
        return rel


def _lone_models(
    root: Path, units: list[_Unit], incomplete: list[IncompleteStep]
) -> tuple[list[_Unit], list[IncompleteStep]]:
    """``units`` less the model folders of a pair saved without their optimizer folder in a run whose other
    steps hold both (Accelerate's ``save_state`` writes ``optimizer_0/`` after ``pytorch_model_fsdp_0/``: a
    save cut between the two, which its ``load_state`` cannot resume), and ``incomplete`` with their steps."""
    paired = {u.model.name for u in units if u.optimizer is not None}
    lone: dict[int, IncompleteStep] = {}
    kept: list[_Unit] = []
    for u in units:
        matches = (pr.model.match(u.model.name) for pr in registry.derived().discovery.folder_pairs)
        pair = next(((pr, m) for pr, m in zip(registry.derived().discovery.folder_pairs, matches) if m), None)
        if u.optimizer is None and u.step is not None and u.model.name in paired and pair is not None:
            want = pair[0].optimizer.format(*pair[1].groups())
            if not os.path.lexists(u.model.parent / want):
                why = (
                    f"{u.model.name}/ but no {want}/ (the run's other steps hold both: a save cut before its optimizer)"
                )
                lone.setdefault(u.step, IncompleteStep(u.step, u.model.parent, why))
                continue
        kept.append(u)
    if not lone:
        return units, incomplete
    known = {i.step for i in incomplete}
    return kept, sorted([*incomplete, *(i for s, i in lone.items() if s not in known)], key=lambda i: i.step)


def _rel(p: Path, root: Path) -> str:
    try:
        return str(p.relative_to(root))
    except ValueError:
        return str(p)


def _units(root: Path, found: list[Path]) -> list[_Unit]:
    by_path = set(found)
    paired: set[Path] = set()
    units: list[_Unit] = []
    for p in found:
        for pair in registry.derived().discovery.folder_pairs:
            m = pair.model.match(p.name)
            if m is None:
                continue
            q = p.parent / pair.optimizer.format(*m.groups())
            if q in by_path and q not in paired:
                units.append(_Unit(p, q, _step_near(p.parent, root), _epoch_near(p.parent, root)))
                paired.update((p, q))
                break
    for p in found:
        if p not in paired:
            units.append(_Unit(p, None, _step_near(p, root), _epoch_near(p, root)))
    return sorted(units, key=lambda u: (u.step is None, u.step or 0, u.epoch, str(u.model)))


def _step_near(p: Path, root: Path) -> int | None:
    """The step of the nearest step-named directory from ``p`` up to (not including) ``root``."""
    d = _step_dir(p, root)
    return step_of(d.name) if d is not None else None


def _epoch_near(p: Path, root: Path) -> int:
    """The epoch of the nearest step-named directory from ``p`` up to ``root`` (``-1``: none named)."""
    q = p
    while q != root and q != q.parent:
        if step_of(q.name) is not None:
            return _epoch_of(q.name)
        q = q.parent
    return -1


#: What Megatron-LM's ``latest_checkpointed_iteration.txt`` holds for a release checkpoint: it loads
#: ``<save>/release/`` (``megatron/training/checkpointing.py``, ``get_checkpoint_name(..., release=True)``).
RELEASE = "release"


def _latest_step(root: Path) -> tuple[int | str, str] | None:
    """The step named by a ``latest`` file (DeepSpeed: ``global_step100``; Megatron: ``100``, or
    :data:`RELEASE` for its ``release/`` directory) and that file's name.

    Raises:
        StepNotFoundError: a ``latest`` file that names no step (neither a number, a step name nor
            Megatron's ``release``): the trainer's own resume stops on it; or a step directory outside ``root``.
            Also a ``latest`` file that cannot be read (permissions): the step it names is not known.
        NotRegularFileError (E102): a ``latest`` that is a FIFO, device or socket.
        PathEscapeError (E101): a ``latest`` symlink to a file outside ``root`` (a hub snapshot's blobs are inside).
    """
    for name in registry.derived().discovery.latest_files:
        p = root / name
        if (own := _tracker_not_text(root, p)) is not None:  # Bridge's torch.save; a folder or link to one
            if own[0] is not None:
                return own[0], name
            continue
        try:
            if p.is_symlink() and p.is_file():  # a link to the file (a hub snapshot's blob): read as open() reads it
                try:
                    text = _pointer_text(resolve_inside(root, name, what=name))
                except PathEscapeError as e:  # not the run's own pointer: a step of the run is still there to pass
                    e.param, e.hint = "step", f"{e.hint}; pass `step` N to open a step of {root.name} itself"
                    raise
            elif p.is_symlink():  # NeMo Automodel's LATEST: a relative symlink to the step directory
                target = os.readlink(p)
                # another run's step directory (latest -> ../other/checkpoint-1) is not this run's step of that number
                s = _linked_step(root, target) if _leads_below(root, target) else None
                if s is not None:
                    return s, name
                raise StepNotFoundError(  # was passed over: the highest step chosen, the link never named
                    f"{p}: links to {target!r}, which names no step directory below {root} "
                    "(`step` latest cannot follow it)",
                    path=p,
                    param="step",
                    hint=f"pass the directory {name} links to itself, or `step` N, or point {name} at a step "
                    "directory (or remove it to make `step` latest the highest complete step)",
                )
            else:
                text = _pointer_text(p)
        except FileNotFoundError:  # removed since it was listed
            continue
        except OSError as e:  # the trainer's resume reading it fails too: the highest step may not be the one it names
            raise StepNotFoundError(
                f"{p}: cannot be read ({e.strerror or e}), so the step it names is not known "
                "(`step` latest cannot follow it)",
                path=p,
                param="step",
                hint=f"make {name} readable (chmod a+r), or pass `step` N",
            ) from None
        if text is None:
            continue
        s = _tracker_int(text)
        if s is None and name in _INT_TRACKERS and step_of(text) is not None:
            raise _not_an_iteration(p, text, step_of(text))
        s = s if s is not None else step_of(text)
        if s is None and text and not _leads_below(root, text):
            # DeepSpeed joins the tag to the run's folder: ../other/checkpoint-1 is another run's save, not this one's
            raise StepNotFoundError(
                f"{p}: holds {text[:200]!r}, which names no step directory below {root} (`step` latest cannot "
                "follow it)",
                path=p,
                param="step",
                hint=f"pass the directory {name} names itself, or `step` N, or write a step of this run into {name}",
            )
        s = s if s is not None else _linked_step(root, text)
        if s is not None:
            return s, name
        if text == RELEASE:  # Megatron's release checkpoint: <root>/release, no step
            return RELEASE, name
        raise StepNotFoundError(  # anything else names none
            f"{p}: holds {text[:40]!r}, which names no step (the trainer's resume stops on it: "
            "Megatron's 'Invalid metadata file', DeepSpeed's missing tag directory)",
            path=p,
            param="step",
            hint=f"write the step into {name} (Megatron: the iteration, e.g. 100; DeepSpeed: global_step100), "
            "remove it, or pass `step` N",
        )
    return None


#: ``latest`` files their trainers read with ``int()`` alone (Megatron-LM's ``read_metadata``, which also takes
#: ``release``; verl's ``find_latest_ckpt_path``; SkyRL's ``load_checkpoints``, ``resume_mode: latest``): a step
#: directory's name there (``global_step_4``) stops the resume, never followed as DeepSpeed's ``latest`` tag is; so
#: does a folder of that name, or a link to a step directory (``open()`` raises ``IsADirectoryError``).
_INT_TRACKERS = ("latest_checkpointed_iteration.txt", "latest_ckpt_global_step.txt")

#: ``latest`` files that are a ``torch.save`` of the trainer's state, not text: Megatron Bridge's
#: ``latest_train_state.pt`` (``TrainState.state_dict()``, its ``step`` the iteration), which its ``load_checkpoint``
#: reads first when it is a file (``os.path.isfile``), before Megatron-LM's ``latest_checkpointed_iteration.txt``.
_TRAIN_STATE_TRACKERS = ("latest_train_state.pt",)

#: The most bytes of a ``latest_train_state.pt`` read (Bridge's is about 1.5 KB: eight 0-d tensors).
_TRAIN_STATE_CAP = 1 << 20


def _tracker_not_text(root: Path, p: Path) -> tuple[int | None] | None:
    """``(iteration,)`` of tracker ``p`` that is not a text file (Megatron Bridge's ``latest_train_state.pt``:
    :func:`_train_state_step`, ``(None,)`` when there is no file), else ``None`` (read it as text).

    Raises:
        StepNotFoundError (E205): an ``int()`` tracker (:data:`_INT_TRACKERS`) that is a folder or a link to one
            (verl's, Megatron-LM's and SkyRL's ``open()`` fails on it); a train state naming no iteration.
    """
    if p.name in _TRAIN_STATE_TRACKERS:
        return (_train_state_step(root, p),)
    if p.name in _INT_TRACKERS and os.path.isdir(p):
        raise _tracker_is_folder(root, p)
    return None


def _tracker_is_folder(root: Path, p: Path) -> StepNotFoundError:
    """E205 for tracker ``p`` (:data:`_INT_TRACKERS`) that is a folder or a link to one (a step directory): the
    trainers read it with ``open()`` and ``int()``, which fails there (``IsADirectoryError``)."""
    target = os.readlink(p) if p.is_symlink() else None
    s = _linked_step(root, target) if target is not None else None
    what = f"a link to {target!r}, a directory" if target is not None else "a directory"
    return StepNotFoundError(
        f"{p}: is {what}, not a file holding the iteration (the trainer's resume reads it with open() and fails: "
        "verl's find_latest_ckpt_path and Megatron-LM's read_metadata raise IsADirectoryError)",
        path=p,
        param="step",
        hint=f"replace {p.name} with a file holding the step number alone"
        + (f" ({s})" if s is not None else " (e.g. 100)")
        + ", or pass `step` N",
    )


def _train_state_step(root: Path, p: Path) -> int | None:
    """The iteration Megatron Bridge's ``latest_train_state.pt`` ``p`` names (its ``TrainState.state_dict()``'s
    ``step``, a 0-d integer tensor), read by :func:`~ckpttool.format.reader.load_saved_object` (ckpttool's
    allow-list unpickler, else ``torch.load(weights_only=True)``: no code in it runs); ``None`` when ``p`` is no file
    (Bridge's ``os.path.isfile`` passes over it).

    Raises:
        StepNotFoundError (E205): it cannot be read, or holds no integer ``step`` of 0 or more (Bridge's resume
            fails on it); NotRegularFileError (E102): a FIFO, device or socket; PathEscapeError (E101): a link to a
            file outside ``root``.
    """
    from ckpttool.errors import CkptError
    from ckpttool.format.files import read_regular
    from ckpttool.format.reader import load_saved_object

    try:
        mode = os.stat(p).st_mode
    except OSError:
        return None
    if stat.S_ISDIR(mode):
        return None
    src = resolve_inside(root, p.name, what=p.name)
    try:
        obj = load_saved_object(read_regular(src, _TRAIN_STATE_CAP, shown=p, what=p.name), str(p))
        step = _saved_int(obj.get("step")) if isinstance(obj, dict) else None
    except (CkptError, OSError, ImportError) as e:  # ImportError: no torch for its tensors
        if isinstance(e, (NotRegularFileError, PathEscapeError)):
            raise
        why = e.strerror if isinstance(e, OSError) and e.strerror else (getattr(e, "message", None) or str(e))
        why = why.splitlines()[0].removeprefix(str(p)).lstrip(": ")[:200]  # the file is named once, below
        raise StepNotFoundError(
            f"{p}: cannot be read as Megatron Bridge's TrainState ({why}), so the iteration it names is not known "
            "(`step` latest cannot follow it)",
            path=p,
            param="step",
            hint=f"pass `step` N, or remove {p.name} (Bridge's resume then reads latest_checkpointed_iteration.txt)",
        ) from None
    if step is None or step < 0:
        raise StepNotFoundError(
            f"{p}: holds no iteration (Megatron Bridge's TrainState keeps it as an integer 'step' of 0 or more; "
            f"found {type(obj).__name__}{' without it' if isinstance(obj, dict) and 'step' not in obj else ''}): "
            "Bridge's resume fails on it",
            path=p,
            param="step",
            hint=f"pass `step` N, or copy the train_state.pt of the iteration to resume into {p.name}",
        )
    return step


def _saved_int(v: Any) -> int | None:
    """``v`` as the int Bridge's ``TrainState.load_state_dict`` takes (``.item()`` of a one-element integer tensor,
    or a plain int), else ``None`` (a float, bool or several elements)."""
    if type(v) is int:
        return v
    if not all(callable(getattr(v, a, None)) for a in ("item", "numel", "is_floating_point", "is_complex")):
        return None
    if v.numel() != 1 or v.is_floating_point() or v.is_complex():
        return None
    x = v.item()
    return x if type(x) is int else None


def _not_an_iteration(p: Path, text: str, step: int | None) -> StepNotFoundError:
    """E205 for tracker ``p`` (:data:`_INT_TRACKERS`) holding ``text``, a step directory's name (of ``step``), which
    ``int()`` does not read."""
    return StepNotFoundError(
        f"{p}: holds {text[:40]!r}, which is not an iteration number (the trainer's resume stops on it: Megatron-LM's "
        "'Invalid metadata file', verl's int() raises ValueError)",
        path=p,
        param="step",
        hint=f"write the step number alone into {p.name} ({step}), or pass `step` N",
    )


def _tracker_int(text: str) -> int | None:
    """The step number in a ``latest`` file's ``text`` as ``int()`` (Megatron-LM's and verl's own reading of it) takes
    it: decimal digits (a superscript is a digit to ``isdigit()``, not to ``int()``), with a leading ``+`` or ``_``
    between digits (``+200``, ``1_000``: loaded as steps 200 and 1000 by those trainers); ``None`` otherwise."""
    if not re.fullmatch(r"\+?\d+(?:_\d+)*", text) or not text.lstrip("+").replace("_", "").isdecimal():
        return None
    return int(text)


def _pointer_text(p: Path) -> str | None:
    """The text of ``latest`` file ``p`` (its size, ``"N bytes"``, when over 256 bytes), ``None`` when there is none
    or it is a folder (a copy of a step, listed as a checkpoint).

    Raises:
        NotRegularFileError (E102): a FIFO, device or socket (opened without blocking, never read).
        OSError: it cannot be opened or read.
    """
    try:
        mode = os.lstat(p).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(mode):
        return None
    if not stat.S_ISREG(mode):  # a socket cannot be opened at all: refused as a FIFO is, not passed over
        raise NotRegularFileError(f"{p} is {file_kind(mode)}, not a regular file", path=p)
    fd = open_regular(p)  # replaced by a FIFO since: refused without blocking
    try:
        data = os.read(fd, 257)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    return data.decode(errors="replace").strip() if len(data) <= 256 else f"{max(size, len(data))} bytes"


def _leads_below(root: Path, target: str) -> bool:
    """Whether ``target`` (a ``latest`` link's target or a ``latest`` file's path, relative to ``root``) leads to a
    path below ``root``: made absolute lexically, or with links resolved (an absolute path naming ``root`` by
    another path)."""
    base = Path(os.path.abspath(root))
    if Path(os.path.normpath(base / target)).is_relative_to(base):
        return True
    try:
        return Path(os.path.realpath(base / target)).is_relative_to(os.path.realpath(root))
    except (OSError, ValueError):  # a NUL in a latest file's text: no path
        return False


def _linked_step(root: Path, target: str) -> int | None:
    """The step a ``latest`` link in ``root`` to ``target`` names: its step directory's (``step-200``), or that of
    the nearest step-named folder holding it below ``root`` (``checkpoint-200/pytorch_model_fsdp_0``), else
    ``None``."""
    s = step_of(Path(target).name)
    if s is not None:
        return s
    base = Path(os.path.abspath(root))
    q = Path(os.path.normpath(base / target))
    d = _step_dir(q, base) if q.is_relative_to(base) else None
    return step_of(d.name) if d is not None else None


def _check_optimizer_dir(opt: Path | None) -> None:
    """Raises UsageError: ``optimizer_dir`` (when given) does not exist or is not a DCP checkpoint directory
    (a file of one, its ``.metadata`` or a ``.distcp``, named with its folder)."""
    if opt is None:
        return
    if not opt.exists():
        from ckpttool.format.files import missing_path_hint

        raise UsageError(
            f"`optimizer_dir` {opt}: no such directory",
            path=opt,
            param="optimizer_dir",
            hint=missing_path_hint(opt, "the optimizer folder that dcp.save wrote (e.g. checkpoint-N/optimizer_0)"),
        )
    if not is_checkpoint_dir(opt):
        in_folder = not opt.is_dir() and is_checkpoint_dir(opt.parent)  # its .metadata or a .distcp file
        raise UsageError(
            f"`optimizer_dir` {opt}: "
            + (
                "a file of a DCP checkpoint, not its directory"
                if in_folder
                else "not a DCP checkpoint directory (no .metadata)"
            ),
            path=opt,
            param="optimizer_dir",
            hint=f"pass the folder that holds it: {shell_arg(opt.parent)}"
            if in_folder
            else "pass the optimizer folder that dcp.save wrote (e.g. checkpoint-N/optimizer_0)",
        )


def locate(path: str | os.PathLike[str], selection: CheckpointSelection | None = None) -> Located:
    """The checkpoint to open for ``path`` (see the module docstring).

    Args:
        path: a checkpoint directory, a step directory, or a training run's checkpoint root.
        selection: ``step`` and a separate ``optimizer_dir`` directory.

    Returns:
        The :class:`Located` checkpoint (its ``model`` directory holds ``.metadata`` or safetensors
        files, unless nothing was found: then ``model`` is ``path`` and opening it reports why).

    Raises:
        UsageError: ``path`` is not a directory; ``optimizer_dir`` does not exist, is not a checkpoint directory,
            or lies in another step directory than the model checkpoint.
        AmbiguousCheckpointError (E204): several checkpoints below ``path`` and no ``step`` that picks one.
        StepNotFoundError (E205): no checkpoint below ``path`` has ``step``.
    """
    with _one_look():
        found = _locate(path, selection)
    _refuse_other_step(found.model, selection.optimizer_dir if selection is not None else None)
    return found


def _refuse_hub_main_not_in_cache(root: Path) -> None:
    """Refuse a hub repository folder whose ``refs/main`` names a revision it holds no snapshot of: a snapshot found
    below it is another revision than the model's main, never read in its place.

    Raises:
        IncompleteCheckpointError (E202): as above.
    """
    main = hub_main_not_in_cache(root)
    if main is not None:
        raise IncompleteCheckpointError(
            f"{root}: a Hugging Face hub repository folder without the snapshot of its main revision",
            path=root,
            hint=hub_hint(root) or "download the model again",
        )


def unfinished_save_hint(file: Path) -> str | None:
    """The hint of a file given where a checkpoint directory belongs whose folder holds a save that did not finish
    (``__0_0.distcp`` beside no ``.metadata``): it names that folder and why it cannot be opened yet; ``None`` when
    the folder shows no unfinished save."""
    folder = file.parent
    why = _unfinished(folder)
    if why is None:
        return None
    return (
        f"{shell_arg(folder)} holds {why}: its save did not finish (or an async save is still running); wait "
        f"for it and pass {shell_arg(folder)}, or pass an earlier complete checkpoint directory"
    )


def _checkpoint_above(root: Path) -> tuple[Path, Path] | None:
    """The checkpoint directory one or two levels above ``root`` (a folder or file inside a checkpoint: its
    ``model_assets/``, ``extra_state/extra_state_rank_0.pt``) and ``root`` relative to it, or ``None``. It is looked
    for above the absolute path (``inspect .`` run inside ``model_assets/`` has no parent as given) and named as
    given (relative when ``root`` is)."""
    here = Path(os.path.abspath(root))
    found = next((p for p in (here.parent, here.parent.parent) if p != here and is_checkpoint_dir(p)), None)
    if found is None:
        return None
    return (found if root.is_absolute() else Path(os.path.relpath(found))), here.relative_to(found)


def _file_given_hint(file: Path) -> str:
    """The hint of a file given where a checkpoint directory belongs, its folder being no checkpoint: a file in a
    folder of a checkpoint (``extra_state/extra_state_rank_0.pt``: that checkpoint is named), a data file of a save
    that did not finish (:func:`unfinished_save_hint`), a blob of a hub cache (its snapshot is named); any other
    file is no distributed checkpoint."""
    above = _checkpoint_above(file)
    if above is not None:
        return f"pass the checkpoint directory {shell_arg(above[0])} ({above[1]} is a file inside it)"
    return (
        unfinished_save_hint(file)
        or hub_hint(file.parent)
        or (
            f"pass the directory that dcp.save wrote (it holds .metadata and __R_N.distcp files; {file.parent} "
            "holds none): a single torch.save file (.pt, .bin) is not a distributed checkpoint"
        )
    )


def _locate(path: str | os.PathLike[str], selection: CheckpointSelection | None) -> Located:
    """:func:`locate` but for the step of ``optimizer_dir``."""
    root = Path(path)
    sel = selection or CheckpointSelection()
    opt = sel.optimizer_dir
    _check_optimizer_dir(opt)
    _refuse_marked(root)
    _refuse_hub_main_not_in_cache(root)
    if root.is_file() and not is_checkpoint_dir(root.parent):  # (a file inside a checkpoint: the reader names it)
        raise UsageError(f"{root} is not a directory", path=root, hint=_file_given_hint(root))
    if not root.is_dir() or is_checkpoint_dir(root):
        if sel.step is not None and root.is_dir():
            raise UsageError(
                f"`step` {sel.step} given, but {root} is a checkpoint itself",
                param="step",
                hint=step_given_hint(root, "step"),
            )
        return Located(root, root, opt, how=_given_how(root))
    found = find_checkpoints(root, whole=True)
    for repo in sorted({b.parent for b in map(hub_blobs, found) if b is not None}):  # a hub cache given
        _refuse_hub_main_not_in_cache(repo)
    incomplete = find_incomplete(root, whole=True)
    if not found:
        if incomplete:  # the only saves below did not finish: said so, not "no checkpoint"
            raise _incomplete_error(root, incomplete[-1], sel.step)
        _refuse_unfinished_below(root)
        return _nothing_below(root, opt)
    units = _units(root, found)
    units, incomplete = _lone_models(root, units, incomplete)
    how = ""
    if sel.step == "latest":  # steps the trainer's own latest-step search skips are passed over as it does
        incomplete = sorted([*incomplete, *_resume_skipped(units, incomplete)], key=lambda i: i.step)
    if sel.step is not None:
        units, how = _of_step(root, units, sel.step, incomplete)
    if len(units) > 1:
        raise _ambiguous(root, units, sel.step, frozenset(i.step for i in incomplete))
    u = units[0]
    _refuse_unfinished_unit(root, u, sel.step, incomplete)
    if opt is not None and u.optimizer is not None:
        raise UsageError(
            f"`optimizer_dir` given, but {u.model.parent} pairs {u.model.name} with {u.optimizer.name} already",
            param="optimizer_dir",
            hint="drop `optimizer_dir`, or pass the model folder itself",
        )
    if not how:
        how = "the only checkpoint below the directory given"
        if u.optimizer is not None:
            how = "the model folder and its optimizer folder below the directory given"
    elif u.optimizer is not None:
        how += ", model folder paired with its optimizer folder"
    newer = tuple(i for i in reversed(incomplete) if u.step is None or i.step > u.step)
    return Located(root, u.model, u.optimizer or opt, u.step, how, newer)


#: Why OLMo-core's ``Checkpointer.latest_checkpoint`` skips a published step directory (``dir_is_checkpoint``).
_NO_RANK0 = (
    "model_and_optim/ and .metadata.json but no train/rank0.pt, which OLMo-core's latest_checkpoint requires of a "
    "checkpoint (it skips this directory; the step opened itself loads without trainer state)"
)


def _resume_skipped(units: list[_Unit], incomplete: list[IncompleteStep]) -> list[IncompleteStep]:
    """The step directories of ``units`` that their trainer's own search for the latest step does not list, though
    their save finished: OLMo-core's ``stepN/`` holding ``model_and_optim/`` and ``.metadata.json`` but no
    ``train/rank0.pt`` (``Checkpointer.dir_is_checkpoint`` requires all three). ``--step latest`` passes over them
    to the step that search finds, as a step whose save did not finish (``R001`` names them); ``--step N`` opens
    one (``validate``'s ``K011``). Also a finished save in a folder torchtitan's resume takes as a step by its name
    (``step-3.tmp``, ``step-20-backup``) with no ``step-N`` directory beside it: that resume fails loading ``step-N``."""
    done = {i.step for i in incomplete}
    out: list[IncompleteStep] = []
    for u in units:
        step_dir = u.model.parent
        if u.step is None or u.step in done or u.optimizer is not None or u.model.name != "model_and_optim":
            continue
        if os.path.lexists(step_dir / ".metadata.json") and not os.path.lexists(step_dir / "train" / "rank0.pt"):
            out.append(IncompleteStep(u.step, step_dir, _NO_RANK0))
            done.add(u.step)
    series: dict[Path, bool] = {}  # each folder listed once: 9,000 step-N-backup folders took 9,000 listings of it
    for u in units:
        m = _TITAN_STEP.search(u.model.name) if u.step is None and u.optimizer is None else None
        n = int(m.group(1)) if m is not None else None
        if n is None or n in done or (u.model.parent / f"step-{n}").is_dir():
            continue
        if u.model.parent not in series:
            series[u.model.parent] = _titan_series(u.model.parent)
        if not series[u.model.parent]:
            continue
        out.append(IncompleteStep(n, u.model, _titan_misnamed(u.model.name, n)))
        done.add(n)
    return out


#: torchtitan's ``CheckpointManager._find_load_step``: ``re.search`` of this in each folder's name of its checkpoint
#: folder (with ``.metadata`` or an HF index), whose highest number it then loads as ``step-N``.
_TITAN_STEP = re.compile(r"step-(\d+)")


def _titan_series(folder: Path) -> bool:
    """Whether ``folder`` holds a ``step-N`` directory (torchtitan's checkpoint folder, which its resume scans)."""
    try:
        return any(re.fullmatch(r"step-[0-9]+", e.name) and e.is_dir() for e in os.scandir(folder))
    except OSError:
        return False


def _titan_misnamed(name: str, n: int) -> str:
    """Why a finished save in folder ``name`` (``step-3.tmp``, ``step-20-backup``) with no ``step-N`` beside it is a
    step ``n`` no resume loads."""
    return (
        f"a finished save under the name {name}, not step-{n}: torchtitan's resume, which matches step-N anywhere in "
        f"a folder's name, takes step {n} from it and fails (it loads step-{n}, which is not there)"
    )


def _steps_of_pair(model: Path, opt: Path) -> tuple[tuple[int, Path], tuple[int, Path]] | None:
    """``((step, step directory), ...)`` of ``model`` and ``opt``: the nearest step-named directory holding each (the
    path itself included) below the folder the two share, by their absolute paths, else with links resolved
    (``run/latest/pytorch_model_fsdp_0``); ``None`` when one of them has none there. A step-named folder holding
    both (``/data/ckpt_1/run/...``, ``checkpoint-2/`` of both) is no step of either's own."""
    for absolute in (os.path.abspath, os.path.realpath):
        qa, qb = Path(absolute(model)), Path(absolute(opt))
        common = Path(os.path.commonpath([qa, qb]))
        da, db = _step_dir(qa, common), _step_dir(qb, common)
        sa = step_of(da.name) if da is not None else None
        sb = step_of(db.name) if db is not None else None
        if da is not None and db is not None and sa is not None and sb is not None:
            return (sa, da), (sb, db)
    return None


def _refuse_other_step(model: Path, opt: Path | None) -> None:
    """UsageError when ``opt`` (`optimizer_dir`) lies in another step's directory than the model checkpoint
    ``model`` (``checkpoint-1/pytorch_model_fsdp_0`` with ``checkpoint-0/optimizer_0``): the moments and steps of
    one save beside the weights of another, which no save wrote and no resume loads."""
    if opt is None:
        return
    pair = _steps_of_pair(model, opt)
    if pair is None or pair[0][0] == pair[1][0]:
        return
    a, b = pair
    partner = next(
        (
            a[1] / q.relative_to(b[1])
            for q in (Path(os.path.abspath(opt)), Path(os.path.realpath(opt)))
            if q.is_relative_to(b[1]) and (a[1] / q.relative_to(b[1])).is_dir()
        ),
        None,
    )
    raise UsageError(
        f"`optimizer_dir` {opt} is of step {b[0]} ({b[1].name}), the model {model} of step {a[0]} ({a[1].name}): "
        "one save's optimizer state beside another's weights",
        path=opt,
        param="optimizer_dir",
        hint=f"pass the optimizer folder saved with the model, {shell_arg(partner)}"
        if partner is not None
        else "pass the optimizer folder of the model's own step",
    )


def _given_how(root: Path) -> str:
    """How the directory given itself was chosen: said of a link to a step directory (``run/latest`` ->
    ``step-200``: the step it opens), else ``the directory given``."""
    try:
        target = os.readlink(root) if root.is_symlink() else None
    except OSError:
        target = None
    s = _linked_step(root.parent, target) if target is not None else None
    return f"the directory given, a link to {target} (step {s})" if s is not None else "the directory given"


def _refuse_marked(root: Path) -> None:
    """E202 when ``root`` (or the step directory above a model folder) holds a trainer's in-progress marker,
    or ``root`` is a checkpoint whose trainer has not written the file it writes last (:func:`_unpublished`)."""
    if not root.is_dir():
        return
    # the checkpoint itself (a Megatron iter_N) or the step directory opened (OLMo-core's stepN/ of
    # model_and_optim/ and train/, no .metadata.json: as `step` N); its model_and_optim/ opened directly is
    # read (OLMo-core's load reads it too) and named by validate (K011)
    running = "(a save still running, or one that was interrupted)"
    unpublished = None if _renamed_to(root) is not None else _unpublished(root)  # stepN-tmp/: named as staging
    found = [
        (root, f"holds {unpublished}: a save that did not finish, which the trainer neither loads nor resumes from")
    ]
    if unpublished is None:
        staged = ((w, _renamed_to(w)) for w in (root, root.parent))
        staging = "the trainer's staging directory of a save not yet renamed to {} " + running
        found = [
            (w, staging.format(final) + ", which the trainer's own load never finds") for w, final in staged if final
        ]
    if not found:
        marked = ((w, _marker(w)) for w in (root, root.parent))
        found = [(w, f"holds {m}, the trainer's marker of a save not yet published {running}") for w, m in marked if m]
    if found:
        where, what = found[0]
        raise IncompleteCheckpointError(
            f"{where}: {what}",
            path=where,
            hint="wait for the save to finish, or open an earlier complete step (`step` N on the run directory)",
        )


def _refuse_unfinished_unit(root: Path, u: _Unit, step: int | str | None, incomplete: list[IncompleteStep]) -> None:
    """E202 when the one checkpoint found (no ``step`` given) belongs to a step whose save did not finish, or
    is a model folder whose optimizer folder beside it holds a save that did not finish (the step directory
    opened itself: NeMo Automodel's ``optim/``, Accelerate's ``optimizer_0/`` with data files, no ``.metadata``)."""
    if step is None and u.step is not None:
        inc = next((i for i in incomplete if i.step == u.step), None)
        if inc is not None:
            raise _incomplete_error(root, inc, None)
    if u.optimizer is not None:
        return
    for pair in registry.derived().discovery.folder_pairs:
        m = pair.model.match(u.model.name)
        partner = u.model.parent / pair.optimizer.format(*m.groups()) if m is not None else None
        why = _unfinished(partner) if partner is not None and partner.is_dir() else None
        if partner is not None and why is not None:
            raise IncompleteCheckpointError(
                f"{root}: {u.model.name}/ was saved with {partner.name}/, whose save did not finish (or is still "
                f"running): {partner} has {why}",
                path=partner,
                hint="wait for the save to finish, or open an earlier complete step (`step` N on the run directory)",
            )


def _latest_epoch(units: list[_Unit]) -> list[_Unit]:
    """Of the units of one step, those of the highest epoch (NeMo Automodel: ``epoch_E_step_S``)."""
    top = max((u.epoch for u in units), default=-1)
    return [u for u in units if u.epoch == top]


def _refuse_unfinished_below(root: Path) -> None:
    """Refuse ``root`` when a checkpoint folder below it holds a save that did not finish (a per-rank save missing a
    rank's file, a trainer's unpublished save) where no step-named directory places it (:func:`find_incomplete`
    names steps): a step directory copied under another name, which is no step but still no "no checkpoint".

    Raises:
        IncompleteCheckpointError (E202): naming the folder and what is missing.
    """
    hit: list[tuple[Path, str]] = []

    def visit(p: Path) -> bool:
        if hit:
            return False
        if is_checkpoint_dir(p):
            why = _unfinished_checkpoint(p)
            if why is not None:
                hit.append((p, why))
            return False
        return True

    _walk(root, MAX_DEPTH, visit)
    if hit:  # a step directory copied under another name: no step to name, still E202
        raise IncompleteCheckpointError(
            f"{root}: {hit[0][0]} has {hit[0][1]} (a save that did not finish, or an async save still running)",
            path=hit[0][0],
            hint="wait for the save to finish, or use an earlier step or a complete copy of this one",
        )


def _nothing_below(root: Path, opt: Path | None) -> Located:
    """``root`` itself when it holds ``.distcp`` files (opening it reports the incomplete save, E202).

    Raises:
        MetadataError: no ``.distcp`` file either.
    """
    try:
        partial = any(DATA_FILE_RE.match(n) for n in os.listdir(root))
    except OSError:
        partial = True
    if partial:
        _refuse_partial_step(root)
        return Located(root, root, opt)
    # a folder inside a checkpoint (its model_assets/, extra_state/): the checkpoint is the directory to pass
    checkpoint = _checkpoint_above(root)
    above, inside = checkpoint if checkpoint is not None else (None, None)
    if above is None and step_of(root.name) is not None and _holds_no_file(root):
        raise MetadataError(
            f"{root}: an empty directory (no .metadata, no data files, in it or below it)",
            path=root,
            hint="a save that stopped right after creating its step directory leaves it so; pass a directory "
            "that dcp.save finished writing (it holds .metadata and __R_N.distcp files), or the run's checkpoint "
            "folder above the step directories",
        )
    raise MetadataError(
        f"{root}: no .metadata, and no DCP checkpoint in the {MAX_DEPTH} directory levels below it",
        path=root,
        hint=f"pass the checkpoint directory {shell_arg(above)} ({inside}/ is a folder inside it)"
        if above is not None
        else _model_folder_hint(root)
        or "pass the directory that dcp.save wrote (it holds .metadata and __R_N.distcp files), "
        "or the run's checkpoint folder above the step directories",
    )


def _refuse_partial_step(root: Path) -> None:
    """Refuse the step directory ``root`` whose save did not finish (data files, no ``.metadata``) when a step
    directory beside it holds an earlier complete save: the hint names the newest of those, the one to pass.

    Raises:
        IncompleteCheckpointError (E202): such an earlier step is there (else opening ``root`` reports E202).
    """
    step = step_of(root.name)
    if step is None:
        return
    try:
        siblings = [(s, p) for p in root.parent.iterdir() if (s := step_of(p.name)) is not None and s < step]
    except OSError:
        return
    done = [(s, p) for s, p in siblings if is_checkpoint_dir(p) and _unfinished(p) is None]
    if not done:
        return
    older = max(done, key=lambda sp: sp[0])[1]
    raise IncompleteCheckpointError(
        f"{root}: has .distcp data files but no .metadata (incomplete save)",
        path=root,
        hint="the save did not finish (crashed or async save still running); wait for it, or pass the newest "
        f"complete step before it: {shell_arg(older)}",
    )


def _model_folder_hint(root: Path, *, hub: bool = True) -> str | None:
    """The hint for a Hugging Face model folder without safetensors (``save_pretrained`` of old, weights in
    ``pytorch_model.bin``) or a folder of ``config.json`` alone, or a download into it not finished; for a hub
    repository folder (``models--ORG--NAME``) that of its snapshot, named (one level: a snapshot named and linked as
    a repository folder is not followed again); else ``None``."""
    snapshot = hub_snapshot(root) if hub else None
    if snapshot is not None:  # inspect/validate look below it: what its snapshot holds is what to say
        inner = _model_folder_hint(snapshot, hub=False)
        return f"a Hugging Face hub repository folder; in its snapshot {snapshot}: {inner}" if inner else None
    unfinished = hub_unfinished_download(root)
    if unfinished is not None:
        return unfinished
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return None
    pickled = [n for n in names if n.endswith((".bin", ".pt", ".pth")) and not n.startswith(".")]
    if pickled:
        return (
            f"{pickled[0]} is a torch.save file, which ckpttool does not read: it reads DCP checkpoints and "
            "safetensors folders; load the model with transformers and save it again with save_pretrained "
            "(it writes safetensors), then pass that folder"
        )
    if "config.json" in names:
        return (
            "it holds config.json but no weights (a model's config folder: pass it to export as --model-assets); "
            "pass the directory that dcp.save wrote (it holds .metadata and __R_N.distcp files)"
        )
    return None


def _incomplete_error(root: Path, inc: IncompleteStep, step: int | str | None) -> IncompleteCheckpointError:
    """E202 for ``step`` (a number, ``latest``, or ``None`` when none was given) naming a step whose save did
    not finish."""
    given = f"`step` {step}: " if step is not None else ""
    return IncompleteCheckpointError(
        f"{root}: {given}step {inc.step} is incomplete (a save that did not finish, or an async save "
        f"still running): {inc.path} has {inc.reason}",
        path=inc.path,
        param="step",
        hint="wait for the save to finish, or pick an earlier complete step with `step` N",
    )


def _of_step(
    root: Path, units: list[_Unit], step: int | str, incomplete: list[IncompleteStep] | None = None
) -> tuple[list[_Unit], str]:
    """The units of ``step`` (a number or ``latest``) and how it was chosen.

    ``latest`` is the step of the ``latest`` file, else the highest step; when its save did not
    finish (``incomplete``) the highest complete step below it is chosen instead (and said so).

    Raises:
        StepNotFoundError: ``latest`` and no unit in a step directory; no unit of the step.
        IncompleteCheckpointError (E202): step ``N`` is incomplete, or ``latest`` and no complete
            step lies below the incomplete one.
    """
    bad = {i.step: i for i in incomplete or ()}
    want: int | str | None = step
    how = ""
    pointer = None
    if want == "latest":
        pointer = _latest_step(root)
        if pointer is not None and pointer[0] == RELEASE:
            return _release_units(root, units, pointer[1])
        want, how = _latest_of(root, units, bad, pointer)
    elif want in bad:
        raise _incomplete_error(root, bad[want], step)
    units_at = [u for u in units if u.step == want]
    if not units_at and pointer is not None and pointer[1] in registry.derived().discovery.latest_fallback:
        # NeMo Automodel's resume passes over a LATEST naming a step that is not there: the highest complete step
        named = want
        want, how = _latest_of(root, units, bad, None)
        how = how[:-1] + f"; {pointer[1]} names step {named}, not below the directory, which the trainer passes over)"
        units_at = [u for u in units if u.step == want]
    if step == "latest":  # one step saved in two epochs: the later epoch
        units_at = _latest_epoch(units_at)
    if not units_at:
        # the steps whose save did not finish marked so, as E204 lists them (NeMo Automodel's ``.incomplete``)
        steps_found = sorted({u.step for u in units if u.step is not None} | set(bad))
        found = ", ".join(f"{s} (incomplete)" if s in bad else str(s) for s in steps_found[:20]) or "none"
        # no resume loads it: DeepSpeed's stops on the missing tag directory, verl's find_latest_ckpt_path returns None
        # (it starts from scratch)
        if pointer is not None:
            raise StepNotFoundError(
                f"{root / pointer[1]}: names step {want}, but no checkpoint of step {want} is below {root}; "
                f"steps found: {found}",
                path=root / pointer[1],
                param="step",
                hint=f"a resume that follows {pointer[1]} does not load step {want} either (the trainer fails, or "
                f"starts from scratch): write an existing step into {pointer[1]}, or pass `step` N (removing the file "
                "does not make the trainer take the highest step: Megatron-LM and verl then train from scratch)",
            )
        raise StepNotFoundError(
            f"{root}: no checkpoint of step {want} below it; steps found: {found}",
            path=root,
            param="step",
            hint=_staged_hint(root, units, want),
        )
    return units_at, _epoch_words(root, units_at, how or f"`step` {want}", want)


#: A directory named by the epoch it ends (torchtune's ``dist_epoch_N``): its number orders the saves like a step
#: but counts epochs, not optimizer steps.
EPOCH_DIR = re.compile(r"(?:dist_)?epoch[-_]?[0-9]+\Z")
#: Accelerate's automatic checkpoint naming (``ProjectConfiguration(automatic_checkpoint_naming=True)``), inside a
#: folder ``checkpoints``: ``checkpoint_<i>`` numbers the ``save_state`` calls (0, 1, ...), not optimizer steps.
SAVE_INDEX_DIR = re.compile(r"checkpoint_[0-9]+\Z")
#: The file every ``Accelerator.save_state`` writes into its save (``random_states_<process index>.pkl``, process 0's):
#: a loop of its own that names its saves ``checkpoints/checkpoint_<step>`` writes none.
ACCELERATE_RNG_FILE = "random_states_0.pkl"


def _epoch_words(root: Path, units: list[_Unit], how: str, want: int | str | None) -> str:
    """``how`` with ``step N`` said as ``epoch N`` where the chosen saves lie in directories named by an epoch
    (``--step latest: step 0`` of torchtune's ``dist_epoch_0`` read as the step count, 0, of a trained model), or as
    ``save N`` in Accelerate's ``checkpoints/checkpoint_N``; a newer incomplete one skipped is named so too."""
    dirs = set()
    for u in units:
        q = u.model
        while q != root and q != q.parent and step_of(q.name) is None:
            q = q.parent
        dirs.add(q if q != root else None)
    names = {q.name if q is not None else "" for q in dirs}
    shown = ", ".join(sorted(names))
    if names and all(EPOCH_DIR.match(n) for n in names):
        word, highest, complete = "epoch", "the highest epoch", "the highest complete epoch"
    elif dirs and all(q is not None and _save_index_dir(q) for q in dirs):
        why = "Accelerate numbers its saves, not steps"
        word, highest, complete = "save", f"the highest save index: {why}", f"the highest complete save index: {why}"
    else:
        return how
    return (
        how.replace(f"step {want} (the highest step)", f"{word} {want} ({shown}, {highest})", 1)
        .replace(f"step {want} (the highest complete step; step ", f"{word} {want} ({shown}, {complete}; {word} ", 1)
        .replace(f"`step` {want}", f"`step` {want} ({word} {want}: {shown})", 1)
    )


def _save_index_dir(q: PurePath) -> bool:
    """``q`` is named by Accelerate's automatic checkpoint naming (:data:`SAVE_INDEX_DIR` in ``checkpoints/``) and
    holds the :data:`ACCELERATE_RNG_FILE` its ``save_state`` writes (``checkpoints/checkpoint_1000`` of a ``dcp.save``
    loop naming its saves by step keeps step 1000)."""
    return (
        bool(SAVE_INDEX_DIR.match(q.name))
        and q.parent.name == "checkpoints"
        and os.path.lexists(os.path.join(q, ACCELERATE_RNG_FILE))
    )


def _latest_of(
    root: Path, units: list[_Unit], bad: dict[int, IncompleteStep], pointer: tuple[int | str, str] | None
) -> tuple[int, str]:
    """The step ``latest`` means (the ``latest`` file's ``pointer``, else the highest; the highest complete
    step below an incomplete one) and how it was chosen."""
    want = pointer[0] if pointer is not None else None
    source = f"named by {pointer[1]}" if pointer is not None else ""
    if want is None:
        _refuse_several_series(root, units, bad)
        steps = [u.step for u in units if u.step is not None] + list(bad)
        want = max(steps) if steps else None
        source = "the highest step"
    newer = [u.step for u in units if isinstance(want, int) and u.step is not None and u.step > want]
    if pointer is not None and newer and max(newer) not in bad:  # its save finished; the file was not written since
        source += (
            f"; step {max(newer)} below it is newer and complete, but {pointer[1]} names this one (a resume that "
            f"follows {pointer[1]} loads it)"
        )
    if isinstance(want, int) and want in bad:
        done = [u.step for u in units if u.step is not None and u.step < want and u.step not in bad]
        if not done:
            raise _incomplete_error(root, bad[want], "latest")
        if pointer is not None and pointer[1] not in registry.derived().discovery.latest_fallback:
            raise _tracked_incomplete(root, pointer[1], bad[want], max(done))
        skipped = bad[want]
        want = max(done)
        source = f"the highest complete step; step {skipped.step} is incomplete: {skipped.reason}"
    if not isinstance(want, int):
        raise StepNotFoundError(
            f"{root}: `step` latest, but no checkpoint below it is in a step directory "
            f"(found {', '.join(u.label(root) for u in units[:6])})",
            path=root,
            param="step",
            hint="pass one of the listed directories",
        )
    untracked = _untracked_note(root, units, want) if pointer is None else ""
    return want, f"`step` latest: step {want} ({source}{untracked}{_staged_note(root, units, want)})"


def _untracked_note(root: Path, units: list[_Unit], want: int) -> str:
    """What ``latest`` (step ``want``, the highest) says where the trainer of that step resumes only from its
    ``latest`` file and ``root`` holds none (:func:`missing_latest`), else ``""``."""
    for u in units:
        if u.step == want and (missing := missing_latest(root, u.model)) is not None:
            return f"; no {missing[0].name} in {root}: {missing[1]}"
    return ""


def _published_by(model: Path) -> SchemaSpec | None:
    """The spec whose trainer wrote checkpoint ``model``, told by its publish markers (megatron-core's
    ``metadata.json`` beside ``common.pt``), among the specs that name a ``latest_required`` file; else ``None``."""
    for spec in registry.specs():
        if spec.discovery.latest_required and any(
            os.path.lexists(model / marker) and all(os.path.lexists(model / h) for h in holds)
            for marker, holds in spec.discovery.publish_markers
        ):
            return spec
    return None


def missing_latest(given: Path, model: Path) -> tuple[Path, str] | None:
    """``(file, what the resume does without it)`` where checkpoint ``model`` lies in a step directory of run root
    ``given`` and is of a format whose trainer resumes only from a ``latest`` file (the schema's
    ``latest_required``: verl's and Megatron-LM's ``latest_checkpointed_iteration.txt``; for megatron-core iterations
    Megatron Bridge's ``latest_train_state.pt`` too) of which ``given`` holds none, the step directory named as that
    trainer names them (the schema's ``step_words``: ``iter_N``, ``global_step_N``); else ``None``.
    Validate's ``R008`` names it."""
    found = detect_layout(model)
    spec = registry.find(found[0].schema) if found is not None else _published_by(model)
    required = spec.discovery.latest_required if spec is not None else ()
    if not required or any(os.path.lexists(given / name) for name, _ in required):
        return None
    q = model
    while q != given and q != q.parent and step_of(q.name) is None:
        q = q.parent
    if q == given or q.parent != given or spec is None or not _has_word(q.name, spec.discovery.step_words):
        return None  # a step directory of another trainer's naming (SkyRL's global_step_N/ of megatron-core saves)
    return given / required[0][0], required[0][1]


def _tracked_incomplete(root: Path, name: str, inc: IncompleteStep, done: int) -> IncompleteCheckpointError:
    """E202 for a ``latest`` file ``name`` (Megatron-LM's and verl's ``latest_checkpointed_iteration.txt``,
    DeepSpeed's ``latest``) naming step ``inc.step``, whose save did not finish: those trainers' resume follows the
    file and loads that step (Megatron-LM and DeepSpeed fail on it, verl's ``find_latest_ckpt_path`` returns it
    because the directory exists), never the older complete step ``done`` (NeMo Automodel's ``LATEST``, which its
    resume passes over, is not refused: the schemas' ``latest_fallback``)."""
    return IncompleteCheckpointError(
        f"{root / name}: names step {inc.step}, whose save did not finish: {inc.path} has {inc.reason}; a resume "
        f"that follows {name} loads step {inc.step} and fails (the newest complete step is {done})",
        path=root / name,
        param="step",
        hint=f"wait for the save to finish, or point {name} at step {done} (the newest complete one), or pass "
        f"`step` {done}",
    )


def _staged_note(root: Path, units: list[_Unit], want: int) -> str:
    """What ``latest`` (step ``want``) says of a finished save of a newer step under a staging name (``step-3.tmp``
    with its ``.metadata``), else ``""``."""
    staged = [(f[0], u.model, f[1]) for u in units if u.step is None and (f := _suffixed_step(u.model, root))]
    staged = [(n, m, name) for n, m, name in staged if n > want]
    if not staged:
        return ""
    # one torchtitan's resume takes as its step (step-3.tmp) is a newer step not loaded (_resume_skipped, R001)
    staged = [(n, m, name) for n, m, name in staged if not ((t := _TITAN_STEP.search(m.name)) and int(t.group(1)) == n)]
    if not staged:
        return ""
    n, m, name = max(staged)
    return (
        f"; {_rel(m, root)} holds a finished save of step {n} under a staging name, not renamed "
        "(no trainer's resume lists it)"
    )


def _staged_hint(root: Path, units: list[_Unit], want: int | str | None) -> str | None:
    """The hint for ``step`` ``want`` found only as a finished save under a staging name (``step-3.tmp``), else
    ``None``."""
    for u in units:
        f = _suffixed_step(u.model, root) if u.step is None else None
        if f is not None and f[0] == want:
            return (
                f"{shell_arg(u.model)} holds a finished save of step {want} under a staging name, not renamed to "
                f"{f[2]}: pass that directory itself"
            )
    return None


def _suffixed_step(p: Path, root: Path) -> tuple[int, str, str] | None:
    """``(step, its name, the step directory's name)`` of the nearest directory from ``p`` up to (not including) ``root`` named
    ``<step directory>.<suffix>`` (``step-3.tmp``, ``checkpoint-3.partial``: a save staged under another name) with
    no step directory of that step and series beside it (:func:`_step_beside`); else ``None``. torchtitan's resume matches ``step-(\\d+)`` anywhere
    in a name: a finished ``step-3.tmp`` is a step to it, an unfinished one a step whose save did not finish."""
    q = p
    while q != root and q != q.parent:
        stem, dot, _ = q.name.partition(".")
        step = step_of(stem) if dot and stem else None
        if step is not None and not _step_beside(q.parent, stem, step):
            return step, q.name, stem
        q = q.parent
    return None


def _step_beside(parent: Path, stem: str, step: int) -> bool:
    """Whether ``parent`` holds a step directory of ``step`` in the series of step directory name ``stem``
    (``step-3`` beside ``step-03.tmp``: its save renamed there, as the trainers' resume lists it)."""
    try:
        with os.scandir(parent) as entries:
            names = [e.name for e in entries if e.is_dir()]
    except OSError:
        return False
    series = re.sub(r"\d+", "N", stem)
    return any(step_of(n) == step and re.sub(r"\d+", "N", n) == series for n in names)


def _step_dir(p: Path, root: Path) -> Path | None:
    """The nearest step-named directory from ``p`` up to (not including) ``root``, else ``None``."""
    q = p
    while q != root and q != q.parent:
        if step_of(q.name) is not None:
            return q
        q = q.parent
    return None


def _series(step_dir: Path) -> tuple[Path, str]:
    """The series a step directory belongs to: its parent and its name with each number as ``N`` (``step-N``,
    ``iter_N``, ``epoch_N_step_N``): one trainer's saves of one run."""
    return step_dir.parent, re.sub(r"\d+", "N", step_dir.name)


def _refuse_several_series(root: Path, units: list[_Unit], bad: dict[int, IncompleteStep]) -> None:
    """E204 when ``latest`` (no ``latest`` file) would compare the step numbers of several series of step directories
    (two trainers' names, ``step-N`` beside ``checkpoint-N``, or two runs' folders below ``root``): their numbers do
    not count the same training, so the highest of them is no run's newest step."""
    newest: dict[tuple[Path, str], tuple[int, Path]] = {}
    for step, path in [(u.step, u.model) for u in units] + [(i.step, i.path) for i in bad.values()]:
        d = _step_dir(path, root) if step is not None else None
        if step is None or d is None:
            continue
        key = _series(d)
        if key not in newest or step > newest[key][0]:
            newest[key] = (step, d)
    if len(newest) < 2:
        return
    shown = sorted(newest.items(), key=lambda kv: (str(kv[0][0]), kv[0][1]))
    listed = "; ".join(f"{_rel(parent / name, root)} (newest {_rel(d, root)})" for (parent, name), (_, d) in shown)
    example = shell_arg(shown[-1][1][1])
    raise AmbiguousCheckpointError(  # no ``steps``: they are no one run's, which stats would follow in order
        f"{root}: `step` latest, but the step directories below it are of {len(newest)} series (other trainers' "
        f"or runs' saves, whose step numbers do not compare): {listed}",
        path=root,
        param="step",
        hint=f"pass the folder of the run you mean (or its newest step directory, e.g. {example}), or pick a step "
        "with `step` N",
    )


def _release_units(root: Path, units: list[_Unit], pointer: str) -> tuple[list[_Unit], str]:
    """The checkpoint in ``root/release`` that a ``latest`` file holding ``release`` names (Megatron-LM loads it).

    Raises:
        StepNotFoundError: no checkpoint there.
    """
    release = root / RELEASE
    found = [u for u in units if u.model == release or release in u.model.parents]
    if not found:
        raise StepNotFoundError(
            f"{root / pointer}: names the release checkpoint, but {release} holds none "
            f"(found {', '.join(u.label(root) for u in units[:6])})",
            path=root / pointer,
            param="step",
            hint=f"write the iteration into {pointer} (e.g. 100), or pass `step` N",
        )
    return found, f"`step` latest: {RELEASE}/ (named by {pointer})"


def _ambiguous(
    root: Path, units: list[_Unit], step: int | str | None, incomplete: frozenset[int] = frozenset()
) -> AmbiguousCheckpointError:
    """The error for several checkpoints below ``root`` (E204), listing them (the steps whose save did not
    finish, ``incomplete``, marked so and never the example)."""
    shown = "; ".join(u.label(root) for u in units[:10]) + (f" (+{len(units) - 10} more)" if len(units) > 10 else "")
    steps = sorted({u.step for u in units if u.step is not None})
    if len(steps) > 1 and step is None:
        listed = sorted({*steps, *incomplete})  # a newer step whose save did not finish too: not a silent gap
        named = ", ".join(f"{s} (incomplete)" if s in incomplete else str(s) for s in listed[:10])
        # the newest complete step (not a stepless folder beside the steps, such as an export written into the run)
        example = next((u for u in reversed(units) if u.step is not None and u.step not in incomplete), units[-1])
        hint = (
            f"pick one with `step` latest or `step` N (steps {named}), "
            f"or pass a directory, e.g. "
            f"{shell_arg(example.model if example.optimizer is None else example.model.parent)}"
        )
    else:
        main = hub_snapshot(root)  # a hub repository folder: the revision refs/main names is the example
        pick = next((u for u in units if main is not None and u.model == main), None)
        hint = f"pass one of them, e.g. {shell_arg((pick or units[0]).model)}"
        hint += " (the snapshot refs/main names)" if pick is not None else ""
    what = f"no .metadata; {len(units)} checkpoints below it"
    if step is not None and len(steps) == 1 and all(u.step == steps[0] for u in units):
        # one step number in several directories (``step-10`` beside ``step-010``): `step` cannot pick one
        what = f"step {steps[0]} is saved in {len(units)} directories below it"
    err = AmbiguousCheckpointError(
        f"{root}: {what}: {shown}",
        path=root,
        hint=hint,
    )
    err.steps = tuple(
        sorted(
            (u.step, str(u.model if u.optimizer is None else u.model.parent))
            for u in units
            if u.step is not None and u.step not in incomplete
        )
    )
    return err


def _prefixed(md: CheckpointMetadata, prefix: str) -> dict[tuple[str, tuple[int, ...] | None], StorageInfo]:
    return {k: v._replace(relative_path=f"{prefix}/{v.relative_path}") for k, v in md.storage.items()}


def compose_pair(
    model_dir: Path, model_md: CheckpointMetadata, optim_dir: Path, optim_md: CheckpointMetadata
) -> tuple[Path, CheckpointMetadata, dict[str, Path]]:
    """One metadata over a model checkpoint and an optimizer checkpoint saved separately.

    Returns:
        ``(root, metadata, parts)``: their common parent, the merged metadata (each part's
        ``relative_path`` s prefixed by the part's folder relative to ``root``), and the parts
        (prefix -> directory) for confinement.

    Raises:
        SchemaError: both hold the same key, or they are stored differently (``.distcp`` and safetensors).
    """
    a, b = model_dir.resolve(), optim_dir.resolve()
    if a == b:
        raise UsageError(
            f"`optimizer_dir` {optim_dir} is the model checkpoint itself",
            param="optimizer_dir",
            hint="`optimizer_dir` names a separate optimizer checkpoint (e.g. checkpoint-N/optimizer_0); "
            "leave it out when the checkpoint holds its optimizer state",
        )
    root = Path(os.path.commonpath([a, b]))
    pa, pb = str(a.relative_to(root)), str(b.relative_to(root))
    if pa in (".", "") or pb in (".", ""):
        raise UsageError(
            f"`optimizer_dir` {optim_dir} and {model_dir}: one lies inside the other",
            param="optimizer_dir",
            hint="pass two sibling checkpoint folders",
        )
    both = [k for k in model_md.entries if k in optim_md.entries]
    if both:
        raise SchemaError(
            f"{model_dir} and {optim_dir} both hold {both[0]!r}"
            + (f" (+{len(both) - 1} more)" if len(both) > 1 else ""),
            param="optimizer_dir",
            hint="pass a model-only checkpoint and an optimizer-only checkpoint",
        )
    serialization = model_md.serialization
    if {model_md.serialization, optim_md.serialization} == {"safetensors", "torch_save"}:
        # NeMo Automodel: model/ by HuggingFaceStorageWriter, optim/ by dcp.save; the chunk locator
        # reads the .safetensors files' windows raw and the .distcp archives as archives
        serialization = "mixed"
    elif model_md.serialization != optim_md.serialization:
        raise SchemaError(
            f"{model_dir} and {optim_dir} are stored differently ({model_md.serialization} vs {optim_md.serialization})",
            param="optimizer_dir",
        )
    md = CheckpointMetadata(
        entries={**model_md.entries, **optim_md.entries},
        storage={**_prefixed(model_md, pa), **_prefixed(optim_md, pb)},
        planner_data={**model_md.planner_data, **optim_md.planner_data},
        version=model_md.version,
        checkpoint_id=model_md.checkpoint_id,
        save_id=model_md.save_id,
        serialization=serialization,
        writer=model_md.writer if model_md.writer == optim_md.writer else None,
        # NeMo Automodel's model/ of 2+ ranks: HuggingFaceStorageWriter's per-rank shards, whose completeness the
        # pair must keep proving (a rank's file missing leaves tensors of the pieces present)
        shards=model_md.shards if model_md.shards is not None else optim_md.shards,
    )
    if not model_md.entries:
        raise MetadataError(f"{model_dir}: the checkpoint holds no entries", path=model_dir)
    return root, md, {pa: model_dir, pb: optim_dir}
