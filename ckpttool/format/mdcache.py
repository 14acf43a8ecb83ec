"""A read-only cache of parsed ``.metadata`` in the user's cache directory, never in the checkpoint.

An optimisation only: a command gives the same result with it, without it (``--no-cache``,
``CKPTTOOL_NO_CACHE=1``) and when it is broken. Key: the SHA-256 and length of the
``.metadata`` bytes; :data:`PARSER_VERSION` invalidates older entries; files under
:data:`MIN_CACHED_BYTES` are parsed directly. An entry (``metadata-v2/<sha256>.ckmd``, no
pickle; layout in ``docs/security.md``, "The parsed-metadata cache") is untrusted input: magic,
xxh3-128 trailer, versions, hash and size must match and every value passes the unpickler's
checks, else it is ignored and the ``.metadata`` parsed again. Only successful parses are
cached. Reading and writing entries is :mod:`ckpttool.format.cache`'s (``docs/design.md`` §6).
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import sys
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from itertools import groupby, islice, repeat
from pathlib import Path
from typing import Any

from ckpttool.format import cache, limits
from ckpttool.format.mdstorage import DuplicateKeys, StorageTable, bounds, compact, int64s, record_end
from ckpttool.format.metadata import DTYPE_ITEMSIZE, BytesMeta, CheckpointMetadata, ChunkMeta, DType, StorageInfo
from ckpttool.format.metadata import TensorMeta as _TensorMeta
from ckpttool.format.unpickler import (
    MAX_DIM_SIZE,
    MAX_NDIM,
    MAX_OFFSET,
    check_record_bound,
    gc_paused,
    parse_metadata_bytes,
    parse_metadata_owned,
)

__all__ = [
    "MIN_CACHED_BYTES",
    "PARSER_VERSION",
    "entry_path",
    "encode",
    "encode_parts",
    "decode",
    "parse_metadata_cached",
    "parse_metadata_taken",
]

log = logging.getLogger(__name__)

#: ``.metadata`` files smaller than this are always parsed directly.
MIN_CACHED_BYTES = 4 << 20
#: Bumped whenever the parser's output for the same bytes could change.
PARSER_VERSION = 2  # 2: CheckpointMetadata.writer
_MAGIC = b"CKPTMDC2"
_FOLDER = "metadata-v2"  # format 3 (xxh3-128 trailer); older formats live in older folders
#: Bytes of the trailer: the xxh3-128 digest of the rest of the entry.
_TRAILER = 16
_LE = sys.byteorder == "little"


def entry_path(digest: str) -> Path:
    """Path of the cache entry of a ``.metadata`` whose SHA-256 is ``digest`` (hex)."""
    return cache.cache_dir() / _FOLDER / f"{digest}.ckmd"


def _checksum(data: bytes | memoryview) -> bytes:
    """The entry's trailer: xxh3-128 of ``data`` (much faster than SHA-256; detects damage, authenticates nothing)."""
    import xxhash

    return xxhash.xxh3_128_digest(data)


# --------------------------------------------------------------------------- encode
#: The int64 columns of an entry, in file order (see the module docstring).
_COLUMNS = (
    "layout_dtype",  # per distinct tensor layout: dtype string id
    "layout_ndim",  # its rank
    "layout_nchunks",  # its chunk count
    "layout_dims",  # all layouts' size[ndim] then per chunk offsets[ndim], sizes[ndim]
    "entry_key",  # per entry: key string id
    "entry_layout",  # its layout id, -1: a byte item
    "tuple_ndim",  # per distinct storage-offset tuple: its length
    "tuple_dims",  # their items
    "tds_len",  # per distinct transform-descriptor tuple: its length (tuple 0 is ())
    "tds_ids",  # their string ids
    "storage_fqn",  # per storage item: fqn string id
    "storage_tuple",  # its offsets tuple id, -1: None (a byte item)
    "storage_path",  # relative_path string id
    "storage_offset",  # byte offset in the file
    "storage_length",  # byte length
    "storage_tds",  # transform-descriptor tuple id
    "planner_key",  # per planner_data path: key string id
    "planner_len",  # its length; -1: a path holding ints or int tuples, in the header's "planner"
    "planner_items",  # the string ids of the all-string paths
)


class _Strings:
    """The entry's string table: each distinct string once, by first use."""

    def __init__(self) -> None:
        self.table: list[str] = []
        self._ids: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        i = self._ids.get(text)
        if i is None:
            i = self._ids[text] = len(self.table)
            self.table.append(text)
        return i

    def done(self) -> list[str]:
        """The table, the lookup dict freed (no string is added after the columns)."""
        self._ids = {}
        return self.table


def encode(md: CheckpointMetadata, digest: str, size: int) -> bytes:
    """The cache entry of ``md`` (parsed from ``size`` bytes with SHA-256 ``digest``)."""
    return b"".join(encode_parts(md, digest, size))


def encode_parts(md: CheckpointMetadata, digest: str, size: int) -> list[bytes | memoryview]:
    """:func:`encode`'s entry as its parts in order (the columns as views of their arrays, the trailer
    last): written one after another, the entry is never copied whole (~256 MiB at 10^6 entries)."""
    import xxhash

    s = _Strings()
    col: dict[str, array[int]] = {name: array("q") for name in _COLUMNS}
    _encode_entries(md, col, s)
    _encode_storage(md, col, s)
    planner = _encode_planner(md, col, s)
    header = {
        "format": 3,
        "parser": PARSER_VERSION,
        "sha256": digest,
        "size": size,
        "version": md.version,
        "checkpoint_id": md.checkpoint_id,
        "save_id": md.save_id,
        "writer": md.writer,
        "serialization": md.serialization,
        "strings": s.done(),
        "planner": planner,
        "columns": [len(col[name]) for name in _COLUMNS],
    }
    head = json.dumps(header, separators=(",", ":")).encode("ascii")
    parts: list[bytes | memoryview] = [_MAGIC, struct.pack("<Q", len(head)), head]
    for name in _COLUMNS:
        a = col[name]
        if not _LE:
            a.byteswap()
        parts.append(memoryview(a).cast("B"))
    trailer = xxhash.xxh3_128()  # _checksum of the parts joined
    for part in parts:
        trailer.update(part)
    parts.append(trailer.digest())
    return parts


def _encode_entries(md: CheckpointMetadata, col: dict[str, array[int]], s: _Strings) -> None:
    """The ``layout_*`` and ``entry_*`` columns: each distinct tensor layout once, each entry's key and layout id."""
    layouts: dict[_TensorMeta, int] = {}
    for key, meta in md.entries.items():
        col["entry_key"].append(s(key))
        if isinstance(meta, _TensorMeta):
            lid = layouts.get(meta)
            if lid is None:
                lid = layouts[meta] = len(layouts)
                col["layout_dtype"].append(s(meta.dtype.name))
                col["layout_ndim"].append(len(meta.size))
                col["layout_nchunks"].append(len(meta.chunks))
                dims = col["layout_dims"]
                dims.extend(meta.size)
                for c in meta.chunks:
                    dims.extend(c.offsets)
                    dims.extend(c.sizes)
            col["entry_layout"].append(lid)
        else:
            col["entry_layout"].append(-1)


def _encode_storage(md: CheckpointMetadata, col: dict[str, array[int]], s: _Strings) -> None:
    """The ``tuple_*``, ``tds_*`` and ``storage_*`` columns (distinct offsets and descriptor tuples once)."""
    if isinstance(md.storage, StorageTable):
        _encode_table(md.storage, col, s)
        return
    tuples: dict[tuple[int, ...], int] = {}
    tds_ids: dict[tuple[str, ...], int] = {(): 0}
    col["tds_len"].append(0)
    for (fqn, offsets), info in md.storage.items():
        col["storage_fqn"].append(s(fqn))
        if offsets is None:
            col["storage_tuple"].append(-1)
        else:
            tid = tuples.get(offsets)
            if tid is None:
                tid = tuples[offsets] = len(tuples)
                col["tuple_ndim"].append(len(offsets))
                col["tuple_dims"].extend(offsets)
            col["storage_tuple"].append(tid)
        col["storage_path"].append(s(info.relative_path))
        col["storage_offset"].append(info.offset)
        col["storage_length"].append(info.length)
        tds = info.transform_descriptors
        did = tds_ids.get(tds)
        if did is None:
            did = tds_ids[tds] = len(tds_ids)
            col["tds_len"].append(len(tds))
            col["tds_ids"].extend(s(t) for t in tds)
        col["storage_tds"].append(did)


def _encode_table(table: StorageTable, col: dict[str, array[int]], s: _Strings) -> None:
    """:func:`_encode_storage` of a :class:`StorageTable`: its columns with the string ids renumbered (C-level maps).

    The table's tuples are distinct (its constructor's grouping relies on it), so they are written as they are.
    """
    ids = list(map(s, table.strings))
    for t in table.tuples:
        col["tuple_ndim"].append(len(t))
        col["tuple_dims"].extend(t)
    descriptors = table.descriptors if table.descriptors is not None and table.tds is not None else [()]
    for tds in descriptors:
        col["tds_len"].append(len(tds))
        col["tds_ids"].extend(s(x) for x in tds)
    col["storage_fqn"].extend(map(ids.__getitem__, table.fqn))
    col["storage_tuple"].extend(iter(table.tup))
    col["storage_path"].extend(map(ids.__getitem__, table.path))
    col["storage_offset"].extend(iter(table.offset))
    col["storage_length"].extend(iter(table.length))
    col["storage_tds"].extend(
        iter(table.tds) if table.tds is not None and table.descriptors is not None else repeat(0, len(table))
    )


def _encode_planner(md: CheckpointMetadata, col: dict[str, array[int]], s: _Strings) -> list[list[Any]]:
    """The ``planner_*`` columns; returns the paths that are not all strings (a tuple item as a list)."""
    planner: list[list[Any]] = []
    for k, path in md.planner_data.items():
        col["planner_key"].append(s(k))
        if all(type(x) is str for x in path):
            col["planner_len"].append(len(path))
            col["planner_items"].extend(map(s, path))
        else:
            col["planner_len"].append(-1)
            planner.append([list(x) if isinstance(x, tuple) else x for x in path])
    return planner


# --------------------------------------------------------------------------- decode
class CorruptEntry(Exception):
    """A cache entry that is not exactly what :func:`encode` writes for this ``.metadata``."""


def _opt_str(v: Any) -> str | None:
    if v is not None and type(v) is not str:
        raise CorruptEntry("header field is not a string")
    return v


def decode(blob: bytes, digest: str, size: int) -> CheckpointMetadata:
    """Rebuild the :class:`CheckpointMetadata` of a cache entry, checking it as untrusted input.

    Raises:
        CorruptEntry: the entry is for other bytes, of another version, truncated, or holds a
            value the unpickler would have refused (any such entry is ignored by the caller).
    """
    return _decode_owned([blob], _check_entry(blob, digest, size))


_DECODE_ERRORS = (ValueError, TypeError, IndexError, KeyError, OverflowError, RecursionError, MemoryError)


def _check_entry(blob: bytes, digest: str, size: int) -> dict[str, Any]:
    """The header of an entry whose magic, checksum and versions are right and that is for these bytes.

    Raises:
        CorruptEntry: otherwise.
    """
    try:
        return _header(blob, digest, size)
    except CorruptEntry:
        raise
    except _DECODE_ERRORS as e:
        raise CorruptEntry(f"{type(e).__name__}: {str(e)[:80]}") from e


def _decode_owned(taken: list[bytes], header: dict[str, Any]) -> CheckpointMetadata:
    """Decode the entry in ``taken`` (a one-item list, emptied: the bytes are freed once the entry is decoded)."""
    try:
        return _decode(taken, header)
    except CorruptEntry:
        raise
    except _DECODE_ERRORS as e:
        raise CorruptEntry(f"{type(e).__name__}: {str(e)[:80]}") from e


def _ids(values: Sequence[int], lo: int, n: int, what: str) -> int:
    """Every id in ``values`` lies in ``[lo, n)`` (:func:`~ckpttool.format.mdstorage.bounds`: in C); returns the
    largest (``lo - 1`` when there is none)."""
    if not values:
        return lo - 1
    low, high = bounds(values)
    if low < lo or high >= n:
        raise CorruptEntry(f"{what} id out of range")
    return high


def _dims_ok(values: Sequence[int]) -> None:
    if values and (min(values) < 0 or max(values) > MAX_DIM_SIZE):
        raise CorruptEntry("dims out of range")


def _header(blob: bytes, digest: str, size: int) -> dict[str, Any]:
    mv = memoryview(blob)
    if len(blob) < 16 + _TRAILER or bytes(mv[:8]) != _MAGIC:
        raise CorruptEntry("bad magic")
    if _checksum(mv[:-_TRAILER]) != bytes(mv[-_TRAILER:]):
        raise CorruptEntry("entry checksum differs (damaged)")
    mv = mv[:-_TRAILER]
    (hlen,) = struct.unpack("<Q", mv[8:16])
    if hlen > len(mv) - 16:
        raise CorruptEntry("truncated header")
    header = json.loads(str(mv[16 : 16 + hlen], "ascii"))  # one copy, the text
    if type(header) is not dict or header.get("format") != 3 or header.get("parser") != PARSER_VERSION:
        raise CorruptEntry("other format or parser version")
    if header.get("sha256") != digest or header.get("size") != size:
        raise CorruptEntry("entry of other bytes")
    header["_body_at"] = 16 + hlen
    return header


def _decode(taken: list[bytes], header: dict[str, Any]) -> CheckpointMetadata:
    col = _columns(taken, header)
    strings = header["strings"]
    shared: dict[tuple[int, ...], tuple[int, ...]] = {}  # equal dims tuples built once
    entries = _decode_entries(col, strings, _decode_layouts(col, strings, shared))
    storage = _decode_storage(col, strings, shared)
    if isinstance(storage, StorageTable):  # the catalog finds the entries' records by these ids (no dict lookups)
        storage.hold_key_ids(entries, compact(col["entry_key"]))
    per_layout = Counter(col["entry_layout"])  # the parser's record count: entries, storage items, chunks
    chunks = sum(col["layout_nchunks"][i] * n for i, n in per_layout.items() if i >= 0)
    if len(entries) + len(storage) + chunks > limits.metadata_record_cap():
        raise CorruptEntry("more records than the cap in force (the parser refuses them)")
    planner = _decode_planner(col, strings, header["planner"])
    serialization = header.get("serialization")
    if serialization not in ("torch_save", "safetensors"):
        raise CorruptEntry("bad serialization")
    writer = header.get("writer")
    if writer not in (None, "olmo-core"):
        raise CorruptEntry("bad writer")
    return CheckpointMetadata(
        entries=entries,
        storage=storage,
        planner_data=planner,
        version=_opt_str(header.get("version")),
        checkpoint_id=_opt_str(header.get("checkpoint_id")),
        save_id=_opt_str(header.get("save_id")),
        serialization=serialization,
        writer=writer,
    )


def _columns(taken: list[bytes], header: dict[str, Any]) -> dict[str, Sequence[int]]:
    """The int64 columns of the entry in ``taken`` (emptied) by name: views of the entry's bytes (8 bytes a value,
    no Python int per value; the bytes are freed with the last view) or, on a big-endian host, arrays.

    Checks the header's string table too (before the columns, as a corrupt entry fails first there).
    """
    blob = taken.pop()
    hlen = header["_body_at"] - 16
    strings = header["strings"]
    lengths = header["columns"]
    if type(strings) is not list or not {*map(type, strings)} <= {str}:  # exact str only, in C
        raise CorruptEntry("bad string table")
    if (
        type(lengths) is not list
        or len(lengths) != len(_COLUMNS)
        or not all(type(n) is int and n >= 0 for n in lengths)
    ):
        raise CorruptEntry("bad column lengths")
    body = memoryview(blob)[16 + hlen : len(blob) - _TRAILER]
    if len(body) != 8 * sum(lengths):
        raise CorruptEntry("column bytes differ from their lengths")
    ints: Sequence[int]
    if _LE:  # the columns straight from the entry's bytes
        ints = body.cast("B").cast("q")
    else:
        ints = array("q")
        ints.frombytes(body)
        ints.byteswap()
    col: dict[str, Sequence[int]] = {}
    pos = 0
    for name, n in zip(_COLUMNS, lengths):
        col[name] = ints[pos : pos + n]
        pos += n
    return col


def _decode_layouts(
    col: dict[str, Sequence[int]], strings: list[str], shared: dict[tuple[int, ...], tuple[int, ...]]
) -> list[_TensorMeta]:
    """The distinct tensor layouts, checked one by one (a few per checkpoint, at most one per entry)."""
    l_dtype, l_ndim, l_nch, l_dims = col["layout_dtype"], col["layout_ndim"], col["layout_nchunks"], col["layout_dims"]
    if not len(l_dtype) == len(l_ndim) == len(l_nch):
        raise CorruptEntry("layout columns differ in length")
    _ids(l_dtype, 0, len(strings), "dtype string")
    _dims_ok(l_dims)
    dtypes: dict[int, DType] = {}
    layouts: list[_TensorMeta] = []
    p = 0
    for dsid, nd, nc in zip(l_dtype, l_ndim, l_nch):
        dt = dtypes.get(dsid)
        if dt is None:
            name = strings[dsid]
            if name not in DTYPE_ITEMSIZE:
                raise CorruptEntry("unknown dtype")
            dt = dtypes[dsid] = DType(name)
        if not 0 <= nd <= MAX_NDIM or nc < 0 or p + nd * (1 + 2 * nc) > len(l_dims):
            raise CorruptEntry("bad rank or chunk count")
        shape = tuple(l_dims[p : p + nd])
        shape = shared.setdefault(shape, shape)
        p += nd
        chunks = []
        for _ in range(nc):
            c_off = tuple(l_dims[p : p + nd])
            c_sz = tuple(l_dims[p + nd : p + 2 * nd])
            p += 2 * nd
            for o, sz, d in zip(c_off, c_sz, shape):
                if o + sz > d:
                    raise CorruptEntry("chunk outside its tensor")
            chunks.append(ChunkMeta(shared.setdefault(c_off, c_off), shared.setdefault(c_sz, c_sz)))
        layouts.append(_TensorMeta(dt, shape, tuple(chunks)))
    if p != len(l_dims):
        raise CorruptEntry("layout dims longer than their layouts")
    return layouts


def _decode_entries(
    col: dict[str, Sequence[int]], strings: list[str], layouts: list[_TensorMeta]
) -> dict[str, _TensorMeta | BytesMeta]:
    """Entries: key -> one of the layouts (frozen, so entries of one layout share it) or the bytes item."""
    e_key, e_layout = col["entry_key"], col["entry_layout"]
    if len(e_key) != len(e_layout):
        raise CorruptEntry("entry columns differ in length")
    _ids(e_key, 0, len(strings), "key string")
    _ids(e_layout, -1, len(layouts), "layout")
    table: list[_TensorMeta | BytesMeta] = [*layouts, BytesMeta()]  # index -1: the bytes item
    entries: dict[str, _TensorMeta | BytesMeta] = dict(
        zip(map(strings.__getitem__, e_key), map(table.__getitem__, e_layout))
    )
    if len(entries) != len(e_key):
        raise CorruptEntry("duplicate entry keys")
    return entries


def _decode_tuples(
    col: dict[str, Sequence[int]], strings: list[str], shared: dict[tuple[int, ...], tuple[int, ...]]
) -> tuple[list[tuple[int, ...] | None], list[tuple[str, ...]]]:
    """The storage-offset tuples (index -1: ``None``) and the transform-descriptor tuples."""
    t_ndim, t_dims = col["tuple_ndim"], col["tuple_dims"]
    if t_ndim and (min(t_ndim) < 0 or max(t_ndim) > MAX_NDIM) or sum(t_ndim) != len(t_dims):
        raise CorruptEntry("bad offsets tuples")
    _dims_ok(t_dims)
    tuples: list[tuple[int, ...] | None] = []
    p = 0
    for nd in t_ndim:
        t = tuple(t_dims[p : p + nd])
        tuples.append(shared.setdefault(t, t))
        p += nd
    tuples.append(None)  # index -1
    d_len, d_ids = col["tds_len"], col["tds_ids"]
    if not d_len or d_len[0] != 0 or min(d_len) < 0 or sum(d_len) != len(d_ids):
        raise CorruptEntry("bad descriptor tuples")
    _ids(d_ids, 0, len(strings), "descriptor string")
    descriptors: list[tuple[str, ...]] = []
    p = 0
    for n in d_len:
        descriptors.append(tuple(strings[i] for i in d_ids[p : p + n]))
        p += n
    return tuples, descriptors


def _decode_storage(
    col: dict[str, Sequence[int]], strings: list[str], shared: dict[tuple[int, ...], tuple[int, ...]]
) -> StorageTable | dict[tuple[str, tuple[int, ...] | None], StorageInfo]:
    """Storage items: columns checked with min/max, then a :class:`StorageTable` over them (views of the entry:
    no object per item)."""
    tuples, descriptors = _decode_tuples(col, strings, shared)
    ns = len(strings)
    s_fqn, s_tup, s_path = col["storage_fqn"], col["storage_tuple"], col["storage_path"]
    s_off, s_len, s_tds = col["storage_offset"], col["storage_length"], col["storage_tds"]
    n = len(s_fqn)
    if not n == len(s_tup) == len(s_path) == len(s_off) == len(s_len) == len(s_tds):
        raise CorruptEntry("storage columns differ in length")
    _ids(s_path, 0, ns, "relative path string")
    tds_max = _ids(s_tds, 0, len(descriptors), "descriptor tuple")
    if n and not 0 <= record_end(s_off, s_len) <= MAX_OFFSET:  # -1: a negative offset or length
        raise CorruptEntry("storage range out of bounds")
    if not n:
        return {}
    offsets = tuples[:-1]  # index -1 (None) is the table's own
    if len(set(offsets)) != len(offsets):
        raise CorruptEntry("offsets tuples given twice")  # encode writes each once; keys compare by id
    # copies, not views of the entry, so that its bytes are freed with the decode; ids as 32-bit ints
    tds = compact(s_tds) if tds_max > 0 else None  # None: every record has no descriptors
    fqn, tup, path = compact(s_fqn), compact(s_tup), compact(s_path)
    try:
        return StorageTable(strings, offsets, descriptors, fqn, tup, path, int64s(s_off), int64s(s_len), tds)  # type: ignore[arg-type]
    except DuplicateKeys as e:  # also an fqn given twice in the string table (keys compare by string id)
        raise CorruptEntry("duplicate storage keys") from e
    except ValueError as e:  # an fqn or tuple id out of range
        raise CorruptEntry(f"storage {e}") from e


def _decode_planner(col: dict[str, Sequence[int]], strings: list[str], raw: Any) -> dict[str, tuple[Any, ...]]:
    """``planner_data``: the all-string paths from the columns, the others from the header (``raw``)."""
    ns = len(strings)
    p_key, p_len, p_items = col["planner_key"], col["planner_len"], col["planner_items"]
    low, high = bounds(p_len) if p_len else (0, 0)
    if len(p_key) != len(p_len) or low < -1 or high > MAX_NDIM:
        raise CorruptEntry("bad planner columns")
    _ids(p_key, 0, ns, "planner key string")
    _ids(p_items, 0, ns, "planner item string")
    others = iter(_planner(raw))
    paths: list[tuple[Any, ...]] = []
    if sum(filter((0).__lt__, p_len)) != len(p_items):  # the lengths > 0 (-1: a path in the header)
        raise CorruptEntry("planner items differ from their paths")
    items = map(strings.__getitem__, p_items)
    for n, run in groupby(p_len):  # runs of paths of one length, built in C (10^6 paths)
        count = len(list(run))
        if n < 0:
            paths.extend(islice(others, count))
        elif n == 0:
            paths.extend(repeat((), count))
        else:
            paths.extend(islice(zip(*[items] * n), count))
    if len(paths) != len(p_len) or next(others, None) is not None or next(items, None) is not None:
        raise CorruptEntry("planner items differ from their paths")
    planner = dict(zip(map(strings.__getitem__, p_key), paths))
    if len(planner) != len(p_key):
        raise CorruptEntry("duplicate planner keys")
    return planner


def _planner(raw: Any) -> list[tuple[Any, ...]]:
    """The planner paths holding ints or int tuples, checked as the unpickler checks them."""
    if type(raw) is not list:
        raise CorruptEntry("bad planner data")
    out: list[tuple[Any, ...]] = []
    for path in raw:
        if type(path) is not list or len(path) > MAX_NDIM:
            raise CorruptEntry("bad planner path")
        items: list[Any] = []
        for x in path:
            if type(x) is str or (type(x) is int and -MAX_OFFSET <= x <= MAX_OFFSET):
                items.append(x)
            elif (
                type(x) is list
                and len(x) <= MAX_NDIM
                and all(type(d) is int and -MAX_OFFSET <= d <= MAX_OFFSET for d in x)
            ):
                items.append(tuple(x))
            else:
                raise CorruptEntry("bad planner path item")
        out.append(tuple(items))
    return out


# --------------------------------------------------------------------------- the cached parse
def parse_metadata_cached(data: bytes, source: str = ".metadata") -> CheckpointMetadata:
    """:func:`~ckpttool.format.unpickler.parse_metadata_bytes`, through the cache when it is on.

    Same result and same errors as the direct parse (only successful parses are cached; a
    ``.metadata`` the parser refuses is refused again each time, from its bytes).

    Raises:
        as :func:`~ckpttool.format.unpickler.parse_metadata_bytes`.
    """
    return parse_metadata_taken([data], source)


def parse_metadata_taken(
    holder: list[bytes | bytearray], source: str = ".metadata", reread: Callable[[], bytes] | None = None
) -> CheckpointMetadata:
    """:func:`parse_metadata_cached` of the bytes in ``holder`` (a one-item list, emptied).

    With the caller's only reference handed over and ``reread`` given (reads the same file
    again), a cache hit frees the ``.metadata`` bytes (hundreds of MB at 10^6 entries) as soon as
    an entry under their digest is read, so they and the entry are never both decoded in
    memory. An entry that fails a later check is ignored as always: the file is read again and
    parsed (and cached only when its digest is still the one looked up).

    Raises:
        as :func:`~ckpttool.format.unpickler.parse_metadata_bytes`.
    """
    with gc_paused():  # the format layer's one pause: ~10 acyclic objects per entry, decoded or unpickled
        return _parse_taken(holder, source, reread)


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # an unusable cache directory is never an error
        return False


def _parse_taken(
    holder: list[bytes | bytearray], source: str, reread: Callable[[], bytes] | None
) -> CheckpointMetadata:
    data: bytes | bytearray | None = holder.pop()
    assert data is not None
    if len(data) < MIN_CACHED_BYTES or not cache.cache_enabled():
        taken = [data]
        data = None  # handed over: freed once unpickled (when the caller handed its reference over too)
        return parse_metadata_owned(taken, source, reread)
    check_record_bound(data, source)  # as the parser does first: a hit is refused exactly when a parse is
    digest = hashlib.sha256(data).hexdigest()
    size = len(data)
    path = entry_path(digest)
    if reread is not None and _is_file(path):
        data = None  # an entry under this digest: the bytes are not needed unless it fails below (re-read then)
    blob = cache.read_entry(path, logger=log)
    if blob is not None:
        try:
            header = _check_entry(blob, digest, size)
            entry = [blob]
            del blob
            md = _decode_owned(entry, header)
            log.debug("%s: parsed metadata from the cache entry %s", source, path)
            return md
        except CorruptEntry as e:
            log.info("%s: cache entry %s ignored (%s); parsing again", source, path, e)
        blob = None
    if data is None:
        assert reread is not None
        data = reread()
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            return parse_metadata_bytes(data, source)  # changed meanwhile: parsed, never cached under the old key
    taken = [data]
    data = None
    changed: list[bool] = []

    def reread_checked() -> bytes:  # the unpickler's bytes where the native parse declined a bytearray it released
        assert reread is not None
        again = reread()
        changed.append(len(again) != size or hashlib.sha256(again).hexdigest() != digest)
        return again

    md = parse_metadata_owned(taken, source, reread_checked if reread is not None else None)
    if any(changed):
        return md  # changed meanwhile: parsed, never cached under the old key
    cache.store_entry(path, lambda: encode_parts(md, digest, size), "metadata cache", logger=log)
    return md
