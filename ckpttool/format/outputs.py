"""Where a command writes its output directory: a local path or an object-store URL, one interface.

:func:`output_dir` yields a local staging directory that the writer fills with plain files;
on success it commits: a local target through
:class:`~ckpttool.format.atomic.AtomicOutputDir`, a URL through :class:`RemoteOutputDir`
(upload under a temporary sibling prefix, then old completion markers deleted, objects copied
server-side with the markers ``.metadata`` / ``model.safetensors.index.json`` /
``adapter_config.json`` last and ckpttool's own ``.ckpttool-output.json`` after them, stale objects
and the prefix deleted; ``--overwrite`` replaces only a prefix whose ``.ckpttool-output.json``
agrees with its objects, :mod:`ckpttool.format.marker`). Invariant: a target never
looks complete unless it is; a failed or interrupted upload leaves it untouched.
:func:`output_location` is what a writer reports. Protocol and failure cases:
``docs/storage.md``, "Writing to a URL: the commit protocol"; ``docs/design.md`` §7.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, cast

from ckpttool.engine.pool import map_ordered
from ckpttool.errors import OutputError
from ckpttool.format import marker
from ckpttool.format.atomic import (
    AtomicOutputDir,
    OutputTarget,
    check_output_target,
    foreign_output_error,
    restore_signals,
    signals_deferred,
    stop_signals,
)
from ckpttool.format.storage import RemoteStore, check_url_key, is_url, local_path, same_store, url_path

__all__ = [
    "OutputDir",
    "RemoteOutputDir",
    "check_target",
    "output_dir",
    "output_location",
    "remote_recording",
    "MARKERS",
]

log = logging.getLogger(__name__)

#: Files that make an output look complete; published last, deleted first on overwrite.
MARKERS = (".metadata", "model.safetensors.index.json", "adapter_config.json")


class OutputDir(Protocol):
    """What every output target offers: ``with target as tmp: ...`` (``tmp`` a local directory)."""

    def __enter__(self) -> Path: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Any: ...


def output_location(out: str | os.PathLike[str]) -> Path:
    """``out`` as a ``Path``, or as a ``UrlPath`` (typed ``Path``; prints as the URL) for a URL."""
    if is_url(out):
        return cast(Path, url_path(out))
    return Path(local_path(out))


def output_dir(
    target: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    source: str | os.PathLike[str] | None = None,
    kind: str = "output",
) -> OutputDir:
    """The output target for ``target``: :class:`AtomicOutputDir` for a path, :class:`RemoteOutputDir` for a URL.

    ``kind`` (the command: ``export``, ``import``, ``reshard``, ``sample``) is recorded in the output's
    marker (:mod:`ckpttool.format.marker`).
    """
    if is_url(target):
        return RemoteOutputDir(target, overwrite=overwrite, source=source, kind=kind)
    local_source = source if source is not None and not is_url(source) else None
    return AtomicOutputDir(local_path(target), overwrite=overwrite, source=local_source, kind=kind)


def check_target(
    target: str | os.PathLike[str], *, overwrite: bool = False, source: str | os.PathLike[str] | None = None
) -> None:
    """What entering :func:`output_dir` would refuse, checked without creating anything (``--dry-run``).

    Raises:
        OutputError: ``target`` exists non-empty without ``overwrite``, overlaps ``source``, is a file (a URL: an
            object).
        ForeignOutputError: (E606) ``overwrite`` of a directory (or prefix) ckpttool did not write.
    """
    if is_url(target):
        RemoteOutputDir(target, overwrite=overwrite, source=source).check()
        return
    local_source = Path(local_path(source)) if source is not None and not is_url(source) else None
    check_output_target(Path(local_path(target)), overwrite=overwrite, source=local_source)


def _remote_ownership(store: RemoteStore, existing: dict[str, int], *, replacing: bool = False) -> marker.Ownership:
    """Whether the objects below an output prefix are provably a ckpttool output (its marker agrees with the
    listing: names, sizes, digests of each object's first and last MiB by range requests); ``replacing``: or an
    interrupted ``--overwrite`` of one (:func:`marker.replacing_doc`), which ``--overwrite`` may finish."""
    doc, why = None, ""
    size = existing.get(marker.MARKER_NAME)
    if size is not None and size > marker.MAX_MARKER_BYTES:  # as a local one (read_marker): too large to be ours
        why = f"its {marker.MARKER_NAME} of {size} bytes is larger than any ckpttool marker"
    elif size is not None:
        doc = marker.parse_marker(store.read_whole(marker.MARKER_NAME, marker.MAX_MARKER_BYTES, what="marker"))
    sizes = {k: v for k, v in existing.items() if k != marker.MARKER_NAME}
    why = why or marker.listing_disagreement(doc, sizes, store.read_range, replacing=replacing)
    # the top-level names, as a directory's entries: an object below a sub-prefix names its folder; an object named
    # like the prefix itself with a trailing '/' that holds bytes (no folder marker: those are not listed) is '/'
    found = marker.describe_names({n.split("/", 1)[0] or "/" for n in existing})
    kind = doc.get("kind") if doc is not None and isinstance(doc.get("kind"), str) else None  # as a folder's
    return marker.Ownership(not why, found, why, kind)


@contextmanager
def remote_recording(store: RemoteStore, relative: str, data: bytes) -> Iterator[None]:
    """Keep the marker of a ckpttool output on a URL prefix true while the body writes ``data`` as the object
    ``relative`` into it (``manifest``, ``stamp``): the remote counterpart of :func:`marker.recording`. If the
    prefix was provably ckpttool's before (its ``.ckpttool-output.json`` agrees with the listing), the marker
    lists the new object afterwards (one PUT), so that ``--overwrite`` still replaces the output; a prefix that
    was not is left as it is. A marker that cannot be rewritten is logged (``--overwrite`` then refuses the
    prefix, which is safe).

    Raises:
        RemoteStorageError (E14x): the listing or a range read of the ownership check failed.
    """
    own = RemoteStore(store.path, store.config)  # a listing of its own: the reader's stays pinned to its ETags
    listed = dict(own.sizes())
    doc = None
    if marker.MARKER_NAME in listed and _remote_ownership(own, listed).owned:
        doc = marker.parse_marker(own.read_whole(marker.MARKER_NAME, marker.MAX_MARKER_BYTES, what="marker"))
    yield
    if doc is None:
        return
    size = len(data)
    head, tail = (data, b"") if size <= 2 * marker.WINDOW else (data[: marker.WINDOW], data[-marker.WINDOW :])
    doc["files"] = dict(sorted({**doc["files"], relative: [size, marker.digest_parts(size, head, tail)]}.items()))
    try:
        own.write_bytes(marker.MARKER_NAME, marker.marker_bytes(doc))
    except Exception as e:  # the output no longer proves itself ours: --overwrite refuses it (safe)
        log.warning("%s: could not add %s to %s (%s)", store.path, relative, marker.MARKER_NAME, type(e).__name__)


class RemoteOutputDir(OutputTarget):
    """An output written below a URL prefix, published only when complete (see the module docstring).

    Args:
        target: ``scheme://bucket/prefix`` of the output.
        overwrite: replace an existing output (one whose marker agrees with its objects).
        source: the source checkpoint; a target inside it (or holding it) is refused.
        kind: the command writing it, recorded in the marker.

    Raises:
        OutputError: on entry, a non-empty target without ``overwrite``, one that overlaps ``source``, the bucket
            itself, or a URL that names an existing object (with ``overwrite`` too: an object is never replaced).
        ForeignOutputError: (E606) ``overwrite`` of a prefix that is not provably a ckpttool output.
        RemoteStorageError (E14x): a request failed after its retries (nothing published).
    """

    def _place(self, target: str | os.PathLike[str], source: str | os.PathLike[str] | None) -> None:
        self.target = url_path(target)
        self.source = url_path(source) if source is not None and is_url(source) else None
        self.store: RemoteStore | None = None
        self.staging: Path | None = None
        self.tmp_store: RemoteStore | None = None
        self.uploaded: list[str] = []
        # copied into a target prefix that held nothing before, while the output is not complete yet: removed again
        # when the run fails or is interrupted (left there, they made the prefix one that --overwrite refuses)
        self.published: list[str] = []

    def __enter__(self) -> Path:
        self.check()
        # handlers first (SIGTERM too stops by an exception: __exit__'s cleanup runs), then the staging directory,
        # deferred: a Ctrl-C as it is made must not leave it in $TMPDIR with no __exit__ to remove it
        self._old_handlers = stop_signals()
        try:
            with signals_deferred():
                self.staging = Path(tempfile.mkdtemp(prefix="ckpttool-out-"))
        except BaseException:
            if self.staging is not None:
                shutil.rmtree(self.staging, ignore_errors=True)
            restore_signals(self._old_handlers)
            raise
        return self.staging

    def check(self) -> None:
        """The checks of entry, without staging anything (``--dry-run``).

        Raises:
            OutputError, ForeignOutputError: as the class says.
        """
        t = self.target
        check_url_key(t)  # before the overlap: s3://b/ck/../hf is no output inside s3://b/ck
        if self.source is not None and same_store(self.source, t):  # s3a://b/ck is s3://b/ck
            a, b = t.key.rstrip("/") + "/", self.source.key.rstrip("/") + "/"
            if a.startswith(b) or b.startswith(a):
                raise OutputError(
                    f"{t}: the output overlaps the source checkpoint {self.source}",
                    path=t,
                    hint="write the output to another prefix",
                )
        if "/" not in t.key.strip("/"):
            raise OutputError(
                f"{t}: name a prefix inside the bucket, not the bucket itself", path=t, hint="e.g. s3://bucket/out"
            )
        self.store = RemoteStore(t)
        if self.store.names_object():  # as a local OUT that is a file: ckpttool writes no output below a user's object
            raise OutputError(
                f"{t} is an object, not a prefix: ckpttool writes the output as objects below a prefix",
                path=t,
                hint="choose a new or empty output prefix (OUT names a prefix; the object is left as it is)",
            )
        self._check_existing(dict(self.store.sizes()))

    def _check_existing(self, existing: dict[str, int], since: str = "") -> None:
        """Refuse a target prefix holding ``existing`` (its listing): non-empty without ``overwrite``, or not
        provably a ckpttool output with it. ``since``: said of objects found by the re-check before publishing."""
        assert self.store is not None
        t = self.target
        if existing and not self.overwrite:
            raise OutputError(
                f"{t}: the output prefix {'now' if since else 'already'} holds {len(existing)} object(s){since}",
                path=t,
                hint="choose a new output prefix, or pass --overwrite to replace a previous output"
                + ("; nothing was published, the new objects are left as they are" if since else ""),
            )
        if existing:
            found = _remote_ownership(self.store, existing, replacing=True)
            if not found.owned:
                raise foreign_output_error(cast(Path, t), found)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc_type is None:
                self._commit()
        except BaseException:
            with signals_deferred():  # a second Ctrl-C must not cut the cleanup short
                self._remove_published()
                self._remove_tmp()
            raise
        finally:
            with signals_deferred():
                if self.staging is not None:
                    shutil.rmtree(self.staging, ignore_errors=True)
            restore_signals(self._old_handlers)

    def _pool(self, fn: Any, items: list[Any]) -> None:
        assert self.store is not None
        if not items:
            return
        workers = max(1, min(self.store.config.workers, len(items)))
        # every transfer runs even if one fails; the first error (in item order) is raised. Interrupted:
        # the queued transfers are dropped, the running ones finish (and are listed in `uploaded`, so the
        # cleanup removes them); deferred, so a second Ctrl-C cannot cut it short
        map_ordered(fn, items, workers=workers, guard=signals_deferred, finish_all=True)

    def _commit(self) -> None:
        assert self.store is not None and self.staging is not None
        t = self.target
        marker.seal(self.staging, self.run, self.kind)
        files = sorted(p.relative_to(self.staging).as_posix() for p in self.staging.rglob("*") if p.is_file())
        parent, _, name = t.key.rstrip("/").rpartition("/")
        tmp_url = f"{t.scheme}://{parent}/{marker.temp_name(name, self.run)}"
        self.tmp_store = RemoteStore(tmp_url, self.store.config)
        staging = self.staging
        tmp_store = self.tmp_store

        def upload(rel: str) -> None:
            tmp_store.put_file(staging / rel, rel)
            self.uploaded.append(rel)

        self._pool(upload, files)
        log.info("uploaded %d file(s) to %s", len(files), tmp_store.path)
        # listed again: a save (a trainer's, another ckpttool run's) may have written into the target prefix while
        # this run wrote its output, which the listing of entry did not hold (the local rename re-checks the same)
        self.store.forget_listing()
        listed = dict(self.store.sizes())
        self._check_existing(listed, since=", written there while this run wrote its output")
        old = set(listed)
        new = set(files)
        if old:  # our marker first: from here on, the prefix is not a complete output, but still provably ours
            self._mark_replacing(staging)
            self.store.remove(sorted(m for m in MARKERS if m in old))
        markers = [f for f in files if f in MARKERS]
        body = [f for f in files if f not in MARKERS and f != marker.MARKER_NAME]
        store = self.store
        fresh = not old

        def publish(rel: str) -> None:
            tmp_store.copy(rel, store, rel)
            if fresh:
                self.published.append(rel)

        self._pool(publish, body)
        stale = sorted(old - new)  # before the markers: the complete marker will not list them
        if stale:
            self.store.remove(stale)
        self._pool(publish, markers)  # last: the output looks complete only now
        self._pool(publish, [marker.MARKER_NAME])  # and is provably ckpttool's only now
        self.published = []  # complete: kept whatever happens next
        self._remove_tmp()
        self.store.forget_listing()
        log.info("published %d object(s) to %s (%d stale removed)", len(files), t, len(stale))

    def _mark_replacing(self, staging: Path) -> None:
        """Replace the old output's marker with one in state ``"replacing"`` (:func:`marker.replacing_doc`): a run
        cut short from here on (a kill, a lost link) leaves a prefix of old and new objects that ``--overwrite``
        still recognises as ckpttool's and replaces, where without a marker it refused it (E606)."""
        assert self.store is not None
        raw = self.store.read_whole(marker.MARKER_NAME, marker.MAX_MARKER_BYTES, what="marker")
        old = marker.parse_marker(raw)
        new = marker.parse_marker((staging / marker.MARKER_NAME).read_bytes())
        if old is None or new is None:  # checked just before: the prefix changed under this run
            raise OutputError(
                f"{self.target}: its {marker.MARKER_NAME} changed while this run wrote its output",
                path=self.target,
                hint="another run writes there; nothing was published, the objects are left as they are",
            )
        self.store.write_bytes(marker.MARKER_NAME, marker.marker_bytes(marker.replacing_doc(new, old)))

    def _remove_published(self) -> None:
        """Delete what this run copied into a target prefix that was empty before, the output not complete yet."""
        if self.store is not None and self.published:
            try:
                self.store.remove(list(self.published))
            except Exception as e:  # best effort: without its markers the prefix never looks complete
                log.warning("could not remove the objects published to %s (%s)", self.target, type(e).__name__)
            self.published = []

    def _remove_tmp(self) -> None:
        if self.tmp_store is not None and self.uploaded:
            try:
                self.tmp_store.remove(list(self.uploaded))
            except Exception as e:  # best effort: a temporary prefix is never read as an output
                log.warning("could not remove temporary prefix %s (%s)", self.tmp_store.path, type(e).__name__)
            self.uploaded = []
