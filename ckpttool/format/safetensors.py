"""safetensors files: the dtype table, the one bounded header reader, and the streaming writer.

Format: https://github.com/huggingface/safetensors ("Format"): 8-byte little-endian header
length, UTF-8 JSON header padded to 8 bytes, raw little-endian data with ``data_offsets``
relative to the header's end, tiling it. :data:`SAFETENSORS_DTYPES`/:data:`SAFETENSORS_TAGS`
follow ``safetensors/src/tensor.rs``. :func:`read_header` checks the length against the file
and :func:`header_cap` before reading, refuses duplicate keys and bounds the JSON graph; it
raises :class:`HeaderError`, which each caller names in its own error. The writer writes the
whole header first, preallocates the file (a full disk fails before any tensor is read) and
orders tensors by decreasing element size, as ``safetensors.torch.save_file``. ``docs/design.md`` §6.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _encode_key
from pathlib import Path
from typing import Any

from ckpttool.engine.io import ShortReadError, read_into, read_upto, write_all
from ckpttool.errors import ExportError, OutputError
from ckpttool.format import limits
from ckpttool.format.files import open_regular
from ckpttool.format.jsonfile import check_json_graph, unique_pairs
from ckpttool.format.metadata import DTYPE_ITEMSIZE, FLOATING_DTYPES

__all__ = [
    "MAX_HEADER_BYTES",
    "SAFETENSORS_DTYPES",
    "SAFETENSORS_TAGS",
    "HeaderEntry",
    "HeaderError",
    "ShardWriter",
    "build_header",
    "header_cap",
    "is_narrowing",
    "read_header",
]

#: The safetensors library refuses headers above 100 MB (``safetensors/src/tensor.rs``, ``MAX_HEADER_SIZE``).
MAX_HEADER_BYTES = 100_000_000

#: torch dtype name -> safetensors dtype tag (safetensors ``Dtype`` enum, 0.4+).
SAFETENSORS_DTYPES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
    "complex64": "C64",
}
#: safetensors dtype tag -> torch dtype name: :data:`SAFETENSORS_DTYPES` the other way.
SAFETENSORS_TAGS: dict[str, str] = {tag: name for name, tag in SAFETENSORS_DTYPES.items()}

# (exponent bits, mantissa bits) of the floating dtypes: a cast is widening when
# the target has at least as many of both (IEEE 754 / bfloat16 / OCP FP8 formats).
_FLOAT_BITS: dict[str, tuple[int, int]] = {
    "float64": (11, 52),
    "float32": (8, 23),
    "bfloat16": (8, 7),
    "float16": (5, 10),
    "float8_e4m3fn": (4, 3),
    "float8_e5m2": (5, 2),
    "float8_e4m3fnuz": (4, 3),
    "float8_e5m2fnuz": (5, 2),
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


def header_cap() -> int:
    """The largest header :func:`read_header` reads: :data:`MAX_HEADER_BYTES`, or ``--max-object-size`` when lower."""
    return min(MAX_HEADER_BYTES, limits.current().max_object_bytes)


class HeaderError(ValueError):
    """A safetensors header :func:`read_header` refuses; the caller words its own error from it.

    Attributes:
        kind: ``"short"`` (under 8 bytes), ``"too_long"`` (length above ``cap``), ``"past_end"``
            (length past the file's end), ``"truncated"`` (the file ended while read),
            ``"not_json"`` (not UTF-8 JSON, or a duplicate key: ``cause``), ``"not_object"``.
        size: the file's size in bytes; length: the header length it declares (0 before read).
        cap: :func:`header_cap` when read; cause: the decoder's exception for ``"not_json"``.
    """

    def __init__(
        self, kind: str, *, size: int, length: int = 0, cap: int = 0, cause: ValueError | RecursionError | None = None
    ) -> None:
        super().__init__(kind)
        self.kind, self.size, self.length, self.cap, self.cause = kind, size, length, cap, cause

    def reason(self, words: dict[str, str]) -> str:
        """``words[kind]`` (a caller's wording of each kind) filled with ``{size}``, ``{length}``,
        ``{cap}`` and ``{cause}`` (the decoder's message, 80 characters at most)."""
        return words[self.kind].format(size=self.size, length=self.length, cap=self.cap, cause=str(self.cause)[:80])


def read_header(path: Path, size: int | None = None) -> tuple[dict[str, Any], int]:
    """Read and parse the JSON header of a safetensors file, size-checked before it is read.

    Args:
        path: the file (the caller confines it; opened as a regular file only).
        size: its size in bytes (``fstat`` when ``None``).

    Returns:
        ``(header, data_start)``: the parsed header (``__metadata__`` included) and the absolute
        offset of the data region (``8 + N``).

    Raises:
        HeaderError: in this order: shorter than 8 bytes, a length above :func:`header_cap`,
            past the file's end, a short read, not UTF-8 JSON or a duplicate key, then (after the
            bounds below) not a JSON object.
        JsonDepthError, IntegerRangeError: nested deeper than :attr:`Limits.max_depth`, an int
            beyond 256 bits (:func:`~ckpttool.format.jsonfile.check_json_graph`).
        OSError: the file cannot be opened or read; NotRegularFileError: a FIFO, device,
            socket or directory.
    """
    fd = open_regular(path)  # never a FIFO or device
    try:
        if size is None:
            size = os.fstat(fd).st_size
        head = read_upto(fd, 8, 0)
        if len(head) < 8:
            raise HeaderError("short", size=size)
        (n,) = struct.unpack("<Q", head)
        cap = header_cap()
        if n > cap:
            raise HeaderError("too_long", size=size, length=n, cap=cap)
        if n > size - 8:
            raise HeaderError("past_end", size=size, length=n, cap=cap)
        raw = read_upto(fd, n, 8)
    finally:
        os.close(fd)
    if len(raw) != n:
        raise HeaderError("truncated", size=size, length=n, cap=cap)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_pairs)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError, DuplicateKeyError, digits
        raise HeaderError("not_json", size=size, length=n, cap=cap, cause=e) from None
    check_json_graph(header, str(path))
    if not isinstance(header, dict):
        raise HeaderError("not_object", size=size, length=n, cap=cap)
    return header, 8 + n


@dataclass(slots=True, unsafe_hash=True)
class HeaderEntry:
    """One tensor of a shard: output ``name``, torch dtype name, ``shape``; ``begin``/``end`` set by :func:`build_header`.

    A value (nothing assigns its fields once built); not frozen, because an export of 10^6 tensors
    builds 10^6 of them and a frozen dataclass is several times slower to build.
    """

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
    prefix, ordered, spans = _layout(entries, metadata)
    return prefix, [HeaderEntry(e.name, e.dtype, e.shape, *spans[e.name]) for e in ordered]


def _layout(
    entries: list[HeaderEntry], metadata: dict[str, str] | None
) -> tuple[bytes, list[HeaderEntry], dict[str, tuple[int, int]]]:
    """:func:`build_header` without an object per placed tensor: ``(prefix, entries in file order,
    name -> (begin, end))``.

    The JSON text is joined from per-entry pieces: the same bytes as ``json.dumps(header,
    separators=(",", ":"))`` of the dict ``{"__metadata__": ..., name: {"dtype", "shape",
    "data_offsets"}, ...}`` (names escaped as ``json.dumps`` escapes keys), without a dict per tensor.
    """
    itemsize = DTYPE_ITEMSIZE
    dtypes = {e.dtype for e in entries}
    if len(dtypes) > 1:  # larger items first (alignment), a stable sort
        rank = {d: -itemsize[d] for d in dtypes}
        ordered = sorted(entries, key=lambda e: rank[e.dtype])
    else:
        ordered = list(entries)
    head = '{"__metadata__":' + json.dumps(dict(metadata or {"format": "pt"}), separators=(",", ":"))
    one = _one_layout(ordered, head)
    if one is not None:
        return one
    pos = 0
    spans: dict[str, tuple[int, int]] = {}
    parts = [head]
    layouts: dict[tuple[str, tuple[int, ...]], tuple[int, str]] = {}  # (dtype, shape) -> (bytes, JSON text)
    for e in ordered:
        layout = layouts.get((e.dtype, e.shape))
        if layout is None:
            tag = SAFETENSORS_DTYPES.get(e.dtype)
            if tag is None:
                raise ExportError(
                    f"{e.name}: dtype {e.dtype} cannot be stored in safetensors",
                    fqn=e.name,
                    hint=(
                        "export it with `save_dtype` float32/bfloat16 or leave it out with `filter_glob`"
                        if e.dtype in FLOATING_DTYPES
                        else "leave it out with `filter_glob`, or with a `rules` entry mapping its checkpoint key to null "
                        "(`to: null`, docs/export.md); `save_dtype` casts floating-point tensors only"
                    ),
                )
            shape_text = json.dumps(list(e.shape), separators=(",", ":"))
            layout = layouts[(e.dtype, e.shape)] = (
                e.nbytes,
                f'{{"dtype":"{tag}","shape":{shape_text},"data_offsets":[',
            )
        if e.name in spans or e.name == "__metadata__":
            raise ExportError(
                f"two tensors map to the output key {e.name!r}",
                fqn=e.name,
                hint="fix the key rules (`rules`) so every output key is unique",
            )
        end = pos + layout[0]
        spans[e.name] = (pos, end)
        parts.append(f"{_encode_key(e.name)}:{layout[1]}{pos},{end}]}}")
        pos = end
    return _prefix(",".join(parts)), ordered, spans


def _prefix(body: str) -> bytes:
    """The 8-byte length and the header text ``body + "}"``, padded with spaces to a multiple of 8 bytes."""
    text = (body + "}").encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _one_layout(
    ordered: list[HeaderEntry], head: str
) -> tuple[bytes, list[HeaderEntry], dict[str, tuple[int, int]]] | None:
    """:func:`_layout` of tensors that all have one dtype and shape (10^6 one-chunk tensors), as columns:
    the offsets a ``range``, the names escaped in one pass, the text joined once. ``None``: several
    layouts, a dtype safetensors cannot store, or a name twice (the loop of :func:`_layout` names it)."""
    if not ordered:
        return None
    e0 = ordered[0]
    dtype, shape = e0.dtype, e0.shape
    tag = SAFETENSORS_DTYPES.get(dtype)
    if tag is None or any(e.dtype != dtype or e.shape != shape for e in ordered):
        return None
    names = [e.name for e in ordered]
    nbytes = e0.nbytes
    offs: range | list[int] = range(0, (len(names) + 1) * nbytes, nbytes) if nbytes else [0] * (len(names) + 1)
    spans = dict(zip(names, zip(offs, offs[1:])))
    if len(spans) != len(names) or "__metadata__" in spans:
        return None
    shape_text = json.dumps(list(shape), separators=(",", ":"))
    mid = f':{{"dtype":"{tag}","shape":{shape_text},"data_offsets":['
    keys = [_encode_key(k) for k in names]
    body = ",".join([head, *[f"{k}{mid}{a},{b}]}}" for k, a, b in zip(keys, offs, offs[1:])]])
    return _prefix(body), ordered, spans


class ShardWriter:
    """One output safetensors file, header written and pre-sized, open for positional writes.

    Args:
        path: the file to create (must not exist).
        entries: its tensors (see :func:`build_header`).
        metadata: ``__metadata__`` (default ``{"format": "pt"}``).
        display: the path named in errors (the file's final place, not the temporary directory).
        digest: a digest algorithm (:mod:`ckpttool.format.digest`): every write is digested as it
            is made (:attr:`extents`: ``(name, byte offset in the tensor, file offset, length, digest)``), and the
            header (:attr:`header_digest`), so the file's manifest needs no second read.

    Raises:
        OutputError: the file cannot be created or the disk has no room for it.
        ExportError: see :func:`build_header`.
    """

    def __init__(
        self,
        path: Path,
        entries: list[HeaderEntry],
        metadata: dict[str, str] | None = None,
        *,
        display: Path | None = None,
        digest: str | None = None,
    ) -> None:
        import threading

        prefix, _, spans = _layout(entries, metadata)
        self.digest = digest
        self.extents: list[tuple[str, int, int, int, str]] = []
        self._lock = threading.Lock()
        self.header_digest: str | None = None
        if digest is not None:
            from ckpttool.format.digest import digest_bytes

            self.header_digest = digest_bytes(prefix, digest)
        self.path = path
        self.spans = spans  # name -> (begin, end) of its data, relative to the header's end
        self.data_start = len(prefix)
        self.size = self.data_start + max((end for _, end in spans.values()), default=0)
        self.fd = -1
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
            write_all(self.fd, prefix, 0)
            if self.size > self.data_start:
                try:
                    os.posix_fallocate(self.fd, 0, self.size)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # filesystem without fallocate
                        raise
                    os.ftruncate(self.fd, self.size)
        except OSError as e:
            self.close()
            shown = display or path
            raise OutputError(
                f"{shown}: cannot create output file of {self.size} bytes ({e.strerror})",
                path=shown,
                hint="free disk space or choose another output location",
            ) from e

    def offset(self, name: str) -> int:
        """Absolute file offset of ``name``'s first byte."""
        return self.data_start + self.spans[name][0]

    def write(self, name: str, data: memoryview, at: int = 0) -> None:
        """Write ``data`` at byte ``at`` of tensor ``name`` (thread-safe: positional write)."""
        begin, end = self.spans[name]
        assert at + len(data) <= end - begin, f"{name}: write past the tensor's end"
        write_all(self.fd, data, self.data_start + begin + at)
        if self.digest is not None:
            h = self.new_hasher()
            h.update(data.cast("B") if data.format != "B" else data)
            self.note(name, at, data.nbytes, h.hexdigest())

    def new_hasher(self) -> Any:
        """A fresh hasher of :attr:`digest` (for bytes this writer does not pass itself, e.g. a file-to-file copy)."""
        from ckpttool.format.digest import new_hasher

        assert self.digest is not None
        return new_hasher(self.digest)

    def note(self, name: str, at: int, length: int, digest: str) -> None:
        """Record the digest of ``length`` bytes written at byte ``at`` of tensor ``name`` (thread-safe)."""
        if length:
            start = self.data_start + self.spans[name][0] + at
            with self._lock:
                self.extents.append((name, at, start, length, digest))

    def read(self, name: str, dest: memoryview) -> None:
        """Read tensor ``name``'s bytes back into ``dest`` (exactly its size)."""
        begin, end = self.spans[name]
        assert len(dest) == end - begin
        try:
            read_into(self.fd, dest, self.data_start + begin)
        except ShortReadError:
            raise OutputError(f"{self.path}: short read of {name!r} from the output", path=self.path) from None

    def close(self) -> None:
        """Close the file. Idempotent."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
