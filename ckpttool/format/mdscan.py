"""``.metadata`` read straight into int columns, without ``pickle.Unpickler`` (the native kernel).

The C kernel ``ckpt_mdscan`` (``ckpttool/engine/native/mdscan.c``) runs the subset of the pickle
machine (protocols 2-5, frames, memo) that ``pickle.dump`` writes for torch's ``Metadata`` with
CPython's stack, mark and memo rules (and no read across a frame's end: ``format/pickleframes.py``),
resolves only the allow-listed record classes, ``torch.Size``, the dtypes, ``_get_layout``, the
memory-format encoding and ``pathlib`` paths, and fills int64 columns: one row per entry, chunk, storage item and planner path, the distinct shapes once, and
strings as offsets into a pool of their bytes, copied as they are read. It builds no object per record, so the unpickler's object graph
(~12x the pickle, ``docs/performance.md``) is never in memory. Anything it does not recognise, or
that the unpickler would refuse, returns ``None`` here; :func:`ckpttool.format.unpickler.parse_metadata_owned`
then runs the allow-list unpickler, which gives its result or its own message. The checks of the
unpickler's conversion that need values (chunk inside its tensor, the record cap, storage ranges,
repeated keys) are made here on the columns, and where one fails the unpickler path runs too, so
every error line is the unpickler's. Without the native kernels (not built, ``CKPTTOOL_NATIVE=0``)
every read takes the unpickler path: the results are the same (``tests/format/test_mdscan.py``).

Given its own ``bytearray`` of at least :data:`DROP_MIN_BYTES` and a way to read the file again, the
kernel releases the buffer's pages behind the parse (``madvise(MADV_DONTNEED)``: nothing reads the
input behind the opcode being read), so the ``.metadata`` bytes (~465 MiB at 10^6 entries and 2.75 M
chunks) are not in memory beside the parse's cells and the columns; where it then declines the
stream, the file is read again for the unpickler.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from operator import add
from typing import Any

from ckpttool.engine import native
from ckpttool.format import limits, metadata
from ckpttool.format.mdstorage import DuplicateKeys, StorageTable, check_unique_keys, compact
from ckpttool.format.metadata import BytesMeta, CheckpointMetadata, ChunkMeta, DType, StorageInfo, TensorMeta

__all__ = ["DROP_MIN_BYTES", "scan_metadata", "scan_metadata_owned"]

_MAX_OFFSET = 2**63 - 1
_DTYPES = tuple(metadata.DTYPE_ITEMSIZE)
_DTYPE_LIST = "\n".join(_DTYPES).encode()
_N_COLS = 9
#: the smallest ``bytearray`` whose pages the kernel releases behind the parse (smaller ones are kept whole)
DROP_MIN_BYTES = 64 << 20


class _Out(ctypes.Structure):
    _fields_ = [
        ("cols", ctypes.c_void_p * _N_COLS),
        ("lens", ctypes.c_int64 * _N_COLS),
        ("pool", ctypes.c_void_p),
        ("pool_len", ctypes.c_int64),
        ("dropped", ctypes.c_int64),
    ]


def _kernel() -> tuple[Any, Any, Any] | None:
    scan = native.function(
        "ckpt_mdscan",
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_char_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.POINTER(_Out),
    )
    free = native.function("ckpt_mdscan_free", None, ctypes.POINTER(_Out))
    free_pool = native.function("ckpt_mdscan_free_pool", None, ctypes.POINTER(_Out))
    return None if scan is None or free is None or free_pool is None else (scan, free, free_pool)


#: Output values allowed per record of :func:`~ckpttool.format.limits.metadata_record_cap` (a real save
#: writes about 3: 5 per entry and storage item, 2 per chunk and planner path item).
VALUES_PER_RECORD = 8


class _Columns:
    """The kernel's nine columns, read in place (int64 ``memoryview``s, 8 bytes a value) until :meth:`free`."""

    def __init__(self, free: Any, free_pool: Any, out: _Out) -> None:
        self._free, self._free_pool, self._out = free, free_pool, out
        self.cols = [
            memoryview((ctypes.c_int64 * n).from_address(p)).cast("B").cast("q") if n else memoryview(b"").cast("q")
            for p, n in zip(out.cols, out.lens)
        ]

    def strings(self) -> list[str]:
        """The string table, decoded from the pool (``surrogatepass``, as the unpickler decodes); frees the pool."""
        n = self._out.pool_len
        pool = memoryview((ctypes.c_char * n).from_address(self._out.pool)).cast("B") if n else memoryview(b"")
        rows = self.cols[2]
        try:
            return [str(pool[o : o + k], "utf-8", "surrogatepass") for o, k in zip(rows[0::2], rows[1::2])]
        finally:
            pool.release()
            self._free_pool(ctypes.byref(self._out))

    def free(self) -> None:
        for c in self.cols:
            c.release()
        self.cols = []
        self._free(ctypes.byref(self._out))


def _columns(k: tuple[Any, Any, Any], data: bytes | bytearray, drop: bool) -> tuple[_Columns | None, bool]:
    """Kernel ``k``'s columns of ``data``, or ``None`` (a stream it declines), and whether any of ``data``'s
    pages were released (``drop``: ``data`` is a ``bytearray`` the caller gives up)."""
    scan, free, free_pool = k
    out = _Out()
    # row values (entries, chunks, storage, planner) within VALUES_PER_RECORD x the record cap: a pickle's shared
    # references could otherwise multiply a small file into huge columns (the unpickler path's dicts collapse them)
    cap = VALUES_PER_RECORD * limits.metadata_record_cap()
    address: int | None
    if isinstance(data, bytearray):
        view = (ctypes.c_char * len(data)).from_buffer(data)
        address = ctypes.addressof(view)
    else:
        view, address = None, ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
    try:
        rc = scan(address, len(data), _DTYPE_LIST, len(_DTYPE_LIST), cap, int(drop), ctypes.byref(out))
    finally:
        del view
    return (None if rc != 0 else _Columns(free, free_pool, out)), out.dropped > 0


def scan_metadata(data: bytes, source: str) -> CheckpointMetadata | None:
    """The :class:`CheckpointMetadata` of ``data`` read by the native kernel, or ``None``.

    ``None``: no kernel, a stream it does not recognise, or a value the unpickler's conversion
    refuses (the caller runs the unpickler, which names it). Equal to what the unpickler path
    returns whenever it returns one.
    """
    return scan_metadata_owned([data], source)


def scan_metadata_owned(
    holder: list[bytes | bytearray], source: str, reread: Callable[[], bytes] | None = None
) -> CheckpointMetadata | None:
    """:func:`scan_metadata` of the bytes in ``holder`` (a one-item list).

    Where a result is returned the list is emptied before the objects are built: with the
    caller's only reference handed over, the bytes (~465 MiB at 10^6 entries and 2.75 M chunks)
    are freed then. Where ``None`` is returned the list holds the file's bytes for the unpickler.
    A ``bytearray`` with ``reread`` (reads the same file again) is the caller's to give up: from
    :data:`DROP_MIN_BYTES` on, its pages are released as the parse passes them, and where the
    stream is declined after a release ``holder`` gets ``reread()``'s ``bytes`` in its place.

    Raises:
        as ``reread``, where it is called.
    """
    k = _kernel()
    if k is None:
        return None
    data = holder[0]
    owned = reread is not None and isinstance(data, bytearray)
    found, dropped = _columns(k, data, owned and len(data) >= DROP_MIN_BYTES)
    del data
    md = None
    if found is not None:
        try:
            md = _read_columns(found, holder)
        finally:
            found.free()
    if md is None and dropped:
        assert reread is not None
        holder.clear()  # its pages released behind the parse: read again for the unpickler
        holder.append(reread())
    return md


def _read_columns(found: _Columns, holder: list[Any]) -> CheckpointMetadata | None:
    """The metadata of the kernel's columns, or ``None`` where the unpickler path would refuse a value."""
    cols = found.cols
    ent, chk, sto = cols[3], cols[4], cols[5]
    # the unpickler path's refusals that the kernel leaves to the columns: the record cap, storage ranges
    # (chunks inside their tensor and a key given twice: the kernel declines them)
    if len(ent) // 5 + len(sto) // 5 + len(chk) // 2 > limits.metadata_record_cap() or not _ranges_ok(sto):
        return None
    if _repeated_storage_keys(sto, len(strs := found.strings()), len(cols[0]) // 2):
        return None  # a dict key given twice: unpickled, the last record wins (torch's pickle.load)
    holder.clear()  # every refusal is behind: the bytes go before the objects are built
    return _metadata(cols, strs)


def _repeated_storage_keys(sto: memoryview, nstr: int, ntup: int) -> bool:
    """Whether two storage records share one ``(fqn, offsets)`` key (string and tuple ids, equal values interned
    to one id; a ``.metadata`` written with two records for two empty chunks at one offset): the unpickler path
    reads such a stream. The grouping :class:`~ckpttool.format.mdstorage.StorageTable` does, run first."""
    if len(sto) < 10:
        return False
    try:
        check_unique_keys(compact(sto[0::5]), compact(sto[1::5]), nstr, ntup)
    except DuplicateKeys:
        return True
    except (ValueError, OverflowError):  # ids out of range: the conversion refuses them as before
        return False
    return False


def _ranges_ok(sto: memoryview) -> bool:
    """Storage offsets and lengths non-negative and their ends within int64 (as the unpickler path checks)."""
    if not sto:
        return True
    offs, lengths = sto[3::5], sto[4::5]
    return min(offs) >= 0 and min(lengths) >= 0 and max(map(add, offs, lengths)) <= _MAX_OFFSET


def _metadata(cols: list[memoryview], strs: list[str]) -> CheckpointMetadata:
    """The metadata of checked columns and their decoded strings."""
    shape_rows, ints, _, ent, chk, sto, pln, pit, top = cols
    shapes: list[tuple[int, ...] | None] = [
        tuple(ints[shape_rows[i] : shape_rows[i] + shape_rows[i + 1]]) for i in range(0, len(shape_rows), 2)
    ]
    entries = _entries(ent, chk, shapes, strs)
    shapes.append(None)  # offsets id -1: a byte item's index
    storage = _storage(sto, shapes, strs)
    items: list[Any] = [strs[v] if k == 0 else v for k, v in zip(pit[0::2], pit[1::2])]
    planner = {strs[k]: tuple(items[i : i + n]) for k, i, n in zip(pln[0::3], pln[1::3], pln[2::3])}
    if top[1] == 2:
        parts = items[top[2] : top[2] + top[3]]
        ckpt_id: str | None = os.path.join(*parts) if parts else ""
    else:
        ckpt_id = strs[top[2]] if top[1] == 1 else None
    return CheckpointMetadata(
        entries=entries,
        storage=storage,
        planner_data=planner,
        version=strs[top[0]] if top[0] >= 0 else None,
        checkpoint_id=ckpt_id,
        save_id=strs[top[4]] if top[4] >= 0 else None,
        writer="olmo-core" if top[5] else None,
    )


def _entries(ent: memoryview, chk: memoryview, shapes: list[Any], strs: list[str]) -> dict[str, TensorMeta | BytesMeta]:
    """Entries from the entry and chunk columns, chunks and layouts built once per distinct value (as the unpickler path).

    The kernel has checked every chunk inside its tensor and every key given once.
    """
    entries: dict[str, TensorMeta | BytesMeta] = {}
    bytes_meta = BytesMeta()
    dtypes = [DType(name) for name in _DTYPES]
    made: dict[tuple[int, int], ChunkMeta] = {}
    layouts: dict[tuple[DType, tuple[int, ...], tuple[ChunkMeta, ...]], TensorMeta] = {}
    for key, dt, size_id, first, n in zip(ent[0::5], ent[1::5], ent[2::5], ent[3::5], ent[4::5]):
        if dt < 0:
            entries[strs[key]] = bytes_meta
            continue
        chunks = []
        for ids in zip(chk[2 * first : 2 * (first + n) : 2], chk[2 * first + 1 : 2 * (first + n) : 2]):
            chunk = made.get(ids)
            if chunk is None:
                chunk = made[ids] = ChunkMeta(shapes[ids[0]], shapes[ids[1]])
            chunks.append(chunk)
        layout = (dtypes[dt], shapes[size_id], tuple(chunks))
        meta = layouts.get(layout)
        if meta is None:
            meta = layouts[layout] = TensorMeta(*layout)
        entries[strs[key]] = meta
    return entries


def _storage(sto: memoryview, shapes: list[Any], strs: list[str]) -> StorageTable | dict[Any, StorageInfo]:
    """Storage items from the (checked) storage columns: a :class:`StorageTable` of copies of the five columns
    (the kernel's are freed after this; ids as 32-bit ints, 28 bytes an item), no object per item."""
    if not sto:
        return {}
    fqn, tup, path = (compact(sto[i::5]) for i in range(3))
    offset, length = (memoryview(sto[i::5].tobytes()).cast("q") for i in (3, 4))
    return StorageTable(strs, shapes[:-1], None, fqn, tup, path, offset, length)
