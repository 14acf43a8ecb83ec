"""Write a DCP checkpoint directory that plain ``torch.distributed.checkpoint.load`` reads.

The format is the one torch's ``FileSystemWriter`` produces (``torch/distributed/
checkpoint/filesystem.py``, torch 2.6-2.13): data files ``__{rank}_0.distcp`` in which
every tensor chunk and byte item is a complete ``torch.save`` archive at
``[offset, offset+length)``, and ``.metadata``, a pickled
``torch.distributed.checkpoint.metadata.Metadata`` whose ``storage_data`` maps
``MetadataIndex(fqn, offsets)`` to ``_StorageInfo(relative_path, offset, length)``.

:class:`DCPWriter` appends items to one file per rank. A chunk that already exists
as an archive in a source checkpoint is copied verbatim (``os.copy_file_range``,
no decode: bitwise the same archive); a new chunk is written with ``torch.save``.
It writes into a directory the caller owns (an :class:`~ckpttool.output.AtomicOutputDir`
temporary directory), so a failed run leaves nothing that looks complete.
"""

from __future__ import annotations

import os
import pickle
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from ..dcp.model import ChunkMeta, DType, StorageInfo
from ..errors import OutputError

if TYPE_CHECKING:
    import torch

__all__ = ["DCPWriter", "WrittenItem", "DCP_VERSION"]

DCP_VERSION = "1.0.0"  # torch/distributed/checkpoint/filesystem.py CURRENT_DCP_VERSION
_COPY_STEP = 1 << 30


@dataclass
class WrittenItem:
    """What :meth:`DCPWriter.finish` records for one key."""

    dtype: DType | None  # None: byte item
    size: tuple[int, ...] = ()
    chunks: list[tuple[ChunkMeta, StorageInfo]] = field(default_factory=list)
    byte_info: StorageInfo | None = None


class DCPWriter:
    """Append tensor chunks and byte items to per-rank data files, then write ``.metadata``.

    Args:
        directory: an existing, empty directory (the temporary output directory).
        checkpoint_id: the final path recorded in ``storage_meta.checkpoint_id``.

    Not thread-safe; files are written sequentially, one per rank.
    """

    def __init__(self, directory: Path, checkpoint_id: Path) -> None:
        self.directory = Path(directory)
        self.checkpoint_id = Path(checkpoint_id)
        self._files: dict[int, BinaryIO] = {}
        self._items: dict[str, WrittenItem] = {}
        self._planner: dict[str, tuple[Any, ...]] = {}
        self.bytes_written = 0
        self.bytes_copied = 0

    # ------------------------------------------------------------------ files
    @staticmethod
    def file_name(rank: int) -> str:
        return f"__{rank}_0.distcp"

    def _file(self, rank: int) -> BinaryIO:
        f = self._files.get(rank)
        if f is None:
            path = self.directory / self.file_name(rank)
            try:
                f = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in close()
            except OSError as e:
                raise OutputError(f"{path}: cannot create ({e.strerror})", path=path) from e
            self._files[rank] = f
        return f

    def ensure_files(self, ranks: range) -> None:
        """Create (possibly empty) data files for ``ranks`` so every target rank has one."""
        for r in ranks:
            self._file(r)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> DCPWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ items
    def declare_tensor(self, key: str, dtype: DType, size: tuple[int, ...], planner_path: tuple[Any, ...] | None) -> None:
        """Announce a tensor entry (global ``size``, ``dtype``) before adding its chunks."""
        self._items[key] = WrittenItem(dtype, tuple(size))
        if planner_path is not None:
            self._planner[key] = tuple(planner_path)

    def _record_chunk(self, key: str, chunk: ChunkMeta, rank: int, offset: int, length: int,
                      transforms: tuple[str, ...] = ()) -> None:
        info = StorageInfo(self.file_name(rank), offset, length, transforms)
        self._items[key].chunks.append((chunk, info))

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
        self.bytes_written += end - start
        self._record_chunk(key, chunk, rank, start, end - start)

    def copy_archive(self, key: str, chunk: ChunkMeta | None, rank: int, src_fd: int, info: StorageInfo) -> None:
        """Copy a stored archive (tensor chunk or byte item) verbatim from a source data file.

        Args:
            key: checkpoint key.
            chunk: the chunk (``None`` for a byte item).
            rank: target rank (output file).
            src_fd: an open descriptor of the source data file.
            info: the source storage info (``offset``/``length``; transforms are kept).
        """
        f = self._file(rank)
        start = f.tell()
        _copy_range(src_fd, f.fileno(), info.offset, info.length)
        f.seek(start + info.length)
        self.bytes_written += info.length
        self.bytes_copied += info.length
        if chunk is None:
            self._items[key].byte_info = StorageInfo(self.file_name(rank), start, info.length, info.transform_descriptors)
        else:
            self._record_chunk(key, chunk, rank, start, info.length, info.transform_descriptors)

    def copy_bytes_item(self, key: str, rank: int, src_fd: int, info: StorageInfo,
                        planner_path: tuple[Any, ...] | None) -> None:
        """Copy a byte item verbatim from the source checkpoint."""
        self._items[key] = WrittenItem(None)
        if planner_path is not None:
            self._planner[key] = tuple(planner_path)
        self.copy_archive(key, None, rank, src_fd, info)

    def write_object(self, key: str, rank: int, obj: Any, planner_path: tuple[Any, ...] | None) -> None:
        """Write a Python object as a byte item (``torch.save`` of the object, as DCP does)."""
        import torch

        self._items[key] = WrittenItem(None)
        if planner_path is not None:
            self._planner[key] = tuple(planner_path)
        f = self._file(rank)
        start = f.tell()
        torch.save(obj, f)
        end = f.tell()
        self.bytes_written += end - start
        self._items[key].byte_info = StorageInfo(self.file_name(rank), start, end - start)

    # ------------------------------------------------------------------ metadata
    def finish(self) -> None:
        """Flush the data files and write ``.metadata`` (torch's own dataclasses, pickled).

        Raises:
            OutputError: a write failed.
        """
        import torch
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            Metadata,
            MetadataIndex,
            StorageMeta,
            TensorProperties,
            TensorStorageMetadata,
        )

        for f in self._files.values():
            os.fsync(f.fileno())
        self.close()
        sd_md: dict[str, Any] = {}
        storage: dict[Any, Any] = {}
        for key, item in self._items.items():
            if item.dtype is None:
                assert item.byte_info is not None, key
                sd_md[key] = BytesStorageMetadata()
                b = item.byte_info
                storage[MetadataIndex(key)] = _StorageInfo(
                    b.relative_path, b.offset, b.length, list(b.transform_descriptors) or None
                )
                continue
            chunks = []
            for i, (c, info) in enumerate(item.chunks):
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)))
                storage[MetadataIndex(key, torch.Size(c.offsets), i)] = _StorageInfo(
                    info.relative_path, info.offset, info.length, list(info.transform_descriptors) or None
                )
            sd_md[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=item.dtype.to_torch()), size=torch.Size(item.size), chunks=chunks
            )
        md = Metadata(
            state_dict_metadata=sd_md,
            planner_data=dict(self._planner),
            storage_data=storage,
            storage_meta=StorageMeta(checkpoint_id=self.checkpoint_id, save_id=uuid.uuid4().hex),
            version=DCP_VERSION,
        )
        path = self.directory / ".metadata"
        try:
            with open(path, "wb") as f:
                pickle.dump(md, f)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise OutputError(f"{path}: cannot write ({e.strerror})", path=path) from e


def _copy_range(src_fd: int, dst_fd: int, offset: int, length: int) -> None:
    """Copy ``length`` bytes at ``offset`` of ``src_fd`` to the current position of ``dst_fd``."""
    done = 0
    use_cfr = hasattr(os, "copy_file_range")
    while done < length:
        n = min(_COPY_STEP, length - done)
        got = 0
        if use_cfr:
            try:
                got = os.copy_file_range(src_fd, dst_fd, n, offset + done)
            except OSError:
                use_cfr = False  # cross-device on old kernels, special files: plain copy below
                got = 0
        if got <= 0:
            data = os.pread(src_fd, n, offset + done)
            if not data:
                raise OSError(f"short read at offset {offset + done}")
            view = memoryview(data)
            while view:
                view = view[os.write(dst_fd, view):]
            got = len(data)
        done += got
