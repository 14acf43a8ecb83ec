"""The chunk locator: where a tensor chunk's raw bytes lie, checked against ``.metadata``.

Every DCP tensor chunk is a complete ``torch.save`` archive at ``[offset, offset+length)``
of its data file (``torch/distributed/checkpoint/filesystem.py``, ``_write_item``): an
uncompressed zip holding ``data.pkl`` and one raw storage record ``data/<key>``.
:func:`locate_chunk` is the only place in ckpttool that checks such an archive against
the metadata; the reader, export's verbatim copy, reshard and ``validate --deep`` all read
a chunk's bytes through the :class:`ChunkLocation` it returns. It checks, in order:

1. the key is a tensor entry and the chunk has a ``storage_data`` entry;
2. the data file is inside the checkpoint directory, exists, and holds the whole window;
3. the archive parses with the restricted tensor unpickler (``data.pkl`` may name only
   ``torch._utils._rebuild_tensor_v2`` and typed storages);
4. its dtype and shape equal the metadata's;
5. the raw storage record (``storage_numel * itemsize`` bytes after its local header) lies
   inside the window.

A checkpoint written by ``HuggingFaceStorageWriter`` (``CheckpointMetadata.serialization ==
"safetensors"``, :mod:`ckpttool.format.hf_storage`) stores each chunk as raw bytes: its
window (from the file's size-checked safetensors header) must hold exactly
``numel * itemsize`` bytes, and is then the chunk's record, in C order.

An archive the fast path does not map (a stream transform such as zstd, torch's newer
``_rebuild_tensor_v3`` encoding, a compressed or big-endian record) gives a location
without a record; callers then let ``torch.load(weights_only=True)`` decode it.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckpttool.errors import ChunkError, UnsafePickleError, UsageError
from ckpttool.format.archive import FileWindow, TensorRecord, parse_tensor_archive
from ckpttool.format.metadata import ChunkMeta, StorageInfo, TensorMeta
from ckpttool.format.tiling import row_major_stride

if TYPE_CHECKING:
    from ckpttool.format.directory import CheckpointDir

__all__ = ["ChunkLocation", "locate_chunk", "tensor_meta"]


@dataclass(frozen=True)
class ChunkLocation:
    """A validated chunk: its storage window and, when mapped, its raw storage record.

    Attributes:
        key: the tensor's checkpoint key.
        chunk: the chunk (``offsets``, ``sizes``).
        meta: the tensor entry (dtype, global size).
        info: the storage entry, bounds-checked against its data file.
        record: the parsed archive (``None``: decode it with ``torch.load``).
        file: the data file as named to the user (checkpoint path / ``relative_path``).
    """

    key: str
    chunk: ChunkMeta
    meta: TensorMeta
    info: StorageInfo
    record: TensorRecord | None
    file: Path

    @property
    def nbytes(self) -> int:
        """Bytes of the chunk's values (``numel * itemsize``)."""
        return self.chunk.numel * self.meta.dtype.itemsize

    @property
    def raw(self) -> bool:
        """The record holds exactly the chunk's values in C order: they can be copied as bytes."""
        r = self.record
        return (
            r is not None
            and r.storage_offset == 0
            and r.storage_numel == self.chunk.numel
            and r.stride == row_major_stride(r.size)
        )

    @property
    def data_start(self) -> int:
        """Absolute offset in the data file of the raw storage record's first byte.

        Raises:
            AssertionError: the location has no record.
        """
        assert self.record is not None
        return self.info.offset + self.record.data_offset

    @property
    def where(self) -> str:
        """``'<file>: '<key>' chunk at <offsets>'`` for messages."""
        return f"{self.file}: {self.key!r} chunk at {self.chunk.offsets}"


def tensor_meta(ckpt: CheckpointDir, key: str) -> TensorMeta:
    """The tensor entry of ``key``.

    Raises:
        UsageError: ``key`` is not a tensor entry of the checkpoint.
    """
    meta = ckpt.metadata.entries.get(key)
    if not isinstance(meta, TensorMeta):
        raise UsageError(f"{ckpt.path}: {key!r} is not a tensor entry of the checkpoint", fqn=key)
    return meta


def _raw_record(key: str, meta: TensorMeta, chunk: ChunkMeta, info: StorageInfo, where: str) -> TensorRecord:
    """The record of a safetensors-stored chunk: its whole window, C order.

    Raises:
        ChunkError: the window does not hold exactly the chunk's bytes.
    """
    need = chunk.numel * meta.dtype.itemsize
    if info.length != need:
        raise ChunkError(
            f"{where}: stored window is {info.length} bytes, {meta.dtype}{list(chunk.sizes)} needs {need}",
            path=info.relative_path,
            fqn=key,
        )
    return TensorRecord(meta.dtype.name, chunk.sizes, row_major_stride(chunk.sizes), 0, chunk.numel, 0)


def locate_chunk(ckpt: CheckpointDir, key: str, chunk: ChunkMeta) -> ChunkLocation:
    """Locate and check one stored chunk of tensor ``key`` (see the module docstring).

    Args:
        ckpt: the opened checkpoint directory.
        key: flattened checkpoint key (``model.model.layers.0.mlp.down_proj.weight``).
        chunk: one of the entry's chunks.

    Returns:
        The :class:`ChunkLocation`.

    Raises:
        UsageError: ``key`` is not a tensor entry.
        MetadataError: the chunk has no storage entry.
        PathEscapeError, DataFileError: the data file escapes, is missing, or is too short.
        ChunkError: the archive is corrupt, unsafe, disagrees with the metadata (dtype,
            shape), or its storage record reaches past the chunk's window.
    """
    meta = tensor_meta(ckpt, key)
    info = ckpt.storage_info(key, chunk)
    file = ckpt.path / info.relative_path
    if info.transform_descriptors:
        return ChunkLocation(key, chunk, meta, info, None, file)
    where = f"{file}: {key!r} chunk at {chunk.offsets}"
    if ckpt.metadata.serialization == "safetensors":
        return ChunkLocation(key, chunk, meta, info, _raw_record(key, meta, chunk, info, where), file)
    try:
        record = parse_tensor_archive(FileWindow(ckpt.fd(info.relative_path), info.offset, info.length))
    except UnsafePickleError as e:
        raise ChunkError(f"{where}: {e.message}", path=info.relative_path, fqn=key) from e
    except (zipfile.BadZipFile, KeyError, ValueError, OSError, EOFError) as e:
        raise ChunkError(
            f"{where}: stored archive is corrupt ({type(e).__name__}: {str(e)[:80]})",
            path=info.relative_path,
            fqn=key,
        ) from e
    if record is None:
        return ChunkLocation(key, chunk, meta, info, None, file)
    if record.dtype != meta.dtype.name or record.size != chunk.sizes:
        raise ChunkError(
            f"{where}: stored tensor is {record.dtype}{list(record.size)}, metadata says "
            f"{meta.dtype}{list(chunk.sizes)}",
            path=info.relative_path,
            fqn=key,
        )
    if record.data_offset < 0 or record.data_offset + record.storage_numel * meta.dtype.itemsize > info.length:
        raise ChunkError(f"{where}: storage record reaches past the archive", path=info.relative_path, fqn=key)
    return ChunkLocation(key, chunk, meta, info, record, file)
