"""Atomic output directories (``docs/design.md`` §7).

:class:`AtomicOutputDir` writes into a temporary sibling ``.<name>.ckpttool-tmp-<pid>-<token>``
and renames it into place only when complete, so a failed or interrupted run never leaves
output that looks complete. Both the temporary directory and the output carry the marker of
:mod:`ckpttool.format.marker` (``.ckpttool-output.json``). A non-empty target is refused unless
``overwrite=True``, and even then only one whose marker agrees with its contents
(:func:`~ckpttool.format.marker.ownership`; anything else is :class:`ForeignOutputError`, E606);
it is replaced only after the new output is complete (renamed aside, restored if the swap fails;
signals deferred between the renames, :func:`signals_deferred`), and the old copy is deleted only
if it still agrees with its marker. A temporary directory left by a killed run is removed by the
next run on the same path only when its marker proves it (:func:`~ckpttool.format.marker.stale_verdict`);
any other is reported and left. ``docs/security.md`` (outputs).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import signal
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from ckpttool.errors import ForeignOutputError, OutputError
from ckpttool.format import marker
from ckpttool.format.files import hub_repository, refuse_unexpanded_tilde_output

__all__ = [
    "AtomicOutputDir",
    "absolute_path",
    "OutputTarget",
    "Terminated",
    "check_output_target",
    "nearest_unwritable",
    "unwritable_reason",
    "foreign_output_error",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_file_target",
    "forget_published",
    "published",
    "signal_received",
    "signals_deferred",
    "signals_held",
    "stop_signals",
    "restore_signals",
]

log = logging.getLogger(__name__)
_defer_depth = 0  # signals_deferred() nesting (main thread only)
_deferred_signal: int | None = None
_signal_received = False  # set by AtomicOutputDir's handler, never cleared: the process is stopping
_published: list[Path] = []  # outputs moved into place by this process, in order (published())
_writing: set[Path] = set()  # temporary directories of open AtomicOutputDirs: a file written there is not published


class Terminated(KeyboardInterrupt):
    """Raised in the main thread on SIGTERM (or SIGHUP) while an output directory is open.

    A ``KeyboardInterrupt``, so every layer that handles Ctrl-C (exit 130) handles it too.
    """


def absolute_path(path: str | os.PathLike[str]) -> Path:
    """Absolute, normalized ``path`` without resolving a symlink in its final component.

    A ``..`` means what it means to the kernel (and a shell): the parent of the directory before it, after
    following symlinks (``link/../X`` is beside the link's target, not beside the link), and only when that
    directory exists (``missing/../X`` names nothing, even though the text normalizes to ``X``).

    Raises:
        OutputError: a ``..`` follows a component that is not an existing directory.
    """
    text = os.fspath(path)
    parts = Path(text).parts
    if ".." not in parts:
        return Path(os.path.abspath(text))
    last = len(parts) - 1 - parts[::-1].index("..")
    for i, part in enumerate(parts[: last + 1]):
        if part == ".." and not os.path.isdir(os.path.join(*parts[:i]) if i else "."):
            before = os.path.join(*parts[:i])
            raise OutputError(
                f"{text}: cannot write there ({before} is not an existing directory, so {before}/.. names nothing)",
                path=Path(text),
                hint=f"create {before} first, or give the path without '..'",
            )
    head = os.path.realpath(os.path.join(*parts[: last + 1]))
    return Path(head, *parts[last + 1 :])


def foreign_output_error(target: Path, found: marker.Ownership) -> ForeignOutputError:
    """The E606 refusal of ``--overwrite`` for ``target``, naming what it holds and why it is not ours."""
    why = f"; {found.why}" if found.why else ""
    # a marker of a kind that disagrees with the files: an output of ckpttool with a file added since (a plot, a
    # report), or a marker copied into another folder; neither is provably ckpttool's
    ours = "not an output of ckpttool" if found.kind is None else "not provably an output of ckpttool"
    return ForeignOutputError(
        f"{target}: `overwrite` refused: it holds {found.found}, {ours}{why}",
        path=target,
        hint="ckpttool replaces only a directory it wrote itself (one whose "
        f"{marker.MARKER_NAME} agrees with its files) or an empty one; choose another output "
        "directory, or remove this one yourself if it is no longer needed",
    )


def refuse_hub_cache_output(target: str | os.PathLike[str], option: str = "output") -> None:
    """Refuse an output path inside a Hugging Face hub cache repository folder (:func:`hub_repository`): the folder
    is ``huggingface_hub``'s, a file written into a snapshot is taken for a file of that revision of the model
    (``scan_cache_dir``, ``from_pretrained`` read it), a folder beside the snapshots for a revision, and
    ``hf cache delete`` removes it with the model.

    Raises:
        OutputError (E600): ``target`` lies in such a folder.
    """
    repo = hub_repository(Path(target))
    if repo is None:
        return
    raise OutputError(
        f"{option} {target}: lies inside the Hugging Face hub cache's repository folder {repo}, which huggingface_hub "
        "manages (a file written there is taken for a file of the model, and `hf cache delete` removes it); "
        "ckpttool does not write into the hub cache",
        path=Path(target),
        hint="write it outside the hub cache"
        + (" with --output FILE (verify with --verify --output FILE)" if option == "manifest" else ""),
    )


def check_output_target(target: Path, *, overwrite: bool, source: Path | None = None) -> None:
    """Refuse a target that exists non-empty (without ``overwrite``) or overlaps the source.

    With ``overwrite`` a non-empty target is accepted only if it is provably a ckpttool output
    (:func:`ckpttool.format.marker.ownership`).

    Raises:
        OutputError: target is a file, non-empty without overwrite, or inside/equal to ``source`` or holding it
            (also through a symbolic link or a bind mount: compared by device and inode too), or starting with
            a ``~`` the shell did not expand (:func:`~ckpttool.format.files.refuse_unexpanded_tilde_output`).
        ForeignOutputError: (E606) ``overwrite`` and a non-empty target that is not provably ours.
    """
    refuse_unexpanded_tilde_output(target)
    target = absolute_path(target)
    refuse_hub_cache_output(target)
    if target.name == "":
        raise OutputError(
            f"{target}: cannot write there (not a directory name)",
            path=target,
            hint="choose a new or empty output directory",
        )
    t = target.resolve()
    if source is not None:
        s = source.resolve()
        # by path, and by device and inode: a bind mount of the source (or of a folder above it) hides no overlap
        if t == s or s in t.parents or t in s.parents or _inside_any(t, (s,)) or _inside_any(s, (t,)):
            raise OutputError(
                f"{target}: output overlaps the source checkpoint {source}",
                path=target,
                hint="write the output to a directory outside the checkpoint",
            )
    _refuse_unusable_place(target, t)
    if target.exists() or target.is_symlink():
        if not target.is_dir() or target.is_symlink():
            link = target.is_symlink()
            raise OutputError(
                f"{target} is a symbolic link: ckpttool writes a real directory there and replaces no link"
                if link
                else f"{target} exists and is not a directory: ckpttool writes the output as a directory",
                path=target,
                hint="choose a new or empty output directory (the directory the link points at, if that is the one)"
                if link
                else "choose a new or empty output directory (OUT is a directory, not a file)",
            )
        try:
            non_empty = any(target.iterdir())
        except OSError as e:
            raise OutputError(
                f"{target}: cannot write there ({e.strerror})", path=target, hint="choose a writable output location"
            ) from e
        if not non_empty:
            _refuse_mount_point(target)
            return
        found = marker.ownership(target)
        if not overwrite:
            raise OutputError(
                f"{target} exists and is not empty",
                path=target,
                hint="choose another output directory, or pass `overwrite` to replace this previous output "
                f"({found.found}: {marker.describe_contents(target)})"
                if found.owned
                else f"choose another output directory (it holds {found.found}, "
                + ("which ckpttool did not write" if found.kind is None else "not provably an output of ckpttool")
                + ": `overwrite` would not replace it)",
            )
        if not found.owned:
            raise foreign_output_error(target, found)
        _refuse_mount_point(target)


def _refuse_unusable_place(target: Path, t: Path) -> None:
    """Refuse an output ``target`` (resolved: ``t``) that is or holds the current directory, or whose nearest
    existing folder cannot be written.

    Raises:
        OutputError: as above.
    """
    try:
        cwd: Path | None = Path.cwd().resolve()
    except OSError:  # the working directory was removed
        cwd = None
    if cwd is not None and (t == cwd or t in cwd.parents) and target.is_dir() and not target.is_symlink():
        # the output is written beside OUT and renamed over it: the shell would be left in a removed directory
        # (`export CKPT .` in an empty folder "wrote nothing" there, and the next command failed E999)
        raise OutputError(
            f"{target}: is the current directory{'' if t == cwd else ' or holds it'}; ckpttool writes the output "
            "beside it and renames it into place, which would leave this shell in a removed directory",
            path=target,
            hint="name a new directory for the output (e.g. ./hf), or run ckpttool from another directory",
        )
    # the output is written beside OUT (in its parent, made first if missing) and renamed over it: --dry-run says
    # what the run would meet there, and the run says it before any work
    found = nearest_unwritable(target)
    if found is not None:
        raise OutputError(
            f"{target}: cannot write there ({found[0]} is not writable: {found[1]})",
            path=target,
            hint="choose a writable output location",
        )


def _refuse_mount_point(target: Path) -> None:
    """Refuse an output directory that is a mount point (a container's volume, a mounted disk): the output,
    written beside it, could not be renamed over it (EBUSY), which was found only after all the work.

    Raises:
        OutputError: ``target`` is a mount point.
    """
    if os.path.ismount(target):
        inside = nearest_unwritable(target / "out")
        raise OutputError(
            f"{target} is a mount point: ckpttool writes the output beside it and renames it into place, "
            "which a mount point does not allow",
            path=target,
            hint=f"name a new directory inside it for the output (e.g. {target / 'out'})"
            if inside is None
            else f"choose a writable output location (the mount point itself is not writable: {inside[1]})",
        )


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Defer SIGINT/SIGTERM/SIGHUP for the body; one that arrived meanwhile is raised on exit.

    For the steps that must not be cut short: the final renames, removing a temporary
    directory or a superseded output, waiting for worker threads before their files are
    closed. Deferral is done by :class:`AtomicOutputDir`'s handlers (they record the signal
    instead of raising while a body runs), not with ``pthread_sigmask``: a signal sent to
    the process is delivered to any thread that does not block it (a worker, a library's
    I/O thread) and Python then runs its handler in the main thread all the same. Outside
    an :class:`AtomicOutputDir`, or off the main thread, this defers nothing.

    Raises:
        KeyboardInterrupt: (or :class:`Terminated`) on exit, for a deferred signal.
    """
    global _defer_depth, _deferred_signal
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _defer_depth += 1
    try:
        yield
    finally:
        _defer_depth -= 1
        if _defer_depth == 0 and _deferred_signal is not None:
            signum, _deferred_signal = _deferred_signal, None
            _raise_for(signum)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """:func:`signals_deferred` outside an :class:`AtomicOutputDir` too: :func:`stop_signals`' handlers for the
    body (the previous ones put back after it), a signal that arrived meanwhile raised on exit.

    For a step that a signal must not cut short though no output is open: loading torch, whose
    ``torch.distributed`` initialisation runs Python code from C++ (pybind11), where a ``KeyboardInterrupt``
    aborts the process (SIGABRT) instead of unwinding. Off the main thread this holds nothing.

    Raises:
        KeyboardInterrupt: (or :class:`Terminated`) on exit, for a held signal.
    """
    old = stop_signals()
    try:
        with signals_deferred():
            yield
    finally:
        restore_signals(old)


def published() -> tuple[Path, ...]:
    """The outputs this process has moved into place, complete (an :class:`AtomicOutputDir` committed, an
    :func:`atomic_write_bytes` file renamed over its path), in order: an interrupt after them leaves them written."""
    return tuple(_published)


def forget_published() -> None:
    """Start :func:`published` afresh (the CLI, at each invocation: several run in one process under test)."""
    _published.clear()


def signal_received() -> bool:
    """Whether a :func:`stop_signals` handler (an open output) has seen SIGINT/SIGTERM/SIGHUP in this process."""
    return _signal_received


def stop_signals(on_signal: Callable[[], None] | None = None) -> dict[int, Any]:
    """Make SIGTERM and SIGHUP (and SIGINT, unless an embedding app set its own; SIGHUP unless ignored, as
    under ``nohup``) raise :class:`Terminated` / ``KeyboardInterrupt`` in the main thread, deferred inside
    :func:`signals_deferred`.

    ``on_signal`` is called first (from the handler). Returns the previous handlers, for
    :func:`restore_signals`; off the main thread nothing is installed (``{}``).
    """

    def handler(signum: int, frame: FrameType | None) -> None:
        global _deferred_signal, _signal_received
        _signal_received = True
        if on_signal is not None:
            on_signal()
        if _defer_depth:
            _deferred_signal = signum
            return
        _raise_for(signum)

    old: dict[int, Any] = {}
    try:
        old[signal.SIGTERM] = signal.signal(signal.SIGTERM, handler)
        hup = getattr(signal, "SIGHUP", None)  # the terminal closed; left alone under nohup (ignored)
        if hup is not None and signal.getsignal(hup) is signal.SIG_DFL:
            old[hup] = signal.signal(hup, handler)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # leave an embedding app's own
            old[signal.SIGINT] = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        pass
    return old


def restore_signals(old: dict[int, Any]) -> None:
    """Put back the handlers :func:`stop_signals` replaced (deferred: a signal midway would leave ours)."""
    with signals_deferred():
        for signum, handler in old.items():
            signal.signal(signum, handler)
        old.clear()


def _raise_for(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt()
    raise Terminated()


def _remove_marked(d: Path) -> None:
    """Remove a temporary directory proven ours, its marker last: cut short, what is left still proves it."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(d):
            if entry.name == marker.MARKER_NAME:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
        os.unlink(d / marker.MARKER_NAME)
        os.rmdir(d)


def _same_dir(a: str, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


class OutputTarget:
    """What an output directory is given, local (:class:`AtomicOutputDir`) or remote
    (``ckpttool.format.outputs.RemoteOutputDir``): the target, ``overwrite``, the source it may not
    overlap and the command writing it (``kind``, recorded in the marker with this run's id)."""

    def __init__(
        self,
        target: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        source: str | os.PathLike[str] | None = None,
        kind: str = "output",
    ) -> None:
        self.overwrite = overwrite
        self.kind = kind
        self.run = marker.new_run()
        self._old_handlers: dict[int, Any] = {}
        self._place(target, source)

    def _place(self, target: str | os.PathLike[str], source: str | os.PathLike[str] | None) -> None:
        """Set ``target`` and ``source`` as the subclass names them (and its own state)."""
        raise NotImplementedError


class AtomicOutputDir(OutputTarget):
    """Context manager yielding a temporary directory that becomes ``target`` on success.

    Args:
        target: final output directory (made absolute first; ``.`` works).
        overwrite: replace an existing non-empty ``target`` that is provably a ckpttool output
            (after success only).
        source: the source checkpoint; the target may not overlap it, and a temporary directory
            that is (or holds) it is never removed as stale.
        kind: the command writing it (``export``, ``import``, ``reshard``, ``sample``), recorded in
            the output's marker.

    Raises:
        OutputError: on entry, see :func:`check_output_target`; on exit, when the
            rename fails (the temporary directory is removed, an existing target kept).
        ForeignOutputError: (E606) on entry, ``overwrite`` of a directory ckpttool did not write.
    """

    def _place(self, target: str | os.PathLike[str], source: str | os.PathLike[str] | None) -> None:
        refuse_unexpanded_tilde_output(target)  # before absolute_path hides the `~` the user typed
        self.target = absolute_path(target)
        self.source = absolute_path(source) if source is not None else None
        self.tmp: Path | None = None
        self._created: list[Path] = []  # parents of target this run created, deepest first
        # Set by the handlers: an exception raised in a signal handler is lost when it lands
        # in a finalizer (``ZipFile.__del__``), so the commit checks this flag as well.
        self._interrupted = False

    def _clean_stale(self) -> None:
        """Remove the temporary directories of dead runs for this target that their marker proves
        ours; warn about (never remove) any other entry with such a name."""
        parent = self.target.parent
        try:
            entries = sorted(parent.iterdir()) if parent.is_dir() else []
        except OSError:
            return
        for p in entries:
            if ".ckpttool-tmp-" not in p.name:
                continue
            remove, why = marker.stale_verdict(p, self.target.name, source=self.source)
            if remove:
                log.info("removing stale temporary output %s", p)
                _remove_marked(p)
            elif why:
                log.warning("%s looks like a temporary output of ckpttool but is left in place: %s", p, why)

    def _on_signal(self) -> None:
        self._interrupted = True

    def __enter__(self) -> Path:
        check_output_target(self.target, overwrite=self.overwrite, source=self.source)
        parent = self.target.parent
        missing = []
        for a in (parent, *parent.parents):
            if a.exists() or a.is_symlink():
                break
            missing.append(a)
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self._created = missing
        except OSError as e:
            self._created = [a for a in missing if a.is_dir()]
            self._remove_created_parents()
            why = e.strerror or str(e)
            if isinstance(e, (FileExistsError, NotADirectoryError)):
                blocker = next((a for a in (parent, *parent.parents) if a.exists() or a.is_symlink()), parent)
                why = f"{blocker} is not a directory"
            raise OutputError(
                f"{self.target}: cannot write there ({why})", path=self.target, hint="choose a writable output location"
            ) from e
        except BaseException:  # Ctrl-C while the parents are made: none of them is left
            self._created = [a for a in missing if a.is_dir()]
            self._remove_created_parents()
            raise
        try:  # interrupted from here on (Ctrl-C, or SIGTERM once the handlers are in): no parent of this run is left
            self._clean_stale()
            # handlers first: a signal while the temporary directory and its marker are made is deferred,
            # then raised here, and the directory removed (never a leftover without a marker)
            self._old_handlers = stop_signals(self._on_signal)
            with signals_deferred():
                self.tmp = self._make_tmp(parent)
                _writing.add(self.tmp)
        except BaseException:
            if self.tmp is not None:
                _writing.discard(self.tmp)
                self._remove_tmp()
            else:
                self._remove_created_parents()
            self._restore_signal()
            raise
        return self.tmp

    def _make_tmp(self, parent: Path) -> Path:
        """Create the temporary directory with this run's ``"writing"`` marker in it.

        Raises:
            OutputError: the parent is not writable (nothing is left).
        """
        tmp = parent / marker.temp_name(self.target.name, self.run)
        try:
            tmp.mkdir()
        except OSError as e:
            raise OutputError(
                f"{parent}: cannot write there ({e.strerror})", path=parent, hint="choose a writable output location"
            ) from e
        try:
            marker.write_writing_marker(tmp, self.run)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise OutputError(
                f"{parent}: cannot write there ({e.strerror})", path=parent, hint="choose a writable output location"
            ) from e
        return tmp

    def _restore_signal(self) -> None:
        restore_signals(self._old_handlers)

    def _remove_tmp(self) -> None:
        """Remove the temporary directory and the parents of ``target`` this run created (no output: no trace)."""
        assert self.tmp is not None
        with signals_deferred():  # a second Ctrl-C must not cut the cleanup short (a leftover temp dir)
            shutil.rmtree(self.tmp, ignore_errors=True)
            self._remove_created_parents()

    def _remove_created_parents(self) -> None:
        for a in self._created:  # deepest first; one that another process filled meanwhile stays
            try:
                os.rmdir(a)
            except OSError:
                break
        self._created = []

    def _write_failure(self, exc: BaseException | None) -> str | None:
        """Why writing failed, when ``exc`` is a failed write (disk full, file too large, read-only, ...)."""
        if isinstance(exc, OSError) and exc.errno in (
            errno.ENOSPC,
            errno.EFBIG,
            errno.EROFS,
            errno.EACCES,
            errno.EDQUOT,
        ):
            return exc.strerror or str(exc)
        if isinstance(exc, shutil.Error):  # copytree: a list of (src, dst, why) and no errno
            errors = exc.args[0] if exc.args and isinstance(exc.args[0], list) else []
            why = next((str(e[-1]) for e in errors if e), str(exc))
            return why.replace(str(self.tmp), str(self.target))  # name the place the user knows
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc_type is not None:
                self._remove_tmp()
                if issubclass(exc_type, KeyboardInterrupt):
                    raise KeyboardInterrupt() from None
                why = self._write_failure(exc)
                if why is not None:
                    raise OutputError(
                        f"{self.target}: write failed ({why[:200]}); no output was left",
                        path=self.target,
                        hint="free disk space or choose another location",
                    ) from exc
                return
            if self._interrupted:  # the handler's exception was swallowed: stop here all the same
                self._remove_tmp()
                raise KeyboardInterrupt()
            self._seal()
            self._commit()
        finally:
            if self.tmp is not None:
                _writing.discard(self.tmp)
            self._restore_signal()

    def _seal(self) -> None:
        """Write the complete marker (every file and its digest) into the finished temporary directory."""
        assert self.tmp is not None
        try:
            marker.seal(self.tmp, self.run, self.kind)
        except BaseException as e:
            self._remove_tmp()
            if isinstance(e, OSError):
                raise OutputError(
                    f"{self.target}: write failed ({e.strerror or e}); no output was left",
                    path=self.target,
                    hint="free disk space or choose another location",
                ) from e
            raise

    def _remove_superseded(self, backup: Path) -> None:
        """Delete the previous output renamed aside, only if it still agrees with its marker (else keep it)."""
        with signals_deferred():  # interrupted, it would leak a whole previous output
            found = marker.ownership(backup)
            if not found.owned:
                log.error(
                    "the previous output at %s changed while the new one was written (%s); it was kept at %s",
                    self.target,
                    found.why or found.found,
                    backup,
                )
                return
            shutil.rmtree(backup, ignore_errors=True)

    def _commit(self) -> None:
        """Rename the finished temporary directory into place; on any failure remove it."""
        assert self.tmp is not None
        tmp, target = self.tmp, self.target
        backup: Path | None = None
        placed = False
        was_cwd = _same_dir(".", target)
        try:
            replace = self.overwrite and (target.exists() or target.is_symlink())
            if replace:
                # Re-check: the target may have changed while the output was written.
                check_output_target(target, overwrite=True, source=self.source)
                replace = any(target.iterdir())
            if not replace:
                # An absent or empty target: one atomic rename; a target that became non-empty
                # meanwhile (a concurrent run) fails with ENOTEMPTY/EEXIST.
                with signals_deferred():
                    os.rename(tmp, target)
                    placed = True
                    _published.append(target)
            else:
                backup = target.parent / f".{target.name}.ckpttool-old-{os.urandom(4).hex()}"
                # one deferred step from the first rename to the old copy's removal: a signal in between
                # would leave the whole previous output behind as `.OUT.ckpttool-old-*`
                with signals_deferred():
                    os.rename(target, backup)
                    try:
                        os.rename(tmp, target)
                    except OSError:
                        if not (target.exists() or target.is_symlink()):
                            try:
                                os.rename(backup, target)
                            except OSError:
                                log.error("the previous output was left at %s", backup)
                            backup = None  # restored, or the only copy left: never delete it
                        else:  # a concurrent run put its complete output in place: the old one is superseded
                            self._remove_superseded(backup)
                            backup = None
                        raise
                    placed = True
                    _published.append(target)
                    self._remove_superseded(backup)
                    backup = None
        except BaseException as e:
            if not placed:
                self._remove_tmp()  # deferred: a second signal must not cut it short
            if isinstance(e, OSError):
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise OutputError(
                        f"{target} exists and is not empty (written by another run meanwhile?)",
                        path=target,
                        hint="choose another output directory or pass `overwrite`",
                    ) from e
                raise OutputError(
                    f"{target}: cannot move the finished output into place ({e.strerror})",
                    path=target,
                    hint="choose another output directory",
                ) from e
            raise
        finally:
            if placed and was_cwd:
                with contextlib.suppress(OSError):
                    os.chdir(target)  # the old directory is gone: follow the new output


#: Bytes of an existing file that :func:`check_file_target`'s ``owned`` sees.
HEAD_BYTES = 4096


def check_file_target(
    path: str | os.PathLike[str],
    *,
    option: str,
    hint: str,
    sources: tuple[str | os.PathLike[str], ...] = (),
    inside_ok: bool = False,
    owned: Callable[[bytes], bool] | None = None,
) -> None:
    """Refuse a file path (a report, a manifest, a picture) where writing would destroy what ckpttool did not write.

    The file is written by :func:`atomic_write_bytes`: a new temporary file in ``path``'s directory renamed over
    ``path``, which replaces whatever entry is there. Refused (``docs/security.md``, outputs): a symbolic link
    (the rename would replace the link, not what it names); a directory, or anything but a regular file (a FIFO,
    a device, a socket); a path whose directory lies inside one of ``sources`` (the checkpoints or directories
    being read; compared by device and inode, so links and bind mounts do not hide it) unless ``inside_ok``; an
    existing regular file whose first :data:`HEAD_BYTES` bytes ``owned`` does not recognise as an output of this
    kind (no ``owned``: any existing file). An empty file outside the sources is replaced (nothing is lost);
    inside them (``inside_ok``) only an output of this kind is.

    Args:
        path: the file to be written; option: the flag that named it (for the message); hint: how to fix it.

    Raises:
        OutputError (E600): as above.
    """
    import stat

    refuse_unexpanded_tilde_output(path, option)
    p = Path(path)
    refuse_hub_cache_output(p, option)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise OutputError(f"{option} {p}: cannot be checked ({e.strerror})", path=p, hint=hint) from e
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise OutputError(f"{option} {p}: is a symbolic link; ckpttool replaces no link", path=p, hint=hint)
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO, device or socket)"
        raise OutputError(f"{option} {p}: is {kind}; ckpttool writes only regular files", path=p, hint=hint)
    why = unwritable_reason(p.parent)
    if why is not None:  # before the command's work (a --deep pass, statistics), not after it
        raise OutputError(f"{option} {p}: cannot write there ({p.parent} is not writable: {why})", path=p, hint=hint)
    inside = _inside_any(p.parent, sources)
    if inside is not None and not inside_ok:
        raise OutputError(
            f"{option} {p}: lies inside {inside}, which this command reads; ckpttool never writes into its source",
            path=p,
            hint=hint,
        )
    if st is None or (st.st_size == 0 and inside is None):
        return
    try:
        with open(p, "rb") as f:
            head = f.read(HEAD_BYTES)
    except OSError as e:
        raise OutputError(f"{option} {p}: cannot be read to check what it is ({e.strerror})", path=p, hint=hint) from e
    if owned is None or not owned(head):
        raise OutputError(
            f"{option} {p}: exists and is not an output of this kind that ckpttool wrote; it is left as it is",
            path=p,
            hint=hint,
        )


def nearest_unwritable(target: Path) -> tuple[Path, str] | None:
    """``(folder, why)`` when the nearest existing folder above ``target`` (where ``target`` and anything made on
    the way to it would be created) cannot be written (:func:`unwritable_reason`), else ``None``."""
    holder = next((a for a in target.parents if a.exists()), None)
    why = unwritable_reason(holder) if holder is not None else None
    return (holder, why) if holder is not None and why is not None else None


def unwritable_reason(directory: Path) -> str | None:
    """Why files cannot be created in the existing directory ``directory`` (``read-only file system``,
    ``permission denied``), else ``None`` (also for a directory that does not exist: its creation reports it).
    ``access(2)``: a root user is refused only by a read-only mount."""
    try:
        if not directory.is_dir() or os.access(directory, os.W_OK | os.X_OK):
            return None
    except OSError:
        return None
    try:
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        read_only = False
    return "read-only file system" if read_only else "permission denied"


def _inside_any(directory: Path, roots: tuple[str | os.PathLike[str], ...]) -> Path | None:
    """The first of ``roots`` that ``directory`` is or lies below (by device and inode of it and its parents)."""
    ids = {}
    for r in roots:
        try:
            st = os.stat(r)
        except OSError:
            continue
        ids[(st.st_dev, st.st_ino)] = Path(r)
    if not ids:
        return None
    d = directory.resolve()
    for a in (d, *d.parents):
        try:
            st = os.stat(a)
        except OSError:
            continue
        hit = ids.get((st.st_dev, st.st_ino))
        if hit is not None:
            return hit
    return None


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, fsync: bool = True, replace: bool = True) -> None:
    """Write a small file whole: a new file of a random name beside ``path`` (``O_EXCL | O_NOFOLLOW``: never
    through a link planted there), ``fsync`` ed unless told not, renamed over ``path``. A regular file it
    replaces keeps its permission bits (a ``0600`` picture stays ``0600``); a new one is ``0644`` less the umask.
    Interrupted (Ctrl-C; SIGTERM or SIGHUP, which raise :class:`Terminated` meanwhile) before the rename, the
    temporary file is removed: nothing is left beside ``path`` (often in a checkpoint: ``manifest``, ``stamp``).

    ``replace=False``: published only where nothing is (a hard link of the finished file, which fails on any name
    there, even one made after the caller looked; a file system without hard links: renamed when nothing is there).

    Raises:
        FileExistsError: ``replace=False`` and ``path`` exists (it is kept; the temporary file is removed).
        OutputError: the directory is not writable or the write failed (the temporary file is removed).
        KeyboardInterrupt: (or :class:`Terminated`) a signal arrived before the rename (the temporary file is removed).
    """
    old = stop_signals()
    try:
        _write_replace(Path(path), data, fsync, replace)
    finally:
        restore_signals(old)


def _write_replace(p: Path, data: bytes, fsync: bool, replace: bool = True) -> None:
    tmp = p.parent / f".{p.name}.ckpttool-tmp-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        try:
            st = os.stat(p, follow_symlinks=False)
            mode = stat.S_IMODE(st.st_mode) if stat.S_ISREG(st.st_mode) else None
        except FileNotFoundError:
            mode = None
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        if replace:
            os.replace(tmp, p)
        else:
            _publish_new(tmp, p)
        if not _writing.intersection(Path(os.path.abspath(p)).parents):  # not a file of an output still written
            _published.append(p)
        if not replace:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()  # the name `p` holds the file now
    except BaseException as e:
        with signals_deferred(), contextlib.suppress(OSError):  # a second signal must not leave it
            tmp.unlink()
        if not isinstance(e, OSError) or (isinstance(e, FileExistsError) and not replace):
            raise
        # Not E600's "another output directory or --overwrite": the place is the caller's (stamp's layout.json).
        hint = (
            f"{p} is a directory; move it away and run again"
            if isinstance(e, IsADirectoryError) or p.is_dir()
            else f"check that {p.parent} is a writable directory with free space"
        )
        raise OutputError(f"{p}: cannot write ({e.strerror})", path=p, hint=hint) from e


def _publish_new(tmp: Path, p: Path) -> None:
    """Give the finished ``tmp`` the name ``p`` only where nothing has that name (``FileExistsError`` else;
    ``IsADirectoryError`` where a directory has it)."""
    try:
        os.link(tmp, p, follow_symlinks=False)
    except FileExistsError:
        if os.path.isdir(p) and not os.path.islink(p):  # as a rename over it would say
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(p)) from None
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        if os.path.lexists(p):  # no hard links here: the rename is refused where a name is seen
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(p)) from None
        os.rename(tmp, p)
        return


def atomic_write_text(path: str | os.PathLike[str], text: str, *, replace: bool = True) -> None:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8 (``replace=False``: only where nothing is).

    Raises:
        FileExistsError: ``replace=False`` and ``path`` exists; OutputError: the directory is not writable.
    """
    atomic_write_bytes(path, text.encode("utf-8"), replace=replace)
