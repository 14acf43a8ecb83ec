"""Write a DCP checkpoint directory that plain ``torch.distributed.checkpoint.load`` reads.

The format is the one torch's ``FileSystemWriter`` produces (``torch/distributed/
checkpoint/filesystem.py``, torch 2.6-2.13): data files ``__{rank}_0.distcp`` in which
every tensor chunk and byte item is a complete ``torch.save`` archive at
``[offset, offset+length)``, and ``.metadata``, a pickled
``torch.distributed.checkpoint.metadata.Metadata`` whose ``storage_data`` maps
``MetadataIndex(fqn, offsets)`` to ``_StorageInfo(relative_path, offset, length)``.

:class:`DCPWriter` appends items to one file per rank. A chunk that already exists
as an archive in a source checkpoint is copied verbatim (:func:`~ckpttool.format.copy.copy_range`,
no decode: bitwise the same archive); a new chunk is written with ``torch.save``.
It writes into a directory the caller owns (an :class:`~ckpttool.format.atomic.AtomicOutputDir`
temporary directory), so a failed run leaves nothing that looks complete.
"""

from __future__ import annotations

import errno
import functools
import io
import os
import pickle
import struct
import threading
import uuid
import zipfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple

from ckpttool.engine.execute import can_split, run_item, run_split
from ckpttool.engine.io import BLOCK_BYTES, ShortReadError, block_buffer, write_all
from ckpttool.engine.plan import Crc32, Feed, Item, Window, WriteAt
from ckpttool.errors import DataFileError, OutputError
from ckpttool.format.archive import STORAGE_DTYPES
from ckpttool.format.copy import copy_range
from ckpttool.format.metadata import FLOAT8_DTYPES, ChunkMeta, DType, StorageInfo
from ckpttool.format.storage import is_url

if TYPE_CHECKING:
    import torch

    from ckpttool.format.locator import ChunkLocation

__all__ = [
    "DCPWriter",
    "WrittenItem",
    "DCP_VERSION",
    "plain_path",
    "can_stream",
    "tensor_data_pkl",
    "torch_save_bytes",
    "write_tensor_archive",
]

DCP_VERSION = "1.0.0"  # torch/distributed/checkpoint/filesystem.py CURRENT_DCP_VERSION


def plain_path(path: Any) -> tuple[Any, ...]:
    """A ``planner_data`` path rebuilt from exact ``str``/``int``/``tuple`` values (never a subclass).

    What ckpttool writes into ``.metadata`` must unpickle with plain torch, without ckpttool
    installed: a ``str`` subclass from ckpttool's reader would be pickled by its class.

    Raises:
        TypeError: an item that is not a str, an int or a tuple of them.
    """

    def item(v: Any) -> Any:
        if isinstance(v, bool):
            raise TypeError("planner_data path item is a bool")
        if isinstance(v, str):
            return str.__str__(v) if type(v) is not str else v
        if isinstance(v, int):
            return int(v)
        if isinstance(v, tuple):
            return tuple(item(x) for x in v)
        raise TypeError(f"planner_data path item of type {type(v).__name__}")

    if not isinstance(path, (tuple, list)):
        raise TypeError(f"planner_data path of type {type(path).__name__}")
    return tuple(item(x) for x in path)


@dataclass
class WrittenItem:
    """What :meth:`DCPWriter.finish` records for one key."""

    dtype: DType | None  # None: byte item
    size: tuple[int, ...] = ()
    chunks: list[tuple[ChunkMeta, StorageInfo]] = field(default_factory=list)
    byte_info: StorageInfo | None = None


def _create(path: Path) -> BinaryIO:
    """``open(path, "wb")``; out of file descriptors (``EMFILE``: the output has a data file per target rank,
    all open while written, and 1024 ranks reach a common soft limit), the soft limit is raised to the hard
    one once and the open tried again."""
    try:
        return open(path, "wb")
    except OSError as e:
        if e.errno != errno.EMFILE or not _raise_open_file_limit():
            raise
    return open(path, "wb")


def _resource_module() -> Any:
    """:mod:`resource` (``None`` where there is none), imported before the output's files are opened: out of file
    descriptors, importing its extension module would fail too."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    return resource


def _raise_open_file_limit() -> bool:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit: whether it rose."""
    resource = _resource_module()
    if resource is None:
        return False
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft >= hard:
        return False
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        return False
    return True


class DCPWriter:
    """Append tensor chunks and byte items to per-rank data files, then write ``.metadata``.

    Args:
        directory: an existing, empty directory (the temporary output directory).
        checkpoint_id: the final path recorded in ``storage_meta.checkpoint_id``; for a URL output its URL
            (``s3://bucket/out``, as torch's ``FsspecWriter`` records it).
        fsync: ``fsync`` every file before :meth:`finish` returns (as torch's
            ``FileSystemWriter(sync_files=True)``), so a renamed output survives a power loss.
        digest: a digest algorithm (:mod:`ckpttool.format.digest`): digest every chunk's raw
            storage record and every byte item's window as it is written (:attr:`digests`,
            :meth:`manifest_entries`), the integrity manifest of the output without a second read.

    Thread safety: several threads may write concurrently as long as each target rank's
    file is written by one thread at a time (the per-rank worker model of ``reshard``).
    """

    def __init__(
        self, directory: Path, checkpoint_id: PurePath, *, fsync: bool = True, digest: str | None = None
    ) -> None:
        self.fsync = fsync
        self.digest = digest
        _resource_module()  # loaded now: see _create
        #: ``(key, chunk offsets | None) -> (covers, digest, crc32 hex | None)``, filled as the bytes pass
        #: (``digest`` set): chunks digest their raw storage record, byte items their whole window.
        self.digests: dict[tuple[str, tuple[int, ...] | None], tuple[str, str, str | None]] = {}
        self.metadata_digest: tuple[str, int] | None = None
        self.directory = Path(directory)
        # a URL output's UrlPath is kept: Path() of it dropped the scheme ('/bucket/out' for s3://bucket/out)
        self.checkpoint_id = checkpoint_id if is_url(checkpoint_id) else Path(checkpoint_id)
        self._files: dict[int, BinaryIO] = {}
        self._items: dict[str, WrittenItem] = {}
        self._planner: dict[str, tuple[Any, ...]] = {}
        self.bytes_written = 0
        self._lock = threading.Lock()
        self._dirty: set[int] = set()

    # ------------------------------------------------------------------ files
    @staticmethod
    def file_name(rank: int) -> str:
        return f"__{rank}_0.distcp"

    def write_error(self, name: str, key: str | None, e: OSError) -> OutputError:
        """The one-line error of a write to the output's file ``name`` (a data file, ``.metadata``) that found no
        room, named as it will be (not by its temporary directory), with the key being written."""
        path = self.checkpoint_id / name
        what = f"cannot write {key!r}" if key is not None else "cannot write"
        return OutputError(
            f"{path}: {what} ({e.strerror})",
            path=path,
            fqn=key,
            hint="free space on the output's filesystem (or raise its file-size limit, `ulimit -f`), then rerun",
        )

    def _file(self, rank: int) -> BinaryIO:
        f = self._files.get(rank)
        with self._lock:
            self._dirty.add(rank)
        if f is None:
            path = self.directory / self.file_name(rank)
            try:
                f = _create(path)
            except OSError as e:
                if e.errno != errno.EMFILE:
                    raise OutputError(f"{path}: cannot create ({e.strerror})", path=path) from e
                raise OutputError(
                    f"{path}: cannot create ({e.strerror}): {len(self._files)} data files of the output, one per "
                    "target rank, are open while they are written",
                    path=path,
                    hint="raise the open-file limit above the number of target ranks (e.g. `ulimit -n 65536`; "
                    "`ulimit -Hn` shows the most it may be) and run again",
                ) from e
            with self._lock:
                self._files[rank] = f
        return f

    def sync(self, rank: int) -> None:
        """Flush and ``fsync`` the data file of ``rank`` (done before ``.metadata`` is written)."""
        f = self._files.get(rank)
        if f is not None:
            try:
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            except OSError as e:
                if e.errno not in _FULL:
                    raise
                raise self.write_error(self.file_name(rank), None, e) from None
            with self._lock:
                self._dirty.discard(rank)

    def ensure_files(self, ranks: Iterable[int]) -> None:
        """Create (possibly empty) data files for ``ranks`` so every target rank has one."""
        for r in ranks:
            self._file(r)

    def close(self) -> None:
        """Close every data file (each one, even after one fails).

        Raises:
            OutputError (E600): a file's last buffered bytes found no room (disk full, ``ulimit -f``); it is named.
            OSError: another failure to close a file.
        """
        failed = self._close_all()
        if failed is not None:
            rank, e = failed
            raise self.write_error(self.file_name(rank), None, e) if e.errno in _FULL else e

    def _close_all(self) -> tuple[int, OSError] | None:
        """Close every data file; the rank and error of the first that failed (its buffered bytes not written)."""
        failed = None
        for rank, f in self._files.items():
            try:
                f.close()
            except OSError as e:
                failed = failed or (rank, e)
        self._files.clear()
        return failed

    def __enter__(self) -> DCPWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # the error in flight is the one to tell (a close that fails as well would hide it)
            self._close_all()

    # ------------------------------------------------------------------ items
    def declare_tensor(
        self, key: str, dtype: DType, size: tuple[int, ...], planner_path: tuple[Any, ...] | None
    ) -> None:
        """Announce a tensor entry (global ``size``, ``dtype``) before adding its chunks."""
        self._items[key] = WrittenItem(dtype, tuple(size))
        if planner_path is not None:
            self._planner[key] = plain_path(planner_path)

    def _record_chunk(
        self, key: str, chunk: ChunkMeta, rank: int, offset: int, length: int, transforms: tuple[str, ...] = ()
    ) -> None:
        info = StorageInfo(self.file_name(rank), offset, length, transforms)
        with self._lock:
            self._items[key].chunks.append((chunk, info))

    def _hasher(self) -> Any:
        from ckpttool.format.digest import new_hasher

        assert self.digest is not None
        return new_hasher(self.digest)

    def _note(self, key: str, offsets: tuple[int, ...] | None, covers: str, digest: str, crc: int | None) -> None:
        with self._lock:
            self.digests[(key, offsets)] = (covers, digest, f"{crc:08x}" if crc is not None else None)

    def write_chunk(self, key: str, chunk: ChunkMeta, rank: int, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (shape ``chunk.sizes``, owning its storage) as a new ``torch.save`` archive."""
        import torch

        assert tuple(tensor.shape) == chunk.sizes, (key, tensor.shape, chunk.sizes)
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size() or not tensor.is_contiguous():
            tensor = tensor.contiguous().clone()  # torch.save writes the whole storage
        f = self._file(rank)
        start = f.tell()
        torch.save(tensor, f)
        end = f.tell()
        self._count(end - start)
        self._record_chunk(key, chunk, rank, start, end - start)
        if self.digest is not None:  # the record is the tensor's bytes, still in memory
            from ckpttool.engine.crc import crc32

            data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
            h = self._hasher()
            h.update(data)
            self._note(key, chunk.offsets, "record", h.hexdigest(), crc32(data, 0) if chunk.numel > 0 else None)

    def copy_archive(
        self,
        key: str,
        chunk: ChunkMeta | None,
        rank: int,
        src_fd: int,
        info: StorageInfo,
        *,
        verify: ChunkLocation | None = None,
        location: ChunkLocation | None = None,
    ) -> None:
        """Copy a stored archive (tensor chunk or byte item) verbatim from a source data file.

        Args:
            key: checkpoint key.
            chunk: the chunk (``None`` for a byte item).
            rank: target rank (output file).
            src_fd: an open descriptor of the source data file.
            info: the source storage info (``offset``/``length``; transforms are kept).
            verify: the chunk's location: check its stored record's CRC-32 as the bytes pass.
            location: the chunk's location (its record's span and CRC-32 for :attr:`digests`);
                without it a chunk's digest covers the whole window.

        Raises:
            ChecksumError: ``verify`` given and the record fails its CRC-32.
        """
        f = self._file(rank)
        f.flush()
        start = f.tell()
        span = None
        if verify is not None and verify.in_file and not verify.record.deflated and verify.record.member is not None:
            span = (verify.record.data_offset, verify.record.data_offset + verify.record.compressed_size)
        h = self._hasher() if self.digest is not None else None
        covers, sink, rec_crc = "window", None, None
        if h is not None:
            loc = location or verify
            sink = (0, info.length, h.update)
            if chunk is not None and loc is not None and loc.in_file:
                covers = "record"
                r = loc.record
                sink = (r.data_offset, r.data_offset + r.compressed_size, h.update) if r.member is not None else None
                rec_crc = r.crc32 if r.member is not None and chunk.numel > 0 else None
        try:
            crc = copy_range(src_fd, f.fileno(), info.offset, start, info.length, crc_span=span, sink=sink)
            if verify is not None and crc is not None:
                verify.check_crc(crc)
        except OSError as e:
            if e.errno not in _FULL:  # a read error of the source: its own message
                raise
            raise self.write_error(self.file_name(rank), key, e) from None
        except EOFError as e:
            raise DataFileError(
                f"{info.relative_path}: short read of {key!r} ({e}); the source changed while being read",
                path=info.relative_path,
                fqn=key,
                hint="rerun when no job is writing the source checkpoint",
            ) from None
        f.seek(start + info.length)
        self._count(info.length)
        if h is not None:
            self._note(key, chunk.offsets if chunk is not None else None, covers, h.hexdigest(), rec_crc)
        if chunk is None:
            self._items[key].byte_info = StorageInfo(
                self.file_name(rank), start, info.length, info.transform_descriptors
            )
        else:
            self._record_chunk(key, chunk, rank, start, info.length, info.transform_descriptors)

    def stream_tensor_archive(
        self, key: str, chunk: ChunkMeta, rank: int, dtype: DType, segments: list[tuple[int, int, int]]
    ) -> None:
        """Write a new ``torch.save`` archive of a contiguous chunk whose bytes are copied from source files.

        Args:
            key: checkpoint key.
            chunk: the output chunk (its ``sizes`` give the tensor shape).
            rank: target rank (output file).
            dtype: element dtype.
            segments: ``(source fd, byte offset, byte length)`` whose concatenation is the
                chunk's row-major storage (``numel * itemsize`` bytes in all).

        Raises:
            OutputError (E600): the write failed (no space left, over the file-size limit, ...).
            OSError: a short read (the source file changed under us).
        """
        f = self._file(rank)
        start = f.tell()
        h = self._hasher() if self.digest is not None else None
        try:
            crc = write_tensor_archive(
                f, dtype, chunk.sizes, segments, block_buffer(), sink=h.update if h else None, behind=self.fsync
            )
        except OSError as e:
            if e.errno is None:  # a short read: the source changed under us
                raise
            raise self.write_error(self.file_name(rank), key, e) from None
        end = f.tell()
        self._count(end - start)
        self._record_chunk(key, chunk, rank, start, end - start)
        if h is not None:
            self._note(key, chunk.offsets, "record", h.hexdigest(), crc if chunk.numel > 0 else None)

    def _count(self, written: int) -> None:
        with self._lock:
            self.bytes_written += written

    def copy_bytes_item(
        self, key: str, rank: int, src_fd: int, info: StorageInfo, planner_path: tuple[Any, ...] | None
    ) -> None:
        """Copy a byte item verbatim from the source checkpoint."""
        self._items[key] = WrittenItem(None)
        if planner_path is not None:
            self._planner[key] = plain_path(planner_path)
        self.copy_archive(key, None, rank, src_fd, info)

    def write_object(self, key: str, rank: int, obj: Any, planner_path: tuple[Any, ...] | None) -> None:
        """Write a plain Python value (str, numbers, lists, dicts) as a byte item (``torch.save`` bytes, as DCP does)."""
        self._items[key] = WrittenItem(None)
        if planner_path is not None:
            self._planner[key] = plain_path(planner_path)
        f = self._file(rank)
        start = f.tell()
        data = torch_save_bytes(obj)
        f.write(data)
        end = f.tell()
        if self.digest is not None:
            h = self._hasher()
            h.update(data)
            self._note(key, None, "window", h.hexdigest(), None)
        self._count(end - start)
        self._items[key].byte_info = StorageInfo(self.file_name(rank), start, end - start)

    # ------------------------------------------------------------------ several writers, one .metadata
    def records(self) -> tuple[dict[str, WrittenItem], dict[str, tuple[Any, ...]], int, dict[Any, Any]]:
        """What this writer wrote (items, planner paths, bytes), for :meth:`merge` into the writer that finishes.

        A distributed run has one writer per process, each writing its own data files; the
        one that writes ``.metadata`` merges the others' records first.
        """
        return dict(self._items), dict(self._planner), self.bytes_written, dict(self.digests)

    def merge(self, records: tuple[dict[str, WrittenItem], dict[str, tuple[Any, ...]], int, dict[Any, Any]]) -> None:
        """Add another writer's :meth:`records` (chunks of the same declared tensors, its byte items, digests)."""
        items, planner, nbytes, digests = records
        self.digests.update(digests)
        for key, item in items.items():
            mine = self._items.get(key)
            if mine is None:
                self._items[key] = item
                continue
            mine.chunks.extend(item.chunks)
            if item.byte_info is not None:
                mine.byte_info = item.byte_info
        self._planner.update(planner)
        self.bytes_written += nbytes

    def manifest_entries(self) -> list[dict[str, Any]]:
        """The manifest entries (``ckpttool.manifest`` version 2, ``docs/diff.md``) of what was written.

        Chunks in ``.metadata`` order (key, then offsets, as :meth:`finish` writes them), each
        with the digest of its raw storage record (``covers: record``); byte items with the
        digest of their window. Only after :meth:`finish`, on a writer made with ``digest``.
        """
        out: list[dict[str, Any]] = []
        for key, item in self._items.items():
            if item.dtype is None:
                assert item.byte_info is not None
                pairs: list[tuple[ChunkMeta | None, StorageInfo]] = [(None, item.byte_info)]
            else:
                pairs = [(c, i) for c, i in sorted(item.chunks, key=lambda ci: ci[0].offsets)]
            for c, info in pairs:
                offs = c.offsets if c is not None else None
                covers, digest, crc = self.digests[(key, offs)]
                out.append(
                    {
                        "key": key,
                        "offsets": list(offs) if offs is not None else None,
                        "sizes": list(c.sizes) if c is not None else None,
                        "file": info.relative_path,
                        "offset": info.offset,
                        "length": info.length,
                        "crc32": crc,
                        "covers": covers,
                        "digest": digest,
                    }
                )
        return out

    # ------------------------------------------------------------------ metadata
    def finish(self) -> None:
        """Flush the data files and write ``.metadata`` (torch's ``Metadata`` pickle, without importing torch).

        Raises:
            OutputError: a write failed.
        """
        for rank in sorted(self._dirty):
            self.sync(rank)
        self.close()
        sd_md: dict[str, Any] = {}
        storage: dict[Any, Any] = {}
        for key, item in self._items.items():
            if item.dtype is None:
                assert item.byte_info is not None, key
                sd_md[key] = _new("BytesStorageMetadata", None)
                storage[_metadata_index(key, None, None)] = _storage_info(item.byte_info)
                continue
            chunks = []
            stored: set[tuple[int, ...]] = set()
            for i, (c, info) in enumerate(sorted(item.chunks, key=lambda ci: ci[0].offsets)):
                chunks.append(_new("ChunkStorageMetadata", {"offsets": _size(c.offsets), "sizes": _size(c.sizes)}))
                if c.offsets in stored and 0 in c.sizes:
                    continue  # an empty chunk at another's offsets: one storage record per key, as torch's dict keeps
                stored.add(tuple(c.offsets))
                storage[_metadata_index(key, c.offsets, i)] = _storage_info(info)
            props = _new(
                "TensorProperties",
                (
                    _global("torch", item.dtype.name),
                    _Call(_global("torch.serialization", "_get_layout"), ("torch.strided",)),
                    False,
                    _Call(_global(_MD, "_MEM_FORMAT_ENCODING"), (0,)),  # torch.contiguous_format
                    False,
                ),
            )
            sd_md[key] = _new(
                "TensorStorageMetadata", {"properties": props, "size": _size(item.size), "chunks": chunks}
            )
        md = _new(
            "Metadata",
            {
                "state_dict_metadata": sd_md,
                "planner_data": dict(self._planner),
                "storage_data": storage,
                "storage_meta": _new(
                    "StorageMeta",
                    {
                        "checkpoint_id": str(self.checkpoint_id),
                        "save_id": uuid.uuid4().hex,
                        "load_id": None,
                        "modules": [],
                    },
                ),
                "version": DCP_VERSION,
            },
        )
        path = self.directory / ".metadata"
        buf = io.BytesIO()
        _MetadataPickler(buf, protocol=4).dump(md)
        data = buf.getvalue()
        if self.digest is not None:
            from ckpttool.format.digest import digest_bytes

            self.metadata_digest = (digest_bytes(data, self.digest), len(data))
        try:
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
        except OSError as e:
            if e.errno in _FULL:
                raise self.write_error(".metadata", None, e) from None
            raise OutputError(f"{path}: cannot write ({e.strerror})", path=path) from e


# ----------------------------------------------------------------------------------------------
# torch-free pickling of DCP metadata and torch.save archives of plain objects.
#
# `.metadata` is `pickle.dump(Metadata(...))` of torch's dataclasses (protocol 4): each object
# is `cls.__new__` + BUILD of its `__getstate__` (a dict; a tuple for TensorProperties), dtypes
# are globals (`torch.bfloat16`), `torch.Size(t)` and enum members are REDUCE calls. Importing
# torch to build those objects costs seconds, more than copying gigabytes, so the opcodes are
# written here directly with the same globals; torch's `pickle.load` and ckpttool's allow-list
# unpickler read them back (tests compare with torch's own objects).
#: The errnos of a write that found no room: disk full, over the file-size limit (``ulimit -f``), over quota.
_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_CLASS_MODULE = {
    "Metadata": _MD,
    "TensorStorageMetadata": _MD,
    "TensorProperties": _MD,
    "ChunkStorageMetadata": _MD,
    "BytesStorageMetadata": _MD,
    "MetadataIndex": _MD,
    "StorageMeta": _MD,
    "_StorageInfo": _FS,
}


class _Global:
    """A module-level name (class, function, dtype) written as ``STACK_GLOBAL``."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name


class _New:
    """``cls.__new__(cls)`` then ``BUILD`` with ``state`` (omitted when ``None``)."""

    __slots__ = ("cls", "state")

    def __init__(self, cls: _Global, state: Any) -> None:
        self.cls, self.state = cls, state


class _Call:
    """``func(*args)`` written as ``REDUCE``."""

    __slots__ = ("func", "args")

    def __init__(self, func: _Global, args: tuple[Any, ...]) -> None:
        self.func, self.args = func, args


_GLOBALS: dict[tuple[str, str], _Global] = {}


def _global(module: str, name: str) -> _Global:
    g = _GLOBALS.get((module, name))
    if g is None:
        g = _GLOBALS[(module, name)] = _Global(module, name)
    return g


def _new(cls_name: str, state: Any) -> _New:
    return _New(_global(_CLASS_MODULE[cls_name], cls_name), state)


def _size(t: tuple[int, ...]) -> _Call:
    return _Call(_global("torch", "Size"), (tuple(int(x) for x in t),))


def _metadata_index(fqn: str, offsets: tuple[int, ...] | None, index: int | None) -> _New:
    return _new("MetadataIndex", {"fqn": fqn, "offset": None if offsets is None else _size(offsets), "index": index})


def _storage_info(info: StorageInfo) -> _New:
    state: dict[str, Any] = {"relative_path": info.relative_path, "offset": info.offset, "length": info.length}
    if info.transform_descriptors:
        state["transform_descriptors"] = list(info.transform_descriptors)
    return _new("_StorageInfo", state)


if TYPE_CHECKING:

    class _PurePickler(pickle._Pickler):
        """The ``pickle._Pickler`` internals the subclasses below call, which typeshed leaves undeclared."""

        write: Callable[[bytes], object]  # set in __init__ (the framer's write)

        def save(self, obj: Any, save_persistent_id: bool = True) -> None: ...

        def memoize(self, obj: Any) -> None: ...

else:
    _PurePickler = pickle._Pickler


def _save_call(self: _PurePickler, obj: _Call) -> None:
    """Pickle a :class:`_Call` as ``func(*args)`` (REDUCE): the dispatch entry of both picklers below."""
    self.save(obj.func)
    self.save(obj.args)
    self.write(pickle.REDUCE)
    self.memoize(obj)


class _MetadataPickler(_PurePickler):
    """Pure-Python pickler that writes :class:`_Global`/:class:`_New`/:class:`_Call` as torch objects."""

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_global_ref(self, obj: _Global) -> None:
        self.save(obj.module)
        self.save(obj.name)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)

    def _save_new(self, obj: _New) -> None:
        self.save(obj.cls)
        self.save(())
        self.write(pickle.NEWOBJ)
        self.memoize(obj)
        if obj.state is not None:
            self.save(obj.state)
            self.write(pickle.BUILD)

    dispatch[_Global] = _save_global_ref  # type: ignore[assignment]  # typeshed: receiver typed as Unpickler
    dispatch[_New] = _save_new  # type: ignore[assignment]  # typeshed: receiver typed as Unpickler
    dispatch[_Call] = _save_call  # type: ignore[assignment]  # typeshed: receiver typed as Unpickler


class _ArchiveWindow(io.RawIOBase):
    """The output file seen from the start of one archive (zip offsets relative to it)."""

    def __init__(self, f: BinaryIO) -> None:
        super().__init__()
        self._f, self._base = f, f.tell()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return self._f.write(b)

    def tell(self) -> int:
        return self._f.tell() - self._base

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 0:
            return self._f.seek(self._base + pos) - self._base
        return self._f.seek(pos, whence) - self._base

    def flush(self) -> None:
        self._f.flush()


# dtype name -> typed storage class that torch.save names in data.pkl (``_rebuild_tensor_v2``). Newer dtypes
# (float8, uint16/32/64) are saved as ``_rebuild_tensor_v3`` + ``UntypedStorage`` sized in bytes, with the
# dtype as the last argument (:data:`_V3_DTYPES`; torch 2.6-2.15 write both the same way).
_V2_DTYPES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "complex128",
    "complex64",
)
_STORAGE_CLASS = {v: k for k, v in STORAGE_DTYPES.items() if v in _V2_DTYPES}
#: dtypes torch.save writes as ``_rebuild_tensor_v3(UntypedStorage, ..., torch.<dtype>)`` (a safetensors
#: file can hold each of them: an import copies them as stored).
_V3_DTYPES = frozenset((*FLOAT8_DTYPES, "uint16", "uint32", "uint64"))


def can_stream(dtype: DType) -> bool:
    """Whether :func:`write_tensor_archive` writes archives of this dtype (torch's v2 or v3 tensor encoding)."""
    return dtype.name in _STORAGE_CLASS or dtype.name in _V3_DTYPES


_ALIGN = 64  # torch.serialization: record data aligned to 64 bytes within the archive


class _ProtoTwoPickler(_PurePickler):
    """Protocol-2 pickler for ``data.pkl`` of a tensor archive (GLOBAL opcodes, a persistent storage id)."""

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_global_ref(self, obj: _Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    dispatch[_Global] = _save_global_ref  # type: ignore[assignment]  # typeshed: receiver typed as Unpickler
    dispatch[_Call] = _save_call  # type: ignore[assignment]  # typeshed: receiver typed as Unpickler

    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, _Pid) else None


class _Pid:
    __slots__ = ("pid",)

    def __init__(self, pid: tuple[Any, ...]) -> None:
        self.pid = pid


@functools.lru_cache(maxsize=1024)  # one pure-Python pickle per (dtype, shape): layers repeat their shapes
def tensor_data_pkl(dtype: DType, sizes: tuple[int, ...]) -> bytes:
    """``data.pkl`` that ``torch.save`` writes for a contiguous CPU tensor with its own storage.

    ``torch._utils._rebuild_tensor_v2(storage, 0, size, stride, False, OrderedDict())`` with
    storage persistent id ``('storage', torch.<Type>Storage, '0', 'cpu', numel)``
    (``torch/serialization.py`` ``_save.persistent_id``); for the dtypes of :data:`_V3_DTYPES`
    ``_rebuild_tensor_v3(storage, 0, size, stride, False, OrderedDict(), torch.<dtype>)`` with
    ``('storage', torch.storage.UntypedStorage, '0', 'cpu', nbytes)``.

    Raises:
        KeyError: a dtype torch.save writes neither way (check :func:`can_stream` first).
    """
    numel = 1
    for s in sizes:
        numel *= s
    stride, acc = [], 1
    for s in reversed(sizes):
        stride.append(acc)
        acc *= max(s, 1)
    v3 = dtype.name in _V3_DTYPES
    if v3:
        storage = _Pid(("storage", _global("torch.storage", "UntypedStorage"), "0", "cpu", numel * dtype.itemsize))
    else:
        storage = _Pid(("storage", _global("torch", _STORAGE_CLASS[dtype.name]), "0", "cpu", numel))
    args: tuple[Any, ...] = (
        storage,
        0,
        tuple(sizes),
        tuple(reversed(stride)),
        False,
        _Call(_global("collections", "OrderedDict"), ()),
    )
    if v3:
        args += (_global("torch", dtype.name),)
    rebuild = _Call(_global("torch._utils", "_rebuild_tensor_v3" if v3 else "_rebuild_tensor_v2"), args)
    buf = io.BytesIO()
    _ProtoTwoPickler(buf, protocol=2).dump(rebuild)
    return buf.getvalue()


def _aligned_info(zf: zipfile.ZipFile, name: str, size: int) -> zipfile.ZipInfo:
    """A stored ZipInfo whose data starts on a 64-byte boundary of the archive (torch's alignment)."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = size
    zip64 = size > zipfile.ZIP64_LIMIT
    offset = zf.fp.tell() if zf.fp is not None else 0
    data_at = offset + 30 + len(name.encode()) + (20 if zip64 else 0)
    pad = (-(data_at + 4)) % _ALIGN  # a padding extra field has a 4-byte header ("FB" + length)
    info.extra = b"FB" + pad.to_bytes(2, "little") + b"Z" * pad
    return info


def _stream_record(
    zf: zipfile.ZipFile, window: _ArchiveWindow, f: BinaryIO, info: zipfile.ZipInfo, source: _RecordSource
) -> None:
    """Write the stored record ``info`` whose data is the concatenation of ``source.segments``, by ``pread`` /
    ``pwrite`` (:func:`_record_at`).

    ``zipfile``'s own record writer (``ZipFile.open(info, "w")``) costs two extra passes over
    the data: zlib's CRC-32 and a copy through the buffered file object. Here the local header
    is written last, with the CRC, and the record is entered in the archive's central directory
    as ``zipfile``'s writer enters it (``filelist``, ``NameToInfo``, ``start_dir``: the fields
    ``_ZipWriteFile.close`` sets, CPython 3.10-3.13; mode ``"w"`` writes the central directory on
    close). Local header as ``ZipInfo.FileHeader`` writes it (zip64 extra field when the data is
    over 4 GiB), so the archive is the one ``zipfile`` would have written.

    Raises:
        OSError: a short read (the source file changed under us) or a failed write.
    """
    nbytes = info.file_size
    zip64 = nbytes > zipfile.ZIP64_LIMIT
    info.compress_size = nbytes
    info.CRC = 0
    info.flag_bits = 0
    if not info.external_attr:
        info.external_attr = 0o600 << 16  # what ZipFile.open(..., "w") sets: ?rw-------
    f.flush()
    header_at = window.tell()
    info.header_offset = header_at
    header_len = len(info.FileHeader(zip64))
    base = f.tell() - header_at  # the archive's start in the output file

    def header(crc: int) -> bytes:
        info.CRC = crc
        out = info.FileHeader(zip64)
        assert len(out) == header_len
        return out

    _record_at(f, base + header_at, base + header_at + header_len, header, source)
    zf.filelist.append(info)
    zf.NameToInfo[info.filename] = info
    zf.start_dir = window.tell()


class _RecordSource(NamedTuple):
    """Where a storage record's bytes come from and how they are written (:func:`write_tensor_archive`'s arguments)."""

    segments: list[tuple[int, int, int]]
    buf: memoryview
    sink: Callable[[memoryview], object] | None
    behind: bool


def _record_at(f: BinaryIO, header_at: int, data_at: int, header: Callable[[int], bytes], source: _RecordSource) -> int:
    """Copy a record's data to ``data_at`` of the output (:func:`_copy_record`: each buffer-full read from the
    source, its CRC-32 folded in while in the CPU cache, written by ``pwrite`` at its place), then its local header
    ``header(crc)`` at ``header_at``; leave ``f`` at the record's end. Returns the CRC-32.

    Raises:
        OSError: a short read (the source file changed under us) or a failed write.
    """
    f.flush()
    try:
        fd: int | None = f.fileno()
    except (OSError, io.UnsupportedOperation):  # an in-memory file: plain writes at the same places
        fd = None
    try:
        crc = _copy_record(f, fd, data_at, source.segments, source.buf, source.sink, source.behind)
    except ShortReadError as e:
        raise OSError(f"short read at offset {e.offset}") from None
    if fd is None:
        f.seek(header_at)
        f.write(header(crc))
    else:
        write_all(fd, header(crc), header_at)
    f.seek(data_at + sum(n for _, _, n in source.segments))
    return crc


def _copy_record(
    f: BinaryIO,
    fd: int | None,
    pos: int,
    segments: list[tuple[int, int, int]],
    buf: memoryview,
    sink: Callable[[memoryview], object] | None,
    behind: bool,
) -> int:
    """Copy the concatenation of ``segments`` to ``pos`` of the output (``fd``, or ``f`` in memory); its CRC-32.

    Without a ``sink``, a record of :data:`_SPLIT_BYTES` or more is copied by two threads, one
    half each (:func:`~ckpttool.engine.execute.run_split`: reads, ``pwrite`` and ISA-L's
    CRC-32 release the GIL, so the halves' page-cache copies run on two cores; the record's
    CRC-32 is the halves' combined); ``behind`` starts the write-back of every
    :data:`WRITEBACK_BYTES` written (:func:`~ckpttool.engine.io.start_writeback`).

    Raises:
        ShortReadError: a source ends early; OSError: a failed write.
    """
    reads = tuple(Window(*s) for s in segments)
    if fd is None:  # an in-memory file: written in order at the same places

        def put(piece: memoryview) -> None:
            f.write(piece)

        f.seek(pos)
        feeds = (Feed(sink),) if sink is not None else ()
        return int(run_item(Item(reads, (Crc32(), *feeds, Feed(put))), buf=buf)[0])
    if sink is not None:
        return int(run_item(Item(reads, (Crc32(), Feed(sink), WriteAt(fd, pos))), buf=buf)[0])
    item = Item(reads, (Crc32(), WriteAt(fd, pos, WRITEBACK_BYTES if behind else 0)))
    nbytes = item.length
    if nbytes >= _SPLIT_BYTES and can_split(item):
        mid = (nbytes // 2) & ~(BLOCK_BYTES - 1) or nbytes // 2
        return int(run_split(item, mid, buf=buf)[0])
    return int(run_item(item, buf=buf)[0])


#: With ``fsync``, write-back of every this many bytes written is started at once (:func:`~ckpttool.engine.io.start_writeback`).
WRITEBACK_BYTES = 8 << 20
#: A record of at least this many bytes is copied by two threads, one half each (:func:`_copy_record`).
_SPLIT_BYTES = 8 << 20


def write_tensor_archive(
    f: BinaryIO,
    dtype: DType,
    sizes: tuple[int, ...],
    segments: list[tuple[int, int, int]],
    buf: memoryview,
    *,
    sink: Callable[[memoryview], object] | None = None,
    behind: bool = False,
) -> int:
    """Append a ``torch.save`` archive of a tensor whose storage bytes are read from ``segments``.

    Members and order as ``torch.save`` writes them; records 64-byte aligned; CRC-32 computed
    while streaming. ``torch.load`` (``weights_only=True`` too) and ckpttool's reader read it.
    The bytes are those :mod:`zipfile` writes (:func:`_write_archive_zipfile`); an archive whose
    record needs no zip64 field is assembled directly (:func:`_write_archive_direct`: one write
    before the record and one after, instead of ``zipfile``'s per-member headers, seeks and
    rewrites, most of an import's time at 10^5 small tensors).

    Args:
        f: output file, positioned where the archive starts.
        dtype, sizes: the tensor.
        segments: ``(fd, offset, length)`` read in order (:mod:`ckpttool.engine.io`).
        buf: a reusable read buffer.
        sink: called with the storage record's bytes, in order, as they are written (a digest's ``update``).
        behind: start the disk write-back of the record as it is written (:func:`~ckpttool.engine.io.start_writeback`;
            for a writer that ``fsync`` s the file afterwards).

    Returns:
        The CRC-32 of the storage record (as its zip entry holds it).

    Raises:
        OSError: a short read (the source file changed under us).
    """
    nbytes = sum(n for _, _, n in segments)
    members = _archive_members(dtype, sizes, str(uuid.uuid4().int).zfill(40)[:40].encode())
    source = _RecordSource(segments, buf, sink, behind)
    if nbytes < _DIRECT_LIMIT < zipfile.ZIP64_LIMIT:  # no member, offset or size needs a zip64 field
        return _write_archive_direct(f, members, nbytes, source)
    return _write_archive_zipfile(f, members, nbytes, source)


#: The small members of a tensor's ``torch.save`` archive before and after its storage record ``data/0``.
_Members = tuple[list[tuple[str, bytes]], list[tuple[str, bytes]]]


def _archive_members(dtype: DType, sizes: tuple[int, ...], serialization_id: bytes) -> _Members:
    """The members ``torch.save`` writes around the storage record (``torch/serialization.py`` ``_save``), in order."""
    before = [
        ("archive/data.pkl", tensor_data_pkl(dtype, tuple(sizes))),
        ("archive/.format_version", b"1"),
        ("archive/.storage_alignment", str(_ALIGN).encode()),
        ("archive/byteorder", b"little"),
    ]
    return before, [("archive/version", b"3\n"), ("archive/.data/serialization_id", serialization_id)]


def _write_archive_zipfile(f: BinaryIO, members: _Members, nbytes: int, source: _RecordSource) -> int:
    """:func:`write_tensor_archive` through :mod:`zipfile` (the record streamed by :func:`_stream_record`); its CRC-32."""
    window = _ArchiveWindow(f)
    with zipfile.ZipFile(window, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, data in members[0]:
            zf.writestr(_aligned_info(zf, name, len(data)), data)
        info = _aligned_info(zf, "archive/data/0", nbytes)
        _stream_record(zf, window, f, info, source)
        for name, data in members[1]:
            zf.writestr(_aligned_info(zf, name, len(data)), data)
    return int(info.CRC)


#: A record below this size needs no zip64 field (``zipfile`` adds one from ``ZIP64_LIMIT``; a member from
#: ``ZIP64_LIMIT / 1.05``): :func:`_write_archive_direct` writes it.
_DIRECT_LIMIT = 1 << 30
_DOS_DATE = 1 << 5 | 1  # 1980-01-01, as ZipInfo(date_time=(1980, 1, 1, 0, 0, 0)) packs it; time 00:00:00 is 0
_MODE = 0o600 << 16  # the external attributes ZipFile.open(..., "w") gives a member: ?rw-------


def _padding(offset: int, name: bytes) -> bytes:
    """The extra field that starts a stored member's data on a 64-byte boundary (:func:`_aligned_info`'s)."""
    pad = (-(offset + 30 + len(name) + 4)) % _ALIGN
    return b"FB" + pad.to_bytes(2, "little") + b"Z" * pad


def _local_header(name: bytes, extra: bytes, crc: int, size: int) -> bytes:
    """A stored member's local header as ``ZipInfo.FileHeader`` packs it (version 2.0, no flags, no zip64)."""
    fixed = struct.pack(
        "<4s2B4HL2L2H", b"PK\003\004", 20, 0, 0, 0, 0, _DOS_DATE, crc, size, size, len(name), len(extra)
    )
    return fixed + name + extra


def _central_record(name: bytes, extra: bytes, crc: int, size: int, offset: int) -> bytes:
    """A stored member's central directory record as ``ZipFile._write_end_record`` packs it (system 3: Unix)."""
    fixed = struct.pack(
        "<4s4B4HL2L5H2L", b"PK\001\002", 20, 3, 20, 0, 0, 0, 0, _DOS_DATE, crc, size, size, len(name), len(extra),
        0, 0, 0, _MODE, offset,
    )  # fmt: skip
    return fixed + name + extra


def _write_archive_direct(f: BinaryIO, members: _Members, nbytes: int, source: _RecordSource) -> int:
    """:func:`write_tensor_archive` of a record below :data:`_DIRECT_LIMIT`, the bytes :func:`_write_archive_zipfile`
    writes: the members before the record and its local header in one write, the record copied by
    :func:`_copy_record` (its CRC-32 folded in as it is written), its header's CRC-32 written in place, then the
    members after it, the central directory and the end record in one write. Returns the record's CRC-32.

    Raises:
        OSError: a short read (the source file changed under us) or a failed write.
    """
    head, central = bytearray(), bytearray()

    def add(out: bytearray, name: str, data: bytes, at: int) -> None:
        raw = name.encode()
        extra = _padding(at, raw)
        crc = zlib.crc32(data)
        out += _local_header(raw, extra, crc, len(data))
        out += data
        central.extend(_central_record(raw, extra, crc, len(data), at))

    for name, data in members[0]:
        add(head, name, data, len(head))
    record_at, raw = len(head), b"archive/data/0"
    extra = _padding(record_at, raw)
    head += _local_header(raw, extra, 0, nbytes)  # its CRC-32 once the record is copied
    base = f.tell()
    f.write(head)
    crc = _record_at(f, base + record_at, base + len(head), lambda c: _local_header(raw, extra, c, nbytes), source)
    central += _central_record(raw, extra, crc, nbytes, record_at)
    tail = bytearray()
    at = len(head) + nbytes
    for name, data in members[1]:
        add(tail, name, data, at + len(tail))
    count = len(members[0]) + 1 + len(members[1])
    end = struct.pack("<4s4H2LH", b"PK\005\006", 0, 0, count, count, len(central), at + len(tail), 0)
    f.write(bytes(tail + central) + end)
    f.flush()  # as ZipFile.close: the next archive's record is written by position
    return crc


def torch_save_bytes(obj: Any) -> bytes:
    """``torch.save(obj)`` bytes for a plain Python value (str, numbers, lists, dicts), without torch.

    The archive has the members ``torch.save`` writes (``torch/serialization.py``,
    ``_save``: ``data.pkl`` as a protocol-2 pickle, ``.format_version``,
    ``.storage_alignment``, ``byteorder``, ``version``, ``.data/serialization_id``), stored
    uncompressed; ``torch.load`` (also with ``weights_only=True``) reads it.

    Raises:
        TypeError: ``obj`` holds something other than plain values.
    """

    def check(v: Any) -> None:
        if isinstance(v, (list, tuple)):
            for x in v:
                check(x)
        elif isinstance(v, dict):
            for k, x in v.items():
                check(k)
                check(x)
        elif not (v is None or isinstance(v, (str, int, float, bool))):
            raise TypeError(f"not a plain value: {type(v).__name__}")

    check(obj)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps(obj, protocol=2))
        z.writestr("archive/.format_version", b"1")
        z.writestr("archive/.storage_alignment", b"64")
        z.writestr("archive/byteorder", b"little")
        z.writestr("archive/version", b"3\n")
        z.writestr("archive/.data/serialization_id", str(uuid.uuid4().int).zfill(40)[:40].encode())
    return buf.getvalue()
