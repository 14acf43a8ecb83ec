"""Parse a ``torch.save`` zip archive inside a window of a data file, as strictly as torch reads it.

Source of the format: ``torch/serialization.py`` and ``caffe2/serialize/inline_container.cc``
(miniz). :func:`parse_archive` accepts only archives two zip readers cannot read differently:
the end records end the window and nothing precedes the first local header; member names are
ones torch reads, under one prefix, no case-insensitive duplicates; local headers agree with
the central directory, members neither gap nor overlap, every byte lies inside the window;
stored or deflate only, no encryption, inflation capped (:mod:`ckpttool.format.limits`).
:func:`parse_tensor_archive` reads ``data.pkl`` with an allow-list unpickler
(``_rebuild_tensor_v2``/``_v3`` only) and returns where the raw storage record lies and its
CRC-32. ``docs/design.md`` §5 ("One chunk locator"), §6; ``docs/security.md``.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Protocol

from ckpttool.engine.crc import crc32
from ckpttool.engine.io import ShortReadError, read_exact
from ckpttool.errors import SizeLimitError, StorageTupleError, UnsafePickleError
from ckpttool.format import limits
from ckpttool.format.metadata import DTYPE_ITEMSIZE
from ckpttool.format.pickleframes import PickleBombError, pickle_input

__all__ = [
    "Archive",
    "ArchiveChecksumError",
    "ArchiveError",
    "BytesWindow",
    "FileWindow",
    "Member",
    "PrereadWindow",
    "STORAGE_DTYPES",
    "TensorRecord",
    "Window",
    "check_torch_records",
    "inflate_into",
    "parse_archive",
    "parse_tensor_archive",
    "read_archive_pickle",
]

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


class ArchiveError(ValueError):
    """The bytes are not a ``torch.save`` archive that torch and ckpttool would read the same way."""


class ArchiveChecksumError(ArchiveError):
    """A member's bytes do not match the CRC-32 of its zip entry."""


# --------------------------------------------------------------------------- windows
class Window(Protocol):
    """Bytes ``[0, length)`` readable at any offset (a chunk's window of its data file, or bytes in memory)."""

    @property
    def length(self) -> int: ...

    def pread(self, offset: int, n: int) -> bytes: ...


class FileWindow(io.RawIOBase):
    """Read-only, seekable view of bytes ``[start, start+length)`` of an open fd (reads never leave it)."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self.fd, self.start, self._len, self._pos = fd, start, length, 0

    @property
    def length(self) -> int:
        return self._len

    def pread(self, offset: int, n: int) -> bytes:
        """``n`` bytes at ``offset`` of the window.

        Raises:
            ArchiveError: the range leaves the window, or the file ends first.
        """
        if offset < 0 or n < 0 or offset + n > self._len:
            raise ArchiveError(f"read of [{offset}, {offset + n}) leaves the archive's {self._len} bytes")
        try:
            return read_exact(self.fd, n, self.start + offset)
        except ShortReadError as e:
            raise ArchiveError(f"data file ends inside the archive (at {e.offset})") from None

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
        got = os.preadv(self.fd, [mv[:n]], self.start + self._pos)
        self._pos += got
        return got


class PrereadWindow(FileWindow):
    """A :class:`FileWindow` whose bytes were read already: reads come from memory, offsets stay the file's.

    One read can fetch the archives of many small chunks that lie together in a data file
    (:meth:`ckpttool.format.reader.CheckpointReader.read_small_chunks`); each archive is then
    parsed from its slice without a system call.
    """

    def __init__(self, fd: int, start: int, data: memoryview) -> None:
        super().__init__(fd, start, len(data))
        self._mv = data

    def pread(self, offset: int, n: int) -> bytes:
        if offset < 0 or n < 0 or offset + n > self._len:
            raise ArchiveError(f"read of [{offset}, {offset + n}) leaves the archive's {self._len} bytes")
        return bytes(self._mv[offset : offset + n])

    def view(self, offset: int, n: int) -> memoryview:
        """The bytes ``[offset, offset + n)`` of the window, without a copy (the range is checked)."""
        if offset < 0 or n < 0 or offset + n > self._len:
            raise ArchiveError(f"read of [{offset}, {offset + n}) leaves the archive's {self._len} bytes")
        return self._mv[offset : offset + n]

    def readinto(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = max(0, min(len(mv), self._len - self._pos))
        mv[:n] = self._mv[self._pos : self._pos + n]
        self._pos += n
        return n


class BytesWindow:
    """A :class:`Window` over bytes in memory (a byte item, a decoded stream transform)."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._mv = memoryview(data).cast("B")

    @property
    def length(self) -> int:
        return len(self._mv)

    def pread(self, offset: int, n: int) -> bytes:
        if offset < 0 or n < 0 or offset + n > len(self._mv):
            raise ArchiveError(f"read of [{offset}, {offset + n}) leaves the archive's {len(self._mv)} bytes")
        return bytes(self._mv[offset : offset + n])


class _Prefetched:
    """A window whose first and last 64 KiB are read once: the headers of a chunk archive, in two reads.

    A tensor chunk's archive has its small members and the record's local header at the start
    and the rest of its members and the directories at the end; parsing it takes ~30 small reads.
    """

    _SPAN = 64 << 10

    def __init__(self, window: Window) -> None:
        self._w = window
        n = window.length
        self._head = window.pread(0, min(n, self._SPAN))
        self._tail_at = max(len(self._head), n - self._SPAN)
        self._tail = window.pread(self._tail_at, n - self._tail_at) if n > self._tail_at else b""

    @property
    def length(self) -> int:
        return self._w.length

    def pread(self, offset: int, n: int) -> bytes:
        if offset >= 0 and n >= 0:
            if offset + n <= len(self._head):
                return self._head[offset : offset + n]
            if offset >= self._tail_at and offset + n <= self.length:
                return self._tail[offset - self._tail_at : offset - self._tail_at + n]
        return self._w.pread(offset, n)


# --------------------------------------------------------------------------- zip structure
STORED, DEFLATED = 0, 8
_EOCD = struct.Struct("<4sHHHHIIH")  # signature, disk, cd disk, entries here, entries, cd size, cd offset, comment
_Z64_LOCATOR = struct.Struct("<4sIQI")
_Z64_EOCD = struct.Struct("<4sQHHIIQQQQ")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_U32 = 0xFFFFFFFF
_FLAG_ENCRYPTED, _FLAG_DESCRIPTOR = 0x1, 0x8
# Members torch.save writes and torch.load reads (torch/serialization.py, caffe2/serialize/inline_container.cc).
_MEMBER_RE = re.compile(
    r"data\.pkl|byteorder|version|\.data/version|\.format_version|\.storage_alignment|"
    r"\.data/serialization_id|data/[0-9]{1,20}"
)
_SMALL_MEMBER_BYTES = 1024  # version, byteorder, .format_version, ...: a few bytes each


@dataclass(frozen=True)
class Member:
    """One archive member, its local header checked against its central entry.

    Attributes:
        name: name inside the archive folder (``data.pkl``, ``data/0``).
        method: ``0`` stored or ``8`` deflate.
        crc32: CRC-32 of the uncompressed bytes (central directory).
        compressed_size, size: bytes stored / uncompressed.
        header_offset: offset of the local header in the window.
        data_offset: offset of the first data byte in the window.
    """

    name: str
    method: int
    crc32: int
    compressed_size: int
    size: int
    header_offset: int
    data_offset: int


@dataclass(frozen=True)
class Archive:
    """A parsed ``torch.save`` archive: its folder ``prefix`` and members by name."""

    prefix: str
    members: dict[str, Member]

    def read(self, window: Window, name: str, cap: int, *, what: str = "") -> bytes | None:
        """The uncompressed bytes of member ``name`` (``None`` if absent), CRC-checked.

        Raises:
            SizeLimitError: the member is larger than ``cap`` (checked before reading or inflating).
            ArchiveError: damaged member; ArchiveChecksumError: CRC mismatch.
        """
        m = self.members.get(name)
        if m is None:
            return None
        if m.size > cap:
            raise SizeLimitError(f"{what or name} is {m.size} bytes uncompressed, over the cap of {limits.human(cap)}")
        if m.method == STORED:
            data = window.pread(m.data_offset, m.size)
        else:
            out = bytearray(m.size)
            inflate_into(window, m, memoryview(out))
            data = bytes(out)
        if crc32(data, 0) != m.crc32:
            raise ArchiveChecksumError(f"member {name} does not match its CRC-32")
        return data


def _extra_fields(extra: bytes) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    pos = 0
    while pos + 4 <= len(extra):
        hid, size = struct.unpack_from("<HH", extra, pos)
        if pos + 4 + size > len(extra):
            raise ArchiveError("malformed extra field")
        out.setdefault(hid, extra[pos + 4 : pos + 4 + size])
        pos += 4 + size
    return out


def _zip64(extra: bytes, values: list[int]) -> list[int]:
    """Replace the ``0xFFFFFFFF`` items of ``values`` (usize, csize, offset order) from a zip64 extra field."""
    need = [i for i, v in enumerate(values) if v == _U32]
    if not need:
        return values
    z = _extra_fields(extra).get(0x0001)
    if z is None or len(z) < 8 * len(need):
        raise ArchiveError("zip64 sizes missing")
    out = list(values)
    for j, i in enumerate(need):
        (out[i],) = struct.unpack_from("<Q", z, 8 * j)
    return out


def _end_records(window: Window) -> tuple[int, int, int, int]:
    """``(entries, cd offset, cd size, cd end)`` from the end records, which must end the window."""
    n = window.length
    if n < _EOCD.size:
        raise ArchiveError(f"{n} bytes: too short for a zip archive")
    tail_len = min(n, _EOCD.size + 0xFFFF)
    tail = window.pread(n - tail_len, tail_len)
    pos = tail.rfind(b"PK\x05\x06")
    fields = None
    while pos >= 0:
        fields = _EOCD.unpack_from(tail, pos) if pos + _EOCD.size <= len(tail) else None
        if fields is not None and pos + _EOCD.size + fields[7] == len(tail):
            break
        pos = tail.rfind(b"PK\x05\x06", 0, pos)
    if pos < 0 or fields is None:
        raise ArchiveError("no end-of-central-directory record at the end of the archive")
    eocd = n - tail_len + pos
    _, disk, cd_disk, here, entries, cd_size, cd_offset, _ = fields
    cd_end = eocd
    loc_at = eocd - _Z64_LOCATOR.size
    if loc_at >= 0 and window.pread(loc_at, 4) == b"PK\x06\x07":
        _, z_disk, z_at, z_disks = _Z64_LOCATOR.unpack(window.pread(loc_at, _Z64_LOCATOR.size))
        if z_at < 0 or z_at + _Z64_EOCD.size > loc_at:
            raise ArchiveError("zip64 end record outside the archive")
        z = _Z64_EOCD.unpack(window.pread(z_at, _Z64_EOCD.size))
        if z[0] != b"PK\x06\x06" or z_at + 12 + z[1] != loc_at:
            raise ArchiveError("malformed zip64 end record")
        _, _, _, _, disk, cd_disk, here, entries, cd_size, cd_offset = z
        if z_disk != 0 or z_disks > 1:
            raise ArchiveError("multi-disk archive")
        cd_end = z_at
    elif _U32 in (cd_size, cd_offset) or 0xFFFF in (here, entries):
        raise ArchiveError("zip64 fields without a zip64 end record")
    if disk != 0 or cd_disk != 0 or here != entries:
        raise ArchiveError("multi-disk archive")
    if cd_offset + cd_size != cd_end:
        # zipfile would shift every offset by the difference (data prepended); torch would not.
        raise ArchiveError("central directory does not end where the end records begin")
    return entries, cd_offset, cd_size, cd_end


def _descriptor_len(window: Window, at: int, next_at: int, crc: int, csize: int, size: int) -> None:
    """Check the data descriptor torch writes after a member (flag bit 3) fills ``[at, next_at)`` and agrees."""
    room = next_at - at
    raw = window.pread(at, min(room, 24)) if room > 0 else b""
    forms = ((b"PK\x07\x08", "<III"), (b"PK\x07\x08", "<IQQ"), (b"", "<III"), (b"", "<IQQ"))
    for sig, fmt in forms:
        length = len(sig) + struct.calcsize(fmt)
        if length != room or not raw.startswith(sig):
            continue
        if struct.unpack_from(fmt, raw, len(sig)) == (crc, csize, size):
            return
    raise ArchiveError("data descriptor disagrees with the central directory")


def parse_archive(window: Window, *, max_members: int | None = None) -> Archive:
    """Parse the zip structure of a ``torch.save`` archive (see the module docstring).

    Args:
        window: the archive's bytes.
        max_members: cap on members (default :attr:`Limits.max_archive_members`).

    Raises:
        ArchiveError: anything torch's reader would refuse or read differently from ckpttool.
    """
    cap = max_members if max_members is not None else limits.current().max_archive_members
    if not isinstance(window, _Prefetched):
        window = _Prefetched(window)
    entries, cd_offset, cd_size, _ = _end_records(window)
    if entries == 0:
        raise ArchiveError("archive has no members")
    if entries > cap:
        raise ArchiveError(f"archive has {entries} members, over the cap of {cap}")
    if cd_size > entries * (_CENTRAL.size + 3 * 0xFFFF):
        raise ArchiveError("central directory larger than its entries can be")
    cd = window.pread(cd_offset, cd_size)
    prefix, raw_members = _central_entries(cd, entries)
    members = _local_members(window, raw_members, prefix, cd_offset)
    if "data.pkl" not in members:
        raise ArchiveError("archive has no data.pkl")
    if "version" not in members and ".data/version" not in members:
        raise ArchiveError("archive has no version record (torch refuses it)")
    return Archive(prefix, members)


#: A central-directory entry: (local header offset, flags, method, CRC-32, compressed size, size,
#: name bytes, name, disk number != 0).
_Central = tuple[int, int, int, int, int, int, bytes, str, bool]


def _central_entries(cd: bytes, entries: int) -> tuple[str, list[_Central]]:
    """The archive's folder and its ``entries`` central-directory entries, each name checked (in file order).

    Raises:
        ArchiveError: a malformed entry, a name torch does not write, a duplicate name, or bytes
            after the last entry.
    """
    pos = 0
    prefix: str | None = None
    seen_lower: set[str] = set()
    raw_members: list[_Central] = []
    for _ in range(entries):
        entry, pos = _central_entry(cd, pos)
        name = entry[7]
        if prefix is None:
            # torch: the folder of the first central-directory entry is the archive's name
            if "/" not in name or name.index("/") == 0:
                raise ArchiveError(f"first member {name[:60]!r} is not in a folder")
            prefix = name[: name.index("/")]
        if not name.startswith(prefix + "/") or not _MEMBER_RE.fullmatch(name[len(prefix) + 1 :]):
            raise ArchiveError(f"member {name[:80]!r} is not one torch.save writes under {prefix[:40]!r}/")
        if name.lower() in seen_lower:
            raise ArchiveError(f"duplicate member {name[:80]!r} (torch would read one of them, unspecified which)")
        seen_lower.add(name.lower())
        raw_members.append(entry)
    if pos != len(cd):
        raise ArchiveError("central directory holds bytes after its entries")
    assert prefix is not None
    return prefix, raw_members


def _central_entry(cd: bytes, pos: int) -> tuple[_Central, int]:
    """The central-directory entry at ``pos`` of ``cd`` and the position after it (method, flags, name checked).

    Raises:
        ArchiveError: truncated, a bad signature, an encrypted member, a method other than stored
            or deflate, a stored member whose sizes differ, or a name that is not UTF-8.
    """
    if pos + _CENTRAL.size > len(cd):
        raise ArchiveError("central directory truncated")
    (sig, _, _, flags, method, _, _, crc, csize, usize, nlen, elen, clen, disk, _, _, offset) = _CENTRAL.unpack_from(
        cd, pos
    )
    if sig != b"PK\x01\x02":
        raise ArchiveError("bad central directory entry")
    name_b = cd[pos + _CENTRAL.size : pos + _CENTRAL.size + nlen]
    extra = cd[pos + _CENTRAL.size + nlen : pos + _CENTRAL.size + nlen + elen]
    pos += _CENTRAL.size + nlen + elen + clen
    if pos > len(cd):
        raise ArchiveError("central directory truncated")
    usize, csize, offset = _zip64(extra, [usize, csize, offset])
    if flags & _FLAG_ENCRYPTED:
        raise ArchiveError("encrypted member")
    if method not in (STORED, DEFLATED):
        raise ArchiveError(f"member compressed with method {method} (torch reads stored or deflate only)")
    if method == STORED and csize != usize:
        raise ArchiveError("stored member with differing sizes")
    try:
        name = name_b.decode("utf-8")
    except UnicodeDecodeError:
        raise ArchiveError("member name is not UTF-8") from None
    return (offset, flags, method, crc, csize, usize, name_b, name, bool(disk)), pos


def _local_members(window: Window, raw_members: list[_Central], prefix: str, cd_offset: int) -> dict[str, Member]:
    """The members by name inside the folder, in offset order, each local header checked (see :func:`_local_member`).

    Raises:
        ArchiveError: a member that does not start where the previous one ends (the first at 0).
    """
    raw_members.sort()
    members: dict[str, Member] = {}
    expected_at = 0
    for i, (offset, _, method, crc, csize, usize, _, name, _) in enumerate(raw_members):
        if offset != expected_at:
            raise ArchiveError(
                f"member {name[:80]!r} starts at {offset}, expected {expected_at} (gap, overlap or prepended bytes)"
            )
        next_at = raw_members[i + 1][0] if i + 1 < len(raw_members) else cd_offset
        data_at = _local_member(window, raw_members[i], next_at, cd_offset)
        expected_at = next_at
        rel = name[len(prefix) + 1 :]
        members[rel] = Member(rel, method, crc, csize, usize, offset, data_at)
    return members


def _local_member(window: Window, entry: _Central, next_at: int, cd_offset: int) -> int:
    """Offset of the member's first data byte, its local header (and data descriptor) checked against ``entry``.

    The member must fill ``[offset, next_at)`` exactly: local header, data, and the data
    descriptor when flag bit 3 is set.

    Raises:
        ArchiveError: the local header overlaps the central directory, is missing, or disagrees
            with the central entry (name, method, flags, CRC, sizes); the data runs past
            ``next_at``; bytes left between the member and the next.
    """
    offset, flags, method, crc, csize, usize, name_b, name, _ = entry
    if offset + _LOCAL.size > cd_offset:
        raise ArchiveError(f"local header of {name[:80]!r} overlaps the central directory")
    (sig, _, lflags, lmethod, _, _, lcrc, lcsize, lusize, lnlen, lelen) = _LOCAL.unpack(
        window.pread(offset, _LOCAL.size)
    )
    if sig != b"PK\x03\x04":
        raise ArchiveError(f"no local header for {name[:80]!r}")
    if offset + _LOCAL.size + lnlen + lelen > cd_offset:
        raise ArchiveError(f"local header of {name[:80]!r} overlaps the central directory")
    local = window.pread(offset + _LOCAL.size, lnlen + lelen)
    if local[:lnlen] != name_b:
        raise ArchiveError(f"local header names {local[:lnlen][:80]!r}, the central directory {name[:80]!r}")
    if lmethod != method or (lflags ^ flags) & (_FLAG_ENCRYPTED | _FLAG_DESCRIPTOR):
        raise ArchiveError(f"local header of {name[:80]!r} disagrees with the central directory (method, flags)")
    data_at: int = offset + _LOCAL.size + lnlen + lelen
    data_end = data_at + csize
    if data_end > next_at:
        raise ArchiveError(f"member {name[:80]!r} runs into the next member or the central directory")
    if flags & _FLAG_DESCRIPTOR:
        if (lcrc, lcsize, lusize) != (0, 0, 0) and (
            lcrc != crc or _zip64(local[lnlen:], [lusize, lcsize]) != [usize, csize]
        ):
            raise ArchiveError(f"local header of {name[:80]!r} disagrees with the central directory (sizes)")
        _descriptor_len(window, data_end, next_at, crc, csize, usize)
    else:
        if lcrc != crc or _zip64(local[lnlen:], [lusize, lcsize]) != [usize, csize]:
            raise ArchiveError(f"local header of {name[:80]!r} disagrees with the central directory (CRC, sizes)")
        if data_end != next_at:
            raise ArchiveError(f"{next_at - data_end} unaccounted bytes after member {name[:80]!r}")
    return data_at


def inflate_into(window: Window, member: Member, out: memoryview) -> None:
    """Fill ``out`` (``member.size`` bytes) from a stored or deflate member, never producing more.

    Raises:
        ArchiveError: the stream is corrupt, ends early, or would inflate past its declared size.
    """
    if len(out) != member.size:
        raise ArchiveError("destination size differs from the member's")
    if member.method == STORED:
        out[:] = window.pread(member.data_offset, member.size)
        return
    d = zlib.decompressobj(-15)
    pos, done, left = member.data_offset, 0, member.compressed_size
    try:
        while left > 0 or d.unconsumed_tail:
            if d.unconsumed_tail:
                piece = d.unconsumed_tail
            else:
                n = min(1 << 20, left)
                piece = window.pread(pos, n)
                pos, left = pos + n, left - n
            got = d.decompress(piece, member.size - done + 1)
            if done + len(got) > member.size:
                raise ArchiveError(f"member {member.name} inflates past its declared {member.size} bytes")
            out[done : done + len(got)] = got
            done += len(got)
            if d.eof:
                break
    except zlib.error as e:
        raise ArchiveError(f"member {member.name}: corrupt deflate stream ({e})") from e
    if not d.eof or done != member.size:
        raise ArchiveError(f"member {member.name} inflates to {done} bytes, declared {member.size}")


# --------------------------------------------------------------------------- tensor archives
@dataclass(frozen=True)
class TensorRecord:
    """Where a chunk's tensor lies in its archive.

    Attributes:
        dtype: dtype name (from the typed storage, or ``_rebuild_tensor_v3``'s dtype).
        size, stride, storage_offset: the view of the storage (elements).
        storage_numel: elements in the storage record.
        data_offset: byte offset of the raw storage record inside the window.
        crc32: CRC-32 of the record's bytes (its zip entry).
        compressed_size: bytes the record occupies in the window.
        deflated: the record is deflate-compressed (read with :func:`inflate_into`).
        big_endian: the archive's ``byteorder`` is ``big`` (bytes must be swapped).
        member: the record's zip member (``None`` for an empty storage without a record).
    """

    dtype: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage_numel: int
    data_offset: int
    crc32: int = 0
    compressed_size: int = 0
    deflated: bool = False
    big_endian: bool = False
    member: Member | None = None


class _Dtype(str):
    """A ``torch.<dtype>`` global in a tensor archive's ``data.pkl`` (v3 encoding)."""


_UNTYPED = ("storage_type", None)


class _TensorPickle(pickle.Unpickler):
    """Unpickler for a single-tensor ``data.pkl`` (``_rebuild_tensor_v2``/``_v3`` + one storage)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_v2
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
            return _rebuild_v3
        if module == "torch" and name in STORAGE_DTYPES:
            return ("storage_type", STORAGE_DTYPES[name])
        if (module, name) == ("torch.storage", "UntypedStorage") or (module, name) == ("torch", "UntypedStorage"):
            return _UNTYPED
        if module == "torch" and name in DTYPE_ITEMSIZE:
            return _Dtype(name)
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise UnsafePickleError(f"tensor archive names pickle global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafePickleError("tensor archive holds an unexpected persistent id")
        _, stype, key, location, numel = pid
        if not (
            isinstance(stype, tuple)
            and len(stype) == 2
            and stype[0] == "storage_type"
            and (stype[1] is None or (type(stype[1]) is str and stype[1] in DTYPE_ITEMSIZE))
        ):  # a tuple the pickle built itself may hold anything where a storage class's dtype belongs
            raise StorageTupleError(f"storage tuple names storage type {_short(stype)}, not a torch storage class")
        if type(key) is not str or not key.isdecimal() or len(key) > 20:
            raise StorageTupleError(f"storage tuple key is {_short(key)}, not a decimal string")
        if type(location) is not str or len(location) > 64:
            raise StorageTupleError(f"storage tuple location is {_short(location)}, not a device string")
        if type(numel) is not int or not 0 <= numel < 1 << 62:
            raise StorageTupleError(f"storage tuple size is {_short(numel)}, not an int in [0, 2^62)")
        return ("storage", stype[1], key, numel)


def _short(v: Any) -> str:
    """``repr`` of an untrusted value that cannot fail (huge ints) and stays short."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64:
        return f"an int of {v.bit_length()} bits"
    try:
        return f"{v!r:.60}"
    except Exception:
        return f"a {type(v).__name__}"


def _rebuild_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, *rest: Any) -> tuple[Any, ...]:
    return ("tensor", storage, storage_offset, size, stride, None)


def _rebuild_v3(
    storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any, *rest: Any
) -> tuple[Any, ...]:
    return ("tensor", storage, storage_offset, size, stride, dtype)


def _small(archive: Archive, window: Window, name: str) -> bytes | None:
    return archive.read(window, name, _SMALL_MEMBER_BYTES)


def check_torch_records(archive: Archive, window: Window) -> bytes | None:
    """Read the small records torch's loader reads and refuse what it refuses; return ``byteorder``.

    ``version`` (or ``.data/version``) must be a file format version torch reads (1-10,
    ``caffe2/serialize/versions.h``), ``byteorder`` ``little`` or ``big``,
    ``.storage_alignment`` an integer, ``.data/serialization_id`` UTF-8 text
    (``torch/serialization.py``, ``_load``); each is CRC-checked.

    Raises:
        ArchiveError: a record torch would refuse; ArchiveChecksumError: one that fails its CRC-32.
    """
    for name in (".format_version", ".data/serialization_id", ".storage_alignment"):
        data = _small(archive, window, name)
        if data is None:
            continue
        try:
            if name == ".storage_alignment":
                int(data)
            elif name == ".data/serialization_id":
                data.decode("utf-8")
        except ValueError:
            raise ArchiveError(f"record {name} holds {data[:24]!r}, which torch cannot read") from None
    bo = _small(archive, window, "byteorder")
    if bo not in (None, b"little", b"big"):
        raise ArchiveError(f"byteorder record {bo[:16]!r} is neither little nor big")
    version = _small(archive, window, "version")
    if version is None:
        version = _small(archive, window, ".data/version")
    try:
        ok_version = version is not None and 1 <= int(version.strip()) <= 10
    except ValueError:
        ok_version = False
    if not ok_version:
        raise ArchiveError("archive version record is not a file format version torch reads (1-10)")
    return bo


def read_archive_pickle(window: Window, *, cap: int | None = None) -> bytes:
    """``data.pkl`` of the archive in ``window`` (a byte item or ``extra_state`` file), size-capped.

    Raises:
        ArchiveError: not a ``torch.save`` archive torch would read the same way.
        SizeLimitError: ``data.pkl`` is larger than ``cap`` (default :attr:`Limits.max_object_bytes`).
    """
    archive = parse_archive(window)
    data = archive.read(
        window, "data.pkl", cap if cap is not None else limits.current().max_object_bytes, what="data.pkl"
    )
    assert data is not None
    return data


def parse_tensor_archive(window: Window) -> TensorRecord:
    """Locate the tensor in a single-tensor ``torch.save`` archive.

    Raises:
        ArchiveError: corrupt, not a tensor archive, or one torch would read differently.
        StorageTupleError: ``data.pkl``'s storage tuple or tensor view has fields of the wrong types.
        UnsafePickleError: ``data.pkl`` names a global other than a tensor rebuild.
    """
    window = _Prefetched(window)  # the small members are read from the same two reads
    archive = parse_archive(window, max_members=16)
    bo = check_torch_records(archive, window)
    pkl = archive.read(window, "data.pkl", limits.current().max_tensor_pickle_bytes, what="a chunk's data.pkl")
    assert pkl is not None
    storage, storage_offset, size, stride, v3_dtype = _tensor_spec(pkl)
    dtype, key, storage_numel = _storage_of(storage, v3_dtype)
    if not (
        isinstance(size, tuple)
        and isinstance(stride, tuple)
        and len(size) == len(stride) <= 64
        and all(type(x) is int and 0 <= x < 1 << 62 for x in size + stride)
        and type(storage_offset) is int
        and 0 <= storage_offset < 1 << 62
    ):
        raise StorageTupleError(
            f"tensor view fields are malformed (offset {_short(storage_offset)}, size {_short(size)}, "
            f"stride {_short(stride)})"
        )
    record = _tensor_record(archive, bo, dtype, key, storage_numel, size, stride, storage_offset)
    if any(s == 0 for s in size):
        span = 0
    else:
        span = storage_offset + sum((s - 1) * st for s, st in zip(size, stride)) + 1
    if span > storage_numel:
        raise ArchiveError("tensor view reaches past its storage")
    return record


def _tensor_spec(pkl: bytes) -> tuple[Any, Any, Any, Any, Any]:
    """``(storage, storage_offset, size, stride, v3 dtype)`` of a chunk's ``data.pkl`` (fields unchecked).

    Raises:
        UnsafePickleError, StorageTupleError: from the allow-list unpickler.
        ArchiveError: unreadable, or not one tensor rebuild.
    """
    try:
        spec = _TensorPickle(pickle_input(pkl)).load()
    except (UnsafePickleError, StorageTupleError):
        raise
    except PickleBombError as e:
        raise ArchiveError(f"data.pkl {e}") from e
    except Exception as e:
        raise ArchiveError(f"data.pkl unreadable: {type(e).__name__}") from e
    if not (isinstance(spec, tuple) and len(spec) == 6 and spec[0] == "tensor"):
        raise ArchiveError("archive does not hold a single tensor")
    _, storage, storage_offset, size, stride, v3_dtype = spec
    return storage, storage_offset, size, stride, v3_dtype


def _storage_of(storage: Any, v3_dtype: Any) -> tuple[str, str, int]:
    """``(dtype, record key, elements)`` of the tensor's storage (v3: an untyped storage sized in bytes).

    Raises:
        StorageTupleError: not a storage, a v3 dtype that is not a torch dtype, an untyped storage
            that is not a whole number of elements, or a v2 rebuild with a dtype argument.
    """
    if not (isinstance(storage, tuple) and len(storage) == 4 and storage[0] == "storage"):
        raise StorageTupleError("tensor rebuilt from something that is not a storage")
    _, dtype, key, storage_numel = storage
    if dtype is None:  # v3: UntypedStorage sized in bytes, the dtype is an argument
        if type(v3_dtype) is not _Dtype:
            raise StorageTupleError(f"_rebuild_tensor_v3 dtype is {_short(v3_dtype)}, not a torch dtype")
        dtype = str(v3_dtype)
        item = DTYPE_ITEMSIZE[dtype]
        if storage_numel % item:
            raise StorageTupleError(f"untyped storage of {storage_numel} bytes is not a whole number of {dtype}")
        storage_numel //= item
    elif v3_dtype is not None:
        raise StorageTupleError("_rebuild_tensor_v2 with a dtype argument")
    return dtype, key, storage_numel


def _tensor_record(
    archive: Archive,
    bo: bytes | None,
    dtype: str,
    key: str,
    storage_numel: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    storage_offset: int,
) -> TensorRecord:
    """The :class:`TensorRecord` of the storage record ``data/<key>``, the archive's only record.

    Raises:
        ArchiveError: other records, no record for a non-empty storage, or a record whose size
            is not the storage's.
    """
    itemsize = DTYPE_ITEMSIZE[dtype]
    rec = archive.members.get(f"data/{key}")
    records = [n for n in archive.members if n.startswith("data/")]
    if records != ([f"data/{key}"] if rec is not None else []):
        raise ArchiveError(f"archive holds records {records[:4]} besides its tensor's data/{key}")
    if rec is None:
        if storage_numel != 0:
            raise ArchiveError(f"archive has no record data/{key}")
        return TensorRecord(dtype, size, stride, storage_offset, 0, 0, big_endian=bo == b"big")
    if rec.size != storage_numel * itemsize:
        raise ArchiveError(f"storage record holds {rec.size} bytes, expected {storage_numel} elements")
    return TensorRecord(
        dtype,
        size,
        stride,
        storage_offset,
        storage_numel,
        rec.data_offset,
        rec.crc32,
        rec.compressed_size,
        rec.method == DEFLATED,
        bo == b"big",
        rec,
    )


# --------------------------------------------------------------------------- layout templates
#: The bytes before the end-of-central-directory record that it reads itself (a zip64 locator's place).
_EOCD_LOOKBACK = _Z64_LOCATOR.size
_SERIALIZATION_ID = ".data/serialization_id"


@dataclass(frozen=True)
class _Varying:
    """A member whose bytes and CRC-32 may differ between archives of one layout.

    Attributes:
        start, size: the member's data in the window (stored: its bytes as written).
        crcs: window offsets of the 4-byte CRC-32 fields that must hold its CRC-32, the central
            directory's first (then the local header's, when it carries one, and the data descriptor's).
        text: the member is ``.data/serialization_id`` (must be UTF-8: the fast check takes ASCII).
    """

    start: int
    size: int
    crcs: tuple[int, ...]
    text: bool


@dataclass(frozen=True)
class ArchiveTemplate:
    """One checked tensor archive, against which archives of the same layout are checked with byte compares.

    ``torch.save`` of tensors of one dtype and shape writes the same bytes but for the values,
    ``.data/serialization_id`` (a number per save) and their CRC-32 fields (local header, data
    descriptor, central directory). An archive of the same length whose every other byte equals
    the template's (:attr:`mask`) has the same zip structure, members, ``data.pkl``, version and
    byteorder records as the template, so :func:`parse_tensor_archive` would return the
    template's :attr:`record` for it; what it would still check is what
    :func:`match_template` checks: each varying member's CRC-32 fields agree (local header and
    data descriptor with the central directory), the serialization id is UTF-8 and matches its
    CRC-32, and (``verify_crc``) the values match theirs. Bytes the end records read before
    themselves (a zip64 locator) are never varying (:func:`archive_template` refuses such a layout).

    Attributes:
        length: the archive's bytes.
        record: the record every matching archive has (stored, little-endian).
        image, mask: the template's bytes (``uint8 [length]``) and ``0`` where bytes may vary, ``0xFF`` elsewhere.
        values: the record (:class:`_Varying`); ``ident``: the serialization id's, if any.
    """

    length: int
    record: TensorRecord
    image: Any
    mask: Any
    values: _Varying
    ident: _Varying | None


def _central_positions(data: bytes, cd_offset: int, entries: int, prefix: str) -> dict[str, int]:
    """Window offsets of the central-directory entries of a parsed archive, by member name."""
    out: dict[str, int] = {}
    pos = cd_offset
    for _ in range(entries):
        nlen, elen, clen = struct.unpack_from("<HHH", data, pos + 28)
        name = data[pos + _CENTRAL.size : pos + _CENTRAL.size + nlen].decode("utf-8")
        out[name[len(prefix) + 1 :]] = pos
        pos += _CENTRAL.size + nlen + elen + clen
    return out


def _varying(data: bytes, m: Member, central_at: int, next_at: int, *, text: bool) -> _Varying | None:
    """The varying fields of member ``m`` (see :class:`_Varying`); ``None``: a form the template does not take."""
    (flags,) = struct.unpack_from("<H", data, central_at + 8)
    crcs = [central_at + 16]
    lcrc, lcsize, lusize = struct.unpack_from("<III", data, m.header_offset + 14)
    if not flags & _FLAG_DESCRIPTOR or (lcrc, lcsize, lusize) != (0, 0, 0):
        crcs.append(m.header_offset + 14)  # must equal the central CRC-32 (parse_archive's check)
    if flags & _FLAG_DESCRIPTOR:
        end = m.data_offset + m.compressed_size
        room = next_at - end
        if room in (16, 24) and data[end : end + 4] == b"PK\x07\x08":
            crcs.append(end + 4)
        elif room in (12, 20):
            crcs.append(end)
        else:
            return None
    if m.method != STORED:
        return None
    return _Varying(m.data_offset, m.size, tuple(crcs), text)


def archive_template(data: bytes, record: TensorRecord) -> ArchiveTemplate | None:
    """The template of the archive ``data``, already checked (:func:`parse_tensor_archive` returned ``record``).

    Returns:
        ``None`` where the layout is not one the byte compare can stand for: a deflated or
        big-endian record, no record, a zip64 archive, a member other than the record and the
        serialization id whose bytes would vary, or a varying byte among those the end records read.
    """
    import numpy as np

    member = record.member
    if member is None or record.deflated or record.big_endian or member.method != STORED:
        return None
    window = BytesWindow(data)
    archive = parse_archive(window, max_members=16)
    entries, cd_offset, cd_size, cd_end = _end_records(window)
    if cd_end != cd_offset + cd_size or data[cd_end - 20 : cd_end - 16] == b"PK\x06\x07":
        return None  # zip64 end records
    central = _central_positions(data, cd_offset, entries, archive.prefix)
    starts = sorted(m.header_offset for m in archive.members.values())

    def next_at(m: Member) -> int:
        i = starts.index(m.header_offset)
        return starts[i + 1] if i + 1 < len(starts) else cd_offset

    values = _varying(data, member, central[member.name], next_at(member), text=False)
    ident_m = archive.members.get(_SERIALIZATION_ID)
    ident = _varying(data, ident_m, central[_SERIALIZATION_ID], next_at(ident_m), text=True) if ident_m else None
    if values is None or (ident_m is not None and ident is None):
        return None
    mask = np.full(len(data), 0xFF, dtype=np.uint8)
    for v in (values, ident):
        if v is None:
            continue
        mask[v.start : v.start + v.size] = 0
        for at in v.crcs:
            mask[at : at + 4] = 0
    if not mask[cd_end - _EOCD_LOOKBACK :].all():
        return None
    return ArchiveTemplate(len(data), record, np.frombuffer(data, dtype=np.uint8).copy(), mask, values, ident)


def match_template(tmpl: ArchiveTemplate, rows: Any, *, verify_crc: bool) -> Any:
    """Which archives of ``rows`` :func:`parse_tensor_archive` would accept as ``tmpl.record`` (see :class:`ArchiveTemplate`).

    Args:
        rows: ``uint8 [n, tmpl.length]``, one archive a row.
        verify_crc: also check each record's values against their CRC-32 (as the reader does when copying).

    Returns:
        ``bool [n]``: ``True`` where the archive matches; ``False`` rows are for :func:`parse_tensor_archive`
        (which names what is wrong, or accepts an archive of another layout).
    """
    import numpy as np

    ok: Any = ~((rows ^ tmpl.image) & tmpl.mask).any(axis=1)
    checks = [(tmpl.values, verify_crc)] + ([(tmpl.ident, True)] if tmpl.ident is not None else [])
    for v, with_crc in checks:
        fields = [np.ascontiguousarray(rows[:, at : at + 4]).view("<u4")[:, 0] for at in v.crcs]
        for f in fields[1:]:
            ok &= f == fields[0]
        if v.text:
            ok &= (rows[:, v.start : v.start + v.size] < 0x80).all(axis=1)
        if with_crc:  # one crc32 call per row, on slices of one flat view (cheaper than numpy row indexing)
            flat = np.ascontiguousarray(rows).reshape(-1).data  # uint8: a flat byte view
            n, a, b = rows.shape[1], v.start, v.start + v.size
            live = np.flatnonzero(ok)
            got = [crc32(flat[at + a : at + b], 0) for at in (live * n).tolist()]
            ok[live] &= np.array(got, dtype=np.uint32) == fields[0][live]
    return ok
