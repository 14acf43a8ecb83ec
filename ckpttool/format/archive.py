"""Parse a ``torch.save`` zip archive that lies inside a window of a data file.

Each DCP tensor chunk is a complete ``torch.save`` archive (an uncompressed zip,
see ``torch/serialization.py``: ``<archive>/data.pkl`` plus one raw storage record
``<archive>/data/<key>`` per storage, 64-byte aligned). :func:`parse_tensor_archive`
locates the records, reads ``data.pkl`` with an allow-list unpickler that only
accepts ``torch._utils._rebuild_tensor_v2`` and typed storage names, and returns
where the raw storage bytes lie, so the caller can read them straight into the
destination tensor: one read, no unpickling of tensor data, no intermediate copy.
Anything unusual (big-endian, compressed record, unknown storage type) returns
``None`` and the caller falls back to ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import struct
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ckpttool.errors import UnsafePickleError

_T = TypeVar("_T")

__all__ = ["FileWindow", "TensorRecord", "parse_tensor_archive", "read_archive_pickle"]

# legacy typed-storage class names (torch/storage.py) -> dtype name
STORAGE_DTYPES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
    "UInt16Storage": "uint16",
    "UInt32Storage": "uint32",
    "UInt64Storage": "uint64",
    "Float8_e4m3fnStorage": "float8_e4m3fn",
    "Float8_e5m2Storage": "float8_e5m2",
}


class FileWindow(io.RawIOBase):
    """Read-only, seekable view of bytes ``[start, start+length)`` of an open fd."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self._fd, self._start, self._len, self._pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = max(0, min(len(mv), self._len - self._pos))
        if n == 0:
            return 0
        got = os.preadv(self._fd, [mv[:n]], self._start + self._pos)
        self._pos += got
        return got


@dataclass(frozen=True)
class TensorRecord:
    """Where a chunk's tensor lies in its archive.

    Attributes:
        dtype: dtype name from the storage type.
        size, stride, storage_offset: the view of the storage (elements).
        storage_numel: elements in the storage record.
        data_offset: byte offset of the raw storage record inside the window.
    """

    dtype: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage_numel: int
    data_offset: int


class _TensorPickle(pickle.Unpickler):
    """Unpickler for a single-tensor ``data.pkl`` (``_rebuild_tensor_v2`` + one storage)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_spec
        if module == "torch" and name in STORAGE_DTYPES:
            return ("storage_type", STORAGE_DTYPES[name])
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if (module, name) in _V3_GLOBALS:
            raise _NotV2Archive(name)  # float8/uint16 etc.: torch.load(weights_only=True) reads those
        raise UnsafePickleError(f"tensor archive names pickle global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], tuple)
            and pid[1][0] == "storage_type"
            and isinstance(pid[2], str)
            and type(pid[4]) is int
        ):
            return ("storage", pid[1][1], pid[2], pid[4])
        raise UnsafePickleError("tensor archive holds an unexpected persistent id")


_V3_GLOBALS = {("torch._utils", "_rebuild_tensor_v3"), ("torch.storage", "UntypedStorage")}


class _NotV2Archive(Exception):
    """The archive uses torch's newer tensor encoding (``_rebuild_tensor_v3`` + ``UntypedStorage``)."""


def _rebuild_spec(
    storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any
) -> tuple[str, Any, Any, Any, Any]:
    return ("tensor", storage, storage_offset, size, stride)


# What zipfile raises on damaged archives besides BadZipFile: NotImplementedError (a corrupt header
# that claims a multi-disk archive or an unknown compression), RuntimeError (an "encrypted" flag),
# struct.error / OverflowError (absurd header fields), zlib.error (corrupt deflate data).
_ZIP_DAMAGE = (NotImplementedError, RuntimeError, struct.error, OverflowError, zlib.error)


def _as_bad_zip(func: Callable[..., _T]) -> Callable[..., _T]:
    """Re-raise zipfile's other damage exceptions as :class:`zipfile.BadZipFile` (one type for callers)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> _T:
        try:
            return func(*args, **kwargs)
        except _ZIP_DAMAGE as e:
            raise zipfile.BadZipFile(f"damaged archive ({type(e).__name__}: {str(e)[:80]})") from e

    return wrapper


def _zip(window: FileWindow) -> zipfile.ZipFile:
    return zipfile.ZipFile(window, "r")


def _member(zf: zipfile.ZipFile, suffix: str) -> zipfile.ZipInfo | None:
    for info in zf.infolist():
        if info.filename.endswith(suffix) and info.filename.count("/") == suffix.count("/") + 1:
            return info
    return None


def _data_start(window: FileWindow, info: zipfile.ZipInfo) -> int:
    """Byte offset of a stored member's data (after its local file header)."""
    header = bytearray(30)
    window.seek(info.header_offset)
    if window.readinto(header) != 30 or header[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile("bad local file header")
    name_len = int.from_bytes(header[26:28], "little")
    extra_len = int.from_bytes(header[28:30], "little")
    return info.header_offset + 30 + name_len + extra_len


@_as_bad_zip
def read_archive_pickle(window: FileWindow) -> bytes:
    """Return ``data.pkl`` of the archive in ``window``.

    Raises:
        zipfile.BadZipFile, KeyError, ValueError: not a ``torch.save`` archive.
    """
    with _zip(window) as zf:  # closed here, not by a finalizer (where a Ctrl-C exception would be lost)
        info = _member(zf, "data.pkl")
        if info is None:
            raise KeyError("data.pkl")
        return zf.read(info)


@_as_bad_zip
def parse_tensor_archive(window: FileWindow) -> TensorRecord | None:
    """Locate the tensor in a single-tensor ``torch.save`` archive.

    Returns:
        The record, or ``None`` when the archive is valid-looking but unusual
        (big-endian, compressed member, unknown storage type) and should be
        read with ``torch.load(weights_only=True)`` instead.

    Raises:
        zipfile.BadZipFile, KeyError, ValueError: corrupt or not a tensor archive.
        UnsafePickleError: ``data.pkl`` names a global other than a tensor rebuild.
    """
    with _zip(window) as zf:  # closed here, not by a finalizer (where a Ctrl-C exception would be lost)
        return _parse_tensor_zip(zf, window)


def _parse_tensor_zip(zf: zipfile.ZipFile, window: FileWindow) -> TensorRecord | None:
    pkl = _member(zf, "data.pkl")
    if pkl is None:
        raise KeyError("data.pkl")
    bo = _member(zf, "byteorder")
    if bo is not None and zf.read(bo) != b"little":
        return None
    try:
        spec = _TensorPickle(io.BytesIO(zf.read(pkl))).load()
    except _NotV2Archive:
        return None
    except UnsafePickleError:
        raise
    except Exception as e:
        raise ValueError(f"data.pkl unreadable: {type(e).__name__}") from e
    if not (isinstance(spec, tuple) and len(spec) == 5 and spec[0] == "tensor"):
        raise ValueError("archive does not hold a single tensor")
    _, storage, storage_offset, size, stride = spec
    if not (isinstance(storage, tuple) and storage[0] == "storage"):
        raise ValueError("tensor without storage")
    _, dtype, key, storage_numel = storage
    if not (
        isinstance(size, tuple)
        and isinstance(stride, tuple)
        and len(size) == len(stride)
        and all(type(x) is int and x >= 0 for x in size + stride)
        and type(storage_offset) is int
        and storage_offset >= 0
        and storage_numel >= 0
    ):
        raise ValueError("tensor view fields are malformed")
    rec = _member(zf, f"data/{key}")
    if rec is None:
        if storage_numel != 0:
            raise KeyError(f"data/{key}")
        data_offset = 0
    else:
        if rec.compress_type != zipfile.ZIP_STORED:
            return None
        data_offset = _data_start(window, rec)
        from ckpttool.format.metadata import DTYPE_ITEMSIZE

        if rec.file_size != storage_numel * DTYPE_ITEMSIZE[dtype]:
            raise ValueError(f"storage record holds {rec.file_size} bytes, expected {storage_numel} elements")
    if any(s == 0 for s in size):
        span = 0
    else:
        span = storage_offset + sum((s - 1) * st for s, st in zip(size, stride)) + 1
    if span > storage_numel:
        raise ValueError("tensor view reaches past its storage")
    return TensorRecord(dtype, size, stride, storage_offset, storage_numel, data_offset)
