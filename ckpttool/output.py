"""Atomic output directories (DESIGN.md section 5).

Every command that writes a directory (``export``, ``reshard``) writes into a
temporary sibling ``.<name>.ckpttool-tmp-<pid>-<token>`` and renames it into
place only when complete, so an interrupted or failed run never leaves output
that looks complete. An existing non-empty target is refused unless
``overwrite=True``, and then replaced only after the new output is complete.
SIGTERM is turned into an exception while the directory is open so the
temporary directory is removed; a temporary directory left by a killed
(SIGKILL) run is removed by the next run that targets the same path.

Example::

    with AtomicOutputDir(out, overwrite=False, source=ckpt_dir) as tmp:
        write_files(tmp)
    # `out` now exists and is complete
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import shutil
import signal
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from .errors import OutputError

__all__ = ["AtomicOutputDir", "Terminated", "check_output_target", "atomic_write_text"]

log = logging.getLogger(__name__)
_TMP_RE = re.compile(r"^\.(?P<name>.+)\.ckpttool-tmp-(?P<pid>\d+)-[0-9a-f]+$")


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM while an output directory is open."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_output_target(target: Path, *, overwrite: bool, source: Path | None = None) -> None:
    """Refuse a target that exists non-empty (without ``overwrite``) or overlaps the source.

    Raises:
        OutputError: target is a file, non-empty without overwrite, or inside/equal to ``source``.
    """
    t = target.resolve()
    if source is not None:
        s = source.resolve()
        if t == s or s in t.parents or t in s.parents:
            raise OutputError(
                f"{target}: output overlaps the source checkpoint {source}",
                path=target, hint="write the output to a directory outside the checkpoint",
            )
    if target.exists() or target.is_symlink():
        if not target.is_dir() or target.is_symlink():
            raise OutputError(f"{target} exists and is not a directory", path=target)
        if any(target.iterdir()) and not overwrite:
            raise OutputError(f"{target} exists and is not empty", path=target,
                              hint="choose another output directory or pass --overwrite")


class AtomicOutputDir:
    """Context manager yielding a temporary directory that becomes ``target`` on success.

    Args:
        target: final output directory.
        overwrite: replace an existing non-empty ``target`` (after success only).
        source: the source checkpoint; the target may not overlap it.

    Raises:
        OutputError: on entry, see :func:`check_output_target`; on exit, when the
            rename fails.
    """

    def __init__(self, target: str | os.PathLike[str], *, overwrite: bool = False,
                 source: str | os.PathLike[str] | None = None) -> None:
        self.target = Path(target)
        self.overwrite = overwrite
        self.source = Path(source) if source is not None else None
        self.tmp: Path | None = None
        self._old_handler: Any = None

    def _clean_stale(self) -> None:
        parent = self.target.parent
        for p in parent.iterdir() if parent.is_dir() else ():
            m = _TMP_RE.match(p.name)
            if m and m.group("name") == self.target.name and not _pid_alive(int(m.group("pid"))):
                log.info("removing stale temporary output %s", p)
                shutil.rmtree(p, ignore_errors=True)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        raise Terminated()

    def __enter__(self) -> Path:
        check_output_target(self.target, overwrite=self.overwrite, source=self.source)
        parent = self.target.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"{parent}: cannot create output parent ({e.strerror})", path=parent) from e
        self._clean_stale()
        tmp = parent / f".{self.target.name}.ckpttool-tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            tmp.mkdir()
        except OSError as e:
            raise OutputError(f"{parent}: cannot write there ({e.strerror})", path=parent,
                              hint="choose a writable output location") from e
        self.tmp = tmp
        try:
            self._old_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread
            self._old_handler = None
        return tmp

    def _restore_signal(self) -> None:
        if self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)
            self._old_handler = None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        assert self.tmp is not None
        try:
            if exc_type is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
                if exc_type is Terminated:
                    raise KeyboardInterrupt() from None
                if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EDQUOT):
                    raise OutputError(f"{self.target}: write failed ({exc.strerror}); no output was left",
                                      path=self.target, hint="free disk space or choose another location") from exc
                return
            self._commit()
        finally:
            self._restore_signal()

    def _commit(self) -> None:
        assert self.tmp is not None
        target = self.target
        backup = None
        try:
            if target.exists():
                check_output_target(target, overwrite=self.overwrite, source=self.source)
                backup = target.parent / f".{target.name}.ckpttool-old-{secrets.token_hex(4)}"
                os.rename(target, backup)
            os.rename(self.tmp, target)
        except OSError as e:
            if backup is not None and not target.exists():
                os.rename(backup, target)
                backup = None
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise OutputError(f"{target}: cannot move the finished output into place ({e.strerror})",
                              path=target) from e
        finally:
            if backup is not None:
                shutil.rmtree(backup, ignore_errors=True)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write a small text file atomically (temp file in the same directory + ``os.replace``).

    Raises:
        OutputError: the directory is not writable.
    """
    p = Path(path)
    tmp = p.parent / f".{p.name}.ckpttool-tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise OutputError(f"{p}: cannot write ({e.strerror})", path=p) from e
