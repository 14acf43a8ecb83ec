"""A read-only cache of parsed ``.metadata``, in the user's cache directory (never in the checkpoint).

Unpickling and checking a 10^6-entry ``.metadata`` (0.5 GB of pickle) takes tens of seconds and
gigabytes; a command run again on the same checkpoint reads the result from a cache entry
instead. The cache is an optimisation only: every command gives the same result with it, without
it (``--no-cache``, ``CKPTTOOL_NO_CACHE=1``) and when it is broken.

Location: ``$CKPTTOOL_CACHE_DIR``, else ``$XDG_CACHE_HOME/ckpttool``, else ``~/.cache/ckpttool``;
entries in its ``metadata-v1/`` folder. Files smaller than :data:`MIN_CACHED_BYTES` are parsed
directly (faster than hashing and reading an entry).

Key: the SHA-256 of the ``.metadata`` bytes (and their length). The bytes are read anyway (caps,
confined open), so the key is the content itself: an edited, replaced or re-saved file is a miss
whatever its mtime, and one file copied elsewhere is a hit. A parser change bumps
:data:`PARSER_VERSION` and every older entry is a miss.

Entry layout (``<sha256>.ckmd``, little-endian; no pickle anywhere)::

    magic    b"CKPTMDC1"
    u64      length J of the JSON header, then J bytes of UTF-8 JSON:
             {"format": 1, "parser": PARSER_VERSION, "sha256": hex, "size": bytes of .metadata,
              "version", "checkpoint_id", "save_id", "serialization": str or null,
              "strings": [str, ...], "planner": [[key, [item, ...]], ...], "n_ints": N}
             planner items: a str, an int, or a list of ints (a tuple path item)
    i64 * N  the int stream (below)
    32 bytes SHA-256 of everything before it (a damaged entry is never decoded)

    int stream:
             n_entries, then per entry: key string id, kind (0 bytes item, 1 tensor);
               a tensor: dtype string id, ndim, n_chunks, size[ndim],
               then per chunk offsets[ndim], sizes[ndim];
             n_storage, then per item: fqn string id, ndim of its offsets (-1: a byte item),
               offsets[ndim], relative_path string id, offset, length, n descriptors, their ids

Loading treats an entry as untrusted input: magic, checksum, versions, hash and size must match, every id
must be in range and every value passes the checks the unpickler applies (dims 0..2^62, at most
64 dims, chunks inside their tensor, int64 offsets, known dtypes, planner paths of str/int);
anything else (truncated, garbage, hostile) makes the entry ignored and the ``.metadata`` parsed
again. Writing is best effort (a read-only or missing cache directory is not an error): written to
a temporary file in the cache folder and renamed, so a reader never sees half an entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import sys
import tempfile
from array import array
from pathlib import Path
from typing import Any

from ckpttool.format.metadata import DTYPE_ITEMSIZE, BytesMeta, CheckpointMetadata, ChunkMeta, DType, StorageInfo
from ckpttool.format.metadata import TensorMeta as _TensorMeta
from ckpttool.format.unpickler import MAX_DIM_SIZE, MAX_NDIM, MAX_OFFSET, gc_paused, parse_metadata_bytes

__all__ = [
    "CACHE_DIR_ENV",
    "NO_CACHE_ENV",
    "MIN_CACHED_BYTES",
    "PARSER_VERSION",
    "cache_dir",
    "cache_enabled",
    "set_cache_enabled",
    "entry_path",
    "encode",
    "decode",
    "parse_metadata_cached",
]

log = logging.getLogger(__name__)

#: Environment variable naming the cache directory.
CACHE_DIR_ENV = "CKPTTOOL_CACHE_DIR"
#: Environment variable that turns the cache off when set to a non-empty value other than ``0``.
NO_CACHE_ENV = "CKPTTOOL_NO_CACHE"
#: ``.metadata`` files smaller than this are always parsed directly.
MIN_CACHED_BYTES = 4 << 20
#: Bumped whenever the parser's output for the same bytes could change.
PARSER_VERSION = 1
_MAGIC = b"CKPTMDC1"
_FOLDER = "metadata-v1"
_LE = sys.byteorder == "little"

_enabled: bool | None = None


def set_cache_enabled(flag: bool | None) -> None:
    """Turn the cache on or off for this process (``None``: back to the environment's choice)."""
    global _enabled
    _enabled = flag


def cache_enabled() -> bool:
    """Whether :func:`parse_metadata_cached` uses the cache (``--no-cache`` / ``CKPTTOOL_NO_CACHE``)."""
    if _enabled is not None:
        return _enabled
    return os.environ.get(NO_CACHE_ENV, "") in ("", "0")


def cache_dir() -> Path:
    """``$CKPTTOOL_CACHE_DIR``, else ``$XDG_CACHE_HOME/ckpttool``, else ``~/.cache/ckpttool``."""
    given = os.environ.get(CACHE_DIR_ENV)
    if given:
        return Path(given)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "ckpttool"


def entry_path(digest: str) -> Path:
    """Path of the cache entry of a ``.metadata`` whose SHA-256 is ``digest`` (hex)."""
    return cache_dir() / _FOLDER / f"{digest}.ckmd"


# --------------------------------------------------------------------------- encode
def encode(md: CheckpointMetadata, digest: str, size: int) -> bytes:
    """The cache entry of ``md`` (parsed from ``size`` bytes with SHA-256 ``digest``)."""
    strings: list[str] = []
    sid: dict[str, int] = {}

    def s(text: str) -> int:
        i = sid.get(text)
        if i is None:
            i = sid[text] = len(strings)
            strings.append(text)
        return i

    ints = array("q", [len(md.entries)])
    ext = ints.extend
    for key, meta in md.entries.items():
        if isinstance(meta, _TensorMeta):
            nd = len(meta.size)
            ext((s(key), 1, s(meta.dtype.name), nd, len(meta.chunks)))
            ext(meta.size)
            for c in meta.chunks:
                ext(c.offsets)
                ext(c.sizes)
        else:
            ext((s(key), 0))
    ints.append(len(md.storage))
    for (fqn, offsets), info in md.storage.items():
        if offsets is None:
            ext((s(fqn), -1))
        else:
            ext((s(fqn), len(offsets)))
            ext(offsets)
        ext((s(info.relative_path), info.offset, info.length, len(info.transform_descriptors)))
        ext(s(t) for t in info.transform_descriptors)
    planner = [[k, [list(x) if isinstance(x, tuple) else x for x in path]] for k, path in md.planner_data.items()]
    header = {
        "format": 1,
        "parser": PARSER_VERSION,
        "sha256": digest,
        "size": size,
        "version": md.version,
        "checkpoint_id": md.checkpoint_id,
        "save_id": md.save_id,
        "serialization": md.serialization,
        "strings": strings,
        "planner": planner,
        "n_ints": len(ints),
    }
    head = json.dumps(header, separators=(",", ":")).encode("ascii")
    if not _LE:
        ints.byteswap()
    body = b"".join((_MAGIC, struct.pack("<Q", len(head)), head, ints.tobytes()))
    return body + hashlib.sha256(body).digest()


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
    try:
        return _decode(blob, digest, size)
    except CorruptEntry:
        raise
    except (ValueError, TypeError, IndexError, KeyError, OverflowError, RecursionError, MemoryError) as e:
        raise CorruptEntry(f"{type(e).__name__}: {str(e)[:80]}") from e


def _decode(blob: bytes, digest: str, size: int) -> CheckpointMetadata:
    mv = memoryview(blob)
    if len(blob) < 48 or bytes(mv[:8]) != _MAGIC:
        raise CorruptEntry("bad magic")
    if hashlib.sha256(mv[:-32]).digest() != bytes(mv[-32:]):
        raise CorruptEntry("entry checksum differs (damaged)")
    mv = mv[:-32]
    (hlen,) = struct.unpack("<Q", mv[8:16])
    if hlen > len(blob) - 16:
        raise CorruptEntry("truncated header")
    header = json.loads(bytes(mv[16 : 16 + hlen]).decode("utf-8"))
    if type(header) is not dict or header.get("format") != 1 or header.get("parser") != PARSER_VERSION:
        raise CorruptEntry("other format or parser version")
    if header.get("sha256") != digest or header.get("size") != size:
        raise CorruptEntry("entry of other bytes")
    strings = header["strings"]
    n_ints = header["n_ints"]
    if type(strings) is not list or type(n_ints) is not int or not all(type(x) is str for x in strings):
        raise CorruptEntry("bad string table")
    body = mv[16 + hlen :]
    if len(body) != 8 * n_ints:
        raise CorruptEntry("int stream length differs")
    arr = array("q")
    arr.frombytes(body)
    if not _LE:
        arr.byteswap()
    ints = arr.tolist()
    del arr
    ns = len(strings)
    dims_cache: dict[tuple[int, ...], tuple[int, ...]] = {}

    def dims(p: int, nd: int) -> tuple[int, ...]:
        t = tuple(ints[p : p + nd])
        hit = dims_cache.get(t)
        if hit is not None:
            return hit
        if len(t) != nd or any(d < 0 or d > MAX_DIM_SIZE for d in t):
            raise CorruptEntry("dims out of range")
        if len(dims_cache) < 65536:
            dims_cache[t] = t
        return t

    def text(i: int) -> str:
        if not 0 <= i < ns:
            raise CorruptEntry("string id out of range")
        return strings[i]  # type: ignore[no-any-return]

    entries: dict[str, _TensorMeta | BytesMeta] = {}
    dtypes: dict[int, DType] = {}
    bytes_meta = BytesMeta()
    p = 1
    for _ in range(ints[0]):
        key, kind = text(ints[p]), ints[p + 1]
        p += 2
        if kind == 0:
            entries[key] = bytes_meta
            continue
        if kind != 1:
            raise CorruptEntry("bad entry kind")
        dsid, nd, nc = ints[p], ints[p + 1], ints[p + 2]
        p += 3
        dt = dtypes.get(dsid)
        if dt is None:
            name = text(dsid)
            if name not in DTYPE_ITEMSIZE:
                raise CorruptEntry("unknown dtype")
            dt = dtypes[dsid] = DType(name)
        if not 0 <= nd <= MAX_NDIM or nc < 0:
            raise CorruptEntry("bad rank or chunk count")
        shape = dims(p, nd)
        p += nd
        chunks = []
        for _c in range(nc):
            c_off = dims(p, nd)
            c_sz = dims(p + nd, nd)
            p += 2 * nd
            for o, sz, d in zip(c_off, c_sz, shape):
                if o + sz > d:
                    raise CorruptEntry("chunk outside its tensor")
            chunks.append(ChunkMeta(c_off, c_sz))
        entries[key] = _TensorMeta(dt, shape, tuple(chunks))
    storage: dict[tuple[str, tuple[int, ...] | None], StorageInfo] = {}
    n_storage = ints[p]
    p += 1
    for _ in range(n_storage):
        fqn, nd = text(ints[p]), ints[p + 1]
        p += 2
        offsets: tuple[int, ...] | None
        if nd == -1:
            offsets = None
        elif 0 <= nd <= MAX_NDIM:
            offsets = dims(p, nd)
            p += nd
        else:
            raise CorruptEntry("bad storage rank")
        rel_id, off, length, ntd = ints[p], ints[p + 1], ints[p + 2], ints[p + 3]
        p += 4
        if off < 0 or length < 0 or off + length > MAX_OFFSET:
            raise CorruptEntry("storage range out of bounds")
        tds: tuple[str, ...] = ()
        if ntd:
            if ntd < 0 or ntd > len(ints):
                raise CorruptEntry("bad descriptor count")
            tds = tuple(text(i) for i in ints[p : p + ntd])
            p += ntd
        storage[(fqn, offsets)] = StorageInfo(text(rel_id), off, length, tds)
    if p != len(ints):
        raise CorruptEntry("int stream longer than its items")
    planner = _planner(header["planner"])
    serialization = header.get("serialization")
    if serialization not in ("torch_save", "safetensors"):
        raise CorruptEntry("bad serialization")
    return CheckpointMetadata(
        entries=entries,
        storage=storage,
        planner_data=planner,
        version=_opt_str(header.get("version")),
        checkpoint_id=_opt_str(header.get("checkpoint_id")),
        save_id=_opt_str(header.get("save_id")),
        serialization=serialization,
    )


def _planner(raw: Any) -> dict[str, tuple[Any, ...]]:
    if type(raw) is not list:
        raise CorruptEntry("bad planner data")
    out: dict[str, tuple[Any, ...]] = {}
    for row in raw:
        key, path = row
        if type(key) is not str or type(path) is not list or len(path) > MAX_NDIM:
            raise CorruptEntry("bad planner path")
        types = set(map(type, path))
        if types <= {str}:
            out[key] = tuple(path)
            continue
        items: list[Any] = []
        for x in path:
            if type(x) is str:
                items.append(x)
            elif type(x) is int and -MAX_OFFSET <= x <= MAX_OFFSET:
                items.append(x)
            elif (
                type(x) is list
                and len(x) <= MAX_NDIM
                and all(type(d) is int and -MAX_OFFSET <= d <= MAX_OFFSET for d in x)
            ):
                items.append(tuple(x))
            else:
                raise CorruptEntry("bad planner path item")
        out[key] = tuple(items)
    return out


# --------------------------------------------------------------------------- the cached parse
def parse_metadata_cached(data: bytes, source: str = ".metadata") -> CheckpointMetadata:
    """:func:`~ckpttool.format.unpickler.parse_metadata_bytes`, through the cache when it is on.

    Same result and same errors as the direct parse (only successful parses are cached; a
    ``.metadata`` the parser refuses is refused again each time, from its bytes).

    Raises:
        as :func:`~ckpttool.format.unpickler.parse_metadata_bytes`.
    """
    if len(data) < MIN_CACHED_BYTES or not cache_enabled():
        return parse_metadata_bytes(data, source)
    digest = hashlib.sha256(data).hexdigest()
    path = entry_path(digest)
    with gc_paused():
        try:
            blob = path.read_bytes()
        except OSError:
            blob = None
        if blob is not None:
            try:
                md = decode(blob, digest, len(data))
                log.debug("%s: parsed metadata from the cache entry %s", source, path)
                return md
            except CorruptEntry as e:
                log.info("%s: cache entry %s ignored (%s); parsing again", source, path, e)
            del blob
        md = parse_metadata_bytes(data, source)
        _store(path, md, digest, len(data))
        return md


def _store(path: Path, md: CheckpointMetadata, digest: str, size: int) -> None:
    """Write the entry (temporary file + rename); any failure only disables it (logged)."""
    try:
        blob = encode(md, digest, size)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except (OSError, ValueError, TypeError, OverflowError) as e:
        log.info("metadata cache not written (%s: %s)", type(e).__name__, e)
