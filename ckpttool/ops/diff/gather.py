"""``diff`` of values that are not one stored tensor in row blocks, on the engine (``docs/design.md`` §5).

A compared value — a legacy EP permutation (dim-0 gather), a per-expert piece of a fused tensor, a
model adapter's element runs (:class:`~ckpttool.ops.export.transform.Run`, as the export plan
writes them), a block-FP8 weight to dequantize, a tensor on another chunk grid — is a sequence of
element ranges of stored tensors, in its canonical C order. Each stored chunk's record is
contiguous segments of its tensor's C order (:func:`~ckpttool.ops.export.transform.chunk_segments`,
export's vocabulary), so the value's bytes are a list of engine windows: the gather is planned,
not done in memory. The engine reads the value as one stream, slab by slab, beside the other
side's (:class:`~ckpttool.engine.plan.PairedSlabs`); a slab is decoded (FP8: ``q * scale`` per
block, as :func:`~ckpttool.engine.kernels.fp8_rows_dequantize`) and folded into the
:class:`~ckpttool.ops.diff.compare.ValueCompare`. Memory: two slabs, not two tensors.

``None`` (the caller assembles the value with the reader): records that are not raw bytes,
zip records whose CRC-32 the reader checks, chunks that do not tile, more than
:data:`MAX_WINDOWS` windows, MXFP4 (dims 1 and 2 transposed), runs that cast.
"""

from __future__ import annotations

import bisect
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpttool.engine.execute import run_item
from ckpttool.engine.io import ShortReadError
from ckpttool.engine.plan import Item as PlanItem
from ckpttool.engine.plan import PairedSlabs, Window
from ckpttool.errors import DataFileError
from ckpttool.format.metadata import TensorMeta
from ckpttool.format.tiling import tiling_problem
from ckpttool.ops.diff.compare import BLOCK_ELEMENTS, Tolerance, ValueCompare, ValueDiff
from ckpttool.ops.export.transform import chunk_segments

if TYPE_CHECKING:
    from ckpttool.format.locator import ChunkLocation
    from ckpttool.model.catalog import TensorEntry
    from ckpttool.ops.diff.result import Item
    from ckpttool.ops.diff.run import Side

__all__ = ["MAX_WINDOWS", "Stream", "gathered_values", "short_tensor", "value_stream"]


@dataclass(frozen=True)
class Stream:
    """A value's stored bytes as engine ``windows`` (concatenated: ``numel x width`` bytes, in the value's C order),
    ``width`` stored bytes per value (1 for FP8), ``decode(slab bytes, first element)`` giving the slab's values as
    a 1-d torch tensor, and the ``(side, location)`` ``records`` read (a short read names one)."""

    windows: tuple[Window, ...]
    width: int
    decode: Callable[[memoryview, int], Any]
    records: tuple[tuple[Side, ChunkLocation], ...]

    @property
    def nbytes(self) -> int:
        return sum(w.length for w in self.windows)


#: The most windows one value is read through (a finer grid, e.g. a column-sharded embedding, is assembled).
MAX_WINDOWS = 1 << 16

_Segments = tuple[list[int], list[tuple[int, int, int, int]]]  # starts; (first element, elements, fd, byte offset)


def _segments(side: Side, key: str, out: list[tuple[Side, ChunkLocation]]) -> _Segments | None:
    """Where each element of stored tensor ``key`` is: its records' segments sorted by global position."""
    meta = side.ckpt.metadata.entries[key]
    assert isinstance(meta, TensorMeta)
    side.reader.check_allocation(key, meta)
    if tiling_problem(meta) is not None:
        return None
    item = meta.dtype.itemsize
    segs: list[tuple[int, int, int, int]] = []
    for c in meta.chunks:
        if c.numel == 0:
            continue
        loc = side.locate(key, c)
        if not loc.raw or (side.reader.verify_crc and loc.record.member is not None):
            return None
        seg, nseg, start = chunk_segments(c, meta.size)
        if len(segs) + nseg > MAX_WINDOWS:
            return None
        fd = side.reader.fd(loc.info.relative_path)
        segs.extend((start(i), seg, fd, loc.data_start + i * seg * item) for i in range(nseg))
        out.append((side, loc))
    segs.sort()
    return [s[0] for s in segs], segs


def _ranges(item: Item) -> list[tuple[TensorEntry, int, int]] | None:
    """The value's element ranges ``(stored tensor, first element, elements)``, in the value's order."""
    e, n = item.entry, math.prod(item.shape)
    if e is None:
        return None
    if item.runs is not None:
        moves = sorted((r.dst, src.key, r.src, r.length, src) for src, runs in item.runs for r in runs if r.length)
        pos = 0
        for dst, _, _, length, src in moves:
            if dst != pos or src.dtype != item.dtype:  # a gap or a cast: assembled
                return None
            pos += length
        return [(src, s, length) for _, _, s, length, src in moves] if pos == n else None
    if item.perm is not None:
        row = math.prod(e.shape[1:])
        out: list[tuple[TensorEntry, int, int]] = []
        for p in item.perm:
            if out and out[-1][1] + out[-1][2] == p * row:
                out[-1] = (e, out[-1][1], out[-1][2] + row)
            else:
                out.append((e, p * row, row))
        return out
    if item.piece is not None:
        j, p, parts = item.piece
        rows = e.shape[1] // parts
        return [(e, (j * e.shape[1] + p * rows) * math.prod(e.shape[2:]), n)]
    return [(e, 0, n)]


_Planned = tuple[tuple[Window, ...], tuple[tuple["Side", "ChunkLocation"], ...]]


def _windows(side: Side, ranges: list[tuple[TensorEntry, int, int]], width: int) -> _Planned | None:
    """The windows of ``ranges`` (adjacent windows of one file merged); ``None`` past :data:`MAX_WINDOWS`."""
    records: list[tuple[Side, ChunkLocation]] = []
    where: dict[str, _Segments | None] = {}
    wins: list[Window] = []
    for e, first, count in ranges:
        if e.key not in where:
            where[e.key] = _segments(side, e.key, records)
        got = where[e.key]
        if got is None:
            return None
        starts, segs = got
        k = bisect.bisect_right(starts, first) - 1
        while count:
            g, m, fd, off = segs[k]
            take = min(count, g + m - first)
            at, nb = off + (first - g) * width, take * width
            if wins and wins[-1].fd == fd and wins[-1].offset + wins[-1].length == at:
                wins[-1] = Window(fd, wins[-1].offset, wins[-1].length + nb)
            else:
                wins.append(Window(fd, at, nb))
            first, count, k = first + take, count - take, k + 1
        if len(wins) > MAX_WINDOWS:
            return None
    return tuple(wins), tuple(records)


def value_stream(side: Side, item: Item) -> Stream | None:
    """The engine stream of ``item``'s value on ``side`` (see the module docstring), or ``None``.

    A dequantized FP8 weight reads its scales first (small) and sets ``side.quant_atol``.

    Raises:
        AllocationError: a chunk claims more bytes than its file holds (as the reader refuses it).
    """
    import torch

    from ckpttool.format.metadata import DType

    if item.dtype == "bytes" or math.prod(item.shape) == 0:
        return None
    if item.dequant is not None and item.dequant[0] == "mxfp4":
        return None
    width = 1 if item.dequant is not None else DType(item.dtype).itemsize
    ranges = _ranges(item)
    planned = _windows(side, ranges, width) if ranges is not None else None
    if planned is None:
        return None
    if item.dequant is not None:
        from ckpttool.ops.diff.quantized import fp8_decoder

        return Stream(planned[0], 1, fp8_decoder(side, item), planned[1])
    td = DType(item.dtype).to_torch()
    return Stream(planned[0], width, lambda raw, first: torch.frombuffer(raw, dtype=td), planned[1])


def gathered_values(
    a: Side, ia: Item, b: Side, ib: Item, how: Tolerance, tolerance: Callable[[Tolerance], Tolerance]
) -> ValueDiff | None:
    """The value comparison of ``ia`` and ``ib`` through their engine streams; ``None`` when one has none.

    ``how``: the :class:`~ckpttool.ops.diff.compare.Tolerance`; ``tolerance(how)``: the one used once both streams are
    planned (a dequantized side's default tolerance needs its scales).

    Raises:
        DataFileError: a data file ends first (it changed since the locator checked it).
    """
    from ckpttool.format.metadata import DType

    sb = value_stream(b, ib)
    sa = value_stream(a, ia) if sb is not None else None
    if sa is None or sb is None:
        return None
    acc = ValueCompare(DType(ia.dtype).to_torch(), DType(ib.dtype).to_torch(), tolerance(how))

    def fold(mine: memoryview, theirs: memoryview, first: int) -> None:
        acc.add(sa.decode(mine, first), sb.decode(theirs, first), first)

    try:
        run_item(PlanItem(sa.windows, (PairedSlabs(sb.windows, sa.width, sb.width, BLOCK_ELEMENTS, fold),)))
    except ShortReadError:
        raise short_tensor([*sb.records, *sa.records]) from None
    b.reader.count_read(sb.nbytes)
    a.reader.count_read(sa.nbytes)
    return acc.result()


def short_tensor(locs: list[tuple[Side, ChunkLocation]]) -> DataFileError:
    """The reader's error for the first record whose data file now ends before it (the first record if none does)."""
    side, loc = next(
        (
            (side, loc)
            for side, loc in locs
            if os.fstat(side.reader.fd(loc.info.relative_path)).st_size < loc.data_start + loc.nbytes
        ),
        locs[0],
    )
    rel = loc.info.relative_path
    return DataFileError(f"{side.reader.path / rel}: short read of {loc.key!r}", path=rel, fqn=loc.key)
