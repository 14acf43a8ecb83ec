"""The one read helper: positional reads that fill a buffer or stream a byte range block by block.

Every read of checkpoint data goes through :func:`read_into` or :func:`read_blocks` (only
the archive window's file-object ``readinto``, one read that may be short, reads itself). Reads use
``os.preadv`` on shared descriptors: no file position, safe from several threads, and the GIL
is released while the kernel copies. A block is :data:`BLOCK_BYTES` (1 MiB): it stays in the
CPU cache between the read and whatever consumes it (a CRC-32, a digest, a ``pwrite``, a
comparison), which beats larger blocks (``docs/performance.md``).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = [
    "BLOCK_BYTES",
    "ShortReadError",
    "block_buffer",
    "read_blocks",
    "read_exact",
    "read_into",
    "read_upto",
    "start_writeback",
    "write_all",
]

BLOCK_BYTES = 1 << 20
_local = threading.local()


class ShortReadError(EOFError):
    """The file ended before the requested bytes were read (it was truncated, or changed).

    Callers turn it into their own :class:`~ckpttool.errors.CkptError` naming the file and key.

    Attributes:
        offset: the file offset at which the read found the end of the file.
        missing: how many requested bytes were not read.
    """

    def __init__(self, offset: int, missing: int) -> None:
        super().__init__(f"source ends at offset {offset}, {missing} bytes short")
        self.offset = offset
        self.missing = missing


def block_buffer() -> memoryview:
    """This thread's reusable :data:`BLOCK_BYTES` buffer (a ``memoryview`` of a ``bytearray``)."""
    buf: memoryview | None = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = memoryview(bytearray(BLOCK_BYTES))
    return buf


def read_into(fd: int, buf: Any, offset: int) -> int:
    """Fill ``buf`` (any writable buffer: ``bytearray``, ``memoryview``, numpy array) from ``offset`` of ``fd``.

    Returns:
        The number of bytes read (``len`` of ``buf`` in bytes).

    Raises:
        ShortReadError: the file ends before ``buf`` is full.
        OSError: the read failed.
    """
    mv = memoryview(buf).cast("B")
    n = len(mv)
    got = _fill(fd, mv, offset)
    if got < n:
        raise ShortReadError(offset + got, n - got)
    return n


def _fill(fd: int, mv: memoryview, offset: int) -> int:
    """Read into ``mv`` (bytes) from ``offset`` of ``fd`` until it is full or the file ends; the bytes read."""
    got, n = 0, len(mv)
    while got < n:
        r = os.preadv(fd, [mv[got:]], offset + got)
        if r <= 0:
            break
        got += r
    return got


def read_exact(fd: int, n: int, offset: int) -> bytes:
    """``n`` bytes from ``offset`` of ``fd`` as ``bytes``.

    Raises:
        ShortReadError: the file ends before ``n`` bytes.
    """
    buf = bytearray(n)
    read_into(fd, buf, offset)
    return bytes(buf)


def read_upto(fd: int, n: int, offset: int) -> bytes:
    """Up to ``n`` bytes from ``offset`` of ``fd``: fewer only where the file ends first (never raises for that)."""
    mv = memoryview(bytearray(n))
    return bytes(mv[: _fill(fd, mv, offset)])


def write_all(fd: int, data: Any, offset: int) -> None:
    """Write all of ``data`` (a bytes-like object) at ``offset`` of ``fd`` (``os.pwrite`` until done).

    Raises:
        OSError: the write failed (``ENOSPC``, ``EFBIG``, ``EIO``, ...).
    """
    mv = memoryview(data).cast("B")
    written, n = 0, len(mv)
    while written < n:
        written += os.pwrite(fd, mv[written:], offset + written)


def read_blocks(fd: int, offset: int, length: int, buf: memoryview | None = None) -> Iterator[memoryview]:
    """Stream ``length`` bytes from ``offset`` of ``fd`` through ``buf``, one filled piece at a time.

    Each yielded ``memoryview`` is a prefix of ``buf`` (default: :func:`block_buffer`), valid
    until the next iteration; pieces are in file order and cover the range exactly once.

    Raises:
        ShortReadError: the file ends inside the range.
    """
    if buf is None:
        buf = block_buffer()
    size = len(buf)
    done = 0
    while done < length:
        want = min(size, length - done)
        got = os.preadv(fd, [buf[:want]], offset + done)
        if got <= 0:
            raise ShortReadError(offset + done, length - done)
        yield buf[:got]
        done += got


_writeback_fn: Any = None


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start the disk write-back of ``[offset, offset + length)`` of ``fd`` without waiting (Linux; else nothing).

    ``sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE)`` (libc, through ``ctypes``):
    the page cache is written to disk while the copy goes on, so the final ``fsync`` (still
    what makes the data durable) waits only for the last window instead of the whole file
    (``docs/performance.md``).
    """
    global _writeback_fn
    if _writeback_fn is None:
        _writeback_fn = False
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                fn = ctypes.CDLL(None, use_errno=True).sync_file_range
                fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
                fn.restype = ctypes.c_int
                _writeback_fn = fn
            except (OSError, AttributeError):  # no libc symbol (musl without it, another OS)
                pass
    if _writeback_fn:
        _writeback_fn(fd, offset, length, 2)  # SYNC_FILE_RANGE_WRITE; a failure here is seen by fsync
