"""``.metadata`` read straight into int columns, without ``pickle.Unpickler`` (the native kernel).

The C kernel ``ckpt_mdscan`` (``ckpttool/engine/native/mdscan.c``) runs the subset of the pickle
machine (protocols 2-5, frames, memo) that ``pickle.dump`` writes for torch's ``Metadata`` with
CPython's stack, mark and memo rules (and no read across a frame's end: ``format/pickleframes.py``),
resolves only the allow-listed record classes, ``torch.Size``, the dtypes, ``_get_layout``, the
memory-format encoding and ``pathlib`` paths, and fills int64 columns: one row per entry, chunk, storage item and planner path, the distinct shapes once, and
strings as offsets into the input. It builds no object per record, so the unpickler's object graph
(~12x the pickle, ``docs/performance.md``) is never in memory. Anything it does not recognise, or
that the unpickler would refuse, returns ``None`` here; :func:`ckpttool.format.unpickler.parse_metadata_owned`
then runs the allow-list unpickler, which gives its result or its own message. The checks of the
unpickler's conversion that need values (chunk inside its tensor, the record cap, storage ranges,
repeated keys) are made here on the columns, and where one fails the unpickler path runs too, so
every error line is the unpickler's. Without the native kernels (not built, ``CKPTTOOL_NATIVE=0``)
every read takes the unpickler path: the results are the same (``tests/format/test_mdscan.py``).
"""

from __future__ import annotations

import ctypes
import os
from operator import add
from typing import Any

from ckpttool.engine import native
from ckpttool.format import limits
from ckpttool.format.mdstorage import StorageTable, compact
from ckpttool.format.metadata import (
    DTYPE_ITEMSIZE,
    BytesMeta,
    CheckpointMetadata,
    ChunkMeta,
    DType,
    StorageInfo,
    TensorMeta,
)

__all__ = ["scan_metadata", "scan_metadata_owned"]

_MAX_OFFSET = 2**63 - 1
_DTYPES = tuple(DTYPE_ITEMSIZE)
_DTYPE_LIST = "\n".join(_DTYPES).encode()
_N_COLS = 9


class _Out(ctypes.Structure):
    _fields_ = [("cols", ctypes.c_void_p * _N_COLS), ("lens", ctypes.c_int64 * _N_COLS)]


def _kernel() -> tuple[Any, Any] | None:
    scan = native.function(
        "ckpt_mdscan",
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int64,
        ctypes.c_char_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.POINTER(_Out),
    )
    free = native.function("ckpt_mdscan_free", None, ctypes.POINTER(_Out))
    return None if scan is None or free is None else (scan, free)


#: Output values allowed per record of :func:`~ckpttool.format.limits.metadata_record_cap` (a real save
#: writes about 3: 5 per entry and storage item, 2 per chunk and planner path item).
VALUES_PER_RECORD = 8


class _Columns:
    """The kernel's nine columns, read in place (int64 ``memoryview``s, 8 bytes a value) until :meth:`free`."""

    def __init__(self, free: Any, out: _Out) -> None:
        self._free, self._out = free, out
        self.cols = [
            memoryview((ctypes.c_int64 * n).from_address(p)).cast("B").cast("q") if n else memoryview(b"").cast("q")
            for p, n in zip(out.cols, out.lens)
        ]

    def free(self) -> None:
        for c in self.cols:
            c.release()
        self.cols = []
        self._free(ctypes.byref(self._out))


def _columns(data: bytes) -> _Columns | None:
    """The kernel's columns of ``data``, or ``None`` (no kernel, or a stream it declines)."""
    k = _kernel()
    if k is None:
        return None
    scan, free = k
    out = _Out()
    # row values (entries, chunks, storage, planner) within VALUES_PER_RECORD x the record cap: a pickle's shared
    # references could otherwise multiply a small file into huge columns (the unpickler path's dicts collapse them)
    cap = VALUES_PER_RECORD * limits.metadata_record_cap()
    if scan(data, len(data), _DTYPE_LIST, len(_DTYPE_LIST), cap, ctypes.byref(out)) != 0:
        return None
    return _Columns(free, out)


def scan_metadata(data: bytes, source: str) -> CheckpointMetadata | None:
    """The :class:`CheckpointMetadata` of ``data`` read by the native kernel, or ``None``.

    ``None``: no kernel, a stream it does not recognise, or a value the unpickler's conversion
    refuses (the caller runs the unpickler, which names it). Equal to what the unpickler path
    returns whenever it returns one.
    """
    return scan_metadata_owned([data], source)


def scan_metadata_owned(holder: list[bytes], source: str) -> CheckpointMetadata | None:
    """:func:`scan_metadata` of the bytes in ``holder`` (a one-item list).

    Where a result is returned the list is emptied once the strings are decoded, before the
    objects are built: with the caller's only reference handed over, the bytes (~465 MiB at 10^6
    entries and 2.75 M chunks) are freed then. Where ``None`` is returned they are left in it.
    """
    data = holder[0]
    found = _columns(data)
    if found is None:
        return None
    try:
        cols = found.cols
        ent, chk, sto = cols[3], cols[4], cols[5]
        # the unpickler path's refusals that the kernel leaves to the columns: the record cap, storage ranges
        # (chunks inside their tensor and a key given twice: the kernel declines them)
        if len(ent) // 5 + len(sto) // 5 + len(chk) // 2 > limits.metadata_record_cap() or not _ranges_ok(sto):
            return None
        mv = memoryview(data)
        str_rows = cols[2]
        strs = [str(mv[o : o + n], "utf-8", "surrogatepass") for o, n in zip(str_rows[0::2], str_rows[1::2])]
        mv.release()
        del data
        holder.clear()  # every refusal is behind: the bytes go before the objects are built
        return _metadata(cols, strs)
    finally:
        found.free()


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
