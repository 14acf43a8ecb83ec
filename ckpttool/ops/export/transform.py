"""The transform path of export: stored chunks streamed slab by slab into the output files.

A transforming export (cast, per-expert split, un-permutation, an adapter's row permutations
and merges) never assembles a tensor: each stored chunk is one work unit that reads its raw
record in slabs of at most :data:`SLAB_BYTES` (a chunk the locator cannot map is decoded by
``torch.load(weights_only=True)``), applies the value transform (:class:`SlabTransform`; ``None``
moves bytes unchanged) and writes each part where the layout (:class:`RunMap`: sorted,
non-overlapping runs over the source's C-order elements) says. Casts (:class:`Cast`) are
:func:`ckpttool.engine.kernels.cast`, bit-exact with torch's ``Tensor.to`` for every non-NaN
value; other dtype pairs use torch's ``Tensor.copy_``. Details: ``docs/export.md``, "The
transform path (slab transforms)"; ``docs/design.md`` §5, "The byte engine".
"""

from __future__ import annotations

import bisect
import math
import os
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ckpttool.engine.crc import crc32
from ckpttool.engine.io import BLOCK_BYTES
from ckpttool.errors import ChunkError, DataFileError, ExportError
from ckpttool.format.metadata import DTYPE_ITEMSIZE, ChunkMeta
from ckpttool.format.tiling import unravel

if TYPE_CHECKING:
    import numpy as np

    from ckpttool.format.locator import ChunkLocation
    from ckpttool.format.reader import CheckpointReader

__all__ = [
    "SLAB_BYTES",
    "Run",
    "RunMap",
    "RowPermutation",
    "SlabWhere",
    "SlabTransform",
    "Cast",
    "chunk_segments",
    "stream_chunk",
]

#: Source bytes per slab, one engine block: the slab and its output stay in the CPU cache between read,
#: transform and write.
SLAB_BYTES = BLOCK_BYTES


# ---------------------------------------------------------------------------------------------- geometry


def _ravel(index: Sequence[int], shape: Sequence[int]) -> int:
    flat = 0
    for i, s in zip(index, shape):
        flat = flat * s + i
    return flat


def chunk_segments(chunk: ChunkMeta, size: tuple[int, ...]) -> tuple[int, int, Callable[[int], int]]:
    """How a chunk's C-order storage maps onto the global tensor: equal contiguous segments.

    A chunk ``(offsets, sizes)`` spans the full global extent in its trailing dims after
    some dim ``k``; its storage is then ``prod(sizes[:k])`` segments of
    ``sizes[k] * prod(size[k+1:])`` elements, each contiguous in the global C order
    (FSDP's ``Shard(0)``: one segment; a ``Shard(1)`` chunk of a matrix: one per row).

    Args:
        chunk: the chunk (offsets and sizes per dim, elements).
        size: the global tensor's shape.

    Returns:
        ``(segment length, number of segments, start)`` where ``start(i)`` is the global flat
        index (elements) of segment ``i``'s first element.
    """
    ndim = len(size)
    if ndim == 0:
        return 1, 1, lambda i: 0
    k = ndim - 1
    while k > 0 and chunk.offsets[k] == 0 and chunk.sizes[k] == size[k]:
        k -= 1
    seg = chunk.sizes[k] * math.prod(size[k + 1 :])
    lead = chunk.sizes[:k]
    nseg = math.prod(lead)
    offs = chunk.offsets

    def start(i: int) -> int:
        idx = []
        for s in reversed(lead):
            i, r = divmod(i, s)
            idx.append(r)
        idx.reverse()
        g = [o + j for o, j in zip(offs[:k], idx)]
        g.append(offs[k])
        g.extend(0 for _ in range(ndim - k - 1))
        return _ravel(g, size)

    return seg, nseg, start


# ---------------------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Run:
    """Elements ``[src, src + length)`` of the source (flat C order) go to ``[dst, dst + length)`` of piece ``piece``."""

    src: int
    length: int
    piece: int
    dst: int


class RunMap:
    """Where each element of one source tensor is written: sorted, non-overlapping :class:`Run` s.

    Elements no run covers are not written (a split that drops part of a tensor).

    Raises:
        ValueError: runs that overlap.
    """

    def __init__(self, runs: Sequence[Run]) -> None:
        self.runs = sorted((r for r in runs if r.length > 0), key=lambda r: r.src)
        for a, b in zip(self.runs, self.runs[1:]):
            if a.src + a.length > b.src:
                raise ValueError(f"runs overlap at source element {b.src}")
        self._starts = [r.src for r in self.runs]
        self.rows = _row_permutation(self.runs)

    @classmethod
    def identity(cls, numel: int, piece: int = 0) -> RunMap:
        return cls([Run(0, numel, piece, 0)])

    @property
    def is_identity(self) -> bool:
        return len(self.runs) == 1 and self.runs[0].src == 0 and self.runs[0].dst == 0

    def parts(self, start: int, length: int) -> Iterator[tuple[int, int, int, int]]:
        """``(offset in the range, length, piece, piece element)`` for every run meeting ``[start, start+length)``."""
        end = start + length
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        runs = self.runs
        while i < len(runs):
            r = runs[i]
            if r.src >= end:
                return
            lo, hi = max(start, r.src), min(end, r.src + r.length)
            if lo < hi:
                yield lo - start, hi - lo, r.piece, r.dst + (lo - r.src)
            i += 1


@dataclass(frozen=True)
class RowPermutation:
    """A run map that is a permutation of equal rows into one piece (the RoPE q/k row interleave).

    Attributes:
        row: elements per row (the runs' common length).
        piece: the output piece.
        dst: ``dst[i]`` is the output row of source row ``i`` (a permutation of ``range(len(dst))``).
        block: the rows of the smallest equal blocks the permutation maps onto themselves
            (RoPE: ``head_dim``); ``len(dst)`` when there are none.
    """

    row: int
    piece: int
    dst: Any  # numpy int64 array
    block: int

    def gather(self, src: memoryview, first_row: int, rows: int, out: Any) -> tuple[int, Any] | None:
        """``rows`` source rows starting at ``first_row`` (bytes in ``src``) permuted into ``out``.

        Returns ``(first output row, the permuted bytes)`` when the rows' destinations are one contiguous
        range of output rows (a slab of whole blocks), else ``None`` (the caller writes run by run).
        """
        import numpy as np

        from ckpttool.engine.kernels import scatter_rows

        d = self.dst[first_row : first_row + rows]
        lo = int(d.min())
        if int(d.max()) - lo + 1 != rows:
            return None
        row_bytes = len(src) // rows
        s2 = np.frombuffer(src, dtype=np.uint8).reshape(rows, row_bytes)
        o2 = out[: rows * row_bytes].reshape(rows, row_bytes)
        scatter_rows(s2, d - lo, o2, permutation=True)  # distinct rows filling lo..lo+rows-1: a permutation
        return lo, o2


def _row_permutation(runs: list[Run]) -> RowPermutation | None:
    """The :class:`RowPermutation` ``runs`` are, or ``None``: equal runs tiling the source, one piece, distinct rows."""
    if len(runs) < 2:
        return None
    row, piece = runs[0].length, runs[0].piece
    for i, r in enumerate(runs):
        if r.length != row or r.piece != piece or r.src != i * row or r.dst % row:
            return None
    import numpy as np

    dst = np.fromiter((r.dst // row for r in runs), dtype=np.int64, count=len(runs))
    n = len(runs)
    if not np.array_equal(np.sort(dst), np.arange(n)):
        return None
    # k is a cut when rows 0..k-1 map onto 0..k-1; the block is the smallest cut whose multiples are all cuts
    cuts = {int(k) + 1 for k in np.flatnonzero(np.maximum.accumulate(dst) == np.arange(n))}
    block = next(b for b in sorted(cuts) if n % b == 0 and all(k in cuts for k in range(b, n + 1, b)))
    return RowPermutation(row, piece, dst, block)


# ---------------------------------------------------------------------------------------------- values


@dataclass(frozen=True)
class SlabWhere:
    """Where a slab lies in the source tensor.

    Attributes:
        key: the source's checkpoint key.
        shape: the source's global shape.
        ranges: ``(offset in the slab, global flat start, length)`` in elements, covering the slab in order;
            each range lies in one row of dim ``ndim - 1`` or spans whole rows.
    """

    key: str
    shape: tuple[int, ...]
    ranges: tuple[tuple[int, int, int], ...]


class SlabTransform(Protocol):
    """A value transform applied slab by slab (``docs/export.md``, "The transform path").

    Attributes:
        src_dtype, out_dtype: torch dtype names of the stored and the written values.
    """

    src_dtype: str
    out_dtype: str

    def __call__(self, src: np.ndarray, out: np.ndarray, where: SlabWhere) -> None:
        """Fill ``out`` (``uint8``, ``n * itemsize(out_dtype)`` bytes) from ``src`` (``uint8``, ``n`` stored values)."""
        ...


class Cast:
    """Cast ``src_dtype`` values to ``out_dtype`` (round to nearest even, as ``torch.Tensor.to``).

    float32, bfloat16 and float16 to each other run on numpy over the bit patterns
    (bfloat16 has no numpy dtype: it is handled as ``uint16``); any other pair converts
    through torch (``Tensor.copy_``), imported on first use.

    Args:
        src_dtype, out_dtype: torch dtype names.
    """

    def __init__(self, src_dtype: str, out_dtype: str) -> None:
        from ckpttool.engine.kernels import FAST_CASTS

        self.src_dtype, self.out_dtype = src_dtype, out_dtype
        self.fast = (src_dtype, out_dtype) in FAST_CASTS

    @property
    def uses_torch(self) -> bool:
        return not self.fast

    def __call__(self, src: np.ndarray, out: np.ndarray, where: SlabWhere) -> None:
        s, o = self.src_dtype, self.out_dtype
        overflow = False
        if self.fast:
            from ckpttool.engine.kernels import cast

            overflow = cast(src, out, s, o)  # float32 -> bfloat16: the kernel's flag (no second pass unless raised)
        else:
            import torch

            src_t = torch.from_numpy(src).view(getattr(torch, s))
            torch.from_numpy(out).view(getattr(torch, o)).copy_(src_t)
        if overflow or s in _WIDER.get(o, ()):
            _refuse_cast_overflow(src, out, s, where, o)


#: Bit patterns of a non-finite value (infinity or NaN): exponent bits all ones.
_NONFINITE = {"float16": (0x7C00, "uint16"), "bfloat16": (0x7F80, "uint16"), "float32": (0x7F800000, "uint32")}
#: Cast target -> the source dtypes with values beyond its range (torch's ``to`` makes them infinite): float16's
#: largest finite value is 65504, bfloat16's 3.39e38 and float32's 3.40e38, beyond which float64 values go.
#: float32 -> bfloat16 (float32's values from 3.39618e38 round to infinity) is not listed: the kernel's flag
#: (:func:`ckpttool.engine.kernels.cast`) says when to look.
_WIDER = {
    "float16": ("float32", "bfloat16", "float64"),
    "bfloat16": ("float64",),
    "float32": ("float64",),
}
#: The smallest float32 magnitude a cast to bfloat16 rounds to infinity (bit pattern ``0x7F7F8000``).
_BF16_OVERFLOW_FROM = 3.39617752923046e38
#: The largest finite value of each cast target, for the message.
_LARGEST = {"float16": "65504", "bfloat16": "3.39e38", "float32": "3.40e38"}


def _refuse_cast_overflow(src: np.ndarray, out: np.ndarray, src_dtype: str, where: SlabWhere, out_dtype: str) -> None:
    """Refuse a cast that made finite values infinite (to float16 beyond +-65504; a float64 value to bfloat16 or
    float32 beyond their +-3.4e38; a float32 value from +-3.39618e38 to bfloat16; torch's ``to`` gives infinity).

    Raises:
        ExportError (E601): :func:`cast_overflow_error` of the slab's first such value.
    """
    import numpy as np

    def nonfinite(raw: np.ndarray, dtype: str) -> Any:
        if dtype == "float64":
            return ~np.isfinite(raw.view(np.float64))
        mask, bits = _NONFINITE[dtype]
        return (raw.view(bits) & mask) == mask

    bad = nonfinite(out, out_dtype)
    if not bad.any():
        return
    bad &= ~nonfinite(src, src_dtype)  # an infinity or NaN stored as such stays one
    hit = np.flatnonzero(bad)
    if not hit.size:
        return
    slab_at = int(hit[0])
    flat = next((g + slab_at - at for at, g, n in where.ranges if at <= slab_at < at + n), None)
    value = float(_as_float(src, src_dtype)[slab_at])
    raise cast_overflow_error(where.key, src_dtype, value, where.shape, flat, out_dtype)


def _as_float(raw: np.ndarray, dtype: str) -> Any:
    """``raw`` bytes as float32 / float64 values (bfloat16 widened exactly)."""
    import numpy as np

    if dtype == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return raw.view(np.float64 if dtype == "float64" else np.float32)


def cast_overflow_error(
    key: str, src_dtype: str, value: float, shape: tuple[int, ...], flat: int | None, out_dtype: str
) -> ExportError:
    """E601 for a finite ``src_dtype`` ``value`` at global flat index ``flat`` of tensor ``key`` (``shape``)
    that a cast to ``out_dtype`` (float16: largest finite 65504; bfloat16, float32: 3.4e38) would write as
    infinity."""
    at = f" at {[int(i) for i in unravel(flat, shape)]}" if flat is not None and shape else ""
    if out_dtype == "float16" and abs(value) < _BF16_OVERFLOW_FROM:
        hint = "export with `save_dtype` bfloat16 (float32's exponents) or preserve; float16 holds values up to 65504"
    else:  # bfloat16 would make this value infinite too
        hint = (
            f"export with `save_dtype` preserve (the stored {src_dtype}); {out_dtype} holds values up to "
            f"{_LARGEST[out_dtype]}"
        )
    return ExportError(
        f"{key}: finite {src_dtype} value(s) beyond {out_dtype}'s range (+-{_LARGEST[out_dtype]}) would be written "
        f"as infinity, e.g. {value:g}{at}",
        fqn=key,
        hint=hint,
    )


# ---------------------------------------------------------------------------------------------- streaming


class _Buffers(threading.local):
    """Per-thread slab buffers (reused: no page faults after the first slab)."""

    def __init__(self) -> None:
        self.src: Any = None
        self.out: Any = None
        self.moved: Any = None

    def get(self, src_bytes: int, out_bytes: int) -> tuple[Any, Any]:
        import numpy as np

        if self.src is None or self.src.size < src_bytes:
            self.src = np.empty(max(src_bytes, BLOCK_BYTES), dtype=np.uint8)
        if self.out is None or self.out.size < out_bytes:
            self.out = np.empty(max(out_bytes, BLOCK_BYTES), dtype=np.uint8)
        return self.src[:src_bytes], self.out[:out_bytes]

    def permuted(self, nbytes: int) -> Any:
        """A third buffer: a slab's rows after a :class:`RowPermutation`."""
        import numpy as np

        if self.moved is None or self.moved.size < nbytes:
            self.moved = np.empty(max(nbytes, BLOCK_BYTES), dtype=np.uint8)
        return self.moved[:nbytes]


_buffers = _Buffers()

#: ``write(piece, data, at_bytes)``: positional write of ``data`` at byte ``at`` of output tensor ``piece``.
WriteFn = Callable[[int, memoryview, int], None]


def _slabs(seg: int, nseg: int, per_slab: int) -> Iterator[tuple[int, int, int, int]]:
    """``(first segment, segments, element offset in the first segment, elements)`` per slab of a chunk."""
    if seg >= per_slab:
        for i in range(nseg):
            for a in range(0, seg, per_slab):
                yield i, 1, a, min(per_slab, seg - a)
        return
    step = max(1, per_slab // seg)
    for i in range(0, nseg, step):
        k = min(step, nseg - i)
        yield i, k, 0, k * seg


def stream_chunk(
    reader: CheckpointReader,
    key: str,
    chunk: ChunkMeta,
    size: tuple[int, ...],
    src_dtype: str,
    runs: RunMap,
    transform: SlabTransform | None,
    write: WriteFn,
    *,
    slab_bytes: int = SLAB_BYTES,
    align: int = 1,
    targets: Sequence[tuple[int, int]] | None = None,
) -> int:
    """Stream one stored chunk through ``transform`` into the output, slab by slab (``docs/export.md``, "The transform path").

    Args:
        reader: the checkpoint reader (thread-safe).
        key: the source tensor's checkpoint key; ``chunk`` one of its chunks, ``size`` its global shape.
        src_dtype: the stored dtype name.
        runs: where each source element goes.
        transform: value transform, or ``None`` to move the bytes unchanged.
        write: writes a slab part to an output piece (thread-safe).
        slab_bytes: source bytes per slab.
        align: slabs that cut a segment start at multiples of this many elements (e.g. the row length).
        targets: per output piece, ``(descriptor, file offset of its byte 0)``: where given, a raw
            record cast or copied by :mod:`ckpttool.engine.move` (no row permutation of small rows,
            no other transform) is moved by one native call per window, not written through ``write``.

    The record's CRC-32 is computed slab by slab as its bytes are read (with ``reader.verify_crc``)
    and checked once the chunk is written: a mismatch raises before the export publishes anything.

    Returns:
        Source bytes read.

    Raises:
        DataFileError, PathEscapeError, ChunkError: as :meth:`CheckpointReader.read_chunk`.
        ChecksumError: the record's bytes do not match its CRC-32 (``reader.verify_crc``).
        OSError: writing the output failed (``ENOSPC``).
    """
    item = DTYPE_ITEMSIZE[src_dtype]
    out_item = DTYPE_ITEMSIZE[transform.out_dtype] if transform is not None else item
    per_slab = max(1, slab_bytes // item)
    if align > 1 and per_slab >= align:
        per_slab -= per_slab % align
    seg, nseg, seg_start = chunk_segments(chunk, size)
    loc = reader.locate(key, chunk)
    if targets is not None and loc.raw and _native_move(src_dtype, transform, runs, reader.verify_crc):
        out_dtype = src_dtype if transform is None else transform.out_dtype
        return _move_chunk(reader, loc, chunk, size, src_dtype, out_dtype, runs, targets)
    memory: Any = None
    if not loc.raw:
        memory = _decoded_chunk(reader, key, chunk)  # checked as it is decoded (read_chunk)
    crc = 0 if memory is None and reader.verify_crc else None  # slabs cover the record once, in order
    read = 0
    for first, count, inner, n in _slabs(seg, nseg, per_slab):
        local = first * seg + inner  # element offset inside the chunk's storage
        src_buf, out_buf = _buffers.get(n * item, n * out_item)
        if memory is not None:
            src_buf[:] = memory[local * item : (local + n) * item]
        else:
            _read_slab(reader, loc, local * item, src_buf, key)
            if crc is not None:
                crc = crc32(src_buf, crc)
            read += n * item
        ranges = tuple(
            (j * seg, seg_start(first + j) + inner, seg if count > 1 else n) for j in range(count)
        )  # (offset in slab, global start, length)
        if transform is not None:
            transform(src_buf, out_buf, SlabWhere(key, size, ranges))
            data = out_buf
        else:
            data = src_buf
        _write_slab(memoryview(data), ranges, runs, out_item, write)
    if crc is not None:
        loc.check_crc(crc)
    return read


#: Source bytes one native move call covers at most: progress and Ctrl-C granularity.
_MOVE_WINDOW = 64 << 20


def _native_move(src_dtype: str, transform: SlabTransform | None, runs: RunMap, crc: bool) -> bool:
    """Whether :func:`_move_chunk` moves a chunk: a plain cast or copy the native kernel has, rows not gathered."""
    from ckpttool.engine.move import available

    if transform is not None and type(transform) is not Cast:
        return False
    out = src_dtype if transform is None else transform.out_dtype
    if runs.rows is not None and runs.rows.row * DTYPE_ITEMSIZE[out] <= _SMALL_ROW_BYTES:
        return False  # RoPE rows: gathered per block and written at once (_write_slab)
    return available(src_dtype, out, crc=crc)


#: A row permutation's rows of at most this many output bytes are gathered per block (``_write_slab``).
_SMALL_ROW_BYTES = 1 << 16


def _move_parts(
    chunk: ChunkMeta, size: tuple[int, ...], runs: RunMap, out_item: int, targets: Sequence[tuple[int, int]]
) -> Iterator[tuple[int, int, int]]:
    """The chunk's storage in order as ``(values, descriptor, file offset)`` runs (``-1``: not written), merged
    where one continues the previous one in the same file."""
    seg, nseg, seg_start = chunk_segments(chunk, size)
    last: list[int] | None = None
    for i in range(nseg):
        g = seg_start(i)
        pos, end = g, g + seg
        for off, n, piece, at in runs.parts(g, seg):
            if g + off > pos:
                if last is not None:
                    yield last[0], last[1], last[2]
                last = [g + off - pos, -1, 0]
            fd, base = targets[piece]
            dest = base + at * out_item
            if last is not None and last[1] == fd and fd >= 0 and last[2] + last[0] * out_item == dest:
                last[0] += n
            else:
                if last is not None:
                    yield last[0], last[1], last[2]
                last = [n, fd, dest]
            pos = g + off + n
        if end > pos:
            if last is not None:
                yield last[0], last[1], last[2]
            last = [end - pos, -1, 0]
    if last is not None:
        yield last[0], last[1], last[2]


def _move_chunk(
    reader: CheckpointReader,
    loc: ChunkLocation,
    chunk: ChunkMeta,
    size: tuple[int, ...],
    src_dtype: str,
    out_dtype: str,
    runs: RunMap,
    targets: Sequence[tuple[int, int]],
) -> int:
    """:func:`stream_chunk` of a raw record by :func:`ckpttool.engine.move.move_runs`, one call per window."""
    from array import array

    from ckpttool.engine.io import ShortReadError
    from ckpttool.engine.move import CastOverflow, move_runs

    assert loc.record is not None
    item, out_item = DTYPE_ITEMSIZE[src_dtype], DTYPE_ITEMSIZE[out_dtype]
    fd = reader.fd(loc.info.relative_path)
    start = loc.info.offset + loc.record.data_offset
    crc: int | None = 0 if reader.verify_crc else None
    per = max(1, _MOVE_WINDOW // item)
    window, nvals, at = array("q"), 0, start
    read = 0

    def flush() -> None:
        nonlocal crc, window, nvals, at, read
        if not nvals:
            return
        try:
            crc = move_runs(fd, at, window, src_dtype, out_dtype, item, crc)
        except CastOverflow as e:  # a finite value the cast made infinite: the chunk's index of it
            local = (at - start) // item + sum(window[3 * j] for j in range(e.run)) + e.index
            seg, _, seg_start = chunk_segments(chunk, size)
            value = struct.unpack("<f", e.bits.to_bytes(4, "little"))[0]
            raise cast_overflow_error(
                loc.key, src_dtype, value, size, seg_start(local // seg) + local % seg, out_dtype
            ) from None
        except ShortReadError:
            raise DataFileError(
                f"{reader.path / loc.info.relative_path}: short read of {loc.key!r}",
                path=loc.info.relative_path,
                fqn=loc.key,
            ) from None
        reader.count_read(nvals * item)
        read += nvals * item
        at += nvals * item
        window, nvals = array("q"), 0

    for n, ofd, dest in _move_parts(chunk, size, runs, out_item, targets):
        while n:
            k = min(n, per - nvals)
            window.extend((k, ofd, dest))
            nvals += k
            n -= k
            if ofd >= 0:
                dest += k * out_item
            if nvals == per:
                flush()
    flush()
    if crc is not None:
        loc.check_crc(crc)
    return read


def _write_slab(
    mv: memoryview, ranges: tuple[tuple[int, int, int], ...], runs: RunMap, out_item: int, write: WriteFn
) -> None:
    """Write a transformed slab's ``ranges`` (``(offset in slab, global start, length)``, elements) where ``runs`` say."""
    for off, g, length in ranges:
        rp = runs.rows
        if rp is not None and g % rp.row == 0 and length % rp.row == 0:  # whole rows: one gather, one write
            moved = rp.gather(
                mv[off * out_item : (off + length) * out_item],
                g // rp.row,
                length // rp.row,
                _buffers.permuted(length * out_item),
            )
            if moved is not None:
                lo, rows_out = moved
                write(rp.piece, memoryview(rows_out.reshape(-1)), lo * rp.row * out_item)
                continue
        for part_off, part_len, piece, at in runs.parts(g, length):
            a = (off + part_off) * out_item
            write(piece, mv[a : a + part_len * out_item], at * out_item)


def _read_slab(reader: CheckpointReader, loc: ChunkLocation, start: int, buf: Any, key: str) -> None:
    """Bytes ``[start, start + len(buf))`` of a located chunk's raw record into ``buf`` (one ``preadv``)."""
    assert loc.record is not None
    reader.pread_into(loc.info, loc.record.data_offset + start, buf, key)


def _decoded_chunk(reader: CheckpointReader, key: str, chunk: ChunkMeta) -> Any:
    """A chunk the locator does not map (stream transform, strided storage): decoded once, as C-order bytes."""
    t = reader.read_chunk(key, chunk)
    import torch

    flat = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    if flat.size != chunk.numel * t.element_size():
        raise ChunkError(f"{reader.path}: {key!r} chunk at {chunk.offsets} decodes to the wrong size", fqn=key)
    return flat


def env_slab_bytes() -> int:
    """:data:`SLAB_BYTES`, or ``CKPTTOOL_SLAB_BYTES`` when set (benchmarks and tests)."""
    v = os.environ.get("CKPTTOOL_SLAB_BYTES")
    return int(v) if v and v.isdecimal() and len(v) <= 18 and int(v) > 0 else SLAB_BYTES  # (int() reads 4,300 digits)
