"""``.metadata`` storage records as columns: :class:`StorageTable`, a read-only mapping with no object per record.

torch's ``Metadata.storage_data`` maps ``MetadataIndex(fqn, offset)`` to ``_StorageInfo``; a
10^6-entry checkpoint has millions of them, and a dict of ``(fqn, offsets) -> StorageInfo``
costs ~290 bytes per record (the key tuple, the record, two ints, the dict slot). The table
keeps int64 columns instead (string ids for the fqn and the data file, an offsets-tuple id, the
byte offset and length, a transform-descriptor tuple id: 48 bytes a record, or views of the
parsed-metadata cache entry) beside one string table, and an index grouped by fqn (two
stable counting sorts, ``engine/native/mdgroup.c``, with a pure-Python fallback). A record is
built as a :class:`~ckpttool.format.metadata.StorageInfo` only when one is asked for, one key
at a time; :meth:`StorageTable.paths` and :meth:`StorageTable.extents` answer the questions
every command asks of all records (which files are referenced, how far each must reach) on the
columns. The native column reader (:mod:`ckpttool.format.mdscan`) and the cache
(:mod:`ckpttool.format.mdcache`) build it; the unpickler path builds a plain dict: consumers
read either through the ``Mapping`` interface.
"""

from __future__ import annotations

import ctypes
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import compress, repeat
from operator import add, itemgetter
from typing import Any

from ckpttool.engine import native
from ckpttool.format.metadata import StorageInfo

__all__ = [
    "StorageTable",
    "DuplicateKeys",
    "bounds",
    "check_unique_keys",
    "compact",
    "int64s",
    "record_end",
    "referenced_paths",
    "file_extents",
    "chunk_paths",
    "chunk_path_columns",
    "key_ids",
    "storage_infos",
]

Key = tuple[str, "tuple[int, ...] | None"]
#: Groups of at most this many records of one fqn are searched one by one, larger ones by bisection.
_LINEAR = 8


class DuplicateKeys(ValueError):
    """Two records of a table share one ``(fqn, offsets)`` key."""


def _ints(n: int) -> memoryview:
    """A zeroed, writable int64 column of ``n`` values."""
    return memoryview(bytearray(8 * n)).cast("q")


def _address(col: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(col)) if len(col) else 0


def check_unique_keys(fqn: Sequence[int], tup: Sequence[int], nstr: int, ntup: int) -> None:
    """The check :class:`StorageTable` makes of its key columns, alone.

    Raises:
        DuplicateKeys: a ``(fqn id, tuple id)`` pair given twice.
        ValueError: an id out of range.
    """
    _group(fqn, tup, nstr, ntup)


def _group(fqn: Sequence[int], tup: Sequence[int], nstr: int, ntup: int) -> tuple[memoryview, memoryview, memoryview]:
    """``(first, order, tsorted)``: the rows of fqn id ``s`` are ``order[first[s]:first[s + 1]]``, ascending by
    tuple id (``tsorted[i] == tup[order[i]]``).

    Raises:
        DuplicateKeys: a ``(fqn id, tuple id)`` pair given twice.
        ValueError: an id out of range.
    """
    n = len(fqn)
    if n != len(tup):
        raise ValueError("storage columns differ in length")
    first, order, tsorted = _ints(nstr + 1), _ints(n), _ints(n)
    kernel = native.function(
        "ckpt_md_group",
        ctypes.c_int64,
        *[ctypes.c_void_p] * 2,
        *[ctypes.c_int64] * 4,
        *[ctypes.c_void_p] * 3,
    )
    if kernel is not None:
        # contiguous copies (the columns may be strided, read-only views): 16 bytes a record, for this call only
        f, t = int64s(fqn), int64s(tup)
        found = kernel(
            _address(memoryview(f)), _address(memoryview(t)), 1, n, nstr, ntup, *map(_address, (first, order, tsorted))
        )
        del f, t
        if found == -2:
            raise MemoryError("grouping storage records")
        if found == -1:
            raise ValueError("storage id out of range")
    else:
        found = _group_python(fqn, tup, nstr, ntup, first, order, tsorted)
    if found:
        raise DuplicateKeys(f"{found} storage keys given twice")
    return first, order, tsorted


def _flat(col: Sequence[int]) -> bool:
    return isinstance(col, memoryview) and col.format == "q" and col.c_contiguous


def int64s(col: Sequence[int]) -> array[int]:
    """A copy of ``col`` as a contiguous int64 array (C-level copies of int64 views and arrays, a native
    widening of :func:`compact`'s 32-bit arrays; anything else value by value)."""
    out = array("q")
    if isinstance(col, memoryview) and col.format == "q":
        out.frombytes(col.cast("B") if col.c_contiguous else col.tobytes())
        return out
    if isinstance(col, array) and col.typecode == "q":
        return col[:]
    if isinstance(col, array) and col.itemsize == 4 and col.typecode == "i":
        kernel = native.function("ckpt_md_widen", None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)
        if kernel is not None:
            out = array("q", _ZERO) * len(col)
            kernel(_address(memoryview(col)), len(col), _address(memoryview(out)))
            return out
    return array("q", col)


_ZERO = (0,)


def _q(col: Sequence[int]) -> memoryview:
    """``col`` as contiguous int64 bytes (a view of a flat int64 view, else of a copy: :func:`int64s`)."""
    if isinstance(col, memoryview) and _flat(col):
        return col.cast("B")
    return memoryview(int64s(col)).cast("B")


#: Values a block of a column is copied in for the kernels (512 KiB): no copy of a whole column beside it.
_BLOCK = 1 << 16


def _blocks(col: Sequence[int]) -> Iterator[tuple[bytes | int, int]]:
    """``(pointer, count)`` of ``col``'s int64 values in blocks of :data:`_BLOCK` values (the same blocks for
    any two columns of one length): an int64 array in place, other columns as copies (``bytes``, passed to
    ctypes as they are)."""
    base = _address(memoryview(col)) if isinstance(col, array) and col.typecode == "q" and len(col) else None
    for start in range(0, len(col), _BLOCK):
        if base is not None:
            yield base + 8 * start, min(_BLOCK, len(col) - start)
            continue
        piece = col[start : start + _BLOCK]
        if isinstance(piece, memoryview) and piece.format == "q":
            yield piece.tobytes(), len(piece)
        else:
            yield array("q", piece).tobytes(), len(piece)


def bounds(col: Sequence[int]) -> tuple[int, int]:
    """``(min(col), max(col))`` of a non-empty int column (in C where the kernels are built).

    Raises:
        ValueError: ``col`` is empty.
    """
    if not len(col):
        raise ValueError("bounds of an empty column")
    kernel = native.function("ckpt_md_bounds", None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)
    if kernel is None:
        return min(col), max(col)
    out, lo, hi = array("q", (0, 0)), None, None
    for ptr, n in _blocks(col):
        kernel(ptr, n, _address(memoryview(out)))
        lo = out[0] if lo is None else min(lo, out[0])
        hi = out[1] if hi is None else max(hi, out[1])
    assert lo is not None and hi is not None
    return lo, hi


def record_end(offset: Sequence[int], length: Sequence[int]) -> int:
    """``max(offset[i] + length[i])`` of two aligned int64 columns (``0`` when empty), ``-1`` when a value is
    negative (in C where the kernels are built).

    Raises:
        ValueError: the columns differ in length.
    """
    if len(offset) != len(length):
        raise ValueError("storage columns differ in length")
    if not len(offset):
        return 0
    kernel = native.function("ckpt_md_end", ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    if kernel is None:
        if min(offset) < 0 or min(length) < 0:
            return -1
        end: int = max(map(add, offset, length))
        return end
    end = 0
    for (off, n), (lens, _) in zip(_blocks(offset), _blocks(length)):  # same lengths, so the same blocks
        part = int(kernel(off, lens, n))
        if part < 0:
            return -1
        end = max(end, part)
    return end


def compact(ids: Sequence[int]) -> Sequence[int]:
    """An id column as 32-bit ints (4 bytes a value instead of 8; ids count strings or tuples, < 2^31).

    Raises:
        OverflowError: an id outside the 32-bit range.
    """
    kernel = native.function("ckpt_md_narrow", ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)
    if kernel is None or not len(ids) or array("i").itemsize != 4:
        return array("i", ids)
    out = array("i", _ZERO) * len(ids)
    at = _address(memoryview(out))
    for ptr, n in _blocks(ids):
        if kernel(ptr, n, at):
            raise OverflowError("id out of the 32-bit range")
        at += 4 * n
    return out


def _group_python(
    fqn: Sequence[int],
    tup: Sequence[int],
    nstr: int,
    ntup: int,
    first: memoryview,
    order: memoryview,
    tsorted: memoryview,
) -> int:
    """:func:`_group` without the native kernels: one sort by ``fqn id * (ntup + 1) + tuple id + 1``."""
    n = len(fqn)
    if n and (min(fqn) < 0 or max(fqn) >= nstr or min(tup) < -1 or max(tup) >= ntup):
        raise ValueError("storage id out of range")
    width = ntup + 1
    keys = list(map(add, map(int.__mul__, fqn, repeat(width)), map(add, tup, repeat(1))))
    rows = sorted(range(n), key=keys.__getitem__)
    order[:] = memoryview(array("q", rows)).cast("B").cast("q")
    tsorted[:] = memoryview(array("q", map(tup.__getitem__, rows))).cast("B").cast("q")
    counts = [0] * (nstr + 1)
    for f in fqn:
        counts[f + 1] += 1
    total = 0
    for s in range(nstr + 1):
        total += counts[s]
        first[s] = total
    ordered = list(map(keys.__getitem__, rows))
    return sum(map(int.__eq__, ordered[1:], ordered[:-1]))


class StorageTable(Mapping[Key, StorageInfo]):
    """``(fqn, chunk offsets or None) -> StorageInfo`` over columns, in the file's order (read-only).

    Args:
        strings: the string table (fqns, data file names, transform descriptors).
        tuples: the distinct offsets tuples, each once (a record's offsets are ``tuples[id]``;
            id ``-1``: ``None``, a byte item).
        descriptors: the distinct transform-descriptor tuples (``None``: every record has ``()``).
        fqn, tup, path, offset, length: the int64 columns, one value per record (string id,
            tuple id, string id, byte offset, byte length); ``tds``: descriptor ids, or ``None``.

    Raises:
        DuplicateKeys: two records with one key (the unpickler path's dict would keep one), or one fqn
            under two string ids.
        ValueError: an id out of range.
    """

    __slots__ = (
        "strings",
        "tuples",
        "descriptors",
        "fqn",
        "tup",
        "path",
        "offset",
        "length",
        "tds",
        "_first",
        "_order",
        "_tsorted",
        "_sid",
        "_tid",
        "_tuples",
        "_key_ids",
    )

    def __init__(
        self,
        strings: list[str],
        tuples: list[tuple[int, ...]],
        descriptors: list[tuple[str, ...]] | None,
        fqn: Sequence[int],
        tup: Sequence[int],
        path: Sequence[int],
        offset: Sequence[int],
        length: Sequence[int],
        tds: Sequence[int] | None = None,
    ) -> None:
        self.strings, self.tuples, self.descriptors = strings, tuples, descriptors
        self.fqn, self.tup, self.path, self.offset, self.length, self.tds = fqn, tup, path, offset, length, tds
        self._first, self._order, self._tsorted = _group(fqn, tup, len(strings), len(tuples))
        # fqn -> string id of the fqns that have records (C-level: no Python loop over the records)
        used = set(fqn)
        self._sid: dict[str, int] = dict(zip(map(strings.__getitem__, used), used))
        if len(self._sid) != len(used):  # one fqn under two string ids: its records would be found under one
            raise DuplicateKeys("an fqn given under two string ids")
        self._tid: dict[tuple[int, ...] | None, int] = dict(zip(tuples, range(len(tuples))))
        self._tid[None] = -1
        self._tuples: list[tuple[int, ...] | None] = [*tuples, None]  # id -1: None
        self._key_ids: tuple[Mapping[str, Any], Sequence[int]] | None = None

    # ------------------------------------------------------------------ one record
    def row(self, key: Key) -> int:
        """The record number of ``key``, or ``-1``."""
        s = self._sid.get(key[0], -1)
        t = self._tid.get(key[1], -2) if s >= 0 else -2
        if t == -2:
            return -1
        a, b = self._first[s], self._first[s + 1]
        if b - a == 1:
            return self._order[a] if self._tsorted[a] == t else -1
        i = bisect_left(self._tsorted, t, a, b)
        return self._order[i] if i < b and self._tsorted[i] == t else -1

    def info(self, r: int) -> StorageInfo:
        """The record ``r`` as a :class:`StorageInfo`."""
        tds = () if self.tds is None or self.descriptors is None else self.descriptors[self.tds[r]]
        return tuple.__new__(StorageInfo, (self.strings[self.path[r]], self.offset[r], self.length[r], tds))

    def get(self, key: Any, default: Any = None) -> Any:
        r = self.row(key) if type(key) is tuple and len(key) == 2 else -1
        return self.info(r) if r >= 0 else default

    def __getitem__(self, key: Key) -> StorageInfo:
        r = self.row(key) if type(key) is tuple and len(key) == 2 else -1
        if r < 0:
            raise KeyError(key)
        return self.info(r)

    def __contains__(self, key: object) -> bool:
        return type(key) is tuple and len(key) == 2 and self.row(key) >= 0

    def __len__(self) -> int:
        return len(self.fqn)

    def __iter__(self) -> Iterator[Key]:
        return zip(map(self.strings.__getitem__, self.fqn), map(self._tuples.__getitem__, self.tup))

    def values(self) -> Any:  # a view-like iterable in the file's order
        return _Values(self)

    def items(self) -> Any:
        return _Items(self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return len(self) == len(other) and all(other.get(k, _MISSING) == v for k, v in self.items())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StorageTable({len(self)} records)"

    # ------------------------------------------------------------------ many records
    def rows(
        self, fqns: Iterable[str], offsets: Iterable[tuple[int, ...] | None], sids: Sequence[int] | None = None
    ) -> Sequence[int]:
        """The record number of each ``(fqn, offsets)`` pair of the two aligned iterables, ``-1`` where none.

        ``sids``: the string id of each fqn where the caller knows it (:meth:`key_ids`), a hint that
        saves a dict lookup per fqn; a pair it finds no record for is looked up by its fqn.

        Raises:
            ValueError: the iterables differ in length.
        """
        fqns, offsets = list(fqns), list(offsets)
        if len(fqns) != len(offsets):
            raise ValueError("fqns and offsets differ in length")
        kernel = _find_kernel()
        if kernel is None:
            return array("q", map(self.row, zip(fqns, offsets)))
        tids = array("q", map(self._tid.get, offsets, repeat(-2)))
        return self._found(kernel, fqns, self._sids(fqns, sids), tids, offsets.__getitem__, sids is not None)

    def _sids(self, fqns: list[str] | Sequence[str], hint: Sequence[int] | None) -> array[int]:
        if hint is not None and len(hint) == len(fqns):
            return int64s(hint)
        return array("q", map(self._sid.get, fqns, repeat(-1)))

    def _found(
        self,
        kernel: Any,
        fqns: Sequence[str],
        sids: array[int],
        tids: array[int],
        offsets_of: Any,
        hinted: bool,
    ) -> array[int]:
        """The records of the string ids ``sids`` with the tuple ids ``tids`` (``ckpt_md_find``); with ``hinted``
        ids, the pairs not found again by their fqn strings (``offsets_of(k)``: the offsets of pair ``k``)."""
        out = array("q", _ZERO) * len(sids)
        index = (self._first, self._order, self._tsorted)
        missing = kernel(
            *map(_address, index),
            len(self.strings),
            _address(memoryview(sids)),
            _address(memoryview(tids)),
            len(sids),
            _address(memoryview(out)),
        )
        if missing and hinted:  # a key whose string has its records under another id (one id per fqn: see __init__)
            for k in compress(range(len(out)), map(_MINUS_ONE.__eq__, out)):
                out[k] = self.row((fqns[k], offsets_of(k)))
        return out

    def path_columns(
        self,
        fqns: Sequence[str],
        offsets: Sequence[tuple[int, ...] | None],
        sids: Sequence[int] | None = None,
    ) -> list[Iterator[str | None]]:
        """The ``relative_path`` of the record ``(fqn, offsets[j])`` of each fqn, one column per ``offsets[j]``
        (``None`` where there is none): the chunks of tensors of one layout, each fqn looked up once
        (``sids``: as :meth:`rows`)."""
        kernel = _find_kernel()
        if kernel is None or not fqns:
            return [self.paths_of(fqns, repeat(o, len(fqns))) for o in offsets]
        ids = self._sids(fqns, sids)
        columns = []
        for o in offsets:
            tids = array("q", (self._tid.get(o, -2),)) * len(ids)
            rows = self._found(kernel, fqns, ids, tids, lambda _, o=o: o, sids is not None)
            columns.append(self._paths_at(rows))
        return columns

    def key_ids(self, entries: Mapping[str, Any]) -> Sequence[int] | None:
        """The string id of each key of ``entries``, in order, when this table was built beside exactly that
        dict (the parsed-metadata cache's decode: :meth:`hold_key_ids`); ``None`` otherwise."""
        held = self._key_ids
        if held is None or held[0] is not entries or len(held[1]) != len(entries):
            return None
        return held[1]

    def hold_key_ids(self, entries: Mapping[str, Any], ids: Sequence[int]) -> None:
        """Keep ``ids``, the string id of each key of ``entries`` (:meth:`key_ids`)."""
        self._key_ids = (entries, ids)

    def _paths_at(self, rows: Sequence[int]) -> Iterator[str | None]:
        """The ``relative_path`` of each record number (``None`` for ``-1``)."""
        if not rows or bounds(rows)[0] >= 0:
            return map(self.strings.__getitem__, map(self.path.__getitem__, rows))
        return (self.strings[self.path[r]] if r >= 0 else None for r in rows)

    def paths_of(
        self, fqns: Iterable[str], offsets: Iterable[tuple[int, ...] | None], sids: Sequence[int] | None = None
    ) -> Iterator[str | None]:
        """The ``relative_path`` of each ``(fqn, offsets)`` record, ``None`` where there is none (in C, but one
        index search per pair; ``sids``: as :meth:`rows`)."""
        return self._paths_at(self.rows(fqns, offsets, sids))

    def infos_of(self, fqns: Iterable[str], offsets: Iterable[tuple[int, ...] | None]) -> list[StorageInfo | None]:
        """The :class:`StorageInfo` of each ``(fqn, offsets)`` record, ``None`` where there is none."""
        rows = self.rows(fqns, offsets)
        if rows and bounds(rows)[0] < 0:
            return [self.info(r) if r >= 0 else None for r in rows]
        paths = map(self.strings.__getitem__, map(self.path.__getitem__, rows))
        offs, lens = map(self.offset.__getitem__, rows), map(self.length.__getitem__, rows)
        if self.tds is None or self.descriptors is None:
            tds: Any = repeat(())
        else:
            tds = map(self.descriptors.__getitem__, map(self.tds.__getitem__, rows))
        return list(map(tuple.__new__, repeat(StorageInfo), zip(paths, offs, lens, tds)))

    # ------------------------------------------------------------------ every record, on the columns
    def paths(self) -> set[str]:
        """The data files the records name (``relative_path``), each once."""
        return set(map(self.strings.__getitem__, set(self.path)))

    def extents(self) -> dict[str, int]:
        """Data file -> the end of its last record (``offset + length``; files whose records all end at 0 left
        out), in the order of the first record ending past 0."""
        kernel = native.function(
            "ckpt_md_extents", ctypes.c_int64, *[ctypes.c_char_p] * 3, *[ctypes.c_int64] * 2, *[ctypes.c_void_p] * 2
        )
        if kernel is None or not len(self):
            ends: dict[int, int] = {}
            get = ends.get
            for p, end in zip(self.path, map(add, self.offset, self.length)):
                if end > get(p, 0):
                    ends[p] = end
            return {self.strings[p]: end for p, end in ends.items()}
        n, ns = len(self), len(self.strings)
        end, first = _ints(ns), _ints(ns)
        cols = (bytes(_q(self.path)), bytes(_q(self.offset)), bytes(_q(self.length)))
        if kernel(*cols, n, ns, _address(end), _address(first)) != 0:
            raise ValueError("storage path id out of range")
        used = sorted((first[p], p) for p in set(self.path) if first[p] < n)
        return {self.strings[p]: end[p] for _, p in used}

    def has_transforms(self) -> bool:
        """Whether any record names a stream transform."""
        if self.tds is None or self.descriptors is None:
            return False
        return any(map(self.descriptors.__getitem__, set(self.tds)))


_MISSING = object()
_MINUS_ONE = -1


def _find_kernel() -> Any:
    return native.function(
        "ckpt_md_find", ctypes.c_int64, *[ctypes.c_void_p] * 3, ctypes.c_int64, *[ctypes.c_void_p] * 4
    )


class _Values:
    __slots__ = ("t",)

    def __init__(self, t: StorageTable) -> None:
        self.t = t

    def __len__(self) -> int:
        return len(self.t)

    def __iter__(self) -> Iterator[StorageInfo]:
        t = self.t
        paths = map(t.strings.__getitem__, t.path)
        if t.tds is None or t.descriptors is None:
            tds: Any = repeat(())
        else:
            tds = map(t.descriptors.__getitem__, t.tds)
        return map(tuple.__new__, repeat(StorageInfo), zip(paths, t.offset, t.length, tds))


class _Items(_Values):
    __slots__ = ()

    def __iter__(self) -> Iterator[tuple[Key, StorageInfo]]:  # type: ignore[override]
        return zip(iter(self.t), _Values.__iter__(self))


def referenced_paths(storage: Mapping[Key, StorageInfo]) -> set[str]:
    """The data files ``storage`` names, each once (on the columns for a :class:`StorageTable`)."""
    if isinstance(storage, StorageTable):
        return storage.paths()
    return {info.relative_path for info in storage.values()}


def file_extents(storage: Mapping[Key, StorageInfo]) -> dict[str, int]:
    """Data file -> end of its last record past 0 (:meth:`StorageTable.extents`; on the columns for a table)."""
    if isinstance(storage, StorageTable):
        return storage.extents()
    needed: dict[str, int] = {}
    get = needed.get
    for rel, offset, length, _ in storage.values():
        end = offset + length
        if end > get(rel, 0):
            needed[rel] = end
    return needed


def chunk_paths(
    storage: Mapping[Key, StorageInfo],
    fqns: Iterable[str],
    offsets: Iterable[tuple[int, ...] | None],
    sids: Sequence[int] | None = None,
) -> Iterator[str | None]:
    """The data file of each ``(fqn, offsets)`` record (aligned iterables; ``None``: no record), in C for a
    :class:`StorageTable` (:meth:`StorageTable.paths_of`; ``sids``: the fqns' string ids, :func:`key_ids`)
    and for a dict."""
    if isinstance(storage, StorageTable):
        return storage.paths_of(fqns, offsets, sids)
    return map(_REL, map(storage.get, zip(fqns, offsets), repeat(_NO_RECORD)))


def chunk_path_columns(
    storage: Mapping[Key, StorageInfo],
    fqns: Sequence[str],
    offsets: Sequence[tuple[int, ...] | None],
    sids: Sequence[int] | None = None,
) -> list[Iterator[str | None]]:
    """:func:`chunk_paths` of every fqn with each of ``offsets``, one column per offsets tuple (the chunks
    of tensors of one layout; for a :class:`StorageTable` each fqn is looked up once:
    :meth:`StorageTable.path_columns`)."""
    if isinstance(storage, StorageTable):
        return storage.path_columns(fqns, offsets, sids)
    return [chunk_paths(storage, fqns, repeat(o, len(fqns))) for o in offsets]


def key_ids(storage: Mapping[Key, StorageInfo], entries: Mapping[str, Any]) -> Sequence[int] | None:
    """The string id of each key of ``entries`` in ``storage``'s table (:meth:`StorageTable.key_ids`), ``None``
    when not known (a dict, or a table not built beside that ``entries``)."""
    return storage.key_ids(entries) if isinstance(storage, StorageTable) else None


def storage_infos(
    storage: Mapping[Key, StorageInfo], fqns: Iterable[str], offsets: Iterable[tuple[int, ...] | None]
) -> list[StorageInfo | None]:
    """``[storage.get((fqn, offsets)) ...]`` of the aligned iterables, in C for a table and for a dict."""
    if isinstance(storage, StorageTable):
        return storage.infos_of(fqns, offsets)
    return list(map(storage.get, zip(fqns, offsets)))


_REL = itemgetter(0)  # StorageInfo.relative_path
_NO_RECORD = (None,)  # what _REL reads for a key without a record
