"""The user's cache directory: where it is, whether it is used, and how an entry is read and stored.

Two codecs keep entries here: the parsed ``.metadata`` (:mod:`ckpttool.format.mdcache`, folder
``metadata-v2/``) and the model class's expected tensors (:mod:`ckpttool.ops.export.expected`,
folder ``model-shapes-v1/``). Each decodes its entries as untrusted input; this module gives
them the rest:

- location: ``$CKPTTOOL_CACHE_DIR``, else ``$XDG_CACHE_HOME/ckpttool`` (an absolute path),
  else ``~/.cache/ckpttool`` (:func:`cache_dir`); never inside a checkpoint;
- the switch: ``--no-cache`` (:func:`set_cache_enabled`) or ``CKPTTOOL_NO_CACHE`` (:func:`cache_enabled`);
- reading (:func:`read_entry`): a regular file only, opened without blocking (a FIFO or device
  at the path is never read), at most a cap's worth of bytes;
- storing (:func:`store_entry`): best effort, written to a temporary file in the entry's folder
  and renamed over the entry, so that a reader never sees half an entry; a read-only or
  missing cache directory is not an error (logged).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = [
    "CACHE_DIR_ENV",
    "NO_CACHE_ENV",
    "cache_dir",
    "cache_enabled",
    "read_entry",
    "set_cache_enabled",
    "store_entry",
]

log = logging.getLogger(__name__)

#: Environment variable naming the cache directory.
CACHE_DIR_ENV = "CKPTTOOL_CACHE_DIR"
#: Environment variable that turns the cache off when set to a non-empty value other than ``0``.
NO_CACHE_ENV = "CKPTTOOL_NO_CACHE"

_enabled: bool | None = None


def set_cache_enabled(flag: bool | None) -> None:
    """Turn the caches on or off for this process (``None``: back to the environment's choice)."""
    global _enabled
    _enabled = flag


def cache_enabled() -> bool:
    """Whether the caches are used (``--no-cache`` / ``CKPTTOOL_NO_CACHE``).

    ``CKPTTOOL_NO_CACHE`` unset, empty, ``0``, ``false``, ``no`` or ``off`` (any case): the caches are on.
    """
    if _enabled is not None:
        return _enabled
    return os.environ.get(NO_CACHE_ENV, "").strip().lower() in ("", "0", "false", "no", "off")


def cache_dir() -> Path:
    """``$CKPTTOOL_CACHE_DIR``, else ``$XDG_CACHE_HOME/ckpttool``, else ``~/.cache/ckpttool``."""
    given = os.environ.get(CACHE_DIR_ENV)
    if given:
        return Path(given)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "ckpttool"


def read_entry(path: Path, max_bytes: int | None = None, *, logger: logging.Logger = log) -> bytes | None:
    """The bytes of the cache entry ``path`` when it is a regular file; ``None`` when it is missing,
    unreadable or special (logged to ``logger``). With ``max_bytes``, at most ``max_bytes + 1`` bytes
    are read (the caller rejects a longer entry).

    Opened with ``O_NONBLOCK``: a FIFO at the path neither blocks the open nor is read, nor is a
    device (``/dev/zero`` would never end).
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                logger.info("cache entry %s ignored (not a regular file)", path)
                return None
            return f.read() if max_bytes is None else f.read(max_bytes + 1)
    except OSError:
        return None


def store_entry(
    path: Path, build: Callable[[], bytes | Sequence[bytes | memoryview]], what: str, *, logger: logging.Logger = log
) -> None:
    """Write the entry ``build()`` (its bytes, or its parts in order) at ``path`` (temporary file + rename), best effort.

    A failure to build it (``ValueError``, ``TypeError``, ``OverflowError``) or to write it
    (``OSError``) leaves no entry and no temporary file; it is logged to ``logger`` as
    ``"<what> not written (<error>)"`` and is not an error.
    """
    try:
        blob = build()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                for part in [blob] if isinstance(blob, bytes) else blob:
                    f.write(part)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except (OSError, ValueError, TypeError, OverflowError) as e:
        logger.info("%s not written (%s: %s)", what, type(e).__name__, e)
