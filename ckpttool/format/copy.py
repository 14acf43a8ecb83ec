"""Copy a byte range from one file to another: the verbatim-copy primitive of export and reshard.

``copy_range`` is one engine item (:mod:`ckpttool.engine.plan`): read through the per-thread
block buffer (``BLOCK_BYTES``), written at the output offset (``WriteAt``). It is deliberately
not ``os.copy_file_range``: a DCP chunk's offset in its ``.distcp`` file never has the same page
phase as its offset in the output (torch's archives start at arbitrary offsets), and on ext4
without reflinks the kernel then assembles every destination page from two partial writes,
which is slower here than a read+write through a cache-sized buffer (``docs/performance.md``).
Neither file position is used or moved, so threads may share descriptors.
"""

from __future__ import annotations

from collections.abc import Callable

from ckpttool.engine.execute import run_item
from ckpttool.engine.plan import Crc32, Feed, Item, Sink, WriteAt

__all__ = ["copy_range"]


def copy_range(
    src_fd: int,
    dst_fd: int,
    src_offset: int,
    dst_offset: int,
    length: int,
    *,
    crc_span: tuple[int, int] | None = None,
    sink: tuple[int, int, Callable[[memoryview], object]] | None = None,
) -> int | None:
    """Copy ``length`` bytes at ``src_offset`` of ``src_fd`` to ``dst_offset`` of ``dst_fd``.

    Args:
        src_fd, dst_fd: open descriptors (read / write); their file positions are untouched.
        src_offset, dst_offset, length: in bytes.
        crc_span: ``(start, end)`` relative to ``src_offset``: compute the CRC-32 of those bytes
            as they pass through the buffer (still in the CPU cache: no second read).
        sink: ``(start, end, fn)``: ``fn`` is called, in order, with every piece of those bytes
            (relative to ``src_offset``) as it passes (a digest's ``update``: same pass, no second read).

    Returns:
        The CRC-32 of ``crc_span`` (``None`` without one).

    Raises:
        EOFError: (:class:`~ckpttool.engine.io.ShortReadError`) the source ends before ``length``
            bytes were read (a truncated file); callers turn it into their own error naming the file and key.
        OSError: reading or writing failed (``ENOSPC``, ``EIO``, ...).
    """
    sinks: list[Sink] = []
    if crc_span is not None:
        sinks.append(Crc32(*crc_span))
    if sink is not None:
        sinks.append(Feed(sink[2], sink[0], sink[1]))
    sinks.append(WriteAt(dst_fd, dst_offset))
    results = run_item(Item.of(src_fd, src_offset, length, *sinks))
    return results[0] if crc_span is not None else None
