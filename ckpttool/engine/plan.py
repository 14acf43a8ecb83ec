"""The plan vocabulary of the byte engine: what to read, how to transform it, where its bytes go.

An :class:`Item` reads the concatenation of its :class:`Window` s (a *stream* of ``length``
bytes, positions counted from 0), passes each filled block through an optional transform
(a callable over the block's ``memoryview``, returning a view of the same length), and hands
it to its sinks in order:

- :class:`WriteAt`: written at ``offset + position`` of an output descriptor;
- :class:`Crc32`: the CRC-32 (zip polynomial) of the bytes ``[start, end)`` of the stream;
- :class:`Feed`: ``fn(piece)`` for every piece of ``[start, end)``, in order (a digest's
  ``update``, a byte counter);
- :class:`Compare`: compared with the same positions of another descriptor;
- :class:`CompareStream`: compared with the same positions of another stream (its own windows);
- :class:`Stats`: the values' statistics (:mod:`ckpttool.engine.stats`), slab by slab;
- :class:`PairedSlabs`: fixed slabs of the stream, each beside the same elements of another
  stream, to a callback (``diff``'s value comparison).

A :class:`Lockstep` reads several streams of the same number of values together, slab by slab,
and hands each group of slabs to one callback (a pair sink: AdamW moments, a parameter and its
master copy, the same tensor of two checkpoints); its :class:`Scan` says what the native kernels
compute of the same slabs instead (statistics folds, :class:`PairKernel` s), one C call per window
(:mod:`ckpttool.engine.scan`).

Plans are plain frozen values; :mod:`ckpttool.engine.execute` runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckpttool.engine.stats import Need

__all__ = [
    "Compare",
    "CompareStream",
    "Crc32",
    "Feed",
    "Item",
    "Lockstep",
    "PairKernel",
    "PairedSlabs",
    "Scan",
    "Sink",
    "Stats",
    "Transform",
    "Window",
    "WriteAt",
]

#: A slab transform: takes a filled block, returns the bytes the sinks see (same length).
Transform = Callable[[memoryview], memoryview]


@dataclass(frozen=True, slots=True)
class Window:
    """``length`` bytes at ``offset`` of the open descriptor ``fd`` (read positionally; shared safely)."""

    fd: int
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class WriteAt:
    """Write stream position ``p`` to ``offset + p`` of ``fd``.

    ``writeback``: start the disk write-back of every this many bytes written
    (:func:`~ckpttool.engine.io.start_writeback`; 0: never).
    """

    fd: int
    offset: int
    writeback: int = 0


@dataclass(frozen=True, slots=True)
class Crc32:
    """The CRC-32 of stream bytes ``[start, end)`` (``end`` ``None``: to the end); the sink's result."""

    start: int = 0
    end: int | None = None


@dataclass(frozen=True, slots=True)
class Feed:
    """Call ``fn`` with every piece of stream bytes ``[start, end)``, in order (the piece is valid during the call)."""

    fn: Callable[[memoryview], object]
    start: int = 0
    end: int | None = None


@dataclass(frozen=True, slots=True)
class Compare:
    """Compare the stream with the bytes at ``offset`` of ``fd``; result: the first differing position or ``None``."""

    fd: int
    offset: int


@dataclass(frozen=True, slots=True)
class Stats:
    """Fold the stream's values into a :class:`~ckpttool.engine.stats.SlabStats` (the sink's result).

    The stream holds whole values of ``dtype`` (an IEEE float: bfloat16, float16, float32, float64);
    each slab of ``slab`` values, cut at multiples of ``slab`` from the stream's start whatever the
    read sizes, goes through :func:`~ckpttool.engine.stats.add_slab` with ``need``. ``each``: with
    ``need.sums``, called as ``each(values, squares, first)`` after each slab (``first``: the slab's
    first value's index in the stream; the arrays are valid during the call).
    """

    dtype: str
    need: Need
    slab: int = 1 << 17
    each: Callable[[Any, Any, int], object] | None = None


@dataclass(frozen=True, slots=True)
class CompareStream:
    """Compare the stream with another one, ``reads`` concatenated (at least as long); result: as :class:`Compare`.

    Where the two are equal their CRC-32s are too: a :class:`Crc32` sink over a span of this
    stream is then also the CRC-32 of the same span of the other (``diff`` checks both sides'
    records from one read of each).
    """

    reads: tuple[Window, ...]


@dataclass(frozen=True, slots=True)
class PairedSlabs:
    """Hand the stream to ``fn`` in slabs, each beside the same elements of another stream (``reads`` concatenated).

    The stream holds values ``width`` bytes wide, the other one values ``other_width`` bytes wide;
    element ``i`` of one pairs with element ``i`` of the other. Slabs of ``slab`` elements are cut
    at multiples of ``slab`` from the stream's start whatever the read sizes (the last one
    shorter): ``fn(mine, theirs, first)`` gets both slabs' bytes and the slab's first element
    index, in order (the views are valid during the call). The sink's result: the CRC-32s of the
    other stream's byte ``spans`` ``(start, end)`` (its records' checks), as a tuple.
    """

    reads: tuple[Window, ...]
    width: int
    other_width: int
    slab: int
    fn: Callable[[memoryview, memoryview, int], object]
    spans: tuple[tuple[int, int], ...] = ()


Sink = WriteAt | Crc32 | Feed | Compare | CompareStream | Stats | PairedSlabs


@dataclass(frozen=True, slots=True)
class Item:
    """One unit of byte work: ``reads`` concatenated, ``transform`` applied, every block to each of ``sinks``."""

    reads: tuple[Window, ...]
    sinks: tuple[Sink, ...] = ()
    transform: Transform | None = None

    @property
    def length(self) -> int:
        """The stream's length in bytes."""
        return sum(w.length for w in self.reads)

    @classmethod
    def of(cls, fd: int, offset: int, length: int, *sinks: Sink, transform: Transform | None = None) -> Item:
        """An item reading one window."""
        return cls((Window(fd, offset, length),), tuple(sinks), transform)


@dataclass(frozen=True, slots=True)
class PairKernel:
    """A native kernel over the slabs of streams ``a`` and ``b`` of a :class:`Lockstep` (indices).

    - ``"adam"``: the AdamW update sizes ``u = a / (sqrt(max(b, 0)) + eps)`` of ``exp_avg`` ``a`` and
      ``exp_avg_sq`` ``b`` (as :func:`~ckpttool.engine.stats.adam_sizes`): their count, ``sum u^2``, ``max |u|``.
    - ``"ratio"``: ``max a * a / b`` (as :func:`~ckpttool.engine.stats.moment_ratio`; no float16 member);
      a slab with a zero ``b`` or an overflowing square is handed back.
    - ``"equal"``: ``a`` equals ``b`` rounded to ``a``'s dtype (bfloat16 or float16 from float32, or the
      same dtype) bit for bit, every ``b`` finite; a slab where not is handed back.
    - ``"below"``: no ``a`` below ``b`` (one dtype; amsgrad's ``max_exp_avg_sq`` and ``exp_avg_sq``), a negative or
      NaN ``a`` and a NaN ``b`` left out; a slab with one is handed back.
    """

    kind: str
    a: int
    b: int
    eps: float = 0.0


@dataclass(frozen=True, slots=True)
class Scan:
    """What the native scan computes of a :class:`Lockstep` 's slabs instead of calling ``each``.

    ``dtypes``: each stream's IEEE float dtype; ``folds``: each stream's statistics request
    (:class:`~ckpttool.engine.stats.Need`; ``None``: CRC-32 only); ``pairs``: the pair kernels;
    ``handback(slabs, first, which)``: called with a slab group that pair kernels ``which`` (a bit
    mask of indices into ``pairs``) hand back for the caller's exact path (the slabs' folds are done);
    ``crcs``: which streams' CRC-32s the caller uses (``None``: all; a stream not folded always has it):
    a DCP data file stores no CRC-32 of its raw tensor bytes, so computing one there checks nothing.
    """

    dtypes: tuple[str, ...]
    folds: tuple[Need | None, ...]
    pairs: tuple[PairKernel, ...] = ()
    handback: Callable[[list[Any], int, int], object] | None = None
    crcs: tuple[bool, ...] | None = None


@dataclass(frozen=True, slots=True)
class Lockstep:
    """Streams of the same number of values read together, slab-aligned.

    Slab ``k`` of every stream (``slab`` values of that stream's ``itemsizes[i]`` bytes; the last
    slab shorter) is read into this thread's buffer for the stream, its CRC-32 computed while it is
    in the CPU cache, then ``each(slabs, first)`` is called with the slabs (``uint8`` numpy arrays,
    valid during the call) and the index of their first value. Run by
    :func:`~ckpttool.engine.execute.run_lockstep`; its result: each stream's CRC-32. With ``scan``,
    :func:`~ckpttool.engine.scan.run_scan` runs the native kernels over the same slabs instead.
    """

    streams: tuple[tuple[Window, ...], ...]
    itemsizes: tuple[int, ...]
    each: Callable[[list[Any], int], object]
    slab: int = 1 << 17
    scan: Scan | None = None

    @property
    def numel(self) -> int:
        """Values per stream (the first stream's length over its item size)."""
        return sum(w.length for w in self.streams[0]) // self.itemsizes[0]
