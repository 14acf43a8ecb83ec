"""Streaming safetensors writer: header first, then tensors written in place through ``mmap``.

Format (https://github.com/huggingface/safetensors, "Format" section): an 8-byte
little-endian header length ``N``, ``N`` bytes of UTF-8 JSON
``{"__metadata__": {...}, "<name>": {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}}``
padded with spaces to a multiple of 8, then the raw little-endian tensor bytes;
``data_offsets`` are relative to the end of the header and tile the data
region without gaps.

Because every shape and dtype is known from the checkpoint metadata, the whole
header is written before any data. The file is then extended to its final size
with ``posix_fallocate`` (so a full disk fails before any tensor is read, never
as a ``SIGBUS`` on a mapped page) and mapped ``MAP_SHARED``: the DCP reader
fills each tensor's slice of the mapping in place (one copy, from the source
page cache to the destination page cache), and the slice's pages are dropped
from the process (``MADV_DONTNEED``; the data stays in the page cache) once the
tensor is complete, so the resident set holds the tensors in flight, not the
shard. Like ``safetensors.torch.save_file``, tensors are ordered by decreasing
element size so every tensor starts aligned to its element size.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..dcp.model import DTYPE_ITEMSIZE
from ..errors import ExportError, OutputError

if TYPE_CHECKING:
    import torch

__all__ = [
    "SAFETENSORS_DTYPES",
    "HeaderEntry",
    "ShardWriter",
    "build_header",
    "is_narrowing",
]

#: torch dtype name -> safetensors dtype tag (safetensors ``Dtype`` enum, 0.4+).
SAFETENSORS_DTYPES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0",
    "complex64": "C64",
}

# (exponent bits, mantissa bits) of the floating dtypes: a cast is widening when
# the target has at least as many of both (IEEE 754 / bfloat16 / OCP FP8 formats).
_FLOAT_BITS: dict[str, tuple[int, int]] = {
    "float64": (11, 52), "float32": (8, 23), "bfloat16": (8, 7), "float16": (5, 10),
    "float8_e4m3fn": (4, 3), "float8_e5m2": (5, 2), "float8_e4m3fnuz": (4, 3), "float8_e5m2fnuz": (5, 2),
    "float8_e8m0fnu": (8, 0),
}


def is_narrowing(src: str, dst: str) -> bool:
    """Whether casting floating dtype ``src`` to ``dst`` can lose range or precision.

    ``bfloat16 -> float16`` loses range and ``float16 -> bfloat16`` loses
    precision, so both are narrowing although the element size is equal.
    """
    if src == dst:
        return False
    a, b = _FLOAT_BITS.get(src), _FLOAT_BITS.get(dst)
    if a is None or b is None:
        return True
    return b[0] < a[0] or b[1] < a[1]


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a shard: output ``name``, torch dtype name, ``shape``; ``begin``/``end`` set by :func:`build_header`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int = 0
    end: int = 0

    @property
    def nbytes(self) -> int:
        n = DTYPE_ITEMSIZE[self.dtype]
        for s in self.shape:
            n *= s
        return n


def build_header(entries: list[HeaderEntry], metadata: dict[str, str] | None = None) -> tuple[bytes, list[HeaderEntry]]:
    """Lay out a safetensors file.

    Args:
        entries: the tensors (any order; names unique).
        metadata: ``__metadata__`` string map (default ``{"format": "pt"}``).

    Returns:
        ``(prefix, placed)``: the 8-byte length plus padded JSON header, and the
        entries with ``begin``/``end`` data offsets, in file order.

    Raises:
        ExportError: a dtype that safetensors cannot store, or duplicate names.
    """
    placed: list[HeaderEntry] = []
    order = sorted(range(len(entries)), key=lambda i: -DTYPE_ITEMSIZE[entries[i].dtype])
    pos = 0
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    for i in order:
        e = entries[i]
        tag = SAFETENSORS_DTYPES.get(e.dtype)
        if tag is None:
            raise ExportError(f"{e.name}: dtype {e.dtype} cannot be stored in safetensors",
                              fqn=e.name, hint="export it with --save-dtype float32/bfloat16 or leave it out with --filter")
        if e.name in header:
            raise ExportError(f"two tensors map to the output key {e.name!r}", fqn=e.name,
                              hint="fix the key rules (--rules) so every output key is unique")
        p = HeaderEntry(e.name, e.dtype, e.shape, pos, pos + e.nbytes)
        header[e.name] = {"dtype": tag, "shape": list(e.shape), "data_offsets": [p.begin, p.end]}
        placed.append(p)
        pos = p.end
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, placed


class ShardWriter:
    """One output safetensors file, pre-sized and mapped for in-place writes.

    Args:
        path: the file to create (must not exist).
        entries: its tensors (see :func:`build_header`).
        metadata: ``__metadata__`` (default ``{"format": "pt"}``).

    Raises:
        OutputError: the file cannot be created or the disk has no room for it.
        ExportError: see :func:`build_header`.
    """

    def __init__(self, path: Path, entries: list[HeaderEntry], metadata: dict[str, str] | None = None) -> None:
        prefix, placed = build_header(entries, metadata)
        self.path = path
        self.entries = {e.name: e for e in placed}
        self.order = [e.name for e in placed]
        self.data_start = len(prefix)
        self.size = self.data_start + (placed[-1].end if placed else 0)
        self.data_bytes = self.size - self.data_start
        fd = -1
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
            os.pwrite(fd, prefix, 0)
            if self.data_bytes:
                try:
                    os.posix_fallocate(fd, 0, self.size)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # filesystem without fallocate
                        raise
                    os.ftruncate(fd, self.size)
                self._map: mmap.mmap | None = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED,
                                                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
            else:
                self._map = None
        except OSError as e:
            raise OutputError(f"{path}: cannot create output file of {self.size} bytes ({e.strerror})",
                              path=path, hint="free disk space or choose another output location") from e
        finally:
            if fd >= 0:
                os.close(fd)
        self._buffer: torch.Tensor | None = None
        self._raw: memoryview | None = None

    def raw(self, name: str) -> memoryview:
        """Writable bytes of ``name`` in the file (torch-free)."""
        e = self.entries[name]
        if e.nbytes == 0:
            return memoryview(bytearray(0))
        if self._raw is None:
            assert self._map is not None
            self._raw = memoryview(self._map)
        start = self.data_start + e.begin
        return self._raw[start:start + e.nbytes]

    def view(self, name: str) -> torch.Tensor:
        """Writable tensor over ``name``'s bytes in the file (its dtype and shape)."""
        import torch

        e = self.entries[name]
        dtype = getattr(torch, e.dtype)
        if e.nbytes == 0:
            return torch.empty(e.shape, dtype=dtype)
        if self._buffer is None:
            assert self._map is not None
            self._buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        start = self.data_start + e.begin
        return self._buffer[start:start + e.nbytes].view(dtype).view(e.shape)

    def release(self, *names: str) -> None:
        """Drop the pages of finished tensors from this process (the data stays in the page cache).

        Adjacent tensors are merged into one range; only whole pages inside the
        ranges are dropped, and ranges under 1 MiB are left alone (not worth a syscall).
        """
        if self._map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        spans = sorted((self.entries[n].begin, self.entries[n].end) for n in names)
        merged: list[list[int]] = []
        for lo, hi in spans:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        page = mmap.PAGESIZE
        for lo, hi in merged:
            if hi - lo < (1 << 20):
                continue
            a = -(-(self.data_start + lo) // page) * page
            b = (self.data_start + hi) // page * page
            if b > a:
                self._map.madvise(mmap.MADV_DONTNEED, a, b - a)

    def close(self) -> None:
        """Unmap the file (every view must be gone). Idempotent."""
        self._buffer = None
        self._raw = None
        if self._map is not None:
            m, self._map = self._map, None
            try:
                m.close()
            except BufferError:
                # A view is still referenced (an exception traceback holds it); the
                # mapping is unmapped when that last reference goes away.
                pass
