"""A pickle's bytes as a file for ``pickle.Unpickler``, with a read across a ``FRAME``'s end refused.

Protocol 4+ pickles group opcodes in frames (``FRAME`` n: the next n bytes). ``pickle.dump`` ends
every frame between opcodes, but a crafted stream may end one inside an opcode's argument, and
CPython's readers then differ: the C unpickler reading a file holds a frame's bytes as its buffer
and, for a read across their end, skips the rest of them and reads on after the frame (``io.BytesIO``,
and a real file once the frame is larger than its peek window); ``pickle.loads`` and small frames
of a buffered file read straight on; the pure-Python unpickler refuses ("pickle exhausted before
end of frame"). :class:`FramedInput` is what the C unpickler reads from instead of ``io.BytesIO``:
the same bytes for each call, and ``pickle.UnpicklingError`` where a read (an opcode, one of its
argument's fields, a text line) starts inside a frame and ends after it. So a stream ckpttool
accepts is read with the same values by all of them. The native reader of ``.metadata``
(``engine/native/mdscan.c``) declines the same streams. A ``FRAME`` inside another frame's bytes
is followed as the C unpickler follows it: its bytes within the outer frame's, else refused.
"""

from __future__ import annotations

import ctypes
import io
import pickle
from functools import cache
from typing import Any

__all__ = [
    "FramedInput",
    "CROSSING",
    "CountedLengthError",
    "MemoIndexError",
    "PickleBombError",
    "check_memo",
    "pickle_input",
]

#: The refusal's text (the pure-Python unpickler's words for it).
CROSSING = "pickle exhausted before end of frame"

_FRAME = 0x95
_LINE = 0  # a read of one text line (its '\n' included); > 0: that many bytes; < 0: a length field of -n bytes, then that many


@cache
def _reads() -> dict[int, tuple[int, ...]]:
    """Opcode -> the reads of its argument, in order, as the C unpickler makes them (from ``pickletools``' table)."""
    import pickletools

    widths = {
        pickletools.TAKEN_FROM_ARGUMENT1: -1,
        pickletools.TAKEN_FROM_ARGUMENT4: -4,
        pickletools.TAKEN_FROM_ARGUMENT4U: -4,
        pickletools.TAKEN_FROM_ARGUMENT8U: -8,
    }
    table: dict[int, tuple[int, ...]] = {}
    for op in pickletools.opcodes:
        arg = op.arg
        if arg is None:
            reads: tuple[int, ...] = ()
        elif arg.n == pickletools.UP_TO_NEWLINE:
            reads = (_LINE, _LINE) if arg.name == "stringnl_noescape_pair" else (_LINE,)
        else:
            reads = (arg.n,) if arg.n >= 0 else (widths[arg.n],)
        table[op.code.encode("latin-1")[0]] = reads
    return table


def _check(start: int, end: int, fend: int) -> bool:
    """Whether a read of ``[start, end)`` starts at the frame's end ``fend`` (False: it lies inside the frame); raises where it crosses it."""
    if start == fend:
        return True
    if end > fend:
        raise pickle.UnpicklingError(f"{CROSSING} (its end: byte {fend})")
    return False


def _pending(data: bytes, start: int, fend: int) -> int:
    """The read that starts at ``fend``, the end of the frame whose bytes begin at ``start`` (an opcode's start).

    Walks the frame's opcodes as the C unpickler reads them. Returns -1 where that read is a
    ``FRAME``'s length, n >= 0 where it is the n bytes of a ``FRAME`` (a new frame), -2 for any
    other read. Raises ``UnpicklingError`` where a read crosses ``fend`` first.
    """
    table = _reads()
    x = start
    while x < fend:
        op = data[x]
        x += 1
        reads = table.get(op)
        if reads is None or op == ord("."):
            break  # the C unpickler stopped or failed there: it made no later read
        if op == _FRAME:
            if _check(x, x + 8, fend):
                return -1
            n = int.from_bytes(data[x : x + 8], "little")
            x += 8
            if x == fend:
                return n
            _check(x, x + n, fend)  # a frame inside this one: within its bytes, and read on
            continue
        for r in reads:
            if r == _LINE:
                nl = data.find(b"\n", x, fend)
                if _check(x, fend + 1 if nl < 0 else nl + 1, fend):
                    return -2
                x = nl + 1
                continue
            width = -r if r < 0 else r
            if _check(x, x + width, fend):
                return -2
            if r < 0:
                n = int.from_bytes(data[x : x + width], "little", signed=width == 4 and op in (ord("T"), 0x8B))
                x += width
                if n < 0 or _check(x, x + n, fend):
                    return -2
                x += n
            else:
                x += width
    return -2


class FramedInput:
    """``data`` as a file for ``pickle.Unpickler`` (``read``/``readline``, no ``peek``), each read checked against the frames.

    The unpickler asks for a frame's bytes with one ``read(n)`` (after ``read(1)`` of ``FRAME``
    and ``read(8)`` of its length) and reads the frame's opcodes from them; its next call comes at
    the frame's end, where a ``read(1)`` starts (nothing shorter runs past a buffer), and where
    anything longer may be a read that began inside the frame: only then are the frame's opcodes
    walked (:func:`_pending`), so a stream ``pickle.dump`` wrote costs three calls per frame.

    Raises:
        pickle.UnpicklingError: from ``read``/``readline``, a read across a frame's end (:data:`CROSSING`).
    """

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0
        self._frame = -1  # the start of the frame whose bytes the unpickler holds (it ends at _pos), or -1
        self._after = (
            0  # 1: the last read was one byte 0x95 (FRAME, where 8 bytes follow); 2: a FRAME's length was read
        )
        self._size = 0  # that FRAME's length

    def _next(self, n: int) -> None:
        """Update the state for a read of ``n`` bytes (-1: a line) at the current position; raises where it crosses a frame's end."""
        after, self._after = self._after, 0
        if self._frame >= 0:
            start, self._frame = self._frame, -1
            if n in (0, 1):
                after = 0
            else:
                kind = _pending(self._data, start, self._pos)
                after, self._size = (1, 0) if kind == -1 else (2, kind) if kind >= 0 else (0, 0)
        if after == 1 and n == 8:
            self._after, self._size = 2, int.from_bytes(self._data[self._pos : self._pos + 8], "little")
        elif after == 2 and n == self._size and n > 1:
            self._frame = self._pos
        elif n == 1 and self._data[self._pos : self._pos + 1] == b"\x95":
            self._after = 1

    def read(self, n: int = -1) -> bytes:
        """The next ``n`` bytes (fewer at the end; all that remain for ``n < 0``)."""
        if n < 0:
            n = len(self._data) - self._pos
        self._next(n)
        out = self._data[self._pos : self._pos + n]
        self._pos += len(out)
        if self._frame >= 0 and len(out) < n:
            self._frame = -1  # a frame past the end: the unpickler stops there
        return out

    def readline(self) -> bytes:
        """The next line, its ``b"\\n"`` included (the rest where there is none)."""
        self._next(-1)
        nl = self._data.find(b"\n", self._pos)
        end = len(self._data) if nl < 0 else nl + 1
        out = self._data[self._pos : end]
        self._pos = end
        return out


def pickle_input(data: bytes) -> Any:
    """The file ``pickle.Unpickler`` reads ``data`` from: :class:`FramedInput`, or ``io.BytesIO`` where no frame can be read.

    A ``FRAME`` the unpickler reads is a 0x95 byte whose next 8 bytes are a length within what
    follows; a stream with none (``pickle.dump`` below protocol 4: its ints' 0x95 bytes are followed
    by more opcodes, never by such a length) leaves the unpickler no frame's buffer to read across,
    and ``io.BytesIO`` costs no Python call per opcode there. The bytes are searched at C speed; past
    ``64 + len(data) // 1024`` 0x95 bytes without a ``FRAME`` (a stream of them) :class:`FramedInput` reads it.

    Raises:
        MemoIndexError: from :func:`check_memo`, before any unpickler runs.
    """
    check_memo(data)
    i, size, left = -1, len(data), 64 + (len(data) >> 10)
    while True:
        i = data.find(b"\x95", i + 1)
        if i < 0:
            return io.BytesIO(data)
        if left <= 0 or int.from_bytes(data[i + 1 : i + 9], "little") <= size - i - 9:
            return FramedInput(data)
        left -= 1


#: Memo slots a pickle may name beyond the ones it wrote before (pickle.dump numbers them 0, 1, 2, ...)
MEMO_SLACK = 256


class PickleBombError(pickle.UnpicklingError):
    """A pickle refused before any unpickler runs (:func:`check_memo`): it would make CPython's C unpickler allocate
    far more than the pickle's own size."""


class MemoIndexError(PickleBombError):
    """A memo index far beyond the memo slots a pickle wrote before it (:func:`check_memo`)."""


class CountedLengthError(PickleBombError):
    """An 8-byte length (``BINUNICODE8``, ``BINBYTES8``, ``BYTEARRAY8``) past the end of the stream
    (:func:`check_memo`): CPython's C unpickler allocates that many bytes before it reads them (``MemoryError``, and
    for ``BYTEARRAY8`` a ``SystemError`` it prints to stderr)."""


def walked(data: bytes) -> bool:
    """Whether :func:`check_memo` walks ``data``: it holds a byte of ``LONG_BINPUT``/``PUT`` (BINPUT's one-byte
    index and ``MEMOIZE`` are harmless) or of an 8-byte length's opcode."""
    return any(b in data for b in (b"r", b"p", b"\x8d", b"\x8e", b"\x96"))


def _length_error(size: int, at: int, n: int) -> CountedLengthError:
    return CountedLengthError(f"a length of {size} bytes at byte {at}, past the {n}-byte stream's end")


def check_memo(data: bytes) -> None:
    """Refuse a ``PUT``/``LONG_BINPUT`` that names a memo slot far beyond the slots written before it.

    CPython's C unpickler grows its memo to twice the index named and zeroes it: ``LONG_BINPUT``
    of slot 2**31 (an 11-byte pickle) makes it touch 32 GiB before any other check can run. A pickle
    written by ``pickle.dump`` or ``torch.save`` numbers its slots 0, 1, 2, ... in order, so an index
    above the count of memo writes before it (plus :data:`MEMO_SLACK`) is refused: the memo stays
    within 16 bytes per byte of the pickle. Walks the opcodes once (the stream's frames are walked
    through); a stream that holds no ``p``/``r`` byte is not walked. Stops where the stream does not
    parse (the unpickler then refuses it).

    Also refuses an 8-byte length (``BINUNICODE8``, ``BINBYTES8``, ``BYTEARRAY8``) past the end of the stream: the
    C unpickler allocates it before reading.

    Raises:
        MemoIndexError: a memo index beyond the bound (its value and position named).
        CountedLengthError: such a length (its value and position named).
    """
    if not walked(data):
        return
    if _native_check(data):
        return
    table = _reads()
    n = len(data)
    x = puts = 0
    while x < n:
        op = data[x]
        x += 1
        if op == 0x72 or op == 0x70 or op == 0x71 or op == 0x94:  # LONG_BINPUT, PUT, BINPUT, MEMOIZE
            if op == 0x72:
                idx, x = int.from_bytes(data[x : x + 4], "little"), x + 4
            elif op == 0x70:
                nl = data.find(b"\n", x)
                if nl < 0:
                    return
                try:
                    idx = int(data[x:nl])
                except ValueError:
                    return
                x = nl + 1
            else:
                idx, x = puts, x + (op == 0x71)
            if idx > puts + MEMO_SLACK:
                raise MemoIndexError(f"memo index {idx} at byte {x} after {puts} memo writes (a memory bomb)")
            puts += 1
            continue
        reads = table.get(op)
        if reads is None or op == 0x2E:  # unknown opcode, STOP
            return
        for r in reads:
            if r == _LINE:
                nl = data.find(b"\n", x)
                if nl < 0:
                    return
                x = nl + 1
            elif r > 0:
                x += r
            else:
                width = -r
                size = int.from_bytes(data[x : x + width], "little", signed=width == 4 and op in (0x54, 0x8B))
                if size < 0:
                    return
                if width == 8 and x + 8 <= n and size > n - x - 8:
                    raise _length_error(size, x - 1, n)
                x += width + size


@cache
def _native_table() -> bytes:
    """:func:`_reads` as the native walk's table: 3 signed bytes an opcode (count of reads or -1, the reads)."""
    out = bytearray(b"\xff\x00\x00" * 256)
    for op, reads in _reads().items():
        out[3 * op : 3 * op + 1 + len(reads)] = bytes([len(reads), *(r & 0xFF for r in reads)])
    return bytes(out)


def _native_check(data: bytes) -> bool:
    """:func:`check_memo`'s walk by the native kernel (``engine/native/pickmemo.c``): True where it found no
    index beyond the bound, False where the Python walk decides (no kernel, or a text ``PUT``).

    Raises:
        MemoIndexError: as :func:`check_memo`.
    """
    from ckpttool.engine import native

    fn = native.function(
        "ckpt_pickle_memo_check",
        ctypes.c_int64,
        ctypes.c_char_p,
        ctypes.c_int64,
        ctypes.c_char_p,
        ctypes.c_int64,
        ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ctypes.c_int64),
    )
    if fn is None:
        return False
    bad, before = ctypes.c_int64(), ctypes.c_int64()
    x = fn(bytes(data), len(data), _native_table(), MEMO_SLACK, ctypes.byref(bad), ctypes.byref(before))
    if x == -3:
        raise _length_error(bad.value, before.value, len(data))
    if x >= 0:
        raise MemoIndexError(f"memo index {bad.value} at byte {x} after {before.value} memo writes (a memory bomb)")
    return bool(x == -1)
