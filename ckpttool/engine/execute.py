"""The one executor of byte plans (:mod:`ckpttool.engine.plan`).

:func:`run_item` streams an item's windows block by block through a per-thread
:data:`~ckpttool.engine.io.BLOCK_BYTES` buffer (:func:`~ckpttool.engine.io.block_buffer`): each
block is read once, transformed, and handed to every sink while it is still in the CPU cache.
:func:`run_items` runs many items on the shared pool (:mod:`ckpttool.engine.pool`);
:func:`run_split` runs one large item as two halves on two threads, the halves' CRC-32s
combined. :func:`run_lockstep` reads a :class:`~ckpttool.engine.plan.Lockstep` 's streams together,
slab by slab.
"""

from __future__ import annotations

import threading
from typing import Any

from ckpttool.engine.crc import crc32, crc32_combine
from ckpttool.engine.io import (
    BLOCK_BYTES,
    ShortReadError,
    block_buffer,
    read_blocks,
    read_into,
    start_writeback,
    write_all,
)
from ckpttool.engine.memcmp import first_difference
from ckpttool.engine.plan import (
    Compare,
    CompareStream,
    Crc32,
    Feed,
    Item,
    Lockstep,
    PairedSlabs,
    Sink,
    Stats,
    Window,
    WriteAt,
)
from ckpttool.engine.pool import map_ordered, overlap

__all__ = [
    "can_split",
    "lockstep_buffer",
    "release_lockstep_buffers",
    "run_item",
    "run_items",
    "run_lockstep",
    "run_split",
]

_local = threading.local()


def _scratch(name: str, nbytes: int = BLOCK_BYTES) -> memoryview:
    """This thread's buffer ``name`` of at least ``nbytes`` (kept for the next item: no page faults per item)."""
    buf: memoryview | None = getattr(_local, name, None)
    if buf is None or len(buf) < nbytes:
        buf = None
        buf = memoryview(bytearray(nbytes))
        setattr(_local, name, buf)
    return buf


def _read_stream(
    windows: tuple[Window, ...], out: memoryview, at: int, start: tuple[int, int] = (0, 0)
) -> tuple[int, int]:
    """Fill ``out`` with bytes ``[at, at + len(out))`` of the stream ``windows`` concatenated.

    ``start``: the index of a window that ends after ``at`` or an earlier one, and its first stream
    position (the value returned by the previous read of a stream read in order: each read then
    costs its own windows, not every window before it). Returns the same for the next read.

    Raises:
        ShortReadError: the windows end first (or a file ends inside one).
    """
    n = len(out)
    done = 0  # bytes of ``out`` filled
    i, pos = start  # the current window and its first stream position
    while i < len(windows) and done < n:
        w = windows[i]
        if at + done < pos + w.length:
            want = min(n - done, pos + w.length - (at + done))
            read_into(w.fd, out[done : done + want], w.offset + (at + done - pos))
            done += want
            if at + done < pos + w.length:
                break  # read on from this window next time
        pos += w.length
        i += 1
    if done < n:
        raise ShortReadError(pos, n - done)
    return i, pos


class _Write:
    __slots__ = ("fd", "offset", "every", "flushed")

    def __init__(self, s: WriteAt, lo: int) -> None:
        self.fd, self.offset, self.every, self.flushed = s.fd, s.offset, s.writeback, lo

    def feed(self, piece: memoryview, at: int) -> None:
        write_all(self.fd, piece, self.offset + at)
        end = at + len(piece)
        if self.every and end - self.flushed >= self.every:
            start_writeback(self.fd, self.offset + self.flushed, end - self.flushed)
            self.flushed = end

    def finish(self, hi: int) -> Any:
        if self.every and hi > self.flushed:
            start_writeback(self.fd, self.offset + self.flushed, hi - self.flushed)
        return None


class _Span:
    """A sink over stream bytes ``[start, end)``: only the part of each piece inside it is passed on."""

    __slots__ = ("start", "end", "crc", "fn")

    def __init__(self, start: int, end: int | None, fn: Any = None) -> None:
        self.start, self.end, self.crc, self.fn = start, end, 0, fn

    def feed(self, piece: memoryview, at: int) -> None:
        n = len(piece)
        a = self.start - at if self.start > at else 0
        b = n if self.end is None else min(n, self.end - at)
        if a < b:
            part = piece[a:b] if (a, b) != (0, n) else piece
            if self.fn is None:
                self.crc = crc32(part, self.crc)
            else:
                self.fn(part)

    def finish(self, hi: int) -> Any:
        return self.crc if self.fn is None else None


class _Spans:
    """CRC-32 spans fed only the pieces that reach them: pieces come in stream order, so a span is fed
    from its start on and dropped once a piece reaches its end (an item of 10^4 records read in 10^4
    pieces costs ~10^4 calls, not 10^8)."""

    __slots__ = ("todo", "next", "active")

    def __init__(self, spans: list[_Span]) -> None:
        self.todo = sorted(spans, key=lambda s: s.start)
        self.next = 0
        self.active: list[_Span] = []

    def feed(self, piece: memoryview, at: int) -> None:
        end, todo, i = at + len(piece), self.todo, self.next
        while i < len(todo) and todo[i].start < end:
            self.active.append(todo[i])
            i += 1
        self.next = i
        for s in self.active:
            s.feed(piece, at)
        self.active = [s for s in self.active if s.end is None or s.end > end]


class _Compare:
    """The other side of a comparison: its windows, read block by block into this thread's compare buffer."""

    __slots__ = ("windows", "first", "cursor")

    def __init__(self, windows: tuple[Window, ...]) -> None:
        self.windows = windows
        self.first: int | None = None
        self.cursor = (0, 0)

    def feed(self, piece: memoryview, at: int) -> None:
        if self.first is not None:
            return
        other = _scratch("cmp")[: len(piece)]
        self.cursor = _read_stream(self.windows, other, at, self.cursor)
        diff = first_difference(piece, other)
        if diff is not None:
            self.first = at + diff

    def finish(self, hi: int) -> Any:
        return self.first


class _Stats:
    """A :class:`~ckpttool.engine.plan.Stats` sink: whole slabs straight from the block, the part of a
    slab that a read leaves at a block's end carried (copied) to the next block."""

    __slots__ = ("s", "acc", "item", "step", "hi", "carry", "add")

    def __init__(self, s: Stats, hi: int) -> None:
        import numpy as np

        from ckpttool.engine.kernels import IEEE_BITS
        from ckpttool.engine.stats import SlabStats, add_slab, fold_slab  # numpy: only where statistics are asked for

        if s.dtype not in IEEE_BITS:
            raise ValueError(f"no statistics kernel for {s.dtype}")
        self.s, self.acc = s, SlabStats()
        self.add = add_slab if s.each is not None else fold_slab  # the value arrays only where ``each`` wants them
        self.item = np.dtype(IEEE_BITS[s.dtype][1]).itemsize
        self.step, self.hi = s.slab * self.item, hi
        self.carry = b""

    def _slab(self, raw: Any, at: int) -> None:
        out = self.add(self.acc, raw, self.s.dtype, self.s.need)
        if self.s.each is not None and out is not None:
            self.s.each(out[0], out[1], at // self.item)

    def feed(self, piece: memoryview, at: int) -> None:
        import numpy as np

        n, a = len(piece), 0
        if self.carry:  # the previous block ended inside a slab: complete it first
            a = min(n, self.step - len(self.carry))
            self.carry += piece[:a]
            if len(self.carry) == self.step or at + a == self.hi:
                self._slab(np.frombuffer(self.carry, np.uint8), at + a - len(self.carry))
                self.carry = b""
        raw = np.frombuffer(piece, np.uint8)
        while a < n:
            b = min(n, a + self.step)
            if b - a < self.step and at + b < self.hi:  # a slab cut short by the read: carried
                self.carry = bytes(piece[a:b])
                return
            self._slab(raw[a:b], at + a)
            a = b

    def finish(self, hi: int) -> Any:
        if self.carry:
            import numpy as np

            self._slab(np.frombuffer(self.carry, np.uint8), hi - len(self.carry))
        return self.acc


class _Paired:
    """A :class:`~ckpttool.engine.plan.PairedSlabs` sink: whole slabs straight from the block, a slab a
    block cuts short completed (copied) in this thread's slab buffer; the other stream's slab read beside it."""

    __slots__ = ("s", "step", "hi", "filled", "spans", "fed", "cursor")

    def __init__(self, s: PairedSlabs, hi: int) -> None:
        self.s, self.step, self.hi, self.filled = s, s.slab * s.width, hi, 0
        self.spans = [_Span(a, b) for a, b in s.spans]
        self.fed = _Spans(self.spans)  # the other stream's record spans, fed only the slabs that reach them
        self.cursor = (0, 0)  # slabs come in order: the other stream is read on from its last window

    def _slab(self, mine: memoryview, at: int) -> None:
        s = self.s
        first = at // s.width
        theirs = _scratch("theirs", self.step // s.width * s.other_width)[: len(mine) // s.width * s.other_width]
        self.cursor = _read_stream(s.reads, theirs, first * s.other_width, self.cursor)
        self.fed.feed(theirs, first * s.other_width)
        s.fn(mine, theirs, first)

    def feed(self, piece: memoryview, at: int) -> None:
        n, a = len(piece), 0
        if self.filled:  # the previous block ended inside a slab: complete it first
            mine = _scratch("mine", self.step)
            a = min(n, self.step - self.filled)
            mine[self.filled : self.filled + a] = piece[:a]
            self.filled += a
            if self.filled == self.step or at + a == self.hi:
                self._slab(mine[: self.filled], at + a - self.filled)
                self.filled = 0
        while a < n:
            b = min(n, a + self.step)
            if b - a < self.step and at + b < self.hi:  # a slab cut short by the read: completed later
                _scratch("mine", self.step)[: b - a] = piece[a:b]
                self.filled = b - a
                return
            self._slab(piece[a:b], at + a)
            a = b

    def finish(self, hi: int) -> Any:
        return tuple(span.finish(hi) for span in self.spans)


def _open(sink: Sink, lo: int, hi: int) -> Any:
    if isinstance(sink, WriteAt):
        return _Write(sink, lo)
    if isinstance(sink, Crc32):
        return _Span(sink.start, sink.end)
    if isinstance(sink, Feed):
        return _Span(sink.start, sink.end, sink.fn)
    if isinstance(sink, Stats):
        return _Stats(sink, hi)
    if isinstance(sink, PairedSlabs):
        return _Paired(sink, hi)
    if isinstance(sink, Compare):
        return _Compare((Window(sink.fd, sink.offset, _UNBOUNDED),))
    return _Compare(sink.reads)


_UNBOUNDED = 1 << 62  # a Compare's one window: the file's end is found by the read


def run_item(item: Item, *, lo: int = 0, hi: int | None = None, buf: memoryview | None = None) -> tuple[Any, ...]:
    """Stream bytes ``[lo, hi)`` of ``item`` (default: all of it) through ``buf`` into its sinks.

    Args:
        buf: the block buffer (default: this thread's :func:`~ckpttool.engine.io.block_buffer`).

    Returns:
        One result per sink, in order: ``Crc32`` its CRC-32 (of its span inside ``[lo, hi)``),
        ``Compare`` the first differing position (``None``: equal), ``Stats`` its
        :class:`~ckpttool.engine.stats.SlabStats`, ``PairedSlabs`` its spans' CRC-32s,
        ``WriteAt``/``Feed`` ``None``.

    Raises:
        ShortReadError: a window (or a compared file) ends early.
        OSError: a read or write failed.
    """
    if hi is None:
        hi = item.length
    if buf is None:
        buf = block_buffer()
    states = [_open(s, lo, hi) for s in item.sinks]
    crcs = [st for s, st in zip(item.sinks, states) if isinstance(s, Crc32)]
    fed: list[Any] = [st for s, st in zip(item.sinks, states) if not isinstance(s, Crc32)]
    if crcs:
        fed.append(_Spans(crcs))  # pure CRC-32s: fed after the other sinks, only where a piece reaches them
    transform = item.transform
    pos = 0  # the current window's first stream position
    for w in item.reads:
        a, b = max(lo, pos), min(hi, pos + w.length)
        for piece in read_blocks(w.fd, w.offset + (a - pos), b - a, buf) if a < b else ():
            if transform is not None:
                piece = transform(piece)
            for st in fed:
                st.feed(piece, a)
            a += len(piece)
        pos += w.length
        if pos >= hi:
            break
    return tuple(st.finish(hi) for st in states)


def run_items(items: list[Item], *, workers: int) -> list[tuple[Any, ...]]:
    """:func:`run_item` of every item on the shared pool (``workers`` at a time); results in item order.

    Raises:
        the first error in item order (see :func:`~ckpttool.engine.pool.map_ordered`).
    """
    return map_ordered(run_item, items, workers=workers)


def can_split(item: Item) -> bool:
    """Whether :func:`run_split` can run ``item`` in halves: CRC-32 combining is available and no sink
    needs its pieces in order (``Feed``, ``Stats`` and ``PairedSlabs``: not split)."""
    return crc32_combine is not None and not any(isinstance(s, (Feed, Stats, PairedSlabs)) for s in item.sinks)


def run_split(item: Item, mid: int, *, buf: memoryview | None = None) -> tuple[Any, ...]:
    """:func:`run_item` as two halves: ``[mid, length)`` on the overlap thread, ``[0, mid)`` here.

    Each ``Crc32`` span's two parts are combined (``crc32_combine``); a comparison gives the
    first half's difference, else the second's. The second half is always waited for (it may
    write into a file the caller closes next). Requires :func:`can_split`.

    Raises:
        as :func:`run_item` (the first half's error first).
    """
    assert can_split(item) and crc32_combine is not None
    n = item.length
    second = overlap(lambda: run_item(item, lo=mid, hi=n))
    try:
        first = run_item(item, lo=0, hi=mid, buf=buf)
    finally:
        rest = second.result()  # re-raises the helper's error; always waited for
    out: list[Any] = []
    for s, x, y in zip(item.sinks, first, rest):
        if isinstance(s, Crc32):
            tail = max(0, min(n if s.end is None else s.end, n) - max(s.start, mid))  # the span's bytes after mid
            out.append(int(crc32_combine(x, y, tail)))
        elif isinstance(s, (Compare, CompareStream)):
            out.append(x if x is not None else y)
        else:
            out.append(None)
    return tuple(out)


class _LockstepBuffers(threading.local):
    """This thread's slab buffer of each lockstep stream (``uint8`` numpy arrays, grown as needed)."""

    def __init__(self) -> None:
        self.bufs: list[Any] = []

    def get(self, slot: int, nbytes: int) -> Any:
        import numpy as np

        while len(self.bufs) <= slot:
            self.bufs.append(None)
        buf = self.bufs[slot]
        if buf is None or buf.size < nbytes:
            buf = self.bufs[slot] = np.empty(max(nbytes, BLOCK_BYTES), dtype=np.uint8)
        return buf[:nbytes]


class _Lockstep:
    bufs = _LockstepBuffers()


def lockstep_buffer(slot: int, nbytes: int) -> Any:
    """This thread's slab buffer of lockstep stream ``slot``: a ``uint8`` numpy array of ``nbytes`` (reused)."""
    return _Lockstep.bufs.get(slot, nbytes)


def release_lockstep_buffers() -> None:
    """Drop every thread's lockstep slab buffers (pool threads outlive a run; a later run allocates anew)."""
    _Lockstep.bufs = _LockstepBuffers()


def run_lockstep(ls: Lockstep) -> tuple[int, ...]:
    """Read ``ls`` 's streams slab by slab together and call ``ls.each`` on every group of slabs.

    Returns:
        Each stream's CRC-32 (zip polynomial), in order.

    Raises:
        ShortReadError: a stream's windows end early. OSError: a read failed. Whatever ``each`` raises.
    """
    n = ls.numel
    bufs = _Lockstep.bufs
    crcs = [0] * len(ls.streams)
    cursors = [(0, 0)] * len(ls.streams)  # each stream read in order: on from its last window
    for e0 in range(0, n, ls.slab):
        m = min(ls.slab, n - e0)
        slabs = []
        for i, (windows, item) in enumerate(zip(ls.streams, ls.itemsizes)):
            raw = bufs.get(i, m * item)
            cursors[i] = _read_stream(windows, raw, e0 * item, cursors[i])
            crcs[i] = crc32(raw, crcs[i])  # the slab is still in the CPU cache
            slabs.append(raw)
        ls.each(slabs, e0)
    return tuple(crcs)
